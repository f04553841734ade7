//! The compile as a user reads its output: what each service may reach and
//! why, and each gateway's and route's status, over a table of selections,
//! gateways and routes; and the same output whatever order the inputs come in.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

use berth_egress::{
    CompiledPlan, EgressReadiness, GatewaySpec, HostPattern, ListenerSpec, ParentSpec, ParentVerdict, PlanInputs,
    Protocol, RouteAction, RouteSpec, Selection, ServiceInput, compile,
};
use rand::SeedableRng as _;
use rand::seq::SliceRandom as _;

fn listener(name: &str, protocol: Protocol, port: u16) -> ListenerSpec {
    ListenerSpec { name: name.into(), protocol, port }
}

fn gateway(name: &str, listeners: Vec<ListenerSpec>) -> GatewaySpec {
    GatewaySpec { name: name.into(), generation: 1, listeners }
}

/// The usual gateway: an HTTP and an HTTPS CONNECT listener, and a TCP one.
fn full_gateway(name: &str) -> GatewaySpec {
    gateway(
        name,
        vec![
            listener("http", Protocol::Http, 3128),
            listener("https", Protocol::HttpsConnect, 3129),
            listener("db", Protocol::Tcp, 5432),
        ],
    )
}

fn parent(gateway: &str, listener: Option<&str>) -> ParentSpec {
    ParentSpec { gateway: gateway.into(), listener: listener.map(str::to_owned) }
}

fn route(name: &str, parents: Vec<ParentSpec>, hosts: &[&str], ports: &[u16], action: RouteAction) -> RouteSpec {
    RouteSpec {
        name: name.into(),
        generation: 1,
        parents,
        hostnames: hosts.iter().map(|h| HostPattern::parse(h).unwrap()).collect(),
        ports: ports.to_vec(),
        action,
    }
}

fn web(selection: Selection) -> ServiceInput {
    ServiceInput { service: "web".into(), selection }
}

fn default_gateway() -> Selection {
    Selection::Gateway("default".into())
}

/// `listener/host` of each destination, as a user scans them.
fn shown(destinations: &[berth_egress::Destination]) -> Vec<String> {
    destinations.iter().map(|d| format!("{}/{}", d.listener, d.hostname)).collect()
}

struct Case {
    what: &'static str,
    selection: Selection,
    gateways: Vec<GatewaySpec>,
    routes: Vec<RouteSpec>,
    gateway: Option<&'static str>,
    readiness: EgressReadiness,
    allowed: Vec<&'static str>,
    denied: Vec<&'static str>,
}

