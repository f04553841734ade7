//! Tells revisions which route generation of each service this router
//! serves (`Services/AckRoutes`), so a revision traffic left is stopped only
//! once no router sends it requests any more.
//!
//! # What an acknowledgement means
//! Generation `g` of a service is acknowledged once the table requests read
//! was built from `g`, and no request this router sent to a replica `g`
//! sends nothing new to (its revision dropped, its lease ended, its node
//! draining while another replica serves) is still being answered: a
//! replica is stopped only once every router acknowledged a generation
//! without it, so none is stopped with a request under way. Requests
//! register the replica they were sent to ([`InFlight::enter`]) under the
//! same lock the acknowledger reads the table under, so no request can pick
//! a replica from a table older than the one acknowledged without being
//! counted first.
//!
//! # Expected flow
//! A task wakes when the table changes, when the last request to a replica
//! the table no longer sends to ends, and every [`KEEP_ALIVE`]; it sends
//! every generation not yet acknowledged that may be, or an empty list as a
//! keep-alive (revisions counts a router alive while it calls). A failed
//! call is tried again with backoff; what it carried is sent again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use berth_core::backoff::Backoff;
use berth_proto::revisions::v1::{AckRoutesRequest, RouteAck, services_client::ServicesClient};
use berth_rpc::Channel;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

use crate::routes::{Endpoint, RouteTable, ServiceKey};

/// How often a router says it is alive when nothing else needs saying:
/// revisions forgets one silent for 15s.
pub(crate) const KEEP_ALIVE: Duration = Duration::from_secs(5);

/// Most acknowledgements sent in one call.
const BATCH: usize = 10_000;

/// How many requests are under way, by service, then by the lease of the
/// replica they were sent to (with that replica): a request looks its
/// count up by the names its endpoint holds, copying none.
type Counts = HashMap<ServiceKey, HashMap<String, (Arc<Endpoint>, usize)>>;

/// The requests under way, by the replica they were sent to.
#[derive(Debug)]
pub(crate) struct InFlight {
    table: watch::Receiver<Arc<RouteTable>>,
    counts: Mutex<Counts>,
    /// Woken when the last request to a replica the table no longer sends
    /// to ends.
    drained: Notify,
}

/// Held while a request is under way; dropping it ends the request.
#[derive(Debug)]
pub(crate) struct InFlightGuard {
    inflight: Arc<InFlight>,
    endpoint: Arc<Endpoint>,
}

/// The counts, locked: what a request reads the table under.
pub(crate) struct Locked<'a> {
    inflight: &'a Arc<InFlight>,
    counts: MutexGuard<'a, Counts>,
}

impl InFlight {
    pub(crate) fn new(table: watch::Receiver<Arc<RouteTable>>) -> Arc<InFlight> {
        Arc::new(InFlight { table, counts: Mutex::new(HashMap::new()), drained: Notify::new() })
    }

    fn counts(&self) -> MutexGuard<'_, Counts> {
        self.counts.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Locks the counts: the table read while they are held, and the
    /// request entered before they are let go, are seen together.
    pub(crate) fn lock(self: &Arc<Self>) -> Locked<'_> {
        Locked { inflight: self, counts: self.counts() }
    }

    /// How many requests are under way, by the lease of the replica each
    /// was counted against.
    #[cfg(test)]
    pub(crate) fn under_way(&self) -> std::collections::BTreeMap<String, usize> {
        self.counts().values().flat_map(|replicas| replicas.iter().map(|(lease, (_, n))| (lease.clone(), *n))).collect()
    }

    /// Whether no request to `service` is being answered by a replica
    /// `table` sends nothing new to.
    fn drained_for(counts: &Counts, table: &RouteTable, service: &ServiceKey) -> bool {
        counts.get(service).is_none_or(|replicas| {
            replicas.values().all(|(endpoint, _)| table.sends_to(service, &endpoint.revision, &endpoint.lease_id))
        })
    }
}

