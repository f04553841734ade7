#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicUsize, Ordering};

use berth_proto::egress::v1::{Destination, EgressPlan, ListenerProtocol, ServiceEgress};
use hickory_proto::op::Query;
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{Name, RData, Record, RecordType};

use super::*;

/// What the test's upstream answers for every name.
const ANSWER: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);

/// A resolver on loopback that answers every query with [`ANSWER`], over
/// UDP and TCP on the same port, counting what it was asked.
struct Upstream {
    addr: SocketAddr,
    asked: Arc<AtomicUsize>,
}

fn answer_to(query: &[u8]) -> Vec<u8> {
    let query = Message::from_vec(query).unwrap();
    let mut response = Message::response(query.metadata.id, OpCode::Query);
    let name = query.queries[0].name().clone();
    response.add_queries(query.queries.iter().cloned());
    response.add_answer(Record::from_rdata(name, 60, RData::A(A(ANSWER))));
    response.to_vec().unwrap()
}

impl Upstream {
    async fn start() -> Self {
        let udp = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = udp.local_addr().unwrap();
        let tcp = TcpListener::bind(addr).await.unwrap();
        let asked = Arc::new(AtomicUsize::new(0));
        let counted = asked.clone();
        tokio::spawn(async move {
            let mut buffer = vec![0u8; MAX_UDP];
            while let Ok((len, client)) = udp.recv_from(&mut buffer).await {
                counted.fetch_add(1, Ordering::SeqCst);
                udp.send_to(&answer_to(&buffer[..len]), client).await.unwrap();
            }
        });
        let counted = asked.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = tcp.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                let query = read_framed(&mut stream).await.unwrap();
                write_framed(&mut stream, &answer_to(&query)).await.unwrap();
            }
        });
        Self { addr, asked }
    }

    fn asked(&self) -> usize {
        self.asked.load(Ordering::SeqCst)
    }
}

/// The tenant `acme`, whose service may reach `*.example.com` through its
/// proxy, resolving through `upstreams` on a node told of no router; and
/// what edits its upstreams.
fn tenant(upstreams: Vec<SocketAddr>) -> (TenantDns, watch::Sender<Arc<Vec<SocketAddr>>>) {
    let destination = Destination {
        listener: "tls".into(),
        protocol: ListenerProtocol::HttpsConnect as i32,
        listener_port: 3128,
        hostname: "*.example.com".into(),
        ports: vec![443],
        route: "api".into(),
    };
    let web = ServiceEgress {
        service: "web".into(),
        gateway: "default".into(),
        allowed: vec![destination],
        ..Default::default()
    };
    let plan = EgressPlan { project: "acme".into(), generation: 1, services: vec![web], ..Default::default() };
    let rules = watch::channel(Arc::new(TenantRules::compile(&plan).unwrap())).0;
    let upstreams = watch::channel(Arc::new(upstreams)).0;
    (TenantDns { rules: rules.subscribe(), upstreams: upstreams.subscribe(), services: false }, upstreams)
}

fn query(name: &str, record_type: RecordType) -> Vec<u8> {
    let mut message = Message::query();
    message.metadata.id = 4242;
    message.metadata.recursion_desired = true;
    message.add_query(Query::query(Name::from_ascii(name).unwrap(), record_type));
    message.to_vec().unwrap()
}

async fn ask(dns: &TenantDns, name: &str, transport: Transport) -> Message {
    ask_for(dns, name, RecordType::A, transport).await
}

async fn ask_for(dns: &TenantDns, name: &str, record_type: RecordType, transport: Transport) -> Message {
    let reply = answer("acme", dns, &query(name, record_type), transport).await.unwrap();
    let reply = Message::from_vec(&reply).unwrap();
    assert_eq!(reply.metadata.id, 4242, "the reply answers the query it was asked");
    reply
}

fn addresses(reply: &Message) -> Vec<Ipv4Addr> {
    reply.answers.iter().filter_map(|r| if let RData::A(A(ip)) = &r.data { Some(*ip) } else { None }).collect()
}

#[tokio::test]
async fn a_name_the_routes_allow_is_answered_by_the_upstream_over_udp_and_tcp() {
    let upstream = Upstream::start().await;
    let (dns, _) = tenant(vec![upstream.addr]);
    for transport in [Transport::Udp, Transport::Tcp] {
        let reply = ask(&dns, "api.example.com.", transport).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::NoError, "{transport:?}");
        assert_eq!(addresses(&reply), [ANSWER], "{transport:?}");
    }
    assert_eq!(upstream.asked(), 2);
}

