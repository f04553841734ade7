//! The agent API (`berth.agent.v1.Agent`), served on the node certificate so
//! the control plane can look at and signal what the host runs.
//!
//! Its RPCs answer `UNIMPLEMENTED` until they are built; the access layer
//! already admits only service and admin identities.

use berth_mtls::TlsCredentials;
use berth_proto::agent::v1;
use berth_rpc::{Listener, MAX_REQUEST_BYTES, RpcError, ServerBuilder};
use tokio_util::sync::CancellationToken;

/// The agent API's handlers.
#[derive(Debug, Clone)]
struct AgentApi {
    #[allow(dead_code, reason = "read by the handlers as they are built")]
    credentials: TlsCredentials,
}

#[tonic::async_trait]
impl v1::agent_server::Agent for AgentApi {}

/// Serves the agent API on `listener` until `shutdown`. The listener reads
/// `credentials` on every handshake, so renewals are served at once.
pub(crate) async fn serve(
    listener: Listener,
    credentials: TlsCredentials,
    shutdown: CancellationToken,
) -> Result<(), RpcError> {
    tracing::info!(addr = ?listener.local_addr().ok(), identity = ?credentials.identity(), "agent api serving");
    ServerBuilder::new()
        .add_service(
            v1::agent_server::AgentServer::new(AgentApi { credentials }).max_decoding_message_size(MAX_REQUEST_BYTES),
        )
        .serve(listener, shutdown)
        .await
}
