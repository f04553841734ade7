//! What the egress tests share: plans built the way the egress service
//! compiles them, a loopback HTTP server that records what reaches it, and
//! a client that speaks to the proxy the way `curl` does.

#![allow(dead_code, reason = "each test binary uses a part of the support")]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use berth_proto::egress::v1::{Destination, EgressPlan, ListenerProtocol, NodeEgressState, ServiceEgress};
use berth_testkit::PATIENCE;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

/// One destination of a plan.
pub(crate) fn dest(route: &str, protocol: ListenerProtocol, hostname: &str, ports: &[u16]) -> Destination {
    let (listener, listener_port) = match protocol {
        ListenerProtocol::HttpsConnect => ("https", 3129),
        ListenerProtocol::Tcp => ("tcp", 5432),
        _ => ("http", 3128),
    };
    Destination {
        listener: listener.into(),
        protocol: protocol as i32,
        listener_port,
        hostname: hostname.into(),
        ports: ports.iter().map(|p| u32::from(*p)).collect(),
        route: route.into(),
    }
}

/// A service with a gateway, allowed and denied destinations.
pub(crate) fn service(name: &str, allowed: Vec<Destination>, denied: Vec<Destination>) -> ServiceEgress {
    ServiceEgress { service: name.into(), gateway: "gw".into(), allowed, denied, condition: None }
}

/// A tenant's plan.
pub(crate) fn plan(project: &str, generation: u64, services: Vec<ServiceEgress>) -> EgressPlan {
    EgressPlan { project: project.into(), generation, services, ..Default::default() }
}

/// A whole node state.
pub(crate) fn node_state(generation: u64, plans: Vec<EgressPlan>) -> NodeEgressState {
    NodeEgressState { generation, plans }
}

/// A loopback HTTP server answering every request `200 hello from <name>`,
/// keeping the request heads it received.
pub(crate) struct Origin {
    pub(crate) addr: SocketAddr,
    pub(crate) heads: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Origin {
    /// Listens on `ip:0`.
    pub(crate) async fn start(ip: &str, name: &str) -> Origin {
        let listener = TcpListener::bind((ip, 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let heads = Arc::new(Mutex::new(Vec::new()));
        let (kept, name) = (heads.clone(), name.to_string());
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else { continue };
                let (kept, name) = (kept.clone(), name.clone());
                tokio::spawn(async move {
                    let Some(head) = read_head(&mut stream).await else { return };
                    kept.lock().unwrap().push(head);
                    let body = format!("hello from {name}");
                    let answer =
                        format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
                    let _ = stream.write_all(answer.as_bytes()).await;
                    let _ = stream.shutdown().await;
                });
            }
        });
        Origin { addr, heads, task }
    }

    pub(crate) fn port(&self) -> u16 {
        self.addr.port()
    }

    pub(crate) fn requests(&self) -> usize {
        self.heads.lock().unwrap().len()
    }
}

impl Drop for Origin {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn read_head(stream: &mut TcpStream) -> Option<String> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if stream.read(&mut byte).await.ok()? == 0 {
            return None;
        }
        head.push(byte[0]);
    }
    Some(String::from_utf8_lossy(&head).into_owned())
}

/// An HTTP answer: its status and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) body: String,
}

/// Reads a whole answer (the peer closes after it).
pub(crate) async fn read_answer(stream: &mut TcpStream) -> Answer {
    let mut raw = Vec::new();
    tokio::time::timeout(PATIENCE, stream.read_to_end(&mut raw)).await.expect("an answer in time").unwrap();
    parse_answer(&raw)
}

fn parse_answer(raw: &[u8]) -> Answer {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("no status in {text:?}"));
    Answer { status, body: body.to_string() }
}

/// `GET url` through the proxy at `proxy`, as a client configured with
/// `HTTP_PROXY` sends it.
pub(crate) async fn get_via(proxy: SocketAddr, url: &str) -> Answer {
    let mut stream = TcpStream::connect(proxy).await.unwrap();
    get_on(&mut stream, url).await
}

/// `GET url` on a connection to the proxy already open.
pub(crate) async fn get_on(stream: &mut TcpStream, url: &str) -> Answer {
    let host = url.trim_start_matches("http://").split('/').next().unwrap().to_string();
    let request = format!("GET {url} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: egress-test\r\nAccept: */*\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    read_answer(stream).await
}

/// `CONNECT authority` through the proxy: the open tunnel, or the answer
/// that refused it.
pub(crate) async fn connect_via(proxy: SocketAddr, authority: &str) -> Result<TcpStream, Answer> {
    let mut stream = TcpStream::connect(proxy).await.unwrap();
    let request = format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let read = tokio::time::timeout(PATIENCE, stream.read(&mut byte)).await.expect("an answer in time").unwrap();
        assert_ne!(read, 0, "the proxy closed without answering: {:?}", String::from_utf8_lossy(&head));
        head.push(byte[0]);
    }
    let answer = parse_answer(&head);
    if answer.status == 200 {
        return Ok(stream);
    }
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(PATIENCE, stream.read_to_end(&mut rest)).await;
    Err(Answer { status: answer.status, body: String::from_utf8_lossy(&rest).into_owned() })
}
