//! The node's egress proxies with plans applied the way the egress service
//! pushes them: what a replica fetches through its proxy, what it is refused
//! and why, CONNECT tunnels, live rule swaps on a listener that never
//! restarts, and tenants that each see only their own plan.
//!
//! These run without isolation (`--egress-isolation off`), so they hold on
//! any host; `egress_netns.rs` covers the network namespaces.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod egress_support;

use std::net::SocketAddr;

use berth_agent::{EgressError, EgressIsolation, EgressProxies, EgressSettings, Enforcement};
use berth_proto::egress::v1::{ListenerProtocol, ServiceEgress};
use berth_proto::types::v1::Condition;
use berth_testkit::{PATIENCE, eventually};
use tokio::io::AsyncWriteExt as _;
use tokio_util::sync::CancellationToken;

use egress_support::*;

const HTTP: ListenerProtocol = ListenerProtocol::Http;
const TLS: ListenerProtocol = ListenerProtocol::HttpsConnect;

struct Node {
    proxies: EgressProxies,
    _dir: tempfile::TempDir,
}

impl Node {
    async fn start() -> Node {
        let dir = tempfile::tempdir().unwrap();
        let settings = EgressSettings { isolation: EgressIsolation::Off, ..EgressSettings::new(dir.path()) };
        let proxies = EgressProxies::start(settings, CancellationToken::new()).await.unwrap();
        proxies.recovered().await;
        Node { proxies, _dir: dir }
    }

    /// Attaches a replica and returns its proxy's address.
    async fn replica(&self, lease_id: &str, project: &str, service: &str) -> SocketAddr {
        let attachment = self.proxies.attach(lease_id, project, service).await.unwrap();
        assert_eq!(attachment.namespace(), None, "isolation is off");
        assert_eq!(attachment.env()["HTTP_PROXY"], format!("http://{}", attachment.proxy_addr()));
        attachment.proxy_addr()
    }
}

#[tokio::test]
async fn an_allowed_fetch_goes_through_and_a_refused_one_is_answered_403_naming_the_rule() {
    let origin = Origin::start("127.0.0.1", "origin").await;
    let admin = Origin::start("127.0.0.1", "admin").await;
    let node = Node::start().await;
    assert!(matches!(node.proxies.enforcement(), Enforcement::Advisory { .. }));
    let proxy = node.replica("lease-1", "acme", "web").await;
    let web = service(
        "web",
        vec![dest("allow-local", HTTP, "127.0.0.1", &[])],
        vec![dest("no-admin", HTTP, "127.0.0.1", &[admin.port()])],
    );
    node.proxies.apply(&node_state(1, vec![plan("acme", 3, vec![web])])).await.unwrap();

    let url = format!("http://127.0.0.1:{}/path?q=1", origin.port());
    let fetched = get_via(proxy, &url).await;
    assert_eq!(fetched, Answer { status: 200, body: "hello from origin".into() });
    let head = origin.heads.lock().unwrap()[0].clone();
    assert!(head.starts_with("GET /path?q=1 HTTP/1.1\r\n"), "sent on in origin form: {head}");
    assert!(head.contains(&format!("Host: 127.0.0.1:{}\r\n", origin.port())), "{head}");
    assert!(head.contains("Connection: close\r\n"), "{head}");

    let denied = get_via(proxy, &format!("http://127.0.0.1:{}/", admin.port())).await;
    assert_eq!(denied.status, 403);
    assert_eq!(
        denied.body,
        format!("berth egress: route no-admin denies 127.0.0.1:{} for service web\n", admin.port())
    );
    assert_eq!(admin.requests(), 0, "a denied request never reaches its destination");

    let unrouted = get_via(proxy, &format!("http://127.0.0.2:{}/", origin.port())).await;
    assert_eq!(unrouted.status, 403);
    assert_eq!(
        unrouted.body,
        format!("berth egress: no route allows 127.0.0.2:{} for service web (HTTP)\n", origin.port())
    );
    node.proxies.close().await;
}

#[tokio::test]
async fn connect_tunnels_what_a_route_allows_and_refuses_the_rest() {
    let origin = Origin::start("127.0.0.1", "tunnelled").await;
    let other = Origin::start("127.0.0.1", "other").await;
    let node = Node::start().await;
    let proxy = node.replica("lease-1", "acme", "web").await;
    let web = service(
        "web",
        vec![dest("tls-out", TLS, "127.0.0.1", &[origin.port()]), dest("plain", HTTP, "127.0.0.1", &[other.port()])],
        vec![],
    );
    node.proxies.apply(&node_state(1, vec![plan("acme", 1, vec![web])])).await.unwrap();

    let mut tunnel = connect_via(proxy, &format!("127.0.0.1:{}", origin.port())).await.unwrap();
    let inside = get_on(&mut tunnel, "/").await;
    assert_eq!(inside, Answer { status: 200, body: "hello from tunnelled".into() }, "bytes relayed both ways");

    let refused = connect_via(proxy, &format!("127.0.0.1:{}", other.port())).await.unwrap_err();
    assert_eq!(refused.status, 403, "an HTTP listener's route does not allow CONNECT");
    assert_eq!(
        refused.body,
        format!("berth egress: no route allows 127.0.0.1:{} for service web (CONNECT)\n", other.port())
    );
    assert_eq!(other.requests(), 0);
    node.proxies.close().await;
}

