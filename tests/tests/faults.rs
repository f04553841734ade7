//! The fault suite: the mesh as production runs it (two replicas of each
//! service as processes, a private PostgreSQL and Redis, three agents),
//! under a steady load of heartbeats, applies and lease requests, taken
//! through one fault at a time:
//!
//! 1. `kill -9` of every service replica in turn: the other replica carries
//!    on, and the loops the killed one led move within their lease;
//! 2. Redis restarted, then flushed: no healthy node is marked down and no
//!    renewed lease expires;
//! 3. PostgreSQL restarted: every replica reports NOT_SERVING while it is
//!    gone and serves again without a restart of its own;
//! 4. `kill -9` of an agent, then a restart: what it ran is adopted, not
//!    restarted;
//! 5. an agent cut off past the reap time (its network namespace's link
//!    down where the test is root, else SIGSTOP): its service replicas move
//!    elsewhere, and once it is back it is fenced and destroys its stale
//!    compute within the fencing bound. The bound counts from its return:
//!    a node out of reach cannot be told anything, so until then its old
//!    copy runs beside the new one (the suite prints how many did);
//! 6. faults injected into a restarted agent (built with its
//!    `fault-injection` feature, see `berth_agent::FAULTS_ENV`): its first
//!    `AssumeCustody` reply lost after the commit, its listing of the host
//!    failing twice, every destroy failing twice. What it ran is adopted,
//!    the same processes, and what the load released from it is gone;
//! 7. an agent given `--stop-after-disconnect` cut off: it stops what it
//!    runs before the leases service can give the work away, so no replica
//!    runs twice.
//!
//! The load is ten times a small fleet's: 240 synthetic nodes heartbeating
//! every second, and four writers of each kind applying, requesting and
//! releasing leases as fast as the mesh answers them (each at most ten a
//! second); the steady row fails if it runs under 220 requests a second.
//!
//! After each fault every invariant is checked (see
//! `berth_e2e::invariants`): no node over capacity, every lease with one
//! holder, service status true to what runs, and everything acknowledged
//! stored. A table of the faults is printed; the test fails if any promise
//! was broken. It needs the machine to itself and the binaries built, so it
//! is ignored in the ordinary run: `make test-faults`.
//!
//! `BERTH_FAULTS_ONLY` (a comma-separated list of `replicas`, `redis`,
//! `postgres`, `agent`, `partition`, `stopping`) runs only those groups,
//! to chase one fault without the rest; the steady row always runs.

#![allow(clippy::unwrap_used, reason = "tests fail loudly")]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use berth_agent::FAULTS_ENV;
use berth_e2e::invariants::{self, ResidentService};
use berth_e2e::report::{self, FaultRow};
use berth_e2e::{Cut, Load, LoadOptions, Mesh, MeshOptions, ServiceKind, Snapshot, workloads};
use berth_proto::agent::v1 as agent_v1;
use berth_proto::identity::v1 as identity_v1;
use berth_proto::leases::v1 as leases_v1;
use berth_proto::revisions::v1 as revisions_v1;
use tokio::task::JoinHandle;
use tonic_health::pb::health_check_response::ServingStatus;

/// The service deployed with replicas, whose replicas the faults watch.
const WEB: &str = "web";

/// Its replicas: fewer than the agents, so one can be lost and replaced.
const WEB_REPLICAS: u32 = 2;

/// The load every fault runs under, at least: ten times what a small
/// fleet makes (16 nodes' heartbeats, 2 applies, 2 lease requests and 2
/// releases a second).
const MIN_LOAD_RPS: f64 = 220.0;

/// How long the mesh runs under load before the first fault.
const WARM_UP: Duration = Duration::from_secs(5);

/// How long the mesh may take to settle after a fault.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(45);

/// How long a request through a front may take to succeed again after a
/// replica behind it was killed.
const SERVE_AGAIN_BOUND: Duration = Duration::from_secs(10);

/// How long one replica serves alone before the killed one comes back.
const ONE_REPLICA_FOR: Duration = Duration::from_secs(3);

/// Slack on top of a leader lease for the new leader to take over.
const LEADER_SLACK: Duration = Duration::from_secs(5);

/// How long Redis stays down when restarted.
const REDIS_DOWN: Duration = Duration::from_secs(1);

/// How long PostgreSQL stays down: under a lease TTL, so a node's renewals
/// can catch up once it is back.
const PG_DOWN: Duration = Duration::from_secs(3);

/// How long every kind of request may take to succeed again after a
/// dependency came back.
const RECOVERY_BOUND: Duration = Duration::from_secs(30);

/// How long a restarted agent may take to adopt what it ran.
const ADOPT_BOUND: Duration = Duration::from_secs(30);

/// Slack on top of the computed bounds of the partition.
const PARTITION_SLACK: Duration = Duration::from_secs(15);

/// How long a fenced agent may take to be UP again under a new incarnation.
const REJOIN_BOUND: Duration = Duration::from_secs(60);

/// How long a released lease's workload may take to be gone while every
/// destroy of it fails twice first.
const DESTROY_BOUND: Duration = Duration::from_secs(30);

/// The `--stop-after-disconnect` of the agent cut off last: under two
/// thirds of the mesh's lease TTL less its stop grace.
const STOP_AFTER: Duration = Duration::from_secs(3);

/// How often the fault steps look at the state they wait for.
const POLL: Duration = Duration::from_millis(200);

/// The groups of faults to run (`BERTH_FAULTS_ONLY`): every group when unset.
fn wants(group: &str) -> bool {
    std::env::var("BERTH_FAULTS_ONLY").map_or(true, |only| only.split(',').any(|wanted| wanted.trim() == group))
}

/// What one fault step found.
struct Outcome {
    recovery: Option<Duration>,
    violations: Vec<String>,
}

