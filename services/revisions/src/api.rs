//! The gRPC face of the catalog: `Services` and `Revisions`, each call
//! checked, handed to the catalog, announced, and each error mapped once.
//!
//! # Who may call what
//! The access layer admits each RPC only to the caller kinds its proto
//! declares: admins change services; admins and services read them; nodes
//! ask for the pull credentials of their own leases (see [`crate::pull`]);
//! routers acknowledge the routes they serve (see [`crate::route_acks`]).
//!
//! # Minting
//! `ApplyService` resolves the bundle reference before its transaction, and
//! only when the declaration's fingerprint differs from the newest
//! revision's, so an unchanged apply costs no registry round trip. A
//! resolution that fails does not fail the apply: the revision is minted
//! unresolved, `BundleResolved=False` says why, and the reconciler retries
//! with backoff until it resolves.

use berth_core::CallerKind;
use berth_proto::revisions::v1;
use tonic::{Request, Response, Status};

use crate::catalog::{CatalogError, Resolution, Scope};
use crate::config::millis;
use crate::model::timestamp;
use crate::resolver::resolve_template;
use crate::route_acks::RouterAck;
use crate::service::RevisionsService;
use crate::validate;

/// Most services one acknowledgement wakes the deploy reconciler for.
const WAKE_ON_ACK: usize = 64;

/// A router's acknowledgement as `GetService` shows it.
fn router_ack(ack: &RouterAck) -> v1::RouterAck {
    v1::RouterAck {
        router: ack.router.clone(),
        instance: ack.instance.clone(),
        generation: u64::try_from(ack.generation).unwrap_or_default(),
        acked_at: (ack.generation > 0).then(|| timestamp(ack.acked_at_ms)),
    }
}

#[tonic::async_trait]
impl v1::services_server::Services for RevisionsService {
    async fn apply_service(
        &self,
        request: Request<v1::ApplyServiceRequest>,
    ) -> Result<Response<v1::ApplyServiceResponse>, Status> {
        let by = berth_rpc::caller(&request)?.to_string();
        let valid = validate::apply(request.into_inner(), &self.core.policy)?;
        let catalog = &self.core.catalog;
        let changed = catalog.latest_fingerprint(&valid.key).await?.as_deref() != Some(valid.fingerprint.as_str());
        let resolution = if changed {
            let limit = self.core.config.resolve_timeout;
            match resolve_template(self.core.resolver.as_ref(), &valid.template, limit).await {
                Ok(digest) => Resolution::Resolved(digest),
                Err(error) => Resolution::Failed(error),
            }
        } else {
            Resolution::NotTried
        };
        let retry_after = millis(self.core.config.resolve_backoff(1));
        let applied = catalog.apply(&valid, &resolution, retry_after).await?;
        if applied.revision_created {
            match &resolution {
                Resolution::Failed(error) => tracing::info!(service = %valid.key, revision = %applied.revision,
                    %by, reason = error.reason(), %error, "revision minted; its bundle did not resolve yet"),
                _ => tracing::info!(service = %valid.key, revision = %applied.revision, %by, "revision minted"),
            }
            self.core.signals.wake(&valid.key).await;
        }
        Ok(Response::new(v1::ApplyServiceResponse {
            service: Some(applied.service.to_proto()),
            revision_created: applied.revision_created,
            revision: applied.revision,
        }))
    }

    async fn get_service(
        &self,
        request: Request<v1::GetServiceRequest>,
    ) -> Result<Response<v1::GetServiceResponse>, Status> {
        let key = validate::service_key(&request.get_ref().project, &request.get_ref().name, "name")?;
        berth_rpc::require_own_workload(
            &request,
            || format!("service {key}"),
            |id| id.project() == key.project && id.service() == Some(key.name.as_str()),
        )?;
        let service = self.core.catalog.service(&key).await?;
        let service = service.ok_or_else(|| Status::not_found(format!("service {key} not found")))?;
        let mut shown = service.to_proto();
        if let Some(status) = shown.status.as_mut() {
            status.routers = self.core.catalog.route_acks(&key).await?.iter().map(router_ack).collect();
        }
        Ok(Response::new(v1::GetServiceResponse { service: Some(shown) }))
    }

    async fn list_services(
        &self,
        request: Request<v1::ListServicesRequest>,
    ) -> Result<Response<v1::ListServicesResponse>, Status> {
        let request = request.into_inner();
        let scope =
            if request.all_projects { Scope::All } else { Scope::Project(validate::project(&request.project)?) };
        let services = self.core.catalog.services(&scope).await?;
        Ok(Response::new(v1::ListServicesResponse { services: services.iter().map(|s| s.to_proto()).collect() }))
    }

