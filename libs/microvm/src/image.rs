//! The images a guest boots from: the initramfs (the init and the kernel's
//! modules), a read-only root image per bundle, a scratch image per lease.
//!
//! Each image is written beside its final name and renamed into place, so a
//! reader never sees half of one and an interrupted build leaves only a
//! temporary file, which the next build of the same image replaces. Root
//! images are ext4 made by `mkfs.ext4 -d` (e2fsprogs), which copies a
//! directory tree into a fresh filesystem without mounting anything.

use std::fs::File;
use std::io::{self, Read as _};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::kernel::GuestKernel;
use crate::{ROOT_LABEL, SCRATCH_LABEL};

/// Room a root image has beyond its files, for ext4's own structures.
const ROOT_SLACK_BYTES: u64 = 16 << 20;

/// An image that could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// Reading the inputs or writing the image failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The failure.
        source: io::Error,
    },
    /// `mkfs.ext4` refused.
    #[error("mkfs.ext4 for {}: {stderr}", .image.display())]
    Mkfs {
        /// The image being made.
        image: PathBuf,
        /// What it printed.
        stderr: String,
    },
}

fn io_error(what: impl Into<String>) -> impl FnOnce(io::Error) -> ImageError {
    let what = what.into();
    move |source| ImageError::Io { what, source }
}

/// Writes the initramfs for `kernel` with `init` as its `/init` at
/// `target`: the init, `busybox` as `/bin/busybox` (the init sets up the
/// network with its `ip`), the kernel's modules under `/lib/modules`, and
/// the directories the init mounts on.
pub fn write_initramfs(init: &Path, busybox: &Path, kernel: &GuestKernel, target: &Path) -> Result<(), ImageError> {
    let staging = staging_path(target);
    let file = File::create(&staging).map_err(io_error(format!("creating {}", staging.display())))?;
    let mut out = io::BufWriter::new(file);
    let mut inode = 0_u32;
    let mut next_inode = || {
        inode += 1;
        inode
    };
    for dir in ["dev", "proc", "sys", "run", "bin", "lib", "lib/modules"] {
        let entry = cpio::NewcBuilder::new(dir).ino(next_inode()).mode(0o040_755).nlink(2);
        out = entry.write(out, 0).finish().map_err(io_error("writing the initramfs"))?;
    }
    let mut files = vec![
        (init.to_path_buf(), "init".to_owned(), 0o100_755),
        (busybox.to_path_buf(), "bin/busybox".to_owned(), 0o100_755),
    ];
    for module in &kernel.modules {
        let name = module.file_name().and_then(|n| n.to_str()).unwrap_or("module.ko");
        files.push((module.clone(), format!("lib/modules/{name}"), 0o100_644));
    }
    for (source, name, mode) in files {
        let mut bytes = Vec::new();
        File::open(&source)
            .and_then(|mut f| f.read_to_end(&mut bytes))
            .map_err(io_error(format!("reading {}", source.display())))?;
        let length = u32::try_from(bytes.len()).map_err(|_| ImageError::Io {
            what: format!("{} is over 4 GiB", source.display()),
            source: io::ErrorKind::InvalidInput.into(),
        })?;
        let mut writer = cpio::NewcBuilder::new(&name).ino(next_inode()).mode(mode).nlink(1).write(out, length);
        io::Write::write_all(&mut writer, &bytes).map_err(io_error("writing the initramfs"))?;
        out = writer.finish().map_err(io_error("writing the initramfs"))?;
    }
    let out = cpio::newc::trailer(out).map_err(io_error("writing the initramfs"))?;
    let file = out
        .into_inner()
        .map_err(|e| ImageError::Io { what: "writing the initramfs".into(), source: e.into_error() })?;
    file.sync_all().map_err(io_error("syncing the initramfs"))?;
    std::fs::rename(&staging, target).map_err(io_error(format!("renaming into {}", target.display())))
}

/// Makes a read-only root image of the tree at `root` at `target` (unless
/// one is there already): ext4 labelled [`ROOT_LABEL`], sized to the tree.
pub fn root_image(root: &Path, target: &Path) -> Result<(), ImageError> {
    if target.is_file() {
        return Ok(());
    }
    let size = tree_bytes(root).map_err(io_error(format!("measuring {}", root.display())))?;
    // Files round up to blocks and directories take blocks of their own:
    // a quarter more than the bytes, plus room for the filesystem itself.
    let size = size + size / 4 + ROOT_SLACK_BYTES;
    mkfs(target, ROOT_LABEL, size, Some(root))
}

