//! Checks that the compiled API keeps its contract: every rpc in the admission table,
//! the admission rules users rely on, the names scripts use, and a comment on everything.

use std::collections::{BTreeMap, BTreeSet};

use berth_core::CallerKind::{self, Admin, Anonymous, Node, Router, Service, Workload};
use prost::Message;
use prost_types::{DescriptorProto, EnumDescriptorProto, FileDescriptorProto, FileDescriptorSet};

use crate::{FILE_DESCRIPTOR_SET, access};

fn descriptor_set() -> FileDescriptorSet {
    FileDescriptorSet::decode(FILE_DESCRIPTOR_SET).expect("the descriptor set decodes")
}

fn berth_files(set: &FileDescriptorSet) -> impl Iterator<Item = &FileDescriptorProto> {
    set.file.iter().filter(|file| file.package().starts_with("berth."))
}

/// Every rpc path in the descriptor set, as gRPC spells it on the wire.
fn rpc_paths(set: &FileDescriptorSet) -> BTreeSet<String> {
    let mut paths = BTreeSet::new();
    for file in &set.file {
        for service in &file.service {
            for method in &service.method {
                paths.insert(format!("/{}.{}/{}", file.package(), service.name(), method.name()));
            }
        }
    }
    paths
}

fn find_message<'a>(set: &'a FileDescriptorSet, full_name: &str) -> &'a DescriptorProto {
    set.file
        .iter()
        .flat_map(|file| {
            file.message_type.iter().map(move |message| (format!("{}.{}", file.package(), message.name()), message))
        })
        .find(|(name, _)| name == full_name)
        .map(|(_, message)| message)
        .unwrap_or_else(|| panic!("message {full_name} is in the descriptor set"))
}

fn enum_values(set: &FileDescriptorSet) -> BTreeSet<String> {
    fn collect(enums: &[EnumDescriptorProto], messages: &[DescriptorProto], out: &mut BTreeSet<String>) {
        for enumeration in enums {
            out.extend(enumeration.value.iter().map(|value| value.name().to_owned()));
        }
        for message in messages {
            collect(&message.enum_type, &message.nested_type, out);
        }
    }
    let mut values = BTreeSet::new();
    for file in &set.file {
        collect(&file.enum_type, &file.message_type, &mut values);
    }
    values
}

#[test]
fn table_covers_every_method_of_every_service_and_nothing_else() {
    let set = descriptor_set();
    let in_descriptor = rpc_paths(&set);
    let in_table: BTreeSet<String> = access::METHODS.iter().map(|(path, _)| (*path).to_owned()).collect();
    assert_eq!(in_table, in_descriptor);
    assert_eq!(access::METHODS.len(), in_table.len(), "a path is listed twice");

    let services: BTreeSet<String> = set
        .file
        .iter()
        .flat_map(|file| file.service.iter().map(move |service| format!("{}.{}", file.package(), service.name())))
        .collect();
    let listed: BTreeSet<String> = access::SERVICES.iter().map(|s| (*s).to_owned()).collect();
    assert_eq!(listed, services);
}

#[test]
fn every_listed_method_is_found_by_allowed_and_admits_someone() {
    for (path, kinds) in access::METHODS {
        assert!(!kinds.is_empty(), "{path} admits no caller kind");
        assert_eq!(access::allowed(path), Some(*kinds), "lookup of {path}");
    }
}

#[test]
fn paths_that_are_not_berth_rpcs_are_not_admitted() {
    for path in [
        "/nope/x",
        "",
        "/",
        "/berth.identity.v1.Join/",
        "berth.identity.v1.Join/Join",
        "/berth.identity.v1.Join/join",
        "/grpc.health.v1.Health/Check",
        "/berth.identity.v1.Join/Join/extra",
    ] {
        assert_eq!(access::allowed(path), None, "{path:?}");
    }
}

#[test]
fn spot_checks_of_the_admission_table() {
    assert_eq!(access::allowed("/berth.identity.v1.NodeSession/Heartbeat"), Some(&[Node][..]));
    assert_eq!(access::allowed("/berth.identity.v1.Join/Join"), Some(&[Anonymous, Node][..]));
    assert_eq!(access::allowed("/berth.identity.v1.JoinTokens/CreateJoinToken"), Some(&[Admin][..]));
    assert_eq!(access::allowed("/berth.identity.v1.Authority/GetCABundle"), Some(&[Node, Service, Admin, Router][..]));
}

