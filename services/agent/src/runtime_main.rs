//! `berth-runtime`: the process runtime's monitor and init as an executable
//! of their own, installed beside `berth-agent` (and `berth`).
//!
//! The agent's own executable acts as the runtime too (invoked by this
//! name), but every launch execs the runtime twice, the monitor and then
//! the init, and an exec costs what the loader does to the image: a binary
//! holding only the runtime's code (a quarter of the agent's size) starts
//! in about half the time the whole agent takes (BENCHMARKS.md has the
//! figures). The agent uses this one when it finds it beside itself
//! (`OciRuntime::binary`).

use std::process::ExitCode;

fn main() -> ExitCode {
    ExitCode::from(u8::try_from(berth_agent::runtime_main()).unwrap_or(1))
}
