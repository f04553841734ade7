//! Fuzz targets for every parser that takes input from outside the mesh: a
//! joining host's CSR, a bundle's manifest and config as a registry serves
//! them, and its tar layer; and for what an admin's requests carry into the
//! control plane: a service declaration (`service_spec`) and the egress
//! gateways and routes (`egress_objects`).
//!
//! Each target is a plain function over bytes so that two drivers share it:
//! `cargo fuzz run NAME` (libFuzzer, the binaries in `fuzz_targets/`) and the
//! seed-corpus test in `tests/seeds.rs`, which `make test` runs.
//!
//! # What each target holds the code to
//! - It returns (an error is fine) and never panics, whatever the bytes.
//! - `tar_layer` never writes outside the directory it extracts into.
//! - `service_spec` and `egress_objects` drive the real gRPC handlers of the
//!   revisions and egress services, in this process, over SQLite and the
//!   in-process bus (see `Harness`): a request is either accepted or
//!   refused `INVALID_ARGUMENT` by the checks that run before anything is
//!   written. Any other answer means input the checks let through failed
//!   further in, and is a finding.
//! - `egress_objects` compiles what the egress service accepted, and the
//!   compile gives the same plan whatever order its inputs come in.
//!
//! # What `service_spec` reaches, and what it cannot
//! `berth service apply -f FILE` reads a JSON or YAML spec into a JSON value
//! and maps that onto an `ApplyServiceRequest`; the mapping lives in the
//! `berth` binary and no library exposes it, nor any other conversion from
//! a JSON value to the revisions proto. So the target takes the bytes two
//! ways: as an `ApplyServiceRequest` in protobuf, which is what reaches the
//! server whatever client sent it, handed to the revisions service's
//! `ApplyService` (its checks, then the catalog); and as spec text, parsed
//! exactly as the CLI parses it (JSON, and YAML through YAML's own value into
//! a JSON value), where anchors, nesting and invalid UTF-8 are the parsers'
//! to hold. The text does not go on to the request.
//!
//! # What `egress_objects` reaches
//! The bytes are a sequence of length-delimited messages (or, when they do
//! not read as one, a single message); each is decoded as an `EgressGateway`
//! and as an `EgressRoute`, and what decodes is applied through the egress
//! service's `ApplyGateway` and `ApplyRoute` (its checks, then the catalog).
//! The objects it accepted, as it answered them, are turned into the
//! compile's inputs the way its full pass reads stored objects (the egress
//! crate exports the compile and its input types, not its checks nor that
//! conversion), and compiled per project with services selecting each
//! gateway, the default one, a missing one, and none.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use base64::Engine as _;
use berth_bundle::{BundleConfig, BundleLimits, BundleManifest, Digest};
use berth_core::Identity;
use berth_egress::{
    EgressConfig, EgressService, GatewaySpec, HostPattern, ListenerSpec, ParentSpec, PlanInputs, Protocol, RouteAction,
    RouteSpec, Selection, ServiceInput, Sources,
};
use berth_mtls::{CertificateAuthority, TlsCredentials, TlsMaterial};
use berth_proto::egress::v1 as egress;
use berth_proto::egress::v1::egress_server::Egress as _;
use berth_proto::revisions::v1 as revisions;
use berth_proto::revisions::v1::services_server::Services as _;
use berth_proto::types::v1::BundleRef;
use berth_revisions::{Dependencies, NoLeases, RegistryPolicy, RegistrySecrets, ResolveError, RevisionsConfig};
use berth_revisions::{RevisionsService, TagResolver};
use berth_rpc::PeerInfo;
use berth_runtime::ServiceContext;
use berth_store::{Store, StoreOptions};
use prost::Message as _;

/// Limits small enough that a fuzzer explores them, not the disk.
const FUZZ_LIMITS: BundleLimits = BundleLimits { max_total_bytes: 1 << 20, max_file_bytes: 1 << 18, max_entries: 256 };

/// The CA the CSR target signs with: made once, as key generation dwarfs
/// parsing.
fn authority() -> &'static CertificateAuthority {
    static CA: OnceLock<CertificateAuthority> = OnceLock::new();
    CA.get_or_init(|| match CertificateAuthority::generate("berth fuzz CA", Duration::from_secs(3600)) {
        Ok(ca) => ca,
        Err(error) => panic!("a CA for fuzzing: {error}"),
    })
}

