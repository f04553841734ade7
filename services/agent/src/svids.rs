//! Each workload's own credential: an X.509-SVID naming its lease, minted
//! before the workload starts, renewed at half its life, and given to the
//! workload as files and over the SPIFFE Workload API (see [`workload_api`]).
//!
//! # What is stored
//! ```text
//! DATA_DIR/svids/<lease_id>/          the workload's identity directory (0700),
//!                                     its user's under a contained runtime, shown
//!                                     to it read-only at $BERTH_IDENTITY_DIR
//!     ..svid.<n>/                     one generation:
//!         svid.pem                    its certificate, PEM
//!         svid-key.pem  (0400)        its private key, PKCS#8 PEM, made here
//!         bundle.pem                  the workload authority's bundle, PEM
//!         jwt-bundle.json             its JWK set, what verifies JWT-SVIDs
//!         berth-ca.pem                the mesh CA bundle: what berth's own APIs
//!                                     present, for a workload calling them with
//!                                     its SVID (caller kind WORKLOAD)
//!     ..data -> ..svid.<n>            the current generation
//!     svid.pem -> ..data/svid.pem     (and the same for the other files)
//!     agent.sock                      the Workload API ($SPIFFE_ENDPOINT_SOCKET)
//! ```
//!
//! # Expected flow
//! - **Mint**, before the provider starts the workload: a key is made on the
//!   node (it never leaves it), leases gives a single-use launch
//!   registration for the lease at the epoch the node holds it
//!   (`NodeLeases/RegisterLaunch`), and identity signs the key's request
//!   against it (`Workloads/SignWorkloadCertificate`). The files are
//!   written and the Workload API listens; only then is the workload
//!   started. A launch whose credential could not be minted fails with
//!   reason `IdentityUnavailable`; failing the lease ends it, and with it
//!   every registration of it.
//! - **Renew**, at half the certificate's life: identity signs a fresh
//!   certificate for the same key while leases holds the lease open on this
//!   node at the epoch the node holds it now
//!   (`Workloads/RenewWorkloadCertificate`). The new generation replaces
//!   the files whole and is sent to every Workload API stream. A refusal
//!   (the lease ended, moved, or left the node) ends renewal for good; an
//!   unreachable identity is tried again with backoff.
//! - **Adopt**: a workload adopted after an agent restart keeps its
//!   directory; renewal and the Workload API resume from the files.
//! - **Forget**: once the worker is done with the lease, renewal and the
//!   Workload API stop and the directory is removed.
//!
//! # Invariants
//! - A workload sees only its own directory; under a contained runtime the
//!   directory and its files belong to the workload's own user (0700, so no
//!   other tenant's user can read them nor reach the socket).
//! - The files always belong together: readers follow `..data`,
//!   which is swapped in one rename (see [`crate::generations`]).
//! - Nothing renews a credential of a lease the worker is done with.

pub(crate) mod workload_api;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use berth_core::backoff::Backoff;
use berth_mtls::TlsCredentials;
use berth_proto::identity::v1::{
    RenewWorkloadCertificateRequest, SignWorkloadCertificateRequest, SignWorkloadCertificateResponse,
    SignWorkloadJwtRequest, SignWorkloadJwtResponse, workloads_client::WorkloadsClient,
};
use berth_proto::leases::v1::{RegisterLaunchRequest, node_leases_client::NodeLeasesClient};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use crate::files::{FileError, on_blocking_pool};
use crate::generations::Generations;
use crate::node_channel::NodeChannel;

/// Where the workloads' identity directories are, under the data directory.
pub(crate) const SVIDS_DIR: &str = "svids";
/// The certificate's file.
pub(crate) const SVID_FILE: &str = "svid.pem";
/// The private key's file.
pub(crate) const KEY_FILE: &str = "svid-key.pem";
/// The trust bundle's file.
pub(crate) const BUNDLE_FILE: &str = "bundle.pem";
/// The JWK set's file.
pub(crate) const JWKS_FILE: &str = "jwt-bundle.json";
/// The mesh CA bundle, to verify berth's APIs with.
pub(crate) const MESH_CA_FILE: &str = "berth-ca.pem";
/// The Workload API's socket.
pub(crate) const SOCKET_FILE: &str = "agent.sock";
/// The files the workload reads, each a link into the current generation.
const SHOWN_FILES: [&str; 5] = [SVID_FILE, KEY_FILE, BUNDLE_FILE, JWKS_FILE, MESH_CA_FILE];
/// The symlink naming the current generation.
const CURRENT: &str = "..data";
/// Generation directories are `..svid.<n>`.
const GENERATION_PREFIX: &str = "..svid.";

