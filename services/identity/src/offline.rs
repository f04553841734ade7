//! Issuing a certificate straight from identity's state, with no identity
//! replica serving: how a first admin identity, or the service identities
//! of a mesh about to start, come to exist before anything can answer
//! `Authority/IssueCertificate`.
//!
//! # Invariants
//! - The CA is opened exactly as a replica opens it: the same schema, its
//!   migrations applied, the same sealing secret. On fresh state the CA is
//!   created here, and every replica started later loads that one; a secret
//!   that does not open the stored CA fails without issuing anything.
//! - The store is closed again before returning, whatever happened.

use std::time::Duration;

use berth_core::Identity;
use berth_mtls::TlsMaterial;
use berth_runtime::{StartError, open_store};

use crate::authority::{Authority, AuthorityError, AuthorityTiming};
use crate::{MIGRATIONS, NAME};

/// Why a certificate could not be issued from identity's state.
#[derive(Debug, thiserror::Error)]
pub enum OfflineIssueError {
    /// Identity's database could not be opened or migrated.
    #[error("cannot open identity's state: {0}")]
    State(#[source] StartError),
    /// The CA could not be opened (a different secret) or refused to sign.
    #[error("cannot issue the certificate: {0}")]
    Authority(#[source] AuthorityError),
}

/// Opens identity's CA in `database_url` under `auth_secret` (creating it on
/// fresh state) and issues a key and certificate for `identity`, valid for
/// `ttl`, carrying `extra_sans` (host names and IPs it is dialled by) beside
/// its identity name.
pub async fn issue_from_state(
    database_url: &str,
    auth_secret: &str,
    identity: &Identity,
    extra_sans: &[String],
    ttl: Duration,
) -> Result<TlsMaterial, OfflineIssueError> {
    let store = open_store(database_url, NAME, MIGRATIONS).await.map_err(OfflineIssueError::State)?;
    let issued = async {
        let authority = Authority::open(store.clone(), auth_secret, AuthorityTiming::default()).await?;
        authority.issue_material(identity, extra_sans, ttl).await
    }
    .await;
    store.close().await;
    issued.map_err(OfflineIssueError::Authority)
}
