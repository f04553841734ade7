//! The gRPC face of the ledger: `Leases` and `Capacity` for requesters,
//! `NodeLeases` for node agents, each call checked and handed to the ledger,
//! each error mapped once through [`LeaseError`].
//!
//! # Who may call what
//! The access layer admits each RPC only to the caller kinds its proto
//! declares. Node RPCs additionally act only on the caller's own node id
//! ([`berth_rpc::require_own_node`]), and only on leases placed on it.
//!
//! # After a write
//! A change a node must act on wakes that node's assignment streams on every
//! replica; a lease that left the open phases leaves the reaper's index; a
//! renewed or re-held lease moves its deadline there. These bus writes are
//! best effort: the streams and the reaper re-read the database on their own.

use std::collections::HashMap;

use berth_proto::identity::v1::NodeState;
use berth_proto::leases::v1;
use tonic::{Request, Response, Status};

use crate::caches::CommitAsk;
use crate::ledger::{LeaseError, LeaseFilter, PhaseReport};
use crate::model::{Resize, Resources};
use crate::placement::NodeRuntime;
use crate::records::LeaseRecord;
use crate::service::LeasesService;
use crate::shared::EXPIRY_INDEX;
use crate::validate;

/// How many of the generations a node says it holds are looked at for one
/// to start a pull from (a node keeps its newest three).
const MAX_PULL_BASES: usize = 3;

impl LeasesService {
    /// Tells streams and the reaper about `lease` after it changed.
    async fn changed(&self, lease: &LeaseRecord) {
        let core = &self.core;
        core.signals.announce(&core.bus, std::slice::from_ref(&lease.node_id)).await;
        core.announce_owners([lease]).await;
        let indexed = match (lease.phase.is_open(), lease.expires_at_ms) {
            (true, Some(at)) => core.bus.deadline_set(EXPIRY_INDEX, &lease.lease_id, at).await,
            _ => core.bus.deadline_remove(EXPIRY_INDEX, &lease.lease_id).await.map(drop),
        };
        if let Err(error) = indexed {
            tracing::debug!(%error, lease_id = %lease.lease_id, "could not update the lease's deadline on the bus");
        }
    }
}

#[tonic::async_trait]
impl v1::leases_server::Leases for LeasesService {
    async fn request_lease(
        &self,
        request: Request<v1::RequestLeaseRequest>,
    ) -> Result<Response<v1::RequestLeaseResponse>, Status> {
        let mut ask = validate::lease_ask(request.into_inner())?;
        ask.traceparent = berth_telemetry::current_traceparent();
        let placed = self.core.placer.request(ask).await?;
        if placed.created {
            tracing::info!(lease_id = %placed.lease.lease_id, node_id = %placed.lease.node_id,
                project = %placed.lease.project, owner = %placed.lease.owner, "lease placed");
        }
        Ok(Response::new(v1::RequestLeaseResponse { lease: Some(placed.lease.to_proto()), created: placed.created }))
    }

    async fn get_lease(&self, request: Request<v1::GetLeaseRequest>) -> Result<Response<v1::GetLeaseResponse>, Status> {
        validate::lease_id(&request.get_ref().lease_id)?;
        berth_rpc::require_own_workload(
            &request,
            || format!("lease {}", request.get_ref().lease_id),
            |id| id.lease() == request.get_ref().lease_id,
        )?;
        let lease_id = request.into_inner().lease_id;
        let lease = self.core.ledger.get(&lease_id).await?;
        Ok(Response::new(v1::GetLeaseResponse { lease: Some(lease.to_proto()) }))
    }

    async fn resize_lease(
        &self,
        request: Request<v1::ResizeLeaseRequest>,
    ) -> Result<Response<v1::ResizeLeaseResponse>, Status> {
        let by = berth_rpc::caller(&request)?.to_string();
        let v1::ResizeLeaseRequest { lease_id, epoch, resources } = request.into_inner();
        validate::lease_id(&lease_id)?;
        let wanted = validate::resources(resources)?;
        let nodes = self.core.nodes.snapshot();
        let room = |node_id: &str| nodes.nodes.get(node_id).and_then(|node| node.capacity).map(Resources::from);
        let (lease, changed) = self.core.ledger.resize(&lease_id, epoch, wanted, &room).await?;
        if changed {
            tracing::info!(%lease_id, node_id = %lease.node_id, from = %lease.resources, to = %wanted, %by, "lease resize asked for");
            self.changed(&lease).await;
        }
        Ok(Response::new(v1::ResizeLeaseResponse { lease: Some(lease.to_proto()) }))
    }

