//! Every fuzz target over its seeds and a few thousand deterministic
//! mutations of them (bit flips, truncations, spliced bytes), so that `make
//! test` holds the targets' promises without a fuzzing engine. A failure here
//! is a panic inside the parser, a file written outside a bundle, a request
//! that passed a service's checks and then failed, or a compile that depends
//! on input order. The request targets' seeds are also held to what they
//! came to (accepted, refused), so that a harness that reached nothing
//! would fail here too.
#![allow(clippy::unwrap_used, reason = "tests fail loudly")]

use std::collections::HashMap;

use base64::Engine as _;
use berth_fuzz::SpecOutcome;
use berth_proto::egress::v1 as egress;
use berth_proto::revisions::v1 as revisions;
use berth_proto::types::v1::{BundleRef, Capacity, Port};
use prost::Message as _;

/// Mutations tried per seed of a parser that works in memory.
const MUTATIONS: usize = 400;

/// Mutations tried per seed of the tar target, which extracts each to disk.
const TAR_MUTATIONS: usize = 100;

/// Mutations tried per seed of a request target, each a call into a service
/// that may write to its store.
const REQUEST_MUTATIONS: usize = 200;

/// A small xorshift generator: the same mutations on every run.
struct Mutator(u64);

impl Mutator {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % (n.max(1) as u64)).unwrap()
    }

    fn mutate(&mut self, seed: &[u8]) -> Vec<u8> {
        let mut data = seed.to_vec();
        for _ in 0..=self.below(4) {
            match self.below(4) {
                0 if !data.is_empty() => {
                    let at = self.below(data.len());
                    data[at] ^= 1 << self.below(8);
                }
                1 if !data.is_empty() => {
                    let at = self.below(data.len());
                    data.truncate(at);
                }
                2 => {
                    let at = self.below(data.len() + 1);
                    let byte = u8::try_from(self.next() & 0xff).unwrap();
                    data.insert(at, byte);
                }
                _ if !data.is_empty() => {
                    let at = self.below(data.len());
                    data[at] = [0x00, 0xff, b'/', b'.', b'"', b'{'][self.below(6)];
                }
                _ => data.push(0),
            }
        }
        data
    }
}

fn run(target: fn(&[u8]), seeds: &[Vec<u8>], mutations: usize) {
    let mut mutator = Mutator(0x9e37_79b9_7f4a_7c15);
    for seed in seeds {
        target(seed);
        for _ in 0..mutations {
            target(&mutator.mutate(seed));
        }
    }
    target(&[]);
}

fn tar_of(entries: &[(&str, tar::EntryType, &[u8], Option<&str>)]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for (path, kind, body, link) in entries {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(*kind);
        header.set_mode(0o644);
        header.set_size(body.len() as u64);
        // Written raw, so that names the tar crate itself refuses to write
        // (absolute, `..`) reach the extractor as an attacker would send them.
        let name = &mut header.as_old_mut().name;
        name[..path.len()].copy_from_slice(path.as_bytes());
        if let Some(link) = link {
            header.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
        }
        header.set_cksum();
        builder.append(&header, *body).unwrap();
    }
    builder.into_inner().unwrap()
}

fn gzip(data: &[u8]) -> Vec<u8> {
    use std::io::Write as _;
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(data).unwrap();
    encoder.finish().unwrap()
}

#[test]
fn csr_target_survives_its_seeds_and_their_mutations() {
    let (csr_pem, _key) = berth_mtls::generate_csr("fuzz").unwrap();
    let base64: String = csr_pem.lines().filter(|line| !line.starts_with("-----")).collect();
    let der = base64::engine::general_purpose::STANDARD.decode(base64).unwrap();
    let seeds = [csr_pem.into_bytes(), der, b"-----BEGIN CERTIFICATE REQUEST-----\n".to_vec()];
    run(berth_fuzz::csr, &seeds, MUTATIONS);
}

