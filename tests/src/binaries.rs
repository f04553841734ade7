//! Where the berth binaries under test are: the target directory the test
//! itself was built into, so a suite runs the binaries of the same build.
//!
//! `cargo test` and `cargo nextest` build a package's binaries only for its
//! own integration tests, so they must be built first: a `--workspace`
//! test build has them all (`make test-faults` runs on it), or
//! `cargo build --bins -p berth-identity ...`. `BERTH_E2E_BIN_DIR` points
//! elsewhere, e.g. at a release build.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};

/// Overrides the directory the binaries are taken from.
pub const BIN_DIR_ENV: &str = "BERTH_E2E_BIN_DIR";

/// The directory holding the binaries: `$BERTH_E2E_BIN_DIR`, or the profile
/// directory of the running test (`target/debug` for
/// `target/debug/deps/faults-<hash>`).
pub fn bin_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os(BIN_DIR_ENV).filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    let exe = std::env::current_exe().context("cannot find the running test executable")?;
    let mut dir = exe.parent().map(Path::to_path_buf).context("the test executable has no directory")?;
    if dir.file_name().is_some_and(|name| name == "deps") {
        dir.pop();
    }
    Ok(dir)
}

/// The path of binary `name` (e.g. `berth-leases`), checked to exist.
pub fn binary(name: &str) -> anyhow::Result<PathBuf> {
    let path = bin_dir()?.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    if !path.is_file() {
        bail!(
            "{} not found: build the binaries first (cargo build --bins -p berth-identity -p berth-revisions \
             -p berth-leases -p berth-egress -p berth-router -p berth-agent), or set {BIN_DIR_ENV}",
            path.display()
        );
    }
    Ok(path)
}
