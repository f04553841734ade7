//! Unpacks a bundle's tar layer into a directory without ever writing outside it, and
//! refuses any entry that would make the bundle reach outside it later.
//!
//! # What is refused, always naming the entry
//! - absolute paths and paths with `..` components;
//! - symlinks whose target is absolute or leads out of the bundle, directly or through
//!   other symlinks in it (checked once every entry is in place, following links the way
//!   the kernel would);
//! - hardlinks to anything but a regular file already extracted inside the bundle;
//! - device files, FIFOs, sparse files and any other entry type;
//! - an entry written through a symlink, or over an entry already extracted;
//! - more than [`BundleLimits::max_entries`] entries, a file larger than
//!   [`BundleLimits::max_file_bytes`], or more than [`BundleLimits::max_total_bytes`] in all.
//!
//! # What is kept
//! Regular files, directories, symlinks and hardlinks. Owners, times and special mode
//! bits are dropped: directories are `0755`, files `0755` when the archive marked them
//! executable and `0644` otherwise.
//!
//! # Expected flow
//! The caller extracts into a fresh private directory and, on any error, removes it whole;
//! only a complete, checked tree is ever renamed into place.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs::{self, OpenOptions, Permissions};
use std::io::{self, Read};
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

use crate::format::LAYER_TAR_GZIP_MEDIA_TYPE;

/// The most bytes of file content one bundle may hold, 4 GiB.
pub const MAX_BUNDLE_BYTES: u64 = 4 << 30;
/// The largest single file a bundle may hold, 1 GiB.
pub const MAX_FILE_BYTES: u64 = 1 << 30;
/// The most tar entries (files, directories and links) one bundle may hold.
pub const MAX_ENTRIES: u64 = 100_000;
/// How many symlinks one path may pass through before it is taken for a loop, as Linux's
/// `MAXSYMLINKS`.
pub const MAX_SYMLINK_HOPS: usize = 40;
/// Tar overhead allowed per entry on top of file content (header, padding, a long name),
/// so a decompressed stream can be bounded before its entries are read.
const STREAM_BYTES_PER_ENTRY: u64 = 8 << 10;

/// The limits a bundle is held to, when packed and when extracted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BundleLimits {
    /// The most bytes of file content in all.
    pub max_total_bytes: u64,
    /// The largest single file.
    pub max_file_bytes: u64,
    /// The most entries of any kind.
    pub max_entries: u64,
}

impl Default for BundleLimits {
    fn default() -> Self {
        Self { max_total_bytes: MAX_BUNDLE_BYTES, max_file_bytes: MAX_FILE_BYTES, max_entries: MAX_ENTRIES }
    }
}

impl BundleLimits {
    /// The most decompressed tar bytes a bundle within these limits can take.
    pub(crate) fn max_stream_bytes(&self) -> u64 {
        self.max_total_bytes.saturating_add(self.max_entries.saturating_add(2).saturating_mul(STREAM_BYTES_PER_ENTRY))
    }
}

/// Why an entry was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnsafeEntry {
    /// The path is absolute.
    #[error("its path is absolute")]
    AbsolutePath,
    /// The path has a `..` component.
    #[error("its path climbs out with `..`")]
    ParentDir,
    /// The path is empty or not usable as a file name.
    #[error("its path is empty")]
    EmptyPath,
    /// A symlink's target is absolute.
    #[error("it is a symlink to the absolute path {0}")]
    AbsoluteSymlink(String),
    /// A symlink's target leads out of the bundle.
    #[error("it is a symlink to {0}, outside the bundle")]
    SymlinkEscapes(String),
    /// A symlink chain does not end within the hop limit.
    #[error("it is a symlink that goes through more than {MAX_SYMLINK_HOPS} links")]
    SymlinkLoop,
    /// A hardlink's target is not a regular file already inside the bundle.
    #[error("it is a hardlink to {0}, which is not a file inside the bundle")]
    HardlinkEscapes(String),
    /// A link entry without a target.
    #[error("it is a link without a target")]
    MissingLinkTarget,
    /// A whiteout that names no entry of its directory (`.`, `..`, nothing).
    #[error("it is a whiteout of `{0}`, which names no entry of its directory")]
    BadWhiteout(String),
    /// A character or block device.
    #[error("it is a device file")]
    DeviceFile,
    /// A FIFO.
    #[error("it is a FIFO")]
    Fifo,
    /// Any other entry type (sparse files, vendor extensions).
    #[error("its tar entry type {0:?} is not supported")]
    UnsupportedType(char),
    /// An earlier entry put a symlink on this entry's path.
    #[error("its path goes through the symlink {0}")]
    ThroughSymlink(String),
    /// An earlier entry put a file where this entry needs a directory.
    #[error("its path goes through the file {0}")]
    ThroughFile(String),
    /// An earlier entry already wrote this path.
    #[error("an earlier entry already wrote this path")]
    Duplicate,
    /// The file is larger than the per-file limit.
    #[error("it is {size} bytes, more than the {limit} allowed per file")]
    FileTooLarge {
        /// The entry's size.
        size: u64,
        /// The per-file limit.
        limit: u64,
    },
    /// The bundle's files add up to more than the total limit.
    #[error("it brings the bundle past the {limit} bytes allowed in all")]
    BundleTooLarge {
        /// The total limit.
        limit: u64,
    },
    /// The bundle has more entries than allowed.
    #[error("it is past the {limit} entries a bundle may hold")]
    TooManyEntries {
        /// The entry limit.
        limit: u64,
    },
}

