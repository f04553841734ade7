//! Where a node finds the parts of the microVM runtime that are files of
//! their own: the static guest init and the `busybox` userland.

use std::path::{Path, PathBuf};

/// The guest init's file name.
pub const INIT_NAME: &str = "berth-vminit";

/// Where `make vminit` puts the static init, under a cargo target directory.
const BUILT_INIT: &str = "x86_64-unknown-linux-gnu/release/berth-vminit";

/// The static guest init: `$BERTH_VMINIT`, else `berth-vminit` beside the
/// running executable (as it ships), else the one `make vminit` built in
/// the target directory the running executable was built in. A
/// dynamically linked build beside the executable (a plain `cargo build`
/// of the workspace makes one) is passed over: a guest has no loader for it.
pub fn find_init() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("BERTH_VMINIT") {
        return Some(path.into());
    }
    let exe = std::env::current_exe().ok()?;
    let beside = exe.with_file_name(INIT_NAME);
    std::iter::once(beside)
        .chain(exe.ancestors().skip(1).take(4).map(|dir| dir.join(BUILT_INIT)))
        .find(|path| matches!(is_static_executable(path), Ok(true)))
}

/// Whether `path` is an ELF executable that needs no program loader (no
/// `PT_INTERP` header): what a guest whose initramfs holds nothing else
/// can run.
pub fn is_static_executable(path: &Path) -> std::io::Result<bool> {
    use std::io::{Read as _, Seek as _, SeekFrom};
    const PT_INTERP: u32 = 3;
    let mut file = std::fs::File::open(path)?;
    let mut header = [0_u8; 64];
    file.read_exact(&mut header)?;
    // 64-bit, little-endian ELF only: the guests are x86-64.
    if header[..4] != *b"\x7fELF" || header[4] != 2 || header[5] != 1 {
        return Ok(false);
    }
    let u16_at = |at: usize| u16::from_le_bytes([header[at], header[at + 1]]);
    let mut offset = [0_u8; 8];
    offset.copy_from_slice(&header[0x20..0x28]);
    let (table, entry_size, entries) = (u64::from_le_bytes(offset), u16_at(0x36), u16_at(0x38));
    if entry_size < 4 {
        return Ok(false);
    }
    let mut entry = vec![0_u8; usize::from(entry_size)];
    for index in 0..u64::from(entries) {
        file.seek(SeekFrom::Start(table.saturating_add(index * u64::from(entry_size))))?;
        file.read_exact(&mut entry)?;
        if u32::from_le_bytes([entry[0], entry[1], entry[2], entry[3]]) == PT_INTERP {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The node's static `busybox`, from Debian's `busybox-static`.
pub fn find_busybox() -> Option<PathBuf> {
    ["/bin/busybox", "/usr/bin/busybox"].into_iter().map(Path::new).find(|p| p.is_file()).map(Path::to_path_buf)
}

/// Where `virtiofsd` (virtio-fs's daemon, which shares a node's directory
/// with a guest) is looked for beside `PATH`: where distributions put the
/// Rust one (it is not on `PATH` there), and where
/// `scripts/microvm-deps.sh` installs it. QEMU's older C daemon
/// (`/usr/lib/qemu/virtiofsd`, another command line) is not used.
pub const VIRTIOFSD_PLACES: [&str; 2] = ["/usr/libexec/virtiofsd", "/opt/berth/virtiofsd/bin/virtiofsd"];

/// The node's `virtiofsd`, if it has one.
pub fn find_virtiofsd() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).map(|dir| dir.join("virtiofsd")).collect::<Vec<_>>())
        .unwrap_or_default();
    on_path.into_iter().chain(VIRTIOFSD_PLACES.iter().map(PathBuf::from)).find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_static_executable_is_told_from_a_dynamically_linked_one_and_from_what_is_no_executable() {
        // The node's busybox-static needs no loader; this test binary does.
        let busybox = find_busybox().expect("busybox-static is installed");
        assert!(is_static_executable(&busybox).unwrap(), "{}", busybox.display());
        let dynamic = std::env::current_exe().unwrap();
        assert!(!is_static_executable(&dynamic).unwrap(), "this test binary is dynamically linked");
        let text = std::env::temp_dir().join(format!("berth-not-elf-{}", std::process::id()));
        std::fs::write(&text, vec![b'#'; 128]).unwrap();
        assert!(!is_static_executable(&text).unwrap());
        std::fs::remove_file(&text).unwrap();
        assert!(is_static_executable(Path::new("/nonexistent/berth-vminit")).is_err());
    }
}
