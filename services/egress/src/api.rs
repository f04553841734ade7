//! The gRPC handlers: gateways, routes and DNS configs for admins, the compiled plan for
//! admins and services, and each node's egress state for that node alone.
//!
//! # What a handler writes
//! Declarations only. Statuses and plans are the full pass's; an apply or a
//! delete that changed something marks the project's next pass, here and on
//! whichever replica leads.
//!
//! # Node RPCs
//! `WatchEgress` and `AckEgress` act only on the caller's own node id
//! (`PERMISSION_DENIED` otherwise). See [`crate::push`] for what a stream
//! sends; an ack records which generation the node applied:
//! - a generation newer than any the node was sent: `FAILED_PRECONDITION`;
//! - older than one already acknowledged: accepted, changes nothing;
//! - the current one: the plan generation of each tenant in it is recorded
//!   as applied (or, with an error, the error is recorded and the applied
//!   generations stay as they were), with the enforcement the node reports
//!   (an unknown value reads as unspecified); `GetPlan`'s `node_acks` show it.

use berth_proto::egress::v1 as proto;
use tonic::{Request, Response, Status};

use crate::records::timestamp;
use crate::service::EgressService;
use crate::validate;

/// The longest error a node may report with an ack; longer ones are cut.
const MAX_ACK_ERROR: usize = 4096;

#[tonic::async_trait]
impl proto::egress_server::Egress for EgressService {
    async fn apply_gateway(
        &self,
        request: Request<proto::ApplyGatewayRequest>,
    ) -> Result<Response<proto::ApplyGatewayResponse>, Status> {
        let by = berth_rpc::caller(&request)?.to_string();
        let valid = validate::gateway(request.into_inner())?;
        let (row, changed) = self.core.catalog.apply_gateway(&valid).await?;
        if changed {
            tracing::info!(gateway = %valid.key, generation = row.generation, %by, "gateway applied");
            self.core.changed(&valid.key.project).await;
        }
        Ok(Response::new(proto::ApplyGatewayResponse { gateway: Some(row.to_proto()) }))
    }

    async fn get_gateway(
        &self,
        request: Request<proto::GetGatewayRequest>,
    ) -> Result<Response<proto::GetGatewayResponse>, Status> {
        let request = request.into_inner();
        let key = validate::key(&request.project, &request.name, "a gateway name")?;
        let row = self.core.catalog.gateway(&key).await?;
        let row = row.ok_or_else(|| Status::not_found(format!("gateway {key} not found")))?;
        Ok(Response::new(proto::GetGatewayResponse { gateway: Some(row.to_proto()) }))
    }

    async fn list_gateways(
        &self,
        request: Request<proto::ListGatewaysRequest>,
    ) -> Result<Response<proto::ListGatewaysResponse>, Status> {
        let project = validate::project(&request.into_inner().project)?;
        let rows = self.core.catalog.gateways(&project).await?;
        Ok(Response::new(proto::ListGatewaysResponse { gateways: rows.iter().map(|r| r.to_proto()).collect() }))
    }

    async fn delete_gateway(
        &self,
        request: Request<proto::DeleteGatewayRequest>,
    ) -> Result<Response<proto::DeleteGatewayResponse>, Status> {
        let by = berth_rpc::caller(&request)?.to_string();
        let request = request.into_inner();
        let key = validate::key(&request.project, &request.name, "a gateway name")?;
        self.core.catalog.delete_gateway(&key).await?;
        tracing::info!(gateway = %key, %by, "gateway deleted");
        self.core.changed(&key.project).await;
        Ok(Response::new(proto::DeleteGatewayResponse {}))
    }

    async fn apply_dns_config(
        &self,
        request: Request<proto::ApplyDnsConfigRequest>,
    ) -> Result<Response<proto::ApplyDnsConfigResponse>, Status> {
        let by = berth_rpc::caller(&request)?.to_string();
        let (project, spec) = validate::dns(request.into_inner())?;
        let (row, changed) = self.core.catalog.apply_dns(&project, &spec).await?;
        if changed {
            tracing::info!(%project, generation = row.generation, %by, "DNS config applied");
            self.core.changed(&project).await;
        }
        Ok(Response::new(proto::ApplyDnsConfigResponse { dns_config: Some(row.to_proto()) }))
    }