#[tokio::test]
async fn a_new_plan_takes_effect_on_the_next_request_without_restarting_the_listener() {
    let origin = Origin::start("127.0.0.1", "origin").await;
    let node = Node::start().await;
    let proxy = node.replica("lease-1", "acme", "web").await;
    let url = format!("http://127.0.0.1:{}/", origin.port());
    let allow = |generation| {
        node_state(
            generation,
            vec![plan("acme", generation, vec![service("web", vec![dest("r1", HTTP, "127.0.0.1", &[])], vec![])])],
        )
    };
    node.proxies.apply(&allow(1)).await.unwrap();
    assert_eq!(get_via(proxy, &url).await.status, 200);

    // A replica connected before the swap, and asks after it.
    let mut early = tokio::net::TcpStream::connect(proxy).await.unwrap();
    let deny = node_state(
        2,
        vec![plan(
            "acme",
            2,
            vec![service(
                "web",
                vec![dest("r1", HTTP, "127.0.0.1", &[])],
                vec![dest("lockdown", HTTP, "127.0.0.1", &[])],
            )],
        )],
    );
    node.proxies.apply(&deny).await.unwrap();
    assert_eq!(node.proxies.status().borrow().applied, Some(2));
    let answer = get_on(&mut early, &url).await;
    assert_eq!(answer.status, 403, "the connection accepted before the swap is decided by the new rules");
    assert!(answer.body.contains("route lockdown denies"), "{}", answer.body);
    assert_eq!(get_via(proxy, &url).await.status, 403);

    node.proxies.apply(&allow(3)).await.unwrap();
    assert_eq!(get_via(proxy, &url).await.status, 200);
    let again = node.proxies.attach("lease-2", "acme", "web").await.unwrap();
    assert_eq!(again.proxy_addr(), proxy, "the same listener throughout");
    node.proxies.close().await;
}

#[tokio::test]
async fn two_tenants_each_see_only_their_own_policy() {
    let a_site = Origin::start("127.0.0.1", "a-site").await;
    let b_site = Origin::start("127.0.0.1", "b-site").await;
    let node = Node::start().await;
    let acme = node.replica("lease-a", "acme", "web").await;
    let globex = node.replica("lease-b", "globex", "web").await;
    assert_ne!(acme, globex, "one listener per tenant and service");
    let state = node_state(
        5,
        vec![
            plan("acme", 1, vec![service("web", vec![dest("to-a", HTTP, "127.0.0.1", &[a_site.port()])], vec![])]),
            plan("globex", 1, vec![service("web", vec![dest("to-b", HTTP, "127.0.0.1", &[b_site.port()])], vec![])]),
        ],
    );
    node.proxies.apply(&state).await.unwrap();
    let (a_url, b_url) =
        (format!("http://127.0.0.1:{}/", a_site.port()), format!("http://127.0.0.1:{}/", b_site.port()));
    assert_eq!(get_via(acme, &a_url).await.body, "hello from a-site");
    assert_eq!(get_via(acme, &b_url).await.status, 403);
    assert_eq!(get_via(globex, &b_url).await.body, "hello from b-site");
    assert_eq!(get_via(globex, &a_url).await.status, 403);

    // A state without globex: its replica still runs, and is refused everything.
    let only_acme = node_state(
        6,
        vec![plan("acme", 1, vec![service("web", vec![dest("to-a", HTTP, "127.0.0.1", &[a_site.port()])], vec![])])],
    );
    node.proxies.apply(&only_acme).await.unwrap();
    let withdrawn = get_via(globex, &b_url).await;
    assert_eq!(withdrawn.status, 403);
    assert!(withdrawn.body.contains("project globex has no egress plan on this node"), "{}", withdrawn.body);
    assert_eq!(get_via(acme, &a_url).await.status, 200);

    // Its last replica gone, globex's proxy stops; acme's is untouched.
    node.proxies.detach("lease-b").await;
    eventually("globex's listener to close", PATIENCE, || async {
        match tokio::net::TcpStream::connect(globex).await {
            Ok(_) => Err(format!("{globex} still accepts connections")),
            Err(_) => Ok(()),
        }
    })
    .await;
    assert_eq!(get_via(acme, &a_url).await.status, 200);
    node.proxies.close().await;
}

