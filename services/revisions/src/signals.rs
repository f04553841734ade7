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
//!
//! # Traces
//! A wake-up carries the W3C `traceparent` of the call that caused it (an
//! apply, a pin, a delete): the bus payload is the key, then a newline and
//! the traceparent when there is one. The reconciler runs that service's
//! reconciles as children of it until the service settles, so one trace
//! shows an apply through revisions, leases and the node that launches it.

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

/// A service to reconcile, and the trace of the call that asked for it
/// (empty when that call was not traced).
pub(crate) type Wake = berth_runtime::Trigger<ServiceKey>;

/// The bus payload of a wake-up: the key, then `\n` and the traceparent when
/// there is one.
pub(crate) fn encode(wake: &Wake) -> Vec<u8> {
    let mut payload = wake.key.encode();
    if !wake.traceparent.is_empty() {
        payload.push('\n');
        payload.push_str(&wake.traceparent);
    }
    payload.into_bytes()
}

/// Reads a payload [`encode`] made (or a bare key); `None` when it names no
/// service.
pub(crate) fn decode(payload: &[u8]) -> Option<Wake> {
    let text = std::str::from_utf8(payload).ok()?;
    let (key, traceparent) = text.split_once('\n').unwrap_or((text, ""));
    Some(Wake { key: ServiceKey::decode(key)?, traceparent: traceparent.to_owned() })
}

/// Publishes changes and wake-ups; cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct Signals {
    bus: Bus,
    local: mpsc::Sender<Wake>,
}

impl Signals {
    pub(crate) fn new(bus: Bus) -> (Self, mpsc::Receiver<Wake>) {
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

    /// Wakes this replica's reconciler for `key`, if it leads: for what every
    /// replica hears alike (a lease of the service changed), so no one else
    /// needs telling.
    pub(crate) fn wake_here(&self, key: ServiceKey) {
        // A full queue is covered by the periodic full pass.
        let _ = self.local.try_send(Wake { key, traceparent: String::new() });
    }

    /// Wakes the reconciler (wherever it leads) for `key`, and tells watchers.
    pub(crate) async fn wake(&self, key: &ServiceKey) {
        let wake = Wake { key: key.clone(), traceparent: berth_telemetry::current_traceparent() };
        let payload = encode(&wake);
        let _ = self.local.try_send(wake);
        if let Err(error) = self.bus.publish(WAKE_TOPIC, payload).await {
            tracing::debug!(%error, service = %key, "could not wake the reconciler; its next pass acts");
        }
        self.changed(key).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wake_reads_back_with_or_without_its_trace() {
        let Some(key) = ServiceKey::decode("acme/web") else { panic!("a valid key") };
        let traced =
            Wake { key: key.clone(), traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into() };
        assert_eq!(decode(&encode(&traced)), Some(traced));
        let bare = Wake { key, traceparent: String::new() };
        assert_eq!(encode(&bare), b"acme/web");
        assert_eq!(decode(b"acme/web"), Some(bare));
        assert_eq!(decode(b"\xff"), None);
        assert_eq!(decode(b""), None);
    }
}