    async fn get_dns_config(
        &self,
        request: Request<proto::GetDnsConfigRequest>,
    ) -> Result<Response<proto::GetDnsConfigResponse>, Status> {
        let project = validate::project(&request.into_inner().project)?;
        let row = self.core.catalog.dns(&project).await?;
        Ok(Response::new(proto::GetDnsConfigResponse { dns_config: Some(row.to_proto()) }))
    }

    async fn apply_route(
        &self,
        request: Request<proto::ApplyRouteRequest>,
    ) -> Result<Response<proto::ApplyRouteResponse>, Status> {
        let by = berth_rpc::caller(&request)?.to_string();
        let valid = validate::route(request.into_inner())?;
        let (row, changed) = self.core.catalog.apply_route(&valid).await?;
        if changed {
            tracing::debug!(route = %valid.key, generation = row.generation, %by, "route applied");
            self.core.changed(&valid.key.project).await;
        }
        Ok(Response::new(proto::ApplyRouteResponse { route: Some(row.to_proto()) }))
    }

    async fn get_route(
        &self,
        request: Request<proto::GetRouteRequest>,
    ) -> Result<Response<proto::GetRouteResponse>, Status> {
        let request = request.into_inner();
        let key = validate::key(&request.project, &request.name, "a route name")?;
        let row = self.core.catalog.route(&key).await?;
        let row = row.ok_or_else(|| Status::not_found(format!("route {key} not found")))?;
        Ok(Response::new(proto::GetRouteResponse { route: Some(row.to_proto()) }))
    }

    async fn list_routes(
        &self,
        request: Request<proto::ListRoutesRequest>,
    ) -> Result<Response<proto::ListRoutesResponse>, Status> {
        let project = validate::project(&request.into_inner().project)?;
        let rows = self.core.catalog.routes(&project).await?;
        Ok(Response::new(proto::ListRoutesResponse { routes: rows.iter().map(|r| r.to_proto()).collect() }))
    }

    async fn delete_route(
        &self,
        request: Request<proto::DeleteRouteRequest>,
    ) -> Result<Response<proto::DeleteRouteResponse>, Status> {
        let by = berth_rpc::caller(&request)?.to_string();
        let request = request.into_inner();
        let key = validate::key(&request.project, &request.name, "a route name")?;
        self.core.catalog.delete_route(&key).await?;
        tracing::info!(route = %key, %by, "route deleted");
        self.core.changed(&key.project).await;
        Ok(Response::new(proto::DeleteRouteResponse {}))
    }

    async fn get_plan(
        &self,
        request: Request<proto::GetPlanRequest>,
    ) -> Result<Response<proto::GetPlanResponse>, Status> {
        let project = validate::project(&request.into_inner().project)?;
        let plan = self.core.catalog.plan(&project).await?;
        let (leading, counters) = self.core.queue.counters(&project);
        let passes = proto::PassStats {
            leading,
            events: counters.events,
            passes: counters.passes,
            changes: counters.changes,
            last_pass_at: counters.last_pass_ms.map(timestamp),
        };
        Ok(Response::new(proto::GetPlanResponse { plan: Some(plan), passes: Some(passes) }))
    }
}

#[tonic::async_trait]
impl proto::node_egress_server::NodeEgress for EgressService {
    async fn watch_egress(
        &self,
        request: Request<proto::WatchEgressRequest>,
    ) -> Result<Response<tonic::codegen::BoxStream<proto::NodeEgressState>>, Status> {
        let node_id = request.get_ref().node_id.clone();
        berth_rpc::require_own_node(&request, &node_id)?;
        tracing::debug!(node = %node_id, "egress watch opened");
        Ok(Response::new(crate::push::open(self.core.clone(), node_id)))
    }

    async fn ack_egress(
        &self,
        request: Request<proto::AckEgressRequest>,
    ) -> Result<Response<proto::AckEgressResponse>, Status> {
        let node_id = request.get_ref().node_id.clone();
        berth_rpc::require_own_node(&request, &node_id)?;
        let request = request.into_inner();
        let error: String = request.error.chars().take(MAX_ACK_ERROR).collect();
        let enforcement =
            proto::EgressEnforcement::try_from(request.enforcement).unwrap_or(proto::EgressEnforcement::Unspecified);
        self.core.catalog.ack(&node_id, request.generation, &error, enforcement).await?;
        if error.is_empty() {
            tracing::debug!(node = %node_id, generation = request.generation, "egress state applied");
        } else {
            tracing::warn!(node = %node_id, generation = request.generation, %error, "a node could not apply its egress state");
        }
        Ok(Response::new(proto::AckEgressResponse {}))
    }
}
