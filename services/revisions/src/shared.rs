//! What every handler and the controller of one replica share: the [`Core`].
//!
//! A leaf of the crate's modules: the handlers, the controller and the
//! service that starts them import it, and it imports none of them, so no
//! two modules import each other.

use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::catalog::Catalog;
use crate::config::RevisionsConfig;
use crate::lease_view::LeaseView;
use crate::leases::LeaseClient;
use crate::resolver::{RegistryPolicy, TagResolver};
use crate::secrets::RegistrySecrets;
use crate::signals::{Signals, Wake};

/// What every handler and the controller of one replica share.
#[derive(Debug)]
pub(crate) struct Core {
    pub(crate) catalog: Catalog,
    pub(crate) signals: Signals,
    pub(crate) leases: Arc<dyn LeaseClient>,
    /// The open leases as the lease watch describes them.
    pub(crate) lease_view: Arc<LeaseView>,
    pub(crate) resolver: Arc<dyn TagResolver>,
    pub(crate) policy: RegistryPolicy,
    pub(crate) secrets: RegistrySecrets,
    pub(crate) config: RevisionsConfig,
    /// This replica's name as it campaigns for the reconciler.
    pub(crate) replica_id: String,
    /// Cancelled when the replica stops: the controller and watch streams end.
    pub(crate) closing: CancellationToken,
    /// Wake-ups for this replica's controller until its task takes them.
    pub(crate) wakes: Mutex<Option<mpsc::Receiver<Wake>>>,
}