/// A joining host's CSR, as the text of the `Join` request carries it and, so
/// that the DER parser is reached too, as DER wrapped in PEM.
pub fn csr(data: &[u8]) {
    let Ok(identity) = Identity::node("fuzz") else { return };
    let ttl = Duration::from_secs(60);
    let text = String::from_utf8_lossy(data);
    let _ = authority().sign_csr(&text, &identity, &[], ttl);
    let wrapped = format!(
        "-----BEGIN CERTIFICATE REQUEST-----\n{}\n-----END CERTIFICATE REQUEST-----\n",
        base64::engine::general_purpose::STANDARD.encode(data)
    );
    let _ = authority().sign_csr(&wrapped, &identity, &[], ttl);
}

/// A bundle's config blob as a registry serves it.
pub fn bundle_config(data: &[u8]) {
    let _ = BundleConfig::parse(data);
}

/// A bundle's manifest as a registry serves it.
pub fn bundle_manifest(data: &[u8]) {
    let _ = BundleManifest::parse(data);
}

/// A bundle's layer, both as a plain tar and gzip'd, extracted into a fresh
/// directory inside a fresh parent; anything appearing in the parent besides
/// that directory was written outside it.
pub fn tar_layer(data: &[u8]) {
    for gzip in [false, true] {
        let Ok(parent) = tempfile::tempdir() else { return };
        let dest = parent.path().join("bundle");
        if std::fs::create_dir(&dest).is_err() {
            return;
        }
        let _ = if gzip {
            berth_bundle::extract_tar(flate2::read::GzDecoder::new(data), &dest, &FUZZ_LIMITS)
        } else {
            berth_bundle::extract_tar(data, &dest, &FUZZ_LIMITS)
        };
        assert_only_child(parent.path(), &dest);
    }
}

fn assert_only_child(parent: &Path, child: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else { return };
    for entry in entries.flatten() {
        assert_eq!(entry.path(), child, "extraction wrote {} outside the bundle directory", entry.path().display());
    }
}

/// What one `service_spec` input came to, so that the seeds test can hold the
/// harness to reaching the code it is for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecOutcome {
    /// The bytes decoded as an `ApplyServiceRequest`.
    pub decoded: bool,
    /// Of the two revisions replicas (a strict registry policy, and
    /// `berth dev`'s), how many accepted it.
    pub accepted: usize,
    /// How many refused it `INVALID_ARGUMENT`.
    pub refused: usize,
    /// The bytes read as a JSON spec.
    pub json: bool,
    /// The bytes read as a YAML spec, and that YAML as a JSON value.
    pub yaml: bool,
}

/// What one `egress_objects` input came to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EgressOutcome {
    /// Messages decoded as a gateway or a route (one frame may be both).
    pub decoded: usize,
    /// Gateways the egress service accepted.
    pub gateways: usize,
    /// Routes it accepted.
    pub routes: usize,
    /// Applies it refused `INVALID_ARGUMENT`.
    pub refused: usize,
    /// Services whose `EgressReady` holds in the compiled plans.
    pub ready: usize,
    /// Destinations allowed or denied across the compiled plans' services.
    pub destinations: usize,
}

/// The parser behind `berth service apply -f` as far as a library reaches
/// it, and the revisions service's `ApplyService`; see the module docs.
pub fn service_spec(data: &[u8]) {
    let _ = service_spec_outcome(data);
}

/// [`service_spec`], saying what the input came to.
pub fn service_spec_outcome(data: &[u8]) -> SpecOutcome {
    let mut outcome = SpecOutcome::default();
    if let Ok(request) = revisions::ApplyServiceRequest::decode(data) {
        outcome.decoded = true;
        with_harness(|harness| {
            for service in [&harness.revisions_strict, &harness.revisions_dev] {
                let answer = harness.runtime.block_on(service.apply_service(harness.request(request.clone())));
                match answer {
                    Ok(_) => outcome.accepted += 1,
                    Err(status) => outcome.refused += refused_as_invalid(&status, "ApplyService"),
                }
            }
            harness.accepted += outcome.accepted;
        });
    }
    // The CLI reads the file as text; bytes that are not UTF-8 stop there.
    if let Ok(text) = std::str::from_utf8(data) {
        outcome.json = serde_json::from_str::<serde_json::Value>(text).is_ok();
        if let Ok(yaml) = serde_yaml_ng::from_str::<serde_yaml_ng::Value>(text) {
            outcome.yaml = serde_json::to_value(yaml).is_ok();
        }
    }
    outcome
}