struct Suite {
    mesh: Mesh,
    load: Load,
    services: Vec<ResidentService>,
    rows: Vec<FaultRow>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs the machine to itself and the binaries built: make test-faults"]
async fn the_mesh_keeps_its_promises_through_every_fault() {
    let started = Instant::now();
    let options = MeshOptions::default();
    eprintln!("faults: starting the mesh ({:?} agents)", options.isolation);
    let mesh = Mesh::start(options).await.unwrap();
    let bundle = berth_e2e::bundles::push_sleeper(&mesh.dir().join("oci"), "sleeper").await.unwrap();
    berth_e2e::bundles::deploy(&mesh, WEB, &bundle, WEB_REPLICAS).await.unwrap();
    let services = vec![ResidentService { name: WEB.into(), replicas: WEB_REPLICAS }];
    let (took, unsettled) = invariants::wait_settled(&mesh, &services, Duration::from_secs(90)).await.unwrap();
    assert!(unsettled.is_empty(), "{WEB} never ran its replicas: {unsettled:?}");
    eprintln!("faults: {WEB} runs {WEB_REPLICAS} replicas after {took:?}; starting the load");
    let load = Load::start(&mesh, load_options(&mesh, bundle)).await.unwrap();
    let mut suite = Suite { mesh, load, services, rows: Vec::new() };

    let result = suite.run_every_fault().await;
    let table = report::table(&suite.rows);
    let broken: usize = suite.rows.iter().map(|row| row.violations.len()).sum();
    eprintln!("\n{table}");
    eprintln!("faults: {} faults in {:.0?}", suite.rows.len(), started.elapsed());
    let Suite { mut mesh, load, rows, .. } = suite;
    load.stop().await;
    let shutdown = mesh.shutdown().await;
    result.unwrap();
    shutdown.unwrap();
    // The headline of each, in the failure itself: a log cut to its tail
    // still says what broke (the table above has each one's trail).
    let headlines = headlines(&rows);
    assert_eq!(broken, 0, "the mesh broke {broken} promises; the table above lists them:\n{}", headlines.join("\n"));
}

/// The workloads of `leases` still running, by lease and pid.
fn still_running(mesh: &Mesh, leases: &BTreeSet<String>) -> Vec<String> {
    workloads::scan(mesh.run_id())
        .into_iter()
        .filter(|w| leases.contains(&w.lease_id))
        .map(|w| format!("{} (pid {})", w.lease_id, w.pid))
        .collect()
}

/// Each violation's first line, under its fault's name.
fn headlines(rows: &[FaultRow]) -> Vec<String> {
    rows.iter()
        .flat_map(|row| {
            row.violations
                .iter()
                .map(move |violation| format!("  {}: {}", row.fault, violation.lines().next().unwrap_or_default()))
        })
        .collect()
}

impl Suite {
    async fn run_every_fault(&mut self) -> anyhow::Result<()> {
        tokio::time::sleep(WARM_UP).await;
        let before = self.load.snapshot();
        tokio::time::sleep(WARM_UP).await;
        let mut violations = self.acknowledgement_check_sees().await?;
        let rate = self.load.snapshot().rate_since(&before);
        if rate < MIN_LOAD_RPS {
            violations
                .push(format!("the load ran at {rate:.0} req/s, under the {MIN_LOAD_RPS} every fault is run under"));
        }
        let outcome = Outcome { recovery: Some(Duration::ZERO), violations };
        self.record("steady load, no fault", "-", before, outcome).await?;

        for kind in ServiceKind::ALL.into_iter().filter(|_| wants("replicas")) {
            for index in self.kill_order(kind).await? {
                let leader = self.leads_any(kind, index).await?;
                let name = format!("kill -9 {kind}-{index}{}", if leader { " (leader)" } else { "" });
                let before = self.load.snapshot();
                let outcome = self.kill_replica(kind, index).await?;
                let when =
                    if leader { "the other replica served and took the lead" } else { "the other replica served" };
                self.record(&name, when, before, outcome).await?;
            }
        }

        if wants("redis") {
            let before = self.load.snapshot();
            let outcome = self.redis_fault(false).await?;
            self.record("restart Redis", "every request kind succeeded again", before, outcome).await?;
            let before = self.load.snapshot();
            let outcome = self.redis_fault(true).await?;
            self.record("FLUSHALL Redis", "every request kind succeeded again", before, outcome).await?;
        }

        if wants("postgres") {
            let before = self.load.snapshot();
            let outcome = self.postgres_fault().await?;
            self.record("restart PostgreSQL", "every replica SERVING, every request kind succeeded", before, outcome)
                .await?;
        }

        let agent = self.agent_running_web(None).await?;
        if wants("agent") {
            self.agent_faults(agent).await?;
        }
        if wants("partition") {
            let other = self.agent_running_web(Some(agent)).await?;
            let how = match self.mesh.agents()[other].cut_kind() {
                Cut::Network => "network namespace down",
                Cut::Frozen => "SIGSTOP",
            };
            let before = self.load.snapshot();
            let outcome = self.partition(other).await?;
            let name = format!("cut off agent {} ({how})", self.mesh.agents()[other].name());
            self.record(&name, "stale compute destroyed after it returned", before, outcome).await?;
        }
        if wants("stopping") {
            let agent = self.agent_running_web(None).await?;
            let before = self.load.snapshot();
            let outcome = self.partition_stopping(agent).await?;
            let name =
                format!("cut off agent {} --stop-after-disconnect {STOP_AFTER:?}", self.mesh.agents()[agent].name());
            self.record(&name, "its compute stopped while cut off", before, outcome).await?;
        }
        Ok(())
    }

    /// The faults of one agent that runs `web`: killed and restarted,
    /// then with faults injected into its restarts and destroys.
    async fn agent_faults(&mut self, agent: usize) -> anyhow::Result<()> {
        let before = self.load.snapshot();
        let outcome = self.kill_agent(agent).await?;
        let name = format!("kill -9 agent {}, restart", self.mesh.agents()[agent].name());
        self.record(&name, "its instances adopted, same processes", before, outcome).await?;

        let before = self.load.snapshot();
        let outcome =
            self.kill_agent_with(agent, "custody-reply-lost=1", "injected fault: the custody reply", 1).await?;
        let name = format!("kill -9 agent {}, its first AssumeCustody reply lost", self.mesh.agents()[agent].name());
        self.record(&name, "its instances adopted, same processes", before, outcome).await?;

        let before = self.load.snapshot();
        let outcome = self.kill_agent_with(agent, "listing-fails=2", "injected fault: the listing", 2).await?;
        let name = format!("kill -9 agent {}, its listing failing twice", self.mesh.agents()[agent].name());
        self.record(&name, "its instances adopted, same processes", before, outcome).await?;

        let before = self.load.snapshot();
        let outcome = self.failing_destroys(agent).await?;
        let name = format!("agent {}: every destroy fails twice", self.mesh.agents()[agent].name());
        self.record(&name, "every released lease's workload gone", before, outcome).await?;

        Ok(())
    }