    async fn list_leases(
        &self,
        request: Request<v1::ListLeasesRequest>,
    ) -> Result<Response<v1::ListLeasesResponse>, Status> {
        let request = request.into_inner();
        let filter = LeaseFilter {
            project: if request.all_projects { None } else { Some(validate::project(&request.project)?) },
            node_id: Some(request.node_id).filter(|n| !n.is_empty()),
            phase: validate::phase_filter(request.phase)?,
            owner: Some(request.owner).filter(|o| !o.is_empty()),
            ..LeaseFilter::default()
        };
        let leases = self.core.ledger.list(&filter).await?;
        Ok(Response::new(v1::ListLeasesResponse { leases: leases.iter().map(LeaseRecord::to_proto).collect() }))
    }

    async fn release_lease(
        &self,
        request: Request<v1::ReleaseLeaseRequest>,
    ) -> Result<Response<v1::ReleaseLeaseResponse>, Status> {
        let by = berth_rpc::caller(&request)?.to_string();
        let v1::ReleaseLeaseRequest { lease_id, reason } = request.into_inner();
        validate::lease_id(&lease_id)?;
        validate::reason(&reason)?;
        let reason = if reason.is_empty() { "Released" } else { reason.as_str() };
        let (lease, changed) = self.core.ledger.release(&lease_id, reason, &by).await?;
        if changed {
            tracing::info!(%lease_id, node_id = %lease.node_id, %reason, %by, "lease released");
            self.changed(&lease).await;
        }
        Ok(Response::new(v1::ReleaseLeaseResponse { lease: Some(lease.to_proto()) }))
    }

    async fn watch_leases(
        &self,
        request: Request<v1::WatchLeasesRequest>,
    ) -> Result<Response<tonic::codegen::BoxStream<v1::LeaseEvent>>, Status> {
        let request = request.into_inner();
        let resume = i64::try_from(request.resume_cursor).ok().filter(|&cursor| cursor > 0);
        let scope = validate::watch_scope(request)?;
        Ok(Response::new(crate::watch::open(self.core.clone(), scope, resume)))
    }

    async fn get_lease_logs(
        &self,
        request: Request<v1::GetLeaseLogsRequest>,
    ) -> Result<Response<tonic::codegen::BoxStream<berth_proto::types::v1::LogChunk>>, Status> {
        Ok(Response::new(crate::logs::open(&self.core, request.into_inner()).await?))
    }

    async fn redeem_launch_registration(
        &self,
        request: Request<v1::RedeemLaunchRegistrationRequest>,
    ) -> Result<Response<v1::RedeemLaunchRegistrationResponse>, Status> {
        let caller = berth_rpc::caller(&request)?.clone();
        if caller != berth_core::Identity::Service("identity".to_owned()) {
            return Err(Status::permission_denied(format!(
                "{caller} may not redeem launch registrations: only identity signs workload certificates"
            )));
        }
        let v1::RedeemLaunchRegistrationRequest { registration, node_id } = request.into_inner();
        validate::registration(&registration)?;
        validate::node_id(&node_id)?;
        let spent = async {
            let redeem = self.core.ledger.verify_launch(&registration, &node_id, &caller.to_string()).await?;
            self.core.redeemer.request(redeem).await
        };
        let lease = spent
            .await
            .inspect_err(|error| tracing::warn!(%node_id, %caller, %error, "launch registration refused"))?;
        tracing::info!(lease_id = %lease.lease_id, epoch = lease.epoch, %node_id, "launch registration redeemed");
        Ok(Response::new(v1::RedeemLaunchRegistrationResponse { lease: Some(lease.to_proto()) }))
    }
}

/// A volume's project and key from a request: the project defaulted and
/// both checked.
fn volume_name(project: &str, key: &str) -> Result<(String, String), LeaseError> {
    let project = validate::project(project)?;
    validate::cache_key(key)?;
    Ok((project, key.to_owned()))
}