/// Egress gateways and routes through the egress service's checks, and what
/// it accepted through the compile; see the module docs.
pub fn egress_objects(data: &[u8]) {
    let _ = egress_objects_outcome(data);
}

/// [`egress_objects`], saying what the input came to.
pub fn egress_objects_outcome(data: &[u8]) -> EgressOutcome {
    let mut outcome = EgressOutcome::default();
    // Per project, by name, as the catalog keeps them: a later apply of a
    // name replaces the earlier.
    let mut gateways: BTreeMap<String, BTreeMap<String, egress::EgressGateway>> = BTreeMap::new();
    let mut routes: BTreeMap<String, BTreeMap<String, egress::EgressRoute>> = BTreeMap::new();
    let frames = frames(data);
    with_harness(|harness| {
        for frame in frames {
            if let Ok(gateway) = egress::EgressGateway::decode(frame) {
                outcome.decoded += 1;
                let request = egress::ApplyGatewayRequest {
                    project: gateway.project,
                    name: gateway.name,
                    listeners: gateway.listeners,
                };
                match harness.runtime.block_on(harness.egress.apply_gateway(harness.request(request))) {
                    Ok(answer) => {
                        if let Some(gateway) = answer.into_inner().gateway {
                            outcome.gateways += 1;
                            let project = gateways.entry(gateway.project.clone()).or_default();
                            project.insert(gateway.name.clone(), gateway);
                        }
                    }
                    Err(status) => outcome.refused += refused_as_invalid(&status, "ApplyGateway"),
                }
            }
            if let Ok(route) = egress::EgressRoute::decode(frame) {
                outcome.decoded += 1;
                let request = egress::ApplyRouteRequest {
                    project: route.project,
                    name: route.name,
                    parent_refs: route.parent_refs,
                    hostnames: route.hostnames,
                    ports: route.ports,
                    action: route.action,
                };
                match harness.runtime.block_on(harness.egress.apply_route(harness.request(request))) {
                    Ok(answer) => {
                        if let Some(route) = answer.into_inner().route {
                            outcome.routes += 1;
                            routes.entry(route.project.clone()).or_default().insert(route.name.clone(), route);
                        }
                    }
                    Err(status) => outcome.refused += refused_as_invalid(&status, "ApplyRoute"),
                }
            }
        }
        harness.accepted += outcome.gateways + outcome.routes;
    });
    let projects: std::collections::BTreeSet<&String> = gateways.keys().chain(routes.keys()).collect();
    for project in projects {
        let gateways: Vec<GatewaySpec> =
            gateways.get(project).into_iter().flat_map(|g| g.values()).map(gateway_spec).collect();
        let routes: Vec<RouteSpec> = routes.get(project).into_iter().flat_map(|r| r.values()).map(route_spec).collect();
        let mut services = vec![
            ServiceInput { service: "on-default".into(), selection: Selection::from_proto(None) },
            ServiceInput { service: "on-missing".into(), selection: Selection::Gateway("no-such-gateway".into()) },
            ServiceInput { service: "disabled".into(), selection: Selection::Disabled },
        ];
        for (n, gateway) in gateways.iter().enumerate() {
            services
                .push(ServiceInput { service: format!("on-{n}"), selection: Selection::Gateway(gateway.name.clone()) });
        }
        let inputs = PlanInputs { services, gateways, routes };
        let plan = berth_egress::compile(&inputs);
        let mut reversed = inputs.clone();
        reversed.services.reverse();
        reversed.gateways.reverse();
        reversed.routes.reverse();
        assert!(berth_egress::compile(&reversed) == plan, "the compile of project {project} depends on input order");
        outcome.ready += plan.services.iter().filter(|s| s.readiness.holds()).count();
        outcome.destinations +=
            plan.services.iter().map(|s| s.destinations.allowed.len() + s.destinations.denied.len()).sum::<usize>();
    }
    outcome
}

