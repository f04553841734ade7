//! Error injection at the agent's two seams, the leases service and the
//! provider, for the fault suite: faults that no network cut or `kill -9`
//! can make happen on cue.
//!
//! Wired in only with the `fault-injection` feature, which the workspace's
//! test build turns on (the fault suite's crate asks for it) and no
//! release or shipped build does; unset, it breaks nothing. With the feature,
//! `BERTH_AGENT_FAULTS` names what to break, comma-separated:
//!
//! - `custody-reply-lost=N`: the first N `AssumeCustody` calls are made and
//!   committed, and then their reply is lost (the agent sees `UNAVAILABLE`,
//!   as when the connection drops between commit and answer);
//! - `listing-fails=N`: the first N inventories of the provider fail;
//! - `destroy-fails=N`: the first N destroys of every workload fail, then
//!   each lease's next one goes through.
//!
//! Every injected fault is logged with the words `injected fault`, so a
//! test can tell that its fault happened.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use berth_proto::leases::v1::{
    AssumeCustodyRequest, Lease, ReconcileNodeRequest, ReconcileNodeResponse, RenewLeasesRequest, RenewLeasesResponse,
    ReportPhaseRequest, ReportResizeRequest,
};

use crate::leases_client::{AssignmentStream, NodeLeasesApi};
use crate::provider::{LaunchSpec, Launched, Provider, ProviderError, Settlement, wrapping_provider};

/// The variable that names the faults.
pub const FAULTS_ENV: &str = "BERTH_AGENT_FAULTS";

/// What to break, as [`FAULTS_ENV`] says.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Faults {
    custody_replies_lost: u32,
    listings_failing: u32,
    destroys_failing: u32,
}

impl Faults {
    /// The faults `BERTH_AGENT_FAULTS` names; none when it is unset.
    pub(crate) fn from_env() -> Result<Self, String> {
        match std::env::var(FAULTS_ENV) {
            Ok(value) => value.parse(),
            Err(_) => Ok(Self::default()),
        }
    }

    /// Wraps the two seams with what breaks them.
    pub(crate) fn wrap(
        self,
        leases: Arc<dyn NodeLeasesApi>,
        provider: Arc<dyn Provider>,
    ) -> (Arc<dyn NodeLeasesApi>, Arc<dyn Provider>) {
        if self == Self::default() {
            return (leases, provider);
        }
        tracing::warn!(faults = ?self, "this agent injects faults ({FAULTS_ENV})");
        let leases: Arc<dyn NodeLeasesApi> =
            Arc::new(FaultyLeases { inner: leases, custody_replies_lost: AtomicU32::new(self.custody_replies_lost) });
        let provider: Arc<dyn Provider> = Arc::new(FaultyProvider {
            inner: provider,
            listings_failing: AtomicU32::new(self.listings_failing),
            destroys_failing: self.destroys_failing,
            destroys_tried: Mutex::new(HashMap::new()),
        });
        (leases, provider)
    }
}

impl std::str::FromStr for Faults {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut faults = Self::default();
        for item in s.split(',').map(str::trim).filter(|item| !item.is_empty()) {
            let (name, count) =
                item.split_once('=').ok_or_else(|| format!("{FAULTS_ENV}: '{item}' is not NAME=COUNT"))?;
            let count: u32 =
                count.parse().map_err(|_| format!("{FAULTS_ENV}: '{count}' in '{item}' is not a count"))?;
            match name {
                "custody-reply-lost" => faults.custody_replies_lost = count,
                "listing-fails" => faults.listings_failing = count,
                "destroy-fails" => faults.destroys_failing = count,
                other => {
                    return Err(format!(
                        "{FAULTS_ENV}: unknown fault '{other}' (known: custody-reply-lost, listing-fails, destroy-fails)"
                    ));
                }
            }
        }
        Ok(faults)
    }
}

/// Takes one from `counter` if it is above zero; whether it did.
fn take_one(counter: &AtomicU32) -> bool {
    counter.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| left.checked_sub(1)).is_ok()
}

#[derive(Debug)]
struct FaultyLeases {
    inner: Arc<dyn NodeLeasesApi>,
    custody_replies_lost: AtomicU32,
}

#[async_trait::async_trait]
impl NodeLeasesApi for FaultyLeases {
    async fn watch_assignments(&self, node_id: &str, resume_cursor: u64) -> Result<AssignmentStream, tonic::Status> {
        self.inner.watch_assignments(node_id, resume_cursor).await
    }

    async fn report_phase(&self, request: ReportPhaseRequest) -> Result<Lease, tonic::Status> {
        self.inner.report_phase(request).await
    }

    async fn renew_leases(&self, request: RenewLeasesRequest) -> Result<RenewLeasesResponse, tonic::Status> {
        self.inner.renew_leases(request).await
    }