/// Why a layer could not be extracted.
#[derive(Debug, thiserror::Error)]
pub enum ExtractError {
    /// An entry is unsafe or over a limit; nothing outside the target was written.
    #[error("entry `{entry}` refused: {reason}")]
    Refused {
        /// The entry's path as the archive spells it.
        entry: String,
        /// Why.
        reason: UnsafeEntry,
    },
    /// The layer is not a readable tar (or gzip) stream.
    #[error("the layer is not a valid tar archive: {0}")]
    Archive(#[source] io::Error),
    /// The target directory could not be written.
    #[error("cannot write {path}: {source}")]
    Io {
        /// The path being written.
        path: String,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// What an extraction wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExtractStats {
    /// Entries read.
    pub entries: u64,
    /// Regular files written (hardlinks not counted).
    pub files: u64,
    /// Bytes of file content written.
    pub bytes: u64,
}

/// Extracts the layer in `archive` (gzip'd when `media_type` says so) into `dest`, an
/// existing empty directory.
pub fn extract_layer(
    archive: &Path,
    media_type: &str,
    dest: &Path,
    limits: &BundleLimits,
) -> Result<ExtractStats, ExtractError> {
    let file = fs::File::open(archive).map_err(ExtractError::Archive)?;
    let reader = io::BufReader::new(file);
    if media_type == LAYER_TAR_GZIP_MEDIA_TYPE {
        extract_tar(flate2::read::MultiGzDecoder::new(reader), dest, limits)
    } else {
        extract_tar(reader, dest, limits)
    }
}

/// An archive entry's name (for errors), kind and path relative to the
/// root, once it is counted against the entry limit; `None` for an entry
/// that carries nothing to write (a pax global header, the archive's own
/// root `./`). Refuses a path that leaves the root.
pub(crate) fn admit_entry<R: Read>(
    entry: &tar::Entry<'_, R>,
    stats: &mut ExtractStats,
    limits: &BundleLimits,
) -> Result<Option<(String, tar::EntryType, PathBuf)>, ExtractError> {
    let name = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
    let refuse = |reason: UnsafeEntry| ExtractError::Refused { entry: name.clone(), reason };
    stats.entries += 1;
    if stats.entries > limits.max_entries {
        return Err(refuse(UnsafeEntry::TooManyEntries { limit: limits.max_entries }));
    }
    let kind = entry.header().entry_type();
    if kind.is_pax_global_extensions() {
        return Ok(None);
    }
    let raw_path = entry.path().map_err(ExtractError::Archive)?.into_owned();
    match relative_path(&raw_path) {
        Ok(rel) => Ok(Some((name, kind, rel))),
        Err(UnsafeEntry::EmptyPath) if kind.is_dir() => Ok(None),
        Err(reason) => Err(refuse(reason)),
    }
}

/// The target link entry `name` names; refused when it names none.
pub(crate) fn link_target<R: Read>(entry: &tar::Entry<'_, R>, name: &str) -> Result<PathBuf, ExtractError> {
    match entry.link_name().map_err(ExtractError::Archive)? {
        Some(link) if !link.as_os_str().is_empty() => Ok(link.into_owned()),
        _ => Err(ExtractError::Refused { entry: name.to_owned(), reason: UnsafeEntry::MissingLinkTarget }),
    }
}

/// Why an entry that is neither a directory, a file nor a link is refused.
pub(crate) fn unsupported(kind: tar::EntryType) -> UnsafeEntry {
    if kind.is_character_special() || kind.is_block_special() {
        UnsafeEntry::DeviceFile
    } else if kind.is_fifo() {
        UnsafeEntry::Fifo
    } else {
        UnsafeEntry::UnsupportedType(char::from(kind.as_byte()))
    }
}

/// Extracts a plain tar stream into `dest`, an existing empty directory.
pub fn extract_tar(reader: impl Read, dest: &Path, limits: &BundleLimits) -> Result<ExtractStats, ExtractError> {
    let bounded = BoundedReader::new(reader, limits.max_stream_bytes());
    let mut archive = tar::Archive::new(bounded);
    let mut stats = ExtractStats::default();
    let mut symlinks: Vec<(String, PathBuf)> = Vec::new();
    for entry in archive.entries().map_err(ExtractError::Archive)? {
        let mut entry = entry.map_err(ExtractError::Archive)?;
        let Some((name, kind, rel)) = admit_entry(&entry, &mut stats, limits)? else { continue };
        let refuse = |reason: UnsafeEntry| ExtractError::Refused { entry: name.clone(), reason };
        let target = dest.join(&rel);
        if kind.is_dir() {
            prepare_parents(dest, &rel).map_err(|r| r.into_error(&name))?;
            match fs::symlink_metadata(&target) {
                Ok(meta) if meta.is_dir() => {}
                Ok(meta) if meta.is_symlink() => {
                    return Err(refuse(UnsafeEntry::ThroughSymlink(rel.display().to_string())));
                }
                Ok(_) => return Err(refuse(UnsafeEntry::Duplicate)),
                Err(_) => create_dir(&target)?,
            }
        } else if kind.is_file() || kind.is_contiguous() {
            prepare_parents(dest, &rel).map_err(|r| r.into_error(&name))?;
            let executable = entry.header().mode().is_ok_and(|mode| mode & 0o111 != 0);
            let mode = if executable { 0o755 } else { 0o644 };
            write_file_entry(&mut entry, &name, &target, mode, limits, &mut stats)?;
        } else if kind.is_symlink() {
            let link = link_target(&entry, &name)?;
            let shown = link.display().to_string();
            if link.is_absolute() {
                return Err(refuse(UnsafeEntry::AbsoluteSymlink(shown)));
            }
            let start = rel.parent().map(components).unwrap_or_default();
            if lexically_escapes(start, &link) {
                return Err(refuse(UnsafeEntry::SymlinkEscapes(shown)));
            }
            prepare_parents(dest, &rel).map_err(|r| r.into_error(&name))?;
            match std::os::unix::fs::symlink(&link, &target) {
                Ok(()) => symlinks.push((name.clone(), rel)),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Err(refuse(UnsafeEntry::Duplicate)),
                Err(source) => return Err(io_error(&target, source)),
            }
        } else if kind.is_hard_link() {
            let source = hardlink_source(dest, &link_target(&entry, &name)?).map_err(refuse)?;
            prepare_parents(dest, &rel).map_err(|r| r.into_error(&name))?;
            match fs::hard_link(&source, &target) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Err(refuse(UnsafeEntry::Duplicate)),
                Err(source) => return Err(io_error(&target, source)),
            }
        } else {
            return Err(refuse(unsupported(kind)));
        }
    }
    // Links may point at links that came later in the archive: only now can each chain be
    // followed to its end.
    for (name, rel) in symlinks {
        resolve_inside(dest, &rel).map_err(|reason| ExtractError::Refused { entry: name, reason })?;
    }
    Ok(stats)
}

/// Writes a regular file entry's content to `target`, which must not exist
/// yet, with `mode`, within `limits`, and counts it in `stats`.
pub(crate) fn write_file_entry<R: Read>(
    entry: &mut tar::Entry<'_, R>,
    name: &str,
    target: &Path,
    mode: u32,
    limits: &BundleLimits,
    stats: &mut ExtractStats,
) -> Result<(), ExtractError> {
    let refuse = |reason: UnsafeEntry| ExtractError::Refused { entry: name.to_owned(), reason };
    let size = entry.size();
    if size > limits.max_file_bytes {
        return Err(refuse(UnsafeEntry::FileTooLarge { size, limit: limits.max_file_bytes }));
    }
    if stats.bytes.saturating_add(size) > limits.max_total_bytes {
        return Err(refuse(UnsafeEntry::BundleTooLarge { limit: limits.max_total_bytes }));
    }
    let mut file = match OpenOptions::new().write(true).create_new(true).open(target) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Err(refuse(UnsafeEntry::Duplicate)),
        Err(source) => return Err(io_error(target, source)),
    };
    let written = io::copy(&mut entry.take(size), &mut file).map_err(ExtractError::Archive)?;
    if written != size {
        return Err(ExtractError::Archive(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("entry `{name}` ends after {written} of its {size} bytes"),
        )));
    }
    file.set_permissions(Permissions::from_mode(mode)).map_err(|e| io_error(target, e))?;
    stats.files += 1;
    stats.bytes += size;
    Ok(())
}

