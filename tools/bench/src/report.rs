//! The heartbeat benchmark's result: every figure, the targets it is held
//! to, and its two renderings (a table for people, JSON for scripts).
//!
//! # Invariants
//! - A target is judged on the figure named beside it, never adjusted: a
//!   missing figure (no successful call) misses the target.
//! - The heartbeat-to-empty-RPC ratio compares like with like: both rows
//!   driven as hard as they go over the same number of connections. The paced
//!   heartbeat rate is the offered load, so dividing it by a capacity would
//!   say more about `--nodes` than about identity.

use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;

use crate::load::{CpuFigures, ErrorCount, Figures};

/// p99 of paced heartbeats must stay under this.
const TARGET_P99_MS: f64 = 50.0;

/// Heartbeats driven flat out must reach this share of the empty RPC's rate.
const TARGET_CAPACITY_RATIO: f64 = 0.5;

/// Paced heartbeats must reach this share of the offered rate, with no errors.
const TARGET_SUSTAINED_SHARE: f64 = 0.99;

/// Identity's peak resident memory over the run must stay under this (each
/// replica's, when there are several).
const TARGET_RSS_AT_LOAD_MIB: f64 = 200.0;

/// Identity's resident memory before any load must stay under this.
const TARGET_RSS_IDLE_MIB: f64 = 40.0;

/// Distinct errors listed in the table.
const ERRORS_SHOWN: usize = 5;

/// Everything one run measured.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Report {
    /// Always "heartbeats".
    pub(crate) scenario: &'static str,
    /// Simulated nodes.
    pub(crate) nodes: u32,
    /// Each node's heartbeat interval.
    pub(crate) interval_ms: u64,
    /// Warm-up before each measured window.
    pub(crate) warmup_ms: u64,
    /// Length of each measured window.
    pub(crate) duration_ms: u64,
    /// Identity's store: "sqlite" or "postgres".
    pub(crate) store: &'static str,
    /// Identity's bus: "memory" or "redis".
    pub(crate) bus: &'static str,
    /// Identity's process id.
    pub(crate) identity_pid: u32,
    /// Heartbeats paced at the interval, one node per connection.
    pub(crate) heartbeat: Figures,
    /// What the nodes offered while paced: nodes per interval.
    pub(crate) heartbeat_offered_per_s: f64,
    /// Heartbeats sent back to back on the same connections.
    pub(crate) heartbeat_saturated: Figures,
    /// `grpc.health.v1.Health/Check` back to back on as many connections.
    pub(crate) empty_rpc: Figures,
    /// How the fleet joined.
    pub(crate) join: JoinFigures,
    /// Identity's resident memory (the sum over its replicas).
    pub(crate) identity_memory: MemoryFigures,
    /// Each identity replica: its nodes and its memory.
    pub(crate) replicas: Vec<ReplicaFigures>,
    /// Every distinct failure, joins and warm-ups included, commonest first.
    pub(crate) errors: Vec<ErrorCount>,
    /// The targets, judged.
    pub(crate) targets: Vec<Target>,
    /// The machine it ran on.
    #[serde(flatten)]
    pub(crate) machine: Machine,
}

/// The join phase: every node's Join and first heartbeat.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct JoinFigures {
    /// Nodes joined.
    pub(crate) nodes: u32,
    /// Nodes whose first heartbeat failed every attempt (they kept heartbeating).
    pub(crate) first_heartbeat_failed: u32,
    /// Joins in flight at once.
    pub(crate) concurrency: u32,
    /// Wall time for all of them.
    pub(crate) seconds: f64,
    /// Nodes joined per second.
    pub(crate) rate_per_s: f64,
    /// CPU over the whole phase (joined nodes heartbeat meanwhile); per call
    /// is per node joined.
    pub(crate) cpu: Option<CpuFigures>,
}

/// Identity's resident memory, MiB.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct MemoryFigures {
    /// Resident after start, before any load.
    pub(crate) idle_mib: f64,
    /// The most it was ever resident during the run (`VmHWM`).
    pub(crate) at_load_mib: f64,
    /// The most seen (sampled `VmRSS`) during each phase.
    pub(crate) phase_peaks_mib: PhasePeaks,
    /// What one client connection costs identity: the empty-RPC peak over
    /// idle, per connection, KiB.
    pub(crate) per_connection_kib: f64,
}

/// Sampled resident-memory peaks per phase, MiB.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct PhasePeaks {
    /// Under the empty-RPC baseline.
    pub(crate) empty_rpc: f64,
    /// While the nodes joined.
    pub(crate) join: f64,
    /// Under paced heartbeats.
    pub(crate) heartbeat: f64,
    /// Under back-to-back heartbeats.
    pub(crate) heartbeat_saturated: f64,
}

