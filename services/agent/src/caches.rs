//! Cache volumes on a node: the sealed generations it holds, each lease's
//! private copy-on-write view of a volume's head, and the seal that turns
//! a finished view into content a new generation can name.
//!
//! ```text
//! DATA_DIR/caches/empty/                                   the lower layer of a view of nothing
//! DATA_DIR/caches/volumes/<project>/<key>/sealed/<hex>/    one sealed content tree, named by its digest
//! DATA_DIR/caches/volumes/<project>/<key>/sealed/<hex>.index.json  each of its files' content digest
//! DATA_DIR/caches/volumes/<project>/<key>/generations/<N>  a link to the sealed tree generation N is
//! DATA_DIR/caches/volumes/<project>/<key>/staging/<lease>/ a seal under way
//! DATA_DIR/caches/volumes/<project>/<key>/staging/following.fetch/  a followed head's fetch under way
//! DATA_DIR/caches/views/<lease>/views.json                 the lease's views: what commits them
//! DATA_DIR/caches/views/<lease>/<key>/{upper,work,merged}  one view: an overlay of the head's tree
//! ```
//!
//! # Invariants
//! - `DATA_DIR/caches` is the node's alone (mode 0700): a sealed tree's
//!   files are open to every user, for the leases whose views it lies under.
//! - A sealed tree is never written after its rename into `sealed/`: it is
//!   the read-only lower layer of every view of its generation, so two
//!   leases of one key never see each other's writes.
//! - A seal is copy, fsync (files, then directories), digest, then one
//!   rename: a crash leaves a whole sealed tree or a staging directory the
//!   sweep removes, never a partial tree under `sealed/`. A file the lease
//!   left alone (not in its upper layer, or there as metadata alone, under
//!   no renamed directory) is hard-linked from the tree it started from
//!   with the digest recorded for it, so a seal reads and writes what the
//!   lease changed, not the whole volume; the digest is the same either way.
//! - The digest covers each entry's relative path, kind, mode, and content
//!   (or link target), in sorted order, with lengths before bytes, so two
//!   trees have one digest only when a workload would see the same files.
//! - `generations/<N>` is written only after the ledger published N with
//!   that digest, and names a sealed tree: `held` never claims content the
//!   node does not have whole.
//! - A lease's views are removed only once its workload is gone (the
//!   runner closes them after the workload ended or was destroyed).

use std::collections::HashSet;
use std::io::{Read as _, Write as _};
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use berth_proto::leases::v1::CacheGeneration;
use berth_proto::types::v1::{CacheCommit, CacheMount};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::files::FileError;

pub(crate) mod follow;
pub(crate) mod registry;

/// Why a volume could not be opened or sealed.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// A file operation failed.
    #[error(transparent)]
    Io(#[from] FileError),
    /// A generation fetched from the registry is not the content the ledger
    /// names.
    #[error("generation {generation} of cache volume {key} as fetched is {actual}, not {expected}")]
    Mismatch {
        /// The volume's key.
        key: String,
        /// The generation.
        generation: u64,
        /// The digest the ledger names.
        expected: String,
        /// The digest of what was fetched.
        actual: String,
    },
    /// The cache registry could not be pushed to or pulled from.
    #[error("cache registry {repository}: {why}")]
    Registry {
        /// The repository.
        repository: String,
        /// Why.
        why: String,
    },
    /// The work was cut short before it finished (its task was cancelled).
    #[error("cache work cut short: {0}")]
    Interrupted(String),
    /// The overlay of a view could not be mounted.
    #[error("cannot mount the view of cache volume {key} at {path}: {why}")]
    Mount {
        /// The volume's key.
        key: String,
        /// Where.
        path: String,
        /// Why.
        why: String,
    },
}

fn io(action: &'static str, path: &Path, source: std::io::Error) -> CacheError {
    CacheError::Io(FileError::new(action, path, source))
}

/// One lease's view of one volume, as recorded beside it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct View {
    /// The volume's key.
    pub key: String,
    /// Where the workload sees it.
    pub inside: PathBuf,
    /// The overlay on the host.
    pub merged: PathBuf,
    /// Its lower layer: the sealed tree it started from, or an empty one.
    #[serde(default)]
    pub lower: PathBuf,
    /// Its upper layer: what the lease changed.
    #[serde(default)]
    pub upper: PathBuf,
    /// The generation the view starts from, as the ledger answered.
    pub base_generation: u64,
    /// Whether it may be published: false when the node did not hold the
    /// head (the view started empty) or the ledger said it publishes
    /// nothing (the project's caching is off).
    pub based: bool,
    /// When it is published (`CacheCommit` as a number).
    pub commit: i32,
}

impl View {
    /// When it is published.
    pub fn commit(&self) -> CacheCommit {
        CacheCommit::try_from(self.commit).unwrap_or_default()
    }
}

/// A sealed tree: its digest (`sha256:<hex>`) and the bytes of its files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sealed {
    pub digest: String,
    pub size_bytes: u64,
}

/// The node's cache volumes under `DATA_DIR/caches`.
#[derive(Debug, Clone)]
pub struct CacheVolumes {
    root: PathBuf,
    /// Fetches of followed heads under way (their scratch is named by
    /// [`follow::FOLLOWING`], not by a lease): the sweep spares them meanwhile.
    following: Arc<AtomicUsize>,
}

/// A fetch of a followed head under way, until dropped.
#[derive(Debug)]
pub struct Following(Arc<AtomicUsize>);

