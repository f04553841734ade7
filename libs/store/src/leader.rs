//! Leader election through the database, so a singleton loop (node monitor,
//! lease reaper, revision GC, egress full pass) runs on one replica at a time
//! while every replica serves RPCs.
//!
//! # What is stored
//! `_berth_leaders`: one row per loop with the `holder`, its `term` and
//! `expires_at_ms` on the database clock. A row is never deleted, so terms
//! only grow: resigning clears the holder and keeps the term.
//!
//! # Invariants
//! - Every comparison is against the database clock, in SQL, so replicas on
//!   skewed hosts agree on who leads.
//! - Every write is fenced by holder and term in its `WHERE` clause; a holder
//!   whose lease ran out and was taken over cannot renew or resign it.
//! - A new holder gets the previous term + 1; the holder that already leads
//!   keeps its term. A loop passes its [`Term`] into the writes it makes
//!   (`... WHERE leader_term = $n` or a check in the same transaction), so a
//!   deposed leader's late writes are refused.
//!
//! # Expected flow
//! A [`LeaderElector`] task tries to acquire every `retry_every`; once it
//! leads it renews every `renew_every` (a third of the TTL by default) and
//! publishes `Some(term)` on a watch channel. It publishes `None` as soon as a
//! renewal is refused or its own deadline (start of the last successful write
//! plus TTL, which is never later than the database's) passes; the loop
//! watching the channel stops. On cancellation it publishes `None` first, then
//! resigns, so another replica takes over at once instead of after the TTL.

use std::fmt;
use std::time::Duration;

use sqlx::AnyConnection;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::error::StoreError;
use crate::store::{Backend, Store, pg_now_ms, sqlite_now_ms};

/// Default lease of a leader: how long a crashed leader's loop stays orphaned.
const DEFAULT_LEADER_TTL: Duration = Duration::from_secs(15);

/// A leadership term: grows by one each time a loop changes hands, and fences
/// the writes of the holder that had it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Term(pub i64);

impl fmt::Display for Term {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The leadership a loop's writes are fenced on: its name, the holder and
/// the term it was elected at. Checked inside the write's own transaction,
/// so a write commits only while its writer still leads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    pub loop_name: &'static str,
    pub holder: String,
    pub term: Term,
}

impl Fence {
    /// Whether the fence still holds the lead on the database clock, read on
    /// `conn` (inside a transaction body); `now_sql` is [`Store::now_ms_sql`].
    pub async fn holds(&self, conn: &mut AnyConnection, now_sql: &str) -> Result<bool, sqlx::Error> {
        let sql = format!(
            "SELECT term FROM _berth_leaders WHERE loop_name = $1 AND holder = $2 AND term = $3 AND expires_at_ms > {now_sql}"
        );
        let held: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .bind(self.loop_name)
            .bind(self.holder.as_str())
            .bind(self.term.0)
            .fetch_optional(&mut *conn)
            .await?;
        Ok(held.is_some())
    }
}

macro_rules! acquire_sql {
    ($now:expr) => {
        concat!(
            "INSERT INTO _berth_leaders (loop_name, holder, term, expires_at_ms) ",
            "VALUES ($1, $2, 1, ",
            $now,
            " + $3) ",
            "ON CONFLICT (loop_name) DO UPDATE SET ",
            "holder = excluded.holder, ",
            "term = CASE WHEN _berth_leaders.holder = excluded.holder ",
            "THEN _berth_leaders.term ELSE _berth_leaders.term + 1 END, ",
            "expires_at_ms = excluded.expires_at_ms ",
            "WHERE _berth_leaders.holder = excluded.holder OR _berth_leaders.expires_at_ms <= ",
            $now,
            " RETURNING term"
        )
    };
}

macro_rules! renew_sql {
    ($now:expr) => {
        concat!(
            "UPDATE _berth_leaders SET expires_at_ms = ",
            $now,
            " + $4 WHERE loop_name = $1 AND holder = $2 AND term = $3 AND expires_at_ms > ",
            $now
        )
    };
}

macro_rules! leader_sql {
    ($now:expr) => {
        concat!(
            "SELECT holder, term FROM _berth_leaders ",
            "WHERE loop_name = $1 AND holder <> '' AND expires_at_ms > ",
            $now
        )
    };
}

const RESIGN_SQL: &str = "UPDATE _berth_leaders SET holder = '', expires_at_ms = 0 \
     WHERE loop_name = $1 AND holder = $2 AND term = $3";

