//! The node agent: one per host. It serves `berth.agent.v1.Agent` on its own
//! mTLS port so the control plane can look at and signal what the host runs.
//!
//! Its RPCs answer `UNIMPLEMENTED` until they are built; the access layer
//! already admits only service and admin identities.

use berth_mtls::TlsCredentials;
use berth_proto::agent::v1;
use berth_rpc::{Listener, MAX_REQUEST_BYTES, ServerBuilder};
use berth_runtime::StartError;
use tokio_util::sync::CancellationToken;

/// The port the agent API listens on by default.
pub const DEFAULT_PORT: u16 = 7447;

/// The agent API's handlers.
#[derive(Debug, Clone)]
pub struct AgentApi {
    #[allow(dead_code, reason = "read by the handlers as they are built")]
    credentials: TlsCredentials,
}

#[tonic::async_trait]
impl v1::agent_server::Agent for AgentApi {}

/// The agent's gRPC services.
pub fn server(credentials: TlsCredentials) -> ServerBuilder {
    ServerBuilder::new().add_service(
        v1::agent_server::AgentServer::new(AgentApi { credentials }).max_decoding_message_size(MAX_REQUEST_BYTES),
    )
}

/// Serves the agent API on `listener` until `shutdown`.
pub async fn serve(
    listener: Listener,
    credentials: TlsCredentials,
    shutdown: CancellationToken,
) -> Result<(), StartError> {
    tracing::info!(addr = ?listener.local_addr().ok(), identity = ?credentials.identity(), "agent serving");
    server(credentials).serve(listener, shutdown).await?;
    Ok(())
}
