//! The promises the mesh keeps whatever happened to it, checked against
//! its database (every service's schema, read directly) and against what
//! actually runs (`/proc`, see [`crate::workloads`]).
//!
//! # Hard invariants
//! True at every instant; a breach is a bug whenever it is seen.
//! - No node is over capacity: the open leases placed on a node reserve no
//!   more than it offers, and the ledger's per-node sums match its leases.
//! - What a client was told succeeded is stored: every acknowledged
//!   revision and lease exists, no more and no fewer of the load's own, and
//!   every acknowledged release left its lease final
//!   ([`Acks`](crate::load::Acks)).
//!
//! # Settled invariants
//! True once the mesh has caught up after a fault ([`wait_settled`]).
//! - Every lease has one holder: each open lease's workload runs once, on
//!   the lease's node; a RUNNING lease runs; nothing runs that no open
//!   lease covers; every elected loop is held by a live replica.
//! - A service's status is true to what runs: its live revision is ready,
//!   and the revision's, the service's and the ledger's replica counts
//!   equal the processes running it, which equal the replicas asked for.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use berth_proto::leases::v1::Workload;
use berth_proto::revisions::v1::ServiceStatus;
use prost::Message as _;

use crate::load::{Acks, LOAD_OWNER, LOAD_SERVICE_PREFIX};
use crate::mesh::{Mesh, ServiceKind};
use crate::workloads;

/// How often [`wait_settled`] looks again.
const SETTLE_POLL: Duration = Duration::from_millis(250);

/// A service the test deployed with replicas, and how many it asked for.
#[derive(Debug, Clone)]
pub struct ResidentService {
    /// The service's name (project "default").
    pub name: String,
    /// Its replicas.
    pub replicas: u32,
}

/// An open lease as the ledger holds it.
#[derive(Debug, Clone)]
struct OpenLease {
    node_id: String,
    phase: String,
    revision: String,
}

/// Checks the hard invariants; each breach is described.
pub async fn check_hard(mesh: &Mesh, acks: &Acks) -> anyhow::Result<Vec<String>> {
    let mut violations = Vec::new();
    check_capacity(mesh, &mut violations).await?;
    check_acknowledged(mesh, acks, &mut violations).await?;
    Ok(violations)
}

/// Checks the settled invariants once; each breach is described.
pub async fn check_settled(mesh: &Mesh, services: &[ResidentService]) -> anyhow::Result<Vec<String>> {
    let mut violations = Vec::new();
    let open = open_leases(mesh).await?;
    check_holders(mesh, &open, &mut violations);
    check_leaders(mesh, &mut violations).await?;
    for service in services {
        check_service(mesh, service, &open, &mut violations).await?;
    }
    Ok(violations)
}

/// Waits up to `timeout` for the settled invariants to hold: how long that
/// took, and the breaches still seen at the deadline (none if it settled).
pub async fn wait_settled(
    mesh: &Mesh,
    services: &[ResidentService],
    timeout: Duration,
) -> anyhow::Result<(Duration, Vec<String>)> {
    let started = Instant::now();
    loop {
        // A read that fails (the database restarting) is another try, not a verdict.
        let violations = match check_settled(mesh, services).await {
            Ok(violations) => violations,
            Err(error) => vec![format!("cannot read the mesh's state: {error:#}")],
        };
        if violations.is_empty() || started.elapsed() >= timeout {
            return Ok((started.elapsed(), violations));
        }
        tokio::time::sleep(SETTLE_POLL).await;
    }
}

/// One node's open leases: node id, cpu and memory they reserve, how many,
/// and the cpu and memory identity says the node offers.
type NodeLoad = (String, i64, i64, i64, Option<i64>, Option<i64>);