    /// Whether the check of acknowledged against stored notices a lease and
    /// a revision acknowledged but never stored: if it did not, its silence
    /// after the faults would mean nothing.
    async fn acknowledgement_check_sees(&self) -> anyhow::Result<Vec<String>> {
        self.load.pause().await;
        let mut acks = self.load.acks();
        acks.leases.insert("never-asked".into(), "l-never-placed".into());
        acks.revisions.insert(u64::MAX, ("load-0".into(), "load-0-99999".into()));
        let found = invariants::check_hard(&self.mesh, &acks).await;
        self.load.resume();
        let found = found?;
        let seen = |needle: &str| found.iter().any(|v| v.contains(needle));
        Ok(if seen("l-never-placed") && seen("load-0-99999") {
            Vec::new()
        } else {
            vec![format!("the acknowledgement check missed made-up acknowledgements: {found:?}")]
        })
    }

    /// Settles, checks every invariant with the writes paused, and adds the row.
    async fn record(
        &mut self,
        fault: &str,
        recovered_when: &str,
        before: Snapshot,
        outcome: Outcome,
    ) -> anyhow::Result<()> {
        let during = self.load.snapshot();
        let mut violations = outcome.violations;
        let (_, unsettled) = invariants::wait_settled(&self.mesh, &self.services, SETTLE_TIMEOUT).await?;
        if !unsettled.is_empty() {
            eprintln!("faults: {fault} did not settle; what the control plane was doing:\n{}", self.explain().await);
        }
        violations.extend(unsettled.into_iter().map(|v| {
            let trail = self.trail(&v);
            format!("{fault}: not settled after {SETTLE_TIMEOUT:?}: {v}{trail}")
        }));
        self.load.pause().await;
        let hard = invariants::check_hard(&self.mesh, &self.load.acks()).await;
        self.load.resume();
        violations.extend(hard?);
        let row = FaultRow {
            fault: fault.to_string(),
            load_rps: during.rate_since(&before),
            client_errors: during.errors_since(&before),
            recovery: outcome.recovery,
            recovered_when: recovered_when.to_string(),
            violations,
        };
        eprintln!(
            "faults: {}: {:.1} req/s ({}), recovery {:?}, {} violations{}",
            row.fault,
            row.load_rps,
            during.breakdown_since(&before),
            row.recovery,
            row.violations.len(),
            self.load.last_error().map(|e| format!("; last client error: {e}")).unwrap_or_default()
        );
        self.rows.push(row);
        Ok(())
    }

    /// Who leads each loop, and the warnings the replicas of revisions and
    /// leases logged last: what a run that did not settle is read by.
    async fn explain(&self) -> String {
        let mut lines = Vec::new();
        for kind in ServiceKind::ALL {
            for loop_name in kind.loops() {
                let leader = self.mesh.leader(kind, loop_name).await;
                lines.push(format!("  {loop_name} led by {leader:?}"));
            }
        }
        for kind in [ServiceKind::Revisions, ServiceKind::Leases] {
            for index in 0..self.mesh.replicas() {
                let Ok(replica) = self.mesh.replica(kind, index) else { continue };
                let text = std::fs::read_to_string(replica.log_path()).unwrap_or_default();
                // The load's own services collide with its applies all the time; the rest is news.
                let warnings: Vec<&str> = text
                    .lines()
                    .filter(|line| line.contains(" WARN ") || line.contains(" ERROR "))
                    .filter(|line| !line.contains("service=default/load-"))
                    .collect();
                lines.push(format!("  {kind}-{index}, last warnings:"));
                lines.extend(warnings[warnings.len().saturating_sub(15)..].iter().map(|line| format!("    {line}")));
                let web: Vec<&str> = text.lines().filter(|line| line.contains(&format!("default/{WEB}"))).collect();
                lines.push(format!("  {kind}-{index}, last lines about {WEB}:"));
                lines.extend(web[web.len().saturating_sub(10)..].iter().map(|line| format!("    {line}")));
            }
        }
        for agent in self.mesh.agents() {
            let text = std::fs::read_to_string(agent.log_path()).unwrap_or_default();
            let warnings: Vec<&str> =
                text.lines().filter(|line| line.contains(" WARN ") || line.contains(" ERROR ")).collect();
            lines.push(format!("  agent {} (running: {}), last warnings:", agent.name(), agent.is_running()));
            lines.extend(warnings[warnings.len().saturating_sub(15)..].iter().map(|line| format!("    {line}")));
        }
        lines.join("\n")
    }

    /// What the agents' logs say about each lease `violation` names (its
    /// last lines in each), so a broken promise shows what the node did.
    fn trail(&self, violation: &str) -> String {
        let leases: BTreeSet<&str> = violation
            .match_indices("l-")
            .filter_map(|(at, _)| violation.get(at..at + 22))
            .filter(|id| id[2..].bytes().all(|b| b.is_ascii_hexdigit()))
            .collect();
        let mut lines = Vec::new();
        for lease in leases {
            for agent in self.mesh.agents() {
                let text = std::fs::read_to_string(agent.log_path()).unwrap_or_default();
                let about: Vec<&str> = text.lines().filter(|line| line.contains(lease)).collect();
                lines.extend(
                    about[about.len().saturating_sub(8)..].iter().map(|line| format!("\n    {}: {line}", agent.name())),
                );
            }
        }
        lines.concat()
    }

    /// The replicas of `kind` in the order they are killed: those leading
    /// nothing first, so each kill of a leader is a kill of the only one.
    async fn kill_order(&self, kind: ServiceKind) -> anyhow::Result<Vec<usize>> {
        let mut order: Vec<usize> = (0..self.mesh.replicas()).collect();
        let mut leading = BTreeSet::new();
        for index in &order {
            if self.leads_any(kind, *index).await? {
                leading.insert(*index);
            }
        }
        order.sort_by_key(|index| leading.contains(index));
        Ok(order)
    }

