//! Talks to where bundles live, a registry or an OCI layout directory: resolves tags to
//! digests, pushes bundles, and fetches manifests and blobs, verifying every byte against
//! its digest as it streams.
//!
//! # Transport
//! Registries are spoken to with oci-client over HTTPS, verified against the system roots
//! plus an optional private CA. Plain HTTP is used for loopback registries (`localhost`,
//! `127.0.0.0/8`, `[::1]`; unless [`RegistryConfig::plain_http_loopback`] is off) and for
//! hosts named in [`RegistryConfig::insecure_registries`].
//! A fresh oci-client is built per operation, because it keeps the first credentials it
//! sees for a registry and callers pass different credentials per bundle.
//!
//! # Errors
//! Every failure is one [`RegistryError`] whose variant is what a caller decides on:
//! [`RegistryError::TagNotFound`], [`RegistryError::Unauthorized`],
//! [`RegistryError::RegistryUnavailable`] (refused connection, timeout, 5xx, 429) and
//! [`RegistryError::InvalidReference`] are the kinds a tag resolver maps; an OCI layout
//! directory answers with the same kinds.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use oci_client::client::{Certificate, CertificateEncoding, ClientConfig, ClientProtocol};
use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::secrets::RegistryAuth;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::digest::{Digest, Hasher};
use crate::format::{BundleConfig, BundleManifest, Descriptor, MAX_CONFIG_BYTES, MAX_MANIFEST_BYTES};
use crate::layout;
use crate::pack::PackedBundle;
use crate::reference::{BundleReference, RegistryReference};
use crate::registry_error::RegistryError;

/// How long connecting to a registry may take by default.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a registry may go silent mid-response by default.
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(60);

/// The buffer one blob read from a layout goes through.
const COPY_BUFFER_BYTES: usize = 64 << 10;

/// Credentials for a registry, filled by the caller (the control plane from a bundle's
/// secret, the CLI from flags).
#[derive(Clone, Default, PartialEq, Eq)]
pub enum RegistryCredentials {
    /// No credentials.
    #[default]
    Anonymous,
    /// HTTP basic authentication, or the username and password a token service takes.
    Basic {
        /// The user.
        username: String,
        /// The password.
        password: String,
    },
    /// A bearer token sent as is.
    Bearer {
        /// The token.
        token: String,
    },
}

impl std::fmt::Debug for RegistryCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Anonymous => f.write_str("Anonymous"),
            Self::Basic { username, .. } => write!(f, "Basic({username}, <redacted>)"),
            Self::Bearer { .. } => f.write_str("Bearer(<redacted>)"),
        }
    }
}

impl RegistryCredentials {
    fn auth(&self) -> RegistryAuth {
        match self {
            Self::Anonymous => RegistryAuth::Anonymous,
            Self::Basic { username, password } => RegistryAuth::Basic(username.clone(), password.clone()),
            Self::Bearer { token } => RegistryAuth::Bearer(token.clone()),
        }
    }
}

/// How to reach registries.
#[derive(Debug, Clone)]
pub struct RegistryConfig {
    /// Registries spoken to over plain HTTP, as `host` (any port) or `host:port`.
    pub insecure_registries: Vec<String>,
    /// PEM certificates of a private registry's CA, trusted beside the system roots.
    pub ca_pem: Option<String>,
    /// Whether loopback registries are spoken to over plain HTTP (the default); false
    /// speaks HTTPS to them like to any other.
    pub plain_http_loopback: bool,
    /// How long connecting may take.
    pub connect_timeout: Duration,
    /// How long a registry may go silent mid-response.
    pub read_timeout: Duration,
    /// Mirrors tried, in order, before the registry they mirror.
    pub mirrors: Vec<RegistryMirror>,
}

impl Default for RegistryConfig {
    fn default() -> Self {
        Self {
            insecure_registries: Vec::new(),
            ca_pem: None,
            plain_http_loopback: true,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            read_timeout: DEFAULT_READ_TIMEOUT,
            mirrors: Vec::new(),
        }
    }
}

/// A mirror of a registry (containerd's `hosts.toml` `[host]` entries): tags
/// are resolved and content pulled from it first, with a connect timeout of
/// at most [`MIRROR_CONNECT_TIMEOUT`] and a read timeout of at most
/// [`MIRROR_READ_TIMEOUT`], and from the registry itself when it fails (a
/// mirror that failed is skipped for the rest of that pull, and left out of
/// every operation for [`MIRROR_RETRY_AFTER`]). Whatever a mirror serves is
/// verified against the digest asked for. Written `ORIGIN=MIRROR`, or `ORIGIN=MIRROR,credentials` to send
/// the mirror the credentials meant for the origin too; without it the
/// mirror is spoken to anonymously.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryMirror {
    /// The registry mirrored, `host[:port]` as references name it
    /// (`docker.io` also matches `index.docker.io`).
    pub origin: String,
    /// The mirror, `host[:port]`.
    pub mirror: String,
    /// Whether the origin's credentials are sent to the mirror.
    pub send_credentials: bool,
}