#[test]
fn bundle_config_target_survives_its_seeds_and_their_mutations() {
    let config = br#"{"entrypoint":"bin/server","args":["--port","8080"],"env":{"A":"b"},"ports":[],"modules":[{"path":"bin/server","digest":"sha256:0000000000000000000000000000000000000000000000000000000000000000","size":12}]}"#;
    run(berth_fuzz::bundle_config, &[config.to_vec(), b"{}".to_vec(), b"[]".to_vec()], MUTATIONS);
}

#[test]
fn bundle_manifest_target_survives_its_seeds_and_their_mutations() {
    let digest = "sha256:0000000000000000000000000000000000000000000000000000000000000000";
    let manifest = format!(
        r#"{{"schemaVersion":2,"mediaType":"{}","artifactType":"{}","config":{{"mediaType":"{}","digest":"{digest}","size":10}},"layers":[{{"mediaType":"{}","digest":"{digest}","size":20}}]}}"#,
        berth_bundle::OCI_MANIFEST_MEDIA_TYPE,
        berth_bundle::BUNDLE_ARTIFACT_TYPE,
        berth_bundle::BUNDLE_CONFIG_MEDIA_TYPE,
        berth_bundle::LAYER_TAR_GZIP_MEDIA_TYPE,
    );
    run(berth_fuzz::bundle_manifest, &[manifest.into_bytes()], MUTATIONS);
}

#[test]
fn tar_layer_target_survives_hostile_layers_and_their_mutations() {
    let plain = tar_of(&[
        ("bin/", tar::EntryType::Directory, b"", None),
        ("bin/server", tar::EntryType::Regular, b"#!/bin/sh\necho hi\n", None),
        ("bin/alias", tar::EntryType::Symlink, b"", Some("server")),
    ]);
    let hostile = [
        tar_of(&[("../escaped", tar::EntryType::Regular, b"out", None)]),
        tar_of(&[("/tmp/absolute", tar::EntryType::Regular, b"out", None)]),
        tar_of(&[
            ("link", tar::EntryType::Symlink, b"", Some("..")),
            ("link/escaped", tar::EntryType::Regular, b"out", None),
        ]),
        tar_of(&[("hard", tar::EntryType::Link, b"", Some("../../etc/passwd"))]),
        tar_of(&[("dev", tar::EntryType::Char, b"", None)]),
    ];
    let mut seeds = vec![plain.clone(), gzip(&plain)];
    for layer in hostile {
        seeds.push(gzip(&layer));
        seeds.push(layer);
    }
    run(berth_fuzz::tar_layer, &seeds, TAR_MUTATIONS);
}

/// A whole, valid service declaration.
fn declaration() -> revisions::ApplyServiceRequest {
    revisions::ApplyServiceRequest {
        project: "acme".into(),
        name: "web".into(),
        template: Some(revisions::ServiceTemplate {
            bundle: Some(BundleRef {
                reference: "registry.example.com/acme/web:1.4".into(),
                secret: "pull".into(),
                insecure: false,
            }),
            command: "bin/server".into(),
            args: vec!["--port".into(), "8080".into()],
            env: HashMap::from([("MODE".into(), "production".into()), ("EMPTY".into(), String::new())]),
            resources: Some(Capacity { cpu_millis: 250, memory_bytes: 128 << 20 }),
            replicas: Some(3),
            ports: vec![Port { name: "http".into(), port: 8080 }, Port { name: "admin".into(), port: 9090 }],
            egress: Some(revisions::EgressSelection { gateway: "corp".into(), disabled: false }),
            tier: "frontend".into(),
            image: None,
            runtime: 0,
            working_dir: String::new(),
            user: String::new(),
            cache: vec![berth_proto::types::v1::CacheMount {
                key: "cargo-main".into(),
                path: "/cache/cargo".into(),
                commit: berth_proto::types::v1::CacheCommit::OnSuccess as i32,
            }],
            readiness: Some(berth_proto::types::v1::Readiness {
                http_path: "/healthz".into(),
                port: "admin".into(),
                period_millis: 500,
            }),
        }),
        source: Some(revisions::Source {
            repo: "https://git.example.com/acme/web".into(),
            commit: "0123456789abcdef".into(),
            r#ref: "refs/heads/main".into(),
            labels: HashMap::from([("team".into(), "web".into())]),
        }),
    }
}