#[tonic::async_trait]
impl v1::caches_server::Caches for LeasesService {
    async fn list_caches(
        &self,
        request: Request<v1::ListCachesRequest>,
    ) -> Result<Response<v1::ListCachesResponse>, Status> {
        let request = request.into_inner();
        let project = if request.all_projects { None } else { Some(validate::project(&request.project)?) };
        let volumes = self.core.ledger.list_caches(project.as_deref()).await?;
        Ok(Response::new(v1::ListCachesResponse { volumes }))
    }

    async fn get_cache(&self, request: Request<v1::GetCacheRequest>) -> Result<Response<v1::GetCacheResponse>, Status> {
        let request = request.into_inner();
        let (project, key) = volume_name(&request.project, &request.key)?;
        let (volume, generations) = self.core.ledger.get_cache(&project, &key).await?;
        Ok(Response::new(v1::GetCacheResponse { volume: Some(volume), generations }))
    }

    async fn set_cache_head(
        &self,
        request: Request<v1::SetCacheHeadRequest>,
    ) -> Result<Response<v1::SetCacheHeadResponse>, Status> {
        let request = request.into_inner();
        let (project, key) = volume_name(&request.project, &request.key)?;
        let volume = self.core.ledger.set_cache_head(&project, &key, request.generation).await?;
        tracing::info!(%project, %key, generation = request.generation, "cache volume head set");
        Ok(Response::new(v1::SetCacheHeadResponse { volume: Some(volume) }))
    }

    async fn pin_cache_generation(
        &self,
        request: Request<v1::PinCacheGenerationRequest>,
    ) -> Result<Response<v1::PinCacheGenerationResponse>, Status> {
        let request = request.into_inner();
        let (project, key) = volume_name(&request.project, &request.key)?;
        let generation =
            self.core.ledger.pin_cache_generation(&project, &key, request.generation, request.pinned).await?;
        tracing::info!(%project, %key, generation = request.generation, pinned = request.pinned, "cache generation pin set");
        Ok(Response::new(v1::PinCacheGenerationResponse { generation: Some(generation) }))
    }

    async fn delete_cache(
        &self,
        request: Request<v1::DeleteCacheRequest>,
    ) -> Result<Response<v1::DeleteCacheResponse>, Status> {
        let request = request.into_inner();
        let (project, key) = volume_name(&request.project, &request.key)?;
        self.core.ledger.delete_cache(&project, &key).await?;
        tracing::info!(%project, %key, "cache volume deleted");
        Ok(Response::new(v1::DeleteCacheResponse {}))
    }

    async fn set_project_caching(
        &self,
        request: Request<v1::SetProjectCachingRequest>,
    ) -> Result<Response<v1::SetProjectCachingResponse>, Status> {
        let request = request.into_inner();
        let project = validate::project(&request.project)?;
        self.core.ledger.set_project_caching(&project, request.enabled).await?;
        tracing::info!(%project, enabled = request.enabled, "project caching set");
        Ok(Response::new(v1::SetProjectCachingResponse { project, enabled: request.enabled }))
    }
}

#[tonic::async_trait]
impl v1::capacity_server::Capacity for LeasesService {
    async fn list_node_capacity(
        &self,
        request: Request<v1::ListNodeCapacityRequest>,
    ) -> Result<Response<v1::ListNodeCapacityResponse>, Status> {
        let tier = request.into_inner().tier;
        validate::tier(&tier)?;
        let snapshot = self.core.nodes.snapshot();
        let rows = self.core.ledger.node_rows().await?;
        let mut rows: HashMap<String, _> = rows.into_iter().map(|row| (row.node_id.clone(), row)).collect();
        let mut nodes = Vec::new();
        for node in snapshot.nodes.values().filter(|n| tier.is_empty() || n.tier == tier) {
            let row = rows.remove(&node.node_id).unwrap_or_default();
            let total = node.capacity.map(Resources::from).unwrap_or_default();
            let runtime = NodeRuntime::of_labels(&node.labels);
            nodes.push(v1::NodeCapacity {
                node_id: node.node_id.clone(),
                tier: node.tier.clone(),
                state: node.state,
                total: Some(total.into()),
                allocated: Some(row.allocated.into()),
                free: Some(total.minus(row.allocated).into()),
                leases: row.open_leases,
                runtime: runtime.name,
                contained: runtime.contained,
            });
        }
        // A node identity no longer lists may still hold leases until they expire.
        if tier.is_empty() {
            for row in rows.into_values().filter(|row| row.open_leases > 0) {
                nodes.push(v1::NodeCapacity {
                    node_id: row.node_id.clone(),
                    tier: String::new(),
                    state: NodeState::Unspecified as i32,
                    total: Some(Resources::default().into()),
                    allocated: Some(row.allocated.into()),
                    free: Some(Resources::default().into()),
                    leases: row.open_leases,
                    ..v1::NodeCapacity::default()
                });
            }
        }
        nodes.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        Ok(Response::new(v1::ListNodeCapacityResponse { nodes }))
    }
}

