//! `berth dev`: the whole mesh in one process, for a first try.
//!
//! Every service still serves mTLS gRPC on its own port (identity on the
//! port base, then revisions, leases, egress, and the dev node's agent), and
//! the router serves services by name over HTTP and HTTPS on the two ports
//! after those, on
//! SQLite files and one in-process bus in the data directory: nothing else
//! to install.
//!
//! # What is stored in the data directory
//! - `identity.db` and the other `<service>.db`: each service's SQLite store.
//!   The CA lives in identity's, its key sealed under `auth-secret`.
//! - `auth-secret` (0600): the dev CA's sealing secret, made on first start.
//! - `ca.pem`: the CA bundle, mirrored by identity whenever it changes.
//! - `admin.pem`, `admin-key.pem` (0600): an admin client identity for
//!   grpcurl and the CLI, signed through the same path as `IssueCertificate`
//!   and re-issued when it nears expiry or no longer chains to the bundle.
//!
//! Service and node certificates live only in memory, issued by identity's
//! authority and renewed by its keeper.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_core::Identity;
use berth_identity::{Authority, IdentityConfig, IdentityService, KeptIdentity, spawn_keeper, write_bundle};
use berth_mtls::{TlsMaterial, cert_not_after, certs_from_pem, generate_csr, verify_chain};
use berth_rpc::Revocations;
use berth_runtime::{
    NodeDirectory, ServiceContext, ServiceSpec, StartError, bind, follow_nodes, follow_workload_bundle, open_bus,
    open_store,
};
use tokio::task::JoinSet;

/// How long the admin certificate written to the data directory is valid.
const ADMIN_VALIDITY: Duration = Duration::from_secs(30 * 24 * 3600);

/// An admin certificate closer than this to expiry is re-issued at start.
const ADMIN_RENEW_BEFORE: Duration = Duration::from_secs(7 * 24 * 3600);

/// How long in-memory service and node certificates are valid; the keeper
/// renews them at half of it.
const LEAF_VALIDITY: Duration = Duration::from_secs(24 * 3600);

/// How long the router's public HTTPS certificate is valid; a new one is
/// issued at every start.
const PUBLIC_CERT_VALIDITY: Duration = Duration::from_secs(30 * 24 * 3600);

/// The control-plane services after identity, in port order.
const SERVICES: [ServiceSpec; 3] = [berth_revisions::SPEC, berth_leases::SPEC, berth_egress::SPEC];

/// The dev node's name (identity picks its id).
const DEV_NODE: &str = "dev";

/// Length of the generated sealing secret, in random bytes (hex encoded).
const SECRET_BYTES: usize = 32;

/// Flags of `berth dev`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct DevArgs {
    /// Where the CA, the admin certificate and every service's state live.
    #[arg(long, env = "BERTH_DATA_DIR", default_value = ".berth/dev", value_name = "DIR")]
    data_dir: PathBuf,
    /// First port: identity on P, revisions P+1, leases P+2, egress P+3, the
    /// dev node's agent P+4, the router's HTTP P+5 and HTTPS P+6.
    #[arg(long, env = "BERTH_PORT_BASE", default_value_t = 7443, value_name = "P",
          value_parser = clap::value_parser!(u16).range(1..=65529))]
    port_base: u16,
    /// Address every port is bound on.
    #[arg(long, env = "BERTH_DEV_HOST", default_value = "127.0.0.1", value_name = "IP")]
    host: IpAddr,
    /// A JSON file of named registry credentials that templates name with
    /// `bundle.secret` (the format of berth-revisions' flag of this name);
    /// revisions resolves with them and the dev node pulls with them.
    #[arg(long, env = "BERTH_REGISTRY_CREDENTIALS", value_name = "FILE")]
    registry_credentials: Option<PathBuf>,
    /// PEM file of the CA that signed a private registry's certificate:
    /// revisions resolves tags and the dev node pulls trusting it.
    #[arg(long = "registry-ca", env = "BERTH_REGISTRY_CA", value_name = "FILE")]
    registry_ca: Option<PathBuf>,
    // What contains the dev node's workloads when run as root.
    #[command(flatten)]
    runtime: berth_agent::RuntimeArgs,
    /// Run the dev node's workloads uncontained when it cannot contain them
    /// as root (the OCI runtime is missing). Without root they always run
    /// uncontained, and the banner says so.
    #[arg(long, env = "BERTH_ALLOW_UNCONTAINED")]
    allow_uncontained: bool,
    /// Leave the dev node's workloads running when `berth dev` stops; by
    /// default Ctrl-C stops them first, since nothing else would.
    #[arg(long)]
    keep_workloads: bool,
    /// How long a replica may take to begin answering a request through
    /// the router before the router answers 504 Gateway Timeout.
    #[arg(long, env = "BERTH_RESPONSE_TIMEOUT", value_name = "DURATION", default_value = "5m",
          value_parser = berth_router::parse_response_timeout)]
    response_timeout: std::time::Duration,
}