/// How long a launch keeps trying to mint its credential while identity or
/// leases cannot be reached, before it fails with `IdentityUnavailable`.
const MINT_PATIENCE: Duration = Duration::from_secs(20);

/// The least time between two renewals of one credential.
const MIN_RENEWAL_GAP: Duration = Duration::from_secs(1);

/// The lease phase reason of a launch whose credential could not be minted.
pub(crate) const IDENTITY_UNAVAILABLE: &str = "IdentityUnavailable";

/// Why a workload's credential could not be minted.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SvidError {
    /// The lease id cannot name a directory.
    #[error("lease id '{0}' is not usable as a directory name")]
    InvalidLeaseId(String),
    /// The key or its signing request could not be made or read.
    #[error("cannot make the workload's key: {0}")]
    Key(String),
    /// Leases or identity refused, or did not answer in time.
    #[error("{service} refused the workload's credential: {message}")]
    Refused {
        /// `leases` or `identity`.
        service: &'static str,
        /// What it said.
        message: String,
    },
    /// What identity answered does not hold together.
    #[error("identity answered a certificate that cannot be used: {0}")]
    Answer(String),
    /// A file could not be written.
    #[error(transparent)]
    File(#[from] FileError),
    /// The agent is stopping.
    #[error("the agent is stopping")]
    Stopped,
}

/// What the node asks of leases and identity for its workloads' credentials.
#[async_trait::async_trait]
pub(crate) trait WorkloadsApi: Send + Sync + std::fmt::Debug {
    /// A launch registration for a lease the node holds at `epoch`.
    async fn register_launch(&self, request: RegisterLaunchRequest) -> Result<String, tonic::Status>;
    /// A launch's first certificate, against a registration.
    async fn sign(
        &self,
        request: SignWorkloadCertificateRequest,
    ) -> Result<SignWorkloadCertificateResponse, tonic::Status>;
    /// A JWT-SVID for a launched workload.
    async fn sign_jwt(&self, request: SignWorkloadJwtRequest) -> Result<SignWorkloadJwtResponse, tonic::Status>;
    /// A fresh certificate for a launched workload.
    async fn renew(
        &self,
        request: RenewWorkloadCertificateRequest,
    ) -> Result<SignWorkloadCertificateResponse, tonic::Status>;
    /// Drops the open connections, so the next call presents the node's
    /// current certificate.
    fn reconnect(&self);
    /// The mesh CA bundle the node trusts now: what berth's APIs present.
    fn mesh_bundle(&self) -> String;
}

/// [`WorkloadsApi`] over gRPC: leases and one identity replica, presenting
/// the node certificate.
#[derive(Debug)]
pub(crate) struct GrpcWorkloads {
    leases: NodeChannel,
    identity: NodeChannel,
    credentials: TlsCredentials,
}

impl GrpcWorkloads {
    /// Clients of leases at `leases` and identity at `identity` (`host:port`).
    pub(crate) fn new(
        leases: &str,
        identity: &str,
        credentials: TlsCredentials,
        timeout: Duration,
    ) -> Result<Self, berth_rpc::ClientError> {
        Ok(Self {
            leases: NodeChannel::new("leases", leases, credentials.clone(), timeout)?,
            identity: NodeChannel::new("identity", identity, credentials.clone(), timeout)?,
            credentials,
        })
    }
}

#[async_trait::async_trait]
impl WorkloadsApi for GrpcWorkloads {
    async fn register_launch(&self, request: RegisterLaunchRequest) -> Result<String, tonic::Status> {
        let mut client = NodeLeasesClient::new(self.leases.channel());
        Ok(self.leases.call(client.register_launch(self.leases.request(request))).await?.registration)
    }

    async fn sign(
        &self,
        request: SignWorkloadCertificateRequest,
    ) -> Result<SignWorkloadCertificateResponse, tonic::Status> {
        let mut client = WorkloadsClient::new(self.identity.channel());
        self.identity.call(client.sign_workload_certificate(self.identity.request(request))).await
    }

    async fn sign_jwt(&self, request: SignWorkloadJwtRequest) -> Result<SignWorkloadJwtResponse, tonic::Status> {
        let mut client = WorkloadsClient::new(self.identity.channel());
        self.identity.call(client.sign_workload_jwt(self.identity.request(request))).await
    }

