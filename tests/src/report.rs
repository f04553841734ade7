//! What a fault run prints: one row per fault with the load the mesh held
//! during it, the errors its clients saw, how long it took to recover, and
//! every invariant it broke (which must be none).

use std::fmt::Write as _;
use std::time::Duration;

/// How one fault went.
#[derive(Debug, Clone)]
pub struct FaultRow {
    /// The fault, e.g. "kill -9 leases-1 (leader)".
    pub fault: String,
    /// Successful requests per second from the fault until it was over.
    pub load_rps: f64,
    /// Failed request attempts clients saw in that time.
    pub client_errors: u64,
    /// From the fault (or its end, as the fault says) until the mesh had
    /// recovered; `None` if it never did.
    pub recovery: Option<Duration>,
    /// What recovery means for this fault.
    pub recovered_when: String,
    /// Every broken promise, described.
    pub violations: Vec<String>,
}

/// The table of rows, as printed.
pub fn table(rows: &[FaultRow]) -> String {
    let fault_width = rows.iter().map(|r| r.fault.len()).max().unwrap_or(0).max("fault".len());
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<fault_width$}  {:>10}  {:>13}  {:>9}  {:>10}  recovered when",
        "fault", "load req/s", "client errors", "recovery", "violations"
    );
    for row in rows {
        let recovery = row.recovery.map_or_else(|| "never".to_string(), |d| format!("{:.1}s", d.as_secs_f64()));
        let _ = writeln!(
            out,
            "{:<fault_width$}  {:>10.1}  {:>13}  {:>9}  {:>10}  {}",
            row.fault,
            row.load_rps,
            row.client_errors,
            recovery,
            row.violations.len(),
            row.recovered_when
        );
    }
    for row in rows.iter().filter(|r| !r.violations.is_empty()) {
        let _ = writeln!(out, "\n{}:", row.fault);
        for violation in &row.violations {
            let _ = writeln!(out, "  - {violation}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_violation_is_listed_under_its_fault() {
        let rows = vec![
            FaultRow {
                fault: "restart Redis".into(),
                load_rps: 42.04,
                client_errors: 3,
                recovery: Some(Duration::from_millis(1500)),
                recovered_when: "every request kind succeeded".into(),
                violations: vec![],
            },
            FaultRow {
                fault: "kill -9 agent e2e-agent-1".into(),
                load_rps: 40.0,
                client_errors: 0,
                recovery: None,
                recovered_when: "its replicas were adopted".into(),
                violations: vec!["lease l-1 restarted".into()],
            },
        ];
        let printed = table(&rows);
        let fields = |start: &str| -> Vec<String> {
            let line = printed.lines().find(|l| l.starts_with(start)).unwrap_or_default();
            line.split_whitespace().map(str::to_string).collect()
        };
        assert_eq!(fields("restart Redis")[2..6], ["42.0", "3", "1.5s", "0"], "{printed}");
        assert_eq!(fields("kill -9 agent e2e-agent-1 ")[4..8], ["40.0", "0", "never", "1"], "{printed}");
        assert!(printed.contains("kill -9 agent e2e-agent-1:\n  - lease l-1 restarted"), "{printed}");
    }
}
