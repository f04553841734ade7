//! Cache volume generations as OCI artifacts: what a node pushes once it
//! sealed a generation, so that a node that does not hold it can pull it by
//! digest and start a lease's view from the same content.
//!
//! # The artifact
//! An OCI image manifest with `artifactType` [`CACHE_ARTIFACT_TYPE`], a JSON
//! config ([`CacheConfig`]: the digest of the sealed tree it carries) and
//! one or more gzip'd tar layers, applied in order the way an image's are:
//! a later layer replaces what an earlier one put at a path, and a whiteout
//! (`.wh.NAME`) removes NAME. A generation whose base generation was pushed
//! reuses the base's layers and adds those holding only what its lease
//! changed ([`pack_cache_layers`] against the base's tree), so publishing
//! uploads the change, not the volume. A generation whose base already
//! stacks [`MAX_CACHE_CHAIN`] generations' layers is packed whole instead
//! (its config's `chain` counts them). Layers are cut at about
//! [`CACHE_LAYER_BYTES`] of content, so no upload holds more than that (or
//! one larger file) in memory.
//!
//! # Invariants
//! - Entries carry no owner and no time, and modes less set-uid and set-gid:
//!   the bits a sealed tree's digest covers, so the layers unpacked in order
//!   give back a tree with the digest the config names. The puller checks
//!   that digest (against the ledger's, not the config's word) before a
//!   lease sees a byte of it.
//! - Every blob is checked against its descriptor as it streams in; layers
//!   are unpacked with the image rules (no path out of the tree, no device
//!   files, bounded sizes), so a registry serving hostile content fails the
//!   pull, never writes outside the scratch tree.

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Read as _, Write};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use flate2::Compression;
use flate2::write::GzEncoder;
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::client::{BlobSource, Fetcher};
use crate::digest::Digest;
use crate::extract::{BundleLimits, ExtractError};
use crate::format::{BundleManifest, Descriptor, LAYER_TAR_GZIP_MEDIA_TYPE, MAX_CONFIG_BYTES, OCI_MANIFEST_MEDIA_TYPE};
use crate::image_user::ImageOwners;
use crate::pack::tar_header;
use crate::registry_error::RegistryError;
use crate::{BundleClient, BundleReference, RegistryCredentials, RegistryReference};

/// The `artifactType` of a cache generation's manifest.
pub const CACHE_ARTIFACT_TYPE: &str = "application/vnd.berth.cache.v1";

/// The media type of a cache generation's config.
pub const CACHE_CONFIG_MEDIA_TYPE: &str = "application/vnd.berth.cache.config.v1+json";

/// The most generations whose layers one manifest stacks; the next
/// generation over such a one is packed whole.
pub const MAX_CACHE_CHAIN: u32 = 16;

/// About how much file content one layer holds before the next begins.
pub const CACHE_LAYER_BYTES: u64 = 64 << 20;

/// The prefix that makes an entry a whiteout.
const WHITEOUT_PREFIX: &str = ".wh.";

/// Permission bits an entry keeps: set-uid and set-gid are dropped.
const KEPT_MODE: u32 = 0o1777;

/// What a cache generation's config says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CacheConfig {
    /// The sealed tree's digest, `sha256:<hex>`.
    pub tree_digest: String,
    /// How many generations' layers the manifest stacks: 1 for a
    /// generation packed whole, its base's plus 1 for one packed as a change.
    #[serde(default)]
    pub chain: u32,
}

/// One layer packed into a file of the caller's.
#[derive(Debug, Clone)]
pub struct PackedLayer {
    /// Where the gzip'd tar is.
    pub path: PathBuf,
    /// What a manifest says of it.
    pub descriptor: Descriptor,
}

/// Why a generation could not be pulled.
#[derive(Debug, thiserror::Error)]
pub enum CachePullError {
    /// The registry could not be read, or served something else than asked.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// What it served is not a cache generation.
    #[error("{reference} is not a cache generation: {reason}")]
    NotACache {
        /// What was pulled.
        reference: String,
        /// Why not.
        reason: String,
    },
    /// A layer could not be unpacked.
    #[error("cannot unpack a layer of {reference}: {source}")]
    Unpack {
        /// What was pulled.
        reference: String,
        /// Why.
        #[source]
        source: ExtractError,
    },
}