    async fn renew(
        &self,
        request: RenewWorkloadCertificateRequest,
    ) -> Result<SignWorkloadCertificateResponse, tonic::Status> {
        let mut client = WorkloadsClient::new(self.identity.channel());
        self.identity.call(client.renew_workload_certificate(self.identity.request(request))).await
    }

    fn reconnect(&self) {
        self.leases.reconnect();
        self.identity.reconnect();
    }

    fn mesh_bundle(&self) -> String {
        self.credentials.material().ca_bundle_pem
    }
}

/// A workload's credential as it stands now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Svid {
    /// The SPIFFE ID it names.
    pub(crate) spiffe_id: String,
    /// The certificate, PEM.
    pub(crate) cert_pem: String,
    /// The private key, PKCS#8 PEM.
    pub(crate) key_pem: String,
    /// The workload authority's bundle, PEM.
    pub(crate) bundle_pem: String,
    /// The bundle's JWK set, JSON: what verifies JWT-SVIDs.
    pub(crate) jwks_json: String,
    /// The mesh CA bundle, PEM: what berth's APIs present.
    pub(crate) mesh_bundle_pem: String,
    /// When it became valid, seconds since the Unix epoch.
    pub(crate) not_before: i64,
    /// When it expires, seconds since the Unix epoch.
    pub(crate) not_after: i64,
    /// When the node got it (for one read back after a restart, when it was
    /// read).
    pub(crate) received: SystemTime,
}

impl Svid {
    /// When it should be renewed: at half the life it had left when the
    /// node got it (certificates are backdated, so not from `not_before`).
    fn renew_at(&self) -> SystemTime {
        let start = (UNIX_EPOCH + Duration::from_secs(u64::try_from(self.not_before).unwrap_or(0))).max(self.received);
        let end = UNIX_EPOCH + Duration::from_secs(u64::try_from(self.not_after).unwrap_or(0));
        start + end.duration_since(start).unwrap_or_default() / 2
    }

    /// The trust domain of its SPIFFE ID, as `spiffe://<domain>`.
    pub(crate) fn trust_domain(&self) -> String {
        let rest = self.spiffe_id.strip_prefix("spiffe://").unwrap_or(&self.spiffe_id);
        format!("spiffe://{}", rest.split('/').next().unwrap_or_default())
    }

    /// Reads the current generation from `dir`.
    fn load(dir: &Path) -> Result<Self, SvidError> {
        let read = |file: &str| {
            let path = dir.join(CURRENT).join(file);
            std::fs::read_to_string(&path).map_err(|source| FileError::new("read", &path, source))
        };
        let (cert_pem, key_pem, bundle_pem) = (read(SVID_FILE)?, read(KEY_FILE)?, read(BUNDLE_FILE)?);
        let jwks_json = read(JWKS_FILE).unwrap_or_default();
        let mesh_bundle_pem = read(MESH_CA_FILE).unwrap_or_default();
        let cert = berth_mtls::certs_from_pem("workload certificate", &cert_pem)
            .map_err(|e| SvidError::Answer(e.to_string()))?;
        let leaf = &cert[0];
        let (not_before, not_after) = berth_mtls::cert_validity(leaf).map_err(|e| SvidError::Answer(e.to_string()))?;
        let spiffe_id = berth_mtls::cert_uris(leaf)
            .map_err(|e| SvidError::Answer(e.to_string()))?
            .into_iter()
            .find(|uri| uri.starts_with("spiffe://"))
            .ok_or_else(|| SvidError::Answer("the certificate names no SPIFFE ID".into()))?;
        Ok(Self {
            spiffe_id,
            cert_pem,
            key_pem,
            bundle_pem,
            jwks_json,
            mesh_bundle_pem,
            not_before,
            not_after,
            received: SystemTime::now(),
        })
    }

    fn signed(answer: SignWorkloadCertificateResponse, key_pem: String, mesh_bundle_pem: String) -> Self {
        Self {
            spiffe_id: answer.spiffe_id,
            cert_pem: answer.certificate_pem,
            key_pem,
            bundle_pem: answer.bundle_pem,
            jwks_json: answer.jwks_json,
            mesh_bundle_pem,
            not_before: answer.not_before.map_or(0, |t| t.seconds),
            not_after: answer.not_after.map_or(0, |t| t.seconds),
            received: SystemTime::now(),
        }
    }
}

