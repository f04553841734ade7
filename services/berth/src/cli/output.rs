//! How the admin commands print: aligned tables with relative ages for
//! people, and JSON for scripts.
//!
//! # The JSON shape
//! The response message in the proto3 JSON mapping, exactly as `grpcurl` prints
//! it (`berth_proto::json`): lowerCamelCase names, enums by value name, 64-bit
//! integers as strings, RFC 3339 timestamps, default values left out. The few
//! commands that print more than one answer print an object whose members are
//! such messages.

use std::io::Write;
use std::time::SystemTime;

use berth_proto::identity::v1;
use berth_proto::leases::v1 as leases;
use berth_proto::types::v1::{Capacity, Condition, ConditionStatus};
use prost_types::Timestamp;
use serde_json::Value;

use super::CliError;

/// What a table cell shows for a value that is not set.
pub(crate) const NONE: &str = "<none>";

/// Columns under upper-case headers, each as wide as its widest cell,
/// three spaces apart.
#[derive(Debug)]
pub(crate) struct Table {
    headers: Vec<&'static str>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub(crate) fn new(headers: Vec<&'static str>) -> Self {
        Self { headers, rows: Vec::new() }
    }

    pub(crate) fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// The table as a section under `heading`, indented; `when_empty` in
    /// its place when it has no rows.
    pub(crate) fn section(&self, heading: &str, when_empty: &str) -> String {
        if self.rows.is_empty() {
            format!("\n{heading}:\n  {when_empty}\n")
        } else {
            format!("\n{heading}:\n{}", indent(&self.render()))
        }
    }

    pub(super) fn render(&self) -> String {
        let header: Vec<String> = self.headers.iter().map(|h| h.to_string()).collect();
        let lines: Vec<&Vec<String>> = std::iter::once(&header).chain(&self.rows).collect();
        let mut widths = vec![0; self.headers.len()];
        for line in &lines {
            for (width, cell) in widths.iter_mut().zip(line.iter()) {
                *width = (*width).max(cell.chars().count());
            }
        }
        let mut out = String::new();
        for line in lines {
            let mut text = String::new();
            for (i, cell) in line.iter().enumerate() {
                if i + 1 < line.len() {
                    let pad = widths[i] - cell.chars().count();
                    text.push_str(cell);
                    text.push_str(&" ".repeat(pad + 3));
                } else {
                    text.push_str(cell);
                }
            }
            out.push_str(text.trim_end());
            out.push('\n');
        }
        out
    }
}

/// The project an empty project field means.
const DEFAULT_PROJECT: &str = "default";

/// A project as printed: an empty one is the default project.
pub(super) fn project_name(project: &str) -> &str {
    if project.is_empty() { DEFAULT_PROJECT } else { project }
}

/// `text` indented by two spaces, a section under a heading.
pub(super) fn indent(text: &str) -> String {
    text.lines().map(|line| format!("  {line}\n")).collect()
}

/// `key: value` lines with the values in one column, like `kubectl
/// describe`.
pub(crate) fn fields(rows: &[(&str, String)]) -> String {
    let width = rows.iter().map(|(key, _)| key.chars().count()).max().unwrap_or(0) + 1;
    rows.iter().map(|(key, value)| format!("{:<width$}  {value}\n", format!("{key}:"))).collect()
}

/// Writes `text` to stdout. A reader that went away (`| head`) is not an
/// error.
pub(super) fn print(text: &str) -> Result<(), CliError> {
    write_stdout(text).map_err(CliError::Output)
}

