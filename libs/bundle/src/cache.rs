//! The node's bundle cache: pulls bundles and container images by digest, verifies every
//! blob, extracts each one safely and atomically, hands out ready-to-run definitions pinned
//! while in use, and evicts the least recently used unpinned ones past a size budget.
//!
//! # What is stored
//! ```text
//! ROOT/blobs/sha256/<hex>       manifests, configs and bundle layers, each verified
//! ROOT/bundles/sha256/<hex>/    the extracted bundle, or the unpacked image root, of <hex>
//! ROOT/used/<hex>               empty; its mtime is the bundle's last use
//! ROOT/owners/<hex>             who an image's layers say owns what, where not root (JSON)
//! ROOT/tmp/                     downloads and extractions in flight, emptied on open
//! ```
//! A container image is kept as its root filesystem alone: its layers are unpacked in
//! order (see [`crate::unpack_image_layer`]) and then dropped, since the root is what
//! runs and the layers can be pulled again. An image index's digest names the root of
//! the one manifest in it for this node's platform; the index, that manifest and the
//! image config are kept as blobs, so a restart knows what the root runs. The root is
//! shared by every lease of its digest and never written after it is renamed into
//! place: each lease's runtime gives it its own copy-on-write view. A pin is the root's
//! reference count.
//! A bundle directory appears only by a rename of a fully extracted and checked tree, after
//! its blobs are stored, so a crash never leaves half a bundle: what is in `tmp/` is
//! removed on open, and so are blobs of no bundle and bundles without their blobs.
//!
//! # Who writes this
//! One [`BundleCache`] per directory (the agent's). Two pulls of one digest at once both
//! download; the second rename finds the bundle in place and uses it.
//!
//! # Expected flow
//! [`BundleCache::pull`] returns a [`ReadyBundle`]; holding it (or a clone of its
//! [`BundlePin`]) keeps the bundle from eviction, dropping it makes it evictable. A pull of
//! a bundle already present touches no network.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::SystemTime;

use std::os::unix::fs::PermissionsExt as _;

use crate::client::{BundleClient, Fetcher, RegistryCredentials};
use crate::digest::{Digest, digest_reader};
use crate::extract::{BundleLimits, ExtractError, extract_layer};
use crate::format::{BundleConfig, BundleManifest, Descriptor, FormatError, MAX_CONFIG_BYTES, MAX_MANIFEST_BYTES};
use crate::image::unpack_image_layer;
use crate::image_user::{ImageOwners, ImageUser};
use crate::layout::{read_bounded, write_atomically};
use crate::oci_image::{ImageManifest, ImageRun, ManifestKind, classify};
use crate::reference::BundleReference;
use crate::registry_error::RegistryError;
use crate::spec::BundlePort;

/// The most of an image's kept owners read back: a path of every entry within
/// the entry limit fits.
const MAX_OWNERS_BYTES: u64 = 64 << 20;

/// How much disk the cache may use by default before evicting, 20 GiB.
pub const DEFAULT_CACHE_BUDGET_BYTES: u64 = 20 << 30;

/// Why a bundle could not be made ready.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// The reference names a tag; the cache pulls by digest only, so what runs is always
    /// what the control plane resolved.
    #[error("{reference} names no digest; the cache pulls by digest only")]
    NotPinned {
        /// The reference.
        reference: String,
    },
    /// Fetching from the registry or layout failed, or content did not match its digest.
    #[error(transparent)]
    Fetch(#[from] RegistryError),
    /// The manifest or config is not a berth bundle.
    #[error("bundle {digest} is not usable: {source}")]
    NotABundle {
        /// The manifest digest.
        digest: Digest,
        /// What is wrong.
        #[source]
        source: FormatError,
    },
    /// The manifest, index or config is not of a container image this node can run.
    #[error("image {digest} is not usable: {source}")]
    NotAnImage {
        /// The manifest digest.
        digest: Digest,
        /// What is wrong.
        #[source]
        source: FormatError,
    },
    /// The layer holds an unsafe or oversized entry, or is not a tar.
    #[error("bundle {digest} refused: {source}")]
    Unsafe {
        /// The manifest digest.
        digest: Digest,
        /// Which entry and why.
        #[source]
        source: ExtractError,
    },
    /// The extracted files do not match the config's module list or entrypoint.
    #[error("bundle {digest} refused: {path}: {reason}")]
    ModuleMismatch {
        /// The manifest digest.
        digest: Digest,
        /// The module or entrypoint.
        path: String,
        /// How it differs.
        reason: String,
    },
    /// The cache directory could not be read or written.
    #[error("bundle cache: {path}: {source}")]
    Io {
        /// The path.
        path: String,
        /// Why.
        #[source]
        source: io::Error,
    },
}