/// Packs into `out` (an existing directory) gzip'd tar layers that turn the
/// tree `base` into the tree `tree`, or that hold all of `tree` when there
/// is no base. A regular file is left out when it is the base's file (one
/// inode) or `same_content(path)` says its content is the base's; a
/// directory is left out when it has the base's mode, and its entries are
/// compared in turn. Blocking.
pub fn pack_cache_layers(
    tree: &Path,
    base: Option<&Path>,
    same_content: &dyn Fn(&str) -> bool,
    out: &Path,
) -> io::Result<Vec<PackedLayer>> {
    let mut packer = LayerPacker { out, same_content, layers: Vec::new(), current: None };
    packer.diff(tree, base, Path::new(""))?;
    if base.is_none() && packer.layers.is_empty() {
        // An empty volume is one empty layer: a manifest names at least one.
        packer.layer()?;
    }
    packer.finish_layer()?;
    Ok(packer.layers)
}

/// The layer being written, and how much content it holds.
struct OpenLayer {
    tar: tar::Builder<GzEncoder<HashingWriter<fs::File>>>,
    path: PathBuf,
    bytes: u64,
}

struct LayerPacker<'a> {
    out: &'a Path,
    same_content: &'a dyn Fn(&str) -> bool,
    layers: Vec<PackedLayer>,
    current: Option<OpenLayer>,
}

