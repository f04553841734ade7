//! Service certificates that renew themselves: once past half its life, a
//! control-plane service asks identity for a new certificate of its own
//! identity (authenticated by the one it holds, which may renew only
//! itself), serves it from the next handshake, and writes it over the files
//! it was started from, so a restart keeps it. No renewal job, CronJob or
//! bootstrap rerun is needed.
//!
//! # Invariants
//! - The new certificate names the same identity and the same host names
//!   and IPs as the current one, with the same lifetime (identity's default
//!   when that lifetime is longer than it grants).
//! - The files are replaced one by one by rename; the file watcher
//!   ([`crate::watch_cert_files`]) may see them mid-way, finds them
//!   mismatched and keeps what is in force until the set is whole.
//! - A failed renewal keeps the current certificate and is tried again at
//!   the next check, with a warning each time.

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use berth_core::CallerKind;
use berth_mtls::{BACKDATE, TlsCredentials, TlsMaterial, cert_host_names, cert_validity, certs_from_pem, generate_csr};
use berth_proto::identity::v1;
use tokio_util::sync::CancellationToken;

use crate::TlsArgs;

/// How often a service looks at its certificate's age by default.
pub const RENEW_CHECK_INTERVAL: Duration = Duration::from_secs(300);

/// Why a renewal did not happen.
#[derive(Debug, thiserror::Error)]
pub enum RenewError {
    /// The certificate in force cannot be read, or names no service.
    #[error("the certificate in force cannot be renewed: {0}")]
    NotRenewable(String),
    /// Identity could not be reached, or refused.
    #[error("identity refused or could not be reached: {0}")]
    Identity(String),
    /// The new certificate could not be used or written.
    #[error("cannot use the renewed certificate: {0}")]
    Install(String),
}

/// Whether `material`'s leaf is past half its life as of `now` (seconds
/// since the epoch), and the lifetime it was signed for. Leaves are valid
/// from [`BACKDATE`] before they were signed; the life counts from signing.
fn due(material: &TlsMaterial, now: i64) -> Result<(bool, i64), RenewError> {
    let chain =
        certs_from_pem("certificate", &material.cert_chain_pem).map_err(|e| RenewError::NotRenewable(e.to_string()))?;
    let (not_before, not_after) = cert_validity(&chain[0]).map_err(|e| RenewError::NotRenewable(e.to_string()))?;
    let signed = (not_before + i64::try_from(BACKDATE.as_secs()).unwrap_or(0)).min(not_after);
    let lifetime = not_after - signed;
    Ok((now >= signed + lifetime / 2, lifetime))
}

fn now_secs() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// Renews `credentials` through identity at `identity_addr` if they are past
/// half their life, installing the new certificate and writing `args`'
/// files; `Ok(true)` when it renewed.
pub async fn renew_if_due(
    args: &TlsArgs,
    credentials: &TlsCredentials,
    identity_addr: &str,
) -> Result<bool, RenewError> {
    let material = credentials.material();
    let (is_due, lifetime) = due(&material, now_secs())?;
    if !is_due {
        return Ok(false);
    }
    let identity =
        credentials.identity().ok_or_else(|| RenewError::NotRenewable("it names no berth identity".into()))?;
    let kind = match identity.kind() {
        CallerKind::Service => v1::CertificateKind::Service,
        CallerKind::Router => v1::CertificateKind::Router,
        _ => return Err(RenewError::NotRenewable(format!("{identity} is neither a service nor a router"))),
    };
    let chain =
        certs_from_pem("certificate", &material.cert_chain_pem).map_err(|e| RenewError::NotRenewable(e.to_string()))?;
    let hosts = cert_host_names(&chain[0]).map_err(|e| RenewError::NotRenewable(e.to_string()))?;
    let (csr_pem, key_pem) = generate_csr(&identity.to_string()).map_err(|e| RenewError::Install(e.to_string()))?;
    let channel =
        berth_rpc::connect(identity_addr, credentials.clone()).map_err(|e| RenewError::Identity(e.to_string()))?;
    let lifetime = u32::try_from(lifetime).unwrap_or(0);
    let request = v1::IssueCertificateRequest {
        kind: kind as i32,
        name: identity.name().to_owned(),
        csr_pem,
        ttl_seconds: lifetime,
        dns_names: hosts.clone(),
    };
    let mut client = v1::authority_client::AuthorityClient::new(channel.clone());
    let issued = match client.issue_certificate(request.clone()).await {
        // Longer than identity grants now: take its default for services.
        Err(status) if status.code() == tonic::Code::InvalidArgument && status.message().contains("ttl_seconds") => {
            let request = v1::IssueCertificateRequest { ttl_seconds: 0, ..request };
            v1::authority_client::AuthorityClient::new(channel).issue_certificate(request).await
        }
        other => other,
    }
    .map_err(|status| RenewError::Identity(format!("{}: {}", status.code(), status.message())))?
    .into_inner();
    let renewed = TlsMaterial { cert_chain_pem: issued.certificate_pem, key_pem, ca_bundle_pem: issued.ca_bundle_pem };
    credentials.reload(renewed.clone()).map_err(|e| RenewError::Install(e.to_string()))?;
    for (path, text, private) in [
        (&args.tls_key, &renewed.key_pem, true),
        (&args.tls_cert, &renewed.cert_chain_pem, false),
        (&args.ca_file, &renewed.ca_bundle_pem, false),
    ] {
        write_replacing(path, text, private).map_err(|e| RenewError::Install(format!("{}: {e}", path.display())))?;
    }
    tracing::info!(%identity, hosts = ?hosts, not_after = credentials.not_after(), "renewed this service's certificate");
    Ok(true)
}

/// Writes `text` to a file beside `path`, then renames it over `path`.
fn write_replacing(path: &Path, text: &str, private: bool) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let staged = dir.join(format!(".{name}.renewing"));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if private { 0o600 } else { 0o644 })
        .open(&staged)?;
    file.write_all(text.as_bytes())?;
    file.sync_all()?;
    std::fs::rename(&staged, path)
}

/// Checks every `interval` until `stop` and renews when due (see the module
/// docs).
pub fn renew_service_certificate(
    args: TlsArgs,
    credentials: TlsCredentials,
    identity_addr: String,
    interval: Duration,
    stop: CancellationToken,
) {
    tokio::spawn(async move {
        loop {
            match renew_if_due(&args, &credentials, &identity_addr).await {
                Ok(_) => {}
                Err(error) => tracing::warn!(%error, retry_in = ?interval, "cannot renew this service's certificate"),
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                () = tokio::time::sleep(interval) => {}
            }
        }
    });
}