impl std::str::FromStr for RegistryMirror {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let usage = || format!("'{text}' is not ORIGIN=MIRROR[,credentials] (e.g. docker.io=mirror.internal:5000)");
        let (origin, rest) = text.split_once('=').ok_or_else(usage)?;
        let (mirror, send_credentials) = match rest.split_once(',') {
            Some((mirror, "credentials")) => (mirror, true),
            Some(_) => return Err(usage()),
            None => (rest, false),
        };
        let host = |name: &str| !name.is_empty() && !name.contains(['/', ' ', '=', ',', '@']);
        let (origin, mirror) = (origin.trim(), mirror.trim());
        if !host(origin) || !host(mirror) || origin == mirror {
            return Err(usage());
        }
        Ok(Self { origin: origin.to_owned(), mirror: mirror.to_owned(), send_credentials })
    }
}

impl std::fmt::Display for RegistryMirror {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={}{}", self.origin, self.mirror, if self.send_credentials { ",credentials" } else { "" })
    }
}

/// The longest a mirror may take to accept a connection before the next
/// one, or the origin, is tried.
pub const MIRROR_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// How long a mirror that failed is left out of every operation of the
/// client before it is asked again.
pub const MIRROR_RETRY_AFTER: Duration = Duration::from_secs(30);

/// The longest a mirror may go silent mid-response before the next one, or
/// the origin, is tried: a mirror that accepts and never answers costs this
/// once per pull, not the origin's read timeout.
pub const MIRROR_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// What `inspect` found.
#[derive(Debug, Clone)]
pub struct BundleInfo {
    /// The reference as asked.
    pub reference: BundleReference,
    /// The manifest digest.
    pub digest: Digest,
    /// The manifest's size in bytes.
    pub manifest_size: u64,
    /// The manifest.
    pub manifest: BundleManifest,
    /// The config.
    pub config: BundleConfig,
}