    async fn leads_any(&self, kind: ServiceKind, index: usize) -> anyhow::Result<bool> {
        for loop_name in kind.loops() {
            if let Some((holder, _)) = self.mesh.leader(kind, loop_name).await?
                && self.mesh.replica_of_holder(kind, &holder) == Some(index)
            {
                return Ok(true);
            }
        }
        Ok(false)
    }

    async fn kill_replica(&mut self, kind: ServiceKind, index: usize) -> anyhow::Result<Outcome> {
        let mut led = Vec::new();
        for loop_name in kind.loops() {
            if let Some((holder, term)) = self.mesh.leader(kind, loop_name).await?
                && self.mesh.replica_of_holder(kind, &holder) == Some(index)
            {
                led.push((*loop_name, term));
            }
        }
        let killed_at = Instant::now();
        self.mesh.kill_replica(kind, index).await?;
        let mut violations = Vec::new();
        let mesh = &self.mesh;

        let served = wait_for(SERVE_AGAIN_BOUND, || probe(mesh, kind)).await.map(|_| killed_at.elapsed());
        if served.is_none() {
            violations.push(format!("no request to {kind} succeeded through its front within {SERVE_AGAIN_BOUND:?}"));
        }
        let timing = mesh.options().timings.leader();
        let lease_bound = timing.ttl + timing.retry_every + LEADER_SLACK;
        let mut moved = Duration::ZERO;
        for (loop_name, term) in led {
            let taken = wait_for(lease_bound.saturating_sub(killed_at.elapsed()), || async move {
                match mesh.leader(kind, loop_name).await {
                    Ok(Some((holder, new_term))) => {
                        let by = mesh.replica_of_holder(kind, &holder);
                        (by.is_some() && by != Some(index) && new_term > term).then_some(())
                    }
                    _ => None,
                }
            })
            .await;
            match taken {
                Some(()) => moved = moved.max(killed_at.elapsed()),
                None => violations.push(format!(
                    "{loop_name} did not move to another replica within its lease ({lease_bound:?}; held at term {term})"
                )),
            }
        }
        let alone_until = killed_at + ONE_REPLICA_FOR;
        tokio::time::sleep_until(alone_until.into()).await;
        self.mesh.start_replica(kind, index).await?;
        let recovery = served.map(|served| served.max(moved));
        Ok(Outcome { recovery, violations })
    }

    async fn redis_fault(&mut self, flush: bool) -> anyhow::Result<Outcome> {
        let timings = self.mesh.options().timings.clone();
        let watched = self.healthy_nodes().await?;
        let watch = DbWatch::start(&self.mesh, watched).await?;
        let started = Instant::now();
        if flush {
            self.mesh.redis_mut().flushall().await?;
        } else {
            self.mesh.redis_mut().restart(REDIS_DOWN).await?;
        }
        let back = Instant::now();
        let mut violations = Vec::new();
        let load = &self.load;
        let recovered = wait_for(RECOVERY_BOUND, || async move { load.all_succeeded_since(back).then_some(()) })
            .await
            .map(|()| started.elapsed());
        if recovered.is_none() {
            violations.push(format!(
                "not every kind of request succeeded within {RECOVERY_BOUND:?} of Redis coming back (last error: {})",
                self.load.last_error().unwrap_or_default()
            ));
        }
        // Long enough for any node whose deadline the bus lost, and any
        // lease it did not renew, to have been marked down or expired.
        let grace = berth_identity::NodeTiming::default().reset_grace.max(timings.down_after);
        let watch_for = (grace + timings.down_after).max(timings.lease_ttl() * 2) + Duration::from_secs(1);
        tokio::time::sleep_until((started + watch_for).into()).await;
        violations.extend(watch.stop().await);
        Ok(Outcome { recovery: recovered, violations })
    }

    async fn postgres_fault(&mut self) -> anyhow::Result<Outcome> {
        let timings = self.mesh.options().timings.clone();
        let replicas = self.all_replicas();
        let pids: BTreeMap<(ServiceKind, usize), Option<u32>> =
            replicas.iter().map(|(kind, index)| ((*kind, *index), self.replica_pid(*kind, *index))).collect();
        let watched = self.healthy_nodes().await?;
        let watch = DbWatch::start(&self.mesh, watched).await?;
        let started = Instant::now();
        self.mesh.postgres_mut().stop().await?;

        let mut answered: BTreeMap<(ServiceKind, usize), BTreeSet<String>> = BTreeMap::new();
        while started.elapsed() < PG_DOWN {
            for (kind, index) in &replicas {
                let status = self.mesh.health(*kind, *index).await;
                answered.entry((*kind, *index)).or_default().insert(format!("{status:?}"));
            }
            tokio::time::sleep(POLL).await;
        }
        self.mesh.postgres_mut().start_again().await?;
        let back = Instant::now();
        let not_serving = format!("{:?}", Some(ServingStatus::NotServing));
        let mut violations: Vec<String> = replicas
            .iter()
            .filter(|r| !answered.get(r).is_some_and(|seen| seen.contains(&not_serving)))
            .map(|(kind, index)| {
                let seen = answered.get(&(*kind, *index)).cloned().unwrap_or_default();
                format!(
                    "{kind}-{index} never reported NOT_SERVING while PostgreSQL was down (its health said {seen:?})"
                )
            })
            .collect();
        let (mesh, load, replicas_ref) = (&self.mesh, &self.load, &replicas);
        let recovered = wait_for(RECOVERY_BOUND, || async move {
            for (kind, index) in replicas_ref {
                if mesh.health(*kind, *index).await != Some(ServingStatus::Serving) {
                    return None;
                }
            }
            load.all_succeeded_since(back).then_some(())
        })
        .await
        .map(|()| back.elapsed());
        if recovered.is_none() {
            let serving: Vec<String> = health_of(&self.mesh, &replicas).await;
            violations.push(format!(
                "not recovered within {RECOVERY_BOUND:?} of PostgreSQL coming back: {serving:?} (last error: {})",
                self.load.last_error().unwrap_or_default()
            ));
        }
        for ((kind, index), before) in &pids {
            let now = self.replica_pid(*kind, *index);
            if now != *before {
                violations.push(format!("{kind}-{index} did not survive the outage: pid {before:?}, now {now:?}"));
            }
        }
        tokio::time::sleep_until((back + timings.lease_ttl() * 2).into()).await;
        violations.extend(watch.stop().await);
        Ok(Outcome { recovery: recovered, violations })
    }

