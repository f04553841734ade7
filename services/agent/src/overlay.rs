//! The overlay mounts the agent makes: an image lease's root over the
//! image's shared unpacked root, and a cache volume's view over its sealed
//! generation. Both are a read-only lower layer and a private upper one, so
//! no lease changes what another sees.

use std::path::Path;

/// Why an overlay could not be mounted.
#[derive(Debug, thiserror::Error)]
pub(crate) enum OverlayError {
    /// A layer's path cannot be written in the mount's options.
    #[error("{0} cannot be an overlay layer: its path holds `,`, `:` or a NUL byte")]
    Layer(String),
    /// The kernel refused the mount.
    #[error(transparent)]
    Mount(#[from] std::io::Error),
}

/// Mounts at `target` an overlay of `lower` with its writes in `upper`
/// (`work` its scratch directory, on the same filesystem), `nosuid` and
/// `nodev`. With `metacopy`, a change of owner or mode copies up metadata
/// alone where the kernel can, and whole files where it cannot.
pub(crate) fn mount(
    target: &Path,
    lower: &Path,
    upper: &Path,
    work: &Path,
    metacopy: bool,
) -> Result<(), OverlayError> {
    for layer in [lower, upper, work] {
        if layer.to_str().is_none_or(|p| p.contains([',', ':', '\0'])) {
            return Err(OverlayError::Layer(layer.display().to_string()));
        }
    }
    let options = format!("lowerdir={},upperdir={},workdir={}", lower.display(), upper.display(), work.display());
    let mount = |options: String| {
        let options = std::ffi::CString::new(options).map_err(|_| std::io::ErrorKind::InvalidInput)?;
        rustix::mount::mount(
            "overlay",
            target,
            "overlay",
            rustix::mount::MountFlags::NOSUID | rustix::mount::MountFlags::NODEV,
            Some(options.as_c_str()),
        )
        .map_err(std::io::Error::from)
    };
    if metacopy {
        match mount(format!("{options},metacopy=on")) {
            Ok(()) => return Ok(()),
            // A kernel without it copies whole files up instead.
            Err(error) => tracing::debug!(%error, target = %target.display(), "an overlay without metacopy"),
        }
    }
    Ok(mount(options)?)
}

/// Detaches the mount at `path`; one that is not there (not a mount point,
/// no such path) is what unmounting it was for.
pub(crate) fn unmount(path: &Path) -> Result<(), rustix::io::Errno> {
    match rustix::mount::unmount(path, rustix::mount::UnmountFlags::DETACH) {
        Ok(()) | Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOENT | rustix::io::Errno::NOTDIR) => Ok(()),
        Err(error) => Err(error),
    }
}