/// The admission contract, written out by hand: a change to any rpc's access option
/// must change this table too.
#[test]
fn admission_table_matches_the_contract() {
    const ADMIN: &[CallerKind] = &[Admin];
    const NODE: &[CallerKind] = &[Node];
    const READERS: &[CallerKind] = &[Service, Admin];
    // A workload reads what its SPIFFE ID names, nothing else (the handler holds it to that).
    const OWN_READERS: &[CallerKind] = &[Service, Admin, Workload];
    // What a router follows to build its routes.
    const WATCHERS: &[CallerKind] = &[Service, Admin, Router];
    let contract: &[(&str, &[&str], &[CallerKind])] = &[
        ("berth.identity.v1.JoinTokens", &["CreateJoinToken", "ListJoinTokens", "RevokeJoinToken"], ADMIN),
        ("berth.identity.v1.Join", &["Join"], &[Anonymous, Node]),
        ("berth.identity.v1.NodeSession", &["Heartbeat"], NODE),
        ("berth.identity.v1.Nodes", &["ListNodes", "GetNode", "GetUpgrade"], READERS),
        ("berth.identity.v1.Nodes", &["UpgradeNodes"], ADMIN),
        ("berth.identity.v1.Nodes", &["WatchNodes"], WATCHERS),
        ("berth.identity.v1.Nodes", &["RevokeNode"], ADMIN),
        // A node drains only itself, on its host's interruption notice (the handler holds it to that).
        ("berth.identity.v1.Nodes", &["DrainNode"], &[Node, Admin]),
        ("berth.identity.v1.Authority", &["GetCABundle"], &[Node, Service, Admin, Router]),
        ("berth.identity.v1.Authority", &["RotateCA"], ADMIN),
        ("berth.identity.v1.Mesh", &["GetEndpoints"], &[Node, Service, Admin, Router]),
        // A service or router renews only its own certificate (the handler holds it to that).
        ("berth.identity.v1.Authority", &["IssueCertificate"], &[Service, Admin, Router]),
        // A node asks for its own workloads' certificates (the handler holds it to its node id).
        (
            "berth.identity.v1.Workloads",
            &["SignWorkloadCertificate", "RenewWorkloadCertificate", "SignWorkloadJwt"],
            NODE,
        ),
        ("berth.identity.v1.Workloads", &["GetWorkloadBundle"], &[Node, Service, Admin, Router]),
        ("berth.revisions.v1.Services", &["ApplyService", "DeleteService", "SetTraffic"], ADMIN),
        ("berth.revisions.v1.Services", &["GetService"], OWN_READERS),
        ("berth.revisions.v1.Services", &["ListServices"], READERS),
        ("berth.revisions.v1.Services", &["WatchServices"], WATCHERS),
        // A router acknowledges only as itself (its name is read from its certificate).
        ("berth.revisions.v1.Services", &["AckRoutes"], &[Router]),
        ("berth.revisions.v1.Revisions", &["ListRevisions"], READERS),
        ("berth.revisions.v1.Revisions", &["GetRevision"], OWN_READERS),
        ("berth.revisions.v1.Revisions", &["GetPullCredentials"], NODE),
        ("berth.leases.v1.Leases", &["RequestLease", "ListLeases", "ReleaseLease", "ResizeLease"], READERS),
        ("berth.leases.v1.Leases", &["GetLease"], OWN_READERS),
        ("berth.leases.v1.Leases", &["GetLeaseLogs"], READERS),
        ("berth.leases.v1.Leases", &["WatchLeases"], WATCHERS),
        // Only identity spends launch registrations (the handler holds a service to that).
        ("berth.leases.v1.Leases", &["RedeemLaunchRegistration"], &[Service]),
        ("berth.leases.v1.Capacity", &["ListNodeCapacity"], READERS),
        ("berth.leases.v1.Caches", &["ListCaches", "GetCache"], READERS),
        ("berth.leases.v1.Caches", &["SetCacheHead", "PinCacheGeneration", "DeleteCache", "SetProjectCaching"], ADMIN),
        (
            "berth.leases.v1.NodeLeases",
            &[
                "WatchAssignments",
                "ReportPhase",
                "RenewLeases",
                "ReconcileNode",
                "AssumeCustody",
                "RegisterLaunch",
                "ReportResize",
                "OpenCache",
                "CommitCache",
                "FollowCaches",
            ],
            NODE,
        ),
        (
            "berth.egress.v1.Egress",
            &["ApplyGateway", "DeleteGateway", "ApplyRoute", "DeleteRoute", "ApplyDnsConfig"],
            ADMIN,
        ),
        (
            "berth.egress.v1.Egress",
            &["GetGateway", "ListGateways", "GetRoute", "ListRoutes", "GetPlan", "GetDnsConfig"],
            READERS,
        ),
        ("berth.egress.v1.NodeEgress", &["WatchEgress", "AckEgress"], NODE),
        ("berth.agent.v1.Agent", &["ListInstances", "GetLogs", "GetStats", "SignalInstance"], READERS),
        ("berth.agent.v1.DataPlane", &["Tunnel"], &[Router]),
    ];
    let mut expected = BTreeMap::new();
    for (service, methods, kinds) in contract {
        for method in *methods {
            expected.insert(format!("/{service}/{method}"), kinds.to_vec());
        }
    }
    let actual: BTreeMap<String, Vec<CallerKind>> =
        access::METHODS.iter().map(|(path, kinds)| ((*path).to_owned(), kinds.to_vec())).collect();
    let paths: BTreeSet<&String> = expected.keys().chain(actual.keys()).collect();
    let breaches: Vec<String> = paths
        .into_iter()
        .filter(|path| expected.get(*path) != actual.get(*path))
        .map(|path| format!("{path}: contract {:?}, proto {:?}", expected.get(path), actual.get(path)))
        .collect();
    assert!(breaches.is_empty(), "admission differs: {breaches:#?}");
}

