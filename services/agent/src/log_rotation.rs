//! Keeps every workload's output within a size bound, so a chatty replica
//! cannot fill the node's disk (in Kubernetes, the agent pod's `emptyDir`,
//! whose overflow gets the whole pod evicted).
//!
//! A workload writes its standard output and error straight into
//! `DATA_DIR/logs/<lease>/stdout.log` and `stderr.log`, through descriptors
//! the agent opened in append mode and handed to it; the agent never sits
//! in the path of the bytes. Every few seconds this task looks at each file:
//! one past the bound is copied to `<file>.1` (replacing the one before) and
//! truncated in place, the way logrotate's `copytruncate` works, because the
//! workload's descriptor cannot be re-pointed at a new file.
//!
//! # Invariants
//! - A lease's output takes at most twice the bound per stream, plus what it
//!   writes between two looks.
//! - The writers append, so after a truncation they write at the new end,
//!   never leaving a hole; `GetLogs` readers see a file shorter than where
//!   they were and start again from its beginning.
//! - What is written between the copy and the truncation is lost: a few
//!   bytes, the price of not holding the workload's pipe.
//! - The newest output is always in the current file, so `GetLogs` keeps
//!   showing what a workload writes now.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::instances::{LOG_DIR, STDERR_FILE, STDOUT_FILE};

/// The default bound on one stream of one lease's output.
pub(crate) const DEFAULT_LOG_MAX_BYTES: u64 = 16 << 20;

/// How often every log file is looked at.
const CHECK_EVERY: Duration = Duration::from_secs(5);

/// The suffix of the one rotated file kept per stream.
const ROTATED_SUFFIX: &str = ".1";

/// Looks after the logs under `data_dir` until `shutdown`.
pub(crate) fn spawn(data_dir: &Path, max_bytes: u64, shutdown: CancellationToken) {
    let root = data_dir.join(LOG_DIR);
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(CHECK_EVERY) => {}
            }
            let root = root.clone();
            let rotated = tokio::task::spawn_blocking(move || rotate_all(&root, max_bytes)).await.unwrap_or_default();
            if rotated > 0 {
                tracing::debug!(rotated, max_bytes, "rotated workload logs past their bound");
            }
        }
    });
}

/// Rotates every stream under `root` past `max_bytes`; how many it rotated.
fn rotate_all(root: &Path, max_bytes: u64) -> usize {
    let Ok(leases) = std::fs::read_dir(root) else { return 0 };
    let mut rotated = 0;
    for lease in leases.flatten() {
        for name in [STDOUT_FILE, STDERR_FILE] {
            let path = lease.path().join(name);
            match rotate_if_over(&path, max_bytes) {
                Ok(true) => rotated += 1,
                Ok(false) => {}
                Err(error) => tracing::warn!(path = %path.display(), %error, "cannot rotate a workload log"),
            }
        }
    }
    rotated
}

/// Copies `path` to `<path>.1` and empties it when it is past `max_bytes`.
fn rotate_if_over(path: &Path, max_bytes: u64) -> std::io::Result<bool> {
    let size = match std::fs::symlink_metadata(path) {
        // Only the regular files the agent made; never follow a link.
        Ok(meta) if meta.is_file() => meta.len(),
        Ok(_) => return Ok(false),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(error) => return Err(error),
    };
    if size <= max_bytes {
        return Ok(false);
    }
    let rotated = with_suffix(path, ROTATED_SUFFIX);
    let staging = with_suffix(path, ".1.tmp");
    std::fs::copy(path, &staging)?;
    std::fs::rename(&staging, &rotated)?;
    std::fs::OpenOptions::new().write(true).open(path)?.set_len(0)?;
    Ok(true)
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    #[test]
    fn a_stream_past_its_bound_is_kept_once_and_its_writer_goes_on_at_the_start() {
        let dir = tempfile::tempdir().unwrap();
        let lease = dir.path().join("l-1");
        std::fs::create_dir_all(&lease).unwrap();
        let path = lease.join(STDOUT_FILE);
        // As the provider opens it for the workload: appending.
        let mut writer = std::fs::OpenOptions::new().create(true).append(true).open(&path).unwrap();
        writer.write_all(&[b'a'; 100]).unwrap();
        assert_eq!(rotate_all(dir.path(), 100), 0, "at the bound is within it");

        writer.write_all(b"b\n").unwrap();
        assert_eq!(rotate_all(dir.path(), 100), 1);
        assert_eq!(std::fs::read(with_suffix(&path, ".1")).unwrap().len(), 102);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);

        // The writer's next bytes land at the start: no hole.
        writer.write_all(b"after\n").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"after\n");

        // A second rotation replaces the first: two generations at most.
        writer.write_all(&[b'c'; 200]).unwrap();
        assert_eq!(rotate_all(dir.path(), 100), 1);
        let kept = std::fs::read(with_suffix(&path, ".1")).unwrap();
        assert!(kept.starts_with(b"after\n") && kept.len() == 206, "{}", kept.len());
        let names: Vec<String> =
            std::fs::read_dir(&lease).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }

    #[test]
    fn links_and_missing_files_are_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let lease = dir.path().join("l-2");
        std::fs::create_dir_all(&lease).unwrap();
        let outside = dir.path().join("outside");
        std::fs::write(&outside, [b'x'; 500]).unwrap();
        std::os::unix::fs::symlink(&outside, lease.join(STDERR_FILE)).unwrap();
        assert_eq!(rotate_all(dir.path(), 10), 0);
        assert_eq!(std::fs::metadata(&outside).unwrap().len(), 500);
        assert_eq!(rotate_all(&dir.path().join("none"), 10), 0);
    }
}