fn with_template(edit: impl FnOnce(&mut revisions::ServiceTemplate)) -> Vec<u8> {
    let mut request = declaration();
    edit(request.template.as_mut().unwrap());
    request.encode_to_vec()
}

#[test]
fn service_spec_target_survives_its_seeds_and_their_mutations() {
    let digest = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    let valid = declaration().encode_to_vec();
    let pinned = with_template(|t| t.bundle.as_mut().unwrap().reference = format!("registry.example.com/web@{digest}"));
    let layout = with_template(|t| t.bundle.as_mut().unwrap().reference = "oci:.berth/oci:hello".into());
    let insecure = with_template(|t| {
        t.bundle = Some(BundleRef {
            reference: "registry.internal:5000/web:1".into(),
            insecure: true,
            ..BundleRef::default()
        });
    });
    let outcome = |data: &[u8]| berth_fuzz::service_spec_outcome(data);
    let applied = |data: &[u8]| {
        let SpecOutcome { decoded, accepted, refused, .. } = outcome(data);
        (decoded, accepted, refused)
    };
    assert_eq!(applied(&valid), (true, 2, 0), "a valid declaration is accepted under either policy");
    assert_eq!(applied(&pinned), (true, 2, 0));
    assert_eq!(applied(&layout), (true, 1, 1), "a layout directory only where layouts are allowed");
    assert_eq!(applied(&insecure), (true, 1, 1), "plain HTTP only to a listed registry");

    let hostile = [
        with_template(|t| t.args = vec!["x".into(); 100_000]),
        with_template(|t| {
            t.ports = vec![Port { name: "zero".into(), port: 0 }, Port { name: "big".into(), port: 65_536 }]
        }),
        with_template(|t| t.ports = (0..10_000).map(|n| Port { name: format!("p{n}"), port: n }).collect()),
        with_template(|t| t.env = (0..5_000).map(|n| (format!("V{n}"), "x".repeat(n % 64))).collect()),
        with_template(|t| t.env = HashMap::from([("A=B".into(), String::new()), ("\u{7}".into(), "\0".into())])),
        with_template(|t| t.command = "a\0b".into()),
        with_template(|t| t.bundle.as_mut().unwrap().reference = "r".repeat(1 << 20)),
        with_template(|t| t.bundle.as_mut().unwrap().reference = "registry.example.com/web@sha256:zz".into()),
        with_template(|t| t.resources = Some(Capacity { cpu_millis: u64::MAX, memory_bytes: 0 })),
        with_template(|t| t.replicas = Some(u32::MAX)),
        with_template(|t| t.egress = Some(revisions::EgressSelection { gateway: "*.".into(), disabled: false })),
        with_template(|t| t.tier = "Front End".into()),
        revisions::ApplyServiceRequest { project: "Acme_Corp".into(), name: "w".repeat(58), ..declaration() }
            .encode_to_vec(),
        revisions::ApplyServiceRequest { template: None, source: None, ..declaration() }.encode_to_vec(),
    ];
    for seed in &hostile {
        assert_eq!(applied(seed), (true, 0, 2), "{:?}", outcome(seed));
    }

    let json = include_bytes!("../../examples/hello/service.json").to_vec();
    let yaml = include_bytes!("../../examples/hello/service.yaml").to_vec();
    assert!(outcome(&json).json && outcome(&json).yaml, "JSON is YAML too");
    assert!(outcome(&yaml).yaml && !outcome(&yaml).json);
    let whole = b"name: web\nproject: acme\ntemplate:\n  bundle: {reference: registry.example.com/web:1}\n  \
                  replicas: 2\n  env: {A: b}\n  ports: [{name: http, port: 8080}]\nsource: {ref: main}\n"
        .to_vec();
    assert!(outcome(&whole).yaml);
    // Nine levels of nine aliases each: 9^9 strings once expanded.
    let laughs = {
        let mut text = format!("a: &a [{}]\n", ["\"lol\""; 9].join(","));
        for (name, previous) in ["b", "c", "d", "e", "f", "g", "h", "i"].into_iter().zip('a'..) {
            text.push_str(&format!("{name}: &{name} [{}]\n", vec![format!("*{previous}"); 9].join(",")));
        }
        text.into_bytes()
    };
    // Nested past every recursion limit, and no deeper: the YAML parser
    // takes time quadratic in the depth of nested flow mappings (40,000
    // levels, 240 KB, take about 6 s in a release build), so deeper seeds
    // only slow the test down.
    let deep_yaml = format!("{}1{}", "[".repeat(2_000), "]".repeat(2_000)).into_bytes();
    let deep_block = (0..300).map(|n| format!("{}k:\n", " ".repeat(n))).collect::<String>().into_bytes();
    let deep_json = format!("{}{}", "{\"a\":".repeat(2_000), "}".repeat(2_000)).into_bytes();
    let text_hostile = [
        laughs,
        deep_yaml,
        deep_block,
        deep_json,
        b"name: web\nname: web\n".to_vec(),
        b"bundle: !!binary aGVsbG8=\nreplicas: 1e999\n".to_vec(),
        b"? [a, b]\n: c\n".to_vec(),
        b"{\"replicas\": 123456789012345678901234567890}".to_vec(),
        b"name: \xff\xfe\n".to_vec(),
        b"*undefined\n".to_vec(),
    ];
    for seed in &text_hostile {
        let came = outcome(seed);
        assert_eq!((came.accepted, came.refused), (0, 2 * usize::from(came.decoded)), "{came:?}");
    }
    assert!(outcome(b"a: &a [x, y]\nb: [*a, *a]\n").yaml, "aliases are read");
    assert!(!outcome(&text_hostile[0]).yaml, "an alias bomb is refused, not expanded");
    assert!(!outcome(&text_hostile[1]).yaml && !outcome(&text_hostile[3]).json, "nesting is bounded");
    assert!(!outcome(&text_hostile[4]).yaml, "a key given twice is refused, as the CLI says");

    let mut seeds = vec![valid, pinned, layout, insecure, json, yaml, whole];
    seeds.extend(hostile.into_iter().filter(|seed| seed.len() < 64 << 10));
    seeds.extend(text_hostile.into_iter().filter(|seed| seed.len() < 64 << 10));
    run(berth_fuzz::service_spec, &seeds, REQUEST_MUTATIONS);
}

