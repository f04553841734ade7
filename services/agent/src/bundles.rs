//! The node's bundles: each bundle lease's code pulled by digest into the
//! node's [`BundleCache`], and, per tenant, which bundle each
//! `<service>:<revision>` runs, so the replicas of a revision resolve to a
//! ready-to-run definition without the network.
//!
//! # What is stored
//! `DATA_DIR/bundles/` is the [`BundleCache`]: only what can be pulled again.
//!
//! # Expected flow
//! A bundle lease arrives BOUND and its worker starts [`BundleStore::warm`]
//! at once, before it reports LAUNCHING, so the pull overlaps the report.
//! The pull is by digest only: the lease's digest pinned onto its bundle
//! reference's repository (`host/repo@sha256:…` or `oci:DIR@sha256:…`). The
//! cache verifies every blob and extracts safely; a bundle already present
//! is used as it is, and two leases of one digest pull it once. A warm that
//! fails fails the launch, with a reason ([`BundleError::reason`]) and a
//! message naming the digest and the cause. The worker holds the
//! [`ReadyBundle`] for as long as it runs the lease, which keeps the bundle
//! from eviction; bundles no lease holds are evicted past the budget after
//! each pull and on every sweep.
//!
//! # Tenants
//! The cache is shared by content; what a tenant may run is not. A tenant's
//! lease runs a bundle only once the node has fetched it, or at least its
//! manifest and config, through that tenant's own reference: otherwise
//! naming a digest another tenant pulled would be enough to run that
//! tenant's private code. After that the tenant's later leases of the digest
//! need no registry at all. What each tenant fetched is kept in memory: after
//! an agent restart the workloads it adopts count as fetched, and anything
//! else is checked against the registry again.
//!
//! # Credentials
//! A lease names registry credentials by `secret`; nodes hold none. When a
//! pull of such a lease needs the registry, the node asks revisions for
//! them for that lease ([`PullCredentials`], see `credentials`), uses them
//! for that pull alone, only with the registry revisions names (which must
//! be the lease's), and only before they expire. A lease without a secret
//! pulls anonymously, and so does one on a node with no revisions address
//! configured. Every way this fails fails the launch with a reason a user
//! can match on: `BundleUnauthorized` when revisions refuses, when the
//! registry refuses what was sent (or, with no revisions address, wants
//! credentials); `BundleUnavailable` when revisions cannot be reached.
//!
//! # Running a bundle
//! - The program is the bundle's entrypoint, or the lease's `command` when it
//!   sets one: an absolute path on the node, or a path inside the bundle (a
//!   bare name that is not a file of the bundle is looked up in `PATH`). A
//!   path inside the bundle that resolves outside it is refused.
//! - Arguments: the lease's when it gives any; none when it sets its own
//!   `command` without arguments; the bundle's otherwise.
//! - Environment: the bundle's, the lease's over it, then `BERTH_BUNDLE_DIR`
//!   (the extracted bundle) and `BERTH_BUNDLE_DIGEST`.
//! - Ports: the lease's named ports, or the bundle's when the lease names
//!   none; each gets a port on the host (see [`crate::process`]).
//! - The working directory is the lease's own, not the bundle: an extracted
//!   bundle is shared by every lease of its digest on the node and stays as
//!   it was verified, so a workload reads its files through
//!   `BERTH_BUNDLE_DIR` (or its program's own path) and writes only to its
//!   working directory, which goes away with the instance.

use std::collections::{HashMap, HashSet};
use std::path::{Component, Path};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::SystemTime;

use berth_bundle::{
    BundleCache, BundleClient, BundleDefinition, BundleReference, CacheError, Digest, ImageRun, ImageUser, ReadyBundle,
    RegistryCredentials, RegistryError,
};
use berth_proto::artifact::ArtifactKind;
use berth_proto::leases::v1::Lease;

use self::credentials::CredentialsError;
pub(crate) use self::credentials::{GrpcPullCredentials, PullCredentials};
use crate::provider::{LaunchSpec, Program, WorkloadRoot};

