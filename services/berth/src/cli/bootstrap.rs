//! `berth bootstrap`: makes a mesh's trust before its services first start.
//! It opens identity's CA in its database (creating it on the first run,
//! its key sealed under `--auth-secret`, exactly as `berth-identity` does)
//! and writes, from the same CA:
//!
//! ```text
//! OUT/ca.pem                      the CA bundle every process verifies peers with
//! OUT/admin.pem, admin-key.pem    an admin identity for the CLI and grpcurl
//! OUT/<svc>.pem, <svc>-key.pem    a service identity per --service
//! --join-token-out FILE           a fresh join token for the first hosts (optional)
//! ```
//!
//! The layout is the one `berth dev` keeps, so `berth --data-dir OUT ...`
//! and grpcurl work against the mesh with no other flags.
//!
//! # Invariants
//! - The CA is never replaced: a rerun (with the same secret) loads it, and
//!   issues every certificate anew from it; a rerun is how a container
//!   deployment renews them. A secret that does not open the stored CA
//!   fails before anything is written.
//! - Every file is written beside its destination and renamed into place,
//!   keys and the token 0600 from the moment they exist, so a service that
//!   watches its certificate files never reads half of one.
//! - Service certificates always carry `localhost` and `127.0.0.1` besides
//!   the names given, so a health check inside the service's own container
//!   or pod (`berth health`) can verify the server it dials on loopback.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_core::Identity;
use berth_identity::{AuthorityTiming, IdentityConfig, IdentityService, MAX_TOKEN_TTL, MAX_TOKEN_USES};
use berth_proto::identity::v1;
use berth_proto::identity::v1::join_tokens_server::JoinTokens as _;
use berth_runtime::{StartError, open_bus, open_store, parse_duration};

use super::cert::write_file;
use super::{CliError, parse_ttl};

/// Names every service certificate carries for checks from inside its own
/// container or pod.
pub(crate) const LOOPBACK_NAMES: [&str; 2] = ["localhost", "127.0.0.1"];

/// The shortest certificate life bootstrap issues: anything shorter would
/// expire before an operator could roll it out.
const MIN_CERT_TTL: Duration = Duration::from_secs(3600);

/// Flags of `berth bootstrap`.
#[derive(Debug, clap::Args)]
pub(crate) struct BootstrapArgs {
    /// Directory to write the CA bundle and certificates into (created if
    /// missing).
    #[arg(long, env = "BERTH_BOOTSTRAP_OUT", value_name = "DIR")]
    out: PathBuf,
    /// Identity's database: `postgres://user@host:5432/db` (identity's own
    /// schema in it) or `sqlite://PATH`, the one `berth-identity` is given.
    #[arg(long, env = "BERTH_DATABASE_URL", value_name = "URL")]
    database_url: String,
    /// The secret the CA key is sealed under: the one every `berth-identity`
    /// replica is given (at least 32 characters).
    #[arg(long, env = "BERTH_AUTH_SECRET", value_name = "SECRET", hide_env_values = true)]
    auth_secret: String,
    /// The admin identity to write as admin.pem (`<NAME>.admin.berth.internal`).
    #[arg(long, env = "BERTH_BOOTSTRAP_ADMIN", default_value = "admin", value_name = "NAME")]
    admin: String,
    /// A service identity to write as NAME.pem and NAME-key.pem, with the
    /// host names (or IPs) it is dialled by, e.g.
    /// `leases=leases,leases.berth.svc`; `localhost` and `127.0.0.1` are
    /// always added. Repeat for each service; given at all, it replaces the
    /// default list.
    #[arg(long = "service", value_name = "NAME[=HOST,...]", value_parser = parse_service,
          default_values = ["revisions", "leases", "egress"])]
    services: Vec<ServiceCert>,
    /// A data-plane router's identity to write as NAME.pem and NAME-key.pem
    /// (`<NAME>.router.berth.internal`), with the host names it is dialled
    /// by, as for --service. Repeat for each; none by default.
    #[arg(long = "router", value_name = "NAME[=HOST,...]", value_parser = parse_router)]
    routers: Vec<ServiceCert>,
    /// How long the admin and service certificates live (at most 90d).
    #[arg(long, env = "BERTH_BOOTSTRAP_CERT_TTL", default_value = "30d", value_name = "DURATION",
          value_parser = parse_duration)]
    cert_ttl: Duration,
    /// Also create a join token and write it here (0600), for the first hosts'
    /// agents (their `--join-token-file`, `BERTH_JOIN_TOKEN_FILE`). Every run
    /// creates a fresh one. Outside --out, the CA bundle is also written
    /// beside it as `ca.pem`: that directory is all an agent needs.
    #[arg(long, env = "BERTH_BOOTSTRAP_JOIN_TOKEN_OUT", value_name = "FILE")]
    join_token_out: Option<PathBuf>,
    /// How long that join token stays usable, e.g. `1h`, `7d` (at most 30d).
    #[arg(long, default_value = "1h", value_name = "DURATION", value_parser = parse_ttl)]
    join_token_ttl: u32,
    /// How many joins that token allows.
    #[arg(long, default_value_t = 1, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_TOKEN_USES)))]
    join_token_uses: u32,
    /// The tier nodes joining with that token are placed in; empty for none.
    #[arg(long, default_value = "", value_name = "TIER", value_parser = parse_tier)]
    join_token_tier: String,
}