/// One entry of an image whose owner or group is set after the image is
/// made, as an image's layers gave it to its user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    /// The entry, absolute inside the image.
    pub path: PathBuf,
    /// Its new owner, if it changes.
    pub uid: Option<u32>,
    /// Its new group, if it changes.
    pub gid: Option<u32>,
}

/// Sets the owners and groups of entries of the ext4 image at `image` in
/// place, with `debugfs` (e2fsprogs), without mounting it. An entry whose
/// path `debugfs` cannot be given (a quote or a line break in it) is an
/// error naming it.
pub fn set_owners(image: &Path, owners: &[Owner]) -> Result<(), ImageError> {
    let mut commands = String::new();
    for owner in owners {
        let path = owner.path.display().to_string();
        if path.contains(['"', '\n', '\r']) || !path.starts_with('/') {
            return Err(ImageError::Io {
                what: format!("giving {path} its owner in {}", image.display()),
                source: io::ErrorKind::InvalidInput.into(),
            });
        }
        for (field, id) in [("uid", owner.uid), ("gid", owner.gid)] {
            if let Some(id) = id {
                commands.push_str(&format!("set_inode_field \"{path}\" {field} {id}\n"));
            }
        }
    }
    if commands.is_empty() {
        return Ok(());
    }
    let script = staging_path(&image.with_extension("debugfs"));
    std::fs::write(&script, commands).map_err(io_error(format!("writing {}", script.display())))?;
    let output = Command::new("debugfs").arg("-w").arg("-f").arg(&script).arg(image).output();
    let _ = std::fs::remove_file(&script);
    let output = output.map_err(io_error("running debugfs (e2fsprogs)"))?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    // debugfs exits 0 whatever its commands did; what failed, it says.
    let failed: Vec<&str> = stderr.lines().filter(|l| !l.starts_with("debugfs ") && !l.trim().is_empty()).collect();
    if !output.status.success() || !failed.is_empty() {
        return Err(ImageError::Mkfs { image: image.to_path_buf(), stderr: failed.join("; ") });
    }
    Ok(())
}

/// Makes an empty writable scratch image of `bytes` at `target`: ext4
/// labelled [`SCRATCH_LABEL`], sparse, so it takes disk only as written.
pub fn scratch_image(target: &Path, bytes: u64) -> Result<(), ImageError> {
    mkfs(target, SCRATCH_LABEL, bytes, None)
}

fn mkfs(target: &Path, label: &str, bytes: u64, tree: Option<&Path>) -> Result<(), ImageError> {
    let staging = staging_path(target);
    let file = File::create(&staging).map_err(io_error(format!("creating {}", staging.display())))?;
    file.set_len(bytes.div_ceil(4096) * 4096).map_err(io_error(format!("sizing {}", staging.display())))?;
    drop(file);
    let mut command = Command::new("mkfs.ext4");
    // No journal: a root image is never written, and a lease's scratch is
    // thrown away with it, so a journal would only cost writes.
    command.args(["-q", "-F", "-O", "^has_journal", "-L", label, "-E", "root_owner=0:0"]);
    if let Some(tree) = tree {
        command.arg("-d").arg(tree);
    }
    command.arg(&staging);
    let output = command.output().map_err(io_error("running mkfs.ext4 (e2fsprogs)"))?;
    if !output.status.success() {
        let _ = std::fs::remove_file(&staging);
        return Err(ImageError::Mkfs {
            image: target.to_path_buf(),
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        });
    }
    std::fs::rename(&staging, target).map_err(io_error(format!("renaming into {}", target.display())))
}

fn staging_path(target: &Path) -> PathBuf {
    let mut name = target.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".partial");
    target.with_file_name(name)
}