/// One identity replica's share of the fleet and what it cost.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ReplicaFigures {
    /// Its process id.
    pub(crate) pid: u32,
    /// Nodes heartbeating to it.
    pub(crate) nodes: u32,
    /// Resident after start, before any load, MiB.
    pub(crate) idle_mib: f64,
    /// Its sampled peak under paced heartbeats, MiB.
    pub(crate) heartbeat_mib: f64,
    /// The most it was ever resident during the run (`VmHWM`), MiB.
    pub(crate) at_load_mib: f64,
    /// What one heartbeating node costs it: the paced-heartbeat peak over
    /// idle, per node, KiB; `None` without nodes.
    pub(crate) per_node_kib: Option<f64>,
}

/// One target and whether the run met it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Target {
    /// What is held to what, in words.
    pub(crate) name: String,
    /// The measured figure it was judged on, in the target's unit.
    pub(crate) value: Option<f64>,
    /// Whether it was met.
    pub(crate) met: bool,
}

/// The machine a run was measured on: how many CPUs it offers and how busy
/// other work kept it just before (reports print both beside every figure).
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Machine {
    /// CPUs this machine offers the bench and what it measures together.
    pub(crate) cpus: usize,
    /// The one-minute load average before the run: other work sharing the machine.
    pub(crate) load_average_before: Option<f64>,
}

impl Machine {
    /// This machine, as it is now: taken before a run starts.
    pub(crate) fn before_run() -> Self {
        Self {
            cpus: std::thread::available_parallelism().map_or(0, usize::from),
            load_average_before: crate::procfs::load_average(),
        }
    }

    /// `machine: N CPUs {shared}; load average L over the minute before the run`.
    pub(crate) fn line(&self, shared: &str) -> String {
        let load = self.load_average_before.map_or_else(|| "unknown".to_string(), |l| format!("{l:.2}"));
        format!("machine: {} CPUs {shared}; load average {load} over the minute before the run", self.cpus)
    }

    /// The end of a report's table: the machine, the targets' verdicts and
    /// the commonest errors.
    pub(crate) fn write_footer(&self, out: &mut String, shared: &str, targets: &[Target], errors: &[ErrorCount]) {
        use std::fmt::Write as _;
        let _ = writeln!(out, "{}", self.line(shared));
        let _ = writeln!(out, "{}", verdicts_line(targets, 1));
        write_errors(out, errors, ERRORS_SHOWN);
    }
}

/// `OK` for a target met, `MISSED` for one missed.
pub(crate) fn verdict(met: bool) -> &'static str {
    if met { "OK" } else { "MISSED" }
}

/// `targets: NAME OK (VALUE); ...`: each target's verdict, its figure with
/// `decimals` places.
pub(crate) fn verdicts_line(targets: &[Target], decimals: usize) -> String {
    let verdicts: Vec<String> = targets
        .iter()
        .map(|t| {
            let value = t.value.map_or_else(|| "no figure".to_string(), |v| format!("{v:.decimals$}"));
            format!("{} {} ({value})", t.name, verdict(t.met))
        })
        .collect();
    format!("targets: {}", verdicts.join("; "))
}

/// The `shown` commonest errors, a line each.
pub(crate) fn write_errors(out: &mut String, errors: &[crate::load::ErrorCount], shown: usize) {
    use std::fmt::Write as _;
    for error in errors.iter().take(shown) {
        let _ = writeln!(out, "  {:>8} x {}", error.count, error.message);
    }
}

