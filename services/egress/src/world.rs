//! What the full pass knows of the rest of the mesh: each service's egress
//! selection, from revisions, and which tenants each node hosts, from leases.
//! Both are followed only while this replica leads, into a [`World`] the
//! pass reads, and every change marks the tenants it touches.
//!
//! # Services: `WatchServices` on revisions
//! One stream over every project (`all_projects`), dialled with this
//! service's own certificate (revisions admits service callers). Each
//! (re)connection's upserts up to `SYNCED` replace the whole view, so what
//! was missed while disconnected is healed; then each event updates it. A
//! service's selection is its live revision's template's `egress` when a
//! revision serves (fetched once per live revision with `GetRevision`, since
//! revisions are immutable), else its own template's. A live revision that
//! cannot be fetched falls back to the template and is fetched again every
//! `source_backoff_max` until it is.
//!
//! # Placement: `ListLeases` on leases
//! Leases offers requesters no watch, so every `placement_poll` the open
//! leases of every project (phases BOUND, LAUNCHING, RUNNING) are listed; a
//! node hosts a tenant while one of them is placed on it. A changed picture
//! marks node placement, and a tenant seen for the first time gets a pass.
//!
//! # Expected flow
//! A new leader starts both followers on an empty world, waits (at most
//! `sync_timeout`) until each has described the world once, then passes
//! every tenant. Level-triggered: a lost event is healed by the next
//! reconnection, poll or full resync.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use berth_proto::leases::v1 as leases;
use berth_proto::revisions::v1 as revisions;
use berth_proto::types::v1::EventKind;
use berth_rpc::Channel;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::compile::ServiceInput;
use crate::model::{Selection, project_or_default};
use crate::shared::Core;

/// The largest lease list read from leases (every open lease, one phase).
const MAX_LEASE_LIST_BYTES: usize = 256 * 1024 * 1024;

/// Live revisions fetched at once while a view is rebuilt.
const RESOLVE_CONCURRENCY: usize = 16;

/// A service as followed.
#[derive(Debug, Clone, PartialEq)]
struct Followed {
    /// What the pass compiles.
    selection: Selection,
    /// The revision serving, if any.
    live: String,
    /// Which incarnation of the name this is (a re-created service restarts its revision names).
    created_at: Option<prost_types::Timestamp>,
    /// The live revision's selection once fetched.
    live_selection: Option<Selection>,
}

impl Followed {
    fn unresolved(&self) -> bool {
        !self.live.is_empty() && self.live_selection.is_none()
    }
}

type ServiceKey = (String, String);

/// The leader's picture of services and placement; see the module docs.
#[derive(Debug)]
pub(crate) struct World {
    services: Mutex<BTreeMap<ServiceKey, Followed>>,
    hosting: Mutex<BTreeMap<String, BTreeSet<String>>>,
    services_synced: watch::Sender<bool>,
    placement_synced: watch::Sender<bool>,
}

