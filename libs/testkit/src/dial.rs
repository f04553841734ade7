//! Dialling identity as a joining host does, from an address of the
//! host's own: many simulated hosts share one machine's loopback range
//! (127.0.0.0/8), each from its own source address, so identity sees and
//! records each one's address as it would a real host's.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use hyper_util::rt::TokioIo;
use rustls::ClientConfig;
use rustls_pki_types::ServerName;
use tokio::net::{TcpSocket, TcpStream};
use tokio_rustls::client::TlsStream;
use tonic::transport::Uri;

/// A connector for `Endpoint::connect_with_connector` that binds `source`
/// before it dials, then speaks TLS with `config` (one without a client
/// certificate, for a join). The endpoint's host must be an IP address,
/// which is the name the server's certificate is verified for.
pub fn from_address(
    source: IpAddr,
    config: Arc<ClientConfig>,
) -> impl tower_service::Service<
    Uri,
    Response = TokioIo<TlsStream<TcpStream>>,
    Error = std::io::Error,
    Future: Send + 'static,
> + Clone
+ Send
+ 'static {
    tower::service_fn(move |uri: Uri| {
        let config = config.clone();
        async move {
            let invalid = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, m.to_string());
            let host = uri.host().ok_or_else(|| invalid("identity's address has no host"))?;
            let port = uri.port_u16().ok_or_else(|| invalid("identity's address has no port"))?;
            let ip: IpAddr = host.parse().map_err(|_| invalid("identity's address is not an IP"))?;
            let socket = if source.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
            socket.bind(SocketAddr::new(source, 0))?;
            let tcp = socket.connect(SocketAddr::new(ip, port)).await?;
            let _ = tcp.set_nodelay(true);
            let tls = tokio_rustls::TlsConnector::from(config).connect(ServerName::from(ip), tcp).await?;
            Ok(TokioIo::new(tls))
        }
    })
}
