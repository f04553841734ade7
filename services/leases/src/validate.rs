//! Checks on what callers send, before anything is read or written: each
//! failure is an `InvalidArgument` naming the field and what it must be.

use berth_proto::artifact::ArtifactKind;
use berth_proto::leases::v1;
use berth_proto::types::v1::Capacity;

use crate::ledger::{LeaseAsk, LeaseError};
use crate::model::{Phase, ResizeState, Resources};

/// The project an empty project field means.
pub(crate) const DEFAULT_PROJECT: &str = "default";

/// The longest owner, idempotency key, spread group or lease id accepted.
const MAX_NAME_LEN: usize = 256;

/// The longest reason word accepted.
const MAX_REASON_LEN: usize = 64;

/// The longest person-readable message accepted.
const MAX_MESSAGE_LEN: usize = 1024;

/// The most leases one renewal or reconcile may name.
pub(crate) const MAX_LEASES_PER_CALL: usize = 10_000;

fn invalid(field: &'static str, reason: impl Into<String>) -> LeaseError {
    LeaseError::InvalidArgument { field, reason: reason.into() }
}

/// `project`, or the default project when empty.
pub(crate) fn project(project: &str) -> Result<String, LeaseError> {
    if project.is_empty() {
        Ok(DEFAULT_PROJECT.to_owned())
    } else if berth_core::is_dns_label(project) {
        Ok(project.to_owned())
    } else {
        Err(invalid("project", format!("'{project}' is not a project name: use 1-63 lowercase letters, digits or '-'")))
    }
}

/// What a `WatchLeases` stream follows.
pub(crate) fn watch_scope(request: v1::WatchLeasesRequest) -> Result<crate::watch::Scope, LeaseError> {
    optional_name("owner", &request.owner)?;
    optional_name("owner_prefix", &request.owner_prefix)?;
    Ok(crate::watch::Scope {
        project: if request.all_projects { None } else { Some(project(&request.project)?) },
        owner: Some(request.owner).filter(|owner| !owner.is_empty()),
        owner_prefix: Some(request.owner_prefix).filter(|prefix| !prefix.is_empty()),
    })
}

/// A non-empty name of printable characters, at most [`MAX_NAME_LEN`] bytes.
fn name(field: &'static str, value: &str) -> Result<(), LeaseError> {
    if value.is_empty() {
        return Err(invalid(field, "must not be empty"));
    }
    optional_name(field, value)
}

/// Like [`name`], but may be empty.
fn optional_name(field: &'static str, value: &str) -> Result<(), LeaseError> {
    if value.len() > MAX_NAME_LEN {
        return Err(invalid(field, format!("must be at most {MAX_NAME_LEN} bytes")));
    }
    if value.chars().any(char::is_control) {
        return Err(invalid(field, "must not contain control characters"));
    }
    Ok(())
}

/// A lease id as the ledger issues them.
pub(crate) fn lease_id(value: &str) -> Result<(), LeaseError> {
    name("lease_id", value)
}

/// A launch registration as RegisterLaunch hands it out: six `/`-separated
/// parts of printable ASCII, the last 64 hex digits.
pub(crate) fn registration(value: &str) -> Result<(), LeaseError> {
    let tag = value.rsplit('/').next().unwrap_or_default();
    let formed = value.len() <= MAX_NAME_LEN
        && value.bytes().all(|b| b.is_ascii_graphic())
        && value.split('/').count() == 6
        && tag.len() == 64
        && tag.bytes().all(|b| b.is_ascii_hexdigit());
    if formed { Ok(()) } else { Err(invalid("registration", "not a launch registration as RegisterLaunch answers it")) }
}

/// A node id: a DNS label, as identity names nodes.
pub(crate) fn node_id(node_id: &str) -> Result<(), LeaseError> {
    if berth_core::is_dns_label(node_id) {
        Ok(())
    } else {
        Err(invalid("node_id", format!("'{node_id}' is not a node id: use 1-63 lowercase letters, digits or '-'")))
    }
}

