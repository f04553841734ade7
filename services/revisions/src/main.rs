//! `berth-revisions`: the revisions service binary.

use std::process::ExitCode;

fn main() -> ExitCode {
    berth_runtime::service_main(
        "berth-revisions",
        "The berth revisions service: services, their immutable revisions, rollout and rollback.",
        "0.0.0.0:7444",
        berth_revisions::SPEC,
    )
}
