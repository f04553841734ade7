//! The elected loop that keeps deadlines in the bus's sorted index (the
//! identity node monitor's heartbeat deadlines, the leases reaper's expiry
//! deadlines): the store holds the truth, the index is what is due when, and
//! the leader acts on what comes due.
//!
//! # Expected flow
//! A [`DeadlineKeeper`] is a [`Leader`] whose every term runs one loop: it
//! rebuilds the index from the store at once, then every tick acts on what
//! is due, and every resync rebuilds the index again and lets the keeper
//! tidy its store.
//!
//! # Invariants
//! - Losing Redis loses nothing: when the bus lost its state (or cannot say
//!   whether it did) at the start of a term, or at any tick, the index is
//!   rebuilt from the store with `reset`, so the keeper grants a grace
//!   rather than acting on deadlines that ran out while nobody could see
//!   them.
//! - Nothing is due while the bus is away: the tick acts on nothing and the
//!   rebuild follows the bus's return.
//! - A failed rebuild or act is logged and tried again (at the next resync
//!   or tick); the loop ends only when its term is lost.

use std::future::Future;
use std::time::Duration;

use berth_bus::{Bus, Continuity};
use berth_store::Term;

use crate::Leader;

/// A loop that keeps deadlines of one kind in the bus's index; being one
/// makes it a [`Leader`].
pub trait DeadlineKeeper: Send + Sync + 'static {
    /// What the deadlines are of, for logs: `node`, `lease`.
    const OF: &'static str;

    /// Why a rebuild failed.
    type Error: std::fmt::Display + Send;

    /// The bus the index lives in.
    fn bus(&self) -> &Bus;

    /// How long between ticks, and between rebuilds from the store.
    fn cadence(&self) -> (Duration, Duration);

    /// Writes every deadline the store holds into the index; with `reset`
    /// (the index was lost), no deadline before a grace from now.
    fn rebuild(&mut self, reset: bool) -> impl Future<Output = Result<(), Self::Error>> + Send + '_;

    /// Acts on what is due under `term`, logging what fails (it is tried
    /// again at the next tick).
    fn act(&mut self, term: Term) -> impl Future<Output = ()> + Send + '_;

    /// The store's housekeeping at each resync, after the rebuild.
    fn tidy(&mut self) -> impl Future<Output = ()> + Send + '_;
}

impl<K: DeadlineKeeper> Leader for K {
    /// Acts while `term` is held; never returns by itself (a fenced write
    /// fails one step, which is tried again at the next tick).
    async fn lead(&mut self, term: Term) {
        keep_deadlines(self, term).await;
    }
}

/// Leads `keeper` while `term` is held; never returns by itself.
async fn keep_deadlines<K: DeadlineKeeper>(keeper: &mut K, term: Term) {
    let (tick, resync) = keeper.cadence();
    let reset = match keeper.bus().continuity().await {
        Ok(continuity) => continuity.needs_rebuild(),
        Err(error) => {
            tracing::warn!(%error, "bus continuity unknown; treating it as lost");
            true
        }
    };
    rebuild_logged(keeper, reset).await;
    let mut next_resync = tokio::time::Instant::now() + resync;
    loop {
        tokio::time::sleep(tick).await;
        match keeper.bus().continuity().await {
            Ok(Continuity::Continuous) => {}
            Ok(lost) => {
                tracing::warn!(continuity = ?lost, of = K::OF, "the bus lost its state; rebuilding deadlines with a grace");
                rebuild_logged(keeper, true).await;
            }
            Err(error) => {
                tracing::debug!(%error, of = K::OF, "bus unavailable; nothing is due until it is back");
                continue;
            }
        }
        keeper.act(term).await;
        if tokio::time::Instant::now() >= next_resync {
            next_resync = tokio::time::Instant::now() + resync;
            rebuild_logged(keeper, false).await;
            keeper.tidy().await;
        }
    }
}

async fn rebuild_logged<K: DeadlineKeeper>(keeper: &mut K, reset: bool) {
    if let Err(error) = keeper.rebuild(reset).await {
        tracing::warn!(%error, reset, of = K::OF, "rebuilding deadlines failed; retrying at the next resync");
    }
}