/// A tier: empty (any) or a DNS label, as identity names tiers.
pub(crate) fn tier(tier: &str) -> Result<(), LeaseError> {
    if tier.is_empty() || berth_core::is_dns_label(tier) {
        Ok(())
    } else {
        Err(invalid("tier", format!("'{tier}' is not a tier name: use 1-63 lowercase letters, digits or '-'")))
    }
}

/// A reason: empty, or one CamelCase word.
pub(crate) fn reason(value: &str) -> Result<(), LeaseError> {
    let camel = value.len() <= MAX_REASON_LEN
        && value.starts_with(|c: char| c.is_ascii_uppercase())
        && value.chars().all(|c| c.is_ascii_alphanumeric());
    if value.is_empty() || camel {
        Ok(())
    } else {
        Err(invalid("reason", format!("'{value}' is not one CamelCase word of at most {MAX_REASON_LEN} letters")))
    }
}

/// A person-readable message of bounded size.
pub(crate) fn message(value: &str) -> Result<(), LeaseError> {
    if value.len() > MAX_MESSAGE_LEN {
        Err(invalid("message", format!("must be at most {MAX_MESSAGE_LEN} bytes")))
    } else {
        Ok(())
    }
}

/// Most ports a phase report names.
const MAX_REPORTED_PORTS: usize = 32;

/// The ports a RUNNING report names: at most 32, each a DNS-label name and
/// a port from 1 to 65535, no name twice.
pub(crate) fn reported_ports(ports: &[berth_proto::types::v1::Port]) -> Result<Vec<(String, u32)>, LeaseError> {
    if ports.len() > MAX_REPORTED_PORTS {
        return Err(invalid("ports", format!("{} ports; at most {MAX_REPORTED_PORTS}", ports.len())));
    }
    let mut seen = std::collections::HashSet::new();
    let mut checked = Vec::with_capacity(ports.len());
    for (n, port) in ports.iter().enumerate() {
        if !berth_core::is_dns_label(&port.name) || !seen.insert(port.name.as_str()) {
            let reason = format!("ports[{n}].name: '{}' is not a port name used once", port.name);
            return Err(invalid("ports", reason));
        }
        if !(1..=65_535).contains(&port.port) {
            return Err(invalid("ports", format!("ports[{n}].port: {} is not a port from 1 to 65535", port.port)));
        }
        checked.push((port.name.clone(), port.port));
    }
    Ok(checked)
}

/// The phase filter of `ListLeases`: unspecified means any.
pub(crate) fn phase_filter(value: i32) -> Result<Option<Phase>, LeaseError> {
    if value == v1::LeasePhase::Unspecified as i32 {
        return Ok(None);
    }
    Phase::from_proto(value).map(Some).ok_or_else(|| invalid("phase", format!("{value} is not a lease phase")))
}

/// The phase a node reports: LAUNCHING, RUNNING, DONE or FAILED.
pub(crate) fn reported_phase(value: i32) -> Result<Phase, LeaseError> {
    match Phase::from_proto(value) {
        Some(phase) if phase.is_reportable() => Ok(phase),
        _ => Err(invalid("phase", "a node reports LAUNCHING, RUNNING, DONE or FAILED")),
    }
}

/// The leases a node names, each at an epoch, without duplicates.
pub(crate) fn lease_refs(field: &'static str, refs: &[v1::LeaseRef]) -> Result<Vec<(String, i64)>, LeaseError> {
    if refs.len() > MAX_LEASES_PER_CALL {
        return Err(invalid(field, format!("at most {MAX_LEASES_PER_CALL} leases per call")));
    }
    let mut seen = std::collections::HashSet::new();
    let mut held = Vec::with_capacity(refs.len());
    for lease in refs {
        lease_id(&lease.lease_id).map_err(|_| invalid(field, "every lease needs a lease_id"))?;
        let epoch = i64::try_from(lease.epoch).map_err(|_| invalid(field, "epoch out of range"))?;
        if seen.insert((lease.lease_id.as_str(), epoch)) {
            held.push((lease.lease_id.clone(), epoch));
        }
    }
    Ok(held)
}