impl Report {
    /// Judges the figures against the targets and stores the verdicts.
    pub(crate) fn judge(&mut self) {
        let paced = &self.heartbeat;
        let sustained_share =
            if self.heartbeat_offered_per_s > 0.0 { paced.rate_per_s / self.heartbeat_offered_per_s } else { 0.0 };
        let ratio =
            (self.empty_rpc.rate_per_s > 0.0).then(|| self.heartbeat_saturated.rate_per_s / self.empty_rpc.rate_per_s);
        let several = self.replicas.len() > 1;
        let per = if several { " per replica" } else { "" };
        let (idle_mib, at_load_mib) = if several {
            let most = |figure: fn(&ReplicaFigures) -> f64| self.replicas.iter().map(figure).fold(0.0, f64::max);
            (most(|r| r.idle_mib), most(|r| r.at_load_mib))
        } else {
            (self.identity_memory.idle_mib, self.identity_memory.at_load_mib)
        };
        self.targets = vec![
            Target {
                name: format!(
                    "heartbeats sustained >= {:.0}% of {:.0}/s offered, no errors",
                    TARGET_SUSTAINED_SHARE * 100.0,
                    self.heartbeat_offered_per_s
                ),
                value: Some(sustained_share),
                met: sustained_share >= TARGET_SUSTAINED_SHARE && paced.errors == 0,
            },
            Target {
                name: format!("p99 < {TARGET_P99_MS:.0}ms"),
                value: paced.p99_ms,
                met: paced.p99_ms.is_some_and(|p99| p99 < TARGET_P99_MS),
            },
            Target {
                name: format!("heartbeat >= {TARGET_CAPACITY_RATIO} x empty RPC (both saturated)"),
                value: ratio,
                met: ratio.is_some_and(|r| r >= TARGET_CAPACITY_RATIO),
            },
            Target {
                name: format!("RSS at load < {TARGET_RSS_AT_LOAD_MIB:.0} MiB{per}"),
                value: Some(at_load_mib),
                met: at_load_mib < TARGET_RSS_AT_LOAD_MIB,
            },
            Target {
                name: format!("idle < {TARGET_RSS_IDLE_MIB:.0} MiB{per}"),
                value: Some(idle_mib),
                met: idle_mib < TARGET_RSS_IDLE_MIB,
            },
        ];
    }

    /// The report as aligned text.
    pub(crate) fn table(&self) -> String {
        let mut out = String::new();
        let backend =
            if self.bus == "memory" { self.store.to_string() } else { format!("{} + {}", self.store, self.bus) };
        let processes = if self.replicas.len() > 1 {
            let pids: Vec<String> = self.replicas.iter().map(|r| r.pid.to_string()).collect();
            format!("{} replicas, pids {}", self.replicas.len(), pids.join(", "))
        } else {
            format!("pid {}", self.identity_pid)
        };
        let _ = writeln!(
            out,
            "berth-bench heartbeats: {} nodes, interval {}, {} measured, identity on {backend} ({processes})",
            self.nodes,
            human(Duration::from_millis(self.interval_ms)),
            human(Duration::from_millis(self.duration_ms)),
        );
        let _ = writeln!(
            out,
            "{:<24}{:>10}{:>10}{:>10}{:>8}{:>14}{:>10}{:>12}{:>12}",
            "", "rate/s", "p50", "p99", "errors", "identity CPU", "CPU/call", "bench CPU", "other CPU"
        );
        for (name, figures) in [
            ("heartbeat", &self.heartbeat),
            ("heartbeat, saturated", &self.heartbeat_saturated),
            ("empty mTLS RPC", &self.empty_rpc),
        ] {
            let cpu = figures.cpu.as_ref();
            let _ = writeln!(
                out,
                "{name:<24}{:>10.1}{:>10}{:>10}{:>8}{:>14}{:>10}{:>12}{:>12}",
                figures.rate_per_s,
                latency(figures.p50_ms),
                latency(figures.p99_ms),
                figures.errors,
                cpu.map_or_else(|| "-".to_string(), |c| format!("{:.2} cores", c.identity_cores)),
                cpu.and_then(|c| c.identity_us_per_call).map_or_else(|| "-".to_string(), |us| format!("{us:.0}us")),
                cpu.map_or_else(|| "-".to_string(), |c| format!("{:.2} cores", c.bench_cores)),
                cpu.map_or_else(|| "-".to_string(), |c| format!("{:.2} cores", c.other_cores)),
            );
        }
        let _ = writeln!(
            out,
            "(heartbeat: each node every {} on its own connection, {:.0}/s offered; saturated rows: one call \
             in flight per connection, back to back, {} connections)",
            human(Duration::from_millis(self.interval_ms)),
            self.heartbeat_offered_per_s,
            self.empty_rpc.connections,
        );
        let _ = write!(
            out,
            "joined {} nodes in {:.1}s ({:.0}/s, {} at once)",
            self.join.nodes, self.join.seconds, self.join.rate_per_s, self.join.concurrency
        );
        if let Some(cpu) = &self.join.cpu {
            let _ = write!(
                out,
                "; identity {:.2} cores, bench {:.2} cores, other {:.2} cores",
                cpu.identity_cores, cpu.bench_cores, cpu.other_cores
            );
        }
        if self.join.first_heartbeat_failed > 0 {
            let _ = write!(
                out,
                "; {} nodes were not up after their first heartbeat's retries and went on heartbeating",
                self.join.first_heartbeat_failed
            );
        }
        out.push('\n');
        let _ = writeln!(
            out,
            "{}",
            self.machine.line(
                "shared by identity, the bench and all else (other CPU: PostgreSQL, Redis, the kernel, other work)"
            )
        );
        let memory = &self.identity_memory;
        let peaks = &memory.phase_peaks_mib;
        let _ = writeln!(
            out,
            "identity RSS: idle {:.1} MiB, at load {:.1} MiB (peak of the run; sampled peaks: empty RPC {:.1}, \
             join {:.1}, heartbeat {:.1}, saturated {:.1}; about {:.0} KiB per connection)",
            memory.idle_mib,
            memory.at_load_mib,
            peaks.empty_rpc,
            peaks.join,
            peaks.heartbeat,
            peaks.heartbeat_saturated,
            memory.per_connection_kib,
        );
        if self.replicas.len() > 1 {
            for (index, replica) in self.replicas.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "  replica {} (pid {}): {} nodes; RSS idle {:.1} MiB, heartbeat {:.1} MiB, at load {:.1} MiB; {}",
                    index + 1,
                    replica.pid,
                    replica.nodes,
                    replica.idle_mib,
                    replica.heartbeat_mib,
                    replica.at_load_mib,
                    replica
                        .per_node_kib
                        .map_or_else(|| "no nodes".to_string(), |kib| format!("about {kib:.0} KiB per node")),
                );
            }
        }
        let _ = writeln!(out, "{}", crate::report::verdicts_line(&self.targets, 2));
        if !self.errors.is_empty() {
            let _ = writeln!(out, "errors (joins and warm-ups included):");
            write_errors(&mut out, &self.errors, ERRORS_SHOWN);
            if self.errors.len() > ERRORS_SHOWN {
                let _ = writeln!(out, "  ... and {} more kinds", self.errors.len() - ERRORS_SHOWN);
            }
        }
        out
    }
}

