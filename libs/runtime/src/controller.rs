//! The keyed, level-triggered controller an elected loop runs while it leads
//! (in the spirit of kube-runtime's): a queue of keys, each reconciled to
//! what its stored state asks for, never two reconciles of one key at once.
//!
//! # Expected flow
//! [`run_controller`] runs for one term (inside [`Leader::lead`]). It queues
//! every key at once and again every `full_resync` (a level-triggered
//! controller acts on state, not on events, so whatever happened while no
//! one led is acted on), and a key whenever a trigger names it: sent on the
//! local channel (by the replica's own handlers) or published on the bus by
//! another replica. Up to `workers` keys are reconciled at once. Each
//! reconcile says what next: look again after a while, or wait for a
//! trigger.
//!
//! A controller may coalesce triggers ([`Coalesce`]): a triggered key is
//! then due `debounce` after its last trigger, but no later than
//! `max_delay` after the first one still pending, so a burst of N triggers
//! costs about `burst length / max_delay + 1` reconciles, not N.
//!
//! # Invariants
//! - One reconcile per key at a time; a key triggered while it runs is
//!   reconciled again once it ends.
//! - A reconcile runs at most `reconcile_timeout`; past it, it is stopped and
//!   counted as failed, so one call that never returns cannot hold a key
//!   still.
//! - A failed reconcile is retried after a wait that doubles from
//!   `retry_base` and never exceeds `retry_max`.
//! - A reconcile that finds its term gone (a fenced write) ends the term:
//!   [`run_controller`] returns, and its [`Leader`] waits to lead again.
//! - A lost bus message (a gap) queues every key.
//!
//! [`Leader`]: crate::Leader
//! [`Leader::lead`]: crate::Leader::lead

use std::collections::{HashMap, HashSet};
use std::fmt::Display;
use std::future::Future;
use std::hash::Hash;
use std::sync::Arc;
use std::time::Duration;

use berth_bus::{BusMessage, Subscription};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// What a reconcile asks for next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Look again after this long, triggered or not.
    Requeue(Duration),
    /// Nothing to do until a trigger names the key.
    AwaitChange,
}

/// A key to reconcile now, and the trace of the call that changed it
/// (W3C `traceparent`, empty for none): its reconciles join that trace until
/// the key settles.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trigger<K> {
    /// What to reconcile.
    pub key: K,
    /// The trace to join.
    pub traceparent: String,
}

/// How a controller paces itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControllerConfig {
    /// Keys reconciled at once.
    pub workers: usize,
    /// The longest one reconcile may take.
    pub reconcile_timeout: Duration,
    /// How often every key is queued.
    pub full_resync: Duration,
    /// The first wait after a failed reconcile.
    pub retry_base: Duration,
    /// The longest wait after failed reconciles.
    pub retry_max: Duration,
    /// How triggers are coalesced; `None` reconciles a triggered key at once.
    pub coalesce: Option<Coalesce>,
}

/// How long a triggered key waits for more triggers (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coalesce {
    /// Due this long after the last trigger...
    pub debounce: Duration,
    /// ...but no later than this long after the first one pending.
    pub max_delay: Duration,
}

impl ControllerConfig {
    /// The wait before trying a key again after `failures` failed reconciles
    /// in a row: doubling from `retry_base`, never longer than `retry_max`.
    pub fn backoff(&self, failures: u32) -> Duration {
        self.retry_base.saturating_mul(1 << failures.min(16)).min(self.retry_max)
    }
}

/// The work of one controller, for one term.
pub trait Reconciler: Send + Sync + 'static {
    /// What is reconciled (a service's project and name).
    type Key: Clone + Eq + Hash + Ord + Display + Send + Sync + 'static;
    /// Why a reconcile or a listing failed.
    type Error: Display + Send + 'static;

    /// Makes `key`'s world what its stored state asks for, every write
    /// fenced on the term.
    fn reconcile(self: Arc<Self>, key: Self::Key) -> impl Future<Output = Result<Action, Self::Error>> + Send;

    /// Every key there is, for a full pass.
    fn keys(&self) -> impl Future<Output = Result<Vec<Self::Key>, Self::Error>> + Send + '_;

    /// Whether `error` says the term is gone.
    fn is_deposed(error: &Self::Error) -> bool;

    /// The error of a reconcile stopped after `limit`.
    fn timed_out(limit: Duration) -> Self::Error;
}

/// Where triggers come from besides the controller's own requeues.
pub struct Triggers<'a, K> {
    /// Triggers sent by this replica.
    pub local: &'a mut mpsc::Receiver<Trigger<K>>,
    /// Triggers other replicas publish, and how to read one; `None` when the
    /// bus could not be followed (full passes still run).
    pub bus: Option<(Subscription, DecodeTrigger<K>)>,
}

