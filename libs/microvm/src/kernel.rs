//! The guest kernel: a stock distribution kernel laid out in one directory.
//!
//! A kernel directory holds `vmlinuz` and, under `modules/`, the modules the
//! guest needs that the kernel does not build in, as `NAME.ko`. Debian's
//! cloud kernel (`linux-image-cloud-amd64`) builds ext4, the 8250 serial
//! console and devtmpfs in, and virtio's MMIO transport, block devices,
//! consoles, network devices and overlayfs as modules; `scripts/microvm-kernel.sh` lays such
//! a directory out from the Debian package. A kernel that builds them in
//! needs no `modules/` at all: a module that is missing is skipped, one
//! that is present is loaded in [`MODULES`]' order.

use std::path::{Path, PathBuf};

/// The modules the guest loads, dependencies first.
pub const MODULES: &[&str] = &[
    "virtio_ring",
    "virtio",
    "virtio_mmio",
    "virtio_blk",
    "virtio_console",
    "overlay",
    "failover",
    "net_failover",
    "virtio_net",
];

/// The modules a guest loads only when its command names shared
/// directories (virtio-fs, see [`crate::wire::GuestShare`]), dependencies
/// first. A kernel directory without them runs guests with no shares.
pub const SHARE_MODULES: &[&str] = &["fuse", "virtiofs"];

/// Where `scripts/microvm-kernel.sh` puts the kernel by default.
pub const DEFAULT_KERNEL_DIR: &str = "/opt/berth/microvm/kernel";

/// A guest kernel and the modules it needs loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestKernel {
    /// The kernel image.
    pub vmlinuz: PathBuf,
    /// The modules to load, in order: [`MODULES`] then [`SHARE_MODULES`],
    /// those present.
    pub modules: Vec<PathBuf>,
}

/// A kernel directory that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("no guest kernel at {}: {why}", .dir.display())]
pub struct KernelError {
    /// The directory looked in.
    pub dir: PathBuf,
    /// What was missing.
    pub why: String,
}

impl GuestKernel {
    /// The kernel laid out in `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self, KernelError> {
        let vmlinuz = dir.join("vmlinuz");
        if !vmlinuz.is_file() {
            return Err(KernelError {
                dir: dir.to_path_buf(),
                why: "no vmlinuz in it (scripts/microvm-kernel.sh lays one out from Debian's cloud kernel)".into(),
            });
        }
        let modules = MODULES
            .iter()
            .chain(SHARE_MODULES)
            .map(|name| dir.join("modules").join(format!("{name}.ko")))
            .filter(|path| path.is_file())
            .collect();
        Ok(Self { vmlinuz, modules })
    }

    /// Whether its guests can mount directories the node shares (the
    /// kernel directory has every one of [`SHARE_MODULES`]).
    pub fn shares_directories(&self) -> bool {
        SHARE_MODULES.iter().all(|name| self.modules.iter().any(|path| path.file_stem().is_some_and(|s| s == *name)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kernel_directory_lists_the_modules_present_in_load_order() {
        let dir = tempfile::tempdir().unwrap();
        let error = GuestKernel::from_dir(dir.path()).unwrap_err().to_string();
        assert!(error.contains("no vmlinuz"), "{error}");
        std::fs::write(dir.path().join("vmlinuz"), b"kernel").unwrap();
        std::fs::create_dir(dir.path().join("modules")).unwrap();
        for name in ["overlay", "virtio", "virtio_ring"] {
            std::fs::write(dir.path().join("modules").join(format!("{name}.ko")), b"ko").unwrap();
        }
        let kernel = GuestKernel::from_dir(dir.path()).unwrap();
        let names: Vec<_> =
            kernel.modules.iter().map(|p| p.file_stem().unwrap().to_str().unwrap().to_owned()).collect();
        assert_eq!(names, ["virtio_ring", "virtio", "overlay"]);
        assert!(!kernel.shares_directories(), "no virtio-fs modules");
        for name in ["virtiofs", "fuse"] {
            std::fs::write(dir.path().join("modules").join(format!("{name}.ko")), b"ko").unwrap();
        }
        let kernel = GuestKernel::from_dir(dir.path()).unwrap();
        let names: Vec<_> =
            kernel.modules.iter().map(|p| p.file_stem().unwrap().to_str().unwrap().to_owned()).collect();
        assert_eq!(names, ["virtio_ring", "virtio", "overlay", "fuse", "virtiofs"]);
        assert!(kernel.shares_directories());
    }
}