/// Writes `text` to stdout and flushes it; a reader that went away (`|
/// head`) is not an error. Every command's output goes through it.
pub(crate) fn write_stdout(text: &str) -> std::io::Result<()> {
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()) {
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

/// Writes a message the server answered to stdout, as `grpcurl` prints it.
pub(super) fn print_message<M: prost::Message + prost::Name>(message: &M) -> Result<(), CliError> {
    print_json(&message_json(message)?)
}

/// A message in the proto3 JSON mapping, to print or to place in a larger object.
pub(super) fn message_json<M: prost::Message + prost::Name>(message: &M) -> Result<Value, CliError> {
    berth_proto::json::to_json(message).map_err(CliError::Json)
}

/// Writes `value` to stdout as indented JSON.
pub(super) fn print_json(value: &Value) -> Result<(), CliError> {
    print(&json_text(value))
}

/// `value` as indented JSON, one line after it.
pub(crate) fn json_text(value: &Value) -> String {
    // A `Value`'s keys are strings: it always serializes.
    let mut text = serde_json::to_string_pretty(value).unwrap_or_default();
    text.push('\n');
    text
}

/// A note for the person at the terminal, kept off stdout so output can be
/// piped.
/// An answer as `format` asks: the message as JSON, else `text()` as it
/// reads.
pub(super) fn print_answer<M: prost::Message + prost::Name, T: AsRef<str>>(
    format: super::OutputFormat,
    message: &M,
    text: impl FnOnce() -> T,
) -> Result<(), CliError> {
    match format {
        super::OutputFormat::Json => print_message(message),
        super::OutputFormat::Table => print(text().as_ref()),
    }
}

/// A List answer as `format` asks: the message as JSON; else a table with
/// a row per item under `headers`, or, with no item, a note that no
/// `plural` were found.
pub(super) fn print_listed<M: prost::Message + prost::Name, T>(
    listed: &M,
    items: &[T],
    plural: &str,
    format: super::OutputFormat,
    headers: Vec<&'static str>,
    row: impl Fn(&T) -> Vec<String>,
) -> Result<(), CliError> {
    if format == super::OutputFormat::Json {
        return print_message(listed);
    }
    if items.is_empty() {
        note(&format!("No {plural} found."));
        return Ok(());
    }
    let mut table = Table::new(headers);
    for item in items {
        table.row(row(item));
    }
    print(&table.render())
}

pub(super) fn note(text: &str) {
    eprintln!("{text}");
}

/// How long ago `at` was, like `kubectl get`: `45s`, `5m30s`, `3h`, `4d`.
pub(super) fn age(at: Option<&Timestamp>) -> String {
    match at {
        Some(at) => human_duration(now_secs().saturating_sub(at.seconds).max(0).unsigned_abs()),
        None => NONE.to_string(),
    }
}

/// How long until `at`: `in 59m`, or `expired 2m ago` once it has passed.
pub(super) fn until(at: Option<&Timestamp>) -> String {
    let Some(at) = at else { return NONE.to_string() };
    let delta = at.seconds.saturating_sub(now_secs());
    if delta > 0 {
        format!("in {}", human_duration(delta.unsigned_abs()))
    } else {
        format!("expired {} ago", human_duration(delta.unsigned_abs()))
    }
}

/// Whether `at` has passed.
pub(super) fn is_past(at: &Timestamp) -> bool {
    at.seconds <= now_secs()
}

/// `at` in RFC 3339 followed by how far away it is, for detail views.
pub(super) fn when(at: Option<&Timestamp>, relative: &str) -> String {
    match at {
        Some(at) => format!("{at} ({relative})"),
        None => NONE.to_string(),
    }
}

/// A duration in the units a person reads at a glance, in the shape
/// `kubectl` uses.
pub(super) fn human_duration(seconds: u64) -> String {
    let minutes = seconds / 60;
    let hours = minutes / 60;
    let days = hours / 24;
    let years = days / 365;
    let pair = |major: u64, major_unit: &str, minor: u64, minor_unit: &str| {
        if minor == 0 { format!("{major}{major_unit}") } else { format!("{major}{major_unit}{minor}{minor_unit}") }
    };
    if seconds < 120 {
        format!("{seconds}s")
    } else if minutes < 10 {
        pair(minutes, "m", seconds % 60, "s")
    } else if minutes < 180 {
        format!("{minutes}m")
    } else if hours < 8 {
        pair(hours, "h", minutes % 60, "m")
    } else if hours < 48 {
        format!("{hours}h")
    } else if days < 8 {
        pair(days, "d", hours % 24, "h")
    } else if days < 2 * 365 {
        format!("{days}d")
    } else if years < 8 {
        pair(years, "y", days % 365, "d")
    } else {
        format!("{years}y")
    }
}

fn now_secs() -> i64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(0))
}