/// The lease a credential is for, and what moves under it: the epoch the
/// node holds it at, and the node id the node reports as (`None` while its
/// session is down).
#[derive(Debug, Clone)]
pub(crate) struct LeaseWatch {
    pub(crate) lease_id: String,
    pub(crate) epoch: watch::Receiver<u64>,
    pub(crate) node: watch::Receiver<Option<String>>,
}

/// Every workload's credential on this node.
#[derive(Debug, Clone)]
pub(crate) struct Svids {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    root: PathBuf,
    api: Arc<dyn WorkloadsApi>,
    retry: (Duration, Duration),
    live: Mutex<HashMap<String, Live>>,
    shutdown: CancellationToken,
}

/// What runs for one workload's credential: its renewal and its Workload
/// API; both stop when dropped.
#[derive(Debug)]
struct Live {
    _renewal: AbortOnDropHandle<()>,
    _api: AbortOnDropHandle<()>,
}

impl Svids {
    /// The credentials kept under `data_dir`, asked for through `api`,
    /// retrying unanswered calls with backoff from `retry.0` up to `retry.1`.
    pub(crate) fn new(
        data_dir: &Path,
        api: Arc<dyn WorkloadsApi>,
        retry: (Duration, Duration),
        shutdown: CancellationToken,
    ) -> Self {
        let inner = Inner { root: data_dir.join(SVIDS_DIR), api, retry, live: Mutex::new(HashMap::new()), shutdown };
        Self { inner: Arc::new(inner) }
    }

    /// The identity directory of `lease_id`.
    pub(crate) fn dir(&self, lease_id: &str) -> PathBuf {
        self.inner.root.join(lease_id)
    }

    /// Mints the credential of a lease about to be launched, writes it and
    /// starts its Workload API and renewal; returns its directory.
    pub(crate) async fn mint(&self, lease: LeaseWatch) -> Result<PathBuf, SvidError> {
        let lease_id = lease.lease_id.clone();
        if lease_id.is_empty() || lease_id.starts_with('.') || lease_id.contains('/') {
            return Err(SvidError::InvalidLeaseId(lease_id));
        }
        let dir = self.dir(&lease_id);
        let fresh = dir.clone();
        on_blocking_pool(move || fresh_dir(&fresh)).await?;
        let (csr_pem, key_pem) = berth_mtls::generate_csr(&lease_id).map_err(|e| SvidError::Key(e.to_string()))?;
        let answer = self.inner.first_certificate(&lease, &csr_pem).await?;
        let svid = Svid::signed(answer, key_pem, self.inner.api.mesh_bundle());
        let (written, publish) = (svid.clone(), dir.clone());
        on_blocking_pool(move || publish_svid(&publish, &written)).await?;
        self.start(lease, svid).await?;
        tracing::info!(%lease_id, "minted the workload's credential");
        Ok(dir)
    }

    /// Resumes renewal and the Workload API of a workload adopted after a
    /// restart, from the files it kept; a workload without them (started
    /// before credentials were minted) is left without.
    pub(crate) async fn adopt(&self, lease: LeaseWatch) {
        let dir = self.dir(&lease.lease_id);
        let loaded = on_blocking_pool(move || Svid::load(&dir)).await;
        match loaded {
            Ok(svid) => {
                let lease_id = lease.lease_id.clone();
                if let Err(error) = self.start(lease, svid).await {
                    tracing::warn!(%lease_id, %error, "cannot resume the workload's credential");
                }
            }
            Err(error) => {
                tracing::info!(lease_id = %lease.lease_id, %error, "the adopted workload has no credential to resume");
            }
        }
    }

    /// Stops renewing the credential of `lease_id` and removes its files.
    pub(crate) async fn forget(&self, lease_id: &str) {
        self.inner.live.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(lease_id);
        let dir = self.dir(lease_id);
        match tokio::task::spawn_blocking(move || std::fs::remove_dir_all(&dir)).await {
            Ok(Ok(())) => tracing::debug!(%lease_id, "removed the workload's credential"),
            Ok(Err(error)) if error.kind() == std::io::ErrorKind::NotFound => {}
            Ok(Err(error)) => tracing::warn!(%lease_id, %error, "cannot remove the workload's credential"),
            Err(error) => tracing::warn!(%lease_id, %error, "cannot remove the workload's credential"),
        }
    }

