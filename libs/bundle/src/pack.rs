//! Builds a bundle from a directory: its `berth.toml`, a reproducible gzip'd tar of every
//! file, the config with the module list, and the manifest that names them.
//!
//! # Reproducible
//! Entries are sorted by path and carry no owners or times (mtime 0, uid and gid 0), modes
//! are `0755` or `0644`, and the gzip header has no time either: the same directory always
//! packs to the same manifest digest, so pushing it again changes nothing.
//!
//! # What a directory may hold
//! Regular files, directories and symlinks that stay inside it (followed through other
//! links the way path resolution would), within [`BundleLimits`]: the same rules the cache
//! applies when extracting, so a pushed bundle is never one that nodes refuse.

use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use flate2::Compression;
use flate2::write::GzEncoder;

use crate::digest::{Digest, HashingReader};
use crate::extract::{BundleLimits, UnsafeEntry, resolve_inside};
use crate::format::{
    BUNDLE_CONFIG_MEDIA_TYPE, BundleConfig, BundleManifest, BundleModule, Descriptor, LAYER_TAR_GZIP_MEDIA_TYPE,
};
use crate::spec::{BundleSpec, SpecError};

/// Why a directory could not be packed.
#[derive(Debug, thiserror::Error)]
pub enum PackError {
    /// `berth.toml` is missing or breaks a rule.
    #[error("{0}")]
    Spec(#[from] SpecError),
    /// A file or directory could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The path.
        path: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A path in the directory cannot go into a bundle.
    #[error("{path} cannot go into a bundle: {reason}")]
    Unsupported {
        /// The path inside the directory.
        path: String,
        /// Why.
        reason: String,
    },
    /// The directory is over a bundle limit.
    #[error("{path} is over a bundle limit: {reason}")]
    OverLimit {
        /// The path inside the directory that crossed the limit.
        path: String,
        /// Which limit.
        reason: UnsafeEntry,
    },
    /// The entrypoint names no file in the bundle.
    #[error("entrypoint: `{0}` is not a file in the bundle directory")]
    EntrypointMissing(String),
}

/// A bundle ready to push or write: manifest, config and layer, all in memory.
#[derive(Clone)]
pub struct PackedBundle {
    manifest: BundleManifest,
    manifest_bytes: Vec<u8>,
    digest: Digest,
    config: BundleConfig,
    config_bytes: Vec<u8>,
    layer: Vec<u8>,
}

impl std::fmt::Debug for PackedBundle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedBundle")
            .field("digest", &self.digest)
            .field("modules", &self.config.modules.len())
            .field("layer_bytes", &self.layer.len())
            .finish()
    }
}

impl PackedBundle {
    /// Packs `dir`, run as its `berth.toml` says, within the default limits. Blocking.
    pub fn from_dir(dir: &Path) -> Result<Self, PackError> {
        Self::from_dir_with_limits(dir, &BundleLimits::default())
    }

    /// Packs `dir` within `limits`. Blocking.
    pub fn from_dir_with_limits(dir: &Path, limits: &BundleLimits) -> Result<Self, PackError> {
        let spec = BundleSpec::read(dir)?;
        let mut packer = Packer { root: dir, limits, entries: 0, bytes: 0, modules: Vec::new() };
        let gz = GzEncoder::new(Vec::new(), Compression::default());
        let mut tar = tar::Builder::new(gz);
        packer.add_dir(&mut tar, dir, "")?;
        let layer = tar.into_inner().and_then(GzEncoder::finish).map_err(|source| read_error(dir, source))?;
        if !Path::new(&spec.entrypoint).is_absolute() && !dir.join(&spec.entrypoint).is_file() {
            return Err(PackError::EntrypointMissing(spec.entrypoint));
        }
        let config = BundleConfig::new(spec, packer.modules);
        Ok(Self::assemble(config, layer))
    }

    /// A bundle of `config` with `layer` (already a gzip'd tar) as its one layer.
    pub(crate) fn assemble(config: BundleConfig, layer: Vec<u8>) -> Self {
        let config_bytes = config.to_bytes();
        let manifest = BundleManifest::new(
            Descriptor::of(BUNDLE_CONFIG_MEDIA_TYPE, &config_bytes),
            Descriptor::of(LAYER_TAR_GZIP_MEDIA_TYPE, &layer),
        );
        let manifest_bytes = manifest.to_bytes();
        let digest = Digest::of(&manifest_bytes);
        Self { manifest, manifest_bytes, digest, config, config_bytes, layer }
    }