#[test]
fn each_selection_resolves_to_what_its_gateway_and_routes_allow() {
    let allow = RouteAction::Allow;
    let deny = RouteAction::Deny;
    let cases = vec![
        Case {
            what: "no selection takes the default gateway; an exact host on one listener",
            selection: default_gateway(),
            gateways: vec![full_gateway("default")],
            routes: vec![route("api", vec![parent("default", Some("https"))], &["api.example.com"], &[443], allow)],
            gateway: Some("default"),
            readiness: EgressReadiness::Accepted,
            allowed: vec!["https/api.example.com"],
            denied: vec![],
        },
        Case {
            what: "a parent with no listener names every listener that can carry it; a wildcard skips TCP",
            selection: default_gateway(),
            gateways: vec![full_gateway("default")],
            routes: vec![route("all", vec![parent("default", None)], &["*.example.com"], &[], allow)],
            gateway: Some("default"),
            readiness: EgressReadiness::Accepted,
            allowed: vec!["http/*.example.com", "https/*.example.com"],
            denied: vec![],
        },
        Case {
            what: "a named gateway, not the default",
            selection: Selection::Gateway("corp".into()),
            gateways: vec![full_gateway("default"), full_gateway("corp")],
            routes: vec![
                route("on-default", vec![parent("default", Some("http"))], &["a.example.com"], &[], allow),
                route("on-corp", vec![parent("corp", Some("http"))], &["b.example.com"], &[], allow),
            ],
            gateway: Some("corp"),
            readiness: EgressReadiness::Accepted,
            allowed: vec!["http/b.example.com"],
            denied: vec![],
        },
        Case {
            what: "the selected gateway does not exist",
            selection: Selection::Gateway("corp".into()),
            gateways: vec![full_gateway("default")],
            routes: vec![route("api", vec![parent("default", None)], &["api.example.com"], &[], allow)],
            gateway: None,
            readiness: EgressReadiness::GatewayNotFound("corp".into()),
            allowed: vec![],
            denied: vec![],
        },
        Case {
            what: "no gateway at all: the default one is missing",
            selection: default_gateway(),
            gateways: vec![],
            routes: vec![],
            gateway: None,
            readiness: EgressReadiness::GatewayNotFound("default".into()),
            allowed: vec![],
            denied: vec![],
        },
        Case {
            what: "disabled: nothing leaves, whatever the default gateway allows",
            selection: Selection::Disabled,
            gateways: vec![full_gateway("default")],
            routes: vec![route("api", vec![parent("default", None)], &["api.example.com"], &[], allow)],
            gateway: None,
            readiness: EgressReadiness::Disabled,
            allowed: vec![],
            denied: vec![],
        },
        Case {
            what: "a route to a listener the gateway lacks attaches nowhere",
            selection: default_gateway(),
            gateways: vec![full_gateway("default")],
            routes: vec![route("api", vec![parent("default", Some("smtp"))], &["api.example.com"], &[], allow)],
            gateway: Some("default"),
            readiness: EgressReadiness::NoRoutes,
            allowed: vec![],
            denied: vec![],
        },
        Case {
            what: "only a denial: nothing is allowed",
            selection: default_gateway(),
            gateways: vec![full_gateway("default")],
            routes: vec![route("no-ads", vec![parent("default", Some("http"))], &["*.ads.example"], &[], deny)],
            gateway: Some("default"),
            readiness: EgressReadiness::NoRoutes,
            allowed: vec![],
            denied: vec!["http/*.ads.example"],
        },
        Case {
            what: "allow and deny side by side, sorted by listener then host",
            selection: default_gateway(),
            gateways: vec![full_gateway("default")],
            routes: vec![
                route(
                    "b-allow",
                    vec![parent("default", Some("https"))],
                    &["*.example.com", "example.com"],
                    &[443],
                    allow,
                ),
                route("a-deny", vec![parent("default", Some("https"))], &["secret.example.com"], &[], deny),
                route("c-db", vec![parent("default", Some("db"))], &["db.internal"], &[5432], allow),
            ],
            gateway: Some("default"),
            readiness: EgressReadiness::Accepted,
            allowed: vec!["db/db.internal", "https/*.example.com", "https/example.com"],
            denied: vec!["https/secret.example.com"],
        },
    ];
    for case in cases {
        let inputs = PlanInputs { services: vec![web(case.selection)], gateways: case.gateways, routes: case.routes };
        let plan = compile(&inputs);
        let service = &plan.services[0];
        assert_eq!(service.gateway.as_deref(), case.gateway, "{}", case.what);
        assert_eq!(service.readiness, case.readiness, "{}", case.what);
        assert_eq!(shown(&service.destinations.allowed), case.allowed, "{}", case.what);
        assert_eq!(shown(&service.destinations.denied), case.denied, "{}", case.what);
    }
}