impl LayerPacker<'_> {
    fn diff(&mut self, tree: &Path, base: Option<&Path>, rel: &Path) -> io::Result<()> {
        let here = tree.join(rel);
        let names = sorted_names(&here)?;
        let base_here = base.map(|base| base.join(rel)).filter(|dir| is_real_dir(dir));
        if let Some(base_dir) = &base_here {
            for gone in sorted_names(base_dir)?.into_iter().filter(|name| !names.contains(name)) {
                self.whiteout(&rel.join(gone))?;
            }
        }
        for name in names {
            let path = rel.join(&name);
            let meta = fs::symlink_metadata(tree.join(&path))?;
            let below = base_here.as_ref().and_then(|dir| fs::symlink_metadata(dir.join(&name)).ok());
            let kind = meta.file_type();
            if kind.is_dir() {
                match &below {
                    Some(old) if old.is_dir() => {
                        if mode(old) != mode(&meta) {
                            self.directory(&path, &meta)?;
                        }
                        self.diff(tree, base, &path)?;
                    }
                    old => {
                        if old.is_some() {
                            self.whiteout(&path)?;
                        }
                        self.directory(&path, &meta)?;
                        self.diff(tree, None, &path)?;
                    }
                }
            } else if kind.is_symlink() {
                let target = fs::read_link(tree.join(&path))?;
                let unchanged = below.as_ref().is_some_and(|old| old.file_type().is_symlink())
                    && base.is_some_and(|base| fs::read_link(base.join(&path)).ok().as_ref() == Some(&target));
                if !unchanged {
                    if below.as_ref().is_some_and(fs::Metadata::is_dir) {
                        self.whiteout(&path)?;
                    }
                    self.symlink(&path, &target)?;
                }
            } else if kind.is_file() {
                let unchanged = below.as_ref().is_some_and(|old| {
                    old.is_file()
                        && mode(old) == mode(&meta)
                        && ((old.dev(), old.ino()) == (meta.dev(), meta.ino())
                            || path.to_str().is_some_and(|text| (self.same_content)(text)))
                });
                if !unchanged {
                    if below.as_ref().is_some_and(fs::Metadata::is_dir) {
                        self.whiteout(&path)?;
                    }
                    self.file(&tree.join(&path), &path, &meta)?;
                }
            }
            // Anything else is not content a sealed tree holds.
        }
        Ok(())
    }

    fn layer(&mut self) -> io::Result<&mut OpenLayer> {
        if self.current.is_none() {
            let path = self.out.join(format!("layer-{}.tar.gz", self.layers.len()));
            let file = fs::File::create(&path)?;
            let gz = GzEncoder::new(HashingWriter::new(file), Compression::fast());
            self.current = Some(OpenLayer { tar: tar::Builder::new(gz), path, bytes: 0 });
        }
        Ok(self.current.as_mut().expect("opened above"))
    }

    /// Ends the open layer once it holds about a layer's worth.
    fn maybe_cut(&mut self) -> io::Result<()> {
        if self.current.as_ref().is_some_and(|layer| layer.bytes >= CACHE_LAYER_BYTES) {
            self.finish_layer()?;
        }
        Ok(())
    }

    fn finish_layer(&mut self) -> io::Result<()> {
        let Some(layer) = self.current.take() else { return Ok(()) };
        let hashing = layer.tar.into_inner()?.finish()?;
        let (file, digest, size) = hashing.finish();
        file.sync_all()?;
        let descriptor = Descriptor {
            media_type: LAYER_TAR_GZIP_MEDIA_TYPE.to_owned(),
            digest,
            size,
            artifact_type: None,
            annotations: BTreeMap::new(),
        };
        self.layers.push(PackedLayer { path: layer.path, descriptor });
        Ok(())
    }

    fn whiteout(&mut self, path: &Path) -> io::Result<()> {
        let name = path.file_name().map(|name| name.to_string_lossy().into_owned()).unwrap_or_default();
        let marker = path.with_file_name(format!("{WHITEOUT_PREFIX}{name}"));
        let mut header = tar_header(tar::EntryType::Regular, 0o600, 0);
        self.layer()?.tar.append_data(&mut header, marker, io::empty())
    }

    fn directory(&mut self, path: &Path, meta: &fs::Metadata) -> io::Result<()> {
        let mut header = tar_header(tar::EntryType::Directory, mode(meta), 0);
        self.layer()?.tar.append_data(&mut header, path, io::empty())
    }

    fn symlink(&mut self, path: &Path, target: &Path) -> io::Result<()> {
        let mut header = tar_header(tar::EntryType::Symlink, 0o777, 0);
        self.layer()?.tar.append_link(&mut header, path, target)
    }

    fn file(&mut self, source: &Path, path: &Path, meta: &fs::Metadata) -> io::Result<()> {
        let size = meta.len();
        let mut header = tar_header(tar::EntryType::Regular, mode(meta), size);
        let file = fs::File::open(source)?;
        let layer = self.layer()?;
        layer.tar.append_data(&mut header, path, file.take(size))?;
        layer.bytes = layer.bytes.saturating_add(size);
        self.maybe_cut()
    }
}

fn mode(meta: &fs::Metadata) -> u32 {
    meta.mode() & KEPT_MODE
}

fn is_real_dir(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|meta| meta.is_dir())
}

fn sorted_names(dir: &Path) -> io::Result<Vec<std::ffi::OsString>> {
    let mut names =
        fs::read_dir(dir)?.map(|entry| entry.map(|entry| entry.file_name())).collect::<Result<Vec<_>, _>>()?;
    names.sort();
    Ok(names)
}

/// Counts and hashes what passes through to `inner`.
struct HashingWriter<W> {
    inner: W,
    hasher: Sha256,
    len: u64,
}

impl<W> HashingWriter<W> {
    fn new(inner: W) -> Self {
        Self { inner, hasher: Sha256::new(), len: 0 }
    }

    fn finish(self) -> (W, Digest, u64) {
        let hex = hex::encode(self.hasher.finalize());
        let digest = Digest::from_hex(&hex).expect("a SHA-256 is 64 hex digits");
        (self.inner, digest, self.len)
    }
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let written = self.inner.write(bytes)?;
        self.hasher.update(&bytes[..written]);
        self.len += written as u64;
        Ok(written)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl CacheConfig {
    fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a config serializes")
    }
}