#[tokio::test]
async fn a_refused_name_and_a_berth_name_never_leave_the_node() {
    let upstream = Upstream::start().await;
    let (dns, _) = tenant(vec![upstream.addr]);
    for name in ["evil.example.net.", "example.com.", "hello.default.berth.internal."] {
        let reply = ask(&dns, name, Transport::Udp).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::Refused, "{name}");
        assert_eq!(reply.queries.len(), 1, "the question is echoed");
        assert!(reply.answers.is_empty());
    }
    assert_eq!(upstream.asked(), 0, "nothing was forwarded");
}

#[tokio::test]
async fn upstreams_are_tried_in_order_and_an_edit_applies_to_the_next_query() {
    let upstream = Upstream::start().await;
    // A port nothing listens on: refused at once on loopback.
    let dead = UdpSocket::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
    let (dns, upstreams) = tenant(vec![]);
    let reply = ask(&dns, "api.example.com.", Transport::Udp).await;
    assert_eq!(reply.metadata.response_code, ResponseCode::Refused, "no upstream: nothing outside berth resolves");

    upstreams.send_replace(Arc::new(vec![dead, upstream.addr]));
    let reply = ask(&dns, "api.example.com.", Transport::Udp).await;
    assert_eq!(addresses(&reply), [ANSWER], "the second upstream answered");
    assert_eq!(upstream.asked(), 1);

    upstreams.send_replace(Arc::new(vec![dead]));
    let reply = ask(&dns, "api.example.com.", Transport::Udp).await;
    assert_eq!(reply.metadata.response_code, ResponseCode::ServFail, "no upstream answered");
}

#[tokio::test]
async fn what_is_no_query_is_answered_as_such_or_dropped() {
    let (dns, _) = tenant(vec![]);
    assert_eq!(answer("acme", &dns, &[7], Transport::Udp).await, None, "too short to answer");
    let garbage = answer("acme", &dns, &[0x12, 0x34, 0xff], Transport::Udp).await.unwrap();
    let garbage = Message::from_vec(&garbage).unwrap();
    assert_eq!((garbage.metadata.id, garbage.metadata.response_code), (0x1234, ResponseCode::FormErr));

    let mut response = Message::from_vec(&query("api.example.com.", RecordType::A)).unwrap();
    response.metadata.message_type = MessageType::Response;
    let reply = answer("acme", &dns, &response.to_vec().unwrap(), Transport::Udp).await.unwrap();
    assert_eq!(Message::from_vec(&reply).unwrap().metadata.response_code, ResponseCode::NotImp);
}

#[tokio::test]
async fn a_service_name_is_answered_on_the_node_with_the_way_to_the_router() {
    let upstream = Upstream::start().await;
    let (mut dns, _) = tenant(vec![upstream.addr]);
    dns.services = true;
    for transport in [Transport::Udp, Transport::Tcp] {
        for name in ["hello.default.berth.internal.", "Canary--Hello.Other.Berth.Internal."] {
            let reply = ask(&dns, name, transport).await;
            assert_eq!(reply.metadata.response_code, ResponseCode::NoError, "{name} {transport:?}");
            assert!(reply.metadata.authoritative, "berth's own zone");
            assert_eq!(addresses(&reply), [SERVICES_ADDR], "{name} {transport:?}");
            assert_eq!(reply.answers[0].name, Name::from_ascii(name).unwrap(), "the name asked for");
        }
    }
    let reply = ask_for(&dns, "hello.default.berth.internal.", RecordType::AAAA, Transport::Udp).await;
    assert_eq!(reply.metadata.response_code, ResponseCode::NoError, "the name exists");
    assert!(reply.answers.is_empty(), "with no IPv6 address");
    for name in ["berth.internal.", "default.berth.internal.", "a.b.default.berth.internal.", "x..berth.internal."] {
        let Ok(name) = Name::from_ascii(name) else { continue };
        let reply = ask(&dns, &name.to_ascii(), Transport::Udp).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::NXDomain, "{name}");
    }
    assert_eq!(upstream.asked(), 0, "berth's names never leave the node");
}