    async fn reconcile_node(&self, request: ReconcileNodeRequest) -> Result<ReconcileNodeResponse, tonic::Status> {
        self.inner.reconcile_node(request).await
    }

    async fn assume_custody(&self, request: AssumeCustodyRequest) -> Result<Lease, tonic::Status> {
        let (lease_id, epoch) = (request.lease_id.clone(), request.epoch);
        let lease = self.inner.assume_custody(request).await?;
        if take_one(&self.custody_replies_lost) {
            tracing::warn!(%lease_id, epoch, now = lease.epoch, "injected fault: the custody reply is lost");
            return Err(tonic::Status::unavailable("injected fault: the AssumeCustody reply was lost"));
        }
        Ok(lease)
    }

    async fn report_resize(&self, request: ReportResizeRequest) -> Result<Lease, tonic::Status> {
        self.inner.report_resize(request).await
    }

    async fn open_cache(
        &self,
        request: berth_proto::leases::v1::OpenCacheRequest,
    ) -> Result<berth_proto::leases::v1::OpenCacheResponse, tonic::Status> {
        self.inner.open_cache(request).await
    }

    async fn commit_cache(
        &self,
        request: berth_proto::leases::v1::CommitCacheRequest,
    ) -> Result<berth_proto::leases::v1::CommitCacheResponse, tonic::Status> {
        self.inner.commit_cache(request).await
    }

    async fn follow_caches(
        &self,
        request: berth_proto::leases::v1::FollowCachesRequest,
    ) -> Result<berth_proto::leases::v1::FollowCachesResponse, tonic::Status> {
        self.inner.follow_caches(request).await
    }

    fn reconnect(&self) {
        self.inner.reconnect();
    }
}

#[derive(Debug)]
struct FaultyProvider {
    inner: Arc<dyn Provider>,
    listings_failing: AtomicU32,
    destroys_failing: u32,
    /// Lease → destroys failed so far.
    destroys_tried: Mutex<HashMap<String, u32>>,
}

wrapping_provider!(FaultyProvider, |this| this.inner, {
    async fn launch(&self, spec: LaunchSpec) -> Result<Launched, ProviderError> {
        self.inner.launch(spec).await
    }

    async fn recover(&self) -> Result<Vec<Launched>, ProviderError> {
        if take_one(&self.listings_failing) {
            tracing::warn!("injected fault: the listing of the node's workloads fails");
            return Err(ProviderError::Unsupported("injected fault: the listing failed".into()));
        }
        self.inner.recover().await
    }

    async fn set_epoch(&self, lease_id: &str, epoch: u64) -> Result<(), ProviderError> {
        self.inner.set_epoch(lease_id, epoch).await
    }

    async fn settle(&self, lease_id: &str, settlement: Settlement) -> Result<(), ProviderError> {
        self.inner.settle(lease_id, settlement).await
    }

    async fn destroy(&self, lease_id: &str) -> Result<(), ProviderError> {
        let failed = {
            let mut tried = self.destroys_tried.lock().unwrap_or_else(PoisonError::into_inner);
            let count = tried.entry(lease_id.to_string()).or_default();
            let fail = *count < self.destroys_failing;
            *count += u32::from(fail);
            fail.then_some(*count)
        };
        if let Some(attempt) = failed {
            tracing::warn!(%lease_id, attempt, "injected fault: the destroy fails");
            return Err(ProviderError::Stuck {
                lease_id: lease_id.to_string(),
                detail: format!("injected fault (failure {attempt} of {})", self.destroys_failing),
            });
        }
        self.inner.destroy(lease_id).await
    }

    async fn remove(&self, lease_id: &str) -> Result<(), ProviderError> {
        self.inner.remove(lease_id).await
    }
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_read_as_the_suite_writes_them_and_bad_ones_are_named() {
        let faults: Faults = "custody-reply-lost=1, listing-fails=2,destroy-fails=3".parse().unwrap();
        assert_eq!(faults, Faults { custody_replies_lost: 1, listings_failing: 2, destroys_failing: 3 });
        assert_eq!("".parse::<Faults>().unwrap(), Faults::default());
        assert!("listing-fails".parse::<Faults>().unwrap_err().contains("'listing-fails' is not NAME=COUNT"));
        assert!("listing-fails=x".parse::<Faults>().unwrap_err().contains("'x'"));
        assert!("disk-full=1".parse::<Faults>().unwrap_err().contains("unknown fault 'disk-full'"));
    }

    #[test]
    fn a_counter_gives_out_exactly_its_count() {
        let counter = AtomicU32::new(2);
        assert!(take_one(&counter));
        assert!(take_one(&counter));
        assert!(!take_one(&counter));
    }
}