#[test]
fn a_denial_wins_where_it_overlaps_and_wildcards_match_subdomains_only() {
    let inputs = PlanInputs {
        services: vec![web(default_gateway())],
        gateways: vec![full_gateway("default")],
        routes: vec![
            route("allow", vec![parent("default", Some("https"))], &["*.example.com"], &[443], RouteAction::Allow),
            route("deny", vec![parent("default", Some("https"))], &["admin.example.com"], &[], RouteAction::Deny),
        ],
    };
    let plan = compile(&inputs);
    let web = &plan.services[0];
    assert!(web.admits("https", "api.example.com", 443));
    assert!(web.admits("https", "a.b.example.com", 443));
    assert!(!web.admits("https", "example.com", 443), "a wildcard matches subdomains only");
    assert!(!web.admits("https", "api.example.com", 80), "only the ports the route names");
    assert!(!web.admits("https", "admin.example.com", 443), "the denial wins");
    assert!(!web.admits("http", "api.example.com", 443), "only through the listener the route attached to");
}

#[test]
fn routes_report_why_each_parent_did_or_did_not_take_them() {
    let allow = RouteAction::Allow;
    let inputs = PlanInputs {
        services: vec![],
        gateways: vec![full_gateway("default")],
        routes: vec![
            route("a-db", vec![parent("default", Some("db"))], &["db.internal"], &[5432], allow),
            route("b-db", vec![parent("default", Some("db"))], &["other.internal"], &[5432], allow),
            route("ghost", vec![parent("nowhere", None)], &["x.example.com"], &[], allow),
            route("no-port", vec![parent("default", Some("db"))], &["db.internal"], &[], allow),
            route("smtp", vec![parent("default", Some("smtp"))], &["mail.example.com"], &[25], allow),
            route("wild-db", vec![parent("default", Some("db"))], &["*.internal"], &[5432], allow),
            route(
                "two-parents",
                vec![parent("default", None), parent("default", Some("db"))],
                &["*.example.com"],
                &[],
                allow,
            ),
        ],
    };
    let plan = compile(&inputs);
    let verdict = |route: &str, n: usize| {
        let route = plan.routes.iter().find(|r| r.name == route).unwrap();
        route.parents[n].verdict.clone()
    };
    assert_eq!(verdict("a-db", 0), ParentVerdict::Accepted { listeners: vec!["db".into()] });
    assert!(
        matches!(verdict("b-db", 0), ParentVerdict::NotAllowedByListeners { message } if message.contains("already carries route a-db"))
    );
    assert!(
        matches!(verdict("ghost", 0), ParentVerdict::NoMatchingParent { message } if message.contains("gateway nowhere"))
    );
    assert!(
        matches!(verdict("no-port", 0), ParentVerdict::NotAllowedByListeners { message } if message.contains("exactly one port"))
    );
    assert!(
        matches!(verdict("smtp", 0), ParentVerdict::NoMatchingParent { message } if message.contains("no listener smtp"))
    );
    assert!(
        matches!(verdict("wild-db", 0), ParentVerdict::NotAllowedByListeners { message } if message.contains("no wildcard"))
    );
    assert_eq!(verdict("two-parents", 0), ParentVerdict::Accepted { listeners: vec!["http".into(), "https".into()] });
    assert!(matches!(verdict("two-parents", 1), ParentVerdict::NotAllowedByListeners { .. }));
    for route in &plan.routes {
        for parent in &route.parents {
            let reason = parent.verdict.reason();
            assert!(["Accepted", "NoMatchingParent", "NotAllowedByListeners"].contains(&reason), "{reason}");
        }
    }

    let gateway = &plan.gateways[0];
    let attached: Vec<(&str, u32)> = gateway.listeners.iter().map(|l| (l.name.as_str(), l.attached_routes)).collect();
    assert_eq!(attached, [("http", 1), ("https", 1), ("db", 1)]);
    assert_eq!(gateway.attached_routes, 2, "a-db and two-parents");
    assert_eq!(gateway.listeners[2].conflicts, ["b-db"]);
}

