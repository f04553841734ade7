//! `Leases/GetLeaseLogs`: a lease's output, streamed from the agent of the
//! node it is placed on, so a caller that reaches this service sees every
//! replica's logs without reaching (or resolving) any node's address.
//!
//! # Invariants
//! - The agent is dialled at the address identity holds for the node, as
//!   this service (its certificate), never as the caller.
//! - The agent's own answers pass through unchanged (NOT_FOUND while the
//!   workload has not started there); an agent that cannot be reached is
//!   UNAVAILABLE naming the node and its address.

use berth_proto::agent::v1::GetLogsRequest;
use berth_proto::agent::v1::agent_client::AgentClient;
use berth_proto::leases::v1::GetLeaseLogsRequest;
use berth_proto::types::v1::LogChunk;
use tonic::Status;
use tonic::codegen::BoxStream;

use crate::shared::Core;
use crate::validate;

/// The output of the lease `request` names, as its node's agent streams it.
pub(crate) async fn open(core: &Core, request: GetLeaseLogsRequest) -> Result<BoxStream<LogChunk>, Status> {
    validate::lease_id(&request.lease_id)?;
    let lease = core.ledger.get(&request.lease_id).await?;
    if lease.node_id.is_empty() {
        return Err(Status::failed_precondition(format!("lease {} is on no node", lease.lease_id)));
    }
    let node = core.nodes.snapshot().nodes.get(&lease.node_id).cloned().ok_or_else(|| {
        Status::unavailable(format!("node {} of lease {} is not known to identity", lease.node_id, lease.lease_id))
    })?;
    if node.advertise_addr.is_empty() {
        return Err(Status::unavailable(format!("node {} advertises no agent address", node.node_id)));
    }
    let unreachable = |detail: String| {
        Status::unavailable(format!(
            "the agent of node {} at {} cannot be reached: {detail}",
            node.node_id, node.advertise_addr
        ))
    };
    let channel =
        berth_rpc::connect(&node.advertise_addr, core.credentials.clone()).map_err(|e| unreachable(e.to_string()))?;
    let asked =
        GetLogsRequest { lease_id: lease.lease_id.clone(), follow: request.follow, tail_lines: request.tail_lines };
    let stream = AgentClient::new(channel).get_logs(asked).await.map_err(|status| {
        // A status with a transport error behind it never reached the agent.
        if std::error::Error::source(&status).is_some() { unreachable(status.message().to_string()) } else { status }
    })?;
    Ok(Box::pin(stream.into_inner()))
}