pub(crate) async fn run(args: DevArgs) -> Result<(), StartError> {
    let dir = &args.data_dir;
    std::fs::create_dir_all(dir).map_err(|source| io("cannot create data directory", dir, source))?;
    probe_writable(dir)?;
    let secret = load_or_create_secret(dir)?;
    let registry_secrets = match &args.registry_credentials {
        Some(path) => berth_revisions::RegistrySecrets::from_file(path)
            .map_err(|e| StartError::Invalid(format!("--registry-credentials: {e}")))?,
        None => berth_revisions::RegistrySecrets::none(),
    };
    let registry_ca = match &args.registry_ca {
        Some(path) => Some(std::fs::read_to_string(path).map_err(|source| io("cannot read", path, source))?),
        None => None,
    };

    // One in-process bus shared the way services share one Redis: each
    // service under its own prefix.
    let bus = open_bus("memory://", "berth").await?;
    let shutdown = berth_rpc::shutdown_signal();
    let sans = vec!["localhost".to_string(), args.host.to_string(), "127.0.0.1".to_string(), "::1".to_string()];

    let identity_store =
        open_store(&sqlite_url(dir, berth_identity::NAME), berth_identity::NAME, berth_identity::MIGRATIONS).await?;
    let identity_bus = bus.with_prefix(berth_identity::NAME).map_err(StartError::Bus)?;
    let config = IdentityConfig {
        auth_secret: secret,
        authority: berth_identity::AuthorityTiming::default(),
        node_cert_ttl: Duration::from_secs(3600),
    };
    let identity_readiness = berth_runtime::store_readiness(&identity_store);
    // Every service at the host a client reached identity by, at its port.
    let mut endpoints = berth_identity::Endpoints::default();
    for (name, offset) in [("revisions", 1), ("leases", 2), ("egress", 3), ("router", 5)] {
        endpoints.insert(name, &format!(":{}", args.port_base + offset)).map_err(StartError::Invalid)?;
    }
    // Agent artifacts are resolved trusting the same private CA as bundles.
    let agent_registry = berth_bundle::BundleClient::new(berth_bundle::RegistryConfig {
        ca_pem: registry_ca.clone(),
        ..berth_bundle::RegistryConfig::default()
    })
    .map_err(|e| StartError::Invalid(format!("--registry-ca: {e}")))?;
    let identity = IdentityService::open(identity_store, identity_bus, config)
        .await
        .map_err(authority_error)?
        .with_endpoints(endpoints)
        .with_agent_registry(agent_registry);
    let authority = identity.authority().clone();
    let bundle = authority.bundle_pem().await.map_err(authority_error)?;
    let ca_path = dir.join("ca.pem");
    write_bundle(&ca_path, &bundle).map_err(|source| io("cannot write", &ca_path, source))?;
    ensure_admin_cert(dir, &authority, &bundle).await?;

    let mut servers = JoinSet::new();
    let mut kept = Vec::new();

    let me = KeptIdentity::issue(&authority, service_identity(berth_identity::NAME)?, sans.clone(), LEAF_VALIDITY)
        .await
        .map_err(authority_error)?;
    let listener = bind(SocketAddr::new(args.host, args.port_base), me.credentials.clone()).await?;
    let dial_host = if args.host.is_unspecified() { IpAddr::from([127, 0, 0, 1]) } else { args.host };
    // Identity asks leases, two ports up, before it signs a workload's certificate.
    let launches = berth_identity::GrpcLaunchLedger::connect(
        &SocketAddr::new(dial_host, args.port_base + 2).to_string(),
        me.credentials.clone(),
    )
    .map_err(|e| StartError::Invalid(format!("identity's leases client: {e}")))?;
    let identity = identity.with_workload_settings(berth_identity::WorkloadSettings {
        ledger: Some(std::sync::Arc::new(launches)),
        ..Default::default()
    });
    identity.spawn_loops(&shutdown);
    let stop = shutdown.clone();
    let server = identity.server().with_readiness(identity_readiness);
    servers.spawn(async move { Ok(server.serve(listener, stop).await?) });
    kept.push(me);

    let identity_addr = SocketAddr::new(dial_host, args.port_base).to_string();
    for (offset, spec) in (1u16..).zip(SERVICES) {
        let me = KeptIdentity::issue(&authority, service_identity(spec.name)?, sans.clone(), LEAF_VALIDITY)
            .await
            .map_err(authority_error)?;
        let store = open_store(&sqlite_url(dir, spec.name), spec.name, spec.migrations).await?;
        let bus = bus.with_prefix(spec.name).map_err(StartError::Bus)?;
        let (revocations, nodes) = (Revocations::new(), NodeDirectory::new());
        follow_nodes(
            identity_addr.clone(),
            me.credentials.clone(),
            nodes.clone(),
            revocations.clone(),
            shutdown.clone(),
        );
        follow_workload_bundle(identity_addr.clone(), me.credentials.clone(), shutdown.clone());
        let ctx = ServiceContext { store, bus, credentials: me.credentials.clone(), revocations, nodes };
        let listener = bind(SocketAddr::new(args.host, args.port_base + offset), me.credentials.clone()).await?;
        let stop = shutdown.clone();
        if spec.name == berth_revisions::NAME {
            // Revisions drives leases, the next port up.
            let leases = SocketAddr::new(dial_host, args.port_base + 2).to_string();
            // Control plane and node share this machine, so oci: layout
            // directories work as bundle sources here.
            let policy = berth_revisions::RegistryPolicy {
                insecure_registries: Vec::new(),
                ca_pem: registry_ca.clone(),
                allow_layouts: true,
                mirrors: Vec::new(),
            };
            let server = berth_revisions::server_with_leases(&ctx, &leases, policy, registry_secrets.clone())?
                .with_revocations(ctx.revocations.clone())
                .with_readiness(ctx.readiness());
            servers.spawn(async move { Ok(server.serve(listener, stop).await?) });
        } else if spec.name == berth_egress::NAME {
            // Egress follows revisions (services' selections) and leases
            // (which tenants each node hosts), the two ports below it.
            let revisions = SocketAddr::new(dial_host, args.port_base + 1).to_string();
            let leases = SocketAddr::new(dial_host, args.port_base + 2).to_string();
            let server = berth_egress::server_with_sources(&ctx, &revisions, &leases)?
                .with_revocations(ctx.revocations.clone())
                .with_readiness(ctx.readiness());
            servers.spawn(async move { Ok(server.serve(listener, stop).await?) });
        } else {
            servers.spawn(async move { spec.serve(&ctx, listener, stop).await });
        }
        kept.push(me);
    }

    // The dev node joins like any host: with a join token on first start,
    // resuming its kept identity after that.
    let agent_dir = dir.join("agent");
    let join_token =
        if agent_dir.join("identity").exists() { None } else { Some(create_dev_token(dir, &identity_addr).await?) };
    let agent_addr = SocketAddr::new(args.host, args.port_base + 4);
    let capacity = berth_agent::Capacity::detect().map_err(|e| StartError::Invalid(format!("agent: {e}")))?;
    let mut agent = berth_agent::AgentConfig::new(
        identity_addr.clone(),
        agent_dir,
        SocketAddr::new(dial_host, agent_addr.port()).to_string(),
        agent_addr,
        capacity,
    );
    agent.ca_bundle_pem = bundle.clone();
    agent.registry_ca_pem = registry_ca.clone();
    agent.join_token = join_token;
    agent.name = DEV_NODE.to_string();
    agent.leases = Some(SocketAddr::new(dial_host, args.port_base + 2).to_string());
    agent.revisions = Some(SocketAddr::new(dial_host, args.port_base + 1).to_string());
    // Every replica reaches out only through its tenant's egress proxy,
    // held to the plan the egress service (three above identity) sends.
    agent.egress = Some(SocketAddr::new(dial_host, args.port_base + 3).to_string());
    // A replica reaches `<service>.<project>.berth.internal` through the
    // router's HTTP listener (five above identity).
    agent.router = Some(SocketAddr::new(dial_host, args.port_base + 5).to_string());
    agent.microvm.accel = args.runtime.microvm_accel;
    let root = rustix::process::geteuid().is_root();
    agent.containment = if root {
        berth_agent::Containment {
            runtime: args.runtime.workload_runtime().map_err(StartError::Invalid)?,
            allow_uncontained: args.allow_uncontained,
            ..Default::default()
        }
    } else {
        // Without root nothing contains the workloads, whatever the flags
        // name: a runtime asked for is not used, and the banner says so.
        if let Some(asked) = unhonoured_runtime(&args.runtime) {
            tracing::warn!(
                runtime = %asked,
                "containing workloads needs root: the dev node runs them uncontained, as this user"
            );
        }
        berth_agent::Containment::uncontained()
    };
    let agent = berth_agent::start(agent, shutdown.clone())
        .await
        .map_err(|e| StartError::Invalid(format!("dev agent: {e}")))?;
    let contained = root && agent.contained();
    // The dev node stopping (revoked by an operator, say) leaves the control
    // plane serving.
    let keep_workloads = args.keep_workloads;
    servers.spawn(async move {
        let stopped = if keep_workloads { agent.wait().await } else { agent.wait_then_stop_workloads().await };
        if let Err(error) = stopped {
            tracing::warn!(%error, "the dev node's agent stopped; the control plane keeps serving");
        }
        Ok(())
    });

    // The router reaches replicas through the agent, as a router identity;
    // its public HTTP port is five above identity.
    let router = KeptIdentity::issue(&authority, router_identity()?, sans.clone(), LEAF_VALIDITY)
        .await
        .map_err(authority_error)?;
    let bind_public = |offset: u16| {
        let addr = SocketAddr::new(args.host, args.port_base + offset);
        async move { tokio::net::TcpListener::bind(addr).await.map_err(|source| StartError::Bind { addr, source }) }
    };
    // HTTPS with a certificate from the dev CA for the default project's
    // names (a wildcard covers one label: other projects' names need their own).
    let public_names: Vec<String> =
        [format!("*.default.{}", berth_router::DEFAULT_DOMAIN), berth_router::DEFAULT_DOMAIN.to_string()]
            .into_iter()
            .chain(sans.iter().cloned())
            .collect();
    let public_cert = authority
        .issue_material(&router_identity()?, &public_names, PUBLIC_CERT_VALIDITY)
        .await
        .map_err(authority_error)?;
    let tls = berth_router::public_tls(&public_cert.cert_chain_pem, &public_cert.key_pem).map_err(StartError::Tls)?;
    let public =
        berth_router::PublicListeners { http: Some(bind_public(5).await?), https: Some((bind_public(6).await?, tls)) };
    let config = berth_router::RouterConfig {
        domain: berth_router::DEFAULT_DOMAIN.to_string(),
        identity_addr: identity_addr.clone(),
        revisions_addr: SocketAddr::new(dial_host, args.port_base + 1).to_string(),
        leases_addr: SocketAddr::new(dial_host, args.port_base + 2).to_string(),
        credentials: router.credentials.clone(),
        instance: berth_router::host_instance(),
        response_timeout: args.response_timeout,
    };
    let serving =
        berth_router::start(config, public, &shutdown).map_err(|e| StartError::Invalid(format!("router: {e}")))?;
    // Requests under way finish before `berth dev` exits.
    servers.spawn(async move {
        serving.stopped().await;
        Ok(())
    });
    kept.push(router);

    spawn_keeper(authority, kept, LEAF_VALIDITY, Some(ca_path), shutdown.clone());
    print_banner(&args, root, contained);

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

/// A single-use join token for the dev node, created through the admin API
/// with the admin identity `berth dev` just wrote.
async fn create_dev_token(dir: &Path, identity_addr: &str) -> Result<String, StartError> {
    use berth_proto::identity::v1::{CreateJoinTokenRequest, join_tokens_client::JoinTokensClient};
    let material = TlsMaterial::from_files(dir.join("admin.pem"), dir.join("admin-key.pem"), dir.join("ca.pem"))
        .map_err(StartError::Tls)?;
    let credentials = berth_mtls::TlsCredentials::new(material).map_err(StartError::Tls)?;
    let channel = berth_rpc::connect(identity_addr, credentials).map_err(|e| StartError::Invalid(e.to_string()))?;
    let request = CreateJoinTokenRequest { max_uses: 1, ttl_seconds: 600, ..Default::default() };
    let response = JoinTokensClient::new(channel)
        .create_join_token(request)
        .await
        .map_err(|status| StartError::Invalid(format!("creating the dev node's join token: {}", status.message())))?;
    Ok(response.into_inner().token)
}

fn sqlite_url(dir: &Path, name: &str) -> String {
    format!("sqlite://{}", dir.join(format!("{name}.db")).display())
}

fn service_identity(name: &str) -> Result<Identity, StartError> {
    Identity::service(name).map_err(|e| StartError::Invalid(e.to_string()))
}

fn router_identity() -> Result<Identity, StartError> {
    Identity::router(DEV_NODE).map_err(|e| StartError::Invalid(e.to_string()))
}

fn authority_error(error: berth_identity::AuthorityError) -> StartError {
    StartError::Invalid(format!("identity: {error}"))
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

/// The dev CA's sealing secret: made once, kept beside the state it opens.
fn load_or_create_secret(dir: &Path) -> Result<String, StartError> {
    let path = dir.join("auth-secret");
    if path.exists() {
        return Ok(read(&path)?.trim().to_string());
    }
    let bytes: [u8; SECRET_BYTES] = rand::random();
    let secret: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    write_private(&path, &secret)?;
    Ok(secret)
}

/// Issues `admin.pem`/`admin-key.pem` unless a current one that chains to
/// the bundle is already there.
async fn ensure_admin_cert(dir: &Path, authority: &Authority, bundle: &str) -> Result<(), StartError> {
    let cert_path = dir.join("admin.pem");
    let key_path = dir.join("admin-key.pem");
    if let Ok(pem) = std::fs::read_to_string(&cert_path)
        && let Ok(key) = std::fs::read_to_string(&key_path)
        && berth_mtls::TlsCredentials::new(TlsMaterial {
            cert_chain_pem: pem.clone(),
            key_pem: key,
            ca_bundle_pem: bundle.to_string(),
        })
        .is_ok()
        && verify_chain(&pem, bundle).is_ok()
        && let Ok(certs) = certs_from_pem("certificate", &pem)
        && let Ok(not_after) = cert_not_after(&certs[0])
        && not_after - now_secs() > ADMIN_RENEW_BEFORE.as_secs() as i64
    {
        return Ok(());
    }
    let admin = Identity::admin("dev").map_err(|e| StartError::Invalid(e.to_string()))?;
    let (csr, key) = generate_csr("dev").map_err(StartError::Tls)?;
    let cert = authority.sign(&csr, &admin, &[], ADMIN_VALIDITY).await.map_err(authority_error)?;
    write_private(&key_path, &key)?;
    std::fs::write(&cert_path, cert.cert_pem).map_err(|source| io("cannot write", &cert_path, source))?;
    Ok(())
}

fn now_secs() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

/// The runtime flags name when they differ from the default (`--runtime
/// oci` through runc), as the flag a user gave: what a `berth dev` without
/// root cannot honour.
fn unhonoured_runtime(runtime: &berth_agent::RuntimeArgs) -> Option<String> {
    if runtime.runtime != "oci" {
        Some(format!("--runtime {}", runtime.runtime))
    } else if runtime.oci_runtime != berth_agent::OciRuntime::Runc {
        Some(format!("--oci-runtime {}", runtime.oci_runtime))
    } else {
        None
    }
}

/// A runtime as the banner names it.
fn runtime_name(runtime: berth_agent::WorkloadRuntime) -> String {
    match runtime {
        berth_agent::WorkloadRuntime::Oci(oci) => oci.to_string(),
        berth_agent::WorkloadRuntime::Process => "the process runtime".to_string(),
        berth_agent::WorkloadRuntime::MicroVm => "QEMU microVMs".to_string(),
        berth_agent::WorkloadRuntime::Uncontained => "plain host processes".to_string(),
    }
}

fn print_banner(args: &DevArgs, root: bool, contained: bool) {
    let dir = args.data_dir.display();
    let host = args.host;
    let p = args.port_base;
    let mut lines = vec![format!("berth dev is running; state in {dir}")];
    for (offset, name) in (0u16..).zip(["identity", "revisions", "leases", "egress", "agent (node 'dev')"]) {
        lines.push(format!("  {name:<20} {host}:{}", p + offset));
    }
    lines.push(format!(
        "  {:<20} http://{host}:{} (a service answers at <service>.<project>.{})",
        "router (HTTP)",
        p + 5,
        berth_router::DEFAULT_DOMAIN
    ));
    lines.push(format!(
        "  {:<20} https://{host}:{} (trusting {dir}/ca.pem; names in the default project)",
        "router (HTTPS)",
        p + 6
    ));
    lines.push(String::new());
    lines.push("Try it:".into());
    lines
        .push(format!("  grpcurl -cacert {dir}/ca.pem -cert {dir}/admin.pem -key {dir}/admin-key.pem {host}:{p} list"));
    lines.push(format!(
        "  grpcurl -cacert {dir}/ca.pem -cert {dir}/admin.pem -key {dir}/admin-key.pem {host}:{p} grpc.health.v1.Health/Check"
    ));
    // The flags were checked when the agent started with them.
    let runtime = args.runtime.workload_runtime().ok();
    if let (true, Some(runtime)) = (contained, runtime) {
        let how = match runtime {
            berth_agent::WorkloadRuntime::MicroVm => "each runs in a microVM with a kernel of its own",
            _ => "each runs as a user of its own, in its own namespaces",
        };
        lines.push(format!(
            "The dev node contains its workloads with {}: {how}, within its lease's memory and CPU.",
            runtime_name(runtime)
        ));
    } else if root {
        // Root, and --allow-uncontained let the agent fall back.
        let asked = runtime.map_or_else(|| "the runtime".to_string(), runtime_name);
        lines.push(format!(
            "WARNING: the dev node's workloads are NOT contained: {asked} cannot run here (the log above says \
             why), so --allow-uncontained runs them as root, with no limits."
        ));
    } else if let Some(asked) = unhonoured_runtime(&args.runtime) {
        lines.push(format!(
            "WARNING: {asked} was not used: containing workloads needs root. The dev node's workloads are NOT \
             contained: they run as your user, see your files, and have no limits. Run `berth dev` as root to \
             use {asked}."
        ));
    } else {
        lines.push(
            "WARNING: the dev node's workloads are NOT contained: they run as your user, see your files, and have \
             no limits. Run `berth dev` as root to contain them."
                .into(),
        );
    }
    if args.keep_workloads {
        lines.push("Stop with Ctrl-C; the dev node's workloads keep running.".into());
    } else {
        lines.push("Stop with Ctrl-C; the dev node's workloads stop with it.".into());
    }
    println!("{}", lines.join("\n"));
}