/// The bytes of the regular files under `root`, without following links.
fn tree_bytes(root: &Path) -> io::Result<u64> {
    let mut total = 0;
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let entry = entry?;
            let kind = entry.file_type()?;
            if kind.is_dir() {
                stack.push(entry.path());
            } else if kind.is_file() {
                total += entry.metadata()?.len();
            }
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_initramfs_holds_the_init_the_modules_and_the_mount_points() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("init"), b"#!init").unwrap();
        std::fs::write(dir.path().join("virtio.ko"), b"module").unwrap();
        let kernel = GuestKernel { vmlinuz: dir.path().join("vmlinuz"), modules: vec![dir.path().join("virtio.ko")] };
        let target = dir.path().join("initramfs.cpio");
        std::fs::write(dir.path().join("busybox"), b"#!busybox").unwrap();
        write_initramfs(&dir.path().join("init"), &dir.path().join("busybox"), &kernel, &target).unwrap();

        let mut reader = File::open(&target).unwrap();
        let mut seen = Vec::new();
        loop {
            let mut entry = cpio::NewcReader::new(reader).unwrap();
            if entry.entry().is_trailer() {
                break;
            }
            let (name, mode) = (entry.entry().name().to_owned(), entry.entry().mode());
            let mut body = Vec::new();
            entry.read_to_end(&mut body).unwrap();
            seen.push((name, mode, body));
            reader = entry.finish().unwrap();
        }
        assert!(seen.contains(&("init".into(), 0o100_755, b"#!init".to_vec())), "{seen:?}");
        assert!(seen.contains(&("bin/busybox".into(), 0o100_755, b"#!busybox".to_vec())), "{seen:?}");
        assert!(seen.contains(&("lib/modules/virtio.ko".into(), 0o100_644, b"module".to_vec())), "{seen:?}");
        assert!(seen.iter().any(|(name, mode, _)| name == "dev" && mode & 0o040_000 != 0), "{seen:?}");
        assert!(!dir.path().join("initramfs.cpio.partial").exists());
    }

    #[test]
    fn a_root_image_is_ext4_labelled_and_sized_to_its_tree_and_built_once() {
        let dir = tempfile::tempdir().unwrap();
        let tree = dir.path().join("tree");
        std::fs::create_dir_all(tree.join("bin")).unwrap();
        std::fs::write(tree.join("bin/hello"), vec![1_u8; 3 << 20]).unwrap();
        let image = dir.path().join("root.ext4");
        root_image(&tree, &image).unwrap();
        let size = std::fs::metadata(&image).unwrap().len();
        assert!(((3 << 20) + ROOT_SLACK_BYTES..(8 << 20) + ROOT_SLACK_BYTES).contains(&size), "{size}");
        let label = Command::new("e2label").arg(&image).output().unwrap();
        assert_eq!(String::from_utf8_lossy(&label.stdout).trim(), ROOT_LABEL);
        let listed = Command::new("debugfs").args(["-R", "stat /bin/hello"]).arg(&image).output().unwrap();
        assert!(String::from_utf8_lossy(&listed.stdout).contains("Size: 3145728"), "{listed:?}");

        // A second ask finds it built and leaves it as it is.
        let before = std::fs::metadata(&image).unwrap().modified().unwrap();
        root_image(&tree, &image).unwrap();
        assert_eq!(std::fs::metadata(&image).unwrap().modified().unwrap(), before);
    }

    #[test]
    fn owners_are_set_in_place_and_a_missing_entry_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let tree = dir.path().join("tree");
        std::fs::create_dir_all(tree.join("www")).unwrap();
        std::fs::write(tree.join("www/index.html"), b"hi").unwrap();
        let image = dir.path().join("root.ext4");
        root_image(&tree, &image).unwrap();
        let owners = [
            Owner { path: "/www".into(), uid: Some(33), gid: Some(34) },
            Owner { path: "/www/index.html".into(), uid: None, gid: Some(34) },
        ];
        set_owners(&image, &owners).unwrap();
        let stat = |path: &str| {
            let out = Command::new("debugfs").args(["-R", &format!("stat {path}")]).arg(&image).output().unwrap();
            String::from_utf8_lossy(&out.stdout).lines().find(|l| l.starts_with("User:")).unwrap_or_default().to_owned()
        };
        assert!(stat("/www").contains("User:    33   Group:    34"), "{}", stat("/www"));
        assert!(stat("/www/index.html").contains("Group:    34"), "{}", stat("/www/index.html"));
        let missing = [Owner { path: "/nope".into(), uid: Some(1), gid: None }];
        let error = set_owners(&image, &missing).unwrap_err().to_string();
        assert!(error.contains("/nope"), "{error}");
    }

    #[test]
    fn mkfs_refusing_is_named_and_leaves_no_partial_image() {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("scratch.ext4");
        let error = scratch_image(&image, 4096).unwrap_err().to_string();
        assert!(error.contains("mkfs.ext4 for") && error.contains("scratch.ext4"), "{error}");
        assert!(!image.exists() && !dir.path().join("scratch.ext4.partial").exists());
    }
}