/// The manifest of a generation: its config and layers.
fn manifest(config: Descriptor, layers: Vec<Descriptor>) -> BundleManifest {
    BundleManifest {
        schema_version: 2,
        media_type: Some(OCI_MANIFEST_MEDIA_TYPE.to_owned()),
        artifact_type: Some(CACHE_ARTIFACT_TYPE.to_owned()),
        config,
        layers,
        annotations: BTreeMap::new(),
    }
}

/// `repository` (`host/path`) with `tag`, as a registry reference.
fn reference(repository: &str, tag: &str) -> Result<RegistryReference, RegistryError> {
    let text = format!("{repository}:{tag}");
    match BundleReference::parse(&text) {
        Ok(BundleReference::Registry(reference)) => Ok(reference),
        Ok(BundleReference::Layout(_)) => Err(RegistryError::InvalidReference {
            reference: text,
            reason: "cache generations are kept in a registry, not a layout directory".to_owned(),
        }),
        Err(error) => Err(RegistryError::InvalidReference { reference: text, reason: error.to_string() }),
    }
}

impl BundleClient {
    /// The layers and config of the generation `digest` in `repository`
    /// (`host/path`), verified.
    pub async fn cache_generation(
        &self,
        repository: &str,
        digest: &Digest,
        credentials: &RegistryCredentials,
    ) -> Result<(Vec<Descriptor>, CacheConfig), CachePullError> {
        let fetcher = self.fetcher(&BundleReference::Registry(reference(repository, "latest")?), credentials)?;
        generation_at(&fetcher, repository, digest).await
    }

    /// Pushes a generation to `repository` (`host/path`) under `tag`: the
    /// layers `below` (already there, a pushed base generation's) and then
    /// `layers`, with `config`. Blobs the registry has are not sent again.
    /// The manifest digest.
    pub async fn push_cache_generation(
        &self,
        repository: &str,
        tag: &str,
        below: &[Descriptor],
        layers: &[PackedLayer],
        config: &CacheConfig,
        credentials: &RegistryCredentials,
    ) -> Result<Digest, RegistryError> {
        let reference = reference(repository, tag)?;
        let config_bytes = config.to_bytes();
        let config_descriptor = Descriptor::of(CACHE_CONFIG_MEDIA_TYPE, &config_bytes);
        let all: Vec<Descriptor> =
            below.iter().cloned().chain(layers.iter().map(|layer| layer.descriptor.clone())).collect();
        let manifest_bytes = manifest(config_descriptor.clone(), all).to_bytes();
        let mut blobs: Vec<(&Descriptor, BlobSource<'_>)> =
            layers.iter().map(|layer| (&layer.descriptor, BlobSource::File(&layer.path))).collect();
        blobs.push((&config_descriptor, BlobSource::Memory(&config_bytes)));
        self.push_artifact(&reference, blobs, &manifest_bytes, credentials).await?;
        Ok(Digest::of(&manifest_bytes))
    }

    /// Pulls the generation `digest` from `repository` (`host/path`) and
    /// unpacks its layers in order into `into`, each downloaded to `scratch`
    /// first and checked; its config. `into` is an empty directory, or with
    /// `skip` > 0 a tree its first `skip` layers already built (the caller
    /// laid out a generation whose artifact's layers they are): only the
    /// rest are pulled. Its config and how many layers it has. On an error,
    /// `into` holds part of it: the caller removes it.
    #[allow(clippy::too_many_arguments, reason = "each is one part of one pull")]
    pub async fn pull_cache_generation(
        &self,
        repository: &str,
        digest: &Digest,
        credentials: &RegistryCredentials,
        scratch: &Path,
        into: &Path,
        limits: &BundleLimits,
        skip: usize,
    ) -> Result<(CacheConfig, usize), CachePullError> {
        // One fetcher for the manifest and the blobs: it signs in once.
        let fetcher = self.fetcher(&BundleReference::Registry(reference(repository, "latest")?), credentials)?;
        let (layers, config) = generation_at(&fetcher, repository, digest).await?;
        let shown = format!("{repository}@{digest}");
        for (index, layer) in layers.iter().enumerate().skip(skip) {
            let path = scratch.join(format!("pull-{index}.tar.gz"));
            let mut file = tokio::fs::File::create(&path)
                .await
                .map_err(|source| RegistryError::Layout { path: path.display().to_string(), source })?;
            fetcher.blob(layer, limits.max_stream_bytes(), &mut file).await?;
            drop(file);
            let (archive, root, limits, media_type) =
                (path.clone(), into.to_path_buf(), *limits, layer.media_type.clone());
            let unpacked = tokio::task::spawn_blocking(move || {
                crate::image::unpack_image_layer(&archive, &media_type, &root, &limits, &mut ImageOwners::default())
            })
            .await
            .map_err(|e| CachePullError::Unpack {
                reference: shown.clone(),
                source: ExtractError::Archive(io::Error::other(e.to_string())),
            })?;
            let _ = tokio::fs::remove_file(&path).await;
            unpacked.map_err(|source| CachePullError::Unpack { reference: shown.clone(), source })?;
        }
        Ok((config, layers.len()))
    }
}

/// The layers and config of the generation `digest`, through `fetcher`.
async fn generation_at(
    fetcher: &Fetcher,
    repository: &str,
    digest: &Digest,
) -> Result<(Vec<Descriptor>, CacheConfig), CachePullError> {
    let shown = format!("{repository}@{digest}");
    let not_a_cache = |reason: String| CachePullError::NotACache { reference: shown.clone(), reason };
    let bytes = fetcher.manifest(digest).await?;
    let manifest: BundleManifest = serde_json::from_slice(&bytes).map_err(|e| not_a_cache(e.to_string()))?;
    if manifest.artifact_type.as_deref() != Some(CACHE_ARTIFACT_TYPE) {
        return Err(not_a_cache(format!("its artifactType is {:?}", manifest.artifact_type)));
    }
    if manifest.config.media_type != CACHE_CONFIG_MEDIA_TYPE {
        return Err(not_a_cache(format!("its config is {}", manifest.config.media_type)));
    }
    if let Some(layer) = manifest.layers.iter().find(|layer| layer.media_type != LAYER_TAR_GZIP_MEDIA_TYPE) {
        return Err(not_a_cache(format!("a layer is {}", layer.media_type)));
    }
    let config = fetcher.small_blob(&manifest.config, MAX_CONFIG_BYTES).await?;
    let config: CacheConfig = serde_json::from_slice(&config).map_err(|e| not_a_cache(e.to_string()))?;
    Ok((manifest.layers, config))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    fn write(root: &Path, path: &str, text: &str) {
        let path = root.join(path);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, text).unwrap();
    }