#[test]
fn descriptor_set_holds_the_api_and_everything_it_imports() {
    let set = descriptor_set();
    assert!(rpc_paths(&set).contains("/berth.identity.v1.Join/Join"), "berth.identity.v1.Join/Join is served");
    let names: BTreeSet<&str> = set.file.iter().map(|file| file.name()).collect();
    for file in &set.file {
        for dependency in &file.dependency {
            assert!(
                names.contains(dependency.as_str()),
                "{} imports {dependency}, which reflection could not resolve",
                file.name()
            );
        }
    }
}

#[test]
fn enum_values_scripts_rely_on_exist() {
    let values = enum_values(&descriptor_set());
    for value in [
        "NODE_STATE_UNSPECIFIED",
        "NODE_STATE_JOINING",
        "NODE_STATE_UP",
        "NODE_STATE_DOWN",
        "NODE_STATE_DRAINING",
        "NODE_STATE_REVOKED",
        "LEASE_PHASE_UNSPECIFIED",
        "LEASE_PHASE_PENDING",
        "LEASE_PHASE_BOUND",
        "LEASE_PHASE_LAUNCHING",
        "LEASE_PHASE_RUNNING",
        "LEASE_PHASE_DONE",
        "LEASE_PHASE_FAILED",
        "LEASE_PHASE_RELEASED",
        "LEASE_PHASE_EXPIRED",
        "CALLER_KIND_ANONYMOUS",
        "CALLER_KIND_NODE",
        "CALLER_KIND_SERVICE",
        "CALLER_KIND_ADMIN",
        "CALLER_KIND_ROUTER",
        "LISTENER_PROTOCOL_HTTP",
        "LISTENER_PROTOCOL_HTTPS_CONNECT",
        "LISTENER_PROTOCOL_TCP",
        "ROUTE_ACTION_ALLOW",
        "ROUTE_ACTION_DENY",
        "AUTHORITY_STATE_PREPARED",
        "AUTHORITY_STATE_ACTIVE",
        "AUTHORITY_STATE_RETIRED",
    ] {
        assert!(values.contains(value), "enum value {value} is defined");
    }
}

#[test]
fn every_enum_starts_with_unspecified_zero() {
    fn check(enums: &[EnumDescriptorProto], messages: &[DescriptorProto]) {
        for enumeration in enums {
            let first = enumeration.value.first().expect("an enum has values");
            assert_eq!(first.number(), 0, "{}", enumeration.name());
            assert!(first.name().ends_with("_UNSPECIFIED"), "{} starts with {}", enumeration.name(), first.name());
        }
        for message in messages {
            check(&message.enum_type, &message.nested_type);
        }
    }
    let set = descriptor_set();
    for file in berth_files(&set) {
        check(&file.enum_type, &file.message_type);
    }
}

