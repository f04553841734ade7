//! Domain types shared by every berth crate, with no I/O: who a caller is and
//! how that is spelled in a certificate.
//!
//! # The SAN scheme
//! A berth certificate names exactly one identity in a DNS subject alternative
//! name under [`TRUST_DOMAIN`]:
//!
//! | kind    | SAN                               |
//! |---------|-----------------------------------|
//! | node    | `<node-id>.node.berth.internal`   |
//! | service | `<service>.svc.berth.internal`    |
//! | admin   | `<name>.admin.berth.internal`     |
//! | router  | `<name>.router.berth.internal`    |
//!
//! A workload's certificate (its X.509-SVID, signed by the workload
//! authority) names it instead by one SPIFFE URI SAN; see [`WorkloadId`].
//!
//! Other SANs (`localhost`, an IP, a public host name) may stand beside it so
//! that clients can verify the server by the address they dialled; they carry
//! no identity.

mod addr;
pub mod backoff;
mod cache;
mod identity;
mod image;
mod json_file;
mod time;
mod workload_id;

pub use addr::bracket_ipv6;
pub use cache::{
    MAX_CACHE_KEY, MAX_CACHE_MOUNTS, cache_key_problem, cache_mounts_problem, cache_path_problem,
    cache_repository_problem,
};
pub use identity::{CallerKind, Identity, IdentityError, SERVICE_ZONE, TRUST_DOMAIN, is_dns_label};
pub use image::{MAX_IMAGE_USER, MAX_WORKING_DIR, image_settings_problems, image_user_problem, working_dir_problem};
pub use json_file::{JsonFileError, write_json_atomically};
pub use time::{millis, wall_clock_ms};
pub use workload_id::{WorkloadId, WorkloadIdError, is_trust_domain};

/// The reason an open lease on a draining node is given (leases writes it,
/// a requester that can move the work, such as revisions, reads it): the
/// lease should be replaced elsewhere, then released.
pub const NODE_DRAINING: &str = "NodeDraining";

/// The node label giving the memory, in bytes, each workload holds on the
/// node beyond its lease's size (a microVM's VMM): the node's agent sets
/// it, and leases charges it against the node's capacity with each lease.
pub const MEMORY_OVERHEAD_LABEL: &str = "berth.workload.memory-overhead";

/// The node label giving the least memory, in bytes, a workload holds on
/// the node whatever its lease asks (a microVM's smallest guest).
pub const MEMORY_FLOOR_LABEL: &str = "berth.workload.memory-floor";