impl World {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            services: Mutex::default(),
            hosting: Mutex::default(),
            services_synced: watch::channel(false).0,
            placement_synced: watch::channel(false).0,
        })
    }

    /// The services of `project` with their selections.
    pub(crate) fn services_of(&self, project: &str) -> Vec<ServiceInput> {
        let services = self.services.lock().unwrap_or_else(PoisonError::into_inner);
        services
            .range((project.to_owned(), String::new())..)
            .take_while(|((p, _), _)| p == project)
            .map(|((_, name), followed)| ServiceInput { service: name.clone(), selection: followed.selection.clone() })
            .collect()
    }

    /// Node id to the tenants it hosts.
    pub(crate) fn hosting(&self) -> BTreeMap<String, BTreeSet<String>> {
        self.hosting.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Every tenant with a service or a workload.
    pub(crate) fn projects(&self) -> BTreeSet<String> {
        let mut projects: BTreeSet<String> =
            self.services.lock().unwrap_or_else(PoisonError::into_inner).keys().map(|(p, _)| p.clone()).collect();
        projects.extend(self.hosting.lock().unwrap_or_else(PoisonError::into_inner).values().flatten().cloned());
        projects
    }

    /// Resolves once both followers have described the world at least once.
    pub(crate) async fn synced(&self) {
        let mut services = self.services_synced.subscribe();
        let mut placement = self.placement_synced.subscribe();
        let _ = services.wait_for(|s| *s).await;
        let _ = placement.wait_for(|s| *s).await;
    }

    /// Replaces every service; the projects whose services changed.
    fn replace_services(&self, fresh: BTreeMap<ServiceKey, Followed>) -> BTreeSet<String> {
        let mut services = self.services.lock().unwrap_or_else(PoisonError::into_inner);
        let mut changed = BTreeSet::new();
        for (key, followed) in services.iter() {
            if fresh.get(key).map(|f| &f.selection) != Some(&followed.selection) {
                changed.insert(key.0.clone());
            }
        }
        for (key, followed) in &fresh {
            if services.get(key).map(|f| &f.selection) != Some(&followed.selection) {
                changed.insert(key.0.clone());
            }
        }
        *services = fresh;
        changed
    }

    /// Sets one service; whether its selection changed.
    fn upsert_service(&self, key: ServiceKey, followed: Followed) -> bool {
        let mut services = self.services.lock().unwrap_or_else(PoisonError::into_inner);
        let changed = services.get(&key).map(|f| &f.selection) != Some(&followed.selection);
        services.insert(key, followed);
        changed
    }

    fn remove_service(&self, key: &ServiceKey) -> bool {
        self.services.lock().unwrap_or_else(PoisonError::into_inner).remove(key).is_some()
    }

    fn service(&self, key: &ServiceKey) -> Option<Followed> {
        self.services.lock().unwrap_or_else(PoisonError::into_inner).get(key).cloned()
    }

    fn unresolved(&self) -> Vec<ServiceKey> {
        let services = self.services.lock().unwrap_or_else(PoisonError::into_inner);
        services.iter().filter(|(_, f)| f.unresolved()).map(|(k, _)| k.clone()).collect()
    }

    /// Replaces placement; the tenants seen for the first time, or `None` when nothing changed.
    fn replace_hosting(&self, fresh: BTreeMap<String, BTreeSet<String>>) -> Option<BTreeSet<String>> {
        let mut hosting = self.hosting.lock().unwrap_or_else(PoisonError::into_inner);
        if *hosting == fresh {
            return None;
        }
        let before: BTreeSet<&String> = hosting.values().flatten().collect();
        let new: BTreeSet<String> = fresh.values().flatten().filter(|p| !before.contains(p)).cloned().collect();
        *hosting = fresh;
        Some(new)
    }
}

/// Starts both followers into `world` until `stop`.
pub(crate) fn spawn(core: Arc<Core>, world: Arc<World>, stop: CancellationToken) {
    match core.sources.revisions.clone() {
        Some(channel) => {
            tokio::spawn(follow_services(Arc::clone(&core), Arc::clone(&world), channel, stop.clone()));
        }
        None => {
            tracing::warn!("no revisions address is configured: plans list no services");
            world.services_synced.send_replace(true);
        }
    }
    match core.sources.leases.clone() {
        Some(channel) => {
            tokio::spawn(follow_placement(core, world, channel, stop));
        }
        None => {
            tracing::warn!("no leases address is configured: no node is sent any plan");
            world.placement_synced.send_replace(true);
        }
    }
}

async fn follow_services(core: Arc<Core>, world: Arc<World>, channel: Channel, stop: CancellationToken) {
    let config = &core.config;
    let mut backoff = config.source_backoff_min;
    loop {
        let result = tokio::select! {
            () = stop.cancelled() => return,
            result = follow_services_once(&core, &world, &channel, &mut backoff) => result,
        };
        if let Err(status) = result {
            tracing::warn!(code = ?status.code(), message = status.message(), retry_in = ?backoff,
                "the service stream from revisions broke; following it again");
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(berth_core::backoff::spread(backoff)) => {}
        }
        backoff = (backoff * 2).min(config.source_backoff_max);
    }
}

async fn follow_services_once(
    core: &Core,
    world: &World,
    channel: &Channel,
    backoff: &mut Duration,
) -> Result<(), tonic::Status> {
    let mut services = revisions::services_client::ServicesClient::new(channel.clone());
    let fetcher = revisions::revisions_client::RevisionsClient::new(channel.clone());
    let request = revisions::WatchServicesRequest { project: String::new(), all_projects: true };
    let mut stream = services.watch_services(request).await?.into_inner();
    let mut initial: Option<BTreeMap<ServiceKey, revisions::Service>> = Some(BTreeMap::new());
    let mut retry = tokio::time::interval(core.config.source_backoff_max);
    retry.tick().await;
    loop {
        let event = tokio::select! {
            event = stream.message() => event?,
            _ = retry.tick(), if initial.is_none() => {
                for key in world.unresolved() {
                    if let Some(followed) = world.service(&key) {
                        let refreshed = fetch_live(&fetcher, &key.0, followed.clone()).await;
                        if world.upsert_service(key.clone(), refreshed) {
                            core.queue.mark(&key.0);
                        }
                    }
                }
                continue;
            }
        };
        let Some(event) = event else { break };
        let kind = EventKind::try_from(event.kind).unwrap_or(EventKind::Unspecified);
        match (kind, event.service, initial.as_mut()) {
            (EventKind::Upsert, Some(service), Some(pending)) => {
                pending.insert(key_of(&service), service);
            }
            (EventKind::Removed, Some(service), Some(pending)) => {
                pending.remove(&key_of(&service));
            }
            (EventKind::Synced, _, Some(_)) => {
                let pending = initial.take().unwrap_or_default();
                let fresh = resolve_all(&fetcher, world, pending).await;
                let count = fresh.len();
                for project in world.replace_services(fresh) {
                    core.queue.mark(&project);
                }
                world.services_synced.send_replace(true);
                *backoff = core.config.source_backoff_min;
                tracing::debug!(services = count, "in sync with revisions' services");
            }
            (EventKind::Upsert, Some(service), None) => {
                let key = key_of(&service);
                let followed = resolve(&fetcher, &service, world.service(&key)).await;
                if world.upsert_service(key.clone(), followed) {
                    core.queue.mark(&key.0);
                }
            }
            (EventKind::Removed, Some(service), None) => {
                let key = key_of(&service);
                if world.remove_service(&key) {
                    core.queue.mark(&key.0);
                }
            }
            _ => {}
        }
    }
    Err(tonic::Status::unavailable("revisions closed the service stream"))
}

