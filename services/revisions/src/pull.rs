//! `GetPullCredentials`: the node's way to the registry credentials of a
//! private bundle. Leases carry only the credentials' name
//! (`bundle.secret`); the credentials stay with revisions, which hands them
//! to a node for one pull of a lease it holds.
//!
//! # Who gets what
//! A node gets the credentials of lease L when all of these hold, checked
//! in this order against the leases service and revisions' own catalog:
//! 1. leases knows L, L is open (BOUND, LAUNCHING or RUNNING), and L is
//!    placed on the calling node (its certificate's node id);
//! 2. L was asked for by revisions for its service: its owner is the
//!    service's `revisions/<name>@<uid>`;
//! 3. the revision L runs belongs to that service and pins the digest L
//!    runs.
//!
//! The name and the registry come from the revision's template, never from
//! the lease, and the credentials go only to the registry that template
//! names (and, when the operator bound them to one, only to that one).
//! Anything else is `PERMISSION_DENIED` (the lease is not the node's to
//! pull for) or `FAILED_PRECONDITION` (the revision names no credentials,
//! or none revisions holds).
//!
//! # Invariants
//! - A password or token is never logged: the log line names the lease,
//!   node, revision, credentials name and registry.
//! - `expires_at` is now plus [`RevisionsConfig::pull_credentials_ttl`]; a
//!   node keeps the credentials in memory for one pull and never past it.
//!
//! [`RevisionsConfig::pull_credentials_ttl`]: crate::RevisionsConfig

use std::time::SystemTime;

use berth_bundle::{BundleReference, RegistryCredentials};
use berth_proto::leases::v1::{Lease, LeasePhase};
use berth_proto::revisions::v1::GetPullCredentialsResponse;
use tonic::Status;

use crate::catalog::CatalogError;
use crate::leases::LeaseCallError;
use crate::model::{ServiceKey, lease_owner};
use crate::secrets::SecretLookupError;
use crate::shared::Core;
use crate::validate;

/// Why a node was not given pull credentials.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PullError {
    /// The request names no lease.
    #[error("lease_id: must not be empty")]
    NoLease,
    /// The lease is unknown, final, or placed on another node.
    #[error("lease {lease_id} is not open on node {node}")]
    NotHeld {
        /// The lease asked about.
        lease_id: String,
        /// The calling node.
        node: String,
    },
    /// The lease is not one revisions asked for on behalf of its revision.
    #[error("lease {lease_id} is not a replica of a revision revisions deployed: {why}")]
    NotARevision {
        /// The lease asked about.
        lease_id: String,
        /// Which check failed.
        why: String,
    },
    /// The revision's bundle names no credentials.
    #[error("revision {revision}'s bundle names no registry credentials (template.bundle.secret)")]
    NoSecret {
        /// The revision.
        revision: String,
    },
    /// The revision's bundle is not in a registry.
    #[error("revision {revision}'s bundle `{reference}` is not in a registry")]
    NotARegistry {
        /// The revision.
        revision: String,
        /// Its bundle reference.
        reference: String,
    },
    /// The credentials are unknown here, or bound to another registry.
    #[error("revision {revision}: {source}")]
    Secret {
        /// The revision.
        revision: String,
        /// Why.
        #[source]
        source: SecretLookupError,
    },
    /// The leases service could not be asked.
    #[error("cannot check the lease with leases: {0}")]
    Leases(#[source] LeaseCallError),
    /// The catalog could not be read.
    #[error(transparent)]
    Catalog(#[from] CatalogError),
}

impl From<PullError> for Status {
    fn from(error: PullError) -> Self {
        let message = error.to_string();
        match error {
            PullError::NoLease => Status::invalid_argument(message),
            PullError::NotHeld { .. } | PullError::NotARevision { .. } => Status::permission_denied(message),
            PullError::NoSecret { .. } | PullError::NotARegistry { .. } | PullError::Secret { .. } => {
                Status::failed_precondition(message)
            }
            PullError::Leases(LeaseCallError::Refused { .. }) => Status::internal(message),
            PullError::Leases(_) => Status::unavailable(message),
            PullError::Catalog(error) => error.into(),
        }
    }
}

/// The credentials `node` may pull `lease_id`'s bundle with (see the module docs).
pub(crate) async fn credentials_for(
    core: &Core,
    node: &str,
    lease_id: &str,
) -> Result<GetPullCredentialsResponse, PullError> {
    if lease_id.is_empty() {
        return Err(PullError::NoLease);
    }
    let not_held = || PullError::NotHeld { lease_id: lease_id.to_owned(), node: node.to_owned() };
    let lease = core.leases.get(lease_id).await.map_err(PullError::Leases)?.ok_or_else(not_held)?;
    if lease.node_id != node || !is_open(&lease) {
        return Err(not_held());
    }
    let not_a_revision = |why: &str| PullError::NotARevision { lease_id: lease_id.to_owned(), why: why.to_owned() };
    let workload = lease.workload.as_ref().ok_or_else(|| not_a_revision("it runs no workload"))?;
    let project = validate::project(&lease.project).map_err(|_| not_a_revision("its project is not valid"))?;
    let key = ServiceKey::new(project.clone(), workload.service.clone());
    let service = if workload.service.is_empty() { None } else { core.catalog.service(&key).await? };
    let service = service.ok_or_else(|| not_a_revision("its service is not one revisions knows"))?;
    if lease.owner != lease_owner(&service.key.name, &service.uid) {
        return Err(not_a_revision("revisions did not ask for it"));
    }
    let revision = match core.catalog.revision(&project, &workload.revision).await {
        Ok(revision) => revision,
        Err(CatalogError::RevisionNotFound { .. }) => return Err(not_a_revision("its revision is gone")),
        Err(error) => return Err(error.into()),
    };
    if revision.service != service.key.name || revision.digest.is_empty() || revision.digest != workload.digest {
        return Err(not_a_revision("it runs another bundle than its revision"));
    }
    let bundle = revision.template.artifact().map(|a| a.reference.clone()).unwrap_or_default();
    if bundle.secret.is_empty() {
        return Err(PullError::NoSecret { revision: revision.name });
    }
    let registry = match BundleReference::parse(&bundle.reference) {
        Ok(BundleReference::Registry(registry)) => registry.registry().to_owned(),
        _ => return Err(PullError::NotARegistry { revision: revision.name, reference: bundle.reference }),
    };
    let credentials = core
        .secrets
        .for_registry(&bundle.secret, &registry)
        .map_err(|source| PullError::Secret { revision: revision.name.clone(), source })?;
    let expires_at = SystemTime::now() + core.config.pull_credentials_ttl;
    tracing::info!(lease = lease_id, node, revision = %revision.name, secret = %bundle.secret, %registry,
        "registry credentials handed to a node for a pull");
    let mut response = GetPullCredentialsResponse {
        registry,
        expires_at: Some(expires_at.into()),
        secret: bundle.secret,
        ..Default::default()
    };
    match credentials {
        RegistryCredentials::Basic { username, password } => {
            response.username = username.clone();
            response.password = password.clone();
        }
        RegistryCredentials::Bearer { token } => response.bearer_token = token.clone(),
        RegistryCredentials::Anonymous => {}
    }
    Ok(response)
}

fn is_open(lease: &Lease) -> bool {
    matches!(lease.phase(), LeasePhase::Bound | LeasePhase::Launching | LeasePhase::Running)
}
