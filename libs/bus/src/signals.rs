//! Keyed wake-up signals across replicas: how a replica's long-lived streams
//! (a node's lease assignments, a node's egress state) learn that what they
//! show changed, whichever replica changed it.
//!
//! # Expected flow
//! A replica that commits a change for some keys (node ids, say) wakes its
//! own streams for those keys at once ([`KeySignals::announce`]) and
//! publishes the keys, one per line, on the signal's topic. Every replica
//! follows the topic ([`KeySignals::spawn_follower`]) and wakes its streams
//! for the keys named. A signal carries no data: a woken stream re-reads
//! its state from the database.
//!
//! # Invariants
//! - Level-triggered: a lost signal delays a change until the stream's next
//!   periodic re-read, never loses it. A bus gap, or a broken subscription,
//!   wakes every stream.
//! - One waiter per stream, coalescing: however many signals arrive while a
//!   stream reads, it reads once more.
//! - Wakers of streams that ended are dropped as they are found.
//! - An observer ([`KeySignals::observe`]) hears every key woken, for
//!   streams that follow many keys (a prefix, a whole project) rather than
//!   one. One that falls behind, and every observer on a gap, hears
//!   [`Signal::All`]: whatever it follows may have changed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{broadcast, watch};
use tokio_util::sync::CancellationToken;

use crate::{Bus, BusMessage};

/// First wait before subscribing again after the subscription broke; doubles up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(100);

/// Longest wait between subscription attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// How many signals an observer may fall behind before it hears [`Signal::All`].
const OBSERVER_BACKLOG: usize = 1024;

/// What an observer of every key hears.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Signal {
    /// What these keys show may have changed.
    Keys(Arc<[String]>),
    /// What any key shows may have changed (signals were lost).
    All,
}

/// A replica's wakers for one topic, one per key with a live stream; cheap to clone.
#[derive(Debug, Clone)]
pub struct KeySignals {
    topic: &'static str,
    wakers: Arc<Mutex<HashMap<String, watch::Sender<u64>>>>,
    observers: broadcast::Sender<Signal>,
}

impl KeySignals {
    /// Signals published and followed on the bus topic `topic`.
    pub fn new(topic: &'static str) -> Self {
        Self { topic, wakers: Arc::default(), observers: broadcast::channel(OBSERVER_BACKLOG).0 }
    }

    /// Hears every key woken on this replica from now on. A receive that
    /// reports it lagged stands for [`Signal::All`].
    pub fn observe(&self) -> broadcast::Receiver<Signal> {
        self.observers.subscribe()
    }

    /// A receiver that changes whenever what `key` shows may have changed.
    pub fn watch(&self, key: &str) -> watch::Receiver<u64> {
        let mut wakers = self.wakers.lock().unwrap_or_else(PoisonError::into_inner);
        wakers.entry(key.to_owned()).or_insert_with(|| watch::channel(0).0).subscribe()
    }