mod credentials;

/// The variable naming the bundle's digest.
pub(crate) const BUNDLE_DIGEST_VAR: &str = "BERTH_BUNDLE_DIGEST";

/// The tenant an empty project means.
const DEFAULT_PROJECT: &str = "default";

/// Why a lease's bundle cannot be run.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BundleError {
    /// The lease's bundle reference or digest cannot be used.
    #[error("bundle {digest} at `{reference}` cannot be pulled: {reason}")]
    InvalidReference {
        /// The reference as the lease gives it.
        reference: String,
        /// The digest as the lease gives it.
        digest: String,
        /// What is wrong.
        reason: String,
    },
    /// Fetching, verifying or extracting the bundle failed.
    #[error("cannot pull bundle {digest} from {reference}: {source}")]
    Pull {
        /// The bundle.
        digest: Digest,
        /// Where it was pulled from, pinned to the digest.
        reference: String,
        /// Why.
        #[source]
        source: Box<CacheError>,
    },
    /// The bundle is in the cache, but the tenant's own reference to it
    /// could not be read.
    #[error("cannot pull bundle {digest} from {reference}: {source}")]
    Access {
        /// The bundle.
        digest: Digest,
        /// Where it was looked for, pinned to the digest.
        reference: String,
        /// Why.
        #[source]
        source: Box<RegistryError>,
    },
    /// The registry credentials the lease names could not be had.
    #[error("cannot pull bundle {digest} from {reference}: Unauthorized: the credentials `{secret}`: {why}")]
    Credentials {
        /// The bundle.
        digest: Digest,
        /// Where it was pulled from.
        reference: String,
        /// The credentials the lease names.
        secret: String,
        /// Why they could not be had.
        why: String,
        /// Whether asking again later may succeed.
        transient: bool,
    },
    /// The program to run is not in the bundle, or leads out of it.
    #[error("bundle {digest}: {field} `{path}` {reason}")]
    Program {
        /// The bundle.
        digest: Digest,
        /// `entrypoint` (the bundle's) or `command` (the lease's).
        field: &'static str,
        /// The program as given.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The lease names a bundle and the digest is an image, or the other way round.
    #[error("{reference} is {is}; run it as the lease's {named} it is not")]
    Kind {
        /// The digest.
        digest: Digest,
        /// Where it was pulled from.
        reference: String,
        /// `bundle` or `image`: what the lease names it as.
        named: &'static str,
        /// What it is.
        is: &'static str,
    },
    /// The cache could not be read or written.
    #[error("bundle cache: {0}")]
    Cache(#[source] Box<CacheError>),
}

impl BundleError {
    /// The lease phase reason, one CamelCase word, for a launch this failed.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            BundleError::InvalidReference { .. } => "BundleInvalid",
            BundleError::Pull { source, .. } => cache_reason(source),
            BundleError::Access { source, .. } => registry_reason(source),
            BundleError::Credentials { transient: true, .. } => "BundleUnavailable",
            BundleError::Credentials { .. } => "BundleUnauthorized",
            BundleError::Program { field: "command", .. } => "InvalidCommand",
            BundleError::Program { .. } | BundleError::Kind { .. } => "BundleInvalid",
            BundleError::Cache(_) => "NodeError",
        }
    }
}

fn cache_reason(error: &CacheError) -> &'static str {
    match error {
        CacheError::Fetch(source) => registry_reason(source),
        CacheError::NotPinned { .. }
        | CacheError::NotABundle { .. }
        | CacheError::NotAnImage { .. }
        | CacheError::Unsafe { .. }
        | CacheError::ModuleMismatch { .. } => "BundleInvalid",
        CacheError::Io { .. } => "NodeError",
    }
}

