//! `berth-router`: the data-plane router binary.

use std::process::ExitCode;

fn main() -> ExitCode {
    berth_router::binary_main()
}