impl Drop for Following {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl CacheVolumes {
    pub fn new(data_dir: &Path) -> Self {
        Self { root: data_dir.join("caches"), following: Arc::new(AtomicUsize::new(0)) }
    }

    /// Marks a fetch of a followed head under way while the guard lives.
    pub fn following(&self) -> Following {
        self.following.fetch_add(1, Ordering::SeqCst);
        Following(self.following.clone())
    }

    /// The newest generation the node holds sealed of each volume it holds
    /// any of: (project, key, generation), by project and key.
    pub fn newest_held(&self) -> Vec<(String, String, u64)> {
        let names = |dir: &Path| -> Vec<String> {
            let mut names: Vec<String> = std::fs::read_dir(dir)
                .map(|entries| {
                    entries
                        .filter_map(Result::ok)
                        .filter(|entry| entry.path().is_dir())
                        .filter_map(|entry| entry.file_name().into_string().ok())
                        .collect()
                })
                .unwrap_or_default();
            names.sort();
            names
        };
        let volumes = self.root.join("volumes");
        let mut newest = Vec::new();
        for project in names(&volumes) {
            for key in names(&volumes.join(&project)) {
                if let Some(&generation) = self.held(&project, &key).first() {
                    newest.push((project.clone(), key, generation));
                }
            }
        }
        newest
    }

