//! Where a node finds the parts of the microVM runtime that are files of
//! their own: the static guest init and the `busybox` userland.

use std::path::{Path, PathBuf};

/// The guest init's file name.
pub const INIT_NAME: &str = "berth-vminit";

/// Where `make vminit` puts the static init, under a cargo target directory.
const BUILT_INIT: &str = "x86_64-unknown-linux-gnu/release/berth-vminit";

/// The static guest init: `$BERTH_VMINIT`, else `berth-vminit` beside the
/// running executable (as it ships), else the one `make vminit` built in
/// the target directory the running executable was built in.
pub fn find_init() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("BERTH_VMINIT") {
        return Some(path.into());
    }
    let exe = std::env::current_exe().ok()?;
    let beside = exe.with_file_name(INIT_NAME);
    if beside.is_file() {
        return Some(beside);
    }
    exe.ancestors().skip(1).take(4).map(|dir| dir.join(BUILT_INIT)).find(|path| path.is_file())
}

/// The node's static `busybox`, from Debian's `busybox-static`.
pub fn find_busybox() -> Option<PathBuf> {
    ["/bin/busybox", "/usr/bin/busybox"].into_iter().map(Path::new).find(|p| p.is_file()).map(Path::to_path_buf)
}