/// A `RequestLease` turned into what the placer takes.
pub(crate) fn lease_ask(request: v1::RequestLeaseRequest) -> Result<LeaseAsk, LeaseError> {
    let project = project(&request.project)?;
    name("owner", &request.owner)?;
    name("idempotency_key", &request.idempotency_key)?;
    let resources = self::resources(request.resources)?;
    tier(&request.tier)?;
    optional_name("spread_group", &request.spread_group)?;
    let workload = request.workload.ok_or_else(|| invalid("workload", "must be set"))?;
    self::workload(&workload)?;
    Ok(LeaseAsk {
        project,
        owner: request.owner,
        idempotency_key: request.idempotency_key,
        resources,
        tier: request.tier,
        spread_group: request.spread_group,
        workload,
        traceparent: String::new(),
    })
}

/// A lease's size: both amounts above zero and storable.
pub(crate) fn resources(capacity: Option<Capacity>) -> Result<Resources, LeaseError> {
    let resources = Resources::from(capacity.ok_or_else(|| invalid("resources", "must be set"))?);
    if resources.cpu_millis == 0 || resources.memory_bytes == 0 {
        return Err(invalid("resources", "cpu_millis and memory_bytes must both be above zero"));
    }
    if i64::try_from(resources.cpu_millis).is_err() || i64::try_from(resources.memory_bytes).is_err() {
        return Err(invalid("resources", "out of range"));
    }
    Ok(resources)
}

/// The outcome a node reports for a resize: applied or deferred.
pub(crate) fn reported_resize(value: i32) -> Result<ResizeState, LeaseError> {
    match v1::ResizeState::try_from(value) {
        Ok(v1::ResizeState::Applied) => Ok(ResizeState::Applied),
        Ok(v1::ResizeState::Deferred) => Ok(ResizeState::Deferred),
        _ => Err(invalid("state", "a node reports RESIZE_STATE_APPLIED or RESIZE_STATE_DEFERRED")),
    }
}

fn workload(workload: &v1::Workload) -> Result<(), LeaseError> {
    if workload.bundle.is_some() && workload.image.is_some() {
        return Err(invalid("workload.image", "set either workload.bundle or workload.image, not both"));
    }
    match (workload.artifact(), workload.digest.is_empty()) {
        (None, true) if workload.command.is_empty() => {
            return Err(invalid("workload", "needs a bundle or image with its digest, or a command"));
        }
        (None, true) => {}
        (None, false) => {
            return Err(invalid("workload.bundle", "must be set (or workload.image) when workload.digest is"));
        }
        (Some(artifact), true) => {
            return Err(invalid("workload.digest", format!("must be set when workload.{} is", artifact.kind.field())));
        }
        (Some(artifact), false) => {
            sha256_digest("workload.digest", &workload.digest)?;
            if !artifact.reference.reference.ends_with(&format!("@{}", workload.digest)) {
                let field = match artifact.kind {
                    ArtifactKind::Bundle => "workload.bundle.reference",
                    ArtifactKind::Image => "workload.image.reference",
                };
                return Err(invalid(field, "must be pinned to workload.digest (repo@sha256:...)"));
            }
        }
    }
    if berth_proto::types::v1::RuntimeClass::try_from(workload.runtime).is_err() {
        return Err(invalid("workload.runtime", format!("{} is not a RuntimeClass value", workload.runtime)));
    }
    let image = workload.image.is_some();
    if let Some((field, problem)) =
        berth_core::image_settings_problems(&workload.working_dir, &workload.user, image).into_iter().next()
    {
        let field = if field == "user" { "workload.user" } else { "workload.working_dir" };
        return Err(invalid(field, problem));
    }
    if workload.env.keys().any(|key| key.is_empty() || key.contains('=') || key.contains('\0')) {
        return Err(invalid("workload.env", "names must be non-empty and hold no '=' or NUL"));
    }
    let mut names = std::collections::HashSet::new();
    for port in &workload.ports {
        if port.port == 0 || port.port > 65535 {
            return Err(invalid("workload.ports", format!("port {} is not between 1 and 65535", port.port)));
        }
        if port.name.is_empty() || !names.insert(port.name.as_str()) {
            return Err(invalid("workload.ports", "every port needs a name, unique within the workload"));
        }
    }
    let mounts = workload.cache.iter().map(|mount| (mount.key.as_str(), mount.path.as_str()));
    if let Some(problem) = berth_core::cache_mounts_problem(mounts) {
        return Err(invalid("workload.cache", problem));
    }
    if let Some(mount) =
        workload.cache.iter().find(|mount| berth_proto::types::v1::CacheCommit::try_from(mount.commit).is_err())
    {
        return Err(invalid("workload.cache", format!("{} is not a CacheCommit value", mount.commit)));
    }
    optional_name("workload.service", &workload.service)?;
    optional_name("workload.revision", &workload.revision)
}