fn io_error(path: &Path, source: io::Error) -> CacheError {
    CacheError::Io { path: path.display().to_string(), source }
}

/// How the cache behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheOptions {
    /// Disk the cache may use (bundles and blobs) before evicting unpinned bundles.
    pub budget_bytes: u64,
    /// The limits each bundle is extracted within.
    pub limits: BundleLimits,
}

impl Default for CacheOptions {
    fn default() -> Self {
        Self { budget_bytes: DEFAULT_CACHE_BUDGET_BYTES, limits: BundleLimits::default() }
    }
}

/// What a bundle needs to run, all paths absolute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BundleDefinition {
    /// The manifest digest.
    pub digest: Digest,
    /// The extracted bundle; the program's working directory.
    pub root: PathBuf,
    /// The program: inside `root`, or an absolute path on the node.
    pub entrypoint: PathBuf,
    /// Arguments passed to the program.
    pub args: Vec<String>,
    /// Environment variables for the program.
    pub env: BTreeMap<String, String>,
    /// The ports the program listens on.
    pub ports: Vec<BundlePort>,
    /// Set when the digest is a container image: `root` is then its unpacked root
    /// filesystem, what runs is this config, and the fields above are empty.
    pub image: Option<Arc<ImageRun>>,
}

/// A bundle in the cache, kept from eviction while this (or a clone of its pin) lives.
#[derive(Debug, Clone)]
pub struct ReadyBundle {
    definition: BundleDefinition,
    pin: BundlePin,
}

impl ReadyBundle {
    /// How to run it.
    pub fn definition(&self) -> &BundleDefinition {
        &self.definition
    }

    /// The pin that keeps it from eviction.
    pub fn pin(&self) -> &BundlePin {
        &self.pin
    }
}

/// Keeps a bundle from eviction until dropped; clones pin too.
#[derive(Debug)]
pub struct BundlePin {
    cache: Arc<Inner>,
    digest: Digest,
}

impl BundlePin {
    fn new(cache: &Arc<Inner>, state: &mut State, digest: &Digest) -> Self {
        if let Some(entry) = state.bundles.get_mut(digest) {
            entry.pins += 1;
        }
        Self { cache: Arc::clone(cache), digest: digest.clone() }
    }

    /// The pinned bundle's digest.
    pub fn digest(&self) -> &Digest {
        &self.digest
    }
}

impl Clone for BundlePin {
    fn clone(&self) -> Self {
        let mut state = self.cache.lock();
        Self::new(&self.cache, &mut state, &self.digest)
    }
}

impl Drop for BundlePin {
    fn drop(&mut self) {
        let mut state = self.cache.lock();
        if let Some(entry) = state.bundles.get_mut(&self.digest) {
            entry.pins = entry.pins.saturating_sub(1);
        }
    }
}

/// What the cache holds now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheUsage {
    /// Bundles present.
    pub bundles: usize,
    /// Bundles pinned.
    pub pinned: usize,
    /// Disk used by bundles and their blobs.
    pub bytes: u64,
}

/// What one eviction pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EvictionReport {
    /// Bundles removed, least recently used first.
    pub evicted: Vec<Digest>,
    /// Bytes freed.
    pub freed_bytes: u64,
    /// Whether the cache is still over budget because what remains is pinned.
    pub over_budget: bool,
}

/// The node's bundle cache; cheap to clone, clones share state.
#[derive(Debug, Clone)]
pub struct BundleCache {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    root: PathBuf,
    options: CacheOptions,
    state: Mutex<State>,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The state stays consistent at every await-free step, so a panic elsewhere
        // while holding the lock leaves nothing half-done.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn blobs(&self) -> PathBuf {
        self.root.join("blobs").join("sha256")
    }

    fn bundles(&self) -> PathBuf {
        self.root.join("bundles").join("sha256")
    }

    fn used(&self) -> PathBuf {
        self.root.join("used")
    }

    fn owners(&self) -> PathBuf {
        self.root.join("owners")
    }

    fn tmp(&self) -> PathBuf {
        self.root.join("tmp")
    }

    fn bundle_dir(&self, digest: &Digest) -> PathBuf {
        self.bundles().join(digest.hex())
    }
}