fn key_of(service: &revisions::Service) -> ServiceKey {
    (project_or_default(&service.project).to_owned(), service.name.clone())
}

/// Resolves every service of a fresh view, fetching live revisions a few at a time.
async fn resolve_all(
    fetcher: &revisions::revisions_client::RevisionsClient<Channel>,
    world: &World,
    pending: BTreeMap<ServiceKey, revisions::Service>,
) -> BTreeMap<ServiceKey, Followed> {
    let mut fresh = BTreeMap::new();
    let mut fetches = JoinSet::new();
    for (key, service) in pending {
        let previous = world.service(&key);
        let followed = from_service(&service, previous.as_ref());
        if !followed.unresolved() {
            fresh.insert(key, followed);
            continue;
        }
        if fetches.len() >= RESOLVE_CONCURRENCY
            && let Some(Ok((key, followed))) = fetches.join_next().await
        {
            fresh.insert(key, followed);
        }
        let fetcher = fetcher.clone();
        fetches.spawn(async move {
            let project = key.0.clone();
            (key, fetch_live(&fetcher, &project, followed).await)
        });
    }
    while let Some(joined) = fetches.join_next().await {
        if let Ok((key, followed)) = joined {
            fresh.insert(key, followed);
        }
    }
    fresh
}

/// `service` as followed, its live revision fetched when not already known.
async fn resolve(
    fetcher: &revisions::revisions_client::RevisionsClient<Channel>,
    service: &revisions::Service,
    previous: Option<Followed>,
) -> Followed {
    let followed = from_service(service, previous.as_ref());
    if followed.unresolved() {
        fetch_live(fetcher, project_or_default(&service.project), followed).await
    } else {
        followed
    }
}

/// `service` as followed, reusing the live revision's selection from
/// `previous` when it is the same revision of the same incarnation.
fn from_service(service: &revisions::Service, previous: Option<&Followed>) -> Followed {
    let template = Selection::from_proto(service.template.as_ref().and_then(|t| t.egress.as_ref()));
    let live = service.status.as_ref().map(|s| s.live_revision.clone()).unwrap_or_default();
    let live_selection = previous
        .filter(|p| p.live == live && p.created_at == service.created_at)
        .and_then(|p| p.live_selection.clone());
    let selection = if live.is_empty() { template.clone() } else { live_selection.clone().unwrap_or(template) };
    Followed { selection, live, created_at: service.created_at, live_selection }
}

/// Fetches `followed`'s live revision and takes its selection; on failure
/// it keeps the template's and stays unresolved, to be fetched again.
async fn fetch_live(
    fetcher: &revisions::revisions_client::RevisionsClient<Channel>,
    project: &str,
    mut followed: Followed,
) -> Followed {
    let request = revisions::GetRevisionRequest { project: project.to_owned(), name: followed.live.clone() };
    match fetcher.clone().get_revision(request).await {
        Ok(response) => {
            let template = response.into_inner().revision.and_then(|r| r.template);
            let selection = Selection::from_proto(template.as_ref().and_then(|t| t.egress.as_ref()));
            followed.selection = selection.clone();
            followed.live_selection = Some(selection);
        }
        Err(status) => {
            tracing::warn!(%project, revision = %followed.live, code = ?status.code(), message = status.message(),
                "cannot read a live revision's egress selection; using the service template's until it can");
        }
    }
    followed
}