impl Locked<'_> {
    /// Counts a request sent to `endpoint` until the guard drops.
    pub(crate) fn enter(&mut self, endpoint: &Arc<Endpoint>) -> InFlightGuard {
        let replicas = match self.counts.get_mut(&endpoint.service) {
            Some(replicas) => replicas,
            None => self.counts.entry(endpoint.service.clone()).or_default(),
        };
        match replicas.get_mut(endpoint.lease_id.as_str()) {
            Some((_, count)) => *count += 1,
            None => {
                replicas.insert(endpoint.lease_id.clone(), (endpoint.clone(), 1));
            }
        }
        InFlightGuard { inflight: self.inflight.clone(), endpoint: endpoint.clone() }
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        let (service, lease_id) = (&self.endpoint.service, self.endpoint.lease_id.as_str());
        let mut counts = self.inflight.counts();
        let Some(replicas) = counts.get_mut(service) else { return };
        let Some((_, count)) = replicas.get_mut(lease_id) else { return };
        *count -= 1;
        if *count == 0 {
            replicas.remove(lease_id);
            if replicas.is_empty() {
                counts.remove(service);
            }
            let sent = self.inflight.table.borrow().sends_to(service, &self.endpoint.revision, lease_id);
            if !sent {
                self.inflight.drained.notify_one();
            }
        }
    }
}

/// Acknowledges what this router serves to revisions over `revisions`, as
/// replica `instance`, until `shutdown`.
pub(crate) async fn acknowledge(
    inflight: Arc<InFlight>,
    revisions: Channel,
    instance: String,
    shutdown: CancellationToken,
) {
    let mut client = ServicesClient::new(revisions);
    let mut table = inflight.table.clone();
    let mut acked: HashMap<ServiceKey, u64> = HashMap::new();
    let mut backoff = Backoff::new(Duration::from_millis(100), KEEP_ALIVE);
    let mut last_sent: Option<tokio::time::Instant> = None;
    loop {
        let current = table.borrow_and_update().clone();
        let due: Vec<RouteAck> = {
            let counts = inflight.counts();
            current
                .generations()
                .filter(|(key, generation)| acked.get(*key).is_none_or(|done| done < generation))
                .filter(|(key, _)| InFlight::drained_for(&counts, &current, key))
                .map(|(key, generation)| RouteAck { project: key.0.clone(), service: key.1.clone(), generation })
                .collect()
        };
        let mut failed = false;
        // With nothing due, a call now and then says the router is alive.
        let alive = (due.is_empty() && last_sent.is_none_or(|at| at.elapsed() >= KEEP_ALIVE)).then(Vec::new);
        for batch in due.chunks(BATCH).map(<[RouteAck]>::to_vec).chain(alive) {
            last_sent = Some(tokio::time::Instant::now());
            let request = AckRoutesRequest { acks: batch.clone(), instance: instance.clone() };
            let sent = tokio::select! {
                () = shutdown.cancelled() => return,
                sent = client.ack_routes(request) => sent,
            };
            match sent {
                Ok(_) => {
                    for ack in batch {
                        acked.insert((ack.project, ack.service), ack.generation);
                    }
                }
                Err(status) => {
                    tracing::warn!(code = ?status.code(), error = %status.message(), "cannot acknowledge routes");
                    failed = true;
                    break;
                }
            }
        }
        // What the table no longer names needs no acknowledgement.
        acked.retain(|key, _| current.generation(key).is_some());
        let wait = if failed {
            backoff.next_delay()
        } else {
            backoff.reset();
            last_sent.map_or(Duration::ZERO, |at| KEEP_ALIVE.saturating_sub(at.elapsed()))
        };
        tokio::select! {
            () = shutdown.cancelled() => return,
            changed = table.changed(), if !failed => if changed.is_err() { return },
            () = inflight.drained.notified(), if !failed => {}
            () = tokio::time::sleep(wait) => {}
        }
    }
}

/// This replica's name among the router's: its host name.
pub fn host_instance() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_string())
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "router".to_string())
}

#[cfg(test)]
mod tests {
    use berth_proto::identity::v1::{Node, NodeState};
    use berth_proto::leases::v1::{Lease, LeasePhase, Workload};
    use berth_proto::revisions::v1::{Service, ServiceStatus};

    use super::*;
    use crate::routes::{Resolution, Sources};

    fn table(live: &str, generation: u64) -> RouteTable {
        RouteTable::build("berth.localhost", &sources(live, generation))
    }