#[tonic::async_trait]
impl v1::node_leases_server::NodeLeases for LeasesService {
    async fn watch_assignments(
        &self,
        request: Request<v1::WatchAssignmentsRequest>,
    ) -> Result<Response<tonic::codegen::BoxStream<v1::AssignmentEvent>>, Status> {
        let v1::WatchAssignmentsRequest { node_id, resume_cursor } = request.get_ref().clone();
        berth_rpc::require_own_node(&request, &node_id)?;
        // Zero asks for a fresh start; a cursor no database could hold is one the ledger cannot resume from.
        let resume = Some(resume_cursor).filter(|&c| c > 0).and_then(|c| i64::try_from(c).ok());
        Ok(Response::new(crate::assignments::open(self.core.clone(), node_id, resume)))
    }

    async fn report_phase(
        &self,
        request: Request<v1::ReportPhaseRequest>,
    ) -> Result<Response<v1::ReportPhaseResponse>, Status> {
        let node_id = request.get_ref().node_id.clone();
        berth_rpc::require_own_node(&request, &node_id)?;
        let request = request.into_inner();
        validate::lease_id(&request.lease_id)?;
        let report = PhaseReport {
            phase: validate::reported_phase(request.phase)?,
            lease_id: request.lease_id,
            epoch: request.epoch,
            reason: request.reason,
            message: request.message,
            exit_code: request.exit_code,
            ports: validate::reported_ports(&request.ports)?,
        };
        validate::reason(&report.reason)?;
        validate::message(&report.message)?;
        let (lease, changed) = self.core.ledger.report(&node_id, &report).await.inspect_err(|error| {
            if matches!(error, LeaseError::StaleEpoch { .. } | LeaseError::IllegalTransition { .. }) {
                tracing::info!(%node_id, lease_id = %report.lease_id, %error, "phase report refused");
            }
        })?;
        if changed && !lease.phase.is_open() {
            tracing::info!(lease_id = %lease.lease_id, %node_id, phase = %lease.phase, reason = %lease.reason, "lease ended");
            self.changed(&lease).await;
        } else if changed {
            // The node's own stream has nothing to learn from its own report; watchers do.
            self.core.announce_owners([&lease]).await;
        }
        Ok(Response::new(v1::ReportPhaseResponse { lease: Some(lease.to_proto()) }))
    }

    async fn renew_leases(
        &self,
        request: Request<v1::RenewLeasesRequest>,
    ) -> Result<Response<v1::RenewLeasesResponse>, Status> {
        let node_id = request.get_ref().node_id.clone();
        berth_rpc::require_own_node(&request, &node_id)?;
        let held = validate::lease_refs("leases", &request.get_ref().leases)?;
        let (renewed, expires_at) = self.core.ledger.renew(&node_id, &held).await?;
        let (mut kept, mut lost) = (Vec::new(), Vec::new());
        let mut deadlines = Vec::new();
        for (lease_id, epoch) in held {
            let lease = v1::LeaseRef { lease_id, epoch: u64::try_from(epoch).unwrap_or_default() };
            if renewed.contains(&(lease.lease_id.clone(), epoch)) {
                deadlines.push((lease.lease_id.clone(), expires_at));
                kept.push(lease);
            } else {
                lost.push(lease);
            }
        }
        if !lost.is_empty() {
            tracing::info!(%node_id, lost = lost.len(), "renewal found leases the node no longer holds");
        }
        if let Err(error) = self.core.bus.deadline_set_many(EXPIRY_INDEX, &deadlines).await {
            tracing::debug!(%error, "could not move renewed deadlines on the bus; the reaper checks the database");
        }
        Ok(Response::new(v1::RenewLeasesResponse { renewed: kept, lost, ttl_ms: self.core.config.ttl_ms() }))
    }