    /// Removes the directories of leases not in `held` that nothing runs for
    /// (left by a lease settled before a restart).
    pub(crate) async fn retain(&self, held: &std::collections::BTreeSet<String>) {
        let Ok(entries) = std::fs::read_dir(&self.inner.root) else { return };
        let stale: Vec<String> = entries
            .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
            .filter(|lease_id| !held.contains(lease_id))
            .filter(|lease_id| {
                !self.inner.live.lock().unwrap_or_else(std::sync::PoisonError::into_inner).contains_key(lease_id)
            })
            .collect();
        for lease_id in stale {
            self.forget(&lease_id).await;
        }
    }

    async fn start(&self, lease: LeaseWatch, svid: Svid) -> Result<(), SvidError> {
        let dir = self.dir(&lease.lease_id);
        let (current, seen) = watch::channel(Arc::new(svid));
        let signer = workload_api::JwtSigner { api: self.inner.api.clone(), lease: lease.clone() };
        let api = workload_api::serve(&dir.join(SOCKET_FILE), seen, signer, self.inner.shutdown.child_token())
            .await
            .map_err(|source| FileError::new("listen on", &dir.join(SOCKET_FILE), source))?;
        let lease_id = lease.lease_id.clone();
        let renewal = tokio::spawn(self.inner.clone().renew(lease, dir, current));
        let live = Live { _renewal: AbortOnDropHandle::new(renewal), _api: AbortOnDropHandle::new(api) };
        self.inner.live.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(lease_id, live);
        Ok(())
    }
}

/// How a call that was refused goes on.
enum Retry {
    /// At once: the connections were dropped for a stale session.
    Now,
    /// After a backoff: the service could not answer.
    Later,
    /// Never: the service answered no.
    Never,
}

impl Inner {
    fn backoff(&self) -> Backoff {
        Backoff::new(self.retry.0, self.retry.1)
    }

    /// How a call refused with `status` goes on. A refusal of who the node
    /// is reconnects once first: after a rejoin the open connections still
    /// present the node's old certificate.
    fn next_try(&self, status: &tonic::Status, reconnected: &mut bool) -> Retry {
        let stale_session = matches!(status.code(), tonic::Code::PermissionDenied | tonic::Code::Unauthenticated);
        if stale_session && !*reconnected {
            self.api.reconnect();
            *reconnected = true;
            Retry::Now
        } else if crate::leases_client::is_transient(status) {
            Retry::Later
        } else {
            Retry::Never
        }
    }

    /// Registers the launch and has identity sign against it, trying again
    /// (with a fresh registration) while either cannot be reached.
    async fn first_certificate(
        &self,
        lease: &LeaseWatch,
        csr_pem: &str,
    ) -> Result<SignWorkloadCertificateResponse, SvidError> {
        let deadline = tokio::time::Instant::now() + MINT_PATIENCE;
        let mut backoff = self.backoff();
        let mut reconnected = false;
        loop {
            let node_id = lease.node.borrow().clone().unwrap_or_default();
            let epoch = *lease.epoch.borrow();
            let attempt = async {
                let request =
                    RegisterLaunchRequest { node_id: node_id.clone(), lease_id: lease.lease_id.clone(), epoch };
                let registration = self.api.register_launch(request).await.map_err(|status| ("leases", status))?;
                let request =
                    SignWorkloadCertificateRequest { node_id: node_id.clone(), registration, csr_pem: csr_pem.into() };
                self.api.sign(request).await.map_err(|status| ("identity", status))
            };
            let (service, status) = match attempt.await {
                Ok(answer) => return Ok(answer),
                Err(refusal) => refusal,
            };
            let refused = || SvidError::Refused { service, message: status.message().to_string() };
            match self.next_try(&status, &mut reconnected) {
                Retry::Now => continue,
                Retry::Never => return Err(refused()),
                Retry::Later => {}
            }
            let delay = backoff.next_delay();
            if tokio::time::Instant::now() + delay > deadline {
                return Err(refused());
            }
            tracing::debug!(lease_id = %lease.lease_id, service, error = %status.message(),
                "cannot mint the workload's credential yet; trying again");
            tokio::select! {
                _ = self.shutdown.cancelled() => return Err(SvidError::Stopped),
                () = tokio::time::sleep(delay) => {}
            }
        }
    }

