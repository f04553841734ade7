//! `berth-identity`: the identity service binary.

use std::process::ExitCode;

fn main() -> ExitCode {
    berth_identity::cli::main()
}