    /// Wakes the streams of `keys` on this replica.
    pub fn wake<'a>(&self, keys: impl IntoIterator<Item = &'a str>) {
        let observed = self.observers.receiver_count() > 0;
        let mut heard: Vec<String> = Vec::new();
        let mut wakers = self.wakers.lock().unwrap_or_else(PoisonError::into_inner);
        for key in keys {
            if observed {
                heard.push(key.to_owned());
            }
            match wakers.get(key) {
                Some(waker) if waker.receiver_count() == 0 => {
                    wakers.remove(key);
                }
                Some(waker) => waker.send_modify(|n| *n = n.wrapping_add(1)),
                None => {}
            }
        }
        drop(wakers);
        if !heard.is_empty() {
            // No observer left is no one to tell.
            let _ = self.observers.send(Signal::Keys(heard.into()));
        }
    }

    /// Wakes every stream on this replica, after signals may have been lost.
    pub fn wake_all(&self) {
        let mut wakers = self.wakers.lock().unwrap_or_else(PoisonError::into_inner);
        wakers.retain(|_, waker| waker.receiver_count() > 0);
        for waker in wakers.values() {
            waker.send_modify(|n| *n = n.wrapping_add(1));
        }
        let _ = self.observers.send(Signal::All);
    }

    /// Wakes `keys` here, then tells the other replicas through `bus`. A
    /// failed publish is logged: their streams catch up at their next re-read.
    pub async fn announce(&self, bus: &Bus, keys: &[String]) {
        if keys.is_empty() {
            return;
        }
        self.wake(keys.iter().map(String::as_str));
        if let Err(error) = bus.publish(self.topic, keys.join("\n")).await {
            tracing::warn!(%error, topic = self.topic, keys = keys.len(), "could not announce changes on the bus");
        }
    }

    /// Follows the topic until `stop`, waking streams as signals arrive.
    pub fn spawn_follower(&self, bus: Bus, stop: CancellationToken) {
        let signals = self.clone();
        let topic = self.topic;
        tokio::spawn(async move {
            let mut backoff = MIN_BACKOFF;
            loop {
                let subscribed = tokio::select! {
                    () = stop.cancelled() => return,
                    subscribed = bus.subscribe(topic) => subscribed,
                };
                match subscribed {
                    Ok(mut subscription) => {
                        backoff = MIN_BACKOFF;
                        // Whatever was published while unsubscribed is unknown.
                        signals.wake_all();
                        loop {
                            let message = tokio::select! {
                                () = stop.cancelled() => return,
                                message = subscription.recv() => message,
                            };
                            match message {
                                Some(BusMessage::Payload(payload)) => {
                                    let text = String::from_utf8_lossy(&payload);
                                    signals.wake(text.lines().filter(|line| !line.is_empty()));
                                }
                                Some(BusMessage::Gap) => signals.wake_all(),
                                None => break,
                            }
                        }
                        tracing::warn!(topic, "the bus subscription for change signals ended; subscribing again");
                    }
                    Err(error) => tracing::warn!(%error, topic, "cannot subscribe to change signals; retrying"),
                }
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test")]

    use super::*;
    use crate::MemoryBus;

    #[tokio::test]
    async fn a_signal_wakes_only_its_key_and_coalesces() {
        let signals = KeySignals::new("t");
        let mut one = signals.watch("n-1");
        let two = signals.watch("n-2");
        signals.wake(["n-1", "n-1", "n-3"]);
        assert!(one.has_changed().unwrap());
        assert!(!two.has_changed().unwrap());
        one.borrow_and_update();
        assert!(!one.has_changed().unwrap());
        signals.wake_all();
        assert!(one.has_changed().unwrap() && two.has_changed().unwrap());
    }

    #[tokio::test]
    async fn an_observer_hears_every_key_woken_and_all_on_a_gap() {
        let signals = KeySignals::new("t");
        signals.wake(["before"]);
        let mut observer = signals.observe();
        signals.wake(["n-1", "n-2"]);
        assert_eq!(observer.recv().await.unwrap(), Signal::Keys(vec!["n-1".to_owned(), "n-2".to_owned()].into()));
        signals.wake_all();
        assert_eq!(observer.recv().await.unwrap(), Signal::All);
        for _ in 0..=OBSERVER_BACKLOG {
            signals.wake(["n-1"]);
        }
        assert!(matches!(observer.recv().await, Err(broadcast::error::RecvError::Lagged(_))), "a laggard is told");
    }

    #[tokio::test]
    async fn wakers_of_closed_streams_are_dropped() {
        let signals = KeySignals::new("t");
        drop(signals.watch("n-1"));
        signals.wake(["n-1"]);
        assert!(signals.wakers.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn an_announcement_on_one_replica_wakes_the_stream_on_another() {
        let bus = Bus::new(MemoryBus::new(), "svc").unwrap();
        let (here, there) = (KeySignals::new("changes"), KeySignals::new("changes"));
        let stop = CancellationToken::new();
        there.spawn_follower(bus.clone(), stop.clone());
        let mut watched = there.watch("n-7");
        let mut other = there.watch("n-8");
        // The follower wakes everything once subscribed; start from there.
        tokio::time::timeout(Duration::from_secs(5), watched.changed()).await.unwrap().unwrap();
        other.borrow_and_update();
        here.announce(&bus, &["n-7".to_owned()]).await;
        tokio::time::timeout(Duration::from_secs(5), watched.changed()).await.unwrap().unwrap();
        assert!(!other.has_changed().unwrap(), "only the key announced is woken");
        stop.cancel();
    }
}
