//! Follows the leases revisions asked for (`WatchLeases`, every project,
//! owners under [`LEASE_OWNER_PREFIX`]) and wakes the reconciler for a
//! service whenever one of its leases changes: placed, running, ended. A
//! replica's status then moves as the replica does, not at the next poll.
//!
//! It also keeps the replica's [`LeaseView`](crate::lease_view::LeaseView),
//! from which a reconcile of a steady service reads its open leases.
//!
//! # Invariants
//! - A hint, never the truth: a reconcile with a slot to fill reads the
//!   service's leases itself, and the view answers only while synced. A lost event (a stream that broke, a leases replica gone) delays a
//!   status until the controller's own requeue (`rollout_poll` while a
//!   service settles, `steady_resync` after), never loses it.
//! - Every replica follows and wakes only its own controller; the one that
//!   leads acts, the others drop the wakes.
//! - A stream that ends or fails is opened again with jittered backoff,
//!   resumed from the view's cursor: only the services whose leases changed
//!   meanwhile are woken. A stream that starts afresh instead wakes every
//!   service with an open lease.

use std::sync::Arc;
use std::time::Duration;

use berth_core::backoff::Backoff;
use tokio_stream::StreamExt as _;

use crate::model::{LEASE_OWNER_PREFIX, ServiceKey, service_of_owner};
use crate::shared::Core;

/// The first wait before following again after the stream broke.
const MIN_BACKOFF: Duration = Duration::from_millis(200);

/// The longest wait between attempts to follow.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// Follows the leases until `core.closing`.
pub(crate) fn spawn(core: Arc<Core>) {
    tokio::spawn(async move {
        let mut backoff = Backoff::new(MIN_BACKOFF, MAX_BACKOFF);
        loop {
            let opened = tokio::select! {
                () = core.closing.cancelled() => return,
                opened = core.leases.watch(LEASE_OWNER_PREFIX, core.lease_view.cursor()) => opened,
            };
            core.lease_view.unsync();
            match opened {
                Ok(mut events) => loop {
                    let event = tokio::select! {
                        () = core.closing.cancelled() => return,
                        event = events.next() => event,
                    };
                    match event {
                        Some(Ok(event)) => {
                            backoff.reset();
                            core.lease_view.apply(&event);
                            let Some(lease) = event.lease else { continue };
                            if let Some(service) = service_of_owner(&lease.owner) {
                                core.signals.wake_here(ServiceKey::new(lease.project, service));
                            }
                        }
                        Some(Err(status)) => {
                            tracing::debug!(error = %status.message(), code = ?status.code(), "the lease watch ended");
                            break;
                        }
                        None => break,
                    }
                },
                Err(error) => tracing::debug!(%error, "cannot follow leases; the reconciler polls meanwhile"),
            }
            core.lease_view.unsync();
            tokio::select! {
                () = core.closing.cancelled() => return,
                () = tokio::time::sleep(backoff.next_delay()) => {}
            }
        }
    });
}