#[tokio::test]
async fn services_of_one_tenant_are_held_to_their_own_rules_and_disabled_egress_refuses_everything() {
    let origin = Origin::start("127.0.0.1", "origin").await;
    let node = Node::start().await;
    let web = node.replica("lease-w", "", "web").await;
    let batch = node.replica("lease-b", "default", "batch").await;
    assert_ne!(web, batch);
    let url = format!("http://127.0.0.1:{}/", origin.port());

    let before = get_via(web, &url).await;
    assert_eq!(before.status, 403);
    assert!(before.body.contains("no egress plan of project default has reached this node yet"), "{}", before.body);

    let disabled = ServiceEgress {
        service: "batch".into(),
        condition: Some(Condition { r#type: "Ready".into(), reason: "GatewayNotFound".into(), ..Default::default() }),
        ..Default::default()
    };
    let state = node_state(
        1,
        vec![plan("", 1, vec![disabled, service("web", vec![dest("r", HTTP, "127.0.0.1", &[])], vec![])])],
    );
    node.proxies.apply(&state).await.unwrap();
    assert_eq!(get_via(web, &url).await.status, 200);
    let refused = get_via(batch, &url).await;
    assert_eq!(refused.status, 403);
    assert!(refused.body.contains("egress is disabled for service batch (GatewayNotFound)"), "{}", refused.body);
    node.proxies.close().await;
}

#[tokio::test]
async fn a_state_with_one_bad_plan_is_refused_whole_and_the_rules_in_force_stay() {
    let origin = Origin::start("127.0.0.1", "origin").await;
    let node = Node::start().await;
    let proxy = node.replica("lease-1", "acme", "web").await;
    let url = format!("http://127.0.0.1:{}/", origin.port());
    let good = plan("acme", 1, vec![service("web", vec![dest("r", HTTP, "127.0.0.1", &[])], vec![])]);
    node.proxies.apply(&node_state(1, vec![good.clone()])).await.unwrap();

    let locked = plan("acme", 2, vec![service("web", vec![], vec![])]);
    let broken = plan("globex", 1, vec![service("web", vec![dest("oops", HTTP, "*.", &[])], vec![])]);
    let error = node.proxies.apply(&node_state(2, vec![locked, broken])).await.unwrap_err();
    assert!(matches!(error, EgressError::Plan(_)), "{error}");
    assert!(error.to_string().contains("route oops"), "{error}");
    assert_eq!(get_via(proxy, &url).await.status, 200, "acme's part of the refused state was not applied either");
    let status = node.proxies.status().borrow().clone();
    assert_eq!(status.applied, Some(1));
    assert!(status.error.unwrap().contains("route oops"));

    let twice = node.proxies.apply(&node_state(3, vec![good.clone(), good])).await.unwrap_err();
    assert!(matches!(twice, EgressError::DuplicateTenant(ref p) if p == "acme"), "{twice}");
    node.proxies.close().await;
}

#[tokio::test]
async fn what_is_not_a_proxy_request_is_answered_400() {
    let node = Node::start().await;
    let proxy = node.replica("lease-1", "acme", "web").await;
    let mut stream = tokio::net::TcpStream::connect(proxy).await.unwrap();
    stream.write_all(b"GET /index.html HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let answer = read_answer(&mut stream).await;
    assert_eq!(answer.status, 400);
    assert!(answer.body.contains("absolute form"), "{}", answer.body);
    node.proxies.close().await;
}

#[tokio::test]
async fn a_restarted_node_opens_each_services_proxy_where_its_replicas_were_told_it_is() {
    let dir = tempfile::tempdir().unwrap();
    let settings = EgressSettings { isolation: EgressIsolation::Off, ..EgressSettings::new(dir.path()) };
    let first = EgressProxies::start(settings.clone(), CancellationToken::new()).await.unwrap();
    first.recovered().await;
    let before = first.attach("lease-1", "acme", "web").await.unwrap();
    first.close().await;

    let second = EgressProxies::start(settings, CancellationToken::new()).await.unwrap();
    let after = second.attach("lease-1", "acme", "web").await.unwrap();
    second.recovered().await;
    assert_eq!(after.proxy_addr(), before.proxy_addr(), "the adopted replica's HTTP_PROXY still points at it");
    second.close().await;
}

#[test]
fn the_agent_documents_its_egress_flags() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_berth-agent")).arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for text in ["--egress-addr", "BERTH_EGRESS_ADDR", "--egress-isolation", "BERTH_EGRESS_ISOLATION", "advisory"] {
        assert!(help.contains(text), "{text} missing from --help:\n{help}");
    }
}
