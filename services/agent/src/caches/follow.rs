//! Following cache heads: a node holds, beside the heads it sealed, the
//! heads of the volumes the ledger names it follower of, so that a
//! volume's next lease finds a second node holding its head when the
//! sealer has no room.
//!
//! While the node serves, it reports every `FOLLOW_PERIOD` the newest
//! generation it holds of each volume (`FollowCaches`); the ledger records
//! the heads among them and answers the heads this node follows and does
//! not hold. Each is fetched from the cache registry as a lease's missing
//! head is (checked against the ledger's digest before it is recorded as
//! held), starting from the generation the node holds when the head's
//! artifact stacks on it (only the layers after it are pulled), and
//! reported at once.
//!
//! # Invariants
//! - Nothing is reported while the node does not serve (no session, or
//!   custody): what it holds is claimed only under the node id its
//!   certificate names.
//! - A followed head is recorded as held only once fetched whole and its
//!   digest checked ([`Transfer::fetch`]); a failed fetch is asked again at
//!   the next report, not retried in a loop.
//! - Its scratch (`staging/following.fetch`) is spared by the sweep while
//!   the fetch runs, and removed by the next fetch of the volume or by the
//!   sweep after it.

use std::sync::Arc;
use std::time::Duration;

use berth_bundle::BundleClient;
use berth_proto::leases::v1::{FollowCachesRequest, HeldCache};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::CacheVolumes;
use super::registry::Transfer;
use crate::leases_client::NodeLeasesApi;

/// What a followed head's transfer names its scratch by, in place of a lease.
pub(crate) const FOLLOWING: &str = "following";

/// How often a serving node reports what it holds.
pub(crate) const FOLLOW_PERIOD: Duration = Duration::from_secs(10);

/// The node's follower of cache heads; [`HeadFollower::run`] until shutdown.
pub(crate) struct HeadFollower {
    pub(crate) leases: Arc<dyn NodeLeasesApi>,
    pub(crate) volumes: CacheVolumes,
    pub(crate) client: BundleClient,
    /// The node id to report as; `None` while the node does not serve.
    pub(crate) reporting: watch::Receiver<Option<String>>,
    pub(crate) period: Duration,
    pub(crate) shutdown: CancellationToken,
}

impl HeadFollower {
    pub(crate) async fn run(mut self) {
        let mut just_fetched = false;
        loop {
            let serving = self.reporting.borrow_and_update().clone();
            // A round that fetched a head reports it at once.
            let again = match serving {
                Some(node_id) => tokio::select! {
                    _ = self.shutdown.cancelled() => return,
                    fetched = self.round(&node_id) => fetched,
                },
                None => false,
            };
            if again && !just_fetched {
                just_fetched = true;
                continue;
            }
            just_fetched = false;
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                changed = self.reporting.changed() => if changed.is_err() { return },
                () = tokio::time::sleep(self.period) => {}
            }
        }
    }

    /// Reports what the node holds and fetches what it is asked to hold;
    /// whether it fetched any head.
    async fn round(&self, node_id: &str) -> bool {
        let volumes = self.volumes.clone();
        let held = tokio::task::spawn_blocking(move || volumes.newest_held()).await.unwrap_or_default();
        let held = held.into_iter().map(|(project, key, generation)| HeldCache { project, key, generation }).collect();
        let request = FollowCachesRequest { node_id: node_id.to_owned(), held };
        let answer = match self.leases.follow_caches(request).await {
            Ok(answer) => answer,
            Err(status) => {
                tracing::debug!(code = ?status.code(), message = status.message(),
                    "cannot report the cache heads this node holds; trying at the next report");
                return false;
            }
        };
        let mut fetched = false;
        for follow in answer.follow {
            let (Some(head), Some(registry)) = (follow.head, follow.registry) else { continue };
            let _following = self.volumes.following();
            let transfer =
                Transfer { volumes: &self.volumes, client: &self.client, registry: &registry, lease_id: FOLLOWING };
            match transfer.fetch(&head, follow.held.as_ref()).await {
                Ok(got) => {
                    tracing::info!(project = %head.project, key = %head.key, generation = head.generation,
                        bytes = got.sealed.size_bytes, pulled_layers = got.pulled_layers, layers = got.layers,
                        "followed cache head fetched");
                    fetched = true;
                }
                Err(error) => tracing::warn!(project = %head.project, key = %head.key,
                    generation = head.generation, %error, "cannot fetch a followed cache head; asking again later"),
            }
        }
        fetched
    }
}