/// One `--service`: the service's identity and the names it is dialled by.
#[derive(Debug, Clone)]
struct ServiceCert {
    identity: Identity,
    hosts: Vec<String>,
}

/// Why bootstrap stopped. Each message is the whole line the user sees.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BootstrapError {
    /// A flag's value is out of bounds.
    #[error("{flag}: {reason}")]
    Flag {
        /// The flag.
        flag: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The output directory could not be made.
    #[error("cannot create {path}: {source}")]
    CreateDir {
        /// The directory.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Identity's database could not be opened or migrated.
    #[error("{0}")]
    State(#[source] StartError),
    /// The CA could not be created, loaded or asked to sign.
    #[error("identity's CA: {0}")]
    Authority(#[source] berth_identity::AuthorityError),
    /// Identity refused to create the join token.
    #[error("cannot create the join token: {0}")]
    Token(String),
    /// A file could not be written.
    #[error(transparent)]
    Write(#[from] CliError),
}

impl From<BootstrapError> for StartError {
    fn from(error: BootstrapError) -> Self {
        match error {
            BootstrapError::State(start) => start,
            other => StartError::Invalid(super::one_line(&other.to_string())),
        }
    }
}

/// `NAME` or `NAME=HOST[,HOST...]`, NAME a valid service name and each HOST
/// a name a client can dial.
fn parse_service(value: &str) -> Result<ServiceCert, String> {
    parse_cert(value, Identity::service)
}

/// `NAME` or `NAME=HOST[,HOST...]` for a router.
fn parse_router(value: &str) -> Result<ServiceCert, String> {
    parse_cert(value, Identity::router)
}

fn parse_cert(
    value: &str,
    identity: fn(String) -> Result<Identity, berth_core::IdentityError>,
) -> Result<ServiceCert, String> {
    let (name, hosts) = value.split_once('=').unwrap_or((value, ""));
    let identity = identity(name.trim().to_string()).map_err(|e| e.to_string())?;
    let mut names = Vec::new();
    for host in hosts.split(',').map(str::trim).filter(|h| !h.is_empty()) {
        check_host(host)?;
        names.push(host.to_string());
    }
    Ok(ServiceCert { identity, hosts: names })
}

/// Empty (no tier) or a DNS label, as identity takes tiers.
fn parse_tier(value: &str) -> Result<String, String> {
    if value.is_empty() || berth_core::is_dns_label(value) {
        Ok(value.to_string())
    } else {
        Err(format!("'{value}' is not a tier name: use 1-63 lowercase letters, digits or '-'"))
    }
}

/// A host name or IP a service can be dialled by; berth's own identity
/// names are refused, as `IssueCertificate` refuses them.
fn check_host(host: &str) -> Result<(), String> {
    if host.parse::<std::net::IpAddr>().is_ok() {
        return Ok(());
    }
    let well_formed = host.len() <= 253
        && host.split('.').all(|label| {
            (1..=63).contains(&label.len())
                && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        });
    if !well_formed {
        return Err(format!("'{host}' is not a host name or IP"));
    }
    if host.ends_with(".berth.internal") {
        return Err(format!("'{host}' is a berth identity name, not a host name a service is dialled by"));
    }
    Ok(())
}

impl BootstrapArgs {
    fn check_flags(&self) -> Result<(), BootstrapError> {
        let max = AuthorityTiming::default().max_cert_ttl;
        if self.cert_ttl < MIN_CERT_TTL || self.cert_ttl > max {
            return Err(BootstrapError::Flag {
                flag: "--cert-ttl",
                reason: format!("must be between 1h and {}d", max.as_secs() / 86_400),
            });
        }
        if Duration::from_secs(u64::from(self.join_token_ttl)) > MAX_TOKEN_TTL {
            return Err(BootstrapError::Flag {
                flag: "--join-token-ttl",
                reason: format!("at most {}d", MAX_TOKEN_TTL.as_secs() / 86_400),
            });
        }
        let mut seen = std::collections::BTreeSet::new();
        if let Some(twice) = self.services.iter().chain(&self.routers).find(|s| !seen.insert(s.identity.name())) {
            return Err(BootstrapError::Flag {
                flag: if twice.identity.kind() == berth_core::CallerKind::Router { "--router" } else { "--service" },
                reason: format!("'{}' is given twice", twice.identity.name()),
            });
        }
        Ok(())
    }

    pub(crate) async fn run(self) -> Result<(), BootstrapError> {
        self.check_flags()?;
        let admin = Identity::admin(self.admin.trim())
            .map_err(|e| BootstrapError::Flag { flag: "--admin", reason: e.to_string() })?;
        let store = open_store(&self.database_url, berth_identity::NAME, berth_identity::MIGRATIONS)
            .await
            .map_err(BootstrapError::State)?;
        let outcome = async {
            // Token creation is the only part that reaches the bus, and it
            // publishes nothing a running replica needs.
            let bus = open_bus("memory://", berth_identity::NAME).await.map_err(BootstrapError::State)?;
            let config = IdentityConfig {
                auth_secret: self.auth_secret.clone(),
                authority: AuthorityTiming::default(),
                node_cert_ttl: Duration::from_secs(3600),
            };
            let identity =
                IdentityService::open(store.clone(), bus, config).await.map_err(BootstrapError::Authority)?;
            self.issue(&identity, &admin).await
        }
        .await;
        store.close().await;
        let written = outcome?;
        println!("{}", written.join("\n"));
        Ok(())
    }

    /// Writes every file from identity's CA; returns what was written, one
    /// line each.
    async fn issue(&self, identity: &IdentityService, admin: &Identity) -> Result<Vec<String>, BootstrapError> {
        let authority = identity.authority();
        let bundle = authority.bundle_pem().await.map_err(BootstrapError::Authority)?;

        create_private_dir(&self.out)?;
        let mut written = Vec::new();
        let admin_material =
            authority.issue_material(admin, &[], self.cert_ttl).await.map_err(BootstrapError::Authority)?;
        write_pair(&self.out, "admin", &admin_material)?;
        written.push(format!("{admin} ({}): {}", admin.to_san(), self.out.join("admin.pem").display()));
        for service in self.services.iter().chain(&self.routers) {
            let mut hosts = service.hosts.clone();
            hosts.extend(LOOPBACK_NAMES.iter().map(|n| n.to_string()).filter(|n| !service.hosts.contains(n)));
            let material = authority
                .issue_material(&service.identity, &hosts, self.cert_ttl)
                .await
                .map_err(BootstrapError::Authority)?;
            let name = service.identity.name();
            write_pair(&self.out, name, &material)?;
            written.push(format!(
                "{} ({}): {}, dialled as {}",
                service.identity,
                service.identity.to_san(),
                self.out.join(format!("{name}.pem")).display(),
                hosts.join(", ")
            ));
        }
        // The bundle last: a reader that sees it sees certificates that chain to it.
        let ca_path = self.out.join("ca.pem");
        write_file(&ca_path, &bundle, false)?;
        written.push(format!("CA bundle: {}", ca_path.display()));

        if let Some(path) = &self.join_token_out {
            let token = self.create_token(identity, admin).await?;
            write_file(path, &token.token, true)?;
            written.push(format!("join token {}: {}", token.token_id, path.display()));
            // Beside the token, the bundle an agent joins with, so a host
            // can be given that directory and nothing of the PKI's keys.
            if let Some(dir) = path.parent().filter(|dir| !dir.as_os_str().is_empty() && *dir != self.out) {
                let beside = dir.join("ca.pem");
                write_file(&beside, &bundle, false)?;
                written.push(format!("CA bundle for agents: {}", beside.display()));
            }
        }
        Ok(written)
    }

    /// Creates the token through identity's own `CreateJoinToken` handler,
    /// as `admin`: the same validation and storage as the RPC.
    async fn create_token(
        &self,
        identity: &IdentityService,
        admin: &Identity,
    ) -> Result<v1::CreateJoinTokenResponse, BootstrapError> {
        let mut request = tonic::Request::new(v1::CreateJoinTokenRequest {
            tier: self.join_token_tier.clone(),
            labels: Default::default(),
            ttl_seconds: self.join_token_ttl,
            max_uses: self.join_token_uses,
            description: "berth bootstrap".into(),
        });
        request.extensions_mut().insert(berth_rpc::PeerInfo {
            remote_addr: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            identity: Some(admin.clone()),
            issued_at: None,
            expires_at: None,
        });
        let created = identity
            .create_join_token(request)
            .await
            .map_err(|status| BootstrapError::Token(super::one_line(status.message())))?;
        Ok(created.into_inner())
    }
}

/// Writes `<name>-key.pem` (0600) and then `<name>.pem` into `dir`.
fn write_pair(dir: &Path, name: &str, material: &berth_mtls::TlsMaterial) -> Result<(), BootstrapError> {
    write_file(&dir.join(format!("{name}-key.pem")), &material.key_pem, true)?;
    write_file(&dir.join(format!("{name}.pem")), &material.cert_chain_pem, false)?;
    Ok(())
}

/// Creates `dir` (and its parents), 0700 when this makes it: it holds keys.
fn create_private_dir(dir: &Path) -> Result<(), BootstrapError> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt as _;
        builder.mode(0o700);
    }
    builder.create(dir).map_err(|source| BootstrapError::CreateDir { path: dir.display().to_string(), source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_service_is_a_name_with_the_hosts_it_is_dialled_by() {
        let plain = parse_service("leases").unwrap();
        assert_eq!(plain.identity.to_san(), "leases.svc.berth.internal");
        assert!(plain.hosts.is_empty());
        let named = parse_service("leases=leases, leases.berth.svc,10.0.0.7").unwrap();
        assert_eq!(named.hosts, ["leases", "leases.berth.svc", "10.0.0.7"]);
        let router = parse_router("router=router").unwrap();
        assert_eq!(router.identity.to_san(), "router.router.berth.internal");
        assert_eq!(router.hosts, ["router"]);
    }

    #[test]
    fn bad_service_names_and_hosts_are_named() {
        assert!(parse_service("Leases!").unwrap_err().contains("'Leases!'"));
        assert!(parse_service("leases=bad host").unwrap_err().contains("'bad host' is not a host name"));
        assert!(parse_service("leases=-x.example").is_err());
        assert!(parse_service("leases=leases.svc.berth.internal").unwrap_err().contains("berth identity name"));
    }
}
