//! `berth dev`: the whole mesh in one process, for a first try.
//!
//! Every service still serves mTLS gRPC on its own port (identity on the
//! port base, then revisions, leases, egress, and the dev node's agent), on
//! SQLite files and an in-process bus in the data directory: nothing else to
//! install.
//!
//! # What is stored in the data directory
//! - `ca.pem`, `ca-key.pem` (0600): the dev CA, created on first start and
//!   reused after, so clients configured once keep working.
//! - `admin.pem`, `admin-key.pem` (0600): an admin client identity for
//!   grpcurl and the CLI, re-issued when it nears expiry.
//! - `<service>.db`: each service's SQLite store.
//!
//! Service and node certificates live only in memory and are re-issued by a
//! renewal task at half their lifetime.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_core::Identity;
use berth_mtls::{CertificateAuthority, TlsCredentials, TlsMaterial, cert_not_after, certs_from_pem};
use berth_runtime::{ServiceSpec, StartError, StateArgs, bind};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// How long the dev CA is valid.
const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// How long the admin certificate written to the data directory is valid.
const ADMIN_VALIDITY: Duration = Duration::from_secs(30 * 24 * 3600);

/// An admin certificate closer than this to expiry is re-issued at start.
const ADMIN_RENEW_BEFORE: Duration = Duration::from_secs(7 * 24 * 3600);

/// How long in-memory service and node certificates are valid; they are
/// renewed at half of it.
const LEAF_VALIDITY: Duration = Duration::from_secs(24 * 3600);

/// The control-plane services, in port order from the port base.
const SERVICES: [ServiceSpec; 4] =
    [berth_identity::SPEC, berth_revisions::SPEC, berth_leases::SPEC, berth_egress::SPEC];

/// The dev node's id.
const DEV_NODE: &str = "dev";

/// Flags of `berth dev`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct DevArgs {
    /// Where the CA, the admin certificate and every service's state live.
    #[arg(long, env = "BERTH_DATA_DIR", default_value = ".berth/dev", value_name = "DIR")]
    data_dir: PathBuf,
    /// First port: identity on P, revisions P+1, leases P+2, egress P+3, the
    /// dev node's agent P+4.
    #[arg(long, env = "BERTH_PORT_BASE", default_value_t = 7443, value_name = "P",
          value_parser = clap::value_parser!(u16).range(1..=65531))]
    port_base: u16,
    /// Address every port is bound on.
    #[arg(long, env = "BERTH_DEV_HOST", default_value = "127.0.0.1", value_name = "IP")]
    host: IpAddr,
}

/// The dev CA and what it issues.
struct DevAuthority {
    ca: CertificateAuthority,
    host: IpAddr,
}

impl DevAuthority {
    /// In-memory material for `identity`, valid for the names clients dial.
    fn material(&self, identity: &Identity) -> Result<TlsMaterial, StartError> {
        let sans = vec!["localhost".to_string(), self.host.to_string(), "127.0.0.1".to_string(), "::1".to_string()];
        let (cert, key) = self.ca.issue(identity, &sans, LEAF_VALIDITY).map_err(StartError::Tls)?;
        Ok(TlsMaterial { cert_chain_pem: cert.cert_pem, key_pem: key, ca_bundle_pem: self.ca.cert_pem().to_string() })
    }
}

pub(crate) async fn run(args: DevArgs) -> Result<(), StartError> {
    let dir = &args.data_dir;
    std::fs::create_dir_all(dir).map_err(|source| io("cannot create data directory", dir, source))?;
    probe_writable(dir)?;
    let authority = DevAuthority { ca: load_or_create_ca(dir)?, host: args.host };
    ensure_admin_cert(dir, &authority.ca)?;

    let shutdown = berth_rpc::shutdown_signal();
    let mut servers = JoinSet::new();
    let mut renewals: Vec<(TlsCredentials, Identity)> = Vec::new();

    for (offset, spec) in (0u16..).zip(SERVICES) {
        let identity = Identity::service(spec.name).map_err(|e| StartError::Invalid(e.to_string()))?;
        let credentials = TlsCredentials::new(authority.material(&identity)?).map_err(StartError::Tls)?;
        let state = StateArgs {
            database_url: format!("sqlite://{}", dir.join(format!("{}.db", spec.name)).display()),
            redis_url: "memory://".into(),
        };
        let ctx = spec.open(&state, credentials.clone()).await?;
        let listener = bind(SocketAddr::new(args.host, args.port_base + offset), credentials.clone()).await?;
        let stop = shutdown.clone();
        servers.spawn(async move { spec.serve(&ctx, listener, stop).await });
        renewals.push((credentials, identity));
    }

    let node = Identity::node(DEV_NODE).map_err(|e| StartError::Invalid(e.to_string()))?;
    let node_credentials = TlsCredentials::new(authority.material(&node)?).map_err(StartError::Tls)?;
    let agent_addr = SocketAddr::new(args.host, args.port_base + 4);
    let agent_listener = bind(agent_addr, node_credentials.clone()).await?;
    let stop = shutdown.clone();
    let agent_credentials = node_credentials.clone();
    servers.spawn(async move { berth_agent::serve(agent_listener, agent_credentials, stop).await });
    renewals.push((node_credentials, node));

    spawn_renewal(authority, renewals, shutdown.clone());
    print_banner(&args);

    // The first server to stop (an error, or all of them after shutdown)
    // stops the rest.
    let mut outcome = Ok(());
    while let Some(joined) = servers.join_next().await {
        let result = joined.unwrap_or_else(|e| Err(StartError::Invalid(format!("a server task failed: {e}"))));
        if let Err(error) = result {
            shutdown.cancel();
            if outcome.is_ok() {
                outcome = Err(error);
            }
        }
    }
    outcome
}