impl Store {
    /// Takes the lead of `loop_name` for `ttl` if no one holds it or the
    /// holder's lease ran out (returning the next term), or extends it if
    /// `holder` already leads (returning its term). `None` while another
    /// holder's lease is live.
    pub async fn try_acquire_leadership(
        &self,
        loop_name: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Option<Term>, StoreError> {
        check_names(loop_name, holder)?;
        let sql = match self.backend() {
            Backend::Postgres => acquire_sql!(pg_now_ms!()),
            Backend::Sqlite => acquire_sql!(sqlite_now_ms!()),
        };
        let term: Option<i64> = sqlx::query_scalar(sql)
            .bind(loop_name)
            .bind(holder)
            .bind(ttl_ms(ttl)?)
            .fetch_optional(self.pool())
            .await
            .map_err(|e| self.classify(e))?;
        Ok(term.map(Term))
    }

    /// Extends `holder`'s lease on `loop_name` at `term`. `false` means the
    /// lead is lost: the lease ran out or another holder took a newer term.
    pub async fn renew_leadership(
        &self,
        loop_name: &str,
        holder: &str,
        term: Term,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        check_names(loop_name, holder)?;
        let sql = match self.backend() {
            Backend::Postgres => renew_sql!(pg_now_ms!()),
            Backend::Sqlite => renew_sql!(sqlite_now_ms!()),
        };
        let done = sqlx::query(sql)
            .bind(loop_name)
            .bind(holder)
            .bind(term.0)
            .bind(ttl_ms(ttl)?)
            .execute(self.pool())
            .await
            .map_err(|e| self.classify(e))?;
        Ok(done.rows_affected() == 1)
    }

    /// Gives up the lead so another holder can take it at once. A no-op if
    /// `holder` no longer holds `term`.
    pub async fn resign_leadership(&self, loop_name: &str, holder: &str, term: Term) -> Result<(), StoreError> {
        check_names(loop_name, holder)?;
        sqlx::query(RESIGN_SQL)
            .bind(loop_name)
            .bind(holder)
            .bind(term.0)
            .execute(self.pool())
            .await
            .map_err(|e| self.classify(e))?;
        Ok(())
    }

    /// Who leads `loop_name` now, and at which term; `None` if no live lease.
    pub async fn leader(&self, loop_name: &str) -> Result<Option<(String, Term)>, StoreError> {
        let sql = match self.backend() {
            Backend::Postgres => leader_sql!(pg_now_ms!()),
            Backend::Sqlite => leader_sql!(sqlite_now_ms!()),
        };
        let row: Option<(String, i64)> =
            sqlx::query_as(sql).bind(loop_name).fetch_optional(self.pool()).await.map_err(|e| self.classify(e))?;
        Ok(row.map(|(holder, term)| (holder, Term(term))))
    }
}

/// An empty holder marks a resigned row, so it cannot name a real one.
fn check_names(loop_name: &str, holder: &str) -> Result<(), StoreError> {
    if loop_name.is_empty() || holder.is_empty() {
        return Err(StoreError::config("leader election needs a non-empty loop name and holder"));
    }
    Ok(())
}

fn ttl_ms(ttl: Duration) -> Result<i64, StoreError> {
    match i64::try_from(ttl.as_millis()) {
        Ok(ms) if ms > 0 => Ok(ms),
        _ => Err(StoreError::config(format!("leader ttl {ttl:?} must be at least a millisecond"))),
    }
}

/// How often a [`LeaderElector`] talks to the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ElectionTiming {
    /// How long a lead lasts without renewal (default 15 s).
    pub ttl: Duration,
    /// How often the leader renews (default `ttl / 3`: two renewals may fail
    /// before the lead is lost).
    pub renew_every: Duration,
    /// How often a follower tries to take the lead (default `ttl / 3`).
    pub retry_every: Duration,
}

impl ElectionTiming {
    /// Timing for a lead of `ttl`, renewed and retried every third of it.
    pub fn from_ttl(ttl: Duration) -> Self {
        Self { ttl, renew_every: ttl / 3, retry_every: ttl / 3 }
    }
}

impl Default for ElectionTiming {
    fn default() -> Self {
        Self::from_ttl(DEFAULT_LEADER_TTL)
    }
}

/// Campaigns for the lead of one loop on behalf of one holder; see the module
/// docs. Built with [`LeaderElector::new`], started with [`LeaderElector::spawn`].
#[derive(Debug)]
pub struct LeaderElector {
    store: Store,
    loop_name: String,
    holder: String,
    timing: ElectionTiming,
}

impl LeaderElector {
    /// An elector for `loop_name` on behalf of `holder`, which must be unique
    /// per process (e.g. pod name plus a random suffix).
    pub fn new(store: Store, loop_name: impl Into<String>, holder: impl Into<String>) -> Self {
        Self { store, loop_name: loop_name.into(), holder: holder.into(), timing: ElectionTiming::default() }
    }

    /// Replaces the default timing.
    pub fn with_timing(mut self, timing: ElectionTiming) -> Self {
        self.timing = timing;
        self
    }