#[derive(Debug, Default)]
struct State {
    bundles: HashMap<Digest, Entry>,
    /// Blobs of bundles being installed, which eviction must leave in place.
    installing: HashMap<Digest, usize>,
    /// Orders uses within one clock tick.
    uses: u64,
}

#[derive(Debug)]
struct Entry {
    run: Run,
    /// The blobs kept for it besides its manifest.
    blobs: Vec<Digest>,
    size: u64,
    last_used: (SystemTime, u64),
    pins: usize,
}

/// What an entry runs.
#[derive(Debug, Clone)]
enum Run {
    Bundle(Arc<BundleConfig>),
    Image(Arc<ImageRun>),
}

impl BundleCache {
    /// Opens (creating if needed) the cache at `root`, clearing what a crash left behind.
    pub async fn open(root: impl Into<PathBuf>, options: CacheOptions) -> Result<Self, CacheError> {
        let root = root.into();
        let scanned = {
            let root = root.clone();
            tokio::task::spawn_blocking(move || scan(&root))
                .await
                .map_err(|e| io_error(Path::new("<scan>"), io::Error::other(e.to_string())))??
        };
        let state = State { bundles: scanned, installing: HashMap::new(), uses: 0 };
        Ok(Self { inner: Arc::new(Inner { root, options, state: Mutex::new(state) }) })
    }

    /// The cache directory.
    pub fn root(&self) -> &Path {
        &self.inner.root
    }

    /// Where the bundle of manifest `digest` is (or would be) extracted.
    pub fn bundle_dir(&self, digest: &Digest) -> PathBuf {
        self.inner.bundle_dir(digest)
    }

    /// What the cache holds now.
    pub fn usage(&self) -> CacheUsage {
        let state = self.inner.lock();
        CacheUsage {
            bundles: state.bundles.len(),
            pinned: state.bundles.values().filter(|e| e.pins > 0).count(),
            bytes: state.bundles.values().map(|e| e.size).sum(),
        }
    }

    /// The bundle of manifest `digest` if it is here, pinned; never touches the network.
    pub async fn get(&self, digest: &Digest) -> Result<Option<ReadyBundle>, CacheError> {
        let ready = {
            let mut state = self.inner.lock();
            self.ready_locked(&mut state, digest)
        };
        if ready.is_some() {
            self.record_use(digest).await;
        }
        Ok(ready)
    }

    /// The bundle `reference` pins by digest, ready to run: from the cache when present,
    /// otherwise fetched, verified and extracted. Evicts past the budget afterwards.
    pub async fn pull(
        &self,
        client: &BundleClient,
        reference: &BundleReference,
        credentials: &RegistryCredentials,
    ) -> Result<ReadyBundle, CacheError> {
        let digest =
            reference.digest().cloned().ok_or_else(|| CacheError::NotPinned { reference: reference.to_string() })?;
        if let Some(ready) = self.get(&digest).await? {
            return Ok(ready);
        }
        let ready = self.fetch(client, reference, credentials, &digest).await?;
        let report = self.evict().await?;
        if report.over_budget {
            tracing::warn!(
                budget = self.inner.options.budget_bytes,
                "bundle cache is over budget: every bundle left is in use"
            );
        }
        Ok(ready)
    }

    /// Removes unpinned bundles, least recently used first, until the cache fits its budget.
    pub async fn evict(&self) -> Result<EvictionReport, CacheError> {
        let mut report = EvictionReport::default();
        let mut parked: Vec<PathBuf> = Vec::new();
        {
            let mut state = self.inner.lock();
            let mut total: u64 = state.bundles.values().map(|e| e.size).sum();
            let mut candidates: Vec<(Digest, (SystemTime, u64))> =
                state.bundles.iter().filter(|(_, e)| e.pins == 0).map(|(d, e)| (d.clone(), e.last_used)).collect();
            candidates.sort_by_key(|candidate| candidate.1);
            for (digest, _) in candidates {
                if total <= self.inner.options.budget_bytes {
                    break;
                }
                let Some(entry) = state.bundles.remove(&digest) else { continue };
                state.uses += 1;
                let place = self.inner.tmp().join(format!("evicted-{}-{}", digest.hex(), state.uses));
                self.park(&state, &digest, &entry, &place)?;
                parked.push(place);
                total -= entry.size;
                report.freed_bytes += entry.size;
                report.evicted.push(digest);
            }
            report.over_budget = total > self.inner.options.budget_bytes;
        }
        if !parked.is_empty() {
            tokio::task::spawn_blocking(move || {
                for place in parked {
                    let _ = fs::remove_dir_all(&place);
                }
            })
            .await
            .map_err(|e| io_error(Path::new("<evict>"), io::Error::other(e.to_string())))?;
        }
        for digest in &report.evicted {
            tracing::info!(%digest, "evicted bundle");
        }
        Ok(report)
    }

