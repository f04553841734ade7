//! Leases and node ledger rows as the database holds them, and as the API
//! shows them.
//!
//! # What is stored
//! `leases`: one row per lease, its workload kept as the protobuf encoding of
//! `berth.leases.v1.Workload`, so a field added to the message needs no
//! migration. `node_ledger`: per node, the sum of what its open leases
//! reserve and its assignment cursor (see the migration for the columns).

use berth_proto::leases::v1;
use berth_proto::types::v1::Port;
use berth_store::StoreError;
use prost::Message as _;
use sqlx::Row as _;
use sqlx::any::AnyRow;

use crate::model::{Phase, Resize, ResizeState, Resources};

/// The columns [`LeaseRecord::from_row`] reads, for `concat!` into a `SELECT`.
macro_rules! lease_columns {
    () => {
        "lease_id, project, idempotency_key, owner, node_id, phase, epoch, cpu_millis, memory_bytes, tier, \
         spread_group, workload, reason, message, exit_code, created_at_ms, phase_changed_at_ms, expires_at_ms, seq, \
         traceparent, ports, resize_state, resize_cpu_millis, resize_memory_bytes, resize_reason, resize_message, cache, \
         memory_overhead_bytes"
    };
}

pub(crate) use lease_columns;

/// One lease, as stored.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LeaseRecord {
    pub(crate) lease_id: String,
    pub(crate) project: String,
    pub(crate) idempotency_key: String,
    pub(crate) owner: String,
    pub(crate) node_id: String,
    pub(crate) phase: Phase,
    pub(crate) epoch: i64,
    pub(crate) resources: Resources,
    pub(crate) tier: String,
    pub(crate) spread_group: String,
    pub(crate) workload: v1::Workload,
    pub(crate) reason: String,
    pub(crate) message: String,
    pub(crate) exit_code: Option<i32>,
    pub(crate) created_at_ms: i64,
    pub(crate) phase_changed_at_ms: i64,
    pub(crate) expires_at_ms: Option<i64>,
    /// The node's assignment cursor at the lease's last change.
    pub(crate) seq: i64,
    /// The trace of the request that created it (see `Lease.traceparent`).
    pub(crate) traceparent: String,
    /// Where the replica listens on its node, by port name, as reported
    /// RUNNING (see `Lease.ports`).
    pub(crate) ports: Vec<(String, u32)>,
    /// Its last resize; `None` when it was never resized.
    pub(crate) resize: Option<Resize>,
    /// What each cache volume did, by key (`CacheObservation`).
    pub(crate) cache: Vec<v1::CacheObservation>,
    /// The node memory it holds beyond its size (see `Lease.memory_overhead_bytes`).
    pub(crate) memory_overhead: u64,
}

impl LeaseRecord {
    /// Decodes a row selected with [`lease_columns!`].
    pub(crate) fn from_row(row: &AnyRow) -> Result<Self, StoreError> {
        let phase: String = row.try_get("phase")?;
        let phase = Phase::parse(&phase)
            .ok_or_else(|| StoreError::internal(format!("lease row holds unknown phase '{phase}'")))?;
        let workload: Vec<u8> = row.try_get("workload")?;
        let workload = v1::Workload::decode(workload.as_slice()).map_err(|e| StoreError::Internal {
            context: "decoding a lease's workload".into(),
            source: Some(Box::new(e)),
        })?;
        let exit_code: Option<i64> = row.try_get("exit_code")?;
        Ok(Self {
            lease_id: row.try_get("lease_id")?,
            project: row.try_get("project")?,
            idempotency_key: row.try_get("idempotency_key")?,
            owner: row.try_get("owner")?,
            node_id: row.try_get("node_id")?,
            phase,
            epoch: row.try_get("epoch")?,
            resources: Resources::new(
                from_column(row.try_get("cpu_millis")?),
                from_column(row.try_get("memory_bytes")?),
            ),
            tier: row.try_get("tier")?,
            spread_group: row.try_get("spread_group")?,
            workload,
            reason: row.try_get("reason")?,
            message: row.try_get("message")?,
            exit_code: exit_code.and_then(|code| i32::try_from(code).ok()),
            created_at_ms: row.try_get("created_at_ms")?,
            phase_changed_at_ms: row.try_get("phase_changed_at_ms")?,
            expires_at_ms: row.try_get("expires_at_ms")?,
            seq: row.try_get("seq")?,
            traceparent: row.try_get("traceparent")?,
            ports: parse_ports(&row.try_get::<String, _>("ports")?),
            resize: match ResizeState::parse(&row.try_get::<String, _>("resize_state")?) {
                Some(state) => Some(Resize {
                    resources: Resources::new(
                        from_column(row.try_get("resize_cpu_millis")?),
                        from_column(row.try_get("resize_memory_bytes")?),
                    ),
                    state,
                    reason: row.try_get("resize_reason")?,
                    message: row.try_get("resize_message")?,
                }),
                None => None,
            },
            cache: {
                let bytes: Vec<u8> = row.try_get("cache")?;
                StoredCache::decode(bytes.as_slice())
                    .map_err(|e| StoreError::Internal {
                        context: "decoding a lease's cache observations".into(),
                        source: Some(Box::new(e)),
                    })?
                    .observations
            },
            memory_overhead: from_column(row.try_get("memory_overhead_bytes")?),
        })
    }