/// Reads a trigger from a bus payload; `None` when it names no key.
pub type DecodeTrigger<K> = Box<dyn Fn(&[u8]) -> Option<Trigger<K>> + Send + Sync>;

impl<K> std::fmt::Debug for Triggers<'_, K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Triggers").field("follows_bus", &self.bus.is_some()).finish_non_exhaustive()
    }
}

/// A finished reconcile: its key and how it went.
type Outcome<R> = (<R as Reconciler>::Key, Result<Action, <R as Reconciler>::Error>);

/// Runs `reconciler` until a reconcile finds the term gone (see the module
/// docs); the caller drops the future when the term is lost otherwise.
pub async fn run_controller<R: Reconciler>(
    reconciler: Arc<R>,
    config: ControllerConfig,
    triggers: Triggers<'_, R::Key>,
) {
    let Triggers { local, mut bus } = triggers;
    let mut queue: Queue<R::Key> = Queue { coalesce: config.coalesce, ..Queue::default() };
    let mut reconciles: JoinSet<Outcome<R>> = JoinSet::new();
    let mut full_pass = tokio::time::interval(config.full_resync);
    let workers = config.workers.max(1);
    loop {
        for key in queue.take_ready(workers.saturating_sub(queue.running.len())) {
            let span = tracing::info_span!("reconcile", key = %key);
            if let Some(traceparent) = queue.traces.get(&key) {
                berth_telemetry::adopt_traceparent(&span, traceparent);
            }
            let reconciler = Arc::clone(&reconciler);
            let limit = config.reconcile_timeout;
            reconciles.spawn(async move {
                let reconciled = tracing::Instrument::instrument(reconciler.reconcile(key.clone()), span);
                let result = tokio::time::timeout(limit, reconciled).await.unwrap_or_else(|_| Err(R::timed_out(limit)));
                (key, result)
            });
        }
        let next_due = queue.next_due();
        tokio::select! {
            _ = full_pass.tick() => match reconciler.keys().await {
                Ok(keys) => {
                    let now = Instant::now();
                    for key in keys {
                        queue.schedule(key, now);
                    }
                }
                Err(error) => tracing::warn!(%error, "listing every key for a full pass failed"),
            },
            Some(trigger) = local.recv() => queue.trigger(trigger),
            message = next_message(&mut bus) => match message {
                Some(BusMessage::Payload(payload)) => {
                    if let Some(trigger) = bus.as_ref().and_then(|(_, decode)| decode(&payload)) {
                        queue.trigger(trigger);
                    }
                }
                Some(BusMessage::Gap) => full_pass.reset_immediately(),
                None => bus = None,
            },
            () = sleep_until(next_due) => {}
            Some(joined) = reconciles.join_next() => {
                let Ok((key, result)) = joined else { continue };
                queue.running.remove(&key);
                match result {
                    Ok(action) => {
                        queue.failures.remove(&key);
                        match action {
                            Action::Requeue(after) => queue.schedule(key, Instant::now() + after),
                            Action::AwaitChange => {
                                queue.traces.remove(&key);
                            }
                        }
                    }
                    Err(error) if R::is_deposed(&error) => {
                        tracing::info!(key = %key, "deposed while reconciling");
                        break;
                    }
                    Err(error) => {
                        let failures = queue.failures.entry(key.clone()).or_default();
                        *failures = failures.saturating_add(1);
                        let backoff = config.backoff(*failures);
                        tracing::warn!(key = %key, %error, retry_in = ?backoff, "reconcile failed");
                        queue.schedule(key, Instant::now() + backoff);
                    }
                }
            }
        }
    }
    reconciles.abort_all();
    while reconciles.join_next().await.is_some() {}
}

/// The queue of one term: when each key is due, which are running, how many
/// times in a row each failed, and the trace each was last triggered in.
#[derive(Debug)]
struct Queue<K> {
    coalesce: Option<Coalesce>,
    due: HashMap<K, Instant>,
    /// When the first of a key's coalesced triggers came, while it waits.
    pending_since: HashMap<K, Instant>,
    running: HashSet<K>,
    failures: HashMap<K, u32>,
    traces: HashMap<K, String>,
}

impl<K> Default for Queue<K> {
    fn default() -> Self {
        Self {
            coalesce: None,
            due: HashMap::new(),
            pending_since: HashMap::new(),
            running: HashSet::new(),
            failures: HashMap::new(),
            traces: HashMap::new(),
        }
    }
}

