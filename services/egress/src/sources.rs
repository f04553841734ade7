//! The channels the full pass learns about the rest of the mesh through:
//! revisions (services and their egress selections) and leases (which
//! tenants each node hosts). What it learns, and how, is [`crate::world`].

use berth_mtls::TlsCredentials;
use berth_rpc::Channel;

/// Where the full pass learns about services (revisions) and placement
/// (leases). A missing source leaves its part of the world empty: plans list
/// no services, or no node is sent any plan.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    pub(crate) revisions: Option<Channel>,
    pub(crate) leases: Option<Channel>,
}

/// Why the channels to revisions or leases could not be made.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The revisions address is not usable.
    #[error("revisions address: {0}")]
    Revisions(#[source] berth_rpc::ClientError),
    /// The leases address is not usable.
    #[error("leases address: {0}")]
    Leases(#[source] berth_rpc::ClientError),
}

impl Sources {
    /// No sources at all.
    pub fn none() -> Self {
        Self::default()
    }

    /// Channels to revisions at `revisions_addr` and leases at `leases_addr`
    /// (`host:port`, either may be absent), dialled with `credentials`: this
    /// service's own certificate. Nothing is dialled until the first call.
    pub fn connect(
        credentials: &TlsCredentials,
        revisions_addr: Option<&str>,
        leases_addr: Option<&str>,
    ) -> Result<Self, SourceError> {
        let dial = |addr: &str| berth_rpc::connect(addr, credentials.clone());
        Ok(Self {
            revisions: revisions_addr.map(dial).transpose().map_err(SourceError::Revisions)?,
            leases: leases_addr.map(dial).transpose().map_err(SourceError::Leases)?,
        })
    }
}
