//! `berth-revisions`: the revisions service binary.

use std::process::ExitCode;

fn main() -> ExitCode {
    berth_revisions::binary_main()
}