impl<K: Clone + Eq + Hash + Ord> Queue<K> {
    /// Makes the key due now, or when coalescing says; its reconciles join
    /// the trigger's trace until the key settles (or a later trigger's trace
    /// replaces it).
    fn trigger(&mut self, trigger: Trigger<K>) {
        if !trigger.traceparent.is_empty() {
            self.traces.insert(trigger.key.clone(), trigger.traceparent);
        }
        let now = Instant::now();
        let Some(Coalesce { debounce, max_delay }) = self.coalesce else {
            self.schedule(trigger.key, now);
            return;
        };
        let already_pending = self.pending_since.contains_key(&trigger.key);
        let first = *self.pending_since.entry(trigger.key.clone()).or_insert(now);
        let at = (now + debounce).min(first + max_delay);
        match self.due.get_mut(&trigger.key) {
            // Pending triggers: a later one moves the time on, up to the bound.
            Some(due) if already_pending => *due = at,
            _ => self.schedule(trigger.key, at),
        }
    }

    /// Makes `key` due at `at`, or sooner if it already was.
    fn schedule(&mut self, key: K, at: Instant) {
        let due = self.due.entry(key).or_insert(at);
        if at < *due {
            *due = at;
        }
    }

    /// When the first key that is not running falls due.
    fn next_due(&self) -> Option<Instant> {
        self.due.iter().filter(|(key, _)| !self.running.contains(*key)).map(|(_, at)| *at).min()
    }

    /// Keys due now and not running, soonest first, at most `room`; they
    /// count as running from here.
    fn take_ready(&mut self, room: usize) -> Vec<K> {
        let now = Instant::now();
        let mut ready: Vec<(Instant, K)> = self
            .due
            .iter()
            .filter(|(key, at)| **at <= now && !self.running.contains(*key))
            .map(|(key, at)| (*at, key.clone()))
            .collect();
        ready.sort();
        ready.truncate(room);
        for (_, key) in &ready {
            self.due.remove(key);
            self.pending_since.remove(key);
            self.running.insert(key.clone());
        }
        ready.into_iter().map(|(_, key)| key).collect()
    }
}