    /// Renews the credential at half its life, for as long as identity
    /// signs and the task is not dropped.
    async fn renew(self: Arc<Self>, mut lease: LeaseWatch, dir: PathBuf, current: watch::Sender<Arc<Svid>>) {
        let lease_id = lease.lease_id.clone();
        loop {
            let due = current.borrow().renew_at();
            // Never back to back, even for a certificate about to expire.
            let wait = due.duration_since(SystemTime::now()).unwrap_or_default().max(MIN_RENEWAL_GAP);
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
            }
            let key_pem = current.borrow().key_pem.clone();
            let Some(svid) = self.renewed(&mut lease, &key_pem).await else { return };
            let (written, publish) = (svid.clone(), dir.clone());
            match on_blocking_pool(move || publish_svid(&publish, &written)).await {
                Ok(()) => {
                    tracing::info!(%lease_id, not_after = svid.not_after, "renewed the workload's credential");
                    current.send_replace(Arc::new(svid));
                }
                Err(error) => {
                    tracing::warn!(%lease_id, %error, "cannot write the workload's renewed credential");
                    tokio::select! {
                        _ = self.shutdown.cancelled() => return,
                        () = tokio::time::sleep(self.retry.1) => {}
                    }
                }
            }
        }
    }

    /// One renewal: tried again while identity cannot be reached or the
    /// node's session is down; `None` once identity refuses for good.
    async fn renewed(&self, lease: &mut LeaseWatch, key_pem: &str) -> Option<Svid> {
        let lease_id = lease.lease_id.clone();
        let csr_pem = match berth_mtls::csr_for_key(&lease_id, key_pem) {
            Ok(csr) => csr,
            Err(error) => {
                tracing::warn!(%lease_id, %error, "cannot ask for the workload's renewed credential");
                return None;
            }
        };
        let mut backoff = self.backoff();
        let mut reconnected = false;
        loop {
            let Some(node_id) = lease.node.borrow().clone() else {
                // In custody: renew once the node reports again.
                tokio::select! {
                    _ = self.shutdown.cancelled() => return None,
                    changed = lease.node.changed() => if changed.is_err() { return None },
                }
                continue;
            };
            let request = RenewWorkloadCertificateRequest {
                node_id,
                lease_id: lease_id.clone(),
                epoch: *lease.epoch.borrow(),
                csr_pem: csr_pem.clone(),
            };
            let status = match self.api.renew(request).await {
                Ok(answer) => return Some(Svid::signed(answer, key_pem.to_string(), self.api.mesh_bundle())),
                Err(status) => status,
            };
            match self.next_try(&status, &mut reconnected) {
                Retry::Now => continue,
                Retry::Never => {
                    tracing::info!(%lease_id, code = ?status.code(), reason = %status.message(),
                        "the workload's credential is not renewed");
                    return None;
                }
                Retry::Later => {}
            }
            tracing::debug!(%lease_id, error = %status.message(), "cannot renew the workload's credential yet");
            tokio::select! {
                _ = self.shutdown.cancelled() => return None,
                () = tokio::time::sleep(backoff.next_delay()) => {}
            }
        }
    }
}

/// An empty identity directory for a launch (a relaunch's is replaced).
fn fresh_dir(dir: &Path) -> Result<(), SvidError> {
    use std::os::unix::fs::DirBuilderExt as _;
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => return Err(FileError::new("remove", dir, source).into()),
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| FileError::new("create", dir, source))?;
    Ok(())
}

/// Writes `svid` as the directory's next generation, for the directory's
/// owner, and links the files the workload reads to it.
fn publish_svid(dir: &Path, svid: &Svid) -> Result<(), SvidError> {
    use std::os::unix::fs::MetadataExt as _;
    let meta = std::fs::metadata(dir).map_err(|source| FileError::new("read", dir, source))?;
    let generations = Generations { root: dir, current: CURRENT, prefix: GENERATION_PREFIX };
    generations.publish(
        &[
            (SVID_FILE, svid.cert_pem.as_bytes(), 0o444),
            (KEY_FILE, svid.key_pem.as_bytes(), 0o400),
            (BUNDLE_FILE, svid.bundle_pem.as_bytes(), 0o444),
            (JWKS_FILE, svid.jwks_json.as_bytes(), 0o444),
            (MESH_CA_FILE, svid.mesh_bundle_pem.as_bytes(), 0o444),
        ],
        Some((meta.uid(), meta.gid())),
    )?;
    for file in SHOWN_FILES {
        if std::fs::symlink_metadata(dir.join(file)).is_err() {
            generations.link(file, &format!("{CURRENT}/{file}"))?;
        }
    }
    generations.remove_stale(&SHOWN_FILES)?;
    Ok(())
}

#[cfg(test)]
mod tests;
