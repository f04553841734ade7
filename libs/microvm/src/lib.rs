//! The microVM runtime's parts that both sides of the VM boundary share,
//! and the host's means of building and booting a guest.
//!
//! A lease run as a microVM is a QEMU `microvm` machine (virtio-mmio
//! devices only, no PCI, no firmware) booting a stock Debian cloud kernel
//! with an initramfs of berth's own: the guest init (`berth-vminit`, a
//! static binary) and the few kernel modules the cloud kernel builds as
//! modules (virtio over MMIO, block, console; overlayfs). The lease's root
//! filesystem is a read-only ext4 image built once per bundle digest; its
//! writes go to a per-lease scratch image through an overlay inside the
//! guest, so one image serves every lease of a revision and no lease sees
//! another's writes.
//!
//! The node and the init talk over virtio-serial ports as [`wire`]
//! describes: the node sends the command to run and signals on the control
//! port; the init reports the workload's start and exit on the status port;
//! the workload's stdout and stderr are ports of their own.
//!
//! # Invariants
//! - A frame is bounded ([`wire::MAX_FRAME`]); a longer or malformed one is
//!   an error naming what was wrong, never a panic.
//! - The guest learns which drive is which from its ext4 label
//!   ([`ROOT_LABEL`], [`SCRATCH_LABEL`]), not from the order the VMM
//!   happened to enumerate them in.

#[cfg(feature = "host")]
pub mod image;
#[cfg(feature = "host")]
pub mod install;
pub mod kernel;
#[cfg(feature = "host")]
pub mod vmm;
pub mod wire;

/// The ext4 label of a lease's read-only root image.
pub const ROOT_LABEL: &str = "berth-root";

/// The ext4 label of a lease's writable scratch image.
pub const SCRATCH_LABEL: &str = "berth-scratch";

/// The name of the virtio-serial port the node sends the init commands on.
pub const CONTROL_PORT: &str = "berth.control";

/// The port the workload's stdout is written to.
pub const STDOUT_PORT: &str = "berth.stdout";

/// The port the workload's stderr is written to.
pub const STDERR_PORT: &str = "berth.stderr";

/// The port the init writes its status lines to.
pub const STATUS_PORT: &str = "berth.status";

/// The port the node asks the init for the workload's use on (see
/// [`wire::GuestStats`]).
pub const STATS_PORT: &str = "berth.stats";