    /// Moves an evicted bundle's tree, and the blobs nothing else needs, into `place`:
    /// renames only, under the lock, so no pull ever sees half a bundle or loses a blob
    /// it is installing; the slow delete happens after.
    fn park(&self, state: &State, digest: &Digest, entry: &Entry, place: &Path) -> Result<(), CacheError> {
        fs::create_dir_all(place).map_err(|e| io_error(place, e))?;
        let tree = self.inner.bundle_dir(digest);
        match fs::rename(&tree, place.join("tree")) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_error(&tree, e)),
        }
        let _ = fs::rename(self.inner.used().join(digest.hex()), place.join("used"));
        let _ = fs::rename(self.inner.owners().join(digest.hex()), place.join("owners"));
        let still_needed: HashSet<&Digest> = state
            .bundles
            .iter()
            .flat_map(|(d, e)| std::iter::once(d).chain(e.blobs.iter()))
            .chain(state.installing.keys())
            .collect();
        for blob in std::iter::once(digest).chain(entry.blobs.iter()) {
            if !still_needed.contains(blob) {
                let _ = fs::rename(self.inner.blobs().join(blob.hex()), place.join(blob.hex()));
            }
        }
        Ok(())
    }

    fn ready_locked(&self, state: &mut State, digest: &Digest) -> Option<ReadyBundle> {
        state.uses += 1;
        let uses = state.uses;
        let entry = state.bundles.get_mut(digest)?;
        entry.last_used = (SystemTime::now(), uses);
        let definition = definition(&self.inner.bundle_dir(digest), digest, &entry.run);
        Some(ReadyBundle { definition, pin: BundlePin::new(&self.inner, state, digest) })
    }

    async fn record_use(&self, digest: &Digest) {
        let path = self.inner.used().join(digest.hex());
        let result = tokio::task::spawn_blocking(move || touch(&path)).await;
        if let Ok(Err(error)) = result {
            tracing::warn!(%digest, %error, "cannot record the bundle's last use");
        }
    }

    async fn fetch(
        &self,
        client: &BundleClient,
        reference: &BundleReference,
        credentials: &RegistryCredentials,
        digest: &Digest,
    ) -> Result<ReadyBundle, CacheError> {
        let fetcher = client.fetcher(reference, credentials)?;
        let manifest_bytes = fetcher.manifest(digest).await?;
        let not_an_image = |source| CacheError::NotAnImage { digest: digest.clone(), source };
        let image = match classify(&manifest_bytes).map_err(not_an_image)? {
            ManifestKind::Bundle => None,
            ManifestKind::Image(image) => Some((image, Vec::new())),
            ManifestKind::Index(entries) => {
                let chosen = entries.into_iter().next().ok_or_else(|| {
                    not_an_image(FormatError::NotAnImage("the index has no image for this node".to_owned()))
                })?;
                let child = fetcher.manifest(&chosen.digest).await?;
                match classify(&child).map_err(not_an_image)? {
                    ManifestKind::Image(image) => Some((image, vec![(chosen.digest, child)])),
                    _ => {
                        return Err(not_an_image(FormatError::NotAnImage(format!(
                            "index entry {} is not an image manifest",
                            chosen.digest
                        ))));
                    }
                }
            }
        };
        if let Some((image, mut kept)) = image {
            kept.insert(0, (digest.clone(), manifest_bytes));
            return self.fetch_image(&fetcher, digest, image, kept).await;
        }
        let not_a_bundle = |source| CacheError::NotABundle { digest: digest.clone(), source };
        let manifest = BundleManifest::parse(&manifest_bytes).map_err(not_a_bundle)?;
        let config_bytes = fetcher.small_blob(&manifest.config, MAX_CONFIG_BYTES).await?;
        let config = BundleConfig::parse(&config_bytes).map_err(not_a_bundle)?;
        let layer =
            manifest.layer().cloned().ok_or_else(|| not_a_bundle(FormatError::NotABundle("no layer".to_owned())))?;

        let download = self.download_layer(&fetcher, &layer).await?;

        let blobs = [manifest.config.digest.clone(), layer.digest.clone()];
        let _installing = Installing::new(&self.inner, vec![digest.clone(), blobs[0].clone(), blobs[1].clone()]);
        let inner = Arc::clone(&self.inner);
        let (digest_owned, config_owned) = (digest.clone(), config.clone());
        let size = tokio::task::spawn_blocking(move || {
            install(&inner, &digest_owned, &manifest, &manifest_bytes, &config_owned, &config_bytes, download)
        })
        .await
        .map_err(|e| io_error(&self.inner.tmp(), io::Error::other(e.to_string())))??;

        let ready = {
            let mut state = self.inner.lock();
            state.bundles.entry(digest.clone()).or_insert_with(|| Entry {
                run: Run::Bundle(Arc::new(config)),
                blobs: blobs.to_vec(),
                size,
                last_used: (SystemTime::now(), 0),
                pins: 0,
            });
            self.ready_locked(&mut state, digest)
        };
        self.record_use(digest).await;
        ready.ok_or_else(|| io_error(&self.bundle_dir(digest), io::Error::other("the bundle vanished after install")))
    }

    /// Downloads one layer blob, verified, into a temporary file under `tmp/`.
    async fn download_layer(&self, fetcher: &Fetcher, layer: &Descriptor) -> Result<tempfile::TempPath, CacheError> {
        let tmp = self.inner.tmp();
        tokio::fs::create_dir_all(&tmp).await.map_err(|e| io_error(&tmp, e))?;
        let download = tempfile::Builder::new()
            .prefix("layer-")
            .tempfile_in(&tmp)
            .map_err(|e| io_error(&tmp, e))?
            .into_temp_path();
        let mut file = tokio::fs::File::create(&download).await.map_err(|e| io_error(&download, e))?;
        fetcher.blob(layer, self.inner.options.limits.max_layer_bytes(), &mut file).await?;
        file.sync_all().await.map_err(|e| io_error(&download, e))?;
        Ok(download)
    }

    /// Fetches the image config and every layer of `image`, verified, unpacks the layers
    /// in order into a private root, and renames it into place; `kept` are the verified
    /// manifests (the digest's own first) stored beside the config.
    async fn fetch_image(
        &self,
        fetcher: &Fetcher,
        digest: &Digest,
        image: ImageManifest,
        kept: Vec<(Digest, Vec<u8>)>,
    ) -> Result<ReadyBundle, CacheError> {
        let config_bytes = fetcher.small_blob(&image.config, MAX_CONFIG_BYTES).await?;
        let run = ImageRun::parse(&config_bytes)
            .map_err(|source| CacheError::NotAnImage { digest: digest.clone(), source })?;
        let mut blobs: Vec<Digest> = kept.iter().skip(1).map(|(d, _)| d.clone()).collect();
        blobs.push(image.config.digest.clone());
        let mut installing: Vec<Digest> = vec![digest.clone()];
        installing.extend(blobs.iter().cloned());
        let _installing = Installing::new(&self.inner, installing);

        let tmp = self.inner.tmp();
        tokio::fs::create_dir_all(&tmp).await.map_err(|e| io_error(&tmp, e))?;
        let staging = tempfile::Builder::new().prefix("image-").tempdir_in(&tmp).map_err(|e| io_error(&tmp, e))?;
        let limits = self.inner.options.limits;
        let mut owners = ImageOwners::default();
        for layer in &image.layers {
            let download = self.download_layer(fetcher, layer).await?;
            let (root, media_type) = (staging.path().to_path_buf(), layer.media_type.clone());
            let unpacked;
            (unpacked, owners) = tokio::task::spawn_blocking(move || {
                let unpacked = unpack_image_layer(&download, &media_type, &root, &limits, &mut owners);
                drop(download);
                (unpacked, owners)
            })
            .await
            .map_err(|e| io_error(&tmp, io::Error::other(e.to_string())))?;
            unpacked.map_err(|source| CacheError::Unsafe { digest: digest.clone(), source })?;
        }

        let inner = Arc::clone(&self.inner);
        let (digest_owned, config_digest) = (digest.clone(), image.config.digest.clone());
        let user = run.user.clone();
        let (size, account, owners) = tokio::task::spawn_blocking(move || {
            let account = ImageUser::resolve(&user, staging.path(), &owners).map_err(|reason| {
                CacheError::NotAnImage { digest: digest_owned.clone(), source: FormatError::NotAnImage(reason) }
            })?;
            let mut stored = kept;
            stored.push((config_digest, config_bytes));
            let size = install_image(&inner, &digest_owned, &stored, &owners, staging)?;
            Ok::<_, CacheError>((size, account, owners))
        })
        .await
        .map_err(|e| io_error(&self.inner.tmp(), io::Error::other(e.to_string())))??;
        let run = ImageRun { account: account.map(Arc::new), owners: Arc::new(owners), ..run };

        let ready = {
            let mut state = self.inner.lock();
            state.bundles.entry(digest.clone()).or_insert_with(|| Entry {
                run: Run::Image(Arc::new(run)),
                blobs,
                size,
                last_used: (SystemTime::now(), 0),
                pins: 0,
            });
            self.ready_locked(&mut state, digest)
        };
        self.record_use(digest).await;
        tracing::info!(%digest, layers = image.layers.len(), "container image unpacked");
        ready.ok_or_else(|| io_error(&self.bundle_dir(digest), io::Error::other("the image vanished after install")))
    }
}

