//! Services and revisions as the database holds them, and as the API shows
//! them.
//!
//! # What is stored
//! Templates, sources and service status are protobuf encodings of their
//! API messages, so a field added to one needs no migration. A revision's
//! conditions are not stored: they are read off its resolution and rollout
//! columns, each with the time it last changed.

use berth_proto::revisions::v1;
use berth_proto::types::v1::{Condition, ConditionStatus};
use berth_store::StoreError;
use prost::Message;
use sqlx::Row as _;
use sqlx::any::AnyRow;

use crate::model::{BUNDLE_RESOLVED, Observed, READY, ServiceKey, set_condition, timestamp};
use crate::traffic::{StoredTraffic, routed};

/// The columns [`ServiceRow::from_row`] reads, for `concat!` into a `SELECT`.
macro_rules! service_columns {
    () => {
        "project, name, uid, generation, template, source, pinned_revision, live_revision, status, \
         created_at_ms, updated_at_ms, version, traffic, route_generation"
    };
}

/// The columns [`RevisionRow::from_row`] reads, for `concat!` into a `SELECT`.
macro_rules! revision_columns {
    () => {
        "project, name, service, generation, template, source, fingerprint, digest, resolve_reason, \
         resolve_message, resolve_attempts, resolve_changed_at_ms, next_resolve_at_ms, state, state_reason, \
         state_message, state_changed_at_ms, rollout_started_at_ms, replicas_running, created_at_ms, unrouted_at_ms, \
         unrouted_generation"
    };
}

pub(crate) use {revision_columns, service_columns};

/// Where a revision's rollout stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RevisionState {
    /// Minted; its replicas have not all run yet (or it was never rolled out).
    Pending,
    /// All its replicas ran at once: it served, or serves.
    Ready,
    /// Its replicas failed to start, or did not all run within the deadline.
    Failed,
}

impl RevisionState {
    fn parse(text: &str) -> Option<Self> {
        match text {
            "pending" => Some(Self::Pending),
            "ready" => Some(Self::Ready),
            "failed" => Some(Self::Failed),
            _ => None,
        }
    }
}

fn decode<M: Message + Default>(row: &AnyRow, column: &str) -> Result<M, StoreError> {
    let bytes: Vec<u8> = row.try_get(column)?;
    M::decode(bytes.as_slice()).map_err(|e| StoreError::Internal {
        context: format!("decoding the stored {column}"),
        source: Some(Box::new(e)),
    })
}

/// One service, as stored.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ServiceRow {
    pub(crate) key: ServiceKey,
    pub(crate) uid: String,
    pub(crate) generation: i64,
    pub(crate) template: v1::ServiceTemplate,
    pub(crate) source: v1::Source,
    pub(crate) pinned_revision: String,
    /// The split `SetTraffic` declared; empty sends all to the latest ready revision.
    pub(crate) traffic: Vec<v1::TrafficTarget>,
    /// How a client's requests keep to one replica, as `SetTraffic` declared it.
    pub(crate) affinity: Option<v1::SessionAffinity>,
    pub(crate) live_revision: String,
    pub(crate) status: v1::ServiceStatus,
    pub(crate) created_at_ms: i64,
    pub(crate) updated_at_ms: i64,
    pub(crate) version: i64,
    /// Grows with each change to what routers send its requests to.
    pub(crate) route_generation: i64,
}

impl ServiceRow {
    /// Decodes a row selected with [`service_columns!`].
    pub(crate) fn from_row(row: &AnyRow) -> Result<Self, StoreError> {
        let stored = decode::<StoredTraffic>(row, "traffic")?;
        Ok(Self {
            key: ServiceKey::new(row.try_get::<String, _>("project")?, row.try_get::<String, _>("name")?),
            uid: row.try_get("uid")?,
            generation: row.try_get("generation")?,
            template: decode(row, "template")?,
            source: decode(row, "source")?,
            pinned_revision: row.try_get("pinned_revision")?,
            traffic: stored.targets,
            affinity: stored.affinity,
            live_revision: row.try_get("live_revision")?,
            status: decode(row, "status")?,
            created_at_ms: row.try_get("created_at_ms")?,
            updated_at_ms: row.try_get("updated_at_ms")?,
            version: row.try_get("version")?,
            route_generation: row.try_get("route_generation")?,
        })
    }

    /// The service as the API shows it.
    pub(crate) fn to_proto(&self) -> v1::Service {
        let mut status = self.status.clone();
        status.live_revision.clone_from(&self.live_revision);
        status.traffic = routed(&self.traffic, &self.live_revision);
        status.route_generation = u64::try_from(self.route_generation).unwrap_or_default();
        status.affinity.clone_from(&self.affinity);
        v1::Service {
            project: self.key.project.clone(),
            name: self.key.name.clone(),
            template: Some(self.template.clone()),
            source: Some(self.source.clone()),
            status: Some(status),
            generation: u64::try_from(self.generation).unwrap_or_default(),
            pinned_revision: self.pinned_revision.clone(),
            traffic: self.traffic.clone(),
            created_at: Some(timestamp(self.created_at_ms)),
            updated_at: Some(timestamp(self.updated_at_ms)),
        }
    }
}

