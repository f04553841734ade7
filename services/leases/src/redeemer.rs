//! The launch redeemer: one task per replica that spends queued launch
//! registrations in batches, one transaction per batch, answering every
//! caller (identity, signing a workload's first certificate) through its
//! own oneshot.
//!
//! Each spending is a durable write, so a commit (and its sync) per
//! registration bounds how fast a fleet's launches get their credentials;
//! a batch shares one. A refused registration (spent, expired, another
//! node's, its lease over) is refused alone and changes nothing; the store
//! failing fails the whole batch, and every caller hears it.

use std::sync::Arc;

use tokio::sync::mpsc;

use crate::ledger::Redeem;
use crate::records::LeaseRecord;
use crate::shared::{Asked, Core, drain_batches};

/// Drains `queue` until the service closes.
pub(crate) fn spawn(core: Arc<Core>, queue: mpsc::Receiver<Asked<Redeem, LeaseRecord>>) {
    let (closing, max_batch) = (core.closing.clone(), core.config.max_batch);
    drain_batches(closing, queue, max_batch, move |batch| {
        let core = Arc::clone(&core);
        async move { redeem(&core, batch).await }
    });
}

async fn redeem(core: &Core, batch: Vec<Asked<Redeem, LeaseRecord>>) {
    // A caller that gave up is not spent for: its registration stays good.
    let batch: Vec<_> = batch.into_iter().filter(|asked| !asked.reply.is_closed()).collect();
    if batch.is_empty() {
        return;
    }
    let asks: Vec<&Redeem> = batch.iter().map(|asked| &asked.ask).collect();
    match core.ledger.redeem_launches(&asks).await {
        Ok(answers) => {
            for (asked, answer) in batch.into_iter().zip(answers) {
                let _ = asked.reply.send(answer);
            }
        }
        Err(error) => {
            tracing::warn!(%error, registrations = batch.len(), "spending a batch of launch registrations failed");
            for asked in batch {
                let _ = asked.reply.send(Err(error.for_each_caller()));
            }
        }
    }
}