async fn check_capacity(mesh: &Mesh, violations: &mut Vec<String>) -> anyhow::Result<()> {
    // The leases and the books are read in one snapshot: under load, a lease
    // ending between two separate reads would look like a ledger out of step.
    let mut snapshot = mesh.pool().begin().await?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ").execute(&mut *snapshot).await?;
    let rows: Vec<NodeLoad> = sqlx::query_as(
        "SELECT l.node_id, CAST(SUM(l.cpu_millis) AS BIGINT), CAST(SUM(l.memory_bytes) AS BIGINT), COUNT(*), \
                MAX(n.capacity_cpu_millis), MAX(n.capacity_memory_bytes) \
         FROM leases.leases l LEFT JOIN identity.nodes n ON n.node_id = l.node_id \
         WHERE l.phase IN ('pending', 'bound', 'launching', 'running') GROUP BY l.node_id ORDER BY l.node_id",
    )
    .fetch_all(&mut *snapshot)
    .await?;
    for (node_id, cpu, memory, _, capacity_cpu, capacity_memory) in &rows {
        match (capacity_cpu, capacity_memory) {
            (Some(capacity_cpu), Some(capacity_memory)) => {
                if cpu > capacity_cpu || memory > capacity_memory {
                    violations.push(format!(
                        "node {node_id} over capacity: open leases reserve {cpu}m/{memory}B of {capacity_cpu}m/{capacity_memory}B"
                    ));
                }
            }
            _ => violations.push(format!("open leases are placed on {node_id}, which identity does not know")),
        }
    }
    let ledger: BTreeMap<String, (i64, i64, i64)> = sqlx::query_as::<_, (String, i64, i64, i64)>(
        "SELECT node_id, cpu_allocated, memory_allocated, open_leases FROM leases.node_ledger",
    )
    .fetch_all(&mut *snapshot)
    .await?
    .into_iter()
    .map(|(node, cpu, memory, count)| (node, (cpu, memory, count)))
    .collect();
    snapshot.commit().await?;
    let summed: BTreeMap<&String, (i64, i64, i64)> =
        rows.iter().map(|(node, cpu, memory, count, _, _)| (node, (*cpu, *memory, *count))).collect();
    for (node_id, booked) in &ledger {
        let actual = summed.get(node_id).copied().unwrap_or((0, 0, 0));
        if *booked != actual {
            violations.push(format!(
                "the ledger books {booked:?} (cpu, memory, leases) on {node_id}, its open leases add up to {actual:?}"
            ));
        }
    }
    Ok(())
}

async fn check_acknowledged(mesh: &Mesh, acks: &Acks, violations: &mut Vec<String>) -> anyhow::Result<()> {
    for lost in &acks.never_acknowledged {
        violations.push(format!("never acknowledged: {lost}"));
    }
    for node in &acks.fenced {
        violations.push(format!("synthetic node {node} was fenced while it heartbeat"));
    }

    let stored: BTreeSet<(String, String)> =
        sqlx::query_as("SELECT service, name FROM revisions.revisions WHERE service LIKE $1 || '%'")
            .bind(LOAD_SERVICE_PREFIX)
            .fetch_all(mesh.pool())
            .await?
            .into_iter()
            .collect();
    let acknowledged: BTreeSet<(String, String)> = acks.revisions.values().cloned().collect();
    for missing in acknowledged.difference(&stored) {
        violations.push(format!("acknowledged revision {} of {} is not stored", missing.1, missing.0));
    }
    // A failed apply may have committed before its answer was lost; only
    // more unacknowledged revisions than failed attempts is a broken promise.
    let unacknowledged = stored.len().saturating_sub(acknowledged.len());
    if unacknowledged as u64 > acks.apply_attempts_failed {
        violations.push(format!(
            "{} load revisions stored for {} acknowledged ({} declarations applied, {} attempts failed)",
            stored.len(),
            acknowledged.len(),
            acks.revisions.len(),
            acks.apply_attempts_failed
        ));
    }
    if acknowledged.len() != acks.revisions.len() {
        violations.push(format!(
            "{} declarations were acknowledged with only {} distinct revisions",
            acks.revisions.len(),
            acknowledged.len()
        ));
    }

    let leases: BTreeMap<String, (String, String)> = sqlx::query_as::<_, (String, String, String)>(
        "SELECT idempotency_key, lease_id, phase FROM leases.leases WHERE owner = $1",
    )
    .bind(LOAD_OWNER)
    .fetch_all(mesh.pool())
    .await?
    .into_iter()
    .map(|(key, id, phase)| (key, (id, phase)))
    .collect();
    for (key, lease_id) in &acks.leases {
        match leases.get(key) {
            Some((stored_id, _)) if stored_id == lease_id => {}
            Some((stored_id, _)) => {
                violations.push(format!("lease request {key} was acknowledged as {lease_id} but stored as {stored_id}"))
            }
            None => violations.push(format!("acknowledged lease {lease_id} (key {key}) is not stored")),
        }
    }
    if leases.len() != acks.leases.len() {
        violations.push(format!("{} load leases stored for {} acknowledged", leases.len(), acks.leases.len()));
    }
    let phases: BTreeMap<&String, &String> = leases.values().map(|(id, phase)| (id, phase)).collect();
    for released in &acks.released {
        match phases.get(released) {
            Some(phase) if ["released", "expired", "failed", "done"].contains(&phase.as_str()) => {}
            other => violations.push(format!("lease {released} was released, yet it is {other:?}")),
        }
    }
    Ok(())
}