    async fn kill_agent(&mut self, agent: usize) -> anyhow::Result<Outcome> {
        let node_id = self.mesh.agent_node_id(agent).await?;
        let before: Vec<workloads::Workload> =
            workloads::scan(self.mesh.run_id()).into_iter().filter(|w| w.node_id == node_id).collect();
        anyhow::ensure!(!before.is_empty(), "agent {agent} runs nothing to adopt");
        let started = Instant::now();
        self.mesh.agent_mut(agent)?.kill().await?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        self.mesh.agent_mut(agent)?.start()?;

        let mut violations = Vec::new();
        let (mesh, load, before_ref) = (&self.mesh, &self.load, &before);
        let adopted = wait_for(ADOPT_BOUND, || async move {
            let listed = list_instances(mesh, agent).await.ok()?;
            let released = load.acks().released;
            let pending: Vec<&workloads::Workload> = before_ref
                .iter()
                .filter(|w| !released.contains(&w.lease_id))
                .filter(|w| {
                    !listed.iter().any(|i| {
                        i.lease_id == w.lease_id && i.pid == w.pid && i.phase == leases_v1::LeasePhase::Running as i32
                    })
                })
                .collect();
            pending.is_empty().then_some(())
        })
        .await;
        if adopted.is_none() {
            violations.push(format!(
                "agent {agent} did not adopt its instances within {ADOPT_BOUND:?}:\n{}",
                self.mesh.agents()[agent].log_tail(10)
            ));
        }
        let now: Vec<workloads::Workload> = workloads::scan(self.mesh.run_id());
        let released = self.load.acks().released;
        for old in before.iter().filter(|w| !released.contains(&w.lease_id)) {
            let same: Vec<&workloads::Workload> = now.iter().filter(|w| w.lease_id == old.lease_id).collect();
            match same.as_slice() {
                [only] if only.pid == old.pid && only.start_time == old.start_time => {}
                others => violations.push(format!(
                    "lease {} was restarted, not adopted: pid {} before, {:?} after",
                    old.lease_id,
                    old.pid,
                    others.iter().map(|w| w.pid).collect::<Vec<_>>()
                )),
            }
        }
        Ok(Outcome { recovery: adopted.map(|()| started.elapsed()), violations })
    }

    /// [`kill_agent`](Self::kill_agent), the agent started again with
    /// `faults` injected (see `berth_agent::FAULTS_ENV`); the fault must be
    /// seen in its log at least `times` times, or the row means nothing.
    async fn kill_agent_with(
        &mut self,
        agent: usize,
        faults: &str,
        injected: &str,
        times: usize,
    ) -> anyhow::Result<Outcome> {
        let seen_before = self.mesh.agents()[agent].log_count(injected);
        self.mesh.agent_mut(agent)?.reconfigure(|spec| spec.env(FAULTS_ENV, faults));
        let mut outcome = self.kill_agent(agent).await?;
        // The restarted agent may be back before its recovery reached the
        // call the fault is in (custody is asked lease by lease, and the
        // load's released leases are refused first): wait for it.
        let mesh = &self.mesh;
        let seen = wait_for(SETTLE_TIMEOUT, || async move {
            let seen = mesh.agents()[agent].log_count(injected) - seen_before;
            (seen >= times).then_some(seen)
        })
        .await
        .unwrap_or_else(|| self.mesh.agents()[agent].log_count(injected) - seen_before);
        if seen < times {
            outcome.violations.push(format!(
                "'{faults}' was injected {seen} times, not {times}: the row proves nothing\n{}",
                self.mesh.agents()[agent].log_tail(10)
            ));
        }
        Ok(outcome)
    }

    /// The agent restarted with every destroy failing twice: each lease the
    /// load releases from it must still have its workload gone, and the
    /// failing destroy must show in `ListInstances` meanwhile. The agent is
    /// restarted without the fault afterwards.
    async fn failing_destroys(&mut self, agent: usize) -> anyhow::Result<Outcome> {
        const INJECTED: &str = "injected fault: the destroy fails";
        let mut outcome = self.kill_agent_with(agent, "destroy-fails=2", "this agent injects faults", 1).await?;
        let node_id = self.mesh.agent_node_id(agent).await?;
        let (mesh, load, node_ref) = (&self.mesh, &self.load, &node_id);
        // What the load runs on the node now: it releases each of them soon.
        let watched = wait_for(SETTLE_TIMEOUT, || async move {
            let opened: BTreeSet<String> = load.acks().leases.into_values().collect();
            let here: BTreeSet<String> = workloads::scan(mesh.run_id())
                .into_iter()
                .filter(|w| &w.node_id == node_ref && opened.contains(&w.lease_id))
                .map(|w| w.lease_id)
                .collect();
            (!here.is_empty()).then_some(here)
        })
        .await
        .context("the load ran nothing on the agent")?;
        let started = Instant::now();
        let shown_failing = std::cell::Cell::new(false);
        let (watched_ref, shown_ref) = (&watched, &shown_failing);
        let gone = wait_for(DESTROY_BOUND, || async move {
            if let Ok(listed) = list_instances(mesh, agent).await
                && listed.iter().any(|i| watched_ref.contains(&i.lease_id) && i.reason == "DestroyFailing")
            {
                shown_ref.set(true);
            }
            let released = load.acks().released;
            let running = workloads::scan(mesh.run_id());
            (watched_ref.iter().all(|lease| released.contains(lease))
                && !running.iter().any(|w| watched_ref.contains(&w.lease_id)))
            .then_some(())
        })
        .await;
        // Counted per lease over the whole log: only this agent run injects
        // destroy failures, and a lease's first may come before it is watched.
        let log = self.mesh.agents()[agent].log_text();
        let injected_lines: Vec<&str> = log.lines().filter(|line| line.contains(INJECTED)).collect();
        let failures: Vec<(&String, usize)> = watched
            .iter()
            .map(|lease| (lease, injected_lines.iter().filter(|line| line.contains(lease.as_str())).count()))
            .collect();
        let injected: usize = failures.iter().map(|(_, n)| n).sum();
        let short: Vec<&(&String, usize)> = failures.iter().filter(|(_, n)| *n < 2).collect();
        if gone.is_none() {
            let left: Vec<String> = workloads::scan(self.mesh.run_id())
                .into_iter()
                .filter(|w| watched.contains(&w.lease_id))
                .map(|w| w.lease_id)
                .collect();
            outcome.violations.push(format!(
                "released leases' workloads still ran {DESTROY_BOUND:?} later: {left:?}\n{}",
                self.mesh.agents()[agent].log_tail(10)
            ));
        }
        if !short.is_empty() {
            outcome.violations.push(format!(
                "released leases whose destroy did not fail twice (lease, failures): {short:?}: the row proves nothing"
            ));
        }
        if !shown_failing.get() {
            outcome.violations.push(format!("ListInstances never showed a lease of {watched:?} as DestroyFailing"));
        }
        eprintln!(
            "faults: {} released leases' workloads gone {:.1?} after, through {injected} failed destroys",
            watched.len(),
            started.elapsed()
        );
        let agent_process = self.mesh.agent_mut(agent)?;
        agent_process.reconfigure(|spec| spec.env(FAULTS_ENV, ""));
        agent_process.stop(Duration::from_secs(10)).await?;
        agent_process.start()?;
        Ok(Outcome { recovery: gone.map(|()| started.elapsed()), violations: outcome.violations })
    }