    /// Starts campaigning. The task stops (and resigns) when `cancel` or the
    /// returned handle's own token is cancelled, or the handle is dropped.
    pub fn spawn(self, cancel: &CancellationToken) -> LeaderHandle {
        let cancel = cancel.child_token();
        let (publish, leadership) = watch::channel(None);
        let span = tracing::info_span!("leader_elector", loop_name = %self.loop_name, holder = %self.holder);
        let task = tokio::spawn(self.run(cancel.clone(), publish).instrument(span));
        LeaderHandle { leadership, cancel, task: Some(task) }
    }

    async fn run(self, cancel: CancellationToken, publish: watch::Sender<Option<Term>>) {
        let mut held: Option<Held> = None;
        loop {
            let started = Instant::now();
            // Not abandoned on cancellation: an acquisition that landed must be
            // known, so it can be resigned rather than left to lapse.
            held = self.step(held, started).await;
            if cancel.is_cancelled() {
                break;
            }
            set(&publish, held.map(|h| h.term));

            let next_step = started + if held.is_some() { self.timing.renew_every } else { self.timing.retry_every };
            let wake = held.map_or(next_step, |h| next_step.min(h.valid_until));
            tokio::select! {
                () = cancel.cancelled() => break,
                () = tokio::time::sleep_until(wake) => {}
            }
            if held.is_some_and(|h| Instant::now() >= h.valid_until) {
                tracing::warn!(loop_name = %self.loop_name, "leadership lapsed before it could be renewed");
                held = None;
                set(&publish, None);
            }
        }

        // Stop the loop before letting anyone else start theirs.
        set(&publish, None);
        if let Some(held) = held {
            match self.store.resign_leadership(&self.loop_name, &self.holder, held.term).await {
                Ok(()) => {
                    tracing::info!(loop_name = %self.loop_name, term = %held.term, "resigned leadership");
                }
                Err(error) => {
                    tracing::warn!(loop_name = %self.loop_name, %error, "resigning leadership failed; it lapses after the ttl");
                }
            }
        }
    }

    /// One renewal or acquisition attempt; what is held afterwards.
    async fn step(&self, held: Option<Held>, started: Instant) -> Option<Held> {
        let (loop_name, holder, ttl) = (&self.loop_name, &self.holder, self.timing.ttl);
        match held {
            Some(current) => {
                let renewal = tokio::select! {
                    renewal = self.store.renew_leadership(loop_name, holder, current.term, ttl) => renewal,
                    // A slow database must not keep a lapsed leader running.
                    () = tokio::time::sleep_until(current.valid_until) => {
                        tracing::warn!(%loop_name, "renewal did not finish before the lead lapsed");
                        return None;
                    }
                };
                match renewal {
                    Ok(true) => Some(Held { term: current.term, valid_until: started + ttl }),
                    Ok(false) => {
                        tracing::warn!(%loop_name, term = %current.term, "lost leadership");
                        None
                    }
                    Err(error) => {
                        tracing::warn!(%loop_name, %error, "renewing leadership failed; retrying until it lapses");
                        Some(current)
                    }
                }
            }
            None => match self.store.try_acquire_leadership(loop_name, holder, ttl).await {
                Ok(Some(term)) => {
                    tracing::info!(%loop_name, %term, "acquired leadership");
                    Some(Held { term, valid_until: started + ttl })
                }
                Ok(None) => None,
                Err(error) => {
                    tracing::warn!(%loop_name, %error, "trying for leadership failed");
                    None
                }
            },
        }
    }
}

/// A lead this process holds, and when it lapses by the local clock, counted
/// from before the write that granted it, so never later than the database's
/// own deadline.
#[derive(Debug, Clone, Copy)]
struct Held {
    term: Term,
    valid_until: Instant,
}

fn set(publish: &watch::Sender<Option<Term>>, value: Option<Term>) {
    publish.send_if_modified(|current| {
        let changed = *current != value;
        *current = value;
        changed
    });
}

/// The running elector: a watch of the current lead and a way to stop it.
/// Dropping the handle stops the elector too.
#[derive(Debug)]
pub struct LeaderHandle {
    leadership: watch::Receiver<Option<Term>>,
    cancel: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl LeaderHandle {
    /// `Some(term)` while this holder leads, `None` otherwise. A loop runs
    /// while it sees `Some` and stops on the first change.
    pub fn subscribe(&self) -> watch::Receiver<Option<Term>> {
        self.leadership.clone()
    }

    /// The lead as last published.
    pub fn current(&self) -> Option<Term> {
        *self.leadership.borrow()
    }

    /// Stops campaigning and waits until the lead, if held, is resigned.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        if let Some(task) = self.task.take()
            && let Err(error) = task.await
        {
            tracing::warn!(%error, "leader elector task failed");
        }
    }
}

impl Drop for LeaderHandle {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}
