//! The instance board: what the node runs or last ran, one entry per lease,
//! as the agent API shows it.
//!
//! # Who writes this
//! The runner adds an entry when it takes a lease on and removes it when the
//! instance's files are cleaned up; each lease's worker records the phases
//! it reports, the process it started and how it ended. The agent API only
//! reads.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use berth_proto::leases::v1::LeasePhase;

use crate::provider::{ExitStatus, InstanceMeta};

/// One instance as the agent API shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InstanceView {
    /// The lease it runs for.
    pub(crate) lease_id: String,
    /// The epoch the node holds the lease at.
    pub(crate) epoch: u64,
    /// Project, service, revision, digest, port.
    pub(crate) meta: InstanceMeta,
    /// The phase this node last reported (or learned) for the lease.
    pub(crate) phase: LeasePhase,
    /// The workload's process id, once started.
    pub(crate) pid: Option<u32>,
    /// When it started.
    pub(crate) started_at: Option<SystemTime>,
    /// How it ended, once it did.
    pub(crate) exit: Option<ExitStatus>,
    /// Why it is in its phase, one CamelCase word; may be empty.
    pub(crate) reason: String,
    /// When the agent is done with it (its end reported, or the lease taken
    /// away and its workload destroyed); the entry stays for its logs.
    pub(crate) ended_at: Option<SystemTime>,
    /// Whether the agent is destroying its workload (the lease ended or
    /// was taken away): it may still run meanwhile, but nothing new is
    /// sent to it.
    pub(crate) ending: bool,
}

impl InstanceView {
    /// A new entry for a lease the node just took on.
    pub(crate) fn new(lease_id: &str, epoch: u64, meta: InstanceMeta, phase: LeasePhase) -> Self {
        Self {
            lease_id: lease_id.to_string(),
            epoch,
            meta,
            phase,
            pid: None,
            started_at: None,
            exit: None,
            reason: String::new(),
            ended_at: None,
            ending: false,
        }
    }

    /// Whether nothing of it runs any more, or will.
    pub(crate) fn is_over(&self) -> bool {
        self.ended_at.is_some() || self.exit.is_some()
    }
}

/// What the node runs or last ran, by lease id; cheap to clone.
#[derive(Debug, Clone, Default)]
pub(crate) struct InstanceBoard {
    entries: Arc<Mutex<BTreeMap<String, InstanceView>>>,
    custody: Arc<Mutex<Custody>>,
}

/// What the node holds in custody: compute it runs but cannot account for
/// yet (after a fence or a restart, until the leases service confirms it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Custody {
    /// How many workloads.
    pub(crate) held: usize,
    /// Since when; `None` when nothing is held in custody.
    pub(crate) since: Option<SystemTime>,
}

impl InstanceBoard {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, InstanceView>> {
        // Every update below leaves an entry whole, so a panic elsewhere
        // while the lock was held cannot have left one half-written.
        self.entries.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Adds or replaces the entry of `view.lease_id`.
    pub(crate) fn put(&self, view: InstanceView) {
        self.lock().insert(view.lease_id.clone(), view);
    }

    /// Changes the entry of `lease_id`, if there is one.
    pub(crate) fn update(&self, lease_id: &str, f: impl FnOnce(&mut InstanceView)) {
        if let Some(view) = self.lock().get_mut(lease_id) {
            f(view);
        }
    }

    /// Drops the entry of `lease_id`.
    pub(crate) fn remove(&self, lease_id: &str) {
        self.lock().remove(lease_id);
    }

    /// The entry of `lease_id`.
    pub(crate) fn get(&self, lease_id: &str) -> Option<InstanceView> {
        self.lock().get(lease_id).cloned()
    }

    /// Every entry, ordered by lease id.
    pub(crate) fn list(&self) -> Vec<InstanceView> {
        self.lock().values().cloned().collect()
    }

    /// What the node holds in custody now.
    pub(crate) fn custody(&self) -> Custody {
        *self.custody.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records what the node holds in custody.
    pub(crate) fn set_custody(&self, custody: Custody) {
        *self.custody.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = custody;
    }
}
