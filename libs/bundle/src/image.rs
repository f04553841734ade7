//! Unpacks a container image's layers, in order, into one root directory,
//! as an OCI runtime will show it to a workload: a later layer replaces
//! what an earlier one put at a path, a whiteout (`.wh.NAME`) removes NAME
//! from the layers below, and an opaque marker (`.wh..wh..opq`) hides a
//! directory's lower contents.
//!
//! # What is refused, always naming the entry
//! - absolute paths and paths with `..` components;
//! - an entry whose parent path goes through a symlink, an earlier layer's
//!   (`etc -> /host/etc`, then `etc/passwd`) or its own: writing through it
//!   could land outside the root;
//! - a whiteout naming `.`, `..` or nothing;
//! - hardlinks to anything but a regular file already inside the root;
//! - device files, FIFOs and any other entry type;
//! - a layer that ends early, or that is not a tar stream;
//! - more entries or bytes than [`BundleLimits`] allows.
//!
//! # What is kept
//! Files, directories, symlinks (absolute ones too: the runtime resolves them
//! inside the root) and hardlinks, with their permission bits, less set-uid
//! and set-gid. Owners are not kept in the tree: everything belongs to the
//! unpacking user, and workloads run as users of their own. Who the layers
//! say owns an entry, where that is not root, is recorded in an
//! [`ImageOwners`] instead, so that an image's `User` can be given what the
//! image meant to be its own (see [`crate::ImageUser`]).
//!
//! # Expected flow
//! The caller unpacks every layer into a fresh private directory and, on any
//! error, removes it whole; only a complete tree is ever used as a root.

use std::collections::HashSet;
use std::fs::{self, Permissions};
use std::io::{self, Read};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use crate::extract::{
    BoundedReader, BundleLimits, ExtractError, ExtractStats, ParentRefusal, UnsafeEntry, admit_entry, create_dir,
    hardlink_source, io_error, link_target, prepare_parents, unsupported, write_file_entry,
};
use crate::format::LAYER_TAR_GZIP_MEDIA_TYPE;
use crate::image_user::ImageOwners;

/// The prefix that makes an entry a whiteout.
const WHITEOUT_PREFIX: &str = ".wh.";

/// The entry that makes its directory opaque.
const OPAQUE_MARKER: &str = ".wh..wh..opq";

/// Permission bits kept from the archive: set-uid and set-gid are dropped.
const KEPT_MODE: u32 = 0o1777;

/// Unpacks the layer in `archive` (gzip'd when `media_type` says so) onto
/// `root`, above the layers already there, noting in `owners` who owns what
/// it writes.
pub fn unpack_image_layer(
    archive: &Path,
    media_type: &str,
    root: &Path,
    limits: &BundleLimits,
    owners: &mut ImageOwners,
) -> Result<ExtractStats, ExtractError> {
    let file = fs::File::open(archive).map_err(ExtractError::Archive)?;
    let reader = io::BufReader::new(file);
    if media_type == LAYER_TAR_GZIP_MEDIA_TYPE || media_type.ends_with("tar+gzip") || media_type.ends_with(".gzip") {
        unpack_image_tar(flate2::read::MultiGzDecoder::new(reader), root, limits, owners)
    } else {
        unpack_image_tar(reader, root, limits, owners)
    }
}