#[test]
fn a_deny_route_on_tcp_needs_the_same_shape_but_no_slot() {
    let inputs = PlanInputs {
        services: vec![web(default_gateway())],
        gateways: vec![full_gateway("default")],
        routes: vec![
            route("allow-db", vec![parent("default", Some("db"))], &["db.internal"], &[5432], RouteAction::Allow),
            route("deny-db", vec![parent("default", Some("db"))], &["db.internal"], &[5432], RouteAction::Deny),
        ],
    };
    let plan = compile(&inputs);
    assert!(plan.routes.iter().all(|r| r.parents[0].verdict.accepted()));
    assert!(!plan.services[0].admits("db", "db.internal", 5432), "the denial wins on the TCP listener too");
}

/// A tenant with `n` of everything, some of each kind of mistake among them.
fn sample(rng: &mut rand::rngs::StdRng, n: usize) -> PlanInputs {
    use rand::Rng as _;
    let protocols = [Protocol::Http, Protocol::HttpsConnect, Protocol::Tcp];
    let gateways: Vec<GatewaySpec> = (0..n)
        .map(|g| {
            let listeners = (0..rng.random_range(1..4))
                .map(|l| listener(&format!("l{l}"), protocols[rng.random_range(0..3)], 3000 + l as u16))
                .collect();
            gateway(&format!("g{g}"), listeners)
        })
        .collect();
    let routes = (0..n * 3)
        .map(|r| {
            let gateway = format!("g{}", rng.random_range(0..n + 1));
            let listener = match rng.random_range(0..3) {
                0 => None,
                1 => Some("l0"),
                _ => Some("l3"),
            };
            let host = if rng.random_bool(0.5) { format!("h{r}.example.com") } else { format!("*.s{r}.example") };
            let ports: Vec<u16> = if rng.random_bool(0.5) { vec![443] } else { vec![] };
            let action = if rng.random_bool(0.8) { RouteAction::Allow } else { RouteAction::Deny };
            route(&format!("r{r:03}"), vec![parent(&gateway, listener)], &[host.as_str()], &ports, action)
        })
        .collect();
    let services = (0..n * 2)
        .map(|s| {
            let selection = match rng.random_range(0..4) {
                0 => Selection::Disabled,
                1 => default_gateway(),
                _ => Selection::Gateway(format!("g{}", rng.random_range(0..n + 1))),
            };
            ServiceInput { service: format!("s{s:03}"), selection }
        })
        .collect();
    PlanInputs { services, gateways, routes }
}

#[test]
fn the_output_is_the_same_whatever_order_the_inputs_come_in() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x00e9_7e55);
    for round in 0..20 {
        let mut inputs = sample(&mut rng, 12);
        let expected: CompiledPlan = compile(&inputs);
        assert!(expected.services.windows(2).all(|w| w[0].service < w[1].service), "services sorted");
        assert!(expected.routes.windows(2).all(|w| w[0].name < w[1].name), "routes sorted");
        assert!(expected.gateways.windows(2).all(|w| w[0].name < w[1].name), "gateways sorted");
        for service in &expected.services {
            let allowed = &service.destinations.allowed;
            assert!(
                allowed.windows(2).all(|w| (&w[0].listener, &w[0].hostname) <= (&w[1].listener, &w[1].hostname)),
                "destinations sorted"
            );
        }
        for _ in 0..5 {
            inputs.services.shuffle(&mut rng);
            inputs.gateways.shuffle(&mut rng);
            inputs.routes.shuffle(&mut rng);
            assert_eq!(compile(&inputs), expected, "round {round}: shuffled inputs compile the same");
        }
    }
}

#[test]
fn repeated_names_compile_the_same_whichever_comes_first() {
    let one = route("api", vec![parent("default", None)], &["a.example.com"], &[], RouteAction::Allow);
    let other = route("api", vec![parent("default", None)], &["b.example.com"], &[], RouteAction::Allow);
    let inputs =
        |routes| PlanInputs { services: vec![web(default_gateway())], gateways: vec![full_gateway("default")], routes };
    assert_eq!(compile(&inputs(vec![one.clone(), other.clone()])), compile(&inputs(vec![other, one])));
}