    /// Creates the root, closed to every other user of the host: sealed
    /// trees are open to every user, for the leases that mount them.
    fn closed_root(&self) -> Result<(), CacheError> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.root)
            .map_err(|e| io("create", &self.root, e))?;
        std::fs::set_permissions(&self.root, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| io("close", &self.root, e))
    }

    fn volume(&self, project: &str, key: &str) -> PathBuf {
        self.root.join("volumes").join(project).join(key)
    }

    fn views_of(&self, lease_id: &str) -> PathBuf {
        self.root.join("views").join(lease_id)
    }

    /// The generations of (project, key) the node holds sealed, newest first.
    pub fn held(&self, project: &str, key: &str) -> Vec<u64> {
        let dir = self.volume(project, key).join("generations");
        let Ok(entries) = std::fs::read_dir(&dir) else { return Vec::new() };
        let mut held: Vec<u64> = entries
            .filter_map(Result::ok)
            .filter(|entry| entry.path().is_dir())
            .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
            .collect();
        held.sort_unstable_by(|a, b| b.cmp(a));
        held
    }

    /// The sealed tree of `head` when the node holds it with that digest.
    fn tree_of(&self, head: &CacheGeneration) -> Option<PathBuf> {
        let hex = head.digest.strip_prefix("sha256:")?;
        let link = self.volume(&head.project, &head.key).join("generations").join(head.generation.to_string());
        let target = std::fs::read_link(&link).ok()?;
        let tree = self.volume(&head.project, &head.key).join("sealed").join(hex);
        (target.file_name()?.as_bytes() == hex.as_bytes() && tree.is_dir()).then_some(tree)
    }

    /// Mounts the lease's view of `mount`'s volume at `head`: an overlay
    /// whose lower layer is the head's sealed tree (or nothing, for
    /// generation 0 or a head the node does not hold) and whose upper layer
    /// is the lease's own; `publish` false when the ledger already said it
    /// publishes nothing. Records it beside the lease's other views.
    pub fn open_view(
        &self,
        lease_id: &str,
        mount: &CacheMount,
        head: &CacheGeneration,
        publish: bool,
    ) -> Result<View, CacheError> {
        self.closed_root()?;
        let dir = self.views_of(lease_id).join(&mount.key);
        let (upper, work, merged) = (dir.join("upper"), dir.join("work"), dir.join("merged"));
        let empty = self.root.join("empty");
        for path in [&upper, &work, &merged, &empty] {
            std::fs::DirBuilder::new().recursive(true).mode(0o700).create(path).map_err(|e| io("create", path, e))?;
        }
        let tree = if head.generation == 0 { None } else { self.tree_of(head) };
        let based = publish && (head.generation == 0 || tree.is_some());
        let lower = tree.unwrap_or(empty);
        if !is_mounted(&merged) {
            crate::overlay::mount(&merged, &lower, &upper, &work, true).map_err(|error| CacheError::Mount {
                key: mount.key.clone(),
                path: merged.display().to_string(),
                why: error.to_string(),
            })?;
        }
        let view = View {
            key: mount.key.clone(),
            inside: PathBuf::from(&mount.path),
            merged,
            lower: lower.clone(),
            upper: upper.clone(),
            base_generation: head.generation,
            based,
            commit: mount.commit,
        };
        let mut views = self.views(lease_id);
        views.retain(|known| known.key != view.key);
        views.push(view.clone());
        let record = self.views_of(lease_id).join("views.json");
        berth_core::write_json_atomically(&record, &views).map_err(|e| io("write", &record, e))?;
        Ok(view)
    }

    /// The views recorded for `lease_id`; none when it has none.
    pub fn views(&self, lease_id: &str) -> Vec<View> {
        let record = self.views_of(lease_id).join("views.json");
        std::fs::read(&record).ok().and_then(|bytes| serde_json::from_slice(&bytes).ok()).unwrap_or_default()
    }

    /// Seals what `view` of (project, key) holds now for `lease_id`: copied
    /// into a staging tree owned by the node, synced, digested, and renamed
    /// into `sealed/` (where the same content already sealed is kept).
    pub fn seal(&self, lease_id: &str, project: &str, view: &View) -> Result<Sealed, CacheError> {
        // What the lease did not change comes from the tree it started
        // from: linked, with the digests that tree was sealed with.
        let base = Base { lower: &view.lower, upper: &view.upper, index: read_index(&view.lower) };
        self.seal_tree(lease_id, project, &view.key, &view.merged, &base, None)
    }

    /// Seals `tree` (the node's own, fetched for `lease_id`; its files are
    /// linked, not copied) as generation `expected` of (project, key): kept
    /// only when its digest is `expected.digest`.
    pub fn adopt(
        &self,
        lease_id: &str,
        project: &str,
        key: &str,
        tree: &Path,
        expected: &CacheGeneration,
    ) -> Result<Sealed, CacheError> {
        let none = Path::new("");
        let base = Base { lower: none, upper: none, index: FileIndex::new() };
        let staging = format!("{lease_id}.adopt");
        self.seal_tree(&staging, project, key, tree, &base, Some(expected))
    }

    /// Seals `tree` under the staging name `staging`: see [`Self::seal`];
    /// with `expected`, files are linked from `tree`, and a tree whose
    /// digest is not the expected one is dropped.
    fn seal_tree(
        &self,
        staging: &str,
        project: &str,
        key: &str,
        tree: &Path,
        base: &Base<'_>,
        expected: Option<&CacheGeneration>,
    ) -> Result<Sealed, CacheError> {
        self.closed_root()?;
        let volume = self.volume(project, key);
        let staging = volume.join("staging").join(staging);
        if staging.exists() {
            std::fs::remove_dir_all(&staging).map_err(|e| io("remove", &staging, e))?;
        }
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(&staging)
            .map_err(|e| io("create", &staging, e))?;
        let mut seal =
            Seal { manifest: Sha256::new(), size_bytes: 0, index: FileIndex::new(), link: expected.is_some() };
        copy_tree(tree, &staging, Path::new(""), true, base, &mut seal)?;
        std::fs::set_permissions(&staging, std::fs::Permissions::from_mode(0o777))
            .map_err(|e| io("set the mode of", &staging, e))?;
        sync_dir(&staging)?;
        let hex = hex(&seal.manifest.finalize());
        if let Some(expected) = expected
            && expected.digest.strip_prefix("sha256:") != Some(hex.as_str())
        {
            std::fs::remove_dir_all(&staging).map_err(|e| io("remove", &staging, e))?;
            return Err(CacheError::Mismatch {
                key: key.to_owned(),
                generation: expected.generation,
                expected: expected.digest.clone(),
                actual: format!("sha256:{hex}"),
            });
        }
        let sealed_dir = volume.join("sealed");
        std::fs::create_dir_all(&sealed_dir).map_err(|e| io("create", &sealed_dir, e))?;
        let sealed = sealed_dir.join(&hex);
        if sealed.exists() {
            std::fs::remove_dir_all(&staging).map_err(|e| io("remove", &staging, e))?;
        } else {
            let index = sealed_dir.join(format!("{hex}.index.json"));
            berth_core::write_json_atomically(&index, &seal.index).map_err(|e| io("write", &index, e))?;
            std::fs::rename(&staging, &sealed).map_err(|e| io("seal", &sealed, e))?;
            sync_dir(&sealed_dir)?;
        }
        Ok(Sealed { digest: format!("sha256:{hex}"), size_bytes: seal.size_bytes })
    }

    /// The sealed tree named `digest` of (project, key), and its file index.
    pub fn sealed_tree(&self, project: &str, key: &str, digest: &str) -> Option<(PathBuf, FileIndex)> {
        let hex = digest.strip_prefix("sha256:")?;
        let tree = self.volume(project, key).join("sealed").join(hex);
        tree.is_dir().then(|| {
            let index = read_index(&tree);
            (tree, index)
        })
    }

    /// A fresh scratch directory of (project, key) for `lease_id`'s
    /// `purpose` (a transfer under way), under `staging/` so the sweep
    /// removes it once the lease is gone.
    pub fn scratch(&self, lease_id: &str, project: &str, key: &str, purpose: &str) -> Result<PathBuf, CacheError> {
        self.closed_root()?;
        let dir = self.volume(project, key).join("staging").join(format!("{lease_id}.{purpose}"));
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(|e| io("remove", &dir, e))?;
        }
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir).map_err(|e| io("create", &dir, e))?;
        Ok(dir)
    }

    /// Removes a scratch directory [`Self::scratch`] made.
    pub fn drop_scratch(&self, dir: &Path) {
        if let Err(error) = std::fs::remove_dir_all(dir)
            && error.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %dir.display(), %error, "cannot remove a cache transfer's scratch; the sweep will");
        }
    }

    /// Records that the ledger published `generation` of (project, key) as
    /// the sealed tree `digest`, so later views of it start from that tree.
    pub fn record(&self, project: &str, key: &str, generation: u64, digest: &str) -> Result<(), CacheError> {
        let Some(hex) = digest.strip_prefix("sha256:") else { return Ok(()) };
        let generations = self.volume(project, key).join("generations");
        std::fs::create_dir_all(&generations).map_err(|e| io("create", &generations, e))?;
        let link = generations.join(generation.to_string());
        let temporary = generations.join(format!(".{generation}.new"));
        let _ = std::fs::remove_file(&temporary);
        std::os::unix::fs::symlink(Path::new("../sealed").join(hex), &temporary)
            .map_err(|e| io("link", &temporary, e))?;
        std::fs::rename(&temporary, &link).map_err(|e| io("link", &link, e))?;
        sync_dir(&generations)
    }

    /// Unmounts and removes every view of `lease_id`. Only once its
    /// workload is gone.
    pub fn close_views(&self, lease_id: &str) -> Result<(), CacheError> {
        let dir = self.views_of(lease_id);
        if !dir.exists() {
            return Ok(());
        }
        for view in self.views(lease_id) {
            unmount(&view.merged);
        }
        // A view recorded before its record was written is unmounted too.
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for entry in entries.filter_map(Result::ok).filter(|entry| entry.path().is_dir()) {
                unmount(&entry.path().join("merged"));
            }
        }
        std::fs::remove_dir_all(&dir).map_err(|e| io("remove", &dir, e))
    }

    /// Removes the views of leases not in `keep` and every seal left under
    /// way (a seal is redone from its view): what a crash left behind; and
    /// of each volume, the generations past the newest [`LOCAL_KEEP`] and
    /// the sealed trees nothing links to any more (see [`collect_local`]).
    pub fn sweep(&self, keep: &HashSet<String>) {
        if let Ok(entries) = std::fs::read_dir(self.root.join("views")) {
            for entry in entries.filter_map(Result::ok) {
                let Some(lease_id) = entry.file_name().to_str().map(str::to_owned) else { continue };
                if !keep.contains(&lease_id)
                    && let Err(error) = self.close_views(&lease_id)
                {
                    tracing::warn!(%lease_id, %error, "cannot remove a finished lease's cache views");
                }
            }
        }
        // The trees the remaining views start from stay, whatever their age.
        let in_use: HashSet<PathBuf> = std::fs::read_dir(self.root.join("views"))
            .map(|entries| {
                entries
                    .filter_map(Result::ok)
                    .filter_map(|entry| entry.file_name().to_str().map(str::to_owned))
                    .flat_map(|lease_id| self.views(&lease_id))
                    .map(|view| view.lower)
                    .collect()
            })
            .unwrap_or_default();
        let Ok(projects) = std::fs::read_dir(self.root.join("volumes")) else { return };
        for project in projects.filter_map(Result::ok) {
            let Ok(keys) = std::fs::read_dir(project.path()) else { continue };
            for key in keys.filter_map(Result::ok) {
                collect_local(&key.path(), &in_use);
                let staging = key.path().join("staging");
                if let Ok(seals) = std::fs::read_dir(&staging) {
                    for seal in seals.filter_map(Result::ok) {
                        // `<lease>` or `<lease>.<purpose>`: a seal or a transfer of that lease.
                        let name = seal.file_name();
                        let lease_id = name.to_str().unwrap_or_default().split('.').next().unwrap_or_default();
                        let followed = lease_id == follow::FOLLOWING && self.following.load(Ordering::SeqCst) > 0;
                        if !keep.contains(lease_id) && !followed {
                            let _ = std::fs::remove_dir_all(seal.path());
                        }
                    }
                }
            }
        }
    }
}