/// Marks blobs as being installed for as long as it lives.
struct Installing {
    cache: Arc<Inner>,
    blobs: Vec<Digest>,
}

impl Installing {
    fn new(cache: &Arc<Inner>, blobs: Vec<Digest>) -> Self {
        let mut state = cache.lock();
        for blob in &blobs {
            *state.installing.entry(blob.clone()).or_default() += 1;
        }
        Self { cache: Arc::clone(cache), blobs }
    }
}

impl Drop for Installing {
    fn drop(&mut self) {
        let mut state = self.cache.lock();
        for blob in &self.blobs {
            if let Some(count) = state.installing.get_mut(blob) {
                *count -= 1;
                if *count == 0 {
                    state.installing.remove(blob);
                }
            }
        }
    }
}

impl BundleLimits {
    /// The largest layer blob a bundle within these limits can have: its tar, plus what
    /// gzip adds to incompressible data.
    pub(crate) fn max_layer_bytes(&self) -> u64 {
        let tar = self.max_stream_bytes();
        tar.saturating_add(tar / 64).saturating_add(1 << 20)
    }
}

/// Extracts the downloaded layer, checks it against the config, stores the blobs and
/// renames the tree into place; the bundle's size on disk.
fn install(
    inner: &Inner,
    digest: &Digest,
    manifest: &BundleManifest,
    manifest_bytes: &[u8],
    config: &BundleConfig,
    config_bytes: &[u8],
    download: tempfile::TempPath,
) -> Result<u64, CacheError> {
    let layer = manifest.layer().ok_or_else(|| CacheError::NotABundle {
        digest: digest.clone(),
        source: FormatError::NotABundle("no layer".to_owned()),
    })?;
    let tmp = inner.tmp();
    let staging = tempfile::Builder::new().prefix("extract-").tempdir_in(&tmp).map_err(|e| io_error(&tmp, e))?;
    extract_layer(&download, &layer.media_type, staging.path(), &inner.options.limits)
        .map_err(|source| CacheError::Unsafe { digest: digest.clone(), source })?;
    check_modules(staging.path(), digest, config)?;

    let blobs = inner.blobs();
    fs::create_dir_all(&blobs).map_err(|e| io_error(&blobs, e))?;
    for (blob, bytes) in [(digest, manifest_bytes), (&manifest.config.digest, config_bytes)] {
        let path = blobs.join(blob.hex());
        write_atomically(&path, bytes).map_err(|e| io_error(&path, e))?;
    }
    let layer_path = blobs.join(layer.digest.hex());
    download.persist(&layer_path).map_err(|e| io_error(&layer_path, e.error))?;

    let size = tree_size(staging.path()).map_err(|e| io_error(staging.path(), e))?
        + manifest_bytes.len() as u64
        + config_bytes.len() as u64
        + layer.size;
    place_tree(inner, digest, staging)?;
    Ok(size)
}