/// Where a hardlink to `link` points under `root`: a regular file already
/// there, reached through real directories only.
pub(crate) fn hardlink_source(root: &Path, link: &Path) -> Result<PathBuf, UnsafeEntry> {
    let escapes = || UnsafeEntry::HardlinkEscapes(link.display().to_string());
    let source_rel = relative_path(link).map_err(|_| escapes())?;
    prepare_parents_existing(root, &source_rel).map_err(|()| escapes())?;
    let source = root.join(&source_rel);
    match fs::symlink_metadata(&source) {
        Ok(meta) if meta.is_file() => Ok(source),
        _ => Err(escapes()),
    }
}

/// The entry path as plain components, `.` parts dropped.
pub(crate) fn relative_path(path: &Path) -> Result<PathBuf, UnsafeEntry> {
    let mut rel = PathBuf::new();
    for component in path.components() {
        match component {
            Component::Normal(part) => rel.push(part),
            Component::CurDir => {}
            Component::ParentDir => return Err(UnsafeEntry::ParentDir),
            Component::RootDir | Component::Prefix(_) => return Err(UnsafeEntry::AbsolutePath),
        }
    }
    if rel.as_os_str().is_empty() { Err(UnsafeEntry::EmptyPath) } else { Ok(rel) }
}

fn components(path: &Path) -> Vec<OsString> {
    path.components()
        .filter_map(|c| match c {
            Component::Normal(part) => Some(part.to_owned()),
            _ => None,
        })
        .collect()
}