/// A cache volume's key, as a node names it.
pub(crate) fn cache_key(key: &str) -> Result<(), LeaseError> {
    berth_core::cache_key_problem(key).map_or(Ok(()), |problem| Err(invalid("key", problem)))
}

/// The most volumes one `FollowCaches` report may name.
pub(crate) const MAX_HELD_CACHES: usize = 10_000;

/// A node's report of the cache generations it holds.
pub(crate) fn held_caches(held: Vec<v1::HeldCache>) -> Result<Vec<crate::caches::Held>, LeaseError> {
    if held.len() > MAX_HELD_CACHES {
        return Err(invalid("held", format!("names {} volumes; at most {MAX_HELD_CACHES}", held.len())));
    }
    held.into_iter()
        .map(|volume| {
            if volume.project.is_empty() || !berth_core::is_dns_label(&volume.project) {
                return Err(invalid("held.project", format!("'{}' is not a project name", volume.project)));
            }
            if let Some(problem) = berth_core::cache_key_problem(&volume.key) {
                return Err(invalid("held.key", problem));
            }
            if volume.generation == 0 {
                return Err(invalid("held.generation", format!("volume {} names generation 0", volume.key)));
            }
            Ok(crate::caches::Held { project: volume.project, key: volume.key, generation: volume.generation })
        })
        .collect()
}