/// Renames a fully extracted and checked tree into place as `digest`'s.
fn place_tree(inner: &Inner, digest: &Digest, staging: tempfile::TempDir) -> Result<(), CacheError> {
    let bundles = inner.bundles();
    fs::create_dir_all(&bundles).map_err(|e| io_error(&bundles, e))?;
    let target = inner.bundle_dir(digest);
    let staged = staging.keep();
    if let Err(error) = fs::rename(&staged, &target) {
        let _ = fs::remove_dir_all(&staged);
        // A concurrent pull of the same digest got there first; its tree is as good.
        if !target.is_dir() {
            return Err(io_error(&target, error));
        }
    }
    Ok(())
}

/// Stores an image's manifests, config and owners, and renames its unpacked
/// root into place; the image's size on disk.
fn install_image(
    inner: &Inner,
    digest: &Digest,
    stored: &[(Digest, Vec<u8>)],
    owners: &ImageOwners,
    staging: tempfile::TempDir,
) -> Result<u64, CacheError> {
    let blobs = inner.blobs();
    fs::create_dir_all(&blobs).map_err(|e| io_error(&blobs, e))?;
    for (blob, bytes) in stored {
        let path = blobs.join(blob.hex());
        write_atomically(&path, bytes).map_err(|e| io_error(&path, e))?;
    }
    if !owners.is_empty() {
        let dir = inner.owners();
        fs::create_dir_all(&dir).map_err(|e| io_error(&dir, e))?;
        let path = dir.join(digest.hex());
        let json = serde_json::to_vec(owners).map_err(|e| io_error(&path, io::Error::other(e)))?;
        write_atomically(&path, &json).map_err(|e| io_error(&path, e))?;
    }
    let size = tree_size(staging.path()).map_err(|e| io_error(staging.path(), e))?
        + stored.iter().map(|(_, bytes)| bytes.len() as u64).sum::<u64>();
    // The root is shown to workloads of other users: it must be traversable.
    fs::set_permissions(staging.path(), fs::Permissions::from_mode(0o755)).map_err(|e| io_error(staging.path(), e))?;
    place_tree(inner, digest, staging)?;
    Ok(size)
}