/// Where a blob to push is: in memory, or in a file read when it is sent.
#[derive(Debug, Clone, Copy)]
pub(crate) enum BlobSource<'a> {
    Memory(&'a [u8]),
    File(&'a Path),
}

/// Resolves, pushes and fetches bundles in registries and layout directories.
#[derive(Debug, Clone)]
pub struct BundleClient {
    config: RegistryConfig,
    certificates: Vec<Certificate>,
    /// When each mirror last failed: one that failed within
    /// [`MIRROR_RETRY_AFTER`] is not asked, so a mirror that is down costs
    /// its timeouts once, not on every pull. Shared by the client's clones.
    failed_mirrors: Arc<std::sync::Mutex<HashMap<String, Instant>>>,
}

impl BundleClient {
    /// A client with `config`; fails when the CA is not usable.
    pub fn new(config: RegistryConfig) -> Result<Self, RegistryError> {
        let certificates = match &config.ca_pem {
            Some(pem) => split_pem(pem)?,
            None => Vec::new(),
        };
        let client = Self { config, certificates, failed_mirrors: Arc::default() };
        // Building one now surfaces a bad CA here, not on the first pull.
        client.oci_client("registry.invalid")?;
        Ok(client)
    }

    /// The same client, also speaking plain HTTP to `registry` (as a bundle reference's
    /// `insecure` flag asks).
    pub fn with_insecure_registry(mut self, registry: impl Into<String>) -> Self {
        self.config.insecure_registries.push(registry.into());
        self
    }

    /// The manifest digest `reference` names now: its own digest when it pins one,
    /// otherwise what its tag points to.
    pub async fn resolve(
        &self,
        reference: &BundleReference,
        credentials: &RegistryCredentials,
    ) -> Result<Digest, RegistryError> {
        if let Some(digest) = reference.digest() {
            return Ok(digest.clone());
        }
        match reference {
            BundleReference::Registry(r) => {
                let endpoints = self.endpoints(r, credentials)?;
                for (i, endpoint) in endpoints.live() {
                    match resolve_at(endpoint).await {
                        Ok(digest) => return Ok(digest),
                        Err(error) => endpoints.failed(i, error)?,
                    }
                }
                Err(Endpoints::exhausted())
            }
            BundleReference::Layout(l) => {
                let dir = l.dir().to_path_buf();
                let tag = l.tag().unwrap_or(crate::reference::DEFAULT_TAG).to_owned();
                let shown = reference.to_string();
                blocking(move || layout::resolve(&dir, &tag, &shown)).await
            }
        }
    }

    /// [`Self::resolve`] for a reference as a user wrote it (a template's bundle
    /// reference); one that does not parse is [`RegistryError::InvalidReference`].
    pub async fn resolve_str(
        &self,
        reference: &str,
        credentials: &RegistryCredentials,
    ) -> Result<Digest, RegistryError> {
        let parsed = BundleReference::parse(reference)
            .map_err(|e| RegistryError::InvalidReference { reference: reference.to_owned(), reason: e.to_string() })?;
        self.resolve(&parsed, credentials).await
    }

    /// Pushes `bundle` to `reference` (blobs the registry already has are skipped) and
    /// returns its manifest digest.
    pub async fn push(
        &self,
        bundle: &PackedBundle,
        reference: &BundleReference,
        credentials: &RegistryCredentials,
    ) -> Result<Digest, RegistryError> {
        if let Some(digest) = reference.digest()
            && digest != bundle.digest()
        {
            return Err(RegistryError::InvalidReference {
                reference: reference.to_string(),
                reason: format!("the bundle's digest is {}, not {digest}", bundle.digest()),
            });
        }
        match reference {
            BundleReference::Registry(r) => {
                let blobs = bundle.blobs();
                self.push_to_registry(r, &blobs, bundle.manifest_bytes(), credentials).await?;
            }
            BundleReference::Layout(l) => {
                let dir = l.dir().to_path_buf();
                let tag = l.tag().map(str::to_owned);
                let bundle = bundle.clone();
                blocking(move || layout::write(&dir, &bundle, tag.as_deref())).await?;
            }
        }
        Ok(bundle.digest().clone())
    }

    /// Pushes `blobs` (skipping those the registry has) and then the OCI image
    /// manifest `manifest` to `r`.
    pub(crate) async fn push_to_registry(
        &self,
        r: &RegistryReference,
        blobs: &[(&Descriptor, &[u8])],
        manifest: &[u8],
        credentials: &RegistryCredentials,
    ) -> Result<(), RegistryError> {
        let blobs = blobs.iter().map(|(descriptor, bytes)| (*descriptor, BlobSource::Memory(bytes)));
        self.push_artifact(r, blobs, manifest, credentials).await
    }

    /// Pushes `blobs` (skipping those the registry has; a file is read only
    /// when it must be sent) and then the OCI image manifest `manifest` to `r`.
    pub(crate) async fn push_artifact<'a>(
        &self,
        r: &RegistryReference,
        blobs: impl IntoIterator<Item = (&'a Descriptor, BlobSource<'a>)>,
        manifest: &[u8],
        credentials: &RegistryCredentials,
    ) -> Result<(), RegistryError> {
        let client = self.oci_client(r.registry())?;
        let auth = credentials.auth();
        client.store_auth_if_needed(r.registry(), &auth).await;
        for (descriptor, source) in blobs {
            let digest = descriptor.digest.to_string();
            let present = client.blob_exists(r.oci(), &digest).await.map_err(|e| from_oci(e, Target::Push(r)))?;
            if present {
                continue;
            }
            let bytes = match source {
                BlobSource::Memory(bytes) => bytes.to_vec(),
                BlobSource::File(path) => tokio::fs::read(path)
                    .await
                    .map_err(|source| RegistryError::Layout { path: path.display().to_string(), source })?,
            };
            client.push_blob(r.oci(), bytes, &digest).await.map_err(|e| from_oci(e, Target::Push(r)))?;
        }
        let content_type = http::HeaderValue::from_static(crate::format::OCI_MANIFEST_MEDIA_TYPE);
        client
            .push_manifest_raw(r.oci(), manifest.to_vec(), content_type)
            .await
            .map_err(|e| from_oci(e, Target::Push(r)))?;
        Ok(())
    }

    /// Resolves `reference` and reads its manifest and config, verified.
    pub async fn inspect(
        &self,
        reference: &BundleReference,
        credentials: &RegistryCredentials,
    ) -> Result<BundleInfo, RegistryError> {
        let digest = self.resolve(reference, credentials).await?;
        let fetcher = self.fetcher(reference, credentials)?;
        let manifest_bytes = fetcher.manifest(&digest).await?;
        let manifest = BundleManifest::parse(&manifest_bytes)
            .map_err(|source| RegistryError::NotABundle { reference: reference.to_string(), source })?;
        let config_bytes = fetcher.small_blob(&manifest.config, MAX_CONFIG_BYTES).await?;
        let config = BundleConfig::parse(&config_bytes)
            .map_err(|source| RegistryError::NotABundle { reference: reference.to_string(), source })?;
        Ok(BundleInfo {
            reference: reference.clone(),
            digest,
            manifest_size: manifest_bytes.len() as u64,
            manifest,
            config,
        })
    }

    /// Fetches the manifest `reference` names, verified, to show the credentials may
    /// read it; for a bundle or an image alike. Its digest.
    pub async fn check_readable(
        &self,
        reference: &BundleReference,
        credentials: &RegistryCredentials,
    ) -> Result<Digest, RegistryError> {
        let digest = self.resolve(reference, credentials).await?;
        self.fetcher(reference, credentials)?.manifest(&digest).await?;
        Ok(digest)
    }

    /// A fetcher for the blobs of the repository or layout `reference` names.
    pub(crate) fn fetcher(
        &self,
        reference: &BundleReference,
        credentials: &RegistryCredentials,
    ) -> Result<Fetcher, RegistryError> {
        let source = match reference {
            BundleReference::Registry(r) => Source::Registry(self.endpoints(r, credentials)?),
            BundleReference::Layout(l) => Source::Layout { dir: l.dir().to_path_buf() },
        };
        Ok(Fetcher { source, shown: reference.to_string() })
    }

    /// Where `reference` is asked for, in order: its registry's mirrors,
    /// then the registry.
    fn endpoints(
        &self,
        reference: &RegistryReference,
        credentials: &RegistryCredentials,
    ) -> Result<Endpoints, RegistryError> {
        let mut list = Vec::new();
        let resting = |mirror: &RegistryMirror| {
            let failed = self.failed_mirrors.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            failed.get(&mirror.mirror).is_some_and(|at| at.elapsed() < MIRROR_RETRY_AFTER)
        };
        for mirror in self.config.mirrors.iter().filter(|m| reference.is_on(&m.origin) && !resting(m)) {
            list.push(Endpoint {
                client: Box::new(self.oci_client_with(
                    &mirror.mirror,
                    self.config.connect_timeout.min(MIRROR_CONNECT_TIMEOUT),
                    self.config.read_timeout.min(MIRROR_READ_TIMEOUT),
                )?),
                reference: reference.on_registry(&mirror.mirror),
                auth: if mirror.send_credentials { credentials.auth() } else { RegistryAuth::Anonymous },
                mirror_of: Some(reference.registry().to_owned()),
            });
        }
        list.push(Endpoint {
            client: Box::new(self.oci_client(reference.registry())?),
            reference: reference.clone(),
            auth: credentials.auth(),
            mirror_of: None,
        });
        let skipped = std::sync::Mutex::new(vec![false; list.len()]);
        Ok(Endpoints { list, skipped, failed_mirrors: Arc::clone(&self.failed_mirrors) })
    }

    fn oci_client(&self, registry: &str) -> Result<oci_client::Client, RegistryError> {
        self.oci_client_with(registry, self.config.connect_timeout, self.config.read_timeout)
    }

    fn oci_client_with(
        &self,
        registry: &str,
        connect_timeout: Duration,
        read_timeout: Duration,
    ) -> Result<oci_client::Client, RegistryError> {
        // reqwest takes the process's rustls provider and panics without one; ring is the
        // only one in this tree, and installing fails harmlessly when one is there.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let protocol = if self.plain_http(registry) { ClientProtocol::Http } else { ClientProtocol::Https };
        let config = ClientConfig {
            protocol,
            extra_root_certificates: self.certificates.clone(),
            connect_timeout: Some(connect_timeout),
            read_timeout: Some(read_timeout),
            // One PUT per blob: every registry takes it, and bundles are pushed whole.
            use_monolithic_push: true,
            platform_resolver: None,
            ..ClientConfig::default()
        };
        oci_client::Client::try_from(config).map_err(|e| RegistryError::Config(error_chain(&e)))
    }

    fn plain_http(&self, registry: &str) -> bool {
        let host = host_of(registry);
        (self.config.plain_http_loopback && is_loopback(host))
            || self.config.insecure_registries.iter().any(|r| r == registry || r == host)
    }
}

