//! Certificate renewal for control-plane services: the files named by
//! `--tls-cert`, `--tls-key` and `--ca-file` are re-read when they change
//! (a renewal job or a Kubernetes secret update rewrites them), and the new
//! material is served from the next handshake on.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use berth_mtls::{TlsCredentials, TlsMaterial};
use tokio_util::sync::CancellationToken;

use crate::TlsArgs;

/// How often the certificate files are checked for changes.
pub const CERT_POLL_INTERVAL: Duration = Duration::from_secs(15);

fn stamp(paths: &[&PathBuf]) -> Vec<Option<SystemTime>> {
    paths.iter().map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok()).collect()
}

/// Polls the files every `interval` until `stop`; a half-written or
/// mismatched set is logged and retried on the next change, keeping the
/// material in force.
pub fn watch_cert_files(args: TlsArgs, credentials: TlsCredentials, interval: Duration, stop: CancellationToken) {
    tokio::spawn(async move {
        let paths = [&args.tls_cert, &args.tls_key, &args.ca_file];
        let mut last = stamp(&paths);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(interval) => {}
            }
            let now = stamp(&paths);
            if now == last {
                continue;
            }
            last = now;
            match TlsMaterial::from_files(&args.tls_cert, &args.tls_key, &args.ca_file)
                .and_then(|m| credentials.reload(m))
            {
                Ok(()) => tracing::info!(not_after = credentials.not_after(), "reloaded certificate files"),
                Err(error) => {
                    tracing::warn!(%error, "certificate files changed but could not be loaded; keeping the current ones")
                }
            }
        }
    });
}