/// `data` as a sequence of length-delimited messages, when it reads as one
/// whole; else `data` as a single message.
fn frames(data: &[u8]) -> Vec<&[u8]> {
    let mut frames = Vec::new();
    let mut rest = data;
    while !rest.is_empty() {
        let mut cursor = rest;
        let Ok(length) = prost::encoding::decode_varint(&mut cursor) else { return vec![data] };
        let Some(length) = usize::try_from(length).ok().filter(|length| *length <= cursor.len()) else {
            return vec![data];
        };
        frames.push(&cursor[..length]);
        rest = &cursor[length..];
    }
    if frames.is_empty() { vec![data] } else { frames }
}

/// A gateway the service accepted, as its full pass reads a stored one.
fn gateway_spec(gateway: &egress::EgressGateway) -> GatewaySpec {
    GatewaySpec {
        name: gateway.name.clone(),
        generation: gateway.generation,
        listeners: gateway
            .listeners
            .iter()
            .map(|l| {
                let protocol = Protocol::from_proto(l.protocol);
                let port = u16::try_from(l.port).ok();
                let (Some(protocol), Some(port)) = (protocol, port) else {
                    panic!("ApplyGateway accepted listener {l:?}, which the compile cannot read");
                };
                ListenerSpec { name: l.name.clone(), protocol, port }
            })
            .collect(),
    }
}

/// A route the service accepted, as its full pass reads a stored one.
fn route_spec(route: &egress::EgressRoute) -> RouteSpec {
    let accepted_but = |what: String| -> ! { panic!("ApplyRoute accepted {what}, which the compile cannot read") };
    RouteSpec {
        name: route.name.clone(),
        generation: route.generation,
        parents: route.parent_refs.iter().map(ParentSpec::from_proto).collect(),
        hostnames: route
            .hostnames
            .iter()
            .map(|h| HostPattern::parse(h).unwrap_or_else(|e| accepted_but(format!("host name {h:?} ({e})"))))
            .collect(),
        ports: route
            .ports
            .iter()
            .map(|p| u16::try_from(*p).unwrap_or_else(|_| accepted_but(format!("port {p}"))))
            .collect(),
        action: RouteAction::from_proto(route.action)
            .unwrap_or_else(|| accepted_but(format!("action {}", route.action))),
    }
}

/// 1 when `status` is the `INVALID_ARGUMENT` of a refused request; any
/// other failure means input the checks passed failed further in.
fn refused_as_invalid(status: &tonic::Status, call: &str) -> usize {
    assert!(
        status.code() == tonic::Code::InvalidArgument,
        "{call} let an input through its checks and then failed: {:?}: {}",
        status.code(),
        status.message()
    );
    1
}

/// Accepted applies after which the harness starts over on fresh stores, so
/// that a long fuzzing run does not grow its databases without end.
const FRESH_STORES_AFTER: usize = 20_000;

/// The revisions and egress services the request targets drive, each on a
/// migrated SQLite file of its own and the in-process bus, with a runtime to
/// drive them; made once per process (and again after
/// [`FRESH_STORES_AFTER`] accepted applies). Revisions runs twice over one
/// store: with the default registry policy, and with `berth dev`'s (layout
/// directories allowed, one insecure registry listed), so both sides of the
/// policy's checks are reached. Tags resolve to nothing, pinned references to
/// their digest: no registry is spoken to. Every request arrives as an
/// admin's, as the CLI sends it.
#[derive(Debug)]
struct Harness {
    runtime: tokio::runtime::Runtime,
    revisions_strict: RevisionsService,
    revisions_dev: RevisionsService,
    egress: EgressService,
    admin: Identity,
    /// Applies accepted since it was made.
    accepted: usize,
    _dir: tempfile::TempDir,
}