fn registry_reason(error: &RegistryError) -> &'static str {
    match error {
        RegistryError::TagNotFound { .. }
        | RegistryError::ManifestNotFound { .. }
        | RegistryError::BlobNotFound { .. } => "BundleNotFound",
        RegistryError::Unauthorized { .. } => "BundleUnauthorized",
        RegistryError::RegistryUnavailable { .. } | RegistryError::Refused { .. } => "BundleUnavailable",
        RegistryError::DigestMismatch { .. } => "BundleDigestMismatch",
        RegistryError::TooLarge { .. } | RegistryError::NotABundle { .. } | RegistryError::InvalidReference { .. } => {
            "BundleInvalid"
        }
        RegistryError::Layout { .. } | RegistryError::Config(_) => "NodeError",
    }
}

/// What a bundle lease asks of the node's bundles.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BundleAsk {
    /// The lease, by which revisions hands out its registry credentials.
    pub(crate) lease_id: String,
    /// The tenant.
    pub(crate) project: String,
    /// The service, when the lease is a replica of one.
    pub(crate) service: String,
    /// The revision, when the lease is a replica of one.
    pub(crate) revision: String,
    /// The bundle reference as the lease gives it.
    pub(crate) reference: String,
    /// The digest the lease pins, `sha256:<hex>`.
    pub(crate) digest: String,
    /// Whether the registry is spoken to over plain HTTP.
    pub(crate) insecure: bool,
    /// The registry credentials the lease names; empty for none.
    pub(crate) secret: String,
    /// Whether the lease names a container image rather than a bundle.
    pub(crate) image: bool,
}

impl BundleAsk {
    /// What `lease` asks for, when it runs a bundle.
    pub(crate) fn of(lease: &Lease) -> Option<Self> {
        let workload = lease.workload.as_ref()?;
        let artifact = workload.artifact()?;
        let bundle = artifact.reference;
        Some(Self {
            lease_id: lease.lease_id.clone(),
            project: lease.project.clone(),
            service: workload.service.clone(),
            revision: workload.revision.clone(),
            reference: bundle.reference.clone(),
            digest: workload.digest.clone(),
            insecure: bundle.insecure,
            secret: bundle.secret.clone(),
            image: artifact.kind == ArtifactKind::Image,
        })
    }

    /// The digest, and the reference pinned to it.
    fn pinned(&self) -> Result<(Digest, BundleReference), BundleError> {
        let invalid = |reason: String| BundleError::InvalidReference {
            reference: self.reference.clone(),
            digest: self.digest.clone(),
            reason,
        };
        let digest: Digest = self.digest.parse().map_err(|e| invalid(format!("the digest is not usable: {e}")))?;
        let reference = BundleReference::parse(&self.reference).map_err(|e| invalid(e.to_string()))?;
        if let Some(pinned) = reference.digest()
            && pinned != &digest
        {
            return Err(invalid(format!("the reference is pinned to {pinned}, not to the lease's digest")));
        }
        Ok((digest.clone(), reference.pinned(&digest)))
    }
}

/// The node's bundle cache and what each tenant may run from it; cheap to
/// clone, clones share state.
#[derive(Debug, Clone)]
pub(crate) struct BundleStore {
    inner: Arc<StoreInner>,
}

#[derive(Debug)]
struct StoreInner {
    cache: BundleCache,
    client: BundleClient,
    /// Where registry credentials come from; `None` when no revisions
    /// address is configured.
    credentials: Option<Arc<dyn PullCredentials>>,
    tenants: Mutex<HashMap<String, Tenant>>,
    /// One fetch per digest at a time: a second lease of a digest being
    /// pulled waits for the first, then finds it in the cache.
    turns: Mutex<HashMap<Digest, Arc<tokio::sync::Mutex<()>>>>,
}

/// What one tenant runs.
#[derive(Debug, Default)]
struct Tenant {
    /// `<service>:<revision>` → the bundle it runs.
    revisions: HashMap<String, Digest>,
    /// Digests the node fetched through this tenant's own references.
    fetched: HashSet<Digest>,
}

fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every change under these locks is a single insert or remove.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl BundleStore {
    /// A store over `cache`, pulling with `client`, with no way to registry
    /// credentials.
    #[cfg(test)]
    pub(crate) fn new(cache: BundleCache, client: BundleClient) -> Self {
        Self::with_credentials(cache, client, None)
    }

    /// A store over `cache`, pulling with `client` and, for leases that
    /// name registry credentials, with what `credentials` hands out.
    pub(crate) fn with_credentials(
        cache: BundleCache,
        client: BundleClient,
        credentials: Option<Arc<dyn PullCredentials>>,
    ) -> Self {
        Self {
            inner: Arc::new(StoreInner {
                cache,
                client,
                credentials,
                tenants: Mutex::new(HashMap::new()),
                turns: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// The registry client the node pulls with, for other artifacts it moves
    /// (cache volume generations).
    pub(crate) fn client(&self) -> &BundleClient {
        &self.inner.client
    }

    /// The bundle the tenant's `<service>:<revision>` runs, pinned, when the
    /// node has it; never touches the network.
    pub(crate) async fn resolve(
        &self,
        project: &str,
        service: &str,
        revision: &str,
    ) -> Result<Option<ReadyBundle>, BundleError> {
        let Some(key) = revision_key(service, revision) else { return Ok(None) };
        let digest = locked(&self.inner.tenants).get(tenant_name(project)).and_then(|t| t.revisions.get(&key).cloned());
        match digest {
            Some(digest) => self.inner.cache.get(&digest).await.map_err(cache_error),
            None => Ok(None),
        }
    }

    /// Makes the lease's bundle ready to run: from what the tenant already
    /// has, or pulled (see the module docs).
    pub(crate) async fn warm(&self, ask: &BundleAsk) -> Result<ReadyBundle, BundleError> {
        let (digest, reference) = ask.pinned()?;
        if let Some(ready) = self.resolve(&ask.project, &ask.service, &ask.revision).await?
            && ready.definition().digest == digest
        {
            return Ok(ready);
        }
        if let Some(ready) = self.fetched(&ask.project, &digest).await? {
            self.remember(&ask.project, &ask.service, &ask.revision, &digest);
            return Ok(ready);
        }
        let _turn = self.turn(&digest).await;
        // Another lease of this tenant may have fetched it while this one waited.
        if let Some(ready) = self.fetched(&ask.project, &digest).await? {
            self.remember(&ask.project, &ask.service, &ask.revision, &digest);
            return Ok(ready);
        }
        let client = match &reference {
            BundleReference::Registry(registry) if ask.insecure => {
                self.inner.client.clone().with_insecure_registry(registry.registry())
            }
            _ => self.inner.client.clone(),
        };
        let shown = reference.to_string();
        let credentials = self.credentials(ask, &digest, &reference).await?;
        let ready = match self.inner.cache.get(&digest).await.map_err(cache_error)? {
            Some(ready) => {
                // Another tenant brought it here: this one shows it may read it.
                client.check_readable(&reference, &credentials).await.map_err(|source| match source {
                    RegistryError::Unauthorized { .. } if self.no_way_to(ask) => no_revisions(ask, &digest, &shown),
                    source => BundleError::Access {
                        digest: digest.clone(),
                        reference: shown.clone(),
                        source: Box::new(source),
                    },
                })?;
                ready
            }
            None => self.inner.cache.pull(&client, &reference, &credentials).await.map_err(|source| match source {
                CacheError::Fetch(RegistryError::Unauthorized { .. }) if self.no_way_to(ask) => {
                    no_revisions(ask, &digest, &shown)
                }
                source => {
                    BundleError::Pull { digest: digest.clone(), reference: shown.clone(), source: Box::new(source) }
                }
            })?,
        };
        drop(credentials);
        if ready.definition().image.is_some() != ask.image {
            let (named, is) = if ask.image { ("image", "a berth bundle") } else { ("bundle", "a container image") };
            return Err(BundleError::Kind { digest, reference: shown, named, is });
        }
        self.remember(&ask.project, &ask.service, &ask.revision, &digest);
        tracing::info!(project = %tenant_name(&ask.project), service = %ask.service, revision = %ask.revision,
            %digest, root = %ready.definition().root.display(), "bundle ready");
        Ok(ready)
    }

    /// What to send the registry for `ask`'s pull of `reference`:
    /// nothing for a lease that names no credentials (or a layout
    /// directory), else what revisions hands out for the lease (see the
    /// module docs).
    async fn credentials(
        &self,
        ask: &BundleAsk,
        digest: &Digest,
        reference: &BundleReference,
    ) -> Result<RegistryCredentials, BundleError> {
        let BundleReference::Registry(registry) = reference else { return Ok(RegistryCredentials::Anonymous) };
        if ask.secret.is_empty() {
            return Ok(RegistryCredentials::Anonymous);
        }
        let refuse = |why: String, transient: bool| BundleError::Credentials {
            digest: digest.clone(),
            reference: reference.to_string(),
            secret: ask.secret.clone(),
            why,
            transient,
        };
        // With nowhere to ask, try without: the registry may not want them.
        let Some(source) = &self.inner.credentials else { return Ok(RegistryCredentials::Anonymous) };
        let issued = source
            .fetch(&ask.lease_id)
            .await
            .map_err(|error| refuse(error.to_string(), matches!(error, CredentialsError::Unavailable(_))))?;
        if !issued.registry.eq_ignore_ascii_case(registry.registry()) {
            return Err(refuse(
                format!(
                    "revisions gave them for registry {}, not {}; they were not sent",
                    issued.registry,
                    registry.registry()
                ),
                false,
            ));
        }
        if issued.expires_at <= SystemTime::now() {
            return Err(refuse("revisions gave them already expired".into(), true));
        }
        tracing::debug!(lease = %ask.lease_id, secret = %ask.secret, registry = %issued.registry,
            "pulling with registry credentials from revisions");
        Ok(issued.credentials)
    }

    /// Whether `ask` names credentials this node has nowhere to ask for.
    fn no_way_to(&self, ask: &BundleAsk) -> bool {
        !ask.secret.is_empty() && self.inner.credentials.is_none()
    }

    /// Pins the bundle of a workload found running after a restart, and
    /// counts it as fetched by its tenant; `None` when the node no longer
    /// has it.
    pub(crate) async fn adopt(
        &self,
        project: &str,
        service: &str,
        revision: &str,
        digest: &str,
    ) -> Option<ReadyBundle> {
        let digest: Digest = digest.parse().ok()?;
        match self.inner.cache.get(&digest).await {
            Ok(Some(ready)) => {
                self.remember(project, service, revision, &digest);
                Some(ready)
            }
            Ok(None) => None,
            Err(error) => {
                tracing::warn!(%digest, %error, "cannot look up the bundle of an adopted workload");
                None
            }
        }
    }

    /// Evicts bundles no lease holds, past the cache's budget.
    pub(crate) async fn evict(&self) {
        match self.inner.cache.evict().await {
            Ok(report) if report.over_budget => {
                tracing::warn!("the bundle cache is over its budget: every bundle left in it is in use");
            }
            Ok(_) => {}
            Err(error) => tracing::warn!(%error, "cannot evict from the bundle cache"),
        }
    }

    /// The bundle when this tenant fetched it before and the cache still has it.
    async fn fetched(&self, project: &str, digest: &Digest) -> Result<Option<ReadyBundle>, BundleError> {
        let known = locked(&self.inner.tenants).get(tenant_name(project)).is_some_and(|t| t.fetched.contains(digest));
        if !known {
            return Ok(None);
        }
        self.inner.cache.get(digest).await.map_err(cache_error)
    }

    /// Records that the tenant fetched `digest` and that its
    /// `<service>:<revision>` runs it.
    fn remember(&self, project: &str, service: &str, revision: &str, digest: &Digest) {
        let mut tenants = locked(&self.inner.tenants);
        let tenant = tenants.entry(tenant_name(project).to_string()).or_default();
        tenant.fetched.insert(digest.clone());
        if let Some(key) = revision_key(service, revision) {
            tenant.revisions.insert(key, digest.clone());
        }
    }

    /// Waits until no other fetch of `digest` is under way, and holds it off
    /// until the returned turn is dropped.
    async fn turn(&self, digest: &Digest) -> FetchTurn {
        let lock = locked(&self.inner.turns).entry(digest.clone()).or_default().clone();
        let guard = lock.lock_owned().await;
        FetchTurn { inner: self.inner.clone(), digest: digest.clone(), guard: Some(guard) }
    }
}

/// One fetch's turn at a digest.
struct FetchTurn {
    inner: Arc<StoreInner>,
    digest: Digest,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl Drop for FetchTurn {
    fn drop(&mut self) {
        self.guard.take();
        let mut turns = locked(&self.inner.turns);
        // Only the map holds it: no fetch waits for this digest any more.
        if turns.get(&self.digest).is_some_and(|lock| Arc::strong_count(lock) == 1) {
            turns.remove(&self.digest);
        }
    }
}

fn cache_error(error: CacheError) -> BundleError {
    BundleError::Cache(Box::new(error))
}

fn no_revisions(ask: &BundleAsk, digest: &Digest, reference: &str) -> BundleError {
    BundleError::Credentials {
        digest: digest.clone(),
        reference: reference.to_string(),
        secret: ask.secret.clone(),
        why: "the registry wants them, and this node has no revisions address to ask for them \
              (--revisions-addr, BERTH_REVISIONS_ADDR)"
            .to_string(),
        transient: false,
    }
}

fn tenant_name(project: &str) -> &str {
    if project.is_empty() { DEFAULT_PROJECT } else { project }
}

fn revision_key(service: &str, revision: &str) -> Option<String> {
    (!service.is_empty() && !revision.is_empty()).then(|| format!("{service}:{revision}"))
}

/// `spec` (what the lease says) made into what runs the bundle of
/// `definition`, by the rules in the module docs.
pub(crate) fn bundle_spec(definition: &BundleDefinition, mut spec: LaunchSpec) -> Result<LaunchSpec, BundleError> {
    if let Some(run) = &definition.image {
        return image_spec(definition, run, spec);
    }
    for (field, value) in [("working_dir", &spec.image.working_dir), ("user", &spec.image.user)] {
        if !value.is_empty() {
            return Err(BundleError::Program {
                digest: definition.digest.clone(),
                field,
                path: value.clone(),
                reason: "applies only to a container image, and this is a bundle".into(),
            });
        }
    }
    let program = match &spec.program {
        Program::Command(command) => lease_command(definition, command)?,
        Program::Entrypoint | Program::Bundled(_) => {
            if spec.args.is_empty() {
                spec.args = definition.args.clone();
            }
            entrypoint(definition)?
        }
    };
    let mut env = definition.env.clone();
    env.extend(std::mem::take(&mut spec.env));
    env.insert(BUNDLE_DIGEST_VAR.to_string(), definition.digest.to_string());
    if spec.ports.is_empty() {
        spec.ports = definition.ports.iter().map(|port| port.name.clone()).collect();
    }
    spec.root = WorkloadRoot::Bundle { dir: definition.root.clone(), digest: definition.digest.to_string() };
    spec.program = program;
    spec.env = env;
    Ok(spec)
}

/// `spec` made into what runs the container image of `definition`: the
/// lease's `command` replaces the image's Entrypoint and its `args` the
/// image's Cmd (a `command` alone runs without the Cmd), as Kubernetes
/// does; the lease's env is laid over the image's; the lease's working
/// directory and user, where it gives them, replace the image's (a user is
/// looked up in the image as the image's own is, see [`ImageUser`]).
fn image_spec(definition: &BundleDefinition, run: &ImageRun, mut spec: LaunchSpec) -> Result<LaunchSpec, BundleError> {
    let args = std::mem::take(&mut spec.args);
    let mut argv: Vec<String> = match &spec.program {
        Program::Command(command) => std::iter::once(command.clone()).chain(args).collect(),
        Program::Entrypoint | Program::Bundled(_) if args.is_empty() => {
            run.entrypoint.iter().chain(&run.cmd).cloned().collect()
        }
        Program::Entrypoint | Program::Bundled(_) => run.entrypoint.iter().cloned().chain(args).collect(),
    };
    if argv.first().is_none_or(|program| program.trim().is_empty()) {
        return Err(BundleError::Program {
            digest: definition.digest.clone(),
            field: "entrypoint",
            path: String::new(),
            reason: "is empty: the image names no Entrypoint nor Cmd, and the lease no command".into(),
        });
    }
    let program = argv.remove(0);
    let mut env = run.env.clone();
    env.extend(std::mem::take(&mut spec.env));
    env.insert(BUNDLE_DIGEST_VAR.to_string(), definition.digest.to_string());
    let overrides = std::mem::take(&mut spec.image);
    let account = if overrides.user.is_empty() {
        run.account.clone()
    } else {
        ImageUser::resolve(&overrides.user, &definition.root, &run.owners)
            .map_err(|reason| BundleError::Program {
                digest: definition.digest.clone(),
                field: "user",
                path: overrides.user.clone(),
                reason: format!("cannot be used: {reason}"),
            })?
            .map(Arc::new)
    };
    let working_dir = if overrides.working_dir.is_empty() { run.working_dir.clone() } else { overrides.working_dir };
    spec.root = WorkloadRoot::Image {
        dir: definition.root.clone(),
        digest: definition.digest.to_string(),
        working_dir,
        account,
    };
    spec.program = Program::Command(program);
    spec.args = argv;
    spec.env = env;
    Ok(spec)
}

/// The bundle's own program.
fn entrypoint(definition: &BundleDefinition) -> Result<Program, BundleError> {
    let path = &definition.entrypoint;
    if !path.starts_with(&definition.root) {
        // An absolute path on the node, as the bundle says.
        return Ok(Program::Command(path.display().to_string()));
    }
    let shown = path.strip_prefix(&definition.root).unwrap_or(path).display().to_string();
    inside(definition, "entrypoint", path, &shown)
}

/// The lease's own program, run with the bundle.
fn lease_command(definition: &BundleDefinition, command: &str) -> Result<Program, BundleError> {
    let path = Path::new(command);
    if path.is_absolute() {
        return Ok(Program::Command(command.to_string()));
    }
    let refuse = |reason: &str| BundleError::Program {
        digest: definition.digest.clone(),
        field: "command",
        path: command.to_string(),
        reason: reason.to_string(),
    };
    if command.contains('\0') || !path.components().all(|part| matches!(part, Component::Normal(_))) {
        return Err(refuse("must be a path inside the bundle without `.` or `..` parts, or an absolute path"));
    }
    let candidate = definition.root.join(path);
    if std::fs::symlink_metadata(&candidate).is_ok() {
        return inside(definition, "command", &candidate, command);
    }
    if command.contains('/') {
        return Err(refuse("is not a file in the bundle"));
    }
    // A bare name the bundle does not have: the workload's PATH finds it.
    Ok(Program::Command(command.to_string()))
}

/// `path`, once its real location is known to be a file inside the bundle.
fn inside(
    definition: &BundleDefinition,
    field: &'static str,
    path: &Path,
    shown: &str,
) -> Result<Program, BundleError> {
    let refuse = |reason: String| BundleError::Program {
        digest: definition.digest.clone(),
        field,
        path: shown.to_string(),
        reason,
    };
    let root = std::fs::canonicalize(&definition.root)
        .map_err(|e| refuse(format!("cannot be run: the bundle directory is unreadable: {e}")))?;
    let real = std::fs::canonicalize(path).map_err(|_| refuse("is not a file in the bundle".to_string()))?;
    if !real.starts_with(&root) {
        return Err(refuse(format!("leads outside the bundle, to {}", real.display())));
    }
    if !real.is_file() {
        return Err(refuse("is not a file in the bundle".to_string()));
    }
    // The path as the bundle names it: a program may go by the name it was
    // called with.
    let relative = path.strip_prefix(&definition.root).unwrap_or(path);
    Ok(Program::Bundled(relative.to_path_buf()))
}

#[cfg(test)]
mod tests;