fn listener(name: &str, protocol: egress::ListenerProtocol, port: u32) -> egress::Listener {
    egress::Listener { name: name.into(), protocol: protocol as i32, port }
}

fn gateway(name: &str, listeners: Vec<egress::Listener>) -> egress::EgressGateway {
    egress::EgressGateway { name: name.into(), listeners, ..egress::EgressGateway::default() }
}

fn route(
    name: &str,
    listener: &str,
    hostnames: &[&str],
    ports: &[u32],
    action: egress::RouteAction,
) -> egress::EgressRoute {
    egress::EgressRoute {
        name: name.into(),
        parent_refs: vec![egress::ParentRef { gateway: "default".into(), listener: listener.into() }],
        hostnames: hostnames.iter().map(|h| h.to_string()).collect(),
        ports: ports.to_vec(),
        action: action as i32,
        ..egress::EgressRoute::default()
    }
}

/// Messages as a sequence of length-delimited frames, as the target reads them.
fn framed(messages: &[&dyn FramedMessage]) -> Vec<u8> {
    let mut out = Vec::new();
    for message in messages {
        message.frame(&mut out);
    }
    out
}

trait FramedMessage {
    fn frame(&self, out: &mut Vec<u8>);
}

impl<M: prost::Message> FramedMessage for M {
    fn frame(&self, out: &mut Vec<u8>) {
        self.encode_length_delimited(out).unwrap();
    }
}