    /// Every entry under `root`: path, kind, mode and content.
    fn listing(root: &Path) -> Vec<String> {
        let mut out = Vec::new();
        let mut stack = vec![PathBuf::new()];
        while let Some(rel) = stack.pop() {
            for name in sorted_names(&root.join(&rel)).unwrap() {
                let path = rel.join(name);
                let meta = fs::symlink_metadata(root.join(&path)).unwrap();
                let shown = path.display();
                if meta.is_dir() {
                    out.push(format!("d {shown} {:o}", mode(&meta)));
                    stack.push(path);
                } else if meta.file_type().is_symlink() {
                    out.push(format!("l {shown} -> {}", fs::read_link(root.join(&path)).unwrap().display()));
                } else {
                    let text = fs::read_to_string(root.join(&path)).unwrap();
                    out.push(format!("f {shown} {:o} {text}", mode(&meta) & 0o111));
                }
            }
        }
        out.sort();
        out
    }

    fn unpack(layers: &[PackedLayer], into: &Path) {
        for layer in layers {
            crate::image::unpack_image_layer(
                &layer.path,
                &layer.descriptor.media_type,
                into,
                &BundleLimits::default(),
                &mut ImageOwners::default(),
            )
            .unwrap();
        }
    }

    fn entries(layer: &PackedLayer) -> Vec<String> {
        let file = fs::File::open(&layer.path).unwrap();
        let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(file));
        archive.entries().unwrap().map(|e| e.unwrap().path().unwrap().display().to_string()).collect()
    }

    #[test]
    fn a_change_packs_only_what_changed_and_the_layers_in_order_give_the_new_tree() {
        let tmp = tempfile::tempdir().unwrap();
        let (base, next, out) = (tmp.path().join("base"), tmp.path().join("next"), tmp.path().join("out"));
        fs::create_dir_all(&out).unwrap();
        write(&base, "kept.txt", "the same");
        write(&base, "changed.txt", "before");
        write(&base, "gone.txt", "removed later");
        write(&base, "dir/inner", "in a directory");
        write(&base, "becomes-dir", "a file first");
        std::os::unix::fs::symlink("kept.txt", base.join("link")).unwrap();
        let whole = pack_cache_layers(&base, None, &|_| false, &out).unwrap();
        assert_eq!(whole.len(), 1);

        write(&next, "kept.txt", "the same");
        write(&next, "changed.txt", "after");
        write(&next, "dir/inner", "in a directory");
        write(&next, "becomes-dir/child", "now a directory");
        write(&next, "new/deep/file", "added");
        std::os::unix::fs::symlink("changed.txt", next.join("link")).unwrap();
        fs::set_permissions(next.join("dir"), fs::Permissions::from_mode(0o700)).unwrap();
        let delta_dir = tmp.path().join("delta");
        fs::create_dir_all(&delta_dir).unwrap();
        let delta = pack_cache_layers(&next, Some(&base), &|path| matches!(path, "kept.txt" | "dir/inner"), &delta_dir)
            .unwrap();
        let packed = entries(&delta[0]);
        for absent in ["kept.txt", "dir/inner"] {
            assert!(!packed.contains(&absent.to_owned()), "{absent} is unchanged: {packed:?}");
        }
        for present in [".wh.gone.txt", "changed.txt", "dir", "link", "becomes-dir/child", "new/deep/file"] {
            assert!(packed.contains(&present.to_owned()), "{present} changed: {packed:?}");
        }

        let rebuilt = tmp.path().join("rebuilt");
        fs::create_dir_all(&rebuilt).unwrap();
        unpack(&whole, &rebuilt);
        unpack(&delta, &rebuilt);
        assert_eq!(listing(&rebuilt), listing(&next));
    }

    #[test]
    fn an_empty_volume_is_one_empty_layer_and_an_unchanged_one_adds_none() {
        let tmp = tempfile::tempdir().unwrap();
        let (tree, out) = (tmp.path().join("tree"), tmp.path().join("out"));
        fs::create_dir_all(&tree).unwrap();
        fs::create_dir_all(&out).unwrap();
        let whole = pack_cache_layers(&tree, None, &|_| false, &out).unwrap();
        assert_eq!(whole.len(), 1);
        assert!(entries(&whole[0]).is_empty());
        let same = pack_cache_layers(&tree, Some(&tree), &|_| true, &out).unwrap();
        assert!(same.is_empty(), "nothing changed, nothing to add over the base's layers");
    }

    #[test]
    fn a_large_tree_is_cut_into_layers_that_rebuild_it() {
        let tmp = tempfile::tempdir().unwrap();
        let (tree, out) = (tmp.path().join("tree"), tmp.path().join("out"));
        fs::create_dir_all(&out).unwrap();
        let chunk = "x".repeat(usize::try_from(CACHE_LAYER_BYTES / 2).unwrap() + 1);
        for name in ["a", "b", "c"] {
            write(&tree, name, &chunk);
        }
        let layers = pack_cache_layers(&tree, None, &|_| false, &out).unwrap();
        assert_eq!(layers.len(), 2, "two files fill a layer; the third starts the next");
        let rebuilt = tmp.path().join("rebuilt");
        fs::create_dir_all(&rebuilt).unwrap();
        unpack(&layers, &rebuilt);
        assert_eq!(listing(&rebuilt), listing(&tree));
        for layer in &layers {
            let bytes = fs::read(&layer.path).unwrap();
            assert_eq!(layer.descriptor.digest, Digest::of(&bytes));
            assert_eq!(layer.descriptor.size, bytes.len() as u64);
        }
    }
}