/// Unpacks one plain tar layer onto `root`, noting in `owners` who owns
/// what it writes.
pub fn unpack_image_tar(
    reader: impl Read,
    root: &Path,
    limits: &BundleLimits,
    owners: &mut ImageOwners,
) -> Result<ExtractStats, ExtractError> {
    let bounded = BoundedReader::new(reader, limits.max_stream_bytes());
    let mut archive = tar::Archive::new(bounded);
    let mut stats = ExtractStats::default();
    // What this layer wrote: an opaque marker hides only the layers below.
    let mut written: HashSet<PathBuf> = HashSet::new();
    for entry in archive.entries().map_err(ExtractError::Archive)? {
        let mut entry = entry.map_err(ExtractError::Archive)?;
        let Some((name, kind, rel)) = admit_entry(&entry, &mut stats, limits)? else { continue };
        let refuse = |reason: UnsafeEntry| ExtractError::Refused { entry: name.clone(), reason };
        let file_name = rel.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if file_name == OPAQUE_MARKER {
            prepare_parents(root, &rel).map_err(|r| r.into_error(&name))?;
            let dir = rel.parent().map(Path::to_path_buf).unwrap_or_default();
            hide_lower(root, &dir, &written, owners)?;
            continue;
        }
        if let Some(hidden) = file_name.strip_prefix(WHITEOUT_PREFIX) {
            if hidden.is_empty() || hidden == "." || hidden == ".." || hidden.contains('/') {
                return Err(refuse(UnsafeEntry::BadWhiteout(hidden.to_string())));
            }
            prepare_parents(root, &rel).map_err(|r| r.into_error(&name))?;
            let hidden = rel.with_file_name(hidden);
            remove_any(&root.join(&hidden))?;
            owners.forget(&hidden);
            continue;
        }
        prepare_parents(root, &rel).map_err(|r: ParentRefusal| r.into_error(&name))?;
        let target = root.join(&rel);
        let mode = entry.header().mode().unwrap_or(0o644) & KEPT_MODE;
        if !kind.is_dir() {
            // Whatever was at the path goes, with all it held.
            owners.forget(&rel);
        }
        if kind.is_dir() {
            match fs::symlink_metadata(&target) {
                Ok(meta) if meta.is_dir() => {}
                Ok(_) => {
                    remove_any(&target)?;
                    create_dir(&target)?;
                }
                Err(_) => create_dir(&target)?,
            }
            fs::set_permissions(&target, Permissions::from_mode(mode | 0o700)).map_err(|e| io_error(&target, e))?;
        } else if kind.is_file() || kind.is_contiguous() {
            remove_any(&target)?;
            write_file_entry(&mut entry, &name, &target, mode, limits, &mut stats)?;
        } else if kind.is_symlink() {
            let link = link_target(&entry, &name)?;
            remove_any(&target)?;
            std::os::unix::fs::symlink(&link, &target).map_err(|e| io_error(&target, e))?;
        } else if kind.is_hard_link() {
            let source = hardlink_source(root, &link_target(&entry, &name)?).map_err(refuse)?;
            if source != target {
                remove_any(&target)?;
                fs::hard_link(&source, &target).map_err(|e| io_error(&target, e))?;
            }
        } else {
            return Err(refuse(unsupported(kind)));
        }
        let header = entry.header();
        owners.note(&rel, header.uid().unwrap_or(0), header.gid().unwrap_or(0));
        written.insert(rel);
    }
    Ok(stats)
}

/// Removes whatever is at `path` (a directory with everything in it); a
/// path with nothing there is fine. Never follows a symlink at `path`.
fn remove_any(path: &Path) -> Result<(), ExtractError> {
    let removed = match fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => Err(e),
    };
    removed.map_err(|e| io_error(path, e))
}