/// CPU the way Kubernetes writes it: whole cores as `4`, the rest as `250m`.
pub(super) fn cpu(millis: u64) -> String {
    if millis.is_multiple_of(1000) { (millis / 1000).to_string() } else { format!("{millis}m") }
}

/// Bytes in the largest binary unit that keeps them readable: `512Mi`, `1.5Gi`.
pub(crate) fn memory(bytes: u64) -> String {
    const UNITS: [(&str, u64); 5] =
        [("Pi", 1 << 50), ("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)];
    for (unit, size) in UNITS {
        if bytes >= size {
            let tenths = (u128::from(bytes) * 10 + u128::from(size) / 2) / u128::from(size);
            return if tenths % 10 == 0 {
                format!("{}{unit}", tenths / 10)
            } else {
                format!("{}.{}{unit}", tenths / 10, tenths % 10)
            };
        }
    }
    bytes.to_string()
}

/// `cpu 4, memory 8Gi`, or `<none>` when nothing was reported.
pub(super) fn capacity(capacity: Option<&Capacity>) -> String {
    match capacity {
        Some(c) => format!("cpu {}, memory {}", cpu(c.cpu_millis), memory(c.memory_bytes)),
        None => NONE.to_string(),
    }
}

/// `k=v,k2=v2` sorted by key, or `<none>`.
pub(super) fn labels(labels: &std::collections::HashMap<String, String>) -> String {
    if labels.is_empty() {
        return NONE.to_string();
    }
    let mut pairs: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    pairs.sort();
    pairs.join(",")
}

/// A cell for a string that may be empty.
pub(super) fn or_none(value: &str) -> String {
    if value.is_empty() { NONE.to_string() } else { value.to_string() }
}

/// A node state as people read it: `UP`, `DRAINING`.
pub(super) fn node_state(state: i32) -> String {
    match v1::NodeState::try_from(state) {
        Ok(v1::NodeState::Unspecified) => "UNKNOWN".to_string(),
        Ok(state) => state.as_str_name().trim_start_matches("NODE_STATE_").to_string(),
        Err(_) => format!("UNKNOWN({state})"),
    }
}

/// A lease phase as people read it: `RUNNING`, `DONE`.
pub(super) fn lease_phase(phase: i32) -> String {
    match leases::LeasePhase::try_from(phase) {
        Ok(leases::LeasePhase::Unspecified) => "UNKNOWN".to_string(),
        Ok(phase) => phase.as_str_name().trim_start_matches("LEASE_PHASE_").to_string(),
        Err(_) => format!("UNKNOWN({phase})"),
    }
}

/// Why a lease is where it is, with its exit status once it exited:
/// `Exited (exit code 3)`, or `<none>`.
pub(super) fn lease_reason(lease: &leases::Lease) -> String {
    match (lease.reason.as_str(), lease.exit_code) {
        ("", None) => NONE.to_string(),
        ("", Some(code)) => format!("exit code {code}"),
        (reason, None) => reason.to_string(),
        (reason, Some(code)) => format!("{reason} (exit code {code})"),
    }
}

/// A condition status as `kubectl` shows it: `True`, `False`, `Unknown`.
pub(super) fn condition_status(status: i32) -> String {
    match ConditionStatus::try_from(status) {
        Ok(ConditionStatus::True) => "True".to_string(),
        Ok(ConditionStatus::False) => "False".to_string(),
        Ok(ConditionStatus::Unknown | ConditionStatus::Unspecified) => "Unknown".to_string(),
        Err(_) => format!("Unknown({status})"),
    }
}

/// The status of the condition of type `kind`, or `Unknown` when there is
/// none.
pub(super) fn condition_of(conditions: &[Condition], kind: &str) -> String {
    conditions.iter().find(|c| c.r#type == kind).map_or_else(|| "Unknown".to_string(), |c| condition_status(c.status))
}

/// Conditions as a table: TYPE STATUS REASON MESSAGE AGE.
pub(super) fn conditions_table(conditions: &[Condition]) -> String {
    let mut table = Table::new(vec!["TYPE", "STATUS", "REASON", "MESSAGE", "AGE"]);
    for condition in conditions {
        table.row(vec![
            condition.r#type.clone(),
            condition_status(condition.status),
            or_none(&condition.reason),
            or_none(&condition.message),
            age(condition.last_transition_time.as_ref()),
        ]);
    }
    table.render()
}

/// A runtime class by its short name (`sandboxed`), or its number when unknown.
pub(crate) fn runtime_class_name(value: i32) -> Value {
    match berth_proto::types::v1::RuntimeClass::try_from(value) {
        Ok(class) => Value::String(class.as_str_name().trim_start_matches("RUNTIME_CLASS_").to_ascii_lowercase()),
        Err(_) => Value::from(value),
    }
}

/// A runtime class as a description shows it: `any` when unset.
pub(crate) fn runtime_class_text(value: i32) -> String {
    match runtime_class_name(value) {
        Value::String(name) if name == "unspecified" => "any".to_owned(),
        Value::String(name) => name,
        other => other.to_string(),
    }
}

/// The `Bundle` (or `Image`) row of a description.
pub(crate) fn artifact_row(artifact: Option<berth_proto::artifact::Artifact<'_>>) -> (&'static str, String) {
    match artifact {
        Some(a) if a.kind == berth_proto::artifact::ArtifactKind::Image => ("Image", a.reference.reference.clone()),
        Some(a) => ("Bundle", a.reference.reference.clone()),
        None => ("Bundle", NONE.to_string()),
    }
}

/// What each cache volume of a lease did, compactly: `deps:hit@3->4`
/// (hit from generation 3, published 4), `deps:miss@0` (nothing published
/// yet), `deps:hit@3 CommitConflict` (not published, and why).
pub(super) fn cache_outcomes(observations: &[leases::CacheObservation]) -> String {
    if observations.is_empty() {
        return NONE.to_string();
    }
    let each = observations.iter().map(|seen| {
        let outcome = if seen.outcome() == leases::CacheOutcome::Hit { "hit" } else { "miss" };
        let mut text = format!("{}:{outcome}@{}", seen.key, seen.base_generation);
        if seen.committed_generation > 0 {
            text.push_str(&format!("->{}", seen.committed_generation));
        } else if !seen.reason.is_empty() {
            text.push_str(&format!(" {}", seen.reason));
        }
        text
    });
    each.collect::<Vec<_>>().join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_aligns_columns_under_their_headers() {
        let mut table = Table::new(vec!["ID", "STATE", "AGE"]);
        table.row(vec!["node-long-id".into(), "UP".into(), "5s".into()]);
        table.row(vec!["n2".into(), "DRAINING".into(), "3m".into()]);
        assert_eq!(
            table.render(),
            "ID             STATE      AGE\nnode-long-id   UP         5s\nn2             DRAINING   3m\n"
        );
    }

    #[test]
    fn durations_read_like_kubectl() {
        assert_eq!(human_duration(5), "5s");
        assert_eq!(human_duration(119), "119s");
        assert_eq!(human_duration(330), "5m30s");
        assert_eq!(human_duration(600), "10m");
        assert_eq!(human_duration(3 * 3600 + 20 * 60), "3h20m");
        assert_eq!(human_duration(2 * 3600 * 12), "24h");
        assert_eq!(human_duration(3 * 86_400 + 4 * 3600), "3d4h");
        assert_eq!(human_duration(30 * 86_400), "30d");
        assert_eq!(human_duration(3 * 365 * 86_400), "3y");
    }

    #[test]
    fn compute_reads_like_kubernetes_quantities() {
        assert_eq!(cpu(4000), "4");
        assert_eq!(cpu(250), "250m");
        assert_eq!(memory(512 << 20), "512Mi");
        assert_eq!(memory(3 << 29), "1.5Gi");
        assert_eq!(memory(100), "100");
    }

    #[test]
    fn a_lease_reason_carries_its_exit_status() {
        let mut lease = leases::Lease {
            lease_id: "l1".into(),
            phase: leases::LeasePhase::Failed as i32,
            reason: "Exited".into(),
            exit_code: Some(3),
            ..Default::default()
        };
        assert_eq!(lease_phase(lease.phase), "FAILED");
        assert_eq!(lease_reason(&lease), "Exited (exit code 3)");
        lease.exit_code = None;
        assert_eq!(lease_reason(&lease), "Exited");
        lease.reason.clear();
        assert_eq!(lease_reason(&lease), NONE);
    }
}