    fn sources(live: &str, generation: u64) -> Sources {
        let mut sources = Sources::default();
        let status = ServiceStatus { live_revision: live.into(), route_generation: generation, ..Default::default() };
        let service = Service { name: "web".into(), status: Some(status), ..Default::default() };
        sources.services.insert("default/web".into(), service);
        for revision in ["web-00001", "web-00002"] {
            let workload = Workload { service: "web".into(), revision: revision.into(), ..Default::default() };
            let lease = Lease {
                lease_id: format!("l-{revision}"),
                node_id: "n-1".into(),
                phase: LeasePhase::Running as i32,
                workload: Some(workload),
                ..Default::default()
            };
            sources.leases.insert(lease.lease_id.clone(), lease);
        }
        let node = Node {
            node_id: "n-1".into(),
            advertise_addr: "127.0.0.1:7447".into(),
            state: NodeState::Up as i32,
            ..Default::default()
        };
        sources.nodes.insert("n-1".into(), node);
        sources
    }

    #[test]
    fn a_generation_is_not_drained_while_a_request_to_a_replica_it_stopped_sending_to_is_answering() {
        let web: ServiceKey = ("default".into(), "web".into());
        // web-00001 runs on n-1, which drains, and on n-2.
        let mut sources = sources("web-00001", 1);
        let mut moved = sources.leases["l-web-00001"].clone();
        moved.lease_id = "l-web-00001-b".into();
        moved.node_id = "n-2".into();
        sources.leases.insert(moved.lease_id.clone(), moved);
        let mut second = sources.nodes["n-1"].clone();
        second.node_id = "n-2".into();
        second.advertise_addr = "127.0.0.2:7447".into();
        sources.nodes.insert("n-2".into(), second);
        let before = RouteTable::build("berth.localhost", &sources);
        let (publish, follower) = watch::channel(Arc::new(before.clone()));
        let inflight = InFlight::new(follower);
        let Resolution::Endpoints(endpoints) = before.resolve("web.default.berth.localhost", 0.5) else { panic!() };
        let on_first = endpoints.iter().find(|e| e.node_id == "n-1").unwrap();
        let guard = inflight.lock().enter(on_first);

        // n-1 drains: its replica is sent nothing new while n-2's serves.
        sources.nodes.get_mut("n-1").unwrap().state = NodeState::Draining as i32;
        sources.services.get_mut("default/web").unwrap().status.as_mut().unwrap().route_generation = 2;
        let after = RouteTable::build("berth.localhost", &sources);
        assert!(!after.sends_to(&web, "web-00001", "l-web-00001"), "{after:?}");
        assert!(after.sends_to(&web, "web-00001", "l-web-00001-b"), "{after:?}");
        publish.send_replace(Arc::new(after.clone()));
        assert!(
            !InFlight::drained_for(&inflight.counts(), &after, &web),
            "a request to the draining replica is answering, though its revision still takes traffic"
        );
        drop(guard);
        assert!(InFlight::drained_for(&inflight.counts(), &after, &web));
        assert!(inflight.counts().is_empty(), "an ended request leaves nothing behind");
    }

    #[test]
    fn a_generation_is_not_drained_while_a_request_to_a_revision_it_dropped_is_answering() {
        let web: ServiceKey = ("default".into(), "web".into());
        let (publish, follower) = watch::channel(Arc::new(table("web-00001", 1)));
        let inflight = InFlight::new(follower);
        let old = table("web-00001", 1);
        let Resolution::Endpoints(endpoints) = old.resolve("web.default.berth.localhost", 0.5) else { panic!() };
        let guard = inflight.lock().enter(&endpoints[0]);

        let new = table("web-00002", 2);
        publish.send_replace(Arc::new(new.clone()));
        assert!(!InFlight::drained_for(&inflight.counts(), &new, &web), "a request to web-00001 is answering");
        assert!(InFlight::drained_for(&inflight.counts(), &old, &web), "which generation 1 still routes to");
        drop(guard);
        assert!(InFlight::drained_for(&inflight.counts(), &new, &web));
        assert!(inflight.counts().is_empty(), "an ended request leaves nothing behind");
    }
}
