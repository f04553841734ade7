//! Gives a lease's own uid and gid what its image gives the image's `User`
//! (see [`berth_bundle::ImageUser`]): the entries the layers gave that user
//! or its group change owner to the lease's ids, and the image's
//! `/etc/passwd` and `/etc/group` name the lease's ids after the account,
//! so the workload is that account in everything but its number.
//!
//! # Invariants
//! - Every change goes through the lease's own overlay (a copy-up into its
//!   upper layer; metadata only where the overlay copies metadata alone):
//!   the shared unpacked root is never written.
//! - Each path is opened beneath the lease's root with no link followed on
//!   the way (`openat2` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`), so no
//!   entry of an image, however made, leads a change outside the root.
//! - It runs before the workload starts, so nothing in the root moves under it.

use std::io::{Read as _, Write as _};
use std::os::fd::OwnedFd;
use std::path::Path;

use berth_bundle::ImageUser;
use rustix::fs::{AtFlags, Gid, Mode, OFlags, ResolveFlags, Uid};

use crate::instances::io;
use crate::provider::ProviderError;

/// The most of `/etc/passwd` or `/etc/group` rewritten; a larger one is left
/// as the image has it.
const MAX_ACCOUNTS_FILE_BYTES: u64 = 1 << 20;

/// Gives `uid` (as user and group) what `account` owns in the root mounted
/// at `rootfs`.
pub(crate) fn give(rootfs: &Path, account: &ImageUser, uid: u32) -> Result<(), ProviderError> {
    let root = rustix::fs::open(rootfs, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| io("open the lease's root", rootfs, e.into()))?;
    let (owner, group) = (Uid::from_raw(uid), Gid::from_raw(uid));
    for owned in &account.owned {
        let entry = match beneath(&root, &owned.path, OFlags::PATH | OFlags::NOFOLLOW) {
            Ok(entry) => entry,
            // Gone, or a link where the image had a directory: nothing of the
            // account's is there.
            Err(rustix::io::Errno::NOENT | rustix::io::Errno::LOOP | rustix::io::Errno::XDEV) => continue,
            Err(e) => return Err(io("open in the lease's root", &rootfs.join(&owned.path), e.into())),
        };
        rustix::fs::chownat(
            &entry,
            "",
            owned.owner.then_some(owner),
            owned.group.then_some(group),
            AtFlags::EMPTY_PATH | AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(|e| io("give the workload", &rootfs.join(&owned.path), e.into()))?;
    }
    if let Some(name) = &account.name {
        rewrite(&root, rootfs, "etc/passwd", |fields| {
            if fields.first().map(String::as_str) == Some(name.as_str()) && fields.len() >= 4 {
                fields[2] = uid.to_string();
                fields[3] = uid.to_string();
            }
        })?;
    }
    if account.gid != 0 {
        let gid = account.gid.to_string();
        rewrite(&root, rootfs, "etc/group", |fields| {
            if fields.get(2).map(String::as_str) == Some(gid.as_str()) {
                fields[2] = uid.to_string();
            }
        })?;
    }
    Ok(())
}

/// Opens `path` beneath `root`, following no link on the way.
fn beneath(root: &OwnedFd, path: &Path, flags: OFlags) -> rustix::io::Result<OwnedFd> {
    rustix::fs::openat2(
        root,
        path,
        flags | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )
}

/// Rewrites each `:`-separated line of the regular file `rel` with `edit`;
/// a file that is not there, is reached through a link, or is too large is
/// left alone.
fn rewrite(
    root: &OwnedFd,
    rootfs: &Path,
    rel: &str,
    mut edit: impl FnMut(&mut Vec<String>),
) -> Result<(), ProviderError> {
    let path = rootfs.join(rel);
    let Ok(file) = beneath(root, Path::new(rel), OFlags::RDONLY | OFlags::NOFOLLOW) else { return Ok(()) };
    let mut file = std::fs::File::from(file);
    if !file.metadata().is_ok_and(|meta| meta.is_file() && meta.len() <= MAX_ACCOUNTS_FILE_BYTES) {
        return Ok(());
    }
    let mut text = String::new();
    if file.read_to_string(&mut text).is_err() {
        return Ok(());
    }
    let mut edited = String::with_capacity(text.len() + 16);
    for line in text.lines() {
        let mut fields: Vec<String> = line.split(':').map(str::to_owned).collect();
        edit(&mut fields);
        edited.push_str(&fields.join(":"));
        edited.push('\n');
    }
    if edited == text {
        return Ok(());
    }
    let file = beneath(root, Path::new(rel), OFlags::WRONLY | OFlags::TRUNC | OFlags::NOFOLLOW)
        .map_err(|e| io("rewrite", &path, e.into()))?;
    std::fs::File::from(file).write_all(edited.as_bytes()).map_err(|source| io("rewrite", &path, source))
}
