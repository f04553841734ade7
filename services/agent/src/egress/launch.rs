//! Launching replicas behind their tenant's egress proxy: a [`Provider`]
//! that wraps the node's own, so the runner launches, adopts and destroys
//! workloads as ever while every replica is attached to its proxy.
//!
//! # Expected flow
//! - **Launch**: the replica's tenant and service are attached first (see
//!   [`EgressProxies::attach`]); the replica gets the proxy variables on top
//!   of its lease's own (which cannot override them) and, when the node
//!   isolates, is given its tenant's namespace to run in (the inner
//!   provider decides how it joins it); once it runs, its ports are forwarded into
//!   the namespace. A replica that cannot be attached is not started: its
//!   lease fails with `EgressUnavailable`.
//! - **Recover**: every replica found running after a restart is attached
//!   again (on the ports recorded for its service), and then the proxies
//!   are told recovery is over.
//! - **Settle, destroy, remove**: the lease lets go of its attachment.

use std::sync::Arc;

use super::proxies::EgressProxies;
use crate::provider::{LaunchSpec, Launched, Provider, ProviderError, Settlement, wrapping_provider};

/// A provider whose replicas reach the network only through their tenant's
/// egress proxy.
#[derive(Debug)]
pub(crate) struct EgressProvider {
    inner: Arc<dyn Provider>,
    proxies: EgressProxies,
}

impl EgressProvider {
    pub(crate) fn new(inner: Arc<dyn Provider>, proxies: EgressProxies) -> Self {
        Self { inner, proxies }
    }

    async fn expose(&self, launched: &Launched) {
        let meta = &launched.record.meta;
        let ports: Vec<u16> = std::iter::once(meta.port)
            .chain(meta.ports.values().copied())
            .filter_map(|port| u16::try_from(port).ok())
            .collect();
        if let Err(error) = self.proxies.expose(&launched.record.lease_id, &ports).await {
            tracing::error!(lease_id = %launched.record.lease_id, %error,
                "the replica runs, but cannot be reached on its node port");
        }
    }
}

wrapping_provider!(EgressProvider, |this| this.inner, {
    async fn launch(&self, mut spec: LaunchSpec) -> Result<Launched, ProviderError> {
        let lease_id = spec.lease_id.clone();
        let attachment = self
            .proxies
            .attach(&lease_id, &spec.meta.project, &spec.meta.service)
            .await
            .map_err(|error| ProviderError::Egress { lease_id: lease_id.clone(), detail: error.to_string() })?;
        spec.env.extend(attachment.env());
        spec.network = attachment.network().cloned();
        match self.inner.launch(spec).await {
            Ok(launched) => {
                self.expose(&launched).await;
                Ok(launched)
            }
            // The replica that runs keeps its attachment.
            Err(error @ ProviderError::AlreadyRunning(_)) => Err(error),
            Err(error) => {
                self.proxies.detach(&lease_id).await;
                Err(error)
            }
        }
    }

    async fn recover(&self) -> Result<Vec<Launched>, ProviderError> {
        let recovered = self.inner.recover().await;
        for launched in recovered.iter().flatten() {
            let record = &launched.record;
            if record.settled || launched.exit.borrow().is_some() {
                continue;
            }
            match self.proxies.attach(&record.lease_id, &record.meta.project, &record.meta.service).await {
                Ok(_) => self.expose(launched).await,
                Err(error) => tracing::error!(lease_id = %record.lease_id, %error,
                    "cannot open the egress proxy of a replica found running"),
            }
        }
        self.proxies.recovered().await;
        recovered
    }

    async fn set_epoch(&self, lease_id: &str, epoch: u64) -> Result<(), ProviderError> {
        self.inner.set_epoch(lease_id, epoch).await
    }

    async fn settle(&self, lease_id: &str, settlement: Settlement) -> Result<(), ProviderError> {
        let settled = self.inner.settle(lease_id, settlement).await;
        self.proxies.detach(lease_id).await;
        settled
    }

    async fn destroy(&self, lease_id: &str) -> Result<(), ProviderError> {
        let destroyed = self.inner.destroy(lease_id).await;
        if destroyed.is_ok() {
            self.proxies.detach(lease_id).await;
        }
        destroyed
    }

    async fn remove(&self, lease_id: &str) -> Result<(), ProviderError> {
        let removed = self.inner.remove(lease_id).await;
        if removed.is_ok() {
            self.proxies.detach(lease_id).await;
        }
        removed
    }
});