/// The newest generations of each volume a node keeps; older ones are
/// fetched again from the registry, or not used, should a lease want one.
pub(crate) const LOCAL_KEEP: usize = 3;

/// How old a sealed tree nothing links to must be before it is removed: a
/// seal renames its tree into place before the ledger publishes it and the
/// node links it, and an in-flight publish must not lose its tree.
const UNLINKED_GRACE: std::time::Duration = std::time::Duration::from_secs(3600);

/// Collects one volume's local generations: links past the newest
/// [`LOCAL_KEEP`] go, then each sealed tree (and its index) that no
/// remaining link names, no view in `in_use` starts from, and that has sat
/// unlinked for [`UNLINKED_GRACE`].
fn collect_local(volume: &Path, in_use: &HashSet<PathBuf>) {
    let generations = volume.join("generations");
    let mut numbered: Vec<(u64, PathBuf)> = std::fs::read_dir(&generations)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter_map(|entry| Some((entry.file_name().to_str()?.parse().ok()?, entry.path())))
                .collect()
        })
        .unwrap_or_default();
    numbered.sort_unstable_by_key(|(number, _)| std::cmp::Reverse(*number));
    for (_, link) in numbered.iter().skip(LOCAL_KEEP) {
        let _ = std::fs::remove_file(link);
    }
    let linked: HashSet<std::ffi::OsString> = numbered
        .iter()
        .take(LOCAL_KEEP)
        .filter_map(|(_, link)| std::fs::read_link(link).ok()?.file_name().map(ToOwned::to_owned))
        .collect();
    let sealed = volume.join("sealed");
    let Ok(trees) = std::fs::read_dir(&sealed) else { return };
    for tree in trees.filter_map(Result::ok) {
        let path = tree.path();
        let old = tree
            .metadata()
            .and_then(|meta| meta.modified())
            .ok()
            .and_then(|at| at.elapsed().ok())
            .is_some_and(|age| age >= UNLINKED_GRACE);
        if !path.is_dir() || linked.contains(&tree.file_name()) || in_use.contains(&path) || !old {
            continue;
        }
        match std::fs::remove_dir_all(&path) {
            Ok(()) => {
                let _ = std::fs::remove_file(sealed.join(format!("{}.index.json", tree.file_name().to_string_lossy())));
                tracing::debug!(tree = %path.display(), "removed a cache tree no kept generation names");
            }
            Err(error) => tracing::warn!(tree = %path.display(), %error, "cannot remove an old cache tree"),
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Feeds one manifest field to `manifest`: its length, then its bytes.
fn field(manifest: &mut Sha256, bytes: &[u8]) {
    manifest.update((bytes.len() as u64).to_be_bytes());
    manifest.update(bytes);
}

/// Each regular file of a sealed tree by its path: its content's SHA-256,
/// written beside the tree (`<hex>.index.json`) so the next seal need not
/// read what its lease left unchanged.
pub(crate) type FileIndex = std::collections::BTreeMap<String, String>;

fn read_index(tree: &Path) -> FileIndex {
    let Some(name) = tree.file_name().and_then(|name| name.to_str()) else { return FileIndex::new() };
    let index = tree.with_file_name(format!("{name}.index.json"));
    std::fs::read(index).ok().and_then(|bytes| serde_json::from_slice(&bytes).ok()).unwrap_or_default()
}

/// The tree a view started from, and what the lease wrote over it.
struct Base<'a> {
    lower: &'a Path,
    upper: &'a Path,
    index: FileIndex,
}

impl Base<'_> {
    /// Where `path`'s content is in the lower tree, and its digest, when
    /// the lease left the content alone: no copy in the upper layer, or one
    /// holding metadata alone (overlayfs `metacopy`) that was not moved
    /// there from elsewhere. `in_place` says no directory above it was
    /// renamed into place (its content would come from another path).
    fn unchanged(&self, path: &Path, in_place: bool) -> Option<(PathBuf, &String)> {
        let digest = self.index.get(path.to_str()?)?;
        let upper = self.upper.join(path);
        let copied = std::fs::symlink_metadata(&upper).is_ok();
        let metadata_only = has_xattr(&upper, "trusted.overlay.metacopy") && !has_xattr(&upper, REDIRECT);
        (in_place && (!copied || metadata_only)).then(|| (self.lower.join(path), digest))
    }
}

