//! The ledger's vocabulary, with no I/O: amounts of compute, lease phases and
//! the moves a node may report between them.
//!
//! # Invariants
//! - A lease is open in `PENDING`, `BOUND`, `LAUNCHING` and `RUNNING`, and only
//!   open leases reserve capacity on their node. Every other phase is final:
//!   nothing moves a lease out of it except custody of a recently `EXPIRED` one.
//! - A node reports only forward moves ([`Phase::node_may_move`]); the ledger
//!   itself makes the moves to `RELEASED`, `EXPIRED` and (on reconcile) `FAILED`.

use std::fmt;

use berth_proto::leases::v1::LeasePhase;
use berth_proto::types::v1::Capacity;

/// An amount of compute: what a node offers, what a lease reserves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Resources {
    /// CPU in thousandths of a core.
    pub cpu_millis: u64,
    /// Memory in bytes.
    pub memory_bytes: u64,
}

impl Resources {
    /// `cpu_millis` of CPU and `memory_bytes` of memory.
    pub const fn new(cpu_millis: u64, memory_bytes: u64) -> Self {
        Self { cpu_millis, memory_bytes }
    }

    /// Whether `wanted` fits within `self` in both dimensions.
    pub fn holds(self, wanted: Resources) -> bool {
        wanted.cpu_millis <= self.cpu_millis && wanted.memory_bytes <= self.memory_bytes
    }

    /// `self + other`, saturating.
    pub fn plus(self, other: Resources) -> Resources {
        Resources {
            cpu_millis: self.cpu_millis.saturating_add(other.cpu_millis),
            memory_bytes: self.memory_bytes.saturating_add(other.memory_bytes),
        }
    }

    /// The larger of `self` and `other` in each dimension: what a lease
    /// reserves while a resize between the two is pending.
    pub fn max(self, other: Resources) -> Resources {
        Resources {
            cpu_millis: self.cpu_millis.max(other.cpu_millis),
            memory_bytes: self.memory_bytes.max(other.memory_bytes),
        }
    }

    /// `self - other`, floored at zero: a node whose capacity shrank below
    /// what it holds has nothing free, not a negative amount.
    pub fn minus(self, other: Resources) -> Resources {
        Resources {
            cpu_millis: self.cpu_millis.saturating_sub(other.cpu_millis),
            memory_bytes: self.memory_bytes.saturating_sub(other.memory_bytes),
        }
    }
}

impl From<Capacity> for Resources {
    fn from(capacity: Capacity) -> Self {
        Self { cpu_millis: capacity.cpu_millis, memory_bytes: capacity.memory_bytes }
    }
}

impl From<Resources> for Capacity {
    fn from(resources: Resources) -> Self {
        Capacity { cpu_millis: resources.cpu_millis, memory_bytes: resources.memory_bytes }
    }
}

impl fmt::Display for Resources {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}m cpu and {} memory", self.cpu_millis, Memory(self.memory_bytes))
    }
}

/// A byte count as a person reads it: `512MiB`, `1.5GiB`, `700 bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Memory(pub u64);

impl fmt::Display for Memory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(u64, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
        for (size, unit) in UNITS {
            if self.0 >= size {
                let tenths = u128::from(self.0) * 10 / u128::from(size);
                return if tenths % 10 == 0 {
                    write!(f, "{}{unit}", tenths / 10)
                } else {
                    write!(f, "{}.{}{unit}", tenths / 10, tenths % 10)
                };
            }
        }
        write!(f, "{} bytes", self.0)
    }
}

/// Where a lease's last resize stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ResizeState {
    /// Asked for; the node has not applied it. The lease reserves the larger
    /// of its size and the asked one meanwhile.
    Pending,
    /// Applied on the node; the lease's resources are the asked size.
    Applied,
    /// Not applied; the lease keeps its size.
    Deferred,
}

impl ResizeState {
    /// How the database spells it.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ResizeState::Pending => "pending",
            ResizeState::Applied => "applied",
            ResizeState::Deferred => "deferred",
        }
    }

    /// The state the database spells `s`; `None` for `''` (never resized) or anything else.
    pub(crate) fn parse(s: &str) -> Option<ResizeState> {
        [ResizeState::Pending, ResizeState::Applied, ResizeState::Deferred]
            .into_iter()
            .find(|state| state.as_str() == s)
    }

    /// The API's state for this one.
    pub(crate) fn to_proto(self) -> berth_proto::leases::v1::ResizeState {
        use berth_proto::leases::v1::ResizeState as Api;
        match self {
            ResizeState::Pending => Api::Pending,
            ResizeState::Applied => Api::Applied,
            ResizeState::Deferred => Api::Deferred,
        }
    }
}

/// A lease's last resize.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Resize {
    /// The size asked for.
    pub(crate) resources: Resources,
    pub(crate) state: ResizeState,
    /// With `Deferred`: why, one CamelCase word.
    pub(crate) reason: String,
    /// A person-readable account of `reason`.
    pub(crate) message: String,
}

impl Default for Resize {
    fn default() -> Self {
        Self {
            resources: Resources::default(),
            state: ResizeState::Pending,
            reason: String::new(),
            message: String::new(),
        }
    }
}

