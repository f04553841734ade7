//! Keeps the route table current by watch, never by polling: revisions'
//! `WatchServices` (every project), leases' `WatchLeases` (every project,
//! the leases revisions asks for), and identity's node registry through
//! [`berth_runtime::follow_nodes`].
//!
//! # Expected flow
//! Each stream sends the current state, then `SYNCED`, then changes. What a
//! (re)opened stream sends before `SYNCED` is staged and replaces that
//! kind's state at `SYNCED`, so whatever was missed while it was broken is
//! healed; after it, each event is applied as it comes. Every change
//! rebuilds the table whole and publishes it; requests read the latest.
//! While a source is unreachable its last state stays in force, and the
//! follower retries with jittered backoff.
//!
//! # Resuming
//! A broken leases stream reopens from the cursor of the last event applied
//! (`resume_cursor`): the ledger then sends only what changed since, and
//! its `SYNCED` says `resumed`, so the staged changes are applied onto the
//! state kept rather than replacing it. A stream that starts afresh (no
//! cursor yet, or one the ledger forgot) replaces it as before. Services
//! carry no cursor and always start afresh.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth_core::backoff::Backoff;
use berth_proto::leases::v1::{Lease, LeaseEvent, WatchLeasesRequest, leases_client::LeasesClient};
use berth_proto::revisions::v1::{Service, ServiceEvent, WatchServicesRequest, services_client::ServicesClient};
use berth_proto::types::v1::EventKind;
use berth_rpc::Channel;
use berth_runtime::NodeDirectory;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::routes::{RouteTable, Sources};

/// The owner every lease revisions asks for starts with.
const REVISIONS_OWNER_PREFIX: &str = "revisions/";

/// First wait after a stream breaks.
const RETRY_INITIAL: Duration = Duration::from_millis(200);

/// Longest wait between attempts.
const RETRY_MAX: Duration = Duration::from_secs(5);

/// What the followers share: the state of each kind, and where the table
/// built from it is published.
#[derive(Debug)]
pub(crate) struct Shared {
    domain: String,
    sources: Mutex<Sources>,
    table: watch::Sender<Arc<RouteTable>>,
}

impl Shared {
    pub(crate) fn new(domain: &str) -> Arc<Shared> {
        Arc::new(Shared {
            domain: domain.to_string(),
            sources: Mutex::new(Sources::default()),
            table: watch::channel(Arc::new(RouteTable::build(domain, &Sources::default()))).0,
        })
    }

    /// The latest table, and its changes.
    pub(crate) fn table(&self) -> watch::Receiver<Arc<RouteTable>> {
        self.table.subscribe()
    }

    fn update(&self, change: impl FnOnce(&mut Sources)) {
        let mut sources = self.sources.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        change(&mut sources);
        self.table.send_replace(Arc::new(RouteTable::build(&self.domain, &sources)));
    }
}

/// One followed kind: how to open its stream and read its events.
trait Followed: Send + 'static {
    type Event: Send + 'static;
    type Object: Send + 'static;
    const WHAT: &'static str;
    /// Opens the stream, resuming after `cursor` where the kind has cursors.
    fn open(
        channel: Channel,
        cursor: u64,
    ) -> impl Future<Output = Result<tonic::Streaming<Self::Event>, tonic::Status>> + Send;
    /// The event's kind, object, cursor (0: none) and, on `SYNCED`,
    /// whether the stream resumed.
    fn split(event: Self::Event) -> Received<Self::Object>;
    fn key(object: &Self::Object) -> String;
    fn slot(sources: &mut Sources) -> &mut BTreeMap<String, Self::Object>;
}

struct Services;

impl Followed for Services {
    type Event = ServiceEvent;
    type Object = Service;
    const WHAT: &'static str = "services";
    async fn open(channel: Channel, _cursor: u64) -> Result<tonic::Streaming<ServiceEvent>, tonic::Status> {
        let request = WatchServicesRequest { all_projects: true, ..Default::default() };
        Ok(ServicesClient::new(channel).watch_services(request).await?.into_inner())
    }
    fn split(event: ServiceEvent) -> Received<Service> {
        Received { kind: event.kind(), object: event.service, cursor: 0, resumed: false }
    }
    fn key(service: &Service) -> String {
        format!("{}/{}", service.project, service.name)
    }
    fn slot(sources: &mut Sources) -> &mut BTreeMap<String, Service> {
        &mut sources.services
    }
}

struct Leases;

