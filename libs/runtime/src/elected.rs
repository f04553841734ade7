//! The elected loop every berth service runs its singleton work in (the
//! revisions reconciler, the egress pass, the leases reaper, the identity
//! node monitor): every replica campaigns, the one that wins a term leads
//! until it loses it, and the others wait to lead.
//!
//! # Expected flow
//! [`spawn_elected`] campaigns for [`Election::loop_name`] and, for each term
//! won, runs [`Leader::lead`] with it. While no term is held it runs
//! [`Leader::follow`] (a leader with wake-ups to drop drops them there).
//!
//! # Invariants
//! - A term's [`Leader::lead`] future is dropped as soon as the term is lost
//!   or the process closes: no work of a lost term goes on past the moment
//!   this replica learns of the loss. (Its writes are fenced on the term all
//!   the same, so one in flight as the term lapses changes nothing.)
//! - A `lead` that returns by itself was fenced off: a write found a newer
//!   term while the elector still thought it led. It is not started again at
//!   the same term at once; the loop waits for the elector to catch up (a
//!   renewal at most).
//! - The elector resigns when the process closes, so a rolling restart hands
//!   the lead over without waiting out a lease.

use std::future::Future;

use berth_store::{ElectionTiming, LeaderElector, Store, Term};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::loops::spawn_loop;

/// What to campaign for and how often.
#[derive(Debug, Clone)]
pub struct Election {
    /// The store the lead is held in.
    pub store: Store,
    /// The loop's name (`revisions.deployer`).
    pub loop_name: &'static str,
    /// This replica's id.
    pub holder: String,
    /// Lease length and renewal.
    pub timing: ElectionTiming,
}

impl Election {
    /// Campaigns for `loop_name` in `store` as `holder`, on `timing`.
    pub fn new(store: Store, loop_name: &'static str, holder: &str, timing: ElectionTiming) -> Self {
        Self { store, loop_name, holder: holder.to_owned(), timing }
    }
}

/// The work one elected loop does.
pub trait Leader: Send + 'static {
    /// Acts while `term` is held. Dropped as soon as the term is lost;
    /// returns by itself only when a write found a newer term.
    fn lead(&mut self, term: Term) -> impl Future<Output = ()> + Send + '_;

    /// Runs while this replica does not lead, and is dropped when it does
    /// (or when leadership changes). Returning makes it run again; the
    /// default never returns.
    fn follow(&mut self) -> impl Future<Output = ()> + Send + '_ {
        std::future::pending()
    }
}

/// Campaigns for `election` until `closing`, and runs `leader` for every term
/// this replica wins (see the module docs), as one of the process's loops.
pub fn spawn_elected(election: Election, closing: CancellationToken, leader: impl Leader) {
    spawn_loop(run_elected(election, closing, leader));
}

async fn run_elected(election: Election, closing: CancellationToken, mut leader: impl Leader) {
    let Election { store, loop_name, holder, timing } = election;
    let elector = LeaderElector::new(store, loop_name, holder.clone()).with_timing(timing).spawn(&closing);
    let mut leadership = elector.subscribe();
    loop {
        let term = *leadership.borrow_and_update();
        match term {
            Some(term) => {
                tracing::info!(loop_name, %term, %holder, "leading");
                let fenced = tokio::select! {
                    () = closing.cancelled() => false,
                    () = lost(&mut leadership, term) => false,
                    () = leader.lead(term) => true,
                };
                tracing::info!(loop_name, %term, "no longer leading");
                if fenced && *leadership.borrow() == Some(term) {
                    tracing::info!(loop_name, %term, "a newer term fenced off this one; waiting for the election");
                    tokio::select! {
                        () = closing.cancelled() => {}
                        _ = leadership.changed() => {}
                        () = tokio::time::sleep(timing.renew_every) => {}
                    }
                }
            }
            None => {
                tokio::select! {
                    () = closing.cancelled() => {}
                    changed = leadership.changed() => if changed.is_err() { break },
                    () = leader.follow() => {}
                }
            }
        }
        if closing.is_cancelled() {
            break;
        }
    }
    elector.shutdown().await;
}

/// Resolves when `term` is no longer held (or the elector is gone).
async fn lost(leadership: &mut watch::Receiver<Option<Term>>, term: Term) {
    loop {
        if leadership.changed().await.is_err() || *leadership.borrow() != Some(term) {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use super::*;

    /// Counts the terms it led, and stops leading (as if fenced) when told.
    struct Recorder {
        terms: Arc<Mutex<Vec<Term>>>,
        fenced_after: Option<Duration>,
    }

    impl Leader for Recorder {
        async fn lead(&mut self, term: Term) {
            self.terms.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(term);
            match self.fenced_after {
                Some(after) => tokio::time::sleep(after).await,
                None => std::future::pending().await,
            }
        }
    }

    fn timing() -> ElectionTiming {
        ElectionTiming::from_ttl(Duration::from_millis(600))
    }

    fn election(store: &Store, holder: &str) -> Election {
        Election { store: store.clone(), loop_name: "test.elected", holder: holder.into(), timing: timing() }
    }

    /// Waits (10 s at most) until `terms` holds `count` starts.
    async fn eventually_led(terms: &Arc<Mutex<Vec<Term>>>, count: usize) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while terms.lock().unwrap().len() < count {
            assert!(tokio::time::Instant::now() < deadline, "led {} times, not {count}", terms.lock().unwrap().len());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_of_two_replicas_leads_and_the_other_takes_over_when_it_closes() {
        let db = berth_store::testing::TestSqlite::new().await.unwrap();
        let store = db.store().clone();
        let (first, second) = (Arc::new(Mutex::new(Vec::new())), Arc::new(Mutex::new(Vec::new())));
        let closing_first = CancellationToken::new();
        let closing_second = CancellationToken::new();
        let recorder = |terms: &Arc<Mutex<Vec<Term>>>| Recorder { terms: Arc::clone(terms), fenced_after: None };
        spawn_elected(election(&store, "a"), closing_first.clone(), recorder(&first));
        eventually_led(&first, 1).await;
        spawn_elected(election(&store, "b"), closing_second.clone(), recorder(&second));
        tokio::time::sleep(timing().ttl).await;
        assert!(second.lock().unwrap().is_empty(), "one leader at a time");

        // The first closes and resigns; the other takes the lead.
        closing_first.cancel();
        eventually_led(&second, 1).await;
        closing_second.cancel();
        assert_eq!(first.lock().unwrap().len(), 1, "{first:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_term_fenced_off_is_not_led_again_at_once() {
        let db = berth_store::testing::TestSqlite::new().await.unwrap();
        let store = db.store().clone();
        let terms = Arc::new(Mutex::new(Vec::new()));
        let closing = CancellationToken::new();
        let leader = Recorder { terms: Arc::clone(&terms), fenced_after: Some(Duration::ZERO) };
        spawn_elected(election(&store, "a"), closing.clone(), leader);
        eventually_led(&terms, 2).await;
        // Over a second, a lead that is fenced off at once restarts about once
        // a renewal (200 ms): a few times, not in a tight loop.
        let before = terms.lock().unwrap().len();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let starts = terms.lock().unwrap().len() - before;
        closing.cancel();
        assert!(starts <= 1 + 1000 / 200, "{starts} starts in a second: a fenced lead waits for the election");
    }
}