#[test]
fn fields_scripts_rely_on_exist() {
    let set = descriptor_set();
    let contract: &[(&str, &[&str])] = &[
        ("berth.types.v1.Capacity", &["cpu_millis", "memory_bytes"]),
        ("berth.types.v1.Condition", &["type", "status", "reason", "message", "last_transition_time"]),
        ("berth.identity.v1.CreateJoinTokenRequest", &["tier", "labels", "ttl_seconds", "max_uses"]),
        ("berth.identity.v1.CreateJoinTokenResponse", &["token_id", "token", "expires_at"]),
        (
            "berth.identity.v1.JoinToken",
            &["token_id", "tier", "labels", "created_at", "expires_at", "max_uses", "uses", "revoked"],
        ),
        (
            "berth.identity.v1.JoinRequest",
            &["token", "csr_pem", "name", "advertise_addr", "tier", "version", "capacity"],
        ),
        (
            "berth.identity.v1.JoinResponse",
            &["node_id", "certificate_pem", "ca_bundle_pem", "incarnation", "heartbeat_interval_ms"],
        ),
        (
            "berth.identity.v1.HeartbeatRequest",
            &["node_id", "incarnation", "usage", "capacity", "version", "renewal_csr_pem"],
        ),
        (
            "berth.identity.v1.HeartbeatResponse",
            &["certificate_pem", "ca_bundle_pem", "heartbeat_interval_ms", "fenced", "state"],
        ),
        (
            "berth.identity.v1.Node",
            &[
                "node_id",
                "name",
                "tier",
                "advertise_addr",
                "state",
                "incarnation",
                "last_heartbeat_at",
                "capacity",
                "version",
                "labels",
                "joined_at",
                "usage",
            ],
        ),
        ("berth.identity.v1.ListNodesRequest", &["tier", "state"]),
        ("berth.identity.v1.ListNodesResponse", &["nodes"]),
        ("berth.identity.v1.RevokeNodeRequest", &["node_id"]),
        ("berth.identity.v1.NodeEvent", &["node", "kind"]),
        ("berth.identity.v1.GetCABundleResponse", &["ca_bundle_pem", "authorities"]),
        ("berth.identity.v1.CertificateAuthority", &["fingerprint", "state", "not_after"]),
        ("berth.identity.v1.RotateCARequest", &["activate"]),
        ("berth.identity.v1.IssueCertificateRequest", &["kind", "name", "csr_pem", "ttl_seconds"]),
        ("berth.identity.v1.IssueCertificateResponse", &["certificate_pem", "ca_bundle_pem", "expires_at"]),
        (
            "berth.leases.v1.Lease",
            &[
                "lease_id",
                "epoch",
                "project",
                "owner",
                "node_id",
                "phase",
                "resources",
                "tier",
                "spread_group",
                "workload",
                "reason",
                "exit_code",
                "created_at",
                "expires_at",
            ],
        ),
        (
            "berth.leases.v1.RequestLeaseRequest",
            &["project", "owner", "idempotency_key", "resources", "tier", "spread_group", "workload"],
        ),
        ("berth.leases.v1.ListLeasesRequest", &["project", "node_id", "phase"]),
        ("berth.leases.v1.ReleaseLeaseRequest", &["lease_id"]),
        ("berth.leases.v1.WatchAssignmentsRequest", &["node_id"]),
        ("berth.leases.v1.ReportPhaseRequest", &["node_id", "lease_id", "epoch", "phase", "reason", "exit_code"]),
        ("berth.leases.v1.RenewLeasesRequest", &["node_id", "leases"]),
        ("berth.leases.v1.RenewLeasesResponse", &["renewed", "lost", "ttl_ms"]),
        ("berth.leases.v1.ReconcileNodeRequest", &["node_id", "running"]),
        ("berth.leases.v1.ReconcileNodeResponse", &["destroy", "failed"]),
        ("berth.leases.v1.AssumeCustodyRequest", &["node_id", "lease_id", "epoch"]),
        ("berth.leases.v1.NodeCapacity", &["node_id", "total", "allocated", "free", "tier", "state"]),
        ("berth.revisions.v1.Service", &["project", "name", "template", "source", "status"]),
        (
            "berth.revisions.v1.ServiceTemplate",
            &["bundle", "command", "args", "env", "resources", "replicas", "ports", "egress"],
        ),
        ("berth.types.v1.BundleRef", &["reference", "secret", "insecure"]),
        ("berth.revisions.v1.EgressSelection", &["gateway", "disabled"]),
        ("berth.revisions.v1.Source", &["repo", "commit", "ref"]),
        (
            "berth.revisions.v1.ServiceStatus",
            &[
                "latest_created_revision",
                "latest_ready_revision",
                "live_revision",
                "replicas_running",
                "replicas_desired",
                "conditions",
            ],
        ),
        (
            "berth.revisions.v1.Revision",
            &["project", "service", "name", "generation", "digest", "template", "source", "created_at", "conditions"],
        ),
        ("berth.revisions.v1.SetTrafficRequest", &["project", "name", "pinned_revision"]),
        ("berth.revisions.v1.ListRevisionsRequest", &["project", "service"]),
        ("berth.revisions.v1.GetRevisionRequest", &["project", "name"]),
        ("berth.egress.v1.EgressGateway", &["project", "name", "listeners", "status"]),
        ("berth.egress.v1.Listener", &["name", "protocol", "port"]),
        ("berth.egress.v1.EgressRoute", &["project", "name", "parent_refs", "hostnames", "ports", "action", "status"]),
        ("berth.egress.v1.ParentRef", &["gateway", "listener"]),
        ("berth.egress.v1.GetPlanRequest", &["project"]),
        ("berth.egress.v1.EgressPlan", &["project", "generation", "services", "gateways", "routes", "node_acks"]),
        ("berth.egress.v1.ServiceEgress", &["service", "gateway", "allowed", "condition"]),
        ("berth.egress.v1.WatchEgressRequest", &["node_id"]),
        ("berth.egress.v1.NodeEgressState", &["generation", "plans"]),
        ("berth.egress.v1.AckEgressRequest", &["node_id", "generation", "error", "enforcement"]),
        ("berth.egress.v1.NodeAck", &["node_id", "generation", "acked_at", "error", "enforcement"]),
        ("berth.agent.v1.Instance", &["lease_id", "epoch", "project", "service", "phase", "pid", "started_at", "port"]),
        ("berth.agent.v1.ListInstancesResponse", &["instances"]),
        ("berth.agent.v1.GetLogsRequest", &["lease_id", "follow", "tail_lines"]),
        ("berth.types.v1.LogChunk", &["data", "stream"]),
        ("berth.leases.v1.GetLeaseLogsRequest", &["lease_id", "follow", "tail_lines"]),
        ("berth.agent.v1.GetStatsRequest", &["lease_id"]),
        ("berth.agent.v1.GetStatsResponse", &["cpu_millis_used", "memory_bytes", "uptime_seconds"]),
        ("berth.agent.v1.SignalInstanceRequest", &["lease_id", "signal"]),
    ];
    for (message, fields) in contract {
        let descriptor = find_message(&set, message);
        let present: BTreeSet<&str> = descriptor.field.iter().map(|field| field.name()).collect();
        for field in *fields {
            assert!(present.contains(field), "{message} has field {field}");
        }
    }
}

