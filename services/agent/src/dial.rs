//! Reaching a replica's port from the agent, where the replica listens:
//! the loopback of its tenant's network namespace when the node isolates
//! egress, else the host's. The data plane's tunnels and the readiness
//! checks both dial through here, so both see what a client would.
//!
//! A port that accepts is not always one something listens on: a
//! microVM's ports are its VMM's forwards, which accept while the guest
//! boots. A readiness check therefore asks the provider first
//! ([`Provider::listens`]), and dials only once it does not say no.
//!
//! # Why not the node port on the host
//! Under egress isolation the agent itself listens on the node port and
//! forwards into the namespace, so a connection to it is accepted whether
//! or not the replica listens: only a connection made inside says whether
//! the replica answers.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use berth_proto::types::v1::Readiness;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use crate::egress::EgressProxies;
use crate::provider::Provider;

/// How long connecting to a replica's port may take.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long one readiness check may take, end to end.
const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// How often readiness is checked when the workload does not say.
pub(crate) const DEFAULT_READINESS_PERIOD: Duration = Duration::from_millis(100);

/// Dials replicas' ports; cheap to clone.
#[derive(Debug, Clone, Default)]
pub(crate) struct Dialer {
    /// The tenants' namespaces, when the node isolates egress.
    pub(crate) egress: Option<EgressProxies>,
}

impl Dialer {
    /// Connects to `port` of the replica of `lease_id`, within [`CONNECT_TIMEOUT`].
    pub(crate) async fn connect(&self, lease_id: &str, port: u16) -> std::io::Result<TcpStream> {
        let connected = async {
            if let Some(egress) = &self.egress
                && let Some(inside) = egress.connect_inside(lease_id, port).await
            {
                return inside;
            }
            TcpStream::connect(SocketAddr::from((Ipv4Addr::LOCALHOST, port))).await
        };
        match tokio::time::timeout(CONNECT_TIMEOUT, connected).await {
            Ok(connected) => connected,
            Err(_) => {
                Err(std::io::Error::new(std::io::ErrorKind::TimedOut, format!("no answer within {CONNECT_TIMEOUT:?}")))
            }
        }
    }

    /// Whether the replica of `lease_id`, run by `provider`, passes
    /// `readiness` on `port` now: something listens on the port where the
    /// replica runs (as far as `provider` can tell), the port accepts, and,
    /// with an HTTP path, a GET of it answers below 400.
    pub(crate) async fn ready(
        &self,
        provider: &dyn Provider,
        lease_id: &str,
        port: u16,
        readiness: &Readiness,
    ) -> Result<(), String> {
        if provider.listens(lease_id, port) == Some(false) {
            return Err(format!("port {port}: nothing listens on it yet where the replica runs"));
        }
        let check = async {
            let mut stream = self.connect(lease_id, port).await.map_err(|e| format!("port {port}: {e}"))?;
            if readiness.http_path.is_empty() {
                return Ok(());
            }
            let request =
                format!("GET {} HTTP/1.0\r\nHost: localhost\r\nUser-Agent: berth-agent\r\n\r\n", readiness.http_path);
            stream.write_all(request.as_bytes()).await.map_err(|e| format!("GET {}: {e}", readiness.http_path))?;
            let mut head = [0u8; 32];
            let mut read = 0;
            while read < 12 {
                match stream.read(&mut head[read..]).await {
                    Ok(0) => break,
                    Ok(n) => read += n,
                    Err(e) => return Err(format!("GET {}: {e}", readiness.http_path)),
                }
            }
            let line = String::from_utf8_lossy(&head[..read]).into_owned();
            let code = line
                .strip_prefix("HTTP/")
                .and_then(|rest| rest.split_whitespace().nth(1))
                .and_then(|code| code.parse::<u16>().ok());
            match code {
                Some(code) if code < 400 => Ok(()),
                Some(code) => Err(format!("GET {} answered {code}", readiness.http_path)),
                None => Err(format!("GET {} answered no HTTP status: {line:?}", readiness.http_path)),
            }
        };
        tokio::time::timeout(CHECK_TIMEOUT, check)
            .await
            .unwrap_or_else(|_| Err(format!("no answer within {CHECK_TIMEOUT:?}")))
    }
}

/// How often `readiness` asks to be checked.
pub(crate) fn period(readiness: &Readiness) -> Duration {
    match readiness.period_millis {
        0 => DEFAULT_READINESS_PERIOD,
        millis => Duration::from_millis(u64::from(millis)),
    }
}