    /// The agent, given `--stop-after-disconnect`, is cut off: it must stop
    /// everything it runs before the leases service can give the work to
    /// another node (a bound under two thirds of the lease TTL less the
    /// stop grace, the README's rule), so no replica runs twice.
    async fn partition_stopping(&mut self, agent: usize) -> anyhow::Result<Outcome> {
        let timings = self.mesh.options().timings.clone();
        anyhow::ensure!(
            STOP_AFTER < timings.lease_ttl() * 2 / 3 - timings.stop_grace,
            "{STOP_AFTER:?} is not a bound the README promises anything for"
        );
        let agent_process = self.mesh.agent_mut(agent)?;
        agent_process
            .reconfigure(|spec| spec.arg("--stop-after-disconnect").arg(format!("{}ms", STOP_AFTER.as_millis())));
        agent_process.stop(Duration::from_secs(10)).await?;
        agent_process.start()?;
        let (_, unsettled) = invariants::wait_settled(&self.mesh, &self.services, SETTLE_TIMEOUT).await?;
        anyhow::ensure!(unsettled.is_empty(), "not settled after the restart: {unsettled:?}");
        // The bound counts from the last renewal: the restarted agent must
        // have reconciled (holding nothing in custody) and renewed once.
        let mesh = &self.mesh;
        wait_for(SETTLE_TIMEOUT, || async move {
            let listed = list_instances_response(mesh, agent).await.ok()?;
            (listed.held_in_custody == 0 && !listed.instances.is_empty()).then_some(())
        })
        .await
        .context("the restarted agent never reconciled what it runs")?;
        tokio::time::sleep(timings.lease_ttl() / 3 + Duration::from_secs(1)).await;
        let (name, node, stale) = self.what_runs_on(agent).await?;
        anyhow::ensure!(!stale.is_empty(), "{name} runs nothing to stop");
        let kind = self.mesh.agent_mut(agent)?.cut()?;
        let cut_at = Instant::now();
        let mut violations = Vec::new();
        // Until the leases could be given away, and a little past it.
        let bound = timings.lease_ttl() + PARTITION_SLACK;
        let (mesh, stale_ref, node_ref) = (&self.mesh, &stale, &node);
        let most_twice = std::cell::Cell::new(0usize);
        let twice_ref = &most_twice;
        let gone = wait_for(bound, || async move {
            let running = workloads::scan(mesh.run_id());
            let stale_left = running.iter().any(|w| stale_ref.contains(&w.lease_id));
            let web: Vec<&workloads::Workload> = running
                .iter()
                .filter(|w| w.revision.as_deref().is_some_and(|r| r.starts_with(&format!("{WEB}-"))))
                .collect();
            if stale_left && web.iter().any(|w| w.node_id != node_ref.node_id) {
                twice_ref.set(twice_ref.get().max(web.len().saturating_sub(WEB_REPLICAS as usize)));
            }
            (!stale_left).then(|| cut_at.elapsed())
        })
        .await;
        match gone {
            Some(took) if took > timings.lease_ttl() => violations.push(format!(
                "{name}'s compute was stopped {took:.1?} after the cut, past the lease TTL ({:?})",
                timings.lease_ttl()
            )),
            Some(_) => {}
            None => {
                // Which of them: the rest of the set did stop.
                let left = still_running(&self.mesh, &stale);
                violations.push(format!(
                    "{name} still ran {left:?} (of {} leases at the cut) {bound:?} after it was cut off ({kind:?})\n{}",
                    stale.len(),
                    self.mesh.agents()[agent].log_tail(10)
                ));
            }
        }
        if most_twice.get() > 0 {
            violations.push(format!("{} replica copies of {WEB} ran twice while {name} was cut off", most_twice.get()));
        }
        self.mesh.agent_mut(agent)?.heal()?;
        let (mesh, name_ref) = (&self.mesh, &name);
        let back = wait_for(REJOIN_BOUND, || async move {
            let row = mesh.node(name_ref).await.ok()??;
            (row.state == "up").then_some(())
        })
        .await;
        if back.is_none() {
            violations.push(format!("{name} was not UP again within {REJOIN_BOUND:?} of its return"));
        }
        eprintln!(
            "faults: {name} stopped its {} workloads {:.1?} after it was cut off; {} copies ran twice",
            stale.len(),
            gone.unwrap_or(bound),
            most_twice.get()
        );
        Ok(Outcome { recovery: gone, violations })
    }

