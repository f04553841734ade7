//! One reconcile pass against the leases service: take what the node found
//! running into custody, then compare everything the node holds with the
//! open leases placed on it. The runner runs one at start (`Recover`),
//! after every rejoin, and every sweep interval (`Sweep`).
//!
//! # Expected flow
//! 1. `AssumeCustody` for every workload in `plan.custody` (found running
//!    after a restart, or held through a fence) at the epoch it was started
//!    at. The leases service moves an open (or just expired) lease to the
//!    next epoch and hands it back RUNNING; the new epoch is written to the
//!    instance record before anything uses it, so a crash right after still
//!    names the lease at the epoch the service holds. A refusal means the
//!    workload is no one's: it is destroyed.
//! 2. `ReconcileNode` with every workload the node has started or is
//!    starting, at the epochs it now holds them. What no open lease covers
//!    is destroyed; RUNNING leases the node did not list were failed by the
//!    service ("NodeLost").
//!
//! Custody comes first because the leases service takes a lease that
//! expired moments ago back into custody, where `ReconcileNode` alone would
//! have the workload destroyed.
//!
//! # Failures
//! A failed call ends the pass early with what it did so far in the report;
//! the runner applies that and runs the pass again after a backoff, asking
//! custody only for what is still without it. A refused custody is not a
//! failure: it is the service's answer about that one workload.

use std::sync::Arc;

use berth_proto::leases::v1::{AssumeCustodyRequest, Lease, LeaseRef, ReconcileNodeRequest};

use crate::leases_client::{NodeLeasesApi, is_transient};
use crate::provider::Provider;

/// What one pass asks about.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct PassPlan {
    /// The node, as its current session names it.
    pub(crate) node_id: String,
    /// Workloads found running, at the epoch they were started at, to take
    /// into custody.
    pub(crate) custody: Vec<LeaseRef>,
    /// Every workload the node has started or is starting, at the epoch it
    /// holds it.
    pub(crate) listed: Vec<LeaseRef>,
}

/// What one pass found.
#[derive(Debug, Default)]
pub(crate) struct PassReport {
    /// Leases taken into custody, at their new epochs.
    pub(crate) assumed: Vec<Lease>,
    /// Workloads custody was refused for, with the service's reason: to be
    /// destroyed.
    pub(crate) refused: Vec<(LeaseRef, String)>,
    /// Workloads no open lease covers: to be destroyed.
    pub(crate) destroy: Vec<LeaseRef>,
    /// Leases the service failed because the node did not list them.
    pub(crate) failed: Vec<LeaseRef>,
    /// The transient failure that ended the pass early, if one did.
    pub(crate) error: Option<tonic::Status>,
}

/// Runs one pass; see the module docs.
pub(crate) async fn run_pass(leases: &dyn NodeLeasesApi, provider: &Arc<dyn Provider>, plan: PassPlan) -> PassReport {
    let PassPlan { node_id, custody, mut listed } = plan;
    let mut report = PassReport::default();
    for held in custody {
        let request =
            AssumeCustodyRequest { node_id: node_id.clone(), lease_id: held.lease_id.clone(), epoch: held.epoch };
        match leases.assume_custody(request).await {
            Ok(lease) => {
                if let Err(error) = provider.set_epoch(&lease.lease_id, lease.epoch).await {
                    tracing::warn!(lease_id = %lease.lease_id, %error, "cannot record the lease's new epoch");
                }
                tracing::info!(lease_id = %lease.lease_id, from = held.epoch, to = lease.epoch, "took the lease into custody");
                for entry in listed.iter_mut().filter(|l| l.lease_id == lease.lease_id) {
                    entry.epoch = lease.epoch;
                }
                report.assumed.push(lease);
            }
            Err(status) if is_transient(&status) => {
                report.error = Some(status);
                return report;
            }
            Err(status) => {
                tracing::warn!(lease_id = %held.lease_id, epoch = held.epoch, error = %status.message(),
                    "custody refused; the workload will be destroyed");
                listed.retain(|l| l.lease_id != held.lease_id);
                report.refused.push((held, status.message().to_string()));
            }
        }
    }
    match leases.reconcile_node(ReconcileNodeRequest { node_id, running: listed }).await {
        Ok(response) => {
            report.destroy = response.destroy;
            report.failed = response.failed;
        }
        Err(status) => report.error = Some(status),
    }
    report
}