    /// The manifest digest: the bundle's name once pushed.
    pub fn digest(&self) -> &Digest {
        &self.digest
    }

    /// The manifest.
    pub fn manifest(&self) -> &BundleManifest {
        &self.manifest
    }

    /// The manifest exactly as pushed.
    pub fn manifest_bytes(&self) -> &[u8] {
        &self.manifest_bytes
    }

    /// The config.
    pub fn config(&self) -> &BundleConfig {
        &self.config
    }

    /// The blobs the manifest names, config first, each with its bytes.
    pub(crate) fn blobs(&self) -> [(&Descriptor, &[u8]); 2] {
        [(&self.manifest.config, &self.config_bytes), (&self.manifest.layers[0], &self.layer)]
    }
}

struct Packer<'a> {
    root: &'a Path,
    limits: &'a BundleLimits,
    entries: u64,
    bytes: u64,
    modules: Vec<BundleModule>,
}

impl Packer<'_> {
    fn add_dir(&mut self, tar: &mut tar::Builder<impl Write>, dir: &Path, prefix: &str) -> Result<(), PackError> {
        let mut names: Vec<(String, PathBuf)> = Vec::new();
        for entry in fs::read_dir(dir).map_err(|e| read_error(dir, e))? {
            let entry = entry.map_err(|e| read_error(dir, e))?;
            let name = entry.file_name().into_string().map_err(|name| PackError::Unsupported {
                path: Path::new(prefix).join(&name).display().to_string(),
                reason: "its name is not UTF-8".to_owned(),
            })?;
            names.push((name, entry.path()));
        }
        names.sort();
        for (name, path) in names {
            let rel = if prefix.is_empty() { name } else { format!("{prefix}/{name}") };
            self.count_entry(&rel)?;
            let meta = fs::symlink_metadata(&path).map_err(|e| read_error(&path, e))?;
            let file_type = meta.file_type();
            if file_type.is_symlink() {
                self.add_symlink(tar, &path, &rel)?;
            } else if file_type.is_dir() {
                let mut header = tar_header(tar::EntryType::Directory, 0o755, 0);
                tar.append_data(&mut header, format!("{rel}/"), io::empty()).map_err(|e| read_error(&path, e))?;
                self.add_dir(tar, &path, &rel)?;
            } else if file_type.is_file() {
                self.add_file(tar, &path, &rel, &meta)?;
            } else {
                return Err(PackError::Unsupported {
                    path: rel,
                    reason: "it is not a regular file, directory or symlink".to_owned(),
                });
            }
        }
        Ok(())
    }

    fn count_entry(&mut self, rel: &str) -> Result<(), PackError> {
        self.entries += 1;
        if self.entries > self.limits.max_entries {
            return Err(PackError::OverLimit {
                path: rel.to_owned(),
                reason: UnsafeEntry::TooManyEntries { limit: self.limits.max_entries },
            });
        }
        Ok(())
    }

    fn add_file(
        &mut self,
        tar: &mut tar::Builder<impl Write>,
        path: &Path,
        rel: &str,
        meta: &fs::Metadata,
    ) -> Result<(), PackError> {
        let size = meta.len();
        if size > self.limits.max_file_bytes {
            return Err(PackError::OverLimit {
                path: rel.to_owned(),
                reason: UnsafeEntry::FileTooLarge { size, limit: self.limits.max_file_bytes },
            });
        }
        if self.bytes.saturating_add(size) > self.limits.max_total_bytes {
            return Err(PackError::OverLimit {
                path: rel.to_owned(),
                reason: UnsafeEntry::BundleTooLarge { limit: self.limits.max_total_bytes },
            });
        }
        let executable = meta.permissions().mode() & 0o111 != 0;
        let mut header = tar_header(tar::EntryType::Regular, if executable { 0o755 } else { 0o644 }, size);
        let file = fs::File::open(path).map_err(|e| read_error(path, e))?;
        let mut reader = HashingReader::new(file.take(size));
        tar.append_data(&mut header, rel, &mut reader).map_err(|e| read_error(path, e))?;
        let (digest, read) = reader.finish();
        if read != size {
            return Err(PackError::Unsupported {
                path: rel.to_owned(),
                reason: "it changed while being packed".to_owned(),
            });
        }
        self.bytes += size;
        self.modules.push(BundleModule { path: rel.to_owned(), digest, size });
        Ok(())
    }

    fn add_symlink(&mut self, tar: &mut tar::Builder<impl Write>, path: &Path, rel: &str) -> Result<(), PackError> {
        let target = fs::read_link(path).map_err(|e| read_error(path, e))?;
        resolve_inside(self.root, Path::new(rel))
            .map_err(|reason| PackError::Unsupported { path: rel.to_owned(), reason: reason.to_string() })?;
        let mut header = tar_header(tar::EntryType::Symlink, 0o777, 0);
        tar.append_link(&mut header, rel, &target).map_err(|e| read_error(path, e))?;
        Ok(())
    }
}