/// Where a lease is in its life; see the module docs for which are open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Phase {
    /// Asked for, not placed. Never written: a request that does not fit is refused.
    Pending,
    /// Placed; its node has not started it.
    Bound,
    /// Its node is starting it.
    Launching,
    /// Its workload runs.
    Running,
    /// Its workload exited 0.
    Done,
    /// It could not start, exited non-zero, or its node lost it.
    Failed,
    /// Given back by its requester.
    Released,
    /// Not renewed in time, and reaped.
    Expired,
}

/// The open phases as an SQL list, for `phase IN` clauses and partial indexes.
pub(crate) const OPEN_PHASES_SQL: &str = "('pending', 'bound', 'launching', 'running')";

impl Phase {
    /// Every phase, in the order the API numbers them.
    pub(crate) const ALL: [Phase; 8] = [
        Phase::Pending,
        Phase::Bound,
        Phase::Launching,
        Phase::Running,
        Phase::Done,
        Phase::Failed,
        Phase::Released,
        Phase::Expired,
    ];

    /// How the database spells it.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Phase::Pending => "pending",
            Phase::Bound => "bound",
            Phase::Launching => "launching",
            Phase::Running => "running",
            Phase::Done => "done",
            Phase::Failed => "failed",
            Phase::Released => "released",
            Phase::Expired => "expired",
        }
    }

    /// The phase the database spells `s`.
    pub(crate) fn parse(s: &str) -> Option<Phase> {
        Phase::ALL.into_iter().find(|phase| phase.as_str() == s)
    }

    /// The API's phase for this one.
    pub(crate) fn to_proto(self) -> LeasePhase {
        match self {
            Phase::Pending => LeasePhase::Pending,
            Phase::Bound => LeasePhase::Bound,
            Phase::Launching => LeasePhase::Launching,
            Phase::Running => LeasePhase::Running,
            Phase::Done => LeasePhase::Done,
            Phase::Failed => LeasePhase::Failed,
            Phase::Released => LeasePhase::Released,
            Phase::Expired => LeasePhase::Expired,
        }
    }

    /// The phase an API value names; `None` for unspecified or unknown values.
    pub(crate) fn from_proto(value: i32) -> Option<Phase> {
        Phase::ALL.into_iter().find(|phase| phase.to_proto() as i32 == value)
    }

    /// Whether a lease in this phase reserves capacity and may still change.
    pub(crate) fn is_open(self) -> bool {
        matches!(self, Phase::Pending | Phase::Bound | Phase::Launching | Phase::Running)
    }

    /// Whether a node may report a move from `self` to `to`.
    pub(crate) fn node_may_move(self, to: Phase) -> bool {
        matches!(
            (self, to),
            (Phase::Bound, Phase::Launching | Phase::Running | Phase::Failed)
                | (Phase::Launching, Phase::Running | Phase::Done | Phase::Failed)
                | (Phase::Running, Phase::Done | Phase::Failed)
        )
    }

    /// Whether a node may report this phase at all.
    pub(crate) fn is_reportable(self) -> bool {
        matches!(self, Phase::Launching | Phase::Running | Phase::Done | Phase::Failed)
    }

    /// The API's name for it, as error messages show it (`RUNNING`).
    pub(crate) fn shouted(self) -> &'static str {
        self.to_proto().as_str_name().trim_start_matches("LEASE_PHASE_")
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.shouted())
    }
}

/// What is kept of cache generations beside each volume's head and the
/// pinned ones.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Retention {
    /// The newest generations of each volume.
    pub(crate) keep: u32,
    /// The most bytes all of a project's generations may hold.
    pub(crate) project_budget: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_round_trip_through_the_database_and_the_api() {
        for phase in Phase::ALL {
            assert_eq!(Phase::parse(phase.as_str()), Some(phase));
            assert_eq!(Phase::from_proto(phase.to_proto() as i32), Some(phase));
        }
        assert_eq!(Phase::from_proto(LeasePhase::Unspecified as i32), None);
        assert_eq!(Phase::parse("RUNNING"), None);
    }

    #[test]
    fn the_open_phases_list_matches_is_open() {
        for phase in Phase::ALL {
            assert_eq!(OPEN_PHASES_SQL.contains(&format!("'{}'", phase.as_str())), phase.is_open(), "{phase}");
        }
    }

    #[test]
    fn a_final_phase_is_never_left_by_a_report() {
        for from in Phase::ALL.into_iter().filter(|p| !p.is_open()) {
            for to in Phase::ALL {
                assert!(!from.node_may_move(to), "{from} -> {to}");
            }
        }
        assert!(!Phase::Running.node_may_move(Phase::Launching));
        assert!(!Phase::Bound.node_may_move(Phase::Done));
        assert!(Phase::Launching.node_may_move(Phase::Done));
    }

    #[test]
    fn memory_reads_like_a_person_writes_it() {
        assert_eq!(Memory(512 << 20).to_string(), "512MiB");
        assert_eq!(Memory(3 << 29).to_string(), "1.5GiB");
        assert_eq!(Memory(700).to_string(), "700 bytes");
        assert_eq!(Resources::new(500, 1 << 30).to_string(), "500m cpu and 1GiB memory");
    }

    #[test]
    fn free_capacity_never_goes_negative() {
        let total = Resources::new(1000, 100);
        assert_eq!(total.minus(Resources::new(1500, 50)), Resources::new(0, 50));
    }
}