/// The host part of `host[:port]` or `[v6][:port]`.
fn host_of(registry: &str) -> &str {
    if let Some(rest) = registry.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match registry.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => registry,
    }
}

fn is_loopback(host: &str) -> bool {
    host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// One certificate per PEM block, since the HTTP client reads one per entry.
fn split_pem(pem: &str) -> Result<Vec<Certificate>, RegistryError> {
    const END: &str = "-----END CERTIFICATE-----";
    let certificates: Vec<Certificate> = pem
        .split_inclusive(END)
        .filter(|block| block.contains("-----BEGIN CERTIFICATE-----") && block.contains(END))
        .map(|block| Certificate { encoding: CertificateEncoding::Pem, data: block.trim().as_bytes().to_vec() })
        .collect();
    if certificates.is_empty() {
        return Err(RegistryError::Config("the CA file holds no PEM certificate".to_owned()));
    }
    Ok(certificates)
}

/// Runs blocking file work off the async workers.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, RegistryError> + Send + 'static,
) -> Result<T, RegistryError> {
    tokio::task::spawn_blocking(work).await.map_err(|e| RegistryError::Layout {
        path: "<blocking task>".to_owned(),
        source: std::io::Error::other(e.to_string()),
    })?
}

/// Reads the blobs of one repository or layout, verifying each.
#[derive(Debug)]
pub(crate) struct Fetcher {
    source: Source,
    shown: String,
}