/// Whether `target`, read from the directory `start` (components below the root), climbs
/// above the root when `..` is taken literally.
fn lexically_escapes(mut start: Vec<OsString>, target: &Path) -> bool {
    for component in target.components() {
        match component {
            Component::Normal(part) => start.push(part.to_owned()),
            Component::CurDir => {}
            Component::ParentDir => {
                if start.pop().is_none() {
                    return true;
                }
            }
            Component::RootDir | Component::Prefix(_) => return true,
        }
    }
    false
}

/// One step of path resolution.
enum Step {
    /// `..`
    Up,
    /// A named component.
    Down(OsString),
    /// A leading `/`.
    Root,
}

/// Follows the symlink at `rel` the way path resolution would, through any symlinks in
/// the tree, and fails if it ever leaves `root`.
pub(crate) fn resolve_inside(root: &Path, rel: &Path) -> Result<(), UnsafeEntry> {
    let mut dir: Vec<OsString> = rel.parent().map(components).unwrap_or_default();
    let first = fs::read_link(root.join(rel)).map_err(|_| UnsafeEntry::MissingLinkTarget)?;
    let shown = first.display().to_string();
    let mut pending: VecDeque<Step> = VecDeque::new();
    push_front_steps(&mut pending, &first);
    let mut hops = 0;
    while let Some(step) = pending.pop_front() {
        match step {
            Step::Up => {
                if dir.pop().is_none() {
                    return Err(UnsafeEntry::SymlinkEscapes(shown));
                }
            }
            Step::Root => return Err(UnsafeEntry::AbsoluteSymlink(shown)),
            Step::Down(part) => {
                dir.push(part);
                let here: PathBuf = dir.iter().fold(root.to_path_buf(), |p, c| p.join(c));
                if fs::symlink_metadata(&here).is_ok_and(|m| m.is_symlink()) {
                    hops += 1;
                    if hops > MAX_SYMLINK_HOPS {
                        return Err(UnsafeEntry::SymlinkLoop);
                    }
                    let next = fs::read_link(&here).map_err(|_| UnsafeEntry::MissingLinkTarget)?;
                    dir.pop();
                    push_front_steps(&mut pending, &next);
                }
            }
        }
    }
    Ok(())
}