/// A content digest in `field`: `sha256:` and 64 lowercase hex digits.
pub(crate) fn sha256_digest(field: &'static str, digest: &str) -> Result<(), LeaseError> {
    let hex = digest.strip_prefix("sha256:").unwrap_or_default();
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return Err(invalid(field, "must be sha256: followed by 64 lowercase hex digits"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use berth_proto::types::v1::{BundleRef, Capacity, Port};

    const DIGEST: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn request() -> v1::RequestLeaseRequest {
        v1::RequestLeaseRequest {
            project: String::new(),
            owner: "revisions/web-00001".into(),
            idempotency_key: "web-00001-0".into(),
            resources: Some(Capacity { cpu_millis: 500, memory_bytes: 256 << 20 }),
            tier: String::new(),
            spread_group: "web".into(),
            workload: Some(v1::Workload { command: "/bin/web".into(), ..Default::default() }),
        }
    }

    fn field_of(error: LeaseError) -> &'static str {
        match error {
            LeaseError::InvalidArgument { field, .. } => field,
            other => panic!("not an invalid argument: {other}"),
        }
    }

    #[test]
    fn a_good_request_lands_in_the_default_project() {
        let ask = lease_ask(request()).unwrap();
        assert_eq!(ask.project, "default");
        assert_eq!(ask.resources, Resources::new(500, 256 << 20));
    }

    #[test]
    fn each_bad_field_is_named() {
        type Spoil = Box<dyn Fn(&mut v1::RequestLeaseRequest)>;
        let cases: Vec<(&str, Spoil)> = vec![
            ("project", Box::new(|r| r.project = "Bad_Project".into())),
            ("owner", Box::new(|r| r.owner.clear())),
            ("idempotency_key", Box::new(|r| r.idempotency_key.clear())),
            ("idempotency_key", Box::new(|r| r.idempotency_key = "x".repeat(300))),
            ("resources", Box::new(|r| r.resources = None)),
            ("resources", Box::new(|r| r.resources = Some(Capacity { cpu_millis: 0, memory_bytes: 1 }))),
            ("resources", Box::new(|r| r.resources = Some(Capacity { cpu_millis: 1, memory_bytes: 0 }))),
            ("tier", Box::new(|r| r.tier = "GPU".into())),
            ("spread_group", Box::new(|r| r.spread_group = "a\nb".into())),
            ("workload", Box::new(|r| r.workload = None)),
            ("workload", Box::new(|r| r.workload = Some(v1::Workload::default()))),
            ("workload.user", Box::new(|r| r.workload.as_mut().unwrap().user = "app".into())),
            ("workload.working_dir", Box::new(|r| r.workload.as_mut().unwrap().working_dir = "/srv".into())),
            ("workload.working_dir", Box::new(|r| r.workload.as_mut().unwrap().working_dir = "srv".into())),
            ("workload.user", Box::new(|r| r.workload.as_mut().unwrap().user = "a b".into())),
        ];
        for (field, spoil) in cases {
            let mut bad = request();
            spoil(&mut bad);
            assert_eq!(field_of(lease_ask(bad).unwrap_err()), field);
        }
    }

    #[test]
    fn a_bundle_must_be_pinned_to_its_digest() {
        let bundle = |reference: &str| BundleRef { reference: reference.into(), ..Default::default() };
        let mut ok = request();
        ok.workload = Some(v1::Workload {
            bundle: Some(bundle(&format!("registry.test/web@{DIGEST}"))),
            digest: DIGEST.into(),
            ..Default::default()
        });
        assert!(lease_ask(ok.clone()).is_ok());

        let mut tag = ok.clone();
        tag.workload.as_mut().unwrap().bundle = Some(bundle("registry.test/web:v1"));
        assert_eq!(field_of(lease_ask(tag).unwrap_err()), "workload.bundle.reference");

        let mut short = ok.clone();
        short.workload.as_mut().unwrap().digest = "sha256:abc".into();
        assert_eq!(field_of(lease_ask(short).unwrap_err()), "workload.digest");

        let mut unpinned = ok;
        unpinned.workload.as_mut().unwrap().digest.clear();
        assert_eq!(field_of(lease_ask(unpinned).unwrap_err()), "workload.digest");
    }

    #[test]
    fn ports_need_unique_names_and_real_numbers() {
        let mut dup = request();
        dup.workload.as_mut().unwrap().ports =
            vec![Port { name: "http".into(), port: 80 }, Port { name: "http".into(), port: 81 }];
        assert_eq!(field_of(lease_ask(dup).unwrap_err()), "workload.ports");
        let mut zero = request();
        zero.workload.as_mut().unwrap().ports = vec![Port { name: "http".into(), port: 0 }];
        assert_eq!(field_of(lease_ask(zero).unwrap_err()), "workload.ports");
    }

    #[test]
    fn reasons_are_one_camel_case_word() {
        assert!(reason("").is_ok());
        assert!(reason("PullFailed").is_ok());
        for bad in ["pullFailed", "Pull Failed", "Pull-Failed", &"A".repeat(65)] {
            assert_eq!(field_of(reason(bad).unwrap_err()), "reason", "{bad}");
        }
    }

    #[test]
    fn nodes_report_only_what_they_observe() {
        assert_eq!(reported_phase(v1::LeasePhase::Running as i32).unwrap(), Phase::Running);
        for phase in
            [v1::LeasePhase::Released, v1::LeasePhase::Expired, v1::LeasePhase::Bound, v1::LeasePhase::Unspecified]
        {
            assert!(reported_phase(phase as i32).is_err(), "{phase:?}");
        }
        assert!(reported_phase(99).is_err());
    }

    #[test]
    fn duplicate_refs_are_folded_and_huge_lists_refused() {
        let refs = vec![
            v1::LeaseRef { lease_id: "l-1".into(), epoch: 1 },
            v1::LeaseRef { lease_id: "l-1".into(), epoch: 1 },
            v1::LeaseRef { lease_id: "l-1".into(), epoch: 2 },
        ];
        assert_eq!(lease_refs("leases", &refs).unwrap().len(), 2);
        let many = vec![v1::LeaseRef { lease_id: "l-1".into(), epoch: 1 }; MAX_LEASES_PER_CALL + 1];
        assert_eq!(field_of(lease_refs("leases", &many).unwrap_err()), "leases");
        let nameless = vec![v1::LeaseRef { lease_id: String::new(), epoch: 1 }];
        assert_eq!(field_of(lease_refs("running", &nameless).unwrap_err()), "running");
    }
}
