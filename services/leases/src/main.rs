//! `berth-leases`: the leases service binary.

use std::process::ExitCode;

fn main() -> ExitCode {
    berth_leases::binary_main()
}