async fn open_leases(mesh: &Mesh) -> anyhow::Result<BTreeMap<String, OpenLease>> {
    let rows: Vec<(String, String, String, Vec<u8>)> = sqlx::query_as(
        "SELECT lease_id, node_id, phase, workload FROM leases.leases \
         WHERE phase IN ('pending', 'bound', 'launching', 'running')",
    )
    .fetch_all(mesh.pool())
    .await?;
    Ok(rows
        .into_iter()
        .map(|(lease_id, node_id, phase, workload)| {
            let revision = Workload::decode(workload.as_slice()).map(|w| w.revision).unwrap_or_default();
            (lease_id, OpenLease { node_id, phase, revision })
        })
        .collect())
}

fn check_holders(mesh: &Mesh, open: &BTreeMap<String, OpenLease>, violations: &mut Vec<String>) {
    let running = workloads::by_lease(mesh.run_id());
    for (lease_id, processes) in &running {
        let pids: Vec<u32> = processes.iter().map(|w| w.pid).collect();
        if processes.len() > 1 {
            violations.push(format!("lease {lease_id} runs {} times: pids {pids:?}", processes.len()));
        }
        match open.get(lease_id) {
            None => violations.push(format!("pids {pids:?} run lease {lease_id}, which is not open")),
            Some(lease) => {
                for process in processes.iter().filter(|w| w.node_id != lease.node_id) {
                    violations.push(format!(
                        "lease {lease_id} is placed on {} but runs on {} (pid {})",
                        lease.node_id, process.node_id, process.pid
                    ));
                }
            }
        }
    }
    for (lease_id, lease) in open {
        if lease.phase == "running" && !running.contains_key(lease_id) {
            violations.push(format!("lease {lease_id} is RUNNING on {} but nothing runs it", lease.node_id));
        }
    }
}

async fn check_leaders(mesh: &Mesh, violations: &mut Vec<String>) -> anyhow::Result<()> {
    for kind in ServiceKind::ALL {
        for loop_name in kind.loops() {
            match mesh.leader(kind, loop_name).await? {
                None => violations.push(format!("nobody leads {loop_name}")),
                Some((holder, _)) => {
                    let live = mesh
                        .replica_of_holder(kind, &holder)
                        .and_then(|index| mesh.replica(kind, index).ok())
                        .and_then(|replica| replica.pid());
                    if live.is_none() {
                        violations.push(format!("{loop_name} is led by {holder}, which is not a running replica"));
                    }
                }
            }
        }
    }
    Ok(())
}

async fn check_service(
    mesh: &Mesh,
    service: &ResidentService,
    open: &BTreeMap<String, OpenLease>,
    violations: &mut Vec<String>,
) -> anyhow::Result<()> {
    let name = &service.name;
    let row: Option<(String, Vec<u8>)> =
        sqlx::query_as("SELECT live_revision, status FROM revisions.services WHERE project = $1 AND name = $2")
            .bind("default")
            .bind(name)
            .fetch_optional(mesh.pool())
            .await?;
    let Some((live, status)) = row else {
        violations.push(format!("service {name} is not stored"));
        return Ok(());
    };
    if live.is_empty() {
        violations.push(format!("service {name} has no live revision"));
        return Ok(());
    }
    let status = ServiceStatus::decode(status.as_slice()).unwrap_or_default();
    let revision: Option<(String, i64)> =
        sqlx::query_as("SELECT state, replicas_running FROM revisions.revisions WHERE project = $1 AND name = $2")
            .bind("default")
            .bind(&live)
            .fetch_optional(mesh.pool())
            .await?;
    let (state, revision_running) = revision.unwrap_or_else(|| ("missing".into(), -1));
    let running_leases =
        open.values().filter(|lease| lease.revision == live && lease.phase == "running").count() as i64;
    let processes: Vec<workloads::Workload> = workloads::scan(mesh.run_id())
        .into_iter()
        .filter(|w| w.revision.as_deref().is_some_and(|r| r.starts_with(&format!("{name}-"))))
        .collect();
    let live_processes = processes.iter().filter(|w| w.revision.as_deref() == Some(live.as_str())).count() as i64;
    let desired = i64::from(service.replicas);
    let counts = [
        ("revision replicas_running", revision_running),
        ("service status replicas_running", i64::from(status.replicas_running)),
        ("service status replicas_desired", i64::from(status.replicas_desired)),
        ("RUNNING leases", running_leases),
        ("processes", live_processes),
    ];
    if state != "ready" || counts.iter().any(|(_, n)| *n != desired) {
        violations.push(format!("{name}: live revision {live} is {state}, {desired} replicas asked for, {counts:?}"));
    }
    let stale: Vec<String> = processes
        .iter()
        .filter(|w| w.revision.as_deref() != Some(live.as_str()))
        .map(|w| format!("{} (pid {})", w.revision.as_deref().unwrap_or_default(), w.pid))
        .collect();
    if !stale.is_empty() {
        violations.push(format!("{name}: revisions other than the live {live} still run: {stale:?}"));
    }
    Ok(())
}