    /// The resize its node has yet to apply, if one is pending.
    pub(crate) fn pending_resize(&self) -> Option<Resources> {
        self.resize.as_ref().filter(|resize| resize.state == ResizeState::Pending).map(|resize| resize.resources)
    }

    /// What it holds of its node's capacity while open: its size, or the
    /// larger of its size and a pending resize's in each dimension.
    pub(crate) fn reserved(&self) -> Resources {
        self.holding(self.pending_resize().map_or(self.resources, |asked| self.resources.max(asked)))
    }

    /// What it holds of its node's capacity at `size`: the size and its
    /// memory overhead.
    pub(crate) fn holding(&self, size: Resources) -> Resources {
        size.plus(Resources::new(0, self.memory_overhead))
    }

    /// The epoch as the API counts it.
    pub(crate) fn epoch(&self) -> u64 {
        u64::try_from(self.epoch).unwrap_or_default()
    }

    /// The lease as the API shows it.
    pub(crate) fn to_proto(&self) -> v1::Lease {
        v1::Lease {
            lease_id: self.lease_id.clone(),
            epoch: self.epoch(),
            project: self.project.clone(),
            owner: self.owner.clone(),
            node_id: self.node_id.clone(),
            phase: self.phase.to_proto() as i32,
            resources: Some(self.resources.into()),
            tier: self.tier.clone(),
            spread_group: self.spread_group.clone(),
            workload: Some(self.workload.clone()),
            reason: self.reason.clone(),
            exit_code: self.exit_code,
            created_at: Some(timestamp(self.created_at_ms)),
            expires_at: self.expires_at_ms.map(timestamp),
            idempotency_key: self.idempotency_key.clone(),
            phase_changed_at: Some(timestamp(self.phase_changed_at_ms)),
            message: self.message.clone(),
            traceparent: self.traceparent.clone(),
            ports: self.ports.iter().map(|(name, port)| Port { name: name.clone(), port: *port }).collect(),
            resize: self.resize.as_ref().map(|resize| v1::LeaseResize {
                resources: Some(resize.resources.into()),
                state: resize.state.to_proto() as i32,
                reason: resize.reason.clone(),
                message: resize.message.clone(),
            }),
            cache: self.cache.clone(),
            memory_overhead_bytes: self.memory_overhead,
        }
    }

    /// The lease at the epoch it is held at.
    pub(crate) fn lease_ref(&self) -> v1::LeaseRef {
        v1::LeaseRef { lease_id: self.lease_id.clone(), epoch: self.epoch() }
    }
}

/// A lease's cache observations as the `cache` column holds them.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct StoredCache {
    #[prost(message, repeated, tag = "1")]
    pub(crate) observations: Vec<v1::CacheObservation>,
}

/// Ports as the `ports` column holds them: `name=port` pairs joined by
/// commas (names are DNS labels, so neither character is in one).
pub(crate) fn format_ports(ports: &[(String, u32)]) -> String {
    ports.iter().map(|(name, port)| format!("{name}={port}")).collect::<Vec<_>>().join(",")
}

/// The `ports` column read back; a pair that does not parse is left out.
fn parse_ports(text: &str) -> Vec<(String, u32)> {
    text.split(',')
        .filter_map(|pair| pair.split_once('='))
        .filter_map(|(name, port)| Some((name.to_string(), port.parse().ok()?)))
        .collect()
}

/// One node's row of the ledger: what its open leases reserve.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct NodeLedgerRow {
    pub(crate) node_id: String,
    pub(crate) allocated: Resources,
    pub(crate) open_leases: u32,
}

impl NodeLedgerRow {
    /// Decodes `node_id, cpu_allocated, memory_allocated, open_leases`.
    pub(crate) fn from_row(row: &AnyRow) -> Result<Self, StoreError> {
        Ok(Self {
            node_id: row.try_get("node_id")?,
            allocated: Resources::new(
                from_column(row.try_get("cpu_allocated")?),
                from_column(row.try_get("memory_allocated")?),
            ),
            open_leases: u32::try_from(row.try_get::<i64, _>("open_leases")?).unwrap_or(u32::MAX),
        })
    }
}

/// A stored amount: amounts are `u64` on the wire and `BIGINT` in the database.
pub(crate) fn to_column(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// An amount read back; a negative one (never written) reads as zero.
pub(crate) fn from_column(value: i64) -> u64 {
    u64::try_from(value).unwrap_or_default()
}

pub(crate) use berth_proto::timestamp_from_ms as timestamp;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amounts_beyond_a_bigint_are_stored_saturated() {
        assert_eq!(to_column(u64::MAX), i64::MAX);
        assert_eq!(from_column(-5), 0);
    }
}