async fn follow_placement(core: Arc<Core>, world: Arc<World>, channel: Channel, stop: CancellationToken) {
    let config = &core.config;
    // Every open lease of every project in one answer: past gRPC's 4 MiB
    // default from about ten thousand leases on.
    let client = leases::leases_client::LeasesClient::new(channel).max_decoding_message_size(MAX_LEASE_LIST_BYTES);
    let mut backoff = config.source_backoff_min;
    loop {
        let wait = match open_leases_by_node(&client).await {
            Ok(hosting) => {
                backoff = config.source_backoff_min;
                if let Some(new) = world.replace_hosting(hosting) {
                    core.queue.mark_placement();
                    for project in new {
                        core.queue.mark(&project);
                    }
                }
                world.placement_synced.send_replace(true);
                config.placement_poll
            }
            Err(status) => {
                tracing::warn!(code = ?status.code(), message = status.message(), retry_in = ?backoff,
                    "cannot list open leases; node placement stays as last known");
                let wait = berth_core::backoff::spread(backoff);
                backoff = (backoff * 2).min(config.source_backoff_max);
                wait
            }
        };
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
        }
    }
}

/// Node id to the projects with an open lease placed on it.
async fn open_leases_by_node(
    client: &leases::leases_client::LeasesClient<Channel>,
) -> Result<BTreeMap<String, BTreeSet<String>>, tonic::Status> {
    let mut hosting: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for phase in [leases::LeasePhase::Bound, leases::LeasePhase::Launching, leases::LeasePhase::Running] {
        let request = leases::ListLeasesRequest { all_projects: true, phase: phase as i32, ..Default::default() };
        for lease in client.clone().list_leases(request).await?.into_inner().leases {
            if !lease.node_id.is_empty() {
                hosting.entry(lease.node_id).or_default().insert(project_or_default(&lease.project).to_owned());
            }
        }
    }
    Ok(hosting)
}

/// The services of every project with their selections, for tests of the view.
#[cfg(test)]
fn selections(world: &World) -> std::collections::HashMap<ServiceKey, Selection> {
    world.services.lock().unwrap().iter().map(|(k, f)| (k.clone(), f.selection.clone())).collect()
}

#[cfg(test)]
mod tests {
    use berth_proto::revisions::v1::{EgressSelection, Service, ServiceStatus, ServiceTemplate};

    use super::*;

    fn service(name: &str, gateway: &str, live: &str) -> Service {
        Service {
            project: "team".into(),
            name: name.into(),
            template: Some(ServiceTemplate {
                egress: Some(EgressSelection { gateway: gateway.into(), disabled: false }),
                ..Default::default()
            }),
            status: Some(ServiceStatus { live_revision: live.into(), ..Default::default() }),
            created_at: Some(prost_types::Timestamp { seconds: 1, nanos: 0 }),
            ..Default::default()
        }
    }

    #[test]
    fn a_known_live_revision_is_reused_and_a_new_one_is_not() {
        let fetched = Followed {
            selection: Selection::Gateway("live".into()),
            live: "web-00001".into(),
            created_at: Some(prost_types::Timestamp { seconds: 1, nanos: 0 }),
            live_selection: Some(Selection::Gateway("live".into())),
        };
        let same = from_service(&service("web", "template", "web-00001"), Some(&fetched));
        assert_eq!(same.selection, Selection::Gateway("live".into()));
        assert!(!same.unresolved());
        let moved = from_service(&service("web", "template", "web-00002"), Some(&fetched));
        assert!(moved.unresolved(), "a new live revision is fetched");
        assert_eq!(moved.selection, Selection::Gateway("template".into()), "until then, the template's");
        let none = from_service(&service("web", "template", ""), Some(&fetched));
        assert_eq!(none.selection, Selection::Gateway("template".into()));
        assert!(!none.unresolved());
    }

    #[test]
    fn replacing_the_view_reports_only_projects_whose_selections_changed() {
        let world = World::new();
        let followed = |gateway: &str| Followed {
            selection: Selection::Gateway(gateway.into()),
            live: String::new(),
            created_at: None,
            live_selection: None,
        };
        let key = |p: &str, n: &str| (p.to_owned(), n.to_owned());
        let first: BTreeMap<_, _> =
            [(key("a", "web"), followed("g")), (key("b", "web"), followed("g"))].into_iter().collect();
        assert_eq!(world.replace_services(first.clone()), ["a".to_owned(), "b".to_owned()].into());
        assert!(world.replace_services(first).is_empty());
        let second: BTreeMap<_, _> = [(key("a", "web"), followed("h"))].into_iter().collect();
        assert_eq!(world.replace_services(second), ["a".to_owned(), "b".to_owned()].into());
        assert_eq!(selections(&world).len(), 1);
        assert_eq!(world.services_of("a").len(), 1);
        assert!(world.services_of("b").is_empty());
    }
}
