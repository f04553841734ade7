//! `berth cert issue`: mints an admin or service identity. The key is made
//! here and never leaves this machine; identity signs a CSR for it.
//!
//! # Invariants
//! - Nothing is written unless identity issued the certificate, so a refused
//!   call leaves existing files as they were.
//! - Each file is written beside its destination and renamed into place; the
//!   key file is 0600 from the moment it exists, whatever was there before.

use std::io::Write;
use std::path::{Path, PathBuf};

use berth_proto::identity::v1;
use berth_proto::identity::v1::authority_client::AuthorityClient;

use super::output;
use super::{CliError, ClientArgs, OutputFormat, parse_ttl};

/// Flags of `berth cert`.
#[derive(Debug, clap::Args)]
pub(crate) struct CertArgs {
    #[command(flatten)]
    client: ClientArgs,
    #[command(subcommand)]
    command: CertCommand,
}

#[derive(Debug, clap::Subcommand)]
enum CertCommand {
    /// Issue an admin or service certificate for a key generated here.
    Issue(IssueArgs),
}

#[derive(Debug, clap::Args)]
struct IssueArgs {
    /// Which kind of identity the certificate names.
    #[arg(long, value_enum)]
    kind: CertKind,
    /// The name within the kind, a DNS label: `alice` for an admin,
    /// `revisions` for a service.
    #[arg(long, value_name = "NAME")]
    name: String,
    /// Where to write the certificate (PEM).
    #[arg(long, value_name = "FILE")]
    cert_out: PathBuf,
    /// Where to write the private key (PEM, mode 0600).
    #[arg(long, value_name = "FILE")]
    key_out: PathBuf,
    /// Where to write the CA bundle the certificate chains to (PEM).
    #[arg(long, value_name = "FILE")]
    ca_out: Option<PathBuf>,
    /// How long the certificate lives, e.g. `24h`, `30d` [default: the
    /// server's for the kind].
    #[arg(long, value_name = "DURATION", value_parser = parse_ttl)]
    ttl: Option<u32>,
    /// A host name or IP the service is dialled by, added to the
    /// certificate so clients can verify it as a server; repeatable or
    /// comma separated. Services only; a service certificate always carries
    /// `localhost` and `127.0.0.1` too, for its own health checks. In
    /// Kubernetes give every name of its Service: `leases`,
    /// `leases.berth.svc`, `leases.berth.svc.cluster.local`.
    #[arg(long = "dns-name", value_name = "NAME", value_delimiter = ',')]
    dns_names: Vec<String>,
}

/// `names` and then the loopback names a service's own health check dials
/// (`berth health` inside its container or pod), each once.
fn with_loopback(names: &[String]) -> Vec<String> {
    let mut all = names.to_vec();
    for name in super::bootstrap::LOOPBACK_NAMES {
        if !all.iter().any(|n| n == name) {
            all.push(name.to_owned());
        }
    }
    all
}

/// The identity kinds `cert issue` mints; node certificates come only from
/// joining.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum CertKind {
    /// An operator: `<name>.admin.berth.internal`.
    Admin,
    /// A control-plane service: `<name>.svc.berth.internal`.
    Service,
    /// A data-plane router: `<name>.router.berth.internal`.
    Router,
}

impl CertArgs {
    pub(crate) async fn run(self) -> Result<(), CliError> {
        let connection = self.client.connect()?;
        let CertCommand::Issue(args) = self.command;
        let (csr_pem, key_pem) =
            berth_mtls::generate_csr(&args.name).map_err(|e| CliError::KeyGeneration(Box::new(e)))?;
        let kind = match args.kind {
            CertKind::Admin => v1::CertificateKind::Admin,
            CertKind::Service => v1::CertificateKind::Service,
            CertKind::Router => v1::CertificateKind::Router,
        };
        let request = v1::IssueCertificateRequest {
            kind: kind as i32,
            name: args.name.clone(),
            csr_pem,
            ttl_seconds: args.ttl.unwrap_or(0),
            dns_names: match args.kind {
                CertKind::Admin => args.dns_names.clone(),
                CertKind::Service | CertKind::Router => with_loopback(&args.dns_names),
            },
        };
        let issued = connection
            .answer(AuthorityClient::new(connection.channel.clone()).issue_certificate(connection.request(request)))
            .await?;

        write_file(&args.key_out, &key_pem, true)?;
        write_file(&args.cert_out, &issued.certificate_pem, false)?;
        if let Some(ca_out) = &args.ca_out {
            write_file(ca_out, &issued.ca_bundle_pem, false)?;
        }

        match self.client.output {
            OutputFormat::Json => output::print_message(&issued),
            OutputFormat::Table => {
                let names = berth_mtls::certs_from_pem("certificate", &issued.certificate_pem)
                    .ok()
                    .and_then(|certs| certs.first().and_then(berth_mtls::identity_from_cert))
                    .map_or_else(|| args.name.clone(), |id| format!("{id} ({})", id.to_san()));
                let expires = issued.expires_at.as_ref();
                let mut text = format!(
                    "issued a certificate for {names}, expires {}\n  certificate: {}\n  key:         {}\n",
                    output::when(expires, &output::until(expires)),
                    args.cert_out.display(),
                    args.key_out.display(),
                );
                if let Some(ca_out) = &args.ca_out {
                    text.push_str(&format!("  CA bundle:   {}\n", ca_out.display()));
                }
                output::print(&text)
            }
        }
    }
}

/// Writes `contents` to a temporary file beside `path` and renames it over
/// `path`; `private` files are created 0600.
pub(super) fn write_file(path: &Path, contents: &str, private: bool) -> Result<(), CliError> {
    let failed = |source| CliError::Write { path: path.display().to_string(), source };
    let file_name = path
        .file_name()
        .ok_or_else(|| failed(std::io::Error::new(std::io::ErrorKind::InvalidInput, "the path names no file")))?;
    let mut staging_name = std::ffi::OsString::from(".");
    staging_name.push(file_name);
    staging_name.push(format!(".{}.tmp", std::process::id()));
    let staging = path.with_file_name(staging_name);

    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(if private { 0o600 } else { 0o644 });
    }
    #[cfg(not(unix))]
    let _ = private;
    let written = options.open(&staging).and_then(|mut file| {
        file.write_all(contents.as_bytes())?;
        file.sync_all()
    });
    let renamed = written.and_then(|()| std::fs::rename(&staging, path));
    if let Err(error) = renamed {
        let _ = std::fs::remove_file(&staging);
        return Err(failed(error));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_service_certificate_names_loopback_once_beside_the_names_given() {
        let names = with_loopback(&["leases".to_owned(), "127.0.0.1".to_owned()]);
        assert_eq!(names, ["leases", "127.0.0.1", "localhost"]);
        assert_eq!(with_loopback(&[]), ["localhost", "127.0.0.1"]);
    }
}
