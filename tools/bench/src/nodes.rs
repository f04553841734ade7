//! Simulated nodes: each joins identity as an agent does, with a key of its
//! own and a join token, and then holds the certificate identity chose for it.
//!
//! # Why every node joins from its own loopback address
//! Identity limits join attempts per peer address, as it must against
//! guessing; a fleet of real hosts joins from as many addresses. So node `i`
//! dials from `127.1.0.1 + i` (all of `127.0.0.0/8` is this host on Linux)
//! and advertises that address as its agent's, which also keeps every node's
//! (tier, advertise address) its own as identity requires.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use berth_mtls::{TlsCredentials, TlsMaterial, generate_csr};
use berth_proto::identity::v1;
use berth_proto::types::v1::Capacity;
use tonic::transport::Endpoint;

/// The first simulated node's address; node `i` is this plus `i`.
const FIRST_NODE_ADDRESS: Ipv4Addr = Ipv4Addr::new(127, 1, 0, 1);

/// The most nodes the loopback range below `127.255.255.255` holds after
/// [`FIRST_NODE_ADDRESS`], kept well inside.
pub(crate) const MAX_NODES: u32 = 1_000_000;

/// The agent port every node advertises.
const AGENT_PORT: u16 = 7444;

/// How long dialling and one join may take.
const JOIN_TIMEOUT: Duration = Duration::from_secs(30);

/// The compute every simulated node offers: a small host.
pub(crate) const NODE_CAPACITY: Capacity = Capacity { cpu_millis: 4000, memory_bytes: 8 << 30 };

/// Why a node could not join.
#[derive(Debug, thiserror::Error)]
pub(crate) enum JoinError {
    /// Its key or CSR could not be made, or its certificate made no credentials.
    #[error("{0}")]
    Tls(#[source] berth_mtls::MtlsError),
    /// Identity could not be reached from the node's address.
    #[error("cannot reach identity from {source_addr}: {detail}")]
    Unreachable {
        /// The node's loopback address.
        source_addr: Ipv4Addr,
        /// Why.
        detail: String,
    },
    /// Identity refused the join.
    #[error("join refused: {message}")]
    Refused {
        /// The status code.
        code: tonic::Code,
        /// The status in the tally's words.
        message: String,
    },
    /// Identity answered without a node id or certificate.
    #[error("identity answered the join without {0}")]
    Incomplete(&'static str),
}

impl JoinError {
    /// Whether an agent would try again: the connection failed, or identity
    /// asked for a retry (contention, overload, its rate limit).
    pub(crate) fn is_transient(&self) -> bool {
        match self {
            JoinError::Unreachable { .. } => true,
            JoinError::Refused { code, .. } => crate::load::is_transient(*code),
            JoinError::Tls(_) | JoinError::Incomplete(_) => false,
        }
    }
}

/// A node that joined: who identity says it is, and its credentials.
#[derive(Debug)]
pub(crate) struct JoinedNode {
    /// The node id identity chose.
    pub(crate) node_id: String,
    /// The incarnation its heartbeats carry.
    pub(crate) incarnation: u64,
    /// Its own certificate and key, trusting identity's CA bundle.
    pub(crate) credentials: TlsCredentials,
}

/// Node `index`'s loopback address.
pub(crate) fn node_address(index: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(FIRST_NODE_ADDRESS) + index)
}

/// Joins node `index` with `token`, over TLS without a client certificate
/// from the node's own address, verifying identity against `ca_bundle_pem`.
pub(crate) async fn join(
    index: u32,
    identity: SocketAddr,
    token: &str,
    ca_bundle_pem: &str,
) -> Result<JoinedNode, JoinError> {
    let source = node_address(index);
    let (csr_pem, key_pem) = generate_csr(&format!("bench-node-{index}")).map_err(JoinError::Tls)?;
    let config = berth_mtls::anonymous_client_config(ca_bundle_pem).map_err(JoinError::Tls)?;
    let unreachable = |detail: String| JoinError::Unreachable { source_addr: source, detail };
    let endpoint = Endpoint::from_shared(format!("https://{identity}"))
        .map_err(|e| unreachable(e.to_string()))?
        .connect_timeout(JOIN_TIMEOUT)
        .timeout(JOIN_TIMEOUT);
    let channel = endpoint
        .connect_with_connector(berth_testkit::from_address(IpAddr::V4(source), config))
        .await
        .map_err(|e| unreachable(berth_runtime::chain(&e)))?;
    let request = v1::JoinRequest {
        token: token.to_string(),
        csr_pem,
        name: format!("bench-node-{index}"),
        advertise_addr: SocketAddr::new(IpAddr::V4(source), AGENT_PORT).to_string(),
        tier: String::new(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        capacity: Some(NODE_CAPACITY),
        labels: [("bench".to_string(), "heartbeats".to_string())].into(),
    };
    let answer = v1::join_client::JoinClient::new(channel)
        .join(request)
        .await
        .map_err(|status| JoinError::Refused { code: status.code(), message: crate::load::status_message(&status) })?
        .into_inner();
    if answer.node_id.is_empty() {
        return Err(JoinError::Incomplete("a node id"));
    }
    if answer.certificate_pem.is_empty() {
        return Err(JoinError::Incomplete("a certificate"));
    }
    let credentials = TlsCredentials::new(TlsMaterial {
        cert_chain_pem: answer.certificate_pem,
        key_pem,
        ca_bundle_pem: answer.ca_bundle_pem,
    })
    .map_err(JoinError::Tls)?;
    Ok(JoinedNode { node_id: answer.node_id, incarnation: answer.incarnation, credentials })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_node_has_its_own_loopback_address() {
        assert_eq!(node_address(0), Ipv4Addr::new(127, 1, 0, 1));
        assert_eq!(node_address(255), Ipv4Addr::new(127, 1, 1, 0));
        assert_eq!(node_address(9_999), Ipv4Addr::new(127, 1, 39, 16));
        let last = node_address(MAX_NODES - 1);
        assert!(last.is_loopback() && last < Ipv4Addr::new(127, 255, 255, 255), "{last}");
    }
}