    async fn reconcile_node(
        &self,
        request: Request<v1::ReconcileNodeRequest>,
    ) -> Result<Response<v1::ReconcileNodeResponse>, Status> {
        let node_id = request.get_ref().node_id.clone();
        berth_rpc::require_own_node(&request, &node_id)?;
        let running = validate::lease_refs("running", &request.get_ref().running)?;
        let reconciled = self.core.ledger.reconcile(&node_id, &running).await?;
        for lease in &reconciled.failed {
            tracing::warn!(lease_id = %lease.lease_id, %node_id, "lease failed: its node does not run it");
            self.changed(lease).await;
        }
        if !reconciled.destroy.is_empty() {
            tracing::info!(%node_id, destroy = reconciled.destroy.len(), "node runs workloads no open lease covers");
        }
        Ok(Response::new(v1::ReconcileNodeResponse {
            destroy: reconciled.destroy,
            failed: reconciled.failed.iter().map(LeaseRecord::lease_ref).collect(),
        }))
    }

    async fn assume_custody(
        &self,
        request: Request<v1::AssumeCustodyRequest>,
    ) -> Result<Response<v1::AssumeCustodyResponse>, Status> {
        let node_id = request.get_ref().node_id.clone();
        berth_rpc::require_own_node(&request, &node_id)?;
        let v1::AssumeCustodyRequest { lease_id, epoch, .. } = request.into_inner();
        validate::lease_id(&lease_id)?;
        let room = self.core.nodes.snapshot().nodes.get(&node_id).and_then(|node| node.capacity).map(Resources::from);
        let lease = self.core.ledger.assume_custody(&node_id, &lease_id, epoch, room).await?;
        tracing::info!(%lease_id, %node_id, epoch = lease.epoch, "lease taken back into its node's custody");
        self.changed(&lease).await;
        Ok(Response::new(v1::AssumeCustodyResponse { lease: Some(lease.to_proto()) }))
    }

    async fn report_resize(
        &self,
        request: Request<v1::ReportResizeRequest>,
    ) -> Result<Response<v1::ReportResizeResponse>, Status> {
        let node_id = request.get_ref().node_id.clone();
        berth_rpc::require_own_node(&request, &node_id)?;
        let v1::ReportResizeRequest { lease_id, epoch, resources, state, reason, message, .. } = request.into_inner();
        validate::lease_id(&lease_id)?;
        let report = Resize {
            resources: validate::resources(resources)?,
            state: validate::reported_resize(state)?,
            reason,
            message,
        };
        validate::reason(&report.reason)?;
        validate::message(&report.message)?;
        let (lease, changed) = self.core.ledger.report_resize(&node_id, &lease_id, epoch, &report).await?;
        if changed {
            let resize = lease.resize.as_ref();
            tracing::info!(%lease_id, %node_id, size = %lease.resources, state = ?resize.map(|r| r.state),
                reason = resize.map_or("", |r| r.reason.as_str()), "lease resize reported");
            self.core.announce_owners([&lease]).await;
        }
        Ok(Response::new(v1::ReportResizeResponse { lease: Some(lease.to_proto()) }))
    }

    async fn open_cache(
        &self,
        request: Request<v1::OpenCacheRequest>,
    ) -> Result<Response<v1::OpenCacheResponse>, Status> {
        let node_id = request.get_ref().node_id.clone();
        berth_rpc::require_own_node(&request, &node_id)?;
        let v1::OpenCacheRequest { lease_id, epoch, key, held_generations, .. } = request.into_inner();
        validate::lease_id(&lease_id)?;
        validate::cache_key(&key)?;
        let (head, observation, changed) =
            self.core.ledger.open_cache(&node_id, &lease_id, epoch, &key, &held_generations).await?;
        if changed {
            tracing::info!(%lease_id, %node_id, %key, generation = head.generation,
                outcome = ?observation.outcome(), "cache volume opened");
        }
        // Only a volume the lease may publish or start from a generation of is given the registry.
        let registry = observation.reason.is_empty().then(|| self.core.ledger.cache_registry(&head.project)).flatten();
        // A miss of a pushed head may be pulled from a generation the node holds.
        let mut older: Vec<u64> = held_generations.iter().copied().filter(|n| *n < head.generation).collect();
        older.sort_unstable_by(|a, b| b.cmp(a));
        older.truncate(MAX_PULL_BASES);
        let held = if registry.is_some() && !head.artifact.is_empty() && !held_generations.contains(&head.generation) {
            self.core.ledger.pushed_generation(&head.project, &key, &older).await?
        } else {
            None
        };
        Ok(Response::new(v1::OpenCacheResponse { head: Some(head), observation: Some(observation), registry, held }))
    }