/// A header with no owner and no time, so the same tree packs to the same bytes.
pub(crate) fn tar_header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(kind);
    header.set_mode(mode);
    header.set_size(size);
    header.set_mtime(0);
    header.set_uid(0);
    header.set_gid(0);
    header
}

fn read_error(path: &Path, source: io::Error) -> PackError {
    PackError::Read { path: path.display().to_string(), source }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with(spec: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("berth.toml"), spec).unwrap();
        std::fs::write(dir.path().join("app"), "#!/bin/sh\n").unwrap();
        dir
    }

    #[test]
    fn the_same_tree_packs_to_the_same_digest_whatever_its_times() {
        let dir = dir_with(r#"entrypoint = "app""#);
        let first = PackedBundle::from_dir(dir.path()).unwrap();
        let file = std::fs::File::options().write(true).open(dir.path().join("app")).unwrap();
        file.set_modified(std::time::SystemTime::UNIX_EPOCH).unwrap();
        let second = PackedBundle::from_dir(dir.path()).unwrap();
        assert_eq!(first.digest(), second.digest());
        let paths: Vec<&str> = first.config().modules.iter().map(|m| m.path.as_str()).collect();
        assert_eq!(paths, ["app", "berth.toml"]);
        assert_eq!(first.config().modules[0].digest, Digest::of(b"#!/bin/sh\n"));
    }

    #[test]
    fn symlinks_out_of_the_directory_are_refused_by_path() {
        let dir = dir_with(r#"entrypoint = "app""#);
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("passwd")).unwrap();
        let Err(PackError::Unsupported { path, .. }) = PackedBundle::from_dir(dir.path()) else {
            panic!("an escaping symlink was packed");
        };
        assert_eq!(path, "passwd");
    }

    #[test]
    fn sockets_are_refused_by_path() {
        let dir = dir_with(r#"entrypoint = "app""#);
        std::fs::create_dir(dir.path().join("run")).unwrap();
        let _listener = std::os::unix::net::UnixListener::bind(dir.path().join("run/sock")).unwrap();
        let Err(PackError::Unsupported { path, .. }) = PackedBundle::from_dir(dir.path()) else {
            panic!("a socket was packed");
        };
        assert_eq!(path, "run/sock");
    }

    #[test]
    fn a_missing_entrypoint_or_spec_is_refused() {
        let dir = dir_with(r#"entrypoint = "bin/missing""#);
        assert!(
            matches!(PackedBundle::from_dir(dir.path()), Err(PackError::EntrypointMissing(e)) if e == "bin/missing")
        );
        let absolute = dir_with(r#"entrypoint = "/usr/bin/python3""#);
        assert!(PackedBundle::from_dir(absolute.path()).is_ok());
        let empty = tempfile::tempdir().unwrap();
        assert!(matches!(PackedBundle::from_dir(empty.path()), Err(PackError::Spec(SpecError::Read { .. }))));
    }

    #[test]
    fn directories_over_the_limits_are_refused() {
        let dir = dir_with(r#"entrypoint = "app""#);
        std::fs::write(dir.path().join("big"), vec![0u8; 4096]).unwrap();
        let limits = BundleLimits { max_file_bytes: 1024, ..BundleLimits::default() };
        let Err(PackError::OverLimit { path, reason }) = PackedBundle::from_dir_with_limits(dir.path(), &limits) else {
            panic!("an oversized file was packed");
        };
        assert_eq!(path, "big");
        assert_eq!(reason, UnsafeEntry::FileTooLarge { size: 4096, limit: 1024 });
    }
}
