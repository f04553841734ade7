//! Keeps an in-process holder of the CA's own certificates fresh: identity's
//! serving certificate, and in `berth dev` every service's. The certificate
//! is re-issued at half its lifetime and whenever the CA bundle changes (a
//! rotation), and the bundle is mirrored to a file when one is configured.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use berth_core::Identity;
use berth_mtls::TlsCredentials;
use tokio_util::sync::CancellationToken;

use crate::authority::{Authority, AuthorityError};

/// How often the bundle is compared with what the holders serve.
pub const KEEPER_POLL: Duration = Duration::from_secs(2);

/// One holder to keep: who it is and the names it is dialled by.
#[derive(Debug, Clone)]
pub struct KeptIdentity {
    /// The identity its certificate names.
    pub identity: Identity,
    /// Extra SANs (host names, IPs).
    pub sans: Vec<String>,
    /// The live credentials.
    pub credentials: TlsCredentials,
}

impl KeptIdentity {
    /// Issues the first certificate for `identity`.
    pub async fn issue(
        authority: &Authority,
        identity: Identity,
        sans: Vec<String>,
        ttl: Duration,
    ) -> Result<Self, AuthorityError> {
        let material = authority.issue_material(&identity, &sans, ttl).await?;
        let credentials = TlsCredentials::new(material).map_err(AuthorityError::Mtls)?;
        Ok(Self { identity, sans, credentials })
    }
}

/// Writes `bundle` to `path` atomically (temp file, then rename).
pub fn write_bundle(path: &PathBuf, bundle: &str) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bundle)?;
    std::fs::rename(tmp, path)
}

/// Spawns the keeper until `stop`.
pub fn spawn_keeper(
    authority: Authority,
    kept: Vec<KeptIdentity>,
    ttl: Duration,
    bundle_out: Option<PathBuf>,
    stop: CancellationToken,
) {
    tokio::spawn(async move {
        let mut issued_at = Instant::now();
        let mut written: Option<String> = None;
        loop {
            match authority.bundle_pem().await {
                Ok(bundle) => {
                    if let Some(path) = &bundle_out
                        && written.as_deref() != Some(bundle.as_str())
                    {
                        match write_bundle(path, &bundle) {
                            Ok(()) => written = Some(bundle.clone()),
                            Err(error) => tracing::warn!(path = %path.display(), %error, "cannot write the CA bundle"),
                        }
                    }
                    let rotated = kept.iter().any(|k| k.credentials.material().ca_bundle_pem != bundle);
                    if rotated || issued_at.elapsed() >= ttl / 2 {
                        for k in &kept {
                            let renewed = authority
                                .issue_material(&k.identity, &k.sans, ttl)
                                .await
                                .and_then(|m| k.credentials.reload(m).map_err(AuthorityError::Mtls));
                            if let Err(error) = renewed {
                                tracing::warn!(identity = %k.identity, %error, "certificate renewal failed; will retry");
                            }
                        }
                        issued_at = Instant::now();
                    }
                }
                Err(error) => tracing::warn!(%error, "cannot read the CA bundle; will retry"),
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(KEEPER_POLL) => {}
            }
        }
    });
}