    /// Agent `agent`'s node name, its node, and the leases it runs now.
    async fn what_runs_on(&self, agent: usize) -> anyhow::Result<(String, berth_e2e::NodeRow, BTreeSet<String>)> {
        let name = self.mesh.agents()[agent].name().to_string();
        let node = self.mesh.node(&name).await?.context("the agent's node")?;
        let leases = workloads::scan(self.mesh.run_id())
            .into_iter()
            .filter(|w| w.node_id == node.node_id)
            .map(|w| w.lease_id)
            .collect();
        Ok((name, node, leases))
    }

    async fn partition(&mut self, agent: usize) -> anyhow::Result<Outcome> {
        let timings = self.mesh.options().timings.clone();
        let (name, node, stale) = self.what_runs_on(agent).await?;
        // The same watch that must see nothing during the other faults must
        // see this one: the node marked down and its leases expired.
        let watch = DbWatch::start(&self.mesh, vec![node.node_id.clone()]).await?;
        let kind = self.mesh.agent_mut(agent)?.cut()?;
        let cut_at = Instant::now();
        let mut violations = Vec::new();

        // Its leases move elsewhere: the node is reaped, and the service's
        // replicas run on other nodes.
        let move_bound =
            timings.down_after + timings.reap_after + timings.lease_ttl() + Duration::from_secs(10) + PARTITION_SLACK;
        let (mesh, name_ref, node_ref) = (&self.mesh, &name, &node);
        let moved = wait_for(move_bound, || async move {
            let row = mesh.node(name_ref).await.ok()??;
            let reaped = row.reaped_at_ms.is_some() || row.incarnation > node_ref.incarnation;
            let elsewhere = web_processes(mesh).await.ok()?;
            let running_elsewhere = elsewhere.iter().filter(|w| w.node_id != node_ref.node_id).count();
            (reaped && running_elsewhere >= WEB_REPLICAS as usize).then_some(())
        })
        .await;
        if moved.is_none() {
            violations
                .push(format!("{name} was not reaped with {WEB}'s replicas running elsewhere within {move_bound:?}"));
        }
        let overlap_before_heal = web_processes(&self.mesh).await?.len().saturating_sub(WEB_REPLICAS as usize);
        let cut_for = cut_at.elapsed();
        // The settled check must see the stale compute the cut-off node
        // still runs, or its silence after the faults would mean nothing.
        let seen = invariants::check_settled(&self.mesh, &self.services).await?;
        if !stale.iter().any(|lease| seen.iter().any(|v| v.contains(lease.as_str()))) {
            violations.push(format!("the invariant check did not see {name}'s stale compute {stale:?}: {seen:?}"));
        }

        // Back: fenced, it destroys what it ran before.
        self.mesh.agent_mut(agent)?.heal()?;
        let healed_at = Instant::now();
        let fencing_bound = match kind {
            // A cut-off agent backs off to the retry maximum, and a call in
            // flight when the link comes back may first time out.
            Cut::Network => berth_agent::DEFAULT_RETRY_MAX + berth_agent::DEFAULT_RPC_TIMEOUT,
            Cut::Frozen => berth_agent::DEFAULT_RPC_TIMEOUT,
        } + timings.heartbeat_interval
            + timings.stop_grace
            + PARTITION_SLACK;
        let (mesh, stale_ref) = (&self.mesh, &stale);
        let gone = wait_for(fencing_bound, || async move {
            let running = workloads::scan(mesh.run_id());
            (!running.iter().any(|w| stale_ref.contains(&w.lease_id))).then_some(())
        })
        .await;
        let fenced_in = healed_at.elapsed();
        if gone.is_none() {
            let left = still_running(&self.mesh, &stale);
            violations.push(format!(
                "stale compute still ran {fencing_bound:?} after {name} returned ({} replica copies ran twice \
                 while it was cut off): {left:?}\n{}",
                overlap_before_heal,
                self.mesh.agents()[agent].log_tail(10)
            ));
        }
        let (mesh, name_ref, node_ref) = (&self.mesh, &name, &node);
        let rejoined = wait_for(REJOIN_BOUND, || async move {
            let row = mesh.node(name_ref).await.ok()??;
            (row.state == "up" && row.incarnation > node_ref.incarnation).then_some(())
        })
        .await;
        if rejoined.is_none() {
            let row = self.mesh.node(&name).await?;
            violations.push(format!("{name} was not UP under a new incarnation within {REJOIN_BOUND:?}: {row:?}"));
        }
        let seen = watch.stop().await;
        let marked_down = seen.iter().any(|s| s.starts_with(&format!("healthy node {} was marked", node.node_id)));
        let expired = seen.iter().any(|s| s.starts_with("lease ") && s.contains(&format!(" on {} ", node.node_id)));
        if !marked_down || !expired {
            violations.push(format!(
                "the database watch missed the partition (node marked down: {marked_down}, a lease of it \
                 expired: {expired}), so it cannot vouch for the other faults: {seen:?}"
            ));
        }
        eprintln!(
            "faults: {name} was cut off for {cut_for:.1?}; {overlap_before_heal} replica copies ran twice until it \
             returned; its stale compute was gone {fenced_in:.1?} after (bound {fencing_bound:?})"
        );
        Ok(Outcome { recovery: gone.map(|()| fenced_in), violations })
    }

    /// An agent that runs one of web's replicas, other than `not`.
    async fn agent_running_web(&self, not: Option<usize>) -> anyhow::Result<usize> {
        for workload in web_processes(&self.mesh).await? {
            if let Some(agent) = self.mesh.agent_of_node(&workload.node_id).await?
                && Some(agent) != not
            {
                return Ok(agent);
            }
        }
        anyhow::bail!("no agent other than {not:?} runs a replica of {WEB}")
    }

    /// Every agent's and synthetic node's id: nodes that heartbeat throughout.
    async fn healthy_nodes(&self) -> anyhow::Result<Vec<String>> {
        let mut nodes: Vec<String> = self.load.nodes().iter().map(|n| n.node_id.clone()).collect();
        for agent in 0..self.mesh.agents().len() {
            nodes.push(self.mesh.agent_node_id(agent).await?);
        }
        Ok(nodes)
    }

    fn all_replicas(&self) -> Vec<(ServiceKind, usize)> {
        ServiceKind::ALL.iter().flat_map(|kind| (0..self.mesh.replicas()).map(move |index| (*kind, index))).collect()
    }

