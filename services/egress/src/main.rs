//! `berth-egress`: the egress service binary.

use std::process::ExitCode;

fn main() -> ExitCode {
    berth_runtime::service_main(
        "berth-egress",
        "The berth egress service: each tenant's egress policy, compiled and pushed to nodes.",
        "0.0.0.0:7446",
        berth_egress::SPEC,
    )
}