    async fn commit_cache(
        &self,
        request: Request<v1::CommitCacheRequest>,
    ) -> Result<Response<v1::CommitCacheResponse>, Status> {
        let node_id = request.get_ref().node_id.clone();
        berth_rpc::require_own_node(&request, &node_id)?;
        let v1::CommitCacheRequest {
            lease_id,
            epoch,
            key,
            base_generation,
            digest,
            size_bytes,
            skip_reason,
            message,
            artifact,
            ..
        } = request.into_inner();
        validate::lease_id(&lease_id)?;
        validate::cache_key(&key)?;
        validate::message(&message)?;
        let sealed = if digest.is_empty() {
            if skip_reason.is_empty() {
                return Err(LeaseError::InvalidArgument {
                    field: "skip_reason",
                    reason: "must say why nothing is published when no digest is given".to_owned(),
                }
                .into());
            }
            validate::reason(&skip_reason)?;
            None
        } else {
            validate::sha256_digest("digest", &digest)?;
            Some((digest, size_bytes))
        };
        if !artifact.is_empty() {
            if sealed.is_none() {
                return Err(LeaseError::InvalidArgument {
                    field: "artifact",
                    reason: "names the artifact of a sealed view, and no digest is given".to_owned(),
                }
                .into());
            }
            validate::sha256_digest("artifact", &artifact)?;
        }
        let skip = (skip_reason, message);
        let ask = CommitAsk { node_id, lease_id, epoch, key, base_generation, sealed, artifact, skip };
        let outcome = self.core.ledger.commit_cache(&ask).await?;
        if outcome.changed {
            let seen = &outcome.observation;
            tracing::info!(lease_id = %ask.lease_id, node_id = %ask.node_id, key = %ask.key,
                committed = seen.committed_generation, reason = %seen.reason, "cache volume commit settled");
        }
        Ok(Response::new(v1::CommitCacheResponse {
            committed: outcome.committed,
            head: Some(outcome.head),
            observation: Some(outcome.observation),
        }))
    }

    async fn follow_caches(
        &self,
        request: Request<v1::FollowCachesRequest>,
    ) -> Result<Response<v1::FollowCachesResponse>, Status> {
        let node_id = request.get_ref().node_id.clone();
        berth_rpc::require_own_node(&request, &node_id)?;
        let held = validate::held_caches(request.into_inner().held)?;
        let heads = self.core.ledger.follow_caches(&node_id, &held).await?;
        let follow = heads
            .into_iter()
            .filter_map(|(head, held)| {
                let registry = self.core.ledger.cache_registry(&head.project)?;
                Some(v1::CacheToFollow { head: Some(head), registry: Some(registry), held })
            })
            .collect();
        Ok(Response::new(v1::FollowCachesResponse { follow }))
    }

    async fn register_launch(
        &self,
        request: Request<v1::RegisterLaunchRequest>,
    ) -> Result<Response<v1::RegisterLaunchResponse>, Status> {
        let node_id = request.get_ref().node_id.clone();
        berth_rpc::require_own_node(&request, &node_id)?;
        let v1::RegisterLaunchRequest { lease_id, epoch, .. } = request.into_inner();
        validate::lease_id(&lease_id)?;
        let (registration, expires_at) = self.core.ledger.register_launch(&node_id, &lease_id, epoch).await?;
        tracing::debug!(%lease_id, epoch, %node_id, "launch registered");
        Ok(Response::new(v1::RegisterLaunchResponse {
            registration,
            expires_at: Some(berth_proto::timestamp_from_ms(expires_at)),
        }))
    }
}