/// Removes what the layers below put in `dir`, keeping what this layer wrote.
fn hide_lower(
    root: &Path,
    dir: &Path,
    written: &HashSet<PathBuf>,
    owners: &mut ImageOwners,
) -> Result<(), ExtractError> {
    let here = root.join(dir);
    let entries = match fs::read_dir(&here) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_error(&here, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| io_error(&here, e))?;
        let rel = dir.join(entry.file_name());
        if !written.contains(&rel) {
            remove_any(&root.join(&rel))?;
            owners.forget(&rel);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tar layer built entry by entry.
    struct Layer(tar::Builder<Vec<u8>>);

    impl Layer {
        fn new() -> Self {
            Layer(tar::Builder::new(Vec::new()))
        }

        fn file(mut self, path: &str, body: &str, mode: u32) -> Self {
            let mut header = tar::Header::new_gnu();
            header.set_size(body.len() as u64);
            header.set_mode(mode);
            header.set_entry_type(tar::EntryType::Regular);
            self.0.append_data(&mut header, path, body.as_bytes()).unwrap();
            self
        }

        fn dir(mut self, path: &str) -> Self {
            let mut header = tar::Header::new_gnu();
            header.set_size(0);
            header.set_mode(0o755);
            header.set_entry_type(tar::EntryType::Directory);
            self.0.append_data(&mut header, path, io::empty()).unwrap();
            self
        }

        fn link(mut self, kind: tar::EntryType, path: &str, target: &str) -> Self {
            let mut header = tar::Header::new_gnu();
            header.set_size(0);
            header.set_mode(0o777);
            header.set_entry_type(kind);
            self.0.append_link(&mut header, path, target).unwrap();
            self
        }

        /// An entry whose name the tar crate would refuse to write (`..`):
        /// set in the header's raw bytes.
        fn raw(mut self, path: &str, kind: tar::EntryType) -> Self {
            let mut header = tar::Header::new_old();
            header.as_old_mut().name[..path.len()].copy_from_slice(path.as_bytes());
            header.set_size(0);
            header.set_mode(0o644);
            header.set_entry_type(kind);
            header.set_cksum();
            self.0.append(&header, io::empty()).unwrap();
            self
        }

        fn bytes(self) -> Vec<u8> {
            self.0.into_inner().unwrap()
        }
    }

    fn unpack(root: &Path, layer: Layer) -> Result<ExtractStats, ExtractError> {
        unpack_image_tar(layer.bytes().as_slice(), root, &BundleLimits::default(), &mut ImageOwners::default())
    }

    fn refused_entry(result: Result<ExtractStats, ExtractError>) -> (String, UnsafeEntry) {
        match result {
            Err(ExtractError::Refused { entry, reason }) => (entry, reason),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn later_layers_replace_whiteouts_remove_and_opaque_directories_hide_what_is_below() {
        let root = tempfile::tempdir().unwrap();
        let base = Layer::new()
            .dir("bin")
            .file("bin/busybox", "#!busybox", 0o4755)
            .link(tar::EntryType::Symlink, "bin/sh", "/bin/busybox")
            .dir("etc")
            .file("etc/motd", "old", 0o644)
            .file("etc/gone", "x", 0o644)
            .dir("var/cache")
            .file("var/cache/a", "a", 0o644)
            .file("var/cache/b", "b", 0o644);
        unpack(root.path(), base).unwrap();
        let top = Layer::new()
            .file("etc/motd", "new", 0o600)
            .file("etc/.wh.gone", "", 0o644)
            .file("var/cache/fresh", "f", 0o644)
            .file("var/cache/.wh..wh..opq", "", 0o644)
            .link(tar::EntryType::Link, "bin/busybox2", "bin/busybox");
        unpack(root.path(), top).unwrap();

        let r = root.path();
        assert_eq!(fs::read_to_string(r.join("etc/motd")).unwrap(), "new");
        assert_eq!(fs::metadata(r.join("etc/motd")).unwrap().permissions().mode() & 0o7777, 0o600);
        assert!(!r.join("etc/gone").exists(), "the whiteout removed it");
        assert!(r.join("var/cache/fresh").exists(), "the opaque layer keeps its own");
        assert!(!r.join("var/cache/a").exists() && !r.join("var/cache/b").exists(), "and hides what was below");
        assert_eq!(fs::read_link(r.join("bin/sh")).unwrap(), Path::new("/bin/busybox"), "absolute links are kept");
        assert_eq!(fs::metadata(r.join("bin/busybox")).unwrap().permissions().mode() & 0o7777, 0o755, "no set-uid");
        assert_eq!(fs::read_to_string(r.join("bin/busybox2")).unwrap(), "#!busybox");
    }

    #[test]
    fn an_absolute_symlink_used_as_a_later_layers_parent_is_refused_and_nothing_lands_outside() {
        let outside = tempfile::tempdir().unwrap();
        let root = tempfile::tempdir().unwrap();
        let lower = Layer::new().link(tar::EntryType::Symlink, "etc", &outside.path().display().to_string());
        unpack(root.path(), lower).unwrap();
        let upper = Layer::new().file("etc/passwd", "root::0:0::/:/bin/sh", 0o644);
        let (entry, reason) = refused_entry(unpack(root.path(), upper));
        assert_eq!(entry, "etc/passwd");
        assert_eq!(reason, UnsafeEntry::ThroughSymlink("etc".into()));
        assert!(!outside.path().join("passwd").exists(), "nothing was written outside the root");

        let whiteout = Layer::new().file("etc/.wh.passwd", "", 0o644);
        assert_eq!(refused_entry(unpack(root.path(), whiteout)).1, UnsafeEntry::ThroughSymlink("etc".into()));
    }

    #[test]
    fn parent_paths_whiteouts_of_dot_dot_devices_and_stray_hardlinks_are_refused_by_name() {
        let outside = tempfile::tempdir().unwrap();
        fs::write(outside.path().join("keep"), "keep").unwrap();
        let root = tempfile::tempdir().unwrap();
        let cases = [
            (Layer::new().raw("../escape", tar::EntryType::Regular), "../escape", UnsafeEntry::ParentDir),
            (Layer::new().raw("a/../../escape", tar::EntryType::Regular), "a/../../escape", UnsafeEntry::ParentDir),
            (Layer::new().raw("/etc/shadow", tar::EntryType::Regular), "/etc/shadow", UnsafeEntry::AbsolutePath),
            (
                Layer::new().raw("dir/.wh...", tar::EntryType::Regular),
                "dir/.wh...",
                UnsafeEntry::BadWhiteout("..".into()),
            ),
            (Layer::new().raw("dev/sda", tar::EntryType::Block), "dev/sda", UnsafeEntry::DeviceFile),
            (Layer::new().raw("dev/null", tar::EntryType::Char), "dev/null", UnsafeEntry::DeviceFile),
            (
                Layer::new().link(tar::EntryType::Link, "stolen", "etc/none"),
                "stolen",
                UnsafeEntry::HardlinkEscapes("etc/none".into()),
            ),
        ];
        for (layer, name, expected) in cases {
            let (entry, reason) = refused_entry(unpack(root.path(), layer));
            assert_eq!((entry.as_str(), reason), (name, expected));
        }
        assert_eq!(fs::read_to_string(outside.path().join("keep")).unwrap(), "keep");
        assert!(!root.path().parent().unwrap().join("escape").exists());
    }

    #[test]
    fn a_truncated_layer_is_an_error_not_a_partial_file() {
        let root = tempfile::tempdir().unwrap();
        let mut bytes = Layer::new().file("big", &"x".repeat(10_000), 0o644).bytes();
        bytes.truncate(3_000);
        let error =
            unpack_image_tar(bytes.as_slice(), root.path(), &BundleLimits::default(), &mut ImageOwners::default())
                .unwrap_err();
        assert!(matches!(error, ExtractError::Archive(_)), "{error}");
    }
}