impl Followed for Leases {
    type Event = LeaseEvent;
    type Object = Lease;
    const WHAT: &'static str = "leases";
    async fn open(channel: Channel, cursor: u64) -> Result<tonic::Streaming<LeaseEvent>, tonic::Status> {
        let request = WatchLeasesRequest {
            all_projects: true,
            owner_prefix: REVISIONS_OWNER_PREFIX.into(),
            resume_cursor: cursor,
            ..Default::default()
        };
        Ok(LeasesClient::new(channel).watch_leases(request).await?.into_inner())
    }
    fn split(event: LeaseEvent) -> Received<Lease> {
        Received { kind: event.kind(), object: event.lease, cursor: event.cursor, resumed: event.resumed }
    }
    fn key(lease: &Lease) -> String {
        lease.lease_id.clone()
    }
    fn slot(sources: &mut Sources) -> &mut BTreeMap<String, Lease> {
        &mut sources.leases
    }
}

/// Follows revisions and leases over `revisions` and `leases`, and the
/// node registry in `nodes`, into `shared`, until `shutdown`.
pub(crate) fn spawn(
    shared: &Arc<Shared>,
    revisions: Channel,
    leases: Channel,
    nodes: NodeDirectory,
    shutdown: &CancellationToken,
) {
    tokio::spawn(follow::<Services>(shared.clone(), revisions, shutdown.clone()));
    tokio::spawn(follow::<Leases>(shared.clone(), leases, shutdown.clone()));
    let (shared, shutdown) = (shared.clone(), shutdown.clone());
    tokio::spawn(async move {
        let mut changed = nodes.changed();
        loop {
            let snapshot = changed.borrow_and_update().clone();
            if snapshot.synced {
                shared.update(|sources| sources.nodes.clone_from(&snapshot.nodes));
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                changed = changed.changed() => if changed.is_err() { return },
            }
        }
    });
}

async fn follow<F: Followed>(shared: Arc<Shared>, channel: Channel, shutdown: CancellationToken) {
    let mut backoff = Backoff::new(RETRY_INITIAL, RETRY_MAX);
    // The cursor of the last event applied, kept across streams.
    let mut cursor = 0;
    loop {
        let ended = tokio::select! {
            () = shutdown.cancelled() => return,
            ended = follow_once::<F>(&shared, channel.clone(), &mut cursor, &mut backoff) => ended,
        };
        let wait = backoff.next_delay();
        tracing::warn!(what = F::WHAT, error = %ended, retry_in = ?wait, "the route source's stream ended");
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
        }
    }
}

/// Follows one stream until it breaks; why it did.
async fn follow_once<F: Followed>(
    shared: &Shared,
    channel: Channel,
    cursor: &mut u64,
    backoff: &mut Backoff,
) -> String {
    let mut stream = match F::open(channel, *cursor).await {
        Ok(stream) => stream,
        Err(status) => return format!("{}: {}", status.code(), status.message()),
    };
    let mut stream_state = Stream::default();
    loop {
        let event = match stream.message().await {
            Ok(Some(event)) => event,
            Ok(None) => return "the server closed it".into(),
            Err(status) => return format!("{}: {}", status.code(), status.message()),
        };
        let received = F::split(event);
        let synced = received.kind == EventKind::Synced;
        if let Some(apply) = stream_state.receive(received, cursor) {
            shared.update(|sources| apply.to(F::slot(sources), F::key));
        }
        if synced {
            backoff.reset();
            tracing::info!(what = F::WHAT, "following the route source");
        }
    }
}

/// One event as the follower reads it.
pub(crate) struct Received<T> {
    kind: EventKind,
    object: Option<T>,
    /// Where to resume after it; 0 for none.
    cursor: u64,
    /// On `SYNCED`: whether the stream resumed rather than started afresh.
    resumed: bool,
}

/// One stream's progress: what it sent before its `SYNCED`, staged.
struct Stream<T> {
    staged: Option<Vec<(EventKind, T)>>,
    /// The last cursor among the staged events.
    staged_cursor: u64,
}

impl<T> Default for Stream<T> {
    fn default() -> Self {
        Stream { staged: Some(Vec::new()), staged_cursor: 0 }
    }
}

/// What an event does to the kind's state.
enum Apply<T> {
    /// Replace it with these objects (a stream that started afresh).
    Replace(Vec<(EventKind, T)>),
    /// Apply these changes onto it.
    Changes(Vec<(EventKind, T)>),
}

