//! `berth-egress`: the egress service binary.

use std::process::ExitCode;

fn main() -> ExitCode {
    berth_egress::binary_main()
}