/// A latency for the table: two decimals under a millisecond, one above.
fn latency(ms: Option<f64>) -> String {
    match ms {
        None => "-".to_string(),
        Some(ms) if ms < 1.0 => format!("{ms:.2}ms"),
        Some(ms) => format!("{ms:.1}ms"),
    }
}

/// A duration as the flags take it: `1s`, `250ms`.
pub(crate) fn human(duration: Duration) -> String {
    if duration.subsec_millis() == 0 && duration.as_secs() > 0 {
        format!("{}s", duration.as_secs())
    } else {
        format!("{}ms", duration.as_millis())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(rate: f64, p99: Option<f64>, errors: u64) -> Figures {
        Figures {
            calls: rate as u64,
            errors,
            rate_per_s: rate,
            p50_ms: p99.map(|p| p / 2.0),
            p99_ms: p99,
            max_ms: p99,
            connections: 100,
            cpu: None,
        }
    }

    fn report() -> Report {
        let mut report = Report {
            scenario: "heartbeats",
            nodes: 100,
            interval_ms: 1000,
            warmup_ms: 5000,
            duration_ms: 30_000,
            store: "postgres",
            bus: "redis",
            identity_pid: 42,
            heartbeat: figures(99.5, Some(9.0), 0),
            heartbeat_offered_per_s: 100.0,
            heartbeat_saturated: figures(12_000.0, Some(20.0), 0),
            empty_rpc: figures(20_000.0, Some(10.0), 0),
            join: JoinFigures {
                nodes: 100,
                first_heartbeat_failed: 0,
                concurrency: 32,
                seconds: 2.0,
                rate_per_s: 50.0,
                cpu: None,
            },
            identity_memory: MemoryFigures {
                idle_mib: 21.4,
                at_load_mib: 96.8,
                phase_peaks_mib: PhasePeaks { empty_rpc: 60.0, join: 70.0, heartbeat: 90.0, heartbeat_saturated: 96.0 },
                per_connection_kib: 395.3,
            },
            replicas: vec![ReplicaFigures {
                pid: 42,
                nodes: 100,
                idle_mib: 21.4,
                heartbeat_mib: 90.0,
                at_load_mib: 96.8,
                per_node_kib: Some(703.0),
            }],
            errors: Vec::new(),
            targets: Vec::new(),
            machine: Machine { cpus: 2, load_average_before: Some(0.25) },
        };
        report.judge();
        report
    }

    fn met(report: &Report) -> Vec<bool> {
        report.targets.iter().map(|t| t.met).collect()
    }

    #[test]
    fn a_run_inside_every_target_meets_them_all() {
        let report = report();
        assert_eq!(met(&report), vec![true; 5]);
        let table = report.table();
        assert!(
            table.starts_with(
                "berth-bench heartbeats: 100 nodes, interval 1s, 30s measured, identity on postgres + redis (pid 42)"
            ),
            "{table}"
        );
        assert!(table.contains("\nheartbeat                     99.5     4.5ms     9.0ms       0             -         -           -           -\n"), "{table}");
        assert!(table.contains("\nempty mTLS RPC             20000.0     5.0ms    10.0ms       0             -         -           -           -\n"), "{table}");
        assert!(table.contains("; load average 0.25 over the minute before the run"), "{table}");
        assert!(table.contains("identity RSS: idle 21.4 MiB, at load 96.8 MiB"), "{table}");
        assert!(table.contains("about 395 KiB per connection)"), "{table}");
        assert!(!table.contains("MISSED"), "{table}");
    }

    #[test]
    fn the_capacity_ratio_is_judged_on_the_saturated_rows() {
        let mut report = report();
        report.heartbeat_saturated = figures(9_999.0, Some(20.0), 0);
        report.judge();
        assert_eq!(report.targets[2].value, Some(9_999.0 / 20_000.0));
        assert!(!report.targets[2].met);
        assert!(report.table().contains("heartbeat >= 0.5 x empty RPC (both saturated) MISSED (0.50)"));
    }

    #[test]
    fn a_single_paced_error_misses_the_sustained_target() {
        let mut report = report();
        report.heartbeat = figures(100.0, Some(9.0), 1);
        report.judge();
        assert!(!report.targets[0].met);
    }

    #[test]
    fn a_run_without_answers_misses_the_latency_target() {
        let mut report = report();
        report.heartbeat = figures(0.0, None, 0);
        report.empty_rpc = figures(0.0, None, 0);
        report.judge();
        assert_eq!(met(&report), vec![false, false, false, true, true]);
        assert!(report.table().contains("p99 < 50ms MISSED (no figure)"));
    }

    #[test]
    fn memory_over_the_limits_misses() {
        let mut report = report();
        report.identity_memory.idle_mib = 40.0;
        report.identity_memory.at_load_mib = 200.0;
        report.judge();
        assert_eq!(met(&report), vec![true, true, true, false, false]);
    }

    #[test]
    fn with_several_replicas_each_is_held_to_the_memory_targets_and_listed() {
        let mut report = report();
        let replica = |pid, nodes, at_load_mib| ReplicaFigures {
            pid,
            nodes,
            idle_mib: 20.0,
            heartbeat_mib: at_load_mib - 5.0,
            at_load_mib,
            per_node_kib: Some(30.0),
        };
        // 330 MiB in all, but each replica under its 200.
        report.replicas = vec![replica(7, 34, 110.0), replica(8, 33, 110.0), replica(9, 33, 110.0)];
        report.identity_memory.at_load_mib = 330.0;
        report.judge();
        assert_eq!(met(&report), vec![true; 5]);
        assert_eq!(report.targets[3].name, "RSS at load < 200 MiB per replica");
        assert_eq!(report.targets[3].value, Some(110.0));
        let table = report.table();
        assert!(table.contains("identity on postgres + redis (3 replicas, pids 7, 8, 9)"), "{table}");
        assert!(
            table.contains("  replica 2 (pid 8): 33 nodes; RSS idle 20.0 MiB, heartbeat 105.0 MiB, at load 110.0 MiB; about 30 KiB per node\n"),
            "{table}"
        );

        report.replicas[2].at_load_mib = 201.0;
        report.judge();
        assert_eq!(met(&report), vec![true, true, true, false, true], "one replica over is a miss");
    }

    #[test]
    fn cpu_columns_show_cores_and_the_cost_of_a_call() {
        let mut report = report();
        report.heartbeat.cpu = Some(CpuFigures {
            identity_cores: 0.4,
            identity_us_per_call: Some(41.7),
            bench_cores: 0.6,
            machine_cores: 1.97,
            other_cores: 0.97,
        });
        let table = report.table();
        assert!(table.contains("\nheartbeat                     99.5     4.5ms     9.0ms       0    0.40 cores      42us  0.60 cores  0.97 cores\n"), "{table}");
    }

    #[test]
    fn durations_read_as_the_flags_take_them() {
        assert_eq!(human(Duration::from_secs(30)), "30s");
        assert_eq!(human(Duration::from_millis(250)), "250ms");
        assert_eq!(human(Duration::from_millis(1500)), "1500ms");
    }
}