enum Source {
    Registry(Endpoints),
    Layout { dir: PathBuf },
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Registry(endpoints) => {
                let shown: Vec<String> = endpoints.list.iter().map(|e| e.reference.to_string()).collect();
                write!(f, "Registry({})", shown.join(", then "))
            }
            Self::Layout { dir } => write!(f, "Layout({})", dir.display()),
        }
    }
}

/// One place a reference is asked for: a mirror, or its own registry.
struct Endpoint {
    client: Box<oci_client::Client>,
    /// The reference as this endpoint serves it.
    reference: RegistryReference,
    auth: RegistryAuth,
    /// The registry this one mirrors; `None` for the registry itself.
    mirror_of: Option<String>,
}

/// The mirrors of one operation's registry, then the registry; a mirror
/// that failed once is skipped for the rest of the operation (a whole
/// pull, for a [`Fetcher`]).
struct Endpoints {
    list: Vec<Endpoint>,
    skipped: std::sync::Mutex<Vec<bool>>,
    /// The client's record of failed mirrors, to add to.
    failed_mirrors: Arc<std::sync::Mutex<HashMap<String, Instant>>>,
}

impl Endpoints {
    /// The endpoints to ask, in order, leaving out mirrors that failed.
    fn live(&self) -> impl Iterator<Item = (usize, &Endpoint)> {
        let skipped = self.skipped.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        self.list.iter().enumerate().filter(move |(i, _)| !skipped[*i])
    }

    /// After endpoint `i` failed with `error`: a mirror is logged and
    /// skipped from then on, so the next is asked; the registry's own
    /// failure is the answer.
    fn failed(&self, i: usize, error: RegistryError) -> Result<(), RegistryError> {
        let endpoint = &self.list[i];
        let Some(origin) = &endpoint.mirror_of else { return Err(error) };
        let mirror = endpoint.reference.registry();
        tracing::warn!(%mirror, %origin, %error, retry_after = ?MIRROR_RETRY_AFTER,
            "a registry mirror failed; the origin is asked instead");
        self.skipped.lock().unwrap_or_else(std::sync::PoisonError::into_inner)[i] = true;
        self.failed_mirrors
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(mirror.to_owned(), Instant::now());
        Ok(())
    }

    /// What is answered if every endpoint was passed over, which cannot be:
    /// the registry itself comes last and is never skipped.
    fn exhausted() -> RegistryError {
        RegistryError::Config("no registry left to ask".to_owned())
    }
}

/// The digest `endpoint` says its reference's tag names.
async fn resolve_at(endpoint: &Endpoint) -> Result<Digest, RegistryError> {
    let reference = &endpoint.reference;
    let text = endpoint
        .client
        .fetch_manifest_digest(reference.oci(), &endpoint.auth)
        .await
        .map_err(|e| from_oci(e, Target::Tag(reference)))?;
    text.parse().map_err(|e| RegistryError::Refused {
        registry: reference.registry().to_owned(),
        detail: format!("it answered with an unusable digest: {e}"),
    })
}

/// The manifest `digest` from `endpoint`, checked against it.
async fn manifest_at(endpoint: &Endpoint, digest: &Digest) -> Result<Vec<u8>, RegistryError> {
    let reference = &endpoint.reference;
    let pinned = reference_pinned(reference, digest);
    let (bytes, _) = endpoint
        .client
        .pull_manifest_raw(pinned.oci(), &endpoint.auth, &crate::oci_image::ACCEPTED_MANIFESTS)
        .await
        .map_err(|e| from_oci(e, Target::Manifest(reference, digest)))?;
    checked_manifest(bytes.to_vec(), digest)
}

