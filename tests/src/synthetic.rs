//! Synthetic nodes: hosts that join identity as an agent does (a key of
//! their own, a CSR, a join token) and then only heartbeat. They put a
//! steady heartbeat load on identity without a process each, and every one
//! of them is a healthy node that must never be marked down.
//!
//! # Source addresses
//! Identity limits join attempts per peer address, so node `i` dials from
//! `127.77.x.y` (every `127/8` address is this host on Linux), which the
//! [`Front`](crate::Front) passes on; each also advertises that address as
//! its agent's, keeping every node's (tier, address) its own.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use anyhow::{Context as _, bail};
use berth_mtls::{TlsCredentials, TlsMaterial, generate_csr};
use berth_proto::identity::v1;
use berth_proto::types::v1::Capacity;
use berth_rpc::Channel;
use tonic::transport::Endpoint;

/// The address synthetic node 0 dials from; node `i` adds `i`.
const FIRST_SOURCE: Ipv4Addr = Ipv4Addr::new(127, 77, 0, 1);

/// The agent port every synthetic node advertises.
const ADVERTISED_PORT: u16 = 7447;

/// How long one join may take.
const JOIN_TIMEOUT: Duration = Duration::from_secs(10);

/// What every synthetic node offers: nothing a lease of another tier can use.
const CAPACITY: Capacity = Capacity { cpu_millis: 1000, memory_bytes: 1 << 30 };

/// A node that joined and heartbeats through its own credentials.
#[derive(Debug, Clone)]
pub struct SyntheticNode {
    /// The node id identity chose.
    pub node_id: String,
    /// Its incarnation.
    pub incarnation: u64,
    /// Its name (`synthetic-<i>`).
    pub name: String,
    /// A channel to identity as this node.
    pub channel: Channel,
}

impl SyntheticNode {
    /// Joins node `index` of tier `tier`'s token through identity at
    /// `identity` (a loopback address whose certificate names 127.0.0.1).
    pub async fn join(index: u32, identity: SocketAddr, token: &str, ca_bundle_pem: &str) -> anyhow::Result<Self> {
        let source = Ipv4Addr::from(u32::from(FIRST_SOURCE) + index);
        let name = format!("synthetic-{index}");
        let (csr_pem, key_pem) = generate_csr(&name)?;
        let config = berth_mtls::anonymous_client_config(ca_bundle_pem)?;
        let channel = Endpoint::from_shared(format!("https://{identity}"))?
            .connect_timeout(JOIN_TIMEOUT)
            .timeout(JOIN_TIMEOUT)
            .connect_with_connector(berth_testkit::from_address(IpAddr::V4(source), config))
            .await
            .with_context(|| format!("{name} cannot reach identity at {identity}"))?;
        let answer = v1::join_client::JoinClient::new(channel)
            .join(v1::JoinRequest {
                token: token.to_string(),
                csr_pem,
                name: name.clone(),
                advertise_addr: SocketAddr::from((source, ADVERTISED_PORT)).to_string(),
                tier: String::new(),
                version: env!("CARGO_PKG_VERSION").to_string(),
                capacity: Some(CAPACITY),
                labels: [("synthetic".to_string(), "heartbeats".to_string())].into(),
            })
            .await
            .with_context(|| format!("{name}: join refused"))?
            .into_inner();
        if answer.node_id.is_empty() || answer.certificate_pem.is_empty() {
            bail!("{name}: identity answered the join without a node id or certificate");
        }
        let credentials = TlsCredentials::new(TlsMaterial {
            cert_chain_pem: answer.certificate_pem,
            key_pem,
            ca_bundle_pem: answer.ca_bundle_pem,
        })?;
        let channel = berth_rpc::connect(&identity.to_string(), credentials)?;
        Ok(Self { node_id: answer.node_id, incarnation: answer.incarnation, name, channel })
    }

    /// One heartbeat.
    pub async fn heartbeat(&self, timeout: Duration) -> Result<v1::HeartbeatResponse, tonic::Status> {
        let mut request = tonic::Request::new(v1::HeartbeatRequest {
            node_id: self.node_id.clone(),
            incarnation: self.incarnation,
            usage: Some(Capacity { cpu_millis: 0, memory_bytes: 0 }),
            capacity: Some(CAPACITY),
            version: env!("CARGO_PKG_VERSION").to_string(),
            renewal_csr_pem: String::new(),
            ca_bundle_sha256: String::new(),
            ..Default::default()
        });
        request.set_timeout(timeout);
        v1::node_session_client::NodeSessionClient::new(self.channel.clone())
            .heartbeat(request)
            .await
            .map(tonic::Response::into_inner)
    }
}