/// The overlay attribute of an entry whose lower content is at another path.
const REDIRECT: &str = "trusted.overlay.redirect";

/// Whether `path` (not followed) has the extended attribute `name`.
fn has_xattr(path: &Path, name: &str) -> bool {
    rustix::fs::lgetxattr(path, name, &mut [0_u8; 0]).is_ok()
}

/// A seal under way: the manifest digest, the bytes, the file index, and
/// whether files are linked from the source (the node's own) or copied.
struct Seal {
    manifest: Sha256,
    size_bytes: u64,
    index: FileIndex,
    link: bool,
}

/// Copies the tree `from` into `to` (which exists), entries sorted by name,
/// feeding each to the seal's manifest under its path `relative`. Regular
/// files, directories and symbolic links are kept; anything else (a socket,
/// a device node, a pipe) is not content and is left out. Modes are opened
/// to every user (files read-write, directories also searchable; execute
/// bits kept): a sealed tree is the lower layer of each later lease's view,
/// which runs as a user of its own, and a view is private to its lease.
/// A file `base` says is unchanged is linked from the tree it came from.
fn copy_tree(
    from: &Path,
    to: &Path,
    relative: &Path,
    in_place: bool,
    base: &Base<'_>,
    seal: &mut Seal,
) -> Result<(), CacheError> {
    let mut entries: Vec<std::fs::DirEntry> = std::fs::read_dir(from)
        .map_err(|e| io("read", from, e))?
        .collect::<Result<_, _>>()
        .map_err(|e| io("read", from, e))?;
    entries.sort_by_key(std::fs::DirEntry::file_name);
    for entry in entries {
        let (source, target) = (entry.path(), to.join(entry.file_name()));
        let path = relative.join(entry.file_name());
        let meta = std::fs::symlink_metadata(&source).map_err(|e| io("read", &source, e))?;
        let kind = meta.file_type();
        let manifest = &mut seal.manifest;
        if kind.is_dir() {
            let mode = (meta.mode() & KEPT_MODE) | 0o777;
            field(manifest, b"d");
            field(manifest, path.as_os_str().as_bytes());
            field(manifest, &mode.to_be_bytes());
            std::fs::DirBuilder::new().mode(0o700).create(&target).map_err(|e| io("create", &target, e))?;
            let moved = has_xattr(&base.upper.join(&path), REDIRECT);
            copy_tree(&source, &target, &path, in_place && !moved, base, seal)?;
            std::fs::set_permissions(&target, std::fs::Permissions::from_mode(mode))
                .map_err(|e| io("set the mode of", &target, e))?;
            sync_dir(&target)?;
        } else if kind.is_symlink() {
            let link = std::fs::read_link(&source).map_err(|e| io("read", &source, e))?;
            field(manifest, b"l");
            field(manifest, path.as_os_str().as_bytes());
            field(manifest, link.as_os_str().as_bytes());
            std::os::unix::fs::symlink(&link, &target).map_err(|e| io("link", &target, e))?;
        } else if kind.is_file() {
            let mode = (meta.mode() & KEPT_MODE) | 0o666;
            let linked =
                base.unchanged(&path, in_place).filter(|(lower, _)| std::fs::hard_link(lower, &target).is_ok());
            let digest = match linked {
                Some((_, digest)) => digest.clone(),
                None if seal.link => link_file(&source, &target, mode)?,
                None => copy_file(&source, &target, mode)?,
            };
            field(manifest, b"f");
            field(manifest, path.as_os_str().as_bytes());
            field(manifest, &mode.to_be_bytes());
            field(manifest, digest.as_bytes());
            seal.size_bytes = seal.size_bytes.saturating_add(meta.len());
            seal.index.insert(path.to_string_lossy().into_owned(), digest);
        } else {
            tracing::debug!(path = %source.display(), "not a file, directory or link; left out of the seal");
        }
    }
    Ok(())
}

