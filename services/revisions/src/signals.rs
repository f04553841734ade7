//! Who hears about a change to a service: the deploy reconciler (woken to
//! act on it) and `WatchServices` streams (sent its new state), on every
//! replica, through the bus.
//!
//! # Delivery
//! Bus messages are hints carrying a service key (`project/name`); losing
//! one costs latency, never correctness: the reconciler requeues every
//! service on a timer and re-reads everything on a gap, and watch streams
//! re-read everything on a gap and on a timer. A wake-up is also handed to
//! this replica's own reconciler directly, so a leader whose bus is down
//! still acts on the applies it serves.

use berth_bus::Bus;
use tokio::sync::mpsc;

use crate::model::ServiceKey;

/// Published when a service's shown state changed; watch streams follow it.
pub(crate) const CHANGES_TOPIC: &str = "services.changed";

/// Published when a service's declaration changed; the reconciler follows it.
pub(crate) const WAKE_TOPIC: &str = "services.wake";

/// How many local wake-ups may wait for the reconciler before more are dropped
/// (the periodic full pass covers them).
pub(crate) const LOCAL_WAKE_QUEUE: usize = 1024;

/// Publishes changes and wake-ups; cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct Signals {
    bus: Bus,
    local: mpsc::Sender<ServiceKey>,
}

impl Signals {
    pub(crate) fn new(bus: Bus) -> (Self, mpsc::Receiver<ServiceKey>) {
        let (local, receiver) = mpsc::channel(LOCAL_WAKE_QUEUE);
        (Self { bus, local }, receiver)
    }

    pub(crate) fn bus(&self) -> &Bus {
        &self.bus
    }

    /// Tells watch streams on every replica that `key` changed.
    pub(crate) async fn changed(&self, key: &ServiceKey) {
        if let Err(error) = self.bus.publish(CHANGES_TOPIC, key.encode().into_bytes()).await {
            tracing::debug!(%error, service = %key, "could not announce a change; watchers resync on their own");
        }
    }

    /// Wakes the reconciler (wherever it leads) for `key`, and tells watchers.
    pub(crate) async fn wake(&self, key: &ServiceKey) {
        let _ = self.local.try_send(key.clone());
        if let Err(error) = self.bus.publish(WAKE_TOPIC, key.encode().into_bytes()).await {
            tracing::debug!(%error, service = %key, "could not wake the reconciler; its next pass acts");
        }
        self.changed(key).await;
    }
}