/// Checks that every module is a regular file of the listed size and digest, and that a
/// relative entrypoint is a file in the bundle.
fn check_modules(root: &Path, digest: &Digest, config: &BundleConfig) -> Result<(), CacheError> {
    let mismatch = |path: &str, reason: String| CacheError::ModuleMismatch {
        digest: digest.clone(),
        path: path.to_owned(),
        reason,
    };
    for module in &config.modules {
        let path = root.join(&module.path);
        let meta = fs::symlink_metadata(&path).map_err(|_| mismatch(&module.path, "missing from the layer".into()))?;
        if !meta.is_file() {
            return Err(mismatch(&module.path, "not a regular file in the layer".into()));
        }
        let file = fs::File::open(&path).map_err(|e| io_error(&path, e))?;
        let (actual, size) = digest_reader(file).map_err(|e| io_error(&path, e))?;
        if size != module.size || actual != module.digest {
            return Err(mismatch(
                &module.path,
                format!("is {actual} ({size} bytes), the config says {} ({} bytes)", module.digest, module.size),
            ));
        }
    }
    if !Path::new(&config.entrypoint).is_absolute() && !root.join(&config.entrypoint).is_file() {
        return Err(mismatch(&config.entrypoint, "the entrypoint is not a file in the bundle".into()));
    }
    Ok(())
}

fn definition(root: &Path, digest: &Digest, run: &Run) -> BundleDefinition {
    match run {
        Run::Bundle(config) => BundleDefinition {
            digest: digest.clone(),
            root: root.to_path_buf(),
            entrypoint: root.join(&config.entrypoint),
            args: config.args.clone(),
            env: config.env.clone(),
            ports: config.ports.clone(),
            image: None,
        },
        Run::Image(run) => BundleDefinition {
            digest: digest.clone(),
            root: root.to_path_buf(),
            entrypoint: PathBuf::new(),
            args: Vec::new(),
            env: BTreeMap::new(),
            ports: Vec::new(),
            image: Some(Arc::clone(run)),
        },
    }
}

/// Bytes of file content under `dir`, links not followed.
fn tree_size(dir: &Path) -> io::Result<u64> {
    let mut total = 0;
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let meta = fs::symlink_metadata(entry.path())?;
        if meta.is_dir() {
            total += tree_size(&entry.path())?;
        } else {
            total += meta.len();
        }
    }
    Ok(total)
}

fn touch(path: &Path) -> io::Result<()> {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent)?;
    }
    let file = fs::OpenOptions::new().create(true).truncate(false).write(true).open(path)?;
    file.set_modified(SystemTime::now())
}

