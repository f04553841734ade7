//! `WatchServices`: every current service in scope as an UPSERT, then
//! SYNCED, then each change as it happens, wherever it was made.
//!
//! # Expected flow
//! A feed subscribes to change notifications before it reads, so no change
//! falls between the read and the subscription. A notification names a
//! service; the feed reads it and sends it if its version moved (UPSERT) or
//! it is gone (REMOVED, with the last state sent). A bus gap, or the resync
//! timer, re-reads the whole scope and sends the difference, so a lost
//! notification delays a change but never loses it.

use std::collections::BTreeMap;
use std::sync::Arc;

use berth_bus::{BusMessage, Subscription};
use berth_proto::revisions::v1;
use berth_proto::types::v1::EventKind;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::catalog::{CatalogError, Scope};
use crate::model::ServiceKey;
use crate::records::ServiceRow;
use crate::shared::Core;
use crate::signals::CHANGES_TOPIC;

/// Events a slow watcher may have waiting before the feed waits for it.
const WATCH_BUFFER: usize = 256;

/// Why a feed stops.
enum Stop {
    /// The client went away.
    Gone,
    /// The catalog failed; the client is told to watch again.
    Failed(CatalogError),
}

/// Opens a feed of the services in `scope`.
pub(crate) fn open(core: Arc<Core>, scope: Scope) -> tonic::codegen::BoxStream<v1::ServiceEvent> {
    let (events, stream) = mpsc::channel(WATCH_BUFFER);
    tokio::spawn(async move {
        let subscription = match core.signals.bus().subscribe(CHANGES_TOPIC).await {
            Ok(subscription) => Some(subscription),
            Err(error) => {
                tracing::warn!(%error, "a service watch cannot follow changes on the bus; it re-reads on a timer");
                None
            }
        };
        let feed = Feed { core, scope, events, sent: BTreeMap::new() };
        feed.run(subscription).await;
    });
    Box::pin(ReceiverStream::new(stream))
}

struct Feed {
    core: Arc<Core>,
    scope: Scope,
    events: mpsc::Sender<Result<v1::ServiceEvent, tonic::Status>>,
    /// What this stream has shown and not removed: each service's version and last state.
    sent: BTreeMap<ServiceKey, (i64, v1::Service)>,
}

impl Feed {
    async fn run(mut self, mut subscription: Option<Subscription>) {
        if let Err(stop) = self.level().await {
            return self.stop(stop).await;
        }
        if self.event(EventKind::Synced, None).await.is_err() {
            return;
        }
        let mut resync = tokio::time::interval(self.core.config.watch_resync);
        resync.tick().await;
        loop {
            let step = tokio::select! {
                () = self.events.closed() => return,
                () = self.core.closing.cancelled() => {
                    let _ = self.events.send(Err(tonic::Status::unavailable("revisions is shutting down; watch again"))).await;
                    return;
                }
                _ = resync.tick() => self.level().await,
                message = next_message(&mut subscription) => match message {
                    Some(BusMessage::Payload(payload)) => {
                        match std::str::from_utf8(&payload).ok().and_then(ServiceKey::decode) {
                            Some(key) if self.wants(&key) => self.follow(&key).await,
                            _ => Ok(()),
                        }
                    }
                    Some(BusMessage::Gap) => self.level().await,
                    None => {
                        subscription = None;
                        Ok(())
                    }
                },
            };
            if let Err(stop) = step {
                return self.stop(stop).await;
            }
        }
    }

    async fn stop(&self, stop: Stop) {
        if let Stop::Failed(error) = stop {
            let _ = self.events.send(Err(error.into())).await;
        }
    }

    fn wants(&self, key: &ServiceKey) -> bool {
        match &self.scope {
            Scope::All => true,
            Scope::Project(project) => key.project == *project,
        }
    }

    /// Sends what changed in the whole scope since it was last shown.
    async fn level(&mut self) -> Result<(), Stop> {
        let rows = self.core.catalog.services(&self.scope).await.map_err(Stop::Failed)?;
        let present: std::collections::HashSet<ServiceKey> = rows.iter().map(|r| r.key.clone()).collect();
        for row in rows {
            self.show(row).await?;
        }
        let gone: Vec<ServiceKey> = self.sent.keys().filter(|k| !present.contains(*k)).cloned().collect();
        for key in gone {
            self.remove(&key).await?;
        }
        Ok(())
    }

    /// Sends `key`'s state if it changed since it was last shown.
    async fn follow(&mut self, key: &ServiceKey) -> Result<(), Stop> {
        match self.core.catalog.service(key).await.map_err(Stop::Failed)? {
            Some(row) => self.show(row).await,
            None => self.remove(key).await,
        }
    }

    async fn show(&mut self, row: ServiceRow) -> Result<(), Stop> {
        if self.sent.get(&row.key).is_some_and(|(version, _)| *version == row.version) {
            return Ok(());
        }
        let service = row.to_proto();
        self.sent.insert(row.key.clone(), (row.version, service.clone()));
        self.event(EventKind::Upsert, Some(service)).await
    }

    async fn remove(&mut self, key: &ServiceKey) -> Result<(), Stop> {
        match self.sent.remove(key) {
            Some((_, last)) => self.event(EventKind::Removed, Some(last)).await,
            None => Ok(()),
        }
    }

    async fn event(&self, kind: EventKind, service: Option<v1::Service>) -> Result<(), Stop> {
        self.events.send(Ok(v1::ServiceEvent { kind: kind as i32, service })).await.map_err(|_| Stop::Gone)
    }
}

async fn next_message(subscription: &mut Option<Subscription>) -> Option<BusMessage> {
    match subscription {
        Some(subscription) => subscription.recv().await,
        None => std::future::pending().await,
    }
}