impl<T> Apply<T> {
    fn to(self, state: &mut BTreeMap<String, T>, key: fn(&T) -> String) {
        let changes = match self {
            Apply::Replace(changes) => {
                state.clear();
                changes
            }
            Apply::Changes(changes) => changes,
        };
        for (kind, object) in changes {
            match kind {
                EventKind::Upsert => {
                    state.insert(key(&object), object);
                }
                // A resumed stream may remove what was never held: nothing to do.
                EventKind::Removed => {
                    state.remove(&key(&object));
                }
                EventKind::Synced | EventKind::Unspecified => {}
            }
        }
    }
}

impl<T> Stream<T> {
    /// Takes in one event; what it does to the state, if anything yet.
    /// `cursor` follows the last change applied.
    fn receive(&mut self, received: Received<T>, cursor: &mut u64) -> Option<Apply<T>> {
        let Received { kind, object, cursor: at, resumed } = received;
        match (&mut self.staged, kind, object) {
            (Some(_), EventKind::Synced, _) => {
                let staged = self.staged.take().unwrap_or_default();
                let last = if at != 0 { at } else { self.staged_cursor };
                // A fresh stream's cursor replaces the old one, which
                // predates the state it replaced, even when it has none.
                if last != 0 || !resumed {
                    *cursor = last;
                }
                Some(if resumed { Apply::Changes(staged) } else { Apply::Replace(staged) })
            }
            (Some(staged), kind @ (EventKind::Upsert | EventKind::Removed), Some(object)) => {
                staged.push((kind, object));
                if at != 0 {
                    self.staged_cursor = at;
                }
                None
            }
            (None, kind @ (EventKind::Upsert | EventKind::Removed), Some(object)) => {
                if at != 0 {
                    *cursor = at;
                }
                Some(Apply::Changes(vec![(kind, object)]))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(kind: EventKind, name: &str, cursor: u64) -> Received<String> {
        Received { kind, object: Some(name.to_string()), cursor, resumed: false }
    }

    fn synced(cursor: u64, resumed: bool) -> Received<String> {
        Received { kind: EventKind::Synced, object: None, cursor, resumed }
    }

    /// Feeds `events` to a fresh stream over `state`; the cursor after.
    fn feed(state: &mut BTreeMap<String, String>, cursor: &mut u64, events: Vec<Received<String>>) {
        let mut stream = Stream::default();
        for received in events {
            if let Some(apply) = stream.receive(received, cursor) {
                apply.to(state, String::clone);
            }
        }
    }

    #[test]
    fn a_resumed_stream_applies_what_changed_and_a_fresh_one_replaces_the_state() {
        let (mut state, mut cursor) = (BTreeMap::new(), 0);
        // Afresh: the open set, then SYNCED with the read's cursor, then changes.
        let first = vec![
            event(EventKind::Upsert, "a", 0),
            event(EventKind::Upsert, "b", 0),
            synced(10, false),
            event(EventKind::Upsert, "c", 11),
        ];
        feed(&mut state, &mut cursor, first);
        assert_eq!(state.keys().collect::<Vec<_>>(), ["a", "b", "c"]);
        assert_eq!(cursor, 11, "the last change applied");

        // Broken before its SYNCED: nothing staged is applied, and the
        // cursor stays where the applied state is.
        feed(&mut state, &mut cursor, vec![event(EventKind::Removed, "a", 12)]);
        assert_eq!(state.keys().collect::<Vec<_>>(), ["a", "b", "c"]);
        assert_eq!(cursor, 11);

        // Resumed: only the changes since, applied onto what is held; a
        // removal of what was never held changes nothing.
        let resumed = vec![
            event(EventKind::Removed, "a", 12),
            event(EventKind::Removed, "never-held", 13),
            event(EventKind::Upsert, "d", 14),
            Received { kind: EventKind::Synced, object: None, cursor: 0, resumed: true },
        ];
        feed(&mut state, &mut cursor, resumed);
        assert_eq!(state.keys().collect::<Vec<_>>(), ["b", "c", "d"]);
        assert_eq!(cursor, 14, "a resumed SYNCED without a cursor keeps the last change's");

        // Afresh again (the ledger forgot the cursor): the open set replaces all.
        feed(&mut state, &mut cursor, vec![event(EventKind::Upsert, "e", 0), synced(0, false)]);
        assert_eq!(state.keys().collect::<Vec<_>>(), ["e"]);
        assert_eq!(cursor, 0, "a fresh stream without a cursor leaves none to resume from");
    }
}