#[test]
fn capacity_is_defined_once_and_shared() {
    let set = descriptor_set();
    let capacity = find_message(&set, "berth.types.v1.Capacity");
    for field in &capacity.field {
        assert_eq!(
            field.r#type(),
            prost_types::field_descriptor_proto::Type::Uint64,
            "Capacity.{} is uint64",
            field.name()
        );
    }
    for file in berth_files(&set) {
        for message in &file.message_type {
            if file.package() != "berth.types.v1" {
                assert_ne!(message.name(), "Capacity", "{} redefines Capacity", file.name());
            }
        }
    }
}

#[test]
fn tenant_scoped_objects_carry_a_project() {
    let set = descriptor_set();
    for message in [
        "berth.revisions.v1.Service",
        "berth.revisions.v1.Revision",
        "berth.leases.v1.Lease",
        "berth.egress.v1.EgressGateway",
        "berth.egress.v1.EgressRoute",
        "berth.egress.v1.EgressPlan",
        "berth.agent.v1.Instance",
    ] {
        let descriptor = find_message(&set, message);
        let project = descriptor
            .field
            .iter()
            .find(|field| field.name() == "project")
            .unwrap_or_else(|| panic!("{message} has a project"));
        assert_eq!(project.r#type(), prost_types::field_descriptor_proto::Type::String);
    }
}

/// Walks every declaration of a file with its source-info path, so the test below can
/// ask whether each one carries a comment.
fn declarations(file: &FileDescriptorProto) -> Vec<(String, Vec<i32>)> {
    // Field numbers of FileDescriptorProto, DescriptorProto and friends in descriptor.proto.
    const FILE_MESSAGE: i32 = 4;
    const FILE_ENUM: i32 = 5;
    const FILE_SERVICE: i32 = 6;
    const MESSAGE_FIELD: i32 = 2;
    const MESSAGE_NESTED: i32 = 3;
    const MESSAGE_ENUM: i32 = 4;
    const ENUM_VALUE: i32 = 2;
    const SERVICE_METHOD: i32 = 2;

    fn message(scope: &str, descriptor: &DescriptorProto, path: Vec<i32>, out: &mut Vec<(String, Vec<i32>)>) {
        let name = format!("{scope}.{}", descriptor.name());
        for (index, field) in descriptor.field.iter().enumerate() {
            let mut field_path = path.clone();
            field_path.extend([MESSAGE_FIELD, index as i32]);
            out.push((format!("{name}.{}", field.name()), field_path));
        }
        for (index, nested) in descriptor.nested_type.iter().enumerate() {
            // Map entries are synthesized by the compiler and carry no comment.
            if nested.options.as_ref().is_some_and(|o| o.map_entry()) {
                continue;
            }
            let mut nested_path = path.clone();
            nested_path.extend([MESSAGE_NESTED, index as i32]);
            message(&name, nested, nested_path, out);
        }
        for (index, enumeration) in descriptor.enum_type.iter().enumerate() {
            let mut enum_path = path.clone();
            enum_path.extend([MESSAGE_ENUM, index as i32]);
            enum_values(&name, enumeration, enum_path, out);
        }
        out.push((name, path));
    }

    fn enum_values(scope: &str, descriptor: &EnumDescriptorProto, path: Vec<i32>, out: &mut Vec<(String, Vec<i32>)>) {
        let name = format!("{scope}.{}", descriptor.name());
        for (index, value) in descriptor.value.iter().enumerate() {
            let mut value_path = path.clone();
            value_path.extend([ENUM_VALUE, index as i32]);
            out.push((format!("{name}.{}", value.name()), value_path));
        }
        out.push((name, path));
    }

    let mut out = Vec::new();
    let package = file.package();
    for (index, descriptor) in file.message_type.iter().enumerate() {
        message(package, descriptor, vec![FILE_MESSAGE, index as i32], &mut out);
    }
    for (index, descriptor) in file.enum_type.iter().enumerate() {
        enum_values(package, descriptor, vec![FILE_ENUM, index as i32], &mut out);
    }
    for (index, service) in file.service.iter().enumerate() {
        let name = format!("{package}.{}", service.name());
        for (method_index, method) in service.method.iter().enumerate() {
            out.push((
                format!("{name}/{}", method.name()),
                vec![FILE_SERVICE, index as i32, SERVICE_METHOD, method_index as i32],
            ));
        }
        out.push((name, vec![FILE_SERVICE, index as i32]));
    }
    out
}

#[test]
fn every_declaration_is_documented() {
    let set = descriptor_set();
    let mut undocumented = Vec::new();
    for file in berth_files(&set) {
        let documented: BTreeSet<&[i32]> = file
            .source_code_info
            .as_ref()
            .expect("the descriptor set keeps source info")
            .location
            .iter()
            .filter(|location| !location.leading_comments().trim().is_empty())
            .map(|location| location.path.as_slice())
            .collect();
        for (name, path) in declarations(file) {
            if !documented.contains(path.as_slice()) {
                undocumented.push(name);
            }
        }
    }
    assert!(undocumented.is_empty(), "no comment on: {undocumented:#?}");
}

#[test]
fn generated_messages_round_trip() {
    use crate::identity::v1::{HeartbeatResponse, NodeState};

    let response = HeartbeatResponse {
        ca_bundle_pem: "-----BEGIN CERTIFICATE-----".to_owned(),
        heartbeat_interval_ms: 5_000,
        fenced: true,
        state: NodeState::Down as i32,
        ..Default::default()
    };
    let decoded = HeartbeatResponse::decode(response.encode_to_vec().as_slice()).expect("decodes");
    assert_eq!(decoded, response);
    assert_eq!(decoded.state(), NodeState::Down);
}

#[test]
fn reflection_serves_the_descriptor_set() {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .build_v1()
        .expect("reflection v1 accepts the descriptor set");
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .expect("reflection v1alpha accepts the descriptor set");
}

#[test]
fn timestamps_split_milliseconds_exactly() {
    let ts = crate::timestamp_from_ms(1_700_000_000_123);
    assert_eq!((ts.seconds, ts.nanos), (1_700_000_000, 123_000_000));
    let before_epoch = crate::timestamp_from_ms(-1);
    assert_eq!((before_epoch.seconds, before_epoch.nanos), (-1, 999_000_000));
}