    fn replica_pid(&self, kind: ServiceKind, index: usize) -> Option<u32> {
        self.mesh.replica(kind, index).ok().and_then(|replica| replica.pid())
    }
}

/// Calls `probe` every [`POLL`] until it answers, for at most `bound`.
async fn wait_for<T, F, Fut>(bound: Duration, mut probe: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + bound;
    loop {
        if let Some(found) = probe().await {
            return Some(found);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(POLL).await;
    }
}

/// One real read of `kind` through its front, on a fresh connection.
async fn probe(mesh: &Mesh, kind: ServiceKind) -> Option<()> {
    let channel = mesh.channel(kind).ok()?;
    let timeout = Duration::from_secs(2);
    let answered = match kind {
        ServiceKind::Identity => {
            let mut request = tonic::Request::new(identity_v1::ListNodesRequest::default());
            request.set_timeout(timeout);
            identity_v1::nodes_client::NodesClient::new(channel).list_nodes(request).await.is_ok()
        }
        ServiceKind::Leases => {
            let mut request = tonic::Request::new(leases_v1::ListNodeCapacityRequest::default());
            request.set_timeout(timeout);
            leases_v1::capacity_client::CapacityClient::new(channel).list_node_capacity(request).await.is_ok()
        }
        ServiceKind::Revisions => {
            let mut request = tonic::Request::new(revisions_v1::ListServicesRequest::default());
            request.set_timeout(timeout);
            revisions_v1::services_client::ServicesClient::new(channel).list_services(request).await.is_ok()
        }
        // Egress serves no data yet; its health is its answer.
        ServiceKind::Egress => {
            let mut request = tonic::Request::new(tonic_health::pb::HealthCheckRequest { service: String::new() });
            request.set_timeout(timeout);
            tonic_health::pb::health_client::HealthClient::new(channel)
                .check(request)
                .await
                .is_ok_and(|r| r.get_ref().status == ServingStatus::Serving as i32)
        }
    };
    answered.then_some(())
}

/// Each replica's health now, described.
async fn health_of(mesh: &Mesh, replicas: &[(ServiceKind, usize)]) -> Vec<String> {
    let mut described = Vec::new();
    for (kind, index) in replicas {
        described.push(format!("{kind}-{index}: {:?}", mesh.health(*kind, *index).await));
    }
    described
}

/// The processes running a revision of web.
async fn web_processes(mesh: &Mesh) -> anyhow::Result<Vec<workloads::Workload>> {
    Ok(workloads::scan(mesh.run_id())
        .into_iter()
        .filter(|w| w.revision.as_deref().is_some_and(|r| r.starts_with(&format!("{WEB}-"))))
        .collect())
}

/// The instances agent `agent` reports.
async fn list_instances(mesh: &Mesh, agent: usize) -> anyhow::Result<Vec<agent_v1::Instance>> {
    Ok(list_instances_response(mesh, agent).await?.instances)
}

/// Agent `agent`'s whole answer to `ListInstances`, custody included.
async fn list_instances_response(mesh: &Mesh, agent: usize) -> anyhow::Result<agent_v1::ListInstancesResponse> {
    let mut request = tonic::Request::new(agent_v1::ListInstancesRequest::default());
    request.set_timeout(Duration::from_secs(2));
    let listed = agent_v1::agent_client::AgentClient::new(mesh.agent_channel(agent)?).list_instances(request).await?;
    Ok(listed.into_inner())
}

fn load_options(mesh: &Mesh, bundle_reference: String) -> LoadOptions {
    LoadOptions {
        synthetic_nodes: 240,
        synthetic_tier: "synthetic".into(),
        apply_every: Duration::from_millis(100),
        load_services: 4,
        lease_every: Duration::from_millis(100),
        open_leases: 2,
        writers: 4,
        lease_cpu_millis: 50,
        lease_memory_bytes: 16 << 20,
        tier: mesh.options().tier.clone(),
        request_timeout: Duration::from_secs(5),
        ack_deadline: Duration::from_secs(60),
        bundle_reference,
    }
}

/// Watches the database during a fault for what it must never show: a
/// healthy node marked anything but UP, or a lease expiring.
struct DbWatch {
    seen: Arc<Mutex<BTreeSet<String>>>,
    stop: tokio_util::sync::CancellationToken,
    task: JoinHandle<()>,
}

impl DbWatch {
    async fn start(mesh: &Mesh, nodes: Vec<String>) -> anyhow::Result<Self> {
        let pool = mesh.pool().clone();
        let (since,): (i64,) =
            sqlx::query_as("SELECT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT").fetch_one(&pool).await?;
        let seen = Arc::new(Mutex::new(BTreeSet::new()));
        let stop = tokio_util::sync::CancellationToken::new();
        let task = tokio::spawn({
            let (seen, stop) = (seen.clone(), stop.clone());
            async move {
                while !stop.is_cancelled() {
                    // The database may be the fault: a failed read is retried.
                    if let Ok(down) = sqlx::query_as::<_, (String, String)>(
                        "SELECT node_id, state FROM identity.nodes WHERE node_id = ANY($1) AND state <> 'up'",
                    )
                    .bind(&nodes)
                    .fetch_all(&pool)
                    .await
                    {
                        let mut seen = seen.lock().unwrap();
                        for (node, state) in down {
                            seen.insert(format!("healthy node {node} was marked {state}"));
                        }
                    }
                    if let Ok(expired) = sqlx::query_as::<_, (String, String)>(
                        "SELECT lease_id, node_id FROM leases.leases WHERE phase = 'expired' AND phase_changed_at_ms >= $1",
                    )
                    .bind(since)
                    .fetch_all(&pool)
                    .await
                    {
                        let mut seen = seen.lock().unwrap();
                        for (lease, node) in expired {
                            seen.insert(format!("lease {lease} on {node} expired though its node renewed it"));
                        }
                    }
                    tokio::select! {
                        () = stop.cancelled() => {}
                        () = tokio::time::sleep(POLL) => {}
                    }
                }
            }
        });
        Ok(Self { seen, stop, task })
    }

    async fn stop(self) -> Vec<String> {
        self.stop.cancel();
        let _ = self.task.await;
        self.seen.lock().unwrap().iter().cloned().collect()
    }
}