/// The permission bits a sealed tree keeps: no set-uid, no set-gid.
const KEPT_MODE: u32 = 0o1777;

/// Links `source` (a file of the node's own) at `target` with `mode`; the
/// content's SHA-256 in hex.
fn link_file(source: &Path, target: &Path, mode: u32) -> Result<String, CacheError> {
    std::fs::hard_link(source, target).map_err(|e| io("link", target, e))?;
    std::fs::set_permissions(target, std::fs::Permissions::from_mode(mode))
        .map_err(|e| io("set the mode of", target, e))?;
    let mut input = std::fs::File::open(target).map_err(|e| io("open", target, e))?;
    let mut content = Sha256::new();
    std::io::copy(&mut input, &mut content).map_err(|e| io("read", target, e))?;
    input.sync_all().map_err(|e| io("sync", target, e))?;
    Ok(hex(&content.finalize()))
}

/// Copies `source` to the new file `target` with `mode`, synced; the
/// content's SHA-256 in hex.
fn copy_file(source: &Path, target: &Path, mode: u32) -> Result<String, CacheError> {
    let mut input = std::fs::File::open(source).map_err(|e| io("open", source, e))?;
    let mut output = std::fs::File::create_new(target).map_err(|e| io("create", target, e))?;
    let mut content = Sha256::new();
    let mut buffer = vec![0; 1 << 16];
    loop {
        let read = input.read(&mut buffer).map_err(|e| io("read", source, e))?;
        if read == 0 {
            break;
        }
        content.update(&buffer[..read]);
        output.write_all(&buffer[..read]).map_err(|e| io("write", target, e))?;
    }
    output.set_permissions(std::fs::Permissions::from_mode(mode)).map_err(|e| io("set the mode of", target, e))?;
    output.sync_all().map_err(|e| io("sync", target, e))?;
    Ok(hex(&content.finalize()))
}

/// Lays out `from`'s tree at `to` (an empty directory): directories made
/// anew with their modes, files hard-linked (shared, so never to be written
/// in place), symbolic links copied.
pub(crate) fn link_tree(from: &Path, to: &Path) -> Result<(), CacheError> {
    for entry in std::fs::read_dir(from).map_err(|e| io("read", from, e))? {
        let entry = entry.map_err(|e| io("read", from, e))?;
        let (source, target) = (entry.path(), to.join(entry.file_name()));
        let meta = std::fs::symlink_metadata(&source).map_err(|e| io("read", &source, e))?;
        if meta.is_dir() {
            std::fs::create_dir(&target).map_err(|e| io("create", &target, e))?;
            link_tree(&source, &target)?;
            std::fs::set_permissions(&target, std::fs::Permissions::from_mode(meta.mode() & 0o7777))
                .map_err(|e| io("set the mode of", &target, e))?;
        } else if meta.file_type().is_symlink() {
            let link = std::fs::read_link(&source).map_err(|e| io("read", &source, e))?;
            std::os::unix::fs::symlink(&link, &target).map_err(|e| io("link", &target, e))?;
        } else if meta.is_file() {
            std::fs::hard_link(&source, &target).map_err(|e| io("link", &target, e))?;
        }
    }
    Ok(())
}

fn sync_dir(dir: &Path) -> Result<(), CacheError> {
    std::fs::File::open(dir).and_then(|dir| dir.sync_all()).map_err(|e| io("sync", dir, e))
}

/// Whether `path` is a mount point: its device differs from its parent's.
fn is_mounted(path: &Path) -> bool {
    let (Ok(own), Some(Ok(parent))) = (std::fs::metadata(path), path.parent().map(std::fs::metadata)) else {
        return false;
    };
    own.dev() != parent.dev()
}