/// Streams the blob `descriptor` names from `endpoint` into `out` (emptied
/// first), checking it against the descriptor.
async fn blob_at(endpoint: &Endpoint, descriptor: &Descriptor, out: &mut impl BlobSink) -> Result<(), RegistryError> {
    let what = format!("blob {}", descriptor.digest);
    let reference = &endpoint.reference;
    out.restart().await.map_err(download_error)?;
    let mut hasher = Hasher::default();
    let digest = descriptor.digest.to_string();
    let mut stream = endpoint
        .client
        .pull_blob_stream(reference.oci(), digest.as_str())
        .await
        .map_err(|e| from_oci(e, Target::Blob(reference, &descriptor.digest)))?;
    while let Some(chunk) = stream.stream.next().await {
        let chunk = chunk.map_err(|e| from_stream_error(e, reference, &what, &descriptor.digest))?;
        hasher.update(&chunk);
        if hasher.len() > descriptor.size {
            return Err(overflow(&hasher, descriptor, &what));
        }
        out.write_all(&chunk).await.map_err(download_error)?;
    }
    out.flush().await.map_err(download_error)?;
    checked_blob(hasher, descriptor, &what)
}

fn download_error(source: std::io::Error) -> RegistryError {
    RegistryError::Layout { path: "the download".to_owned(), source }
}

/// More bytes came than the descriptor says the blob has.
fn overflow(hasher: &Hasher, descriptor: &Descriptor, what: &str) -> RegistryError {
    RegistryError::DigestMismatch {
        what: what.to_owned(),
        expected: format!("{} ({} bytes)", descriptor.digest, descriptor.size),
        actual: format!("more than {} bytes", hasher.len()),
    }
}

/// Where a blob is streamed: what a failed try wrote can be thrown away
/// before the next endpoint is asked.
pub(crate) trait BlobSink: tokio::io::AsyncWrite + Unpin + Send {
    /// Empties it, for another try.
    fn restart(&mut self) -> impl std::future::Future<Output = std::io::Result<()>> + Send;
}

impl BlobSink for Vec<u8> {
    async fn restart(&mut self) -> std::io::Result<()> {
        self.clear();
        Ok(())
    }
}

impl BlobSink for tokio::fs::File {
    async fn restart(&mut self) -> std::io::Result<()> {
        use tokio::io::AsyncSeekExt as _;
        self.set_len(0).await?;
        self.seek(std::io::SeekFrom::Start(0)).await.map(|_| ())
    }
}

impl Fetcher {
    /// The manifest with `digest`, checked against it.
    pub(crate) async fn manifest(&self, digest: &Digest) -> Result<Vec<u8>, RegistryError> {
        let bytes = match &self.source {
            Source::Registry(endpoints) => {
                for (i, endpoint) in endpoints.live() {
                    match manifest_at(endpoint, digest).await {
                        Ok(bytes) => return Ok(bytes),
                        Err(error) => endpoints.failed(i, error)?,
                    }
                }
                return Err(Endpoints::exhausted());
            }
            Source::Layout { dir } => {
                let path = layout::blob_path(dir, digest);
                let (shown, digest_owned) = (self.shown.clone(), digest.clone());
                blocking(move || {
                    layout::read_bounded(&path, MAX_MANIFEST_BYTES).map_err(|e| match e.kind() {
                        std::io::ErrorKind::NotFound => {
                            RegistryError::ManifestNotFound { reference: shown.clone(), digest: digest_owned.clone() }
                        }
                        std::io::ErrorKind::InvalidData => RegistryError::TooLarge {
                            what: format!("manifest {digest_owned}"),
                            size: MAX_MANIFEST_BYTES + 1,
                            limit: MAX_MANIFEST_BYTES,
                        },
                        _ => RegistryError::RegistryUnavailable { registry: shown.clone(), detail: e.to_string() },
                    })
                })
                .await?
            }
        };
        checked_manifest(bytes, digest)
    }

    /// A blob of at most `limit` bytes, in memory, checked against its descriptor.
    pub(crate) async fn small_blob(&self, descriptor: &Descriptor, limit: u64) -> Result<Vec<u8>, RegistryError> {
        let mut bytes = Vec::new();
        self.blob(descriptor, limit, &mut bytes).await?;
        Ok(bytes)
    }

