//! Files that are replaced whole, never in part: each version is written
//! into a fresh generation directory, flushed, and published by renaming a
//! new symlink over the one that names the current generation, the way
//! Kubernetes writes secret volumes. The node's identity (see
//! [`crate::identity_dir`]) and each workload's SVID (see [`crate::svids`])
//! are kept this way.
//!
//! # Invariants
//! - A reader that follows the current symlink sees one generation whole:
//!   a crash at any point leaves it naming the old generation or the new
//!   one, never a mix; leftovers go with [`Generations::remove_stale`].
//! - A generation written for another owner (a workload's user) is given to
//!   that owner before it is published, so it is never readable by the
//!   owner half-written nor unreadable once published.

use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::Path;

use crate::files::FileError;

/// Half-written generations and symlinks end in this.
pub(crate) const TMP_SUFFIX: &str = ".tmp";

/// One directory of generations: `<root>/<current>` names the current
/// `<root>/<prefix><n>`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Generations<'a> {
    /// The directory holding them.
    pub(crate) root: &'a Path,
    /// The symlink naming the current one.
    pub(crate) current: &'a str,
    /// What every generation's name starts with; `<n>` follows.
    pub(crate) prefix: &'a str,
}

/// A file of a generation: its name, contents and mode.
pub(crate) type GenerationFile<'a> = (&'a str, &'a [u8], u32);

impl Generations<'_> {
    /// The generation the current symlink names.
    pub(crate) fn current(&self) -> Option<u64> {
        let target = std::fs::read_link(self.root.join(self.current)).ok()?;
        self.generation_of(target.file_name()?.to_str()?)
    }

    /// Writes `files` as the next generation and makes it current; with an
    /// `owner` (uid, gid), the generation is theirs. Returns its number.
    pub(crate) fn publish(&self, files: &[GenerationFile<'_>], owner: Option<(u32, u32)>) -> Result<u64, FileError> {
        let generation = self.next()?;
        let name = format!("{}{generation}", self.prefix);
        let staging = self.root.join(format!("{name}{TMP_SUFFIX}"));
        let target = self.root.join(&name);
        if staging.exists() {
            std::fs::remove_dir_all(&staging).map_err(|source| FileError::new("remove", &staging, source))?;
        }
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&staging)
            .map_err(|source| FileError::new("create", &staging, source))?;
        for (file, contents, mode) in files {
            write_synced(&staging.join(file), contents, *mode)?;
        }
        if let Some((uid, gid)) = owner {
            for path in files.iter().map(|(file, ..)| staging.join(file)).chain([staging.clone()]) {
                std::os::unix::fs::chown(&path, Some(uid), Some(gid))
                    .map_err(|source| FileError::new("give the workload", &path, source))?;
            }
        }
        sync_dir(&staging)?;
        std::fs::rename(&staging, &target).map_err(|source| FileError::new("rename", &staging, source))?;
        self.link(self.current, &name)?;
        sync_dir(self.root)?;
        Ok(generation)
    }

    /// Points `link` at `target` by renaming a new symlink over it.
    pub(crate) fn link(&self, link: &str, target: &str) -> Result<(), FileError> {
        let staging = self.root.join(format!("{link}{TMP_SUFFIX}"));
        let _ = std::fs::remove_file(&staging);
        std::os::unix::fs::symlink(target, &staging).map_err(|source| FileError::new("create", &staging, source))?;
        std::fs::rename(&staging, self.root.join(link)).map_err(|source| FileError::new("rename", &staging, source))
    }

    /// Removes every generation but the current one, and staging leftovers
    /// (of generations, and of the symlinks and files named in `staged`).
    pub(crate) fn remove_stale(&self, staged: &[&str]) -> Result<(), FileError> {
        let current = self.current();
        let read = |source| FileError::new("read", self.root, source);
        for entry in std::fs::read_dir(self.root).map_err(read)? {
            let entry = entry.map_err(read)?;
            let Some(name) = entry.file_name().to_str().map(str::to_string) else { continue };
            let path = entry.path();
            let stale_generation = name.starts_with(self.prefix)
                && (name.ends_with(TMP_SUFFIX) || self.generation_of(&name).is_some_and(|n| Some(n) != current));
            if stale_generation {
                std::fs::remove_dir_all(&path).map_err(|source| FileError::new("remove", &path, source))?;
            } else if name.strip_suffix(TMP_SUFFIX).is_some_and(|stem| stem == self.current || staged.contains(&stem)) {
                std::fs::remove_file(&path).map_err(|source| FileError::new("remove", &path, source))?;
            }
        }
        Ok(())
    }

    fn next(&self) -> Result<u64, FileError> {
        let mut highest = self.current().unwrap_or(0);
        let read = |source| FileError::new("read", self.root, source);
        for entry in std::fs::read_dir(self.root).map_err(read)? {
            if let Some(n) = entry.map_err(read)?.file_name().to_str().and_then(|name| self.generation_of(name)) {
                highest = highest.max(n);
            }
        }
        Ok(highest + 1)
    }

    /// `<prefix><n>` → `n`; anything else (staging names included) → `None`.
    fn generation_of(&self, name: &str) -> Option<u64> {
        name.strip_prefix(self.prefix)?.parse().ok()
    }
}

/// Writes `contents` to `path` with `mode` and flushes it to disk.
pub(crate) fn write_synced(path: &Path, contents: &[u8], mode: u32) -> Result<(), FileError> {
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .map_err(|source| FileError::new("write", path, source))?;
    file.write_all(contents).map_err(|source| FileError::new("write", path, source))?;
    file.sync_all().map_err(|source| FileError::new("flush", path, source))
}

/// Flushes a directory's entries to disk.
pub(crate) fn sync_dir(path: &Path) -> Result<(), FileError> {
    File::open(path).and_then(|dir| dir.sync_all()).map_err(|source| FileError::new("flush", path, source))
}