/// Puts `path`'s steps at the front of `pending`, in order.
fn push_front_steps(pending: &mut VecDeque<Step>, path: &Path) {
    let steps: Vec<Step> = path
        .components()
        .filter_map(|c| match c {
            Component::Normal(part) => Some(Step::Down(part.to_owned())),
            Component::CurDir => None,
            Component::ParentDir => Some(Step::Up),
            Component::RootDir | Component::Prefix(_) => Some(Step::Root),
        })
        .collect();
    for step in steps.into_iter().rev() {
        pending.push_front(step);
    }
}

/// Why the directories above an entry could not be made.
pub(crate) enum ParentRefusal {
    Unsafe(UnsafeEntry),
    Io(ExtractError),
}

impl ParentRefusal {
    pub(crate) fn into_error(self, entry: &str) -> ExtractError {
        match self {
            Self::Unsafe(reason) => ExtractError::Refused { entry: entry.to_owned(), reason },
            Self::Io(error) => error,
        }
    }
}

/// Makes the directories above `rel`, refusing to pass through a symlink or a file.
pub(crate) fn prepare_parents(root: &Path, rel: &Path) -> Result<(), ParentRefusal> {
    let mut here = root.to_path_buf();
    let mut shown = PathBuf::new();
    let Some(parent) = rel.parent() else { return Ok(()) };
    for part in components(parent) {
        here.push(&part);
        shown.push(&part);
        match fs::symlink_metadata(&here) {
            Ok(meta) if meta.is_dir() => {}
            Ok(meta) if meta.is_symlink() => {
                return Err(ParentRefusal::Unsafe(UnsafeEntry::ThroughSymlink(shown.display().to_string())));
            }
            Ok(_) => return Err(ParentRefusal::Unsafe(UnsafeEntry::ThroughFile(shown.display().to_string()))),
            Err(_) => create_dir(&here).map_err(ParentRefusal::Io)?,
        }
    }
    Ok(())
}

/// Checks that the directories above `rel` exist and are real directories.
fn prepare_parents_existing(root: &Path, rel: &Path) -> Result<(), ()> {
    let mut here = root.to_path_buf();
    let Some(parent) = rel.parent() else { return Ok(()) };
    for part in components(parent) {
        here.push(&part);
        match fs::symlink_metadata(&here) {
            Ok(meta) if meta.is_dir() => {}
            _ => return Err(()),
        }
    }
    Ok(())
}

pub(crate) fn create_dir(path: &Path) -> Result<(), ExtractError> {
    match fs::create_dir(path) {
        Ok(()) => fs::set_permissions(path, Permissions::from_mode(0o755)).map_err(|e| io_error(path, e)),
        Err(source) => Err(io_error(path, source)),
    }
}

pub(crate) fn io_error(path: &Path, source: io::Error) -> ExtractError {
    ExtractError::Io { path: path.display().to_string(), source }
}

/// A reader that fails once more than a set number of bytes has been read, so a
/// decompression bomb ends in an error instead of a full disk or memory.
pub(crate) struct BoundedReader<R> {
    inner: R,
    remaining: u64,
}

impl<R> BoundedReader<R> {
    /// `inner`, failing past `limit` bytes.
    pub(crate) fn new(inner: R, limit: u64) -> Self {
        Self { inner, remaining: limit }
    }
}

impl<R: Read> Read for BoundedReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.remaining = self.remaining.checked_sub(n as u64).ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidData, "the decompressed layer is larger than the bundle limits allow")
        })?;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lexical_escape_counts_from_the_link_directory() {
        assert!(!lexically_escapes(vec!["a".into()], Path::new("../b")));
        assert!(lexically_escapes(vec!["a".into()], Path::new("../../b")));
        assert!(lexically_escapes(Vec::new(), Path::new("..")));
        assert!(!lexically_escapes(Vec::new(), Path::new("./x/../y")));
    }

    #[test]
    fn relative_paths_drop_dots_and_refuse_escapes() {
        assert_eq!(relative_path(Path::new("./a/./b")).unwrap(), PathBuf::from("a/b"));
        assert_eq!(relative_path(Path::new("/etc/x")), Err(UnsafeEntry::AbsolutePath));
        assert_eq!(relative_path(Path::new("a/../../x")), Err(UnsafeEntry::ParentDir));
        assert_eq!(relative_path(Path::new("./")), Err(UnsafeEntry::EmptyPath));
    }
}