/// One revision, as stored.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RevisionRow {
    pub(crate) project: String,
    pub(crate) name: String,
    pub(crate) service: String,
    pub(crate) generation: i64,
    pub(crate) template: v1::ServiceTemplate,
    pub(crate) source: v1::Source,
    pub(crate) fingerprint: String,
    /// `sha256:<hex>`, or empty until the bundle reference resolves.
    pub(crate) digest: String,
    /// Why the last resolution failed; empty once resolved or before any attempt.
    pub(crate) resolve_reason: String,
    pub(crate) resolve_message: String,
    pub(crate) resolve_attempts: i64,
    pub(crate) resolve_changed_at_ms: i64,
    pub(crate) next_resolve_at_ms: i64,
    pub(crate) state: RevisionState,
    pub(crate) state_reason: String,
    pub(crate) state_message: String,
    pub(crate) state_changed_at_ms: i64,
    /// When its current rollout began; unset when none is under way.
    pub(crate) rollout_started_at_ms: Option<i64>,
    pub(crate) replicas_running: i64,
    pub(crate) created_at_ms: i64,
    /// When it last stopped taking traffic; its replicas drain for a while after.
    pub(crate) unrouted_at_ms: Option<i64>,
    /// The route generation that left it out then: once every router serves
    /// it, nothing is sent to it any more.
    pub(crate) unrouted_generation: Option<i64>,
}

impl RevisionRow {
    /// Decodes a row selected with [`revision_columns!`].
    pub(crate) fn from_row(row: &AnyRow) -> Result<Self, StoreError> {
        let state: String = row.try_get("state")?;
        Ok(Self {
            project: row.try_get("project")?,
            name: row.try_get("name")?,
            service: row.try_get("service")?,
            generation: row.try_get("generation")?,
            template: decode(row, "template")?,
            source: decode(row, "source")?,
            fingerprint: row.try_get("fingerprint")?,
            digest: row.try_get("digest")?,
            resolve_reason: row.try_get("resolve_reason")?,
            resolve_message: row.try_get("resolve_message")?,
            resolve_attempts: row.try_get("resolve_attempts")?,
            resolve_changed_at_ms: row.try_get("resolve_changed_at_ms")?,
            next_resolve_at_ms: row.try_get("next_resolve_at_ms")?,
            state: RevisionState::parse(&state)
                .ok_or_else(|| StoreError::internal(format!("revision row holds unknown state '{state}'")))?,
            state_reason: row.try_get("state_reason")?,
            state_message: row.try_get("state_message")?,
            state_changed_at_ms: row.try_get("state_changed_at_ms")?,
            rollout_started_at_ms: row.try_get("rollout_started_at_ms")?,
            replicas_running: row.try_get("replicas_running")?,
            created_at_ms: row.try_get("created_at_ms")?,
            unrouted_at_ms: row.try_get("unrouted_at_ms")?,
            unrouted_generation: row.try_get("unrouted_generation")?,
        })
    }

    /// Whether it stopped taking traffic less than `drain_ms` before `now_ms`:
    /// its replicas are kept until then.
    pub(crate) fn draining(&self, now_ms: i64, drain_ms: i64) -> bool {
        self.unrouted_at_ms.is_some_and(|at| now_ms < at.saturating_add(drain_ms))
    }

    /// Whether its bundle reference has resolved to a digest.
    pub(crate) fn resolved(&self) -> bool {
        !self.digest.is_empty()
    }

    /// `BundleResolved` as it reads now.
    pub(crate) fn resolution(&self) -> Observed {
        if self.resolved() {
            Observed::holds(BUNDLE_RESOLVED)
        } else if self.resolve_reason.is_empty() {
            Observed::new(BUNDLE_RESOLVED, ConditionStatus::Unknown, "Resolving", "the bundle tag is being resolved")
        } else {
            Observed::new(BUNDLE_RESOLVED, ConditionStatus::False, &self.resolve_reason, &self.resolve_message)
        }
    }

    fn readiness(&self) -> Observed {
        match self.state {
            RevisionState::Ready => Observed::holds(READY),
            RevisionState::Failed => {
                Observed::new(READY, ConditionStatus::False, &self.state_reason, &self.state_message)
            }
            RevisionState::Pending if self.rollout_started_at_ms.is_some() => {
                Observed::new(READY, ConditionStatus::Unknown, "Deploying", "its replicas are starting")
            }
            RevisionState::Pending => {
                let reason = if self.state_reason.is_empty() { "NotDeployed" } else { self.state_reason.as_str() };
                Observed::new(READY, ConditionStatus::Unknown, reason, &self.state_message)
            }
        }
    }

    /// Its conditions: `BundleResolved` and `Ready`.
    pub(crate) fn conditions(&self) -> Vec<Condition> {
        let generation = u64::try_from(self.generation).unwrap_or_default();
        let mut conditions = Vec::new();
        set_condition(&mut conditions, &self.resolution(), self.resolve_changed_at_ms, generation);
        set_condition(&mut conditions, &self.readiness(), self.state_changed_at_ms, generation);
        conditions
    }

    /// The revision as the API shows it.
    pub(crate) fn to_proto(&self) -> v1::Revision {
        v1::Revision {
            project: self.project.clone(),
            service: self.service.clone(),
            name: self.name.clone(),
            generation: u64::try_from(self.generation).unwrap_or_default(),
            digest: self.digest.clone(),
            template: Some(self.template.clone()),
            source: Some(self.source.clone()),
            created_at: Some(timestamp(self.created_at_ms)),
            conditions: self.conditions(),
            replicas_running: u32::try_from(self.replicas_running).unwrap_or_default(),
        }
    }
}

/// A deleted service incarnation whose leases may still be open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Tombstone {
    pub(crate) key: ServiceKey,
    pub(crate) uid: String,
}
