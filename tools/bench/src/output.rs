//! How every scenario speaks: progress on stderr, and its report on stdout
//! as a table for people or JSON for scripts, whichever `-o` chose.

use serde::Serialize;

/// Output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum OutputFormat {
    /// Aligned columns for people.
    Table,
    /// Every figure as JSON, for scripts.
    Json,
}

/// One line of progress on stderr, so stdout stays the report alone.
pub(crate) fn progress(message: &str) {
    eprintln!("bench: {message}");
}

/// Why a run ended without its report, in the ways every bench that runs
/// client tasks under Ctrl-C can.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RunError {
    /// A client task panicked or was cancelled.
    #[error("a client task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// Ctrl-C or SIGTERM arrived.
    #[error("interrupted")]
    Interrupted,
    /// The report could not be written.
    #[error("cannot write the report: {0}")]
    Output(String),
}

/// Prints `report` on stdout in `format`: `table` renders it for people.
/// Fails only when the report cannot be written as JSON.
pub(crate) fn print_report<R: Serialize>(
    format: OutputFormat,
    report: &R,
    table: impl FnOnce(&R) -> String,
) -> Result<(), String> {
    let mut text = match format {
        OutputFormat::Table => table(report),
        OutputFormat::Json => serde_json::to_string_pretty(report).map_err(|e| e.to_string())?,
    };
    if !text.ends_with('\n') {
        text.push('\n');
    }
    print!("{text}");
    Ok(())
}
