//! Workload trust for a control-plane service: the workload authority's
//! bundle, fetched from identity (`Workloads/GetWorkloadBundle`) and
//! installed into the service's [`TlsCredentials`], so its listener admits
//! workloads presenting their X.509-SVIDs (caller kind `WORKLOAD`).
//!
//! # Invariants
//! - Until the first fetch succeeds, the service admits no workload; a
//!   later failed fetch keeps the bundle in force (a workload is refused
//!   only once identity has said its authority is no longer trusted).
//! - The bundle is read again every [`REFRESH`]: a rotation of the
//!   workload authority must publish the new authority that long before it
//!   signs with it, which a prepare phase longer than a workload
//!   certificate's life already gives.

use std::time::Duration;

use berth_core::backoff::Backoff;
use berth_mtls::TlsCredentials;
use berth_proto::identity::v1::{GetWorkloadBundleRequest, workloads_client::WorkloadsClient};
use tokio_util::sync::CancellationToken;

/// How often the bundle is read again once it is known.
pub(crate) const REFRESH: Duration = Duration::from_secs(60);

/// First retry delay after a failed fetch; doubles up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(200);

/// Longest wait between attempts while identity cannot be reached.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// Keeps `credentials` trusting the workload bundle identity at
/// `identity_addr` publishes, until `stop`.
pub fn follow_workload_bundle(identity_addr: String, credentials: TlsCredentials, stop: CancellationToken) {
    tokio::spawn(async move {
        let mut backoff = Backoff::new(MIN_BACKOFF, MAX_BACKOFF);
        loop {
            let wait = match fetch_and_install(&identity_addr, &credentials).await {
                Ok(()) => {
                    backoff.reset();
                    REFRESH
                }
                Err(why) => {
                    tracing::warn!(identity = %identity_addr, %why, "cannot read the workload bundle; retrying");
                    backoff.next_delay()
                }
            };
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    });
}

async fn fetch_and_install(addr: &str, credentials: &TlsCredentials) -> Result<(), String> {
    let channel = berth_rpc::connect(addr, credentials.clone()).map_err(|e| e.to_string())?;
    let bundle = WorkloadsClient::new(channel)
        .get_workload_bundle(GetWorkloadBundleRequest {})
        .await
        .map_err(|status| format!("{:?}: {}", status.code(), status.message()))?
        .into_inner()
        .bundle_pem;
    let bundle = Some(bundle).filter(|pem| !pem.trim().is_empty());
    let changed = credentials.workload_bundle().as_deref() != bundle.as_deref();
    credentials.trust_workloads(bundle).map_err(|e| format!("identity's workload bundle is unusable: {e}"))?;
    if changed {
        tracing::info!(identity = %addr, "trusting the workload bundle identity publishes");
    }
    Ok(())
}
