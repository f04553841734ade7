//! Network namespaces, where the agent runs as root on Linux: a program in
//! its tenant's namespace that ignores the proxy variables reaches nothing,
//! neither the host's loopback nor its other addresses, while through the
//! proxy it reaches what the plan allows; one tenant's proxies do not exist
//! in another's namespace; two agents on one host never share a namespace;
//! and namespaces no process uses are removed. Inside, names resolve only
//! as the tenant's routes allow, and services' internal names lead to the
//! router.
//!
//! Every test here needs root and `ip` (and `curl`, `sleep`); without them
//! it says so and passes without checking anything, except under `CI=true`,
//! where it fails.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod egress_support;

use std::net::{IpAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::Output;

use berth_agent::{Attachment, EgressIsolation, EgressProxies, EgressSettings, Enforcement};
use berth_proto::egress::v1::ListenerProtocol;
use tokio_util::sync::CancellationToken;

use egress_support::*;

const HTTP: ListenerProtocol = ListenerProtocol::Http;
const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Whether this host can run these tests; says why not when it cannot.
fn isolation_possible() -> bool {
    let missing: Vec<&str> = ["/usr/bin/curl", "/bin/sleep"].into_iter().filter(|t| !Path::new(t).exists()).collect();
    berth_testkit::runs_as_root("network namespaces")
        && berth_testkit::needs(missing.is_empty(), &format!("{missing:?}"))
}

async fn isolated(dir: &Path) -> EgressProxies {
    isolated_until(dir, CancellationToken::new()).await
}

async fn isolated_until(dir: &Path, shutdown: CancellationToken) -> EgressProxies {
    let settings = EgressSettings { isolation: EgressIsolation::Required, ..EgressSettings::new(dir) };
    let proxies = EgressProxies::start(settings, shutdown).await.unwrap();
    assert_eq!(proxies.enforcement(), Enforcement::Isolated);
    proxies
}

fn netns_path(name: &str) -> PathBuf {
    Path::new("/run/netns").join(name)
}

/// Runs `program` the way a replica runs: in its namespace, with the
/// environment it is given.
async fn run_as_replica(attachment: &Attachment, program: &str, args: &[&str]) -> Output {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let (program, args) = attachment.command(program, &args);
    tokio::process::Command::new(program)
        .args(args)
        .env_clear()
        .env("PATH", PATH)
        .envs(attachment.env())
        .output()
        .await
        .unwrap()
}

/// `curl` as a replica: prints the body and the status code, or fails to
/// connect. A replica's `NO_PROXY` keeps loopback away from the proxy, so a
/// request for a loopback origin through the proxy passes `--noproxy ""`.
async fn curl(attachment: &Attachment, extra: &[&str], url: &str) -> Output {
    let mut args = vec!["-sS", "--max-time", "5", "-o", "/dev/stdout", "-w", "\nstatus=%{http_code}"];
    args.extend_from_slice(extra);
    args.push(url);
    run_as_replica(attachment, "curl", &args).await
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The host's address on its default route, when it has one.
fn host_address() -> Option<IpAddr> {
    let socket = UdpSocket::bind("0.0.0.0:0").ok()?;
    socket.connect("203.0.113.1:9").ok()?;
    Some(socket.local_addr().ok()?.ip()).filter(|ip| !ip.is_loopback())
}

#[tokio::test]
async fn a_replica_that_ignores_the_proxy_reaches_nothing_and_through_it_reaches_what_the_plan_allows() {
    if !isolation_possible() {
        return;
    }
    let origin = Origin::start("0.0.0.0", "origin").await;
    let dir = tempfile::tempdir().unwrap();
    let proxies = isolated(dir.path()).await;
    let replica = proxies.attach("lease-1", "acme", "web").await.unwrap();
    let namespace = replica.namespace().unwrap().to_string();
    assert!(netns_path(&namespace).exists());
    let state =
        node_state(1, vec![plan("acme", 1, vec![service("web", vec![dest("local", HTTP, "127.0.0.1", &[])], vec![])])]);
    proxies.apply(&state).await.unwrap();

    let loopback = format!("http://127.0.0.1:{}/", origin.port());
    let direct = curl(&replica, &["--noproxy", "*"], &loopback).await;
    assert!(!direct.status.success(), "the host's loopback is not the namespace's: {}", stdout(&direct));
    if let Some(host) = host_address() {
        let direct = curl(&replica, &["--noproxy", "*"], &format!("http://{host}:{}/", origin.port())).await;
        assert!(!direct.status.success(), "the host's own address is unreachable: {}", stdout(&direct));
    } else {
        eprintln!("this host has no default route; only its loopback was tried directly");
    }
    assert_eq!(origin.requests(), 0, "nothing reached the host directly");

    let proxied = curl(&replica, &["--noproxy", "", "-x", &replica.proxy_url()], &loopback).await;
    assert!(proxied.status.success(), "{proxied:?}");
    assert_eq!(stdout(&proxied), "hello from origin\nstatus=200");
    assert_eq!(origin.requests(), 1);

    // The proxy variables are what the replica uses by default.
    let refused = curl(&replica, &[], &format!("http://example.invalid:{}/", origin.port())).await;
    assert!(stdout(&refused).ends_with("status=403"), "{}", stdout(&refused));
    assert!(stdout(&refused).contains("no route allows example.invalid"), "{}", stdout(&refused));

    proxies.close().await;
    assert!(!netns_path(&namespace).exists(), "a namespace no process uses is removed at close");
}

#[tokio::test]
async fn one_tenants_proxies_do_not_exist_in_another_tenants_namespace() {
    if !isolation_possible() {
        return;
    }
    let origin = Origin::start("127.0.0.1", "origin").await;
    let dir = tempfile::tempdir().unwrap();
    let proxies = isolated(dir.path()).await;
    let acme_web = proxies.attach("lease-1", "acme", "web").await.unwrap();
    let acme_api = proxies.attach("lease-2", "acme", "api").await.unwrap();
    let globex = proxies.attach("lease-3", "globex", "web").await.unwrap();
    assert_ne!(acme_web.namespace(), globex.namespace());
    assert_ne!(acme_web.proxy_addr(), acme_api.proxy_addr());
    let allow = vec![dest("local", HTTP, "127.0.0.1", &[])];
    let state = node_state(
        1,
        vec![
            plan("acme", 1, vec![service("web", allow.clone(), vec![]), service("api", allow, vec![])]),
            plan("globex", 1, vec![service("web", vec![], vec![])]),
        ],
    );
    proxies.apply(&state).await.unwrap();
    let url = format!("http://127.0.0.1:{}/", origin.port());

    assert!(
        stdout(&curl(&acme_api, &["--noproxy", "", "-x", &acme_api.proxy_url()], &url).await).ends_with("status=200")
    );
    // From globex's namespace, acme's second proxy is not there at all...
    let absent = curl(&globex, &["--noproxy", "", "-x", &acme_api.proxy_url()], &url).await;
    assert!(!absent.status.success(), "acme's proxy answered in globex's namespace: {}", stdout(&absent));
    // ...and what answers on globex's own port holds globex's plan.
    let own = curl(&globex, &["--noproxy", "", "-x", &globex.proxy_url()], &url).await;
    assert!(stdout(&own).ends_with("status=403"), "{}", stdout(&own));
    assert!(stdout(&own).contains("for service web"), "{}", stdout(&own));
    assert_eq!(origin.requests(), 1, "only acme's request went out");
    proxies.close().await;
}

#[tokio::test]
async fn two_agents_on_one_host_never_share_or_remove_each_others_namespaces() {
    if !isolation_possible() {
        return;
    }
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (a, b) = (isolated(dir_a.path()).await, isolated(dir_b.path()).await);
    let on_a = a.attach("lease-1", "acme", "web").await.unwrap();
    let on_b = b.attach("lease-1", "acme", "web").await.unwrap();
    let (ns_a, ns_b) = (on_a.namespace().unwrap().to_string(), on_b.namespace().unwrap().to_string());
    assert_ne!(ns_a, ns_b);
    assert!(netns_path(&ns_a).exists() && netns_path(&ns_b).exists());

    // A third agent starting sweeps only what is unused and not owned by a live agent.
    let dir_c = tempfile::tempdir().unwrap();
    let c = isolated(dir_c.path()).await;
    assert!(netns_path(&ns_a).exists() && netns_path(&ns_b).exists(), "another agent's namespaces are left alone");
    c.close().await;

    a.close().await;
    assert!(!netns_path(&ns_a).exists());
    assert!(netns_path(&ns_b).exists(), "closing one agent leaves the other's namespace");
    b.close().await;
    assert!(!netns_path(&ns_b).exists());
}

#[tokio::test]
async fn a_namespace_a_process_still_uses_survives_a_restart_and_an_unused_one_is_swept() {
    if !isolation_possible() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let crash = CancellationToken::new();
    let first = isolated_until(dir.path(), crash.clone()).await;
    let replica = first.attach("lease-1", "acme", "web").await.unwrap();
    let idle = first.attach("lease-2", "idle-tenant", "web").await.unwrap();
    let (kept, swept) = (replica.namespace().unwrap().to_string(), idle.namespace().unwrap().to_string());
    let (program, args) = replica.command("sleep", &["1000".to_string()]);
    let mut workload = tokio::process::Command::new(program).args(args).kill_on_drop(true).spawn().unwrap();
    // The agent dies without cleaning anything up: its sockets close with it.
    crash.cancel();
    drop(first);
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;

    let second = isolated(dir.path()).await;
    assert!(netns_path(&kept).exists(), "the workload's namespace outlives the agent");
    assert!(!netns_path(&swept).exists(), "a namespace no process uses is swept at start");
    let adopted = second.attach("lease-1", "acme", "web").await.unwrap();
    assert_eq!(adopted.namespace(), Some(kept.as_str()));
    assert_eq!(adopted.proxy_addr(), replica.proxy_addr(), "the same proxy port as the replica was given");
    second.recovered().await;

    workload.kill().await.unwrap();
    workload.wait().await.unwrap();
    second.detach("lease-1").await;
    assert!(!netns_path(&kept).exists(), "the tenant left the node with its last replica");
    second.close().await;
}

#[tokio::test]
async fn a_replica_resolves_what_its_routes_allow_through_its_projects_upstream_and_nothing_else() {
    if !isolation_possible() {
        return;
    }
    let resolver = berth_testkit::Resolver::start();
    let (upstream, asked) = (resolver.addr, || resolver.asked().len());
    let dir = tempfile::tempdir().unwrap();
    let proxies = isolated(dir.path()).await;
    let replica = proxies.attach("lease-1", "acme", "web").await.unwrap();
    let connect = ListenerProtocol::HttpsConnect;
    let with_upstreams = |generation, upstreams: Vec<String>| {
        let mut plan =
            plan("acme", generation, vec![service("web", vec![dest("api", connect, "*.example.com", &[443])], vec![])]);
        plan.dns = Some(berth_proto::egress::v1::DnsConfig { upstreams, search: vec![], ndots: Some(1) });
        node_state(generation, vec![plan])
    };
    proxies.apply(&with_upstreams(1, vec![upstream.to_string()])).await.unwrap();
    let nslookup = |name: &'static str| {
        let replica = &replica;
        async move { stdout(&run_as_replica(replica, "busybox", &["nslookup", name, "127.0.0.53"]).await) }
    };

    let resolved = nslookup("api.example.com").await;
    assert!(resolved.contains("192.0.2.10"), "resolved through the project's upstream: {resolved}");
    let forwarded = asked();
    assert!(forwarded >= 1, "the upstream was asked");

    let refused = nslookup("evil.example.net").await;
    assert!(refused.contains("REFUSED"), "no route reaches it, so it does not resolve: {refused}");
    assert_eq!(asked(), forwarded, "a refused name never left the node");

    // An edit applies to the next query, with nothing restarted.
    proxies.apply(&with_upstreams(2, Vec::new())).await.unwrap();
    let unresolved = nslookup("api.example.com").await;
    assert!(unresolved.contains("REFUSED"), "no upstream any more: {unresolved}");
    proxies.close().await;
}

/// An HTTP server on the host's loopback that answers every request with
/// the `Host` it was sent to: the router.
async fn router_echoing_hosts() -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buffer = [0u8; 1024];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buffer).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&buffer[..n]),
                    }
                }
                let request = String::from_utf8_lossy(&request).to_ascii_lowercase();
                let host = request.lines().find_map(|l| l.strip_prefix("host: ")).unwrap_or("").trim().to_string();
                let body = format!("router saw {host}\n");
                let response = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}", body.len());
                let _ = stream.write_all(response.as_bytes()).await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn a_replica_reaches_a_service_by_its_internal_name_through_the_router() {
    if !isolation_possible() {
        return;
    }
    let router = router_echoing_hosts().await;
    let dir = tempfile::tempdir().unwrap();
    let settings = EgressSettings {
        isolation: EgressIsolation::Required,
        router: Some(router.to_string()),
        ..EgressSettings::new(dir.path())
    };
    let proxies = EgressProxies::start(settings, CancellationToken::new()).await.unwrap();
    let replica = proxies.attach("lease-1", "acme", "web").await.unwrap();
    proxies.apply(&node_state(1, vec![plan("acme", 1, vec![service("web", vec![], vec![])])])).await.unwrap();

    let looked_up =
        stdout(&run_as_replica(&replica, "busybox", &["nslookup", "hello.default.berth.internal", "127.0.0.53"]).await);
    assert!(looked_up.contains("127.0.0.54"), "the name leads to the way to the router: {looked_up}");
    let nothing =
        stdout(&run_as_replica(&replica, "busybox", &["nslookup", "default.berth.internal", "127.0.0.53"]).await);
    assert!(nothing.contains("NXDOMAIN"), "not a service's name: {nothing}");

    // Where that address leads: the router, which reads the service from the name.
    let served = stdout(
        &run_as_replica(
            &replica,
            "curl",
            &[
                "-sS",
                "--max-time",
                "5",
                "--resolve",
                "hello.default.berth.internal:80:127.0.0.54",
                "http://hello.default.berth.internal/",
            ],
        )
        .await,
    );
    assert_eq!(served.trim(), "router saw hello.default.berth.internal", "through the router: {served}");
    let env = replica.env();
    assert!(
        env["NO_PROXY"].split(',').any(|d| d == ".berth.internal"),
        "services are reached directly, not through the proxy"
    );
    proxies.close().await;
}
