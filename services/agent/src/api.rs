//! The agent API (`berth.agent.v1.Agent`), served on the node certificate so
//! the control plane and operators can look at and signal what the host
//! runs. The access layer admits only service and admin identities.
//!
//! # What it reads
//! Instances come from the runner's board; logs, stats and signals go to the
//! provider. An agent started without a leases service runs nothing: it
//! lists no instances and knows no lease.

use std::sync::Arc;
use std::time::Duration;

use berth_mtls::TlsCredentials;
use berth_proto::agent::v1;
use berth_rpc::threads::ServingThreads;
use berth_rpc::{Listener, MAX_REQUEST_BYTES, RpcError, ServerBuilder};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::codegen::BoxStream;
use tonic::{Request, Response, Status};

use crate::board::{InstanceBoard, InstanceView};
use crate::data_plane::DataPlane;
use crate::logs::{LogRequest, stream_logs};
use crate::provider::{Provider, ProviderError, WorkloadSignal};

/// How many log chunks may wait for a slow caller before reading pauses.
const LOG_BACKLOG: usize = 16;

/// What the handlers read.
#[derive(Debug, Clone)]
pub(crate) struct AgentApi {
    /// The node's instances.
    pub(crate) board: InstanceBoard,
    /// What runs them; `None` when the agent runs no leases.
    pub(crate) provider: Option<Arc<dyn Provider>>,
    /// How often a followed log is read.
    pub(crate) log_poll: Duration,
    /// Ends followed logs when the agent stops.
    pub(crate) shutdown: CancellationToken,
}

impl AgentApi {
    fn provider(&self, lease_id: &str) -> Result<&Arc<dyn Provider>, Status> {
        self.provider
            .as_ref()
            .ok_or_else(|| Status::not_found(format!("no instance for lease {lease_id} on this node")))
    }
}

fn lease_id(field: &str) -> Result<String, Status> {
    let id = field.trim();
    if id.is_empty() {
        return Err(Status::invalid_argument("lease_id: the lease whose instance to look at is required"));
    }
    Ok(id.to_string())
}

fn provider_status(error: ProviderError) -> Status {
    match error {
        ProviderError::NotFound(_) => Status::not_found(error.to_string()),
        ProviderError::NotRunning(_) => Status::failed_precondition(error.to_string()),
        ProviderError::InvalidLeaseId(_) => Status::invalid_argument(format!("lease_id: {error}")),
        _ => Status::internal(error.to_string()),
    }
}

fn project_matches(wanted: &str, project: &str) -> bool {
    let named = |p: &str| if p.is_empty() { "default".to_string() } else { p.to_string() };
    wanted.is_empty() || named(wanted) == named(project)
}

fn instance(view: InstanceView) -> v1::Instance {
    let over = view.is_over();
    v1::Instance {
        lease_id: view.lease_id,
        epoch: view.epoch,
        project: view.meta.project,
        service: view.meta.service,
        revision: view.meta.revision,
        phase: view.phase as i32,
        pid: if over { 0 } else { view.pid.unwrap_or(0) },
        started_at: view.started_at.map(prost_types::Timestamp::from),
        port: view.meta.port,
        digest: view.meta.digest,
        exit_code: view.exit.and_then(|e| e.code()),
        reason: view.reason,
    }
}

fn workload_signal(signal: i32) -> Result<WorkloadSignal, Status> {
    Ok(match v1::Signal::try_from(signal) {
        Ok(v1::Signal::Term) => WorkloadSignal::Term,
        Ok(v1::Signal::Kill) => WorkloadSignal::Kill,
        Ok(v1::Signal::Int) => WorkloadSignal::Int,
        Ok(v1::Signal::Hup) => WorkloadSignal::Hup,
        Ok(v1::Signal::Usr1) => WorkloadSignal::Usr1,
        Ok(v1::Signal::Usr2) => WorkloadSignal::Usr2,
        Ok(v1::Signal::Quit) => WorkloadSignal::Quit,
        Ok(v1::Signal::Unspecified) | Err(_) => {
            return Err(Status::invalid_argument(
                "signal: one of SIGNAL_TERM, SIGNAL_KILL, SIGNAL_INT, SIGNAL_HUP, SIGNAL_USR1, SIGNAL_USR2, SIGNAL_QUIT is required",
            ));
        }
    })
}