    async fn delete_service(
        &self,
        request: Request<v1::DeleteServiceRequest>,
    ) -> Result<Response<v1::DeleteServiceResponse>, Status> {
        let by = berth_rpc::caller(&request)?.to_string();
        let request = request.into_inner();
        let key = validate::service_key(&request.project, &request.name, "name")?;
        let deleted = self.core.catalog.delete(&key).await?;
        tracing::info!(service = %key, uid = %deleted.uid, %by, "service deleted; its leases are being released");
        self.core.signals.wake(&key).await;
        Ok(Response::new(v1::DeleteServiceResponse {}))
    }

    async fn set_traffic(
        &self,
        request: Request<v1::SetTrafficRequest>,
    ) -> Result<Response<v1::SetTrafficResponse>, Status> {
        let by = berth_rpc::caller(&request)?.to_string();
        let request = request.into_inner();
        let key = validate::service_key(&request.project, &request.name, "name")?;
        validate::revision_name("pinned_revision", &request.pinned_revision, true)?;
        let targets = crate::traffic::requested(&key.name, &request.pinned_revision, &request.targets)?;
        let affinity = crate::traffic::affinity(request.affinity.as_ref())?;
        let service =
            self.core.catalog.set_traffic(&key, &targets, affinity.as_ref()).await.map_err(|error| match error {
                CatalogError::NotOfService { .. } if !request.targets.is_empty() => {
                    Status::invalid_argument(format!("targets: {error}"))
                }
                error => error.into(),
            })?;
        tracing::info!(service = %key, targets = ?service.traffic, %by, "traffic set");
        self.core.signals.wake(&key).await;
        Ok(Response::new(v1::SetTrafficResponse { service: Some(service.to_proto()) }))
    }

    async fn ack_routes(
        &self,
        request: Request<v1::AckRoutesRequest>,
    ) -> Result<Response<v1::AckRoutesResponse>, Status> {
        let caller = berth_rpc::caller(&request)?;
        if caller.kind() != CallerKind::Router {
            return Err(Status::permission_denied("only a router acknowledges routes"));
        }
        let router = caller.name().to_owned();
        let request = request.into_inner();
        let acks = validate::route_acks(&request)?;
        let advanced = self.core.catalog.ack_routes(&router, &request.instance, &acks).await?;
        // A router catching up on every service wakes none: the passes
        // waiting on it look again within a second anyway.
        if advanced.len() <= WAKE_ON_ACK {
            for key in &advanced {
                self.core.signals.wake(key).await;
            }
        }
        Ok(Response::new(v1::AckRoutesResponse {}))
    }

    async fn watch_services(
        &self,
        request: Request<v1::WatchServicesRequest>,
    ) -> Result<Response<tonic::codegen::BoxStream<v1::ServiceEvent>>, Status> {
        let request = request.into_inner();
        let scope =
            if request.all_projects { Scope::All } else { Scope::Project(validate::project(&request.project)?) };
        Ok(Response::new(crate::watch::open(self.core.clone(), scope)))
    }
}

#[tonic::async_trait]
impl v1::revisions_server::Revisions for RevisionsService {
    async fn list_revisions(
        &self,
        request: Request<v1::ListRevisionsRequest>,
    ) -> Result<Response<v1::ListRevisionsResponse>, Status> {
        let request = request.into_inner();
        let key = validate::service_key(&request.project, &request.service, "service")?;
        if self.core.catalog.service(&key).await?.is_none() {
            return Err(Status::not_found(format!("service {key} not found")));
        }
        let revisions = self.core.catalog.revisions(&key).await?;
        Ok(Response::new(v1::ListRevisionsResponse { revisions: revisions.iter().map(|r| r.to_proto()).collect() }))
    }

    async fn get_revision(
        &self,
        request: Request<v1::GetRevisionRequest>,
    ) -> Result<Response<v1::GetRevisionResponse>, Status> {
        let project = validate::project(&request.get_ref().project)?;
        validate::revision_name("name", &request.get_ref().name, false)?;
        berth_rpc::require_own_workload(
            &request,
            || format!("revision {} in project {project}", request.get_ref().name),
            |id| id.project() == project && id.revision() == Some(request.get_ref().name.as_str()),
        )?;
        let request = request.into_inner();
        let revision = self.core.catalog.revision(&project, &request.name).await?;
        Ok(Response::new(v1::GetRevisionResponse { revision: Some(revision.to_proto()) }))
    }

    async fn get_pull_credentials(
        &self,
        request: Request<v1::GetPullCredentialsRequest>,
    ) -> Result<Response<v1::GetPullCredentialsResponse>, Status> {
        let node = berth_rpc::caller(&request)?
            .node_id()
            .ok_or_else(|| Status::permission_denied("only a node may ask for pull credentials"))?
            .to_owned();
        let request = request.into_inner();
        Ok(Response::new(crate::pull::credentials_for(&self.core, &node, &request.lease_id).await?))
    }
}