impl Harness {
    fn new() -> Harness {
        let fail =
            |what: &str, error: &dyn std::fmt::Display| -> ! { panic!("the fuzz harness needs {what}: {error}") };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| fail("a runtime", &e));
        let dir = tempfile::Builder::new().prefix("berth-fuzz-").tempdir().unwrap_or_else(|e| fail("a directory", &e));
        let admin = Identity::admin("fuzz").unwrap_or_else(|e| fail("an admin identity", &e));
        let credentials = credentials().unwrap_or_else(|e| fail("credentials", &e));
        let (revisions_strict, revisions_dev, egress) = runtime.block_on(async {
            let context = |store: Store| {
                ServiceContext::new(
                    store,
                    berth_bus::Bus::new(berth_bus::MemoryBus::new(), "fuzz").unwrap_or_else(|e| fail("a bus", &e)),
                    credentials.clone(),
                )
            };
            let revisions_store = store(dir.path(), "revisions", berth_revisions::MIGRATIONS).await;
            let egress_store = store(dir.path(), "egress", berth_egress::MIGRATIONS).await;
            let config = RevisionsConfig::default();
            let dependencies = |policy: RegistryPolicy| Dependencies {
                leases: Arc::new(NoLeases),
                resolver: Arc::new(PinnedOnly),
                policy,
                secrets: RegistrySecrets::none(),
            };
            let dev_policy = RegistryPolicy {
                insecure_registries: vec!["registry.internal:5000".into()],
                ca_pem: None,
                allow_layouts: true,
                mirrors: Vec::new(),
            };
            let revisions_context = context(revisions_store);
            (
                RevisionsService::new(&revisions_context, config.clone(), dependencies(RegistryPolicy::default())),
                RevisionsService::new(&revisions_context, config, dependencies(dev_policy)),
                EgressService::new(&context(egress_store), EgressConfig::default(), Sources::none()),
            )
        });
        Harness { runtime, revisions_strict, revisions_dev, egress, admin, accepted: 0, _dir: dir }
    }

    /// `message` as an admin's call would carry it.
    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        let peer = PeerInfo {
            remote_addr: ([127, 0, 0, 1], 40_000).into(),
            identity: Some(self.admin.clone()),
            issued_at: None,
            expires_at: None,
        };
        request.extensions_mut().insert(peer);
        request
    }
}

/// Runs `body` on the process's harness, made first when there is none (or
/// it has taken enough applies); one input at a time.
fn with_harness(body: impl FnOnce(&mut Harness)) {
    static HARNESS: Mutex<Option<Harness>> = Mutex::new(None);
    let mut held = HARNESS.lock().unwrap_or_else(PoisonError::into_inner);
    if held.as_ref().is_none_or(|harness| harness.accepted >= FRESH_STORES_AFTER) {
        *held = None;
        *held = Some(Harness::new());
    }
    if let Some(harness) = held.as_mut() {
        body(harness);
    }
}

/// A migrated SQLite store in `dir`.
async fn store(dir: &Path, name: &str, migrations: &[berth_store::Migration]) -> Store {
    let url = format!("sqlite://{}", dir.join(format!("{name}.db")).display());
    let store = match Store::connect_with(&url, name, StoreOptions::default()).await {
        Ok(store) => store,
        Err(error) => panic!("the fuzz harness needs a {name} store: {error}"),
    };
    if let Err(error) = store.migrate(migrations).await {
        panic!("the fuzz harness needs the {name} schema: {error}");
    }
    // A throwaway file: a commit need not wait for the disk. (The store's
    // one connection keeps the setting; a reconnect only costs speed.)
    if let Err(error) = sqlx::query("PRAGMA synchronous = OFF").execute(store.pool()).await {
        panic!("the fuzz harness cannot tune its {name} store: {error}");
    }
    store
}

/// The certificate a service context carries (the handlers are called
/// directly, so it is never presented).
fn credentials() -> Result<TlsCredentials, Box<dyn std::error::Error>> {
    let identity = Identity::service("revisions")?;
    let (certificate, key_pem) = authority().issue(&identity, &[], Duration::from_secs(3600))?;
    Ok(TlsCredentials::new(TlsMaterial {
        cert_chain_pem: certificate.cert_pem,
        key_pem,
        ca_bundle_pem: authority().cert_pem().to_owned(),
    })?)
}

/// Resolves pinned references (`...@sha256:...`) to their digest and no tag.
#[derive(Debug)]
struct PinnedOnly;

#[tonic::async_trait]
impl TagResolver for PinnedOnly {
    async fn resolve(&self, bundle: &BundleRef) -> Result<Digest, ResolveError> {
        let pinned = bundle.reference.rsplit_once('@').and_then(|(_, digest)| digest.parse::<Digest>().ok());
        pinned.ok_or_else(|| ResolveError::TagNotFound("the fuzz harness resolves no tags".into()))
    }
}