    /// Streams a blob of at most `limit` bytes into `out`, hashing as it goes; fails,
    /// having written part of it, when the content does not match the descriptor. What
    /// a failed mirror wrote is thrown away before the next endpoint is asked.
    pub(crate) async fn blob(
        &self,
        descriptor: &Descriptor,
        limit: u64,
        out: &mut impl BlobSink,
    ) -> Result<(), RegistryError> {
        let what = format!("blob {}", descriptor.digest);
        if descriptor.size > limit {
            return Err(RegistryError::TooLarge { what, size: descriptor.size, limit });
        }
        let mut hasher = Hasher::default();
        match &self.source {
            Source::Registry(endpoints) => {
                for (i, endpoint) in endpoints.live() {
                    match blob_at(endpoint, descriptor, out).await {
                        Ok(()) => return Ok(()),
                        Err(error) => endpoints.failed(i, error)?,
                    }
                }
                return Err(Endpoints::exhausted());
            }
            Source::Layout { dir } => {
                let path = layout::blob_path(dir, &descriptor.digest);
                let mut file = tokio::fs::File::open(&path).await.map_err(|e| match e.kind() {
                    std::io::ErrorKind::NotFound => {
                        RegistryError::BlobNotFound { reference: self.shown.clone(), digest: descriptor.digest.clone() }
                    }
                    _ => RegistryError::RegistryUnavailable { registry: self.shown.clone(), detail: e.to_string() },
                })?;
                let mut buffer = vec![0; COPY_BUFFER_BYTES];
                loop {
                    let n = file.read(&mut buffer).await.map_err(|e| RegistryError::RegistryUnavailable {
                        registry: self.shown.clone(),
                        detail: format!("{}: {e}", path.display()),
                    })?;
                    if n == 0 {
                        break;
                    }
                    hasher.update(&buffer[..n]);
                    if hasher.len() > descriptor.size {
                        return Err(overflow(&hasher, descriptor, &what));
                    }
                    out.write_all(&buffer[..n]).await.map_err(download_error)?;
                }
            }
        }
        out.flush().await.map_err(download_error)?;
        checked_blob(hasher, descriptor, &what)
    }
}

/// `bytes` when they are the manifest `digest` names, within the size limit.
fn checked_manifest(bytes: Vec<u8>, digest: &Digest) -> Result<Vec<u8>, RegistryError> {
    let size = bytes.len() as u64;
    if size > MAX_MANIFEST_BYTES {
        return Err(RegistryError::TooLarge { what: format!("manifest {digest}"), size, limit: MAX_MANIFEST_BYTES });
    }
    let actual = Digest::of(&bytes);
    if actual != *digest {
        return Err(RegistryError::DigestMismatch {
            what: "manifest".to_owned(),
            expected: digest.to_string(),
            actual: actual.to_string(),
        });
    }
    Ok(bytes)
}

/// Whether what `hasher` took is the blob `descriptor` names.
fn checked_blob(hasher: Hasher, descriptor: &Descriptor, what: &str) -> Result<(), RegistryError> {
    let size = hasher.len();
    let actual = hasher.finish();
    if size != descriptor.size || actual != descriptor.digest {
        return Err(RegistryError::DigestMismatch {
            what: what.to_owned(),
            expected: format!("{} ({} bytes)", descriptor.digest, descriptor.size),
            actual: format!("{actual} ({size} bytes)"),
        });
    }
    Ok(())
}

fn reference_pinned(reference: &RegistryReference, digest: &Digest) -> RegistryReference {
    match BundleReference::Registry(reference.clone()).pinned(digest) {
        BundleReference::Registry(pinned) => pinned,
        BundleReference::Layout(_) => reference.clone(),
    }
}

/// What a failed registry call was about, to say which thing was not found.
#[derive(Clone, Copy)]
enum Target<'a> {
    Tag(&'a RegistryReference),
    Manifest(&'a RegistryReference, &'a Digest),
    Blob(&'a RegistryReference, &'a Digest),
    Push(&'a RegistryReference),
}

impl Target<'_> {
    fn reference(&self) -> &RegistryReference {
        match self {
            Self::Tag(r) | Self::Manifest(r, _) | Self::Blob(r, _) | Self::Push(r) => r,
        }
    }

    fn not_found(&self, detail: String) -> RegistryError {
        match *self {
            Self::Tag(r) => RegistryError::TagNotFound { reference: r.to_string() },
            Self::Manifest(r, digest) => {
                RegistryError::ManifestNotFound { reference: r.to_string(), digest: digest.clone() }
            }
            Self::Blob(r, digest) => RegistryError::BlobNotFound { reference: r.to_string(), digest: digest.clone() },
            Self::Push(r) => RegistryError::Refused { registry: r.registry().to_owned(), detail },
        }
    }
}