#[test]
fn egress_objects_target_survives_its_seeds_and_their_mutations() {
    use egress::ListenerProtocol::{Http, HttpsConnect, Tcp};
    use egress::RouteAction::{Allow, Deny, Unspecified};
    let default = gateway(
        "default",
        vec![listener("http", Http, 3128), listener("https", HttpsConnect, 3129), listener("tcp", Tcp, 5432)],
    );
    let api = route("api", "", &["api.example.com", "*.example.net"], &[443], Allow);
    let no_admin = route("no-admin", "http", &["admin.example.com"], &[], Deny);
    let db = route("db", "tcp", &["db.internal"], &[5432], Unspecified);
    let valid = framed(&[&default, &api, &no_admin, &db]);
    let came = berth_fuzz::egress_objects_outcome(&valid);
    assert_eq!((came.gateways, came.routes, came.refused), (1, 3, 0), "{came:?}");
    // on-default and on-0 select `default`, which allows something; disabled
    // is honoured; on-missing names no gateway.
    assert_eq!(came.ready, 3, "{came:?}");
    // api on http and https (two host names each), no-admin on http, db on tcp; for two services.
    assert_eq!(came.destinations, 2 * (4 + 1 + 1), "{came:?}");

    let hostile_routes = [
        route("wild", "", &["*."], &[443], Allow),
        route("wild", "", &["**"], &[443], Allow),
        route("wild", "", &["*"], &[], Allow),
        route("wild", "", &["*.*.example.com"], &[], Allow),
        route("wild", "", &[""], &[], Allow),
        route("dots", "", &["a..b"], &[], Allow),
        route("ports", "", &["a.example.com"], &[0, 65_536], Allow),
        route("twice", "", &["a.example.com", "a.example.com"], &[80, 80], Allow),
        route("UPPER", "", &["a.example.com"], &[], Allow),
        route("no-host", "", &[], &[], Allow),
        egress::EgressRoute { action: 7, ..route("act", "", &["a.example.com"], &[], Allow) },
        egress::EgressRoute { project: "a/b".into(), ..route("proj", "", &["a.example.com"], &[], Allow) },
        egress::EgressRoute { parent_refs: Vec::new(), ..route("orphan", "", &["a.example.com"], &[], Allow) },
        egress::EgressRoute {
            hostnames: (0..10_000).map(|n| format!("h{n}.example.com")).collect(),
            ..route("many-hosts", "", &[], &[], Allow)
        },
        egress::EgressRoute {
            ports: (1..=60_000).collect(),
            ..route("many-ports", "", &["a.example.com"], &[], Allow)
        },
    ];
    let hostile_gateways = [
        gateway("default", vec![listener("http", Http, 0), listener("tcp", Tcp, 65_536)]),
        gateway("default", vec![listener("http", Http, 3128), listener("http", Tcp, 3128)]),
        gateway("default", vec![egress::Listener { name: "x".into(), protocol: 99, port: 80 }]),
        gateway("default", Vec::new()),
        gateway("*.", vec![listener("http", Http, 3128)]),
        gateway("default", (0..10_000).map(|n| listener(&format!("l{n}"), Http, 1 + n)).collect()),
    ];
    for hostile in &hostile_routes {
        let came = berth_fuzz::egress_objects_outcome(&framed(&[&default, hostile]));
        assert_eq!((came.gateways, came.routes), (1, 0), "{hostile:?} was accepted: {came:?}");
        assert!(came.refused >= 1, "{came:?}");
    }
    for hostile in &hostile_gateways {
        let came = berth_fuzz::egress_objects_outcome(&framed(&[hostile, &api]));
        assert_eq!(came.gateways, 0, "{came:?}");
        assert_eq!(came.routes, 1, "{came:?}");
        assert_eq!(came.ready, 1, "without its gateway only the disabled service is ready: {came:?}");
    }

    let mut seeds = vec![
        valid,
        default.encode_to_vec(),
        api.encode_to_vec(),
        framed(&[&default, &api, &route("wild", "", &["*.example.com"], &[443], Deny), &db, &db]),
        b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01".to_vec(),
        vec![0x80; 64],
    ];
    seeds.extend(hostile_routes.iter().filter(|r| r.encoded_len() < 4096).map(|r| framed(&[&default, r])));
    seeds.extend(hostile_gateways.iter().filter(|g| g.encoded_len() < 4096).map(|g| framed(&[g, &api])));
    run(berth_fuzz::egress_objects, &seeds, REQUEST_MUTATIONS);
}