#[tonic::async_trait]
impl v1::agent_server::Agent for AgentApi {
    async fn list_instances(
        &self,
        request: Request<v1::ListInstancesRequest>,
    ) -> Result<Response<v1::ListInstancesResponse>, Status> {
        let wanted = request.into_inner().project;
        let instances = self
            .board
            .list()
            .into_iter()
            .filter(|view| project_matches(wanted.trim(), &view.meta.project))
            .map(instance)
            .collect();
        let custody = self.board.custody();
        Ok(Response::new(v1::ListInstancesResponse {
            instances,
            held_in_custody: u32::try_from(custody.held).unwrap_or(u32::MAX),
            custody_since: custody.since.map(prost_types::Timestamp::from),
        }))
    }

    async fn get_logs(
        &self,
        request: Request<v1::GetLogsRequest>,
    ) -> Result<Response<BoxStream<berth_proto::types::v1::LogChunk>>, Status> {
        let request = request.into_inner();
        let lease_id = lease_id(&request.lease_id)?;
        let files = self.provider(&lease_id)?.log_files(&lease_id).map_err(provider_status)?;
        let (tx, rx) = tokio::sync::mpsc::channel(LOG_BACKLOG);
        let request =
            LogRequest { lease_id, files, tail_lines: request.tail_lines, follow: request.follow, poll: self.log_poll };
        tokio::spawn(stream_logs(request, self.board.clone(), tx, self.shutdown.clone()));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn get_stats(&self, request: Request<v1::GetStatsRequest>) -> Result<Response<v1::GetStatsResponse>, Status> {
        let lease_id = lease_id(&request.into_inner().lease_id)?;
        let stats = self.provider(&lease_id)?.stats(&lease_id).await.map_err(provider_status)?;
        Ok(Response::new(v1::GetStatsResponse {
            cpu_millis_used: stats.cpu_time.as_millis().min(u128::from(u64::MAX)) as u64,
            memory_bytes: stats.memory_bytes,
            uptime_seconds: stats.uptime.as_secs(),
        }))
    }

    async fn signal_instance(
        &self,
        request: Request<v1::SignalInstanceRequest>,
    ) -> Result<Response<v1::SignalInstanceResponse>, Status> {
        let request = request.into_inner();
        let lease_id = lease_id(&request.lease_id)?;
        let signal = workload_signal(request.signal)?;
        self.provider(&lease_id)?.signal(&lease_id, signal).await.map_err(provider_status)?;
        tracing::info!(%lease_id, ?signal, "signalled the instance");
        Ok(Response::new(v1::SignalInstanceResponse {}))
    }
}

/// Serves the agent API and the data plane on `listener` until `shutdown`. The listener reads
/// `credentials` on every handshake, so renewals are served at once.
pub(crate) async fn serve(
    listener: Listener,
    credentials: TlsCredentials,
    api: AgentApi,
    data_plane: DataPlane,
    shutdown: CancellationToken,
) -> Result<(), RpcError> {
    tracing::info!(addr = ?listener.local_addr().ok(), identity = ?credentials.identity(), "agent api serving");
    // Every routed request crosses this server (the data plane): its
    // connections are served a thread each, as the router's are.
    ServerBuilder::new()
        .with_serving_threads(ServingThreads::per_cpu("agent-serve")?)
        .with_max_streams(crate::data_plane::TUNNELS_PER_CONNECTION)
        .add_service(v1::agent_server::AgentServer::new(api).max_decoding_message_size(MAX_REQUEST_BYTES))
        .add_service(data_plane)
        .serve(listener, shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn projects_match_with_empty_meaning_default() {
        assert!(project_matches("", "anything"));
        assert!(project_matches("default", ""));
        assert!(project_matches("", ""));
        assert!(project_matches("team", "team"));
        assert!(!project_matches("team", ""));
        assert!(!project_matches("team", "other"));
    }

    #[test]
    fn an_unset_or_unknown_signal_names_the_field() {
        for bad in [0, 99] {
            let status = workload_signal(bad).unwrap_err();
            assert_eq!(status.code(), tonic::Code::InvalidArgument);
            assert!(status.message().starts_with("signal:"), "{}", status.message());
        }
        assert_eq!(workload_signal(v1::Signal::Term as i32).unwrap(), WorkloadSignal::Term);
    }
}