/// The error a caller acts on, for what oci-client reported.
fn from_oci(error: OciDistributionError, target: Target<'_>) -> RegistryError {
    let registry = target.reference().registry().to_owned();
    let detail = error_chain(&error);
    let by_status = |status: u16, detail: String| match status {
        401 | 403 => RegistryError::Unauthorized { registry: registry.clone(), detail },
        404 => target.not_found(detail),
        429 | 500..=599 => RegistryError::RegistryUnavailable { registry: registry.clone(), detail },
        _ => RegistryError::Refused { registry: registry.clone(), detail },
    };
    match error {
        OciDistributionError::UnauthorizedError { .. } | OciDistributionError::AuthenticationFailure(_) => {
            RegistryError::Unauthorized { registry, detail }
        }
        OciDistributionError::RegistryError { ref envelope, .. } => {
            let code = envelope.errors.first().map(|e| &e.code);
            match code {
                Some(OciErrorCode::Unauthorized | OciErrorCode::Denied) => {
                    RegistryError::Unauthorized { registry, detail }
                }
                Some(
                    OciErrorCode::ManifestUnknown
                    | OciErrorCode::NameUnknown
                    | OciErrorCode::NotFound
                    | OciErrorCode::BlobUnknown,
                ) => target.not_found(detail),
                Some(OciErrorCode::NameInvalid | OciErrorCode::TagInvalid) => {
                    RegistryError::InvalidReference { reference: target.reference().to_string(), reason: detail }
                }
                Some(OciErrorCode::Toomanyrequests) => RegistryError::RegistryUnavailable { registry, detail },
                _ => RegistryError::Refused { registry, detail },
            }
        }
        OciDistributionError::ServerError { code, .. } => by_status(code, detail),
        OciDistributionError::RequestError(ref e) => match e.status() {
            Some(status) => by_status(status.as_u16(), detail),
            None => RegistryError::RegistryUnavailable { registry, detail },
        },
        OciDistributionError::IoError(_) => RegistryError::RegistryUnavailable { registry, detail },
        OciDistributionError::DigestError(oci_client::errors::DigestError::VerificationError {
            ref expected,
            ref actual,
        }) => RegistryError::DigestMismatch {
            what: match target {
                Target::Manifest(..) => "manifest".to_owned(),
                _ => "blob".to_owned(),
            },
            expected: expected.clone(),
            actual: actual.clone(),
        },
        _ => RegistryError::Refused { registry, detail },
    }
}

/// The error for a failure in the middle of a blob stream.
fn from_stream_error(
    error: std::io::Error,
    reference: &RegistryReference,
    what: &str,
    digest: &Digest,
) -> RegistryError {
    if let Some(oci_client::errors::DigestError::VerificationError { actual, .. }) =
        error.get_ref().and_then(|inner| inner.downcast_ref::<oci_client::errors::DigestError>())
    {
        return RegistryError::DigestMismatch {
            what: what.to_owned(),
            expected: digest.to_string(),
            actual: actual.clone(),
        };
    }
    RegistryError::RegistryUnavailable { registry: reference.registry().to_owned(), detail: error_chain(&error) }
}

/// An error and its sources on one line, repeats dropped.
fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next = Some(error);
    while let Some(e) = next {
        let text = e.to_string().split_whitespace().collect::<Vec<_>>().join(" ");
        if !text.is_empty() && !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        next = e.source();
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_and_named_hosts_speak_plain_http() {
        let client = BundleClient::new(RegistryConfig {
            insecure_registries: vec!["registry.lan".into(), "10.0.0.5:5000".into()],
            ..RegistryConfig::default()
        })
        .unwrap();
        for plain in
            ["127.0.0.1:5000", "localhost:5000", "localhost", "[::1]:5000", "registry.lan:443", "10.0.0.5:5000"]
        {
            assert!(client.plain_http(plain), "{plain} should be plain HTTP");
        }
        for tls in ["registry.example.com", "10.0.0.5:5001", "registry.lan.example.com"] {
            assert!(!client.plain_http(tls), "{tls} should be HTTPS");
        }
    }

    #[test]
    fn a_ca_without_certificates_is_refused() {
        let config = RegistryConfig { ca_pem: Some("not a certificate".into()), ..RegistryConfig::default() };
        assert!(matches!(BundleClient::new(config), Err(RegistryError::Config(_))));
    }

    #[test]
    fn credentials_never_print_their_secret() {
        let basic = RegistryCredentials::Basic { username: "ci".into(), password: "hunter2".into() };
        let bearer = RegistryCredentials::Bearer { token: "tok".into() };
        assert!(!format!("{basic:?}").contains("hunter2"));
        assert!(!format!("{bearer:?}").contains("tok"));
    }
}