fn unmount(path: &Path) {
    if let Err(error) = crate::overlay::unmount(path) {
        tracing::warn!(path = %path.display(), %error, "cannot unmount a cache view");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testdir::TestDir;

    fn mount(key: &str) -> CacheMount {
        CacheMount { key: key.into(), path: "/cache".into(), commit: CacheCommit::OnSuccess as i32 }
    }

    fn head(key: &str, generation: u64, digest: &str) -> CacheGeneration {
        CacheGeneration {
            project: "default".into(),
            key: key.into(),
            generation,
            digest: digest.into(),
            ..Default::default()
        }
    }

    fn tree(dir: &Path, files: &[(&str, &str)]) {
        for (path, text) in files {
            let path = dir.join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
    }

    /// A view whose overlay is not mounted: its merged directory filled by hand.
    fn view_of(dir: &Path, key: &str) -> View {
        View {
            key: key.into(),
            inside: "/cache".into(),
            merged: dir.to_path_buf(),
            lower: PathBuf::new(),
            upper: PathBuf::new(),
            base_generation: 0,
            based: true,
            commit: 0,
        }
    }

    #[test]
    fn a_seal_is_named_by_what_a_workload_would_see_and_kept_whole() {
        let tmp = TestDir::new();
        let volumes = CacheVolumes::new(tmp.path());
        let (one, two) = (tmp.path().join("one"), tmp.path().join("two"));
        tree(&one, &[("a.txt", "alpha"), ("deps/b.bin", "beta")]);
        tree(&two, &[("deps/b.bin", "beta"), ("a.txt", "alpha")]);
        let first = volumes.seal("l-1", "default", &view_of(&one, "deps")).unwrap();
        let second = volumes.seal("l-2", "default", &view_of(&two, "deps")).unwrap();
        assert_eq!(first, second, "the same files, written in another order, seal alike");
        assert_eq!(first.size_bytes, 9);
        let hex = first.digest.strip_prefix("sha256:").unwrap();
        let sealed = tmp.path().join("caches/volumes/default/deps/sealed").join(hex);
        assert_eq!(std::fs::read_to_string(sealed.join("deps/b.bin")).unwrap(), "beta");
        assert!(!tmp.path().join("caches/volumes/default/deps/staging/l-2").exists(), "no staging left");

        // Another content, another name; an execute bit is content too
        // (read and write are open to all in every sealed tree).
        std::fs::write(two.join("a.txt"), "ALPHA").unwrap();
        let changed = volumes.seal("l-3", "default", &view_of(&two, "deps")).unwrap();
        assert_ne!(changed.digest, first.digest);
        std::fs::write(two.join("a.txt"), "alpha").unwrap();
        std::fs::set_permissions(two.join("a.txt"), std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(volumes.seal("l-4", "default", &view_of(&two, "deps")).unwrap().digest, first.digest);
        std::fs::set_permissions(two.join("a.txt"), std::fs::Permissions::from_mode(0o700)).unwrap();
        assert_ne!(volumes.seal("l-5", "default", &view_of(&two, "deps")).unwrap().digest, first.digest);
        let mode = std::fs::metadata(sealed.join("a.txt")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o666, "sealed open to every user");
        let root = std::fs::metadata(tmp.path().join("caches")).unwrap().permissions().mode();
        assert_eq!(root & 0o777, 0o700, "under a root no other user enters");

        // Recorded as a generation, it is held; a link to a tree never sealed is not.
        assert!(volumes.held("default", "deps").is_empty());
        volumes.record("default", "deps", 1, &first.digest).unwrap();
        volumes.record("default", "deps", 2, &format!("sha256:{}", "0".repeat(64))).unwrap();
        assert_eq!(volumes.held("default", "deps"), [1]);
        assert!(volumes.held("other", "deps").is_empty(), "another project's volume is another volume");
    }

    #[test]
    fn the_sweep_keeps_the_newest_generations_and_the_trees_views_start_from() {
        let tmp = TestDir::new();
        let volumes = CacheVolumes::new(tmp.path());
        let mut digests = Vec::new();
        for generation in 1..=5_u64 {
            let dir = tmp.path().join(format!("g{generation}"));
            tree(&dir, &[("n", &generation.to_string())]);
            let sealed = volumes.seal(&format!("l-{generation}"), "default", &view_of(&dir, "deps")).unwrap();
            volumes.record("default", "deps", generation, &sealed.digest).unwrap();
            digests.push(sealed.digest);
        }
        let sealed_dir = tmp.path().join("caches/volumes/default/deps/sealed");
        let tree_of = |digest: &str| sealed_dir.join(digest.strip_prefix("sha256:").unwrap());
        let age = |path: &Path| {
            let long_ago = std::time::SystemTime::now() - UNLINKED_GRACE - std::time::Duration::from_secs(60);
            std::fs::File::open(path).unwrap().set_modified(long_ago).unwrap();
        };
        // A view of a running lease starts from generation 1's tree.
        let mut running = view_of(&tmp.path().join("g1"), "deps");
        running.lower = tree_of(&digests[0]);
        let record = tmp.path().join("caches/views/l-run");
        std::fs::create_dir_all(&record).unwrap();
        berth_core::write_json_atomically(&record.join("views.json"), &vec![running]).unwrap();
        // Generation 2's tree is old but was unlinked only just now: the grace keeps it this time.
        for digest in [&digests[0], &digests[2]] {
            age(&tree_of(digest));
        }

        volumes.sweep(&HashSet::from(["l-run".to_owned()]));
        assert_eq!(volumes.held("default", "deps"), [5, 4, 3], "the newest three");
        assert!(tree_of(&digests[0]).is_dir(), "a running view's lower layer stays");
        assert!(tree_of(&digests[1]).is_dir(), "unlinked too recently to go");
        for digest in &digests[2..] {
            assert!(tree_of(digest).is_dir(), "a kept generation's tree stays");
        }
        age(&tree_of(&digests[1]));
        volumes.sweep(&HashSet::new());
        assert!(!tree_of(&digests[1]).exists(), "an old tree no generation names goes");
        assert!(!sealed_dir.join(format!("{}.index.json", &digests[1][7..])).exists());
        assert!(!tree_of(&digests[0]).exists(), "once its view is gone, so is generation 1");
        assert!(tree_of(&digests[2]).is_dir());
    }

    #[test]
    fn the_newest_held_generation_of_each_volume_is_what_a_node_reports_and_a_follow_fetch_survives_a_sweep() {
        let tmp = TestDir::new();
        let volumes = CacheVolumes::new(tmp.path());
        assert!(volumes.newest_held().is_empty());
        for (project, key, generation) in [("default", "deps", 1), ("default", "deps", 4), ("team-a", "go", 2)] {
            let dir = tmp.path().join(format!("{project}-{key}-{generation}"));
            tree(&dir, &[("n", &generation.to_string())]);
            let sealed = volumes.seal("l-1", project, &view_of(&dir, key)).unwrap();
            volumes.record(project, key, generation, &sealed.digest).unwrap();
        }
        let newest = volumes.newest_held();
        let expected = [("default", "deps", 4), ("team-a", "go", 2)];
        let expected: Vec<(String, String, u64)> =
            expected.iter().map(|(p, k, g)| ((*p).to_owned(), (*k).to_owned(), *g)).collect();
        assert_eq!(newest, expected);

        // A followed head's fetch is named by no lease: spared while under way, swept after.
        let scratch = volumes.scratch(follow::FOLLOWING, "default", "deps", "fetch").unwrap();
        let under_way = volumes.following();
        volumes.sweep(&HashSet::new());
        assert!(scratch.is_dir(), "spared while the fetch runs");
        drop(under_way);
        volumes.sweep(&HashSet::new());
        assert!(!scratch.exists(), "a fetch a crash cut short goes");
    }

    #[test]
    fn a_crash_mid_seal_leaves_a_staging_tree_the_sweep_removes_and_no_sealed_tree() {
        let tmp = TestDir::new();
        let volumes = CacheVolumes::new(tmp.path());
        let staging = tmp.path().join("caches/volumes/default/deps/staging/l-9");
        tree(&staging, &[("half", "written")]);
        let views = tmp.path().join("caches/views/l-9/deps/merged");
        std::fs::create_dir_all(&views).unwrap();
        volumes.sweep(&HashSet::from(["l-1".to_owned()]));
        assert!(!staging.exists());
        assert!(!tmp.path().join("caches/views/l-9").exists());
        assert!(volumes.held("default", "deps").is_empty());
    }

    #[test]
    fn two_views_of_one_head_never_see_each_others_writes_and_the_head_is_untouched() {
        if !berth_testkit::runs_as_root("mounting a view") {
            return;
        }
        let tmp = TestDir::new();
        let volumes = CacheVolumes::new(tmp.path());
        let seed = tmp.path().join("seed");
        tree(
            &seed,
            &[("shared.txt", "from generation 1"), ("untouched.bin", "kept as it was"), ("dir/f", "in a directory")],
        );
        let sealed = volumes.seal("l-0", "default", &view_of(&seed, "deps")).unwrap();
        volumes.record("default", "deps", 1, &sealed.digest).unwrap();

        let one = volumes.open_view("l-1", &mount("deps"), &head("deps", 1, &sealed.digest), true).unwrap();
        let two = volumes.open_view("l-2", &mount("deps"), &head("deps", 1, &sealed.digest), true).unwrap();
        assert!(one.based && two.based);
        assert_eq!(std::fs::read_to_string(one.merged.join("shared.txt")).unwrap(), "from generation 1");
        std::fs::write(one.merged.join("shared.txt"), "changed by l-1").unwrap();
        std::fs::write(one.merged.join("new.txt"), "l-1 only").unwrap();
        assert_eq!(std::fs::read_to_string(two.merged.join("shared.txt")).unwrap(), "from generation 1");
        assert!(!two.merged.join("new.txt").exists());
        let hex = sealed.digest.strip_prefix("sha256:").unwrap();
        let head_tree = tmp.path().join("caches/volumes/default/deps/sealed").join(hex);
        assert_eq!(std::fs::read_to_string(head_tree.join("shared.txt")).unwrap(), "from generation 1");

        // l-1's view sealed holds its writes over the head: what it left
        // alone is linked from the head's tree, never read again, and the
        // digest is what sealing the same files from scratch gives.
        std::fs::rename(one.merged.join("dir"), one.merged.join("moved")).unwrap();
        std::fs::create_dir(one.merged.join("dir")).unwrap();
        std::fs::write(one.merged.join("dir/f"), "new under the old name").unwrap();
        let next = volumes.seal("l-1", "default", &one).unwrap();
        assert_ne!(next.digest, sealed.digest);
        let plain = tmp.path().join("plain");
        tree(
            &plain,
            &[
                ("shared.txt", "changed by l-1"),
                ("new.txt", "l-1 only"),
                ("untouched.bin", "kept as it was"),
                ("moved/f", "in a directory"),
                ("dir/f", "new under the old name"),
            ],
        );
        assert_eq!(volumes.seal("l-plain", "other", &view_of(&plain, "deps")).unwrap(), next);
        let next_tree =
            tmp.path().join("caches/volumes/default/deps/sealed").join(next.digest.strip_prefix("sha256:").unwrap());
        let inode = |path: &Path| std::fs::metadata(path).unwrap().ino();
        assert_eq!(
            inode(&next_tree.join("untouched.bin")),
            inode(&head_tree.join("untouched.bin")),
            "linked, not copied"
        );
        assert_ne!(inode(&next_tree.join("shared.txt")), inode(&head_tree.join("shared.txt")));
        assert_eq!(std::fs::read_to_string(next_tree.join("dir/f")).unwrap(), "new under the old name");
        assert_eq!(std::fs::read_to_string(next_tree.join("moved/f")).unwrap(), "in a directory");
        assert_eq!(volumes.views("l-1"), std::slice::from_ref(&one), "the view is recorded beside the lease");

        // A head the node does not hold: the view starts empty, and says so.
        let elsewhere = volumes.open_view("l-3", &mount("deps"), &head("deps", 7, &next.digest), true).unwrap();
        assert!(!elsewhere.based);
        assert_eq!(std::fs::read_dir(&elsewhere.merged).unwrap().count(), 0);

        for lease in ["l-1", "l-2", "l-3"] {
            volumes.close_views(lease).unwrap();
            assert!(!tmp.path().join("caches/views").join(lease).exists());
        }
        assert!(!is_mounted(&one.merged));
    }
}
