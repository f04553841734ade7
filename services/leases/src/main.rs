//! `berth-leases`: the leases service binary.

use std::process::ExitCode;

fn main() -> ExitCode {
    berth_runtime::service_main(
        "berth-leases",
        "The berth leases service: the capacity ledger, placement and the lease lifecycle.",
        "0.0.0.0:7445",
        berth_leases::SPEC,
    )
}