/// Reads what a previous run left: clears `tmp/`, drops bundles without their blobs and
/// blobs of no bundle, and sizes what remains.
fn scan(root: &Path) -> Result<HashMap<Digest, Entry>, CacheError> {
    let inner_dirs = [
        root.join("blobs").join("sha256"),
        root.join("bundles").join("sha256"),
        root.join("used"),
        root.join("owners"),
    ];
    for dir in &inner_dirs {
        fs::create_dir_all(dir).map_err(|e| io_error(dir, e))?;
    }
    let tmp = root.join("tmp");
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| io_error(&tmp, e))?;
    }
    fs::create_dir_all(&tmp).map_err(|e| io_error(&tmp, e))?;
    let [blobs, bundles, used, owners] = inner_dirs;

    let mut found = HashMap::new();
    for entry in fs::read_dir(&bundles).map_err(|e| io_error(&bundles, e))? {
        let entry = entry.map_err(|e| io_error(&bundles, e))?;
        let path = entry.path();
        let loaded = entry.file_name().to_str().and_then(|name| Digest::from_hex(name).ok()).and_then(|digest| {
            let entry = load_entry(&blobs, &used, &owners, &path, &digest)?;
            Some((digest, entry))
        });
        match loaded {
            Some((digest, entry)) => {
                found.insert(digest, entry);
            }
            None => {
                tracing::warn!(path = %path.display(), "removing a cached bundle without its manifest or config");
                let _ = if path.is_dir() { fs::remove_dir_all(&path) } else { fs::remove_file(&path) };
            }
        }
    }
    let referenced: HashSet<String> =
        found.iter().flat_map(|(d, e)| std::iter::once(d).chain(e.blobs.iter())).map(|d| d.hex().to_owned()).collect();
    for dir in [&blobs, &used, &owners] {
        for entry in fs::read_dir(dir).map_err(|e| io_error(dir, e))? {
            let entry = entry.map_err(|e| io_error(dir, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let keep = if dir != &blobs {
                Digest::from_hex(&name).is_ok_and(|d| found.contains_key(&d))
            } else {
                referenced.contains(&name)
            };
            if !keep {
                let _ = fs::remove_file(entry.path());
            }
        }
    }
    Ok(found)
}

fn load_entry(blobs: &Path, used: &Path, owners: &Path, dir: &Path, digest: &Digest) -> Option<Entry> {
    if !fs::symlink_metadata(dir).ok()?.is_dir() {
        return None;
    }
    let manifest_bytes = read_bounded(&blobs.join(digest.hex()), MAX_MANIFEST_BYTES).ok()?;
    let last_used = fs::metadata(used.join(digest.hex()))
        .and_then(|m| m.modified())
        .or_else(|_| fs::metadata(dir).and_then(|m| m.modified()))
        .unwrap_or(SystemTime::UNIX_EPOCH);
    let image = match classify(&manifest_bytes).ok()? {
        ManifestKind::Bundle => None,
        ManifestKind::Image(image) => Some((image, Vec::new(), manifest_bytes.len() as u64)),
        ManifestKind::Index(entries) => {
            let chosen = entries.into_iter().next()?;
            let child = read_bounded(&blobs.join(chosen.digest.hex()), MAX_MANIFEST_BYTES).ok()?;
            match classify(&child).ok()? {
                ManifestKind::Image(image) => {
                    Some((image, vec![chosen.digest], (manifest_bytes.len() + child.len()) as u64))
                }
                _ => None?,
            }
        }
    };
    if let Some((image, mut kept, manifests_size)) = image {
        let config_bytes = read_bounded(&blobs.join(image.config.digest.hex()), MAX_CONFIG_BYTES).ok()?;
        let mut run = ImageRun::parse(&config_bytes).ok()?;
        // Kept when the image was unpacked, where any entry is not root's.
        let kept_owners = match read_bounded(&owners.join(digest.hex()), MAX_OWNERS_BYTES) {
            Ok(json) => serde_json::from_slice::<ImageOwners>(&json).ok()?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => ImageOwners::default(),
            Err(_) => return None,
        };
        run.account = ImageUser::resolve(&run.user, dir, &kept_owners).ok()?.map(Arc::new);
        run.owners = Arc::new(kept_owners);
        kept.push(image.config.digest);
        return Some(Entry {
            run: Run::Image(Arc::new(run)),
            blobs: kept,
            size: tree_size(dir).ok()? + manifests_size + config_bytes.len() as u64,
            last_used: (last_used, 0),
            pins: 0,
        });
    }
    let manifest = BundleManifest::parse(&manifest_bytes).ok()?;
    let config_bytes = read_bounded(&blobs.join(manifest.config.digest.hex()), MAX_CONFIG_BYTES).ok()?;
    let config = BundleConfig::parse(&config_bytes).ok()?;
    let layer = manifest.layer()?;
    let size = tree_size(dir).ok()? + manifest_bytes.len() as u64 + config_bytes.len() as u64 + layer.size;
    Some(Entry {
        run: Run::Bundle(Arc::new(config)),
        blobs: vec![manifest.config.digest.clone(), layer.digest.clone()],
        size,
        last_used: (last_used, 0),
        pins: 0,
    })
}