async fn next_message<K>(bus: &mut Option<(Subscription, DecodeTrigger<K>)>) -> Option<BusMessage> {
    match bus {
        Some((subscription, _)) => subscription.recv().await,
        None => std::future::pending().await,
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    const CONFIG: ControllerConfig = ControllerConfig {
        workers: 2,
        reconcile_timeout: Duration::from_secs(5),
        full_resync: Duration::from_secs(3600),
        retry_base: Duration::from_millis(100),
        retry_max: Duration::from_secs(10),
        coalesce: None,
    };

    const COALESCE: Coalesce = Coalesce { debounce: Duration::from_millis(100), max_delay: Duration::from_secs(1) };

    fn coalescing() -> Queue<&'static str> {
        Queue { coalesce: Some(COALESCE), ..Queue::default() }
    }

    fn trigger(key: &'static str) -> Trigger<&'static str> {
        Trigger { key, traceparent: String::new() }
    }

    #[tokio::test(start_paused = true)]
    async fn a_coalesced_burst_is_one_reconcile_once_it_goes_quiet() {
        let mut queue = coalescing();
        for _ in 0..1000 {
            queue.trigger(trigger("team"));
        }
        assert!(queue.take_ready(5).is_empty(), "nothing before the debounce");
        tokio::time::advance(COALESCE.debounce).await;
        assert_eq!(queue.take_ready(5), ["team"]);
        assert_eq!(queue.next_due(), None, "taking it cleared every trigger of the burst");
    }

    #[tokio::test(start_paused = true)]
    async fn coalesced_triggers_that_never_stop_still_reconcile_every_max_delay() {
        let mut queue = coalescing();
        let started = Instant::now();
        let mut reconciles = 0;
        while started.elapsed() < Duration::from_secs(5) {
            queue.trigger(trigger("busy"));
            tokio::time::advance(Duration::from_millis(10)).await;
            let ready = queue.take_ready(5);
            reconciles += ready.len();
            for key in ready {
                queue.running.remove(key);
            }
        }
        assert!((4..=6).contains(&reconciles), "{reconciles} reconciles in 5 s of constant triggers");
    }

    #[tokio::test(start_paused = true)]
    async fn a_requeue_due_sooner_is_not_put_off_by_a_coalesced_trigger() {
        let mut queue = coalescing();
        queue.schedule("a", Instant::now());
        queue.trigger(trigger("a"));
        assert_eq!(queue.take_ready(5), ["a"], "already due now");
    }

    #[test]
    fn a_failing_key_is_tried_again_sooner_than_the_longest_wait() {
        assert_eq!(CONFIG.backoff(1), Duration::from_millis(200));
        assert_eq!(CONFIG.backoff(2), Duration::from_millis(400));
        for failures in [7, 8, 40, u32::MAX] {
            assert_eq!(CONFIG.backoff(failures), CONFIG.retry_max, "after {failures} failures");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_triggered_while_it_runs_runs_once_more_after_and_never_twice_at_once() {
        let mut queue = Queue::default();
        queue.trigger(Trigger { key: "a", traceparent: "00-trace".into() });
        queue.trigger(Trigger { key: "b", traceparent: String::new() });
        assert_eq!(queue.take_ready(1), ["a"], "one worker's room, the first due first");
        queue.trigger(Trigger { key: "a", traceparent: String::new() });
        assert_eq!(queue.take_ready(5), ["b"], "a runs, so only b is ready");
        queue.running.remove("a");
        assert_eq!(queue.take_ready(5), ["a"], "triggered while running: runs again once it ended");
        assert_eq!(queue.traces.get("a").map(String::as_str), Some("00-trace"), "an empty trace keeps the last");
    }

    #[tokio::test(start_paused = true)]
    async fn a_later_schedule_never_delays_an_earlier_one() {
        let mut queue = Queue::default();
        let now = Instant::now();
        queue.schedule("a", now + Duration::from_secs(1));
        queue.schedule("a", now + Duration::from_secs(9));
        assert_eq!(queue.next_due(), Some(now + Duration::from_secs(1)));
        assert!(queue.take_ready(5).is_empty(), "nothing due yet");
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(queue.take_ready(5), ["a"]);
        assert_eq!(queue.next_due(), None);
    }

    /// Records each reconcile, fails `flaky` a few times, and is deposed on `stop`.
    #[derive(Default)]
    struct Recorder {
        seen: Mutex<Vec<String>>,
        flaky_failures: Mutex<u32>,
    }

    #[derive(Debug)]
    enum TestError {
        Deposed,
        Failed,
        TimedOut,
    }

    impl Display for TestError {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "{self:?}")
        }
    }

    impl Reconciler for Recorder {
        type Key = String;
        type Error = TestError;

        async fn reconcile(self: Arc<Self>, key: String) -> Result<Action, TestError> {
            self.seen.lock().unwrap().push(key.clone());
            match key.as_str() {
                "stop" => Err(TestError::Deposed),
                "hang" => std::future::pending().await,
                "flaky" => {
                    let mut failures = self.flaky_failures.lock().unwrap();
                    if *failures < 3 {
                        *failures += 1;
                        return Err(TestError::Failed);
                    }
                    Ok(Action::AwaitChange)
                }
                "poll" => Ok(Action::Requeue(Duration::from_secs(1))),
                _ => Ok(Action::AwaitChange),
            }
        }

        async fn keys(&self) -> Result<Vec<String>, TestError> {
            Ok(vec!["flaky".into(), "hang".into(), "poll".into(), "settled".into()])
        }

        fn is_deposed(error: &TestError) -> bool {
            matches!(error, TestError::Deposed)
        }

        fn timed_out(_: Duration) -> TestError {
            TestError::TimedOut
        }
    }

    fn count(recorder: &Recorder, key: &str) -> usize {
        recorder.seen.lock().unwrap().iter().filter(|k| *k == key).count()
    }

    #[tokio::test(start_paused = true)]
    async fn every_key_is_reconciled_failures_retried_polls_repeated_and_a_deposed_reconcile_ends_the_term() {
        let recorder = Arc::new(Recorder::default());
        let (send, mut local) = mpsc::channel(8);
        let controller = {
            let recorder = Arc::clone(&recorder);
            tokio::spawn(async move {
                run_controller(recorder, CONFIG, Triggers { local: &mut local, bus: None }).await;
            })
        };
        tokio::time::sleep(Duration::from_millis(10_500)).await;
        assert_eq!(count(&recorder, "settled"), 1, "a settled key waits for a trigger");
        assert_eq!(count(&recorder, "flaky"), 4, "three failures, each retried after its backoff, then settled");
        assert!((10..=11).contains(&count(&recorder, "poll")), "requeued every second: {}", count(&recorder, "poll"));
        assert_eq!(count(&recorder, "hang"), 2, "stopped after 5 s, retried after its backoff, stopped again");

        send.send(Trigger { key: "settled".to_string(), traceparent: String::new() }).await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(count(&recorder, "settled"), 2, "a trigger reconciles it again");

        send.send(Trigger { key: "stop".to_string(), traceparent: String::new() }).await.unwrap();
        tokio::time::timeout(Duration::from_secs(1), controller)
            .await
            .expect("a deposed reconcile ends the term")
            .unwrap();
    }
}
