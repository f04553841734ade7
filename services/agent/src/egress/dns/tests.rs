#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

use std::net::Ipv4Addr;

use berth_proto::egress::v1::{Destination, EgressPlan, ListenerProtocol, ServiceEgress};
use berth_testkit::{RESOLVER_ANSWER as ANSWER, Resolver};
use hickory_proto::op::Query;
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{Name, RData, RecordType};

use super::*;

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
    (TenantDns { rules: rules.subscribe(), upstreams: upstreams.subscribe(), services: None }, upstreams)
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
    let upstream = Resolver::start();
    let (dns, _) = tenant(vec![upstream.addr]);
    for transport in [Transport::Udp, Transport::Tcp] {
        let reply = ask(&dns, "api.example.com.", transport).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::NoError, "{transport:?}");
        assert_eq!(addresses(&reply), [ANSWER], "{transport:?}");
    }
    assert_eq!(upstream.asked().len(), 2);
}

#[tokio::test]
async fn a_refused_name_and_a_berth_name_never_leave_the_node() {
    let upstream = Resolver::start();
    let (dns, _) = tenant(vec![upstream.addr]);
    for name in ["evil.example.net.", "example.com.", "hello.default.berth.internal."] {
        let reply = ask(&dns, name, Transport::Udp).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::Refused, "{name}");
        assert_eq!(reply.queries.len(), 1, "the question is echoed");
        assert!(reply.answers.is_empty());
    }
    assert_eq!(upstream.asked().len(), 0, "nothing was forwarded");
}

#[tokio::test]
async fn upstreams_are_tried_in_order_and_an_edit_applies_to_the_next_query() {
    let upstream = Resolver::start();
    // A port nothing listens on: refused at once on loopback.
    let dead = UdpSocket::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
    let (dns, upstreams) = tenant(vec![]);
    let reply = ask(&dns, "api.example.com.", Transport::Udp).await;
    assert_eq!(reply.metadata.response_code, ResponseCode::Refused, "no upstream: nothing outside berth resolves");

    upstreams.send_replace(Arc::new(vec![dead, upstream.addr]));
    let reply = ask(&dns, "api.example.com.", Transport::Udp).await;
    assert_eq!(addresses(&reply), [ANSWER], "the second upstream answered");
    assert_eq!(upstream.asked().len(), 1);

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
    let upstream = Resolver::start();
    let (mut dns, _) = tenant(vec![upstream.addr]);
    dns.services = Some(SERVICES_ADDR);
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
    // A microVM guest's resolver answers with the address QEMU relays to the same place.
    dns.services = Some(std::net::Ipv4Addr::new(10, 0, 2, 100));
    let reply = ask(&dns, "hello.default.berth.internal.", Transport::Udp).await;
    assert_eq!(addresses(&reply), [std::net::Ipv4Addr::new(10, 0, 2, 100)]);
    assert_eq!(upstream.asked().len(), 0, "berth's names never leave the node");
}