fn io(what: &'static str, path: &Path, source: std::io::Error) -> StartError {
    StartError::Io { what, path: path.display().to_string(), source }
}

fn probe_writable(dir: &Path) -> Result<(), StartError> {
    let probe = dir.join(".write-probe");
    std::fs::write(&probe, b"").map_err(|source| io("data directory is not writable:", dir, source))?;
    let _ = std::fs::remove_file(probe);
    Ok(())
}

fn write_private(path: &Path, contents: &str) -> Result<(), StartError> {
    use std::io::Write;
    #[cfg(unix)]
    use std::os::unix::fs::OpenOptionsExt;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    options.mode(0o600);
    let mut file = options.open(path).map_err(|source| io("cannot write", path, source))?;
    file.write_all(contents.as_bytes()).map_err(|source| io("cannot write", path, source))
}

fn read(path: &Path) -> Result<String, StartError> {
    std::fs::read_to_string(path).map_err(|source| io("cannot read", path, source))
}

fn load_or_create_ca(dir: &Path) -> Result<CertificateAuthority, StartError> {
    let cert_path = dir.join("ca.pem");
    let key_path = dir.join("ca-key.pem");
    if cert_path.exists() && key_path.exists() {
        return CertificateAuthority::from_pem(&read(&cert_path)?, &read(&key_path)?).map_err(StartError::Tls);
    }
    if cert_path.exists() != key_path.exists() {
        return Err(StartError::Invalid(format!(
            "{} holds only half of the dev CA (ca.pem and ca-key.pem go together); restore the other file or remove both",
            dir.display()
        )));
    }
    let ca = CertificateAuthority::generate("berth dev CA", CA_VALIDITY).map_err(StartError::Tls)?;
    // The key first: a crash between the two writes leaves no certificate
    // without its key.
    write_private(&key_path, &ca.key_pem())?;
    std::fs::write(&cert_path, ca.cert_pem()).map_err(|source| io("cannot write", &cert_path, source))?;
    tracing::info!(fingerprint = %ca.fingerprint(), "created the dev CA");
    Ok(ca)
}

/// Issues `admin.pem`/`admin-key.pem` unless a current one signed by this CA
/// is already there.
fn ensure_admin_cert(dir: &Path, ca: &CertificateAuthority) -> Result<(), StartError> {
    let cert_path = dir.join("admin.pem");
    let key_path = dir.join("admin-key.pem");
    if key_path.exists()
        && let Ok(pem) = std::fs::read_to_string(&cert_path)
        && let Ok(material) = TlsMaterial::from_files(&cert_path, &key_path, dir.join("ca.pem"))
        && TlsCredentials::new(material).is_ok()
        && let Ok(certs) = certs_from_pem("certificate", &pem)
        && let Ok(not_after) = cert_not_after(&certs[0])
        && issued_by(&pem, ca)
        && not_after - now_secs() > ADMIN_RENEW_BEFORE.as_secs() as i64
    {
        return Ok(());
    }
    let admin = Identity::admin("dev").map_err(|e| StartError::Invalid(e.to_string()))?;
    let (cert, key) = ca.issue(&admin, &[], ADMIN_VALIDITY).map_err(StartError::Tls)?;
    write_private(&key_path, &key)?;
    std::fs::write(&cert_path, cert.cert_pem).map_err(|source| io("cannot write", &cert_path, source))?;
    Ok(())
}

/// Whether `cert_pem` verifies as signed by `ca`: the trust bundle of the
/// CA alone must accept it as a client.
fn issued_by(cert_pem: &str, ca: &CertificateAuthority) -> bool {
    berth_mtls::verify_chain(cert_pem, ca.cert_pem()).is_ok()
}

fn now_secs() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

fn spawn_renewal(authority: DevAuthority, holders: Vec<(TlsCredentials, Identity)>, stop: CancellationToken) {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(LEAF_VALIDITY / 2) => {}
            }
            for (credentials, identity) in &holders {
                match authority.material(identity).and_then(|m| credentials.reload(m).map_err(StartError::Tls)) {
                    Ok(()) => tracing::info!(%identity, "renewed certificate"),
                    Err(error) => tracing::warn!(%identity, %error, "certificate renewal failed; will retry"),
                }
            }
        }
    });
}

fn print_banner(args: &DevArgs) {
    let dir = args.data_dir.display();
    let host = args.host;
    let p = args.port_base;
    let mut lines = vec![format!("berth dev is running; state in {dir}")];
    for (offset, name) in (0u16..).zip(["identity", "revisions", "leases", "egress", "agent (node 'dev')"]) {
        lines.push(format!("  {name:<20} {host}:{}", p + offset));
    }
    lines.push(String::new());
    lines.push("Try it:".into());
    lines
        .push(format!("  grpcurl -cacert {dir}/ca.pem -cert {dir}/admin.pem -key {dir}/admin-key.pem {host}:{p} list"));
    lines.push(format!(
        "  grpcurl -cacert {dir}/ca.pem -cert {dir}/admin.pem -key {dir}/admin-key.pem {host}:{p} grpc.health.v1.Health/Check"
    ));
    lines.push("Stop with Ctrl-C.".into());
    println!("{}", lines.join("\n"));
}
