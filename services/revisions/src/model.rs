//! The revisions domain with no I/O: service keys, revision names, the
//! owner and idempotency keys a service's leases carry, the canonical
//! fingerprint that decides whether an apply mints, and conditions.
//!
//! # Invariants
//! - A revision is named `<service>-<generation>`, the generation zero-padded
//!   to five digits; the last `-` splits it, so two services never mint the
//!   same name.
//! - Every lease of a service incarnation has owner `revisions/<service>@<uid>`
//!   and idempotency key `<revision>/<uid>/<slot>/<attempt>`: asking again for
//!   a slot's current attempt returns the same lease, and a new attempt (a
//!   replacement) is a new lease.
//! - The fingerprint of equal declarations is equal whatever order maps were
//!   sent in and whether `replicas` was left unset or set to its default.

use std::collections::BTreeMap;
use std::fmt;

use berth_proto::revisions::v1::{ServiceTemplate, Source};
use berth_proto::types::v1::{Capacity, Condition, ConditionStatus};
use prost::Message as _;
use sha2::{Digest as _, Sha256};

use crate::config::{DEFAULT_CPU_MILLIS, DEFAULT_MEMORY_BYTES};

/// The project an empty project field means.
pub(crate) const DEFAULT_PROJECT: &str = "default";

/// Condition: the service's live revision runs every replica it should.
pub const READY: &str = "Ready";

/// Condition: the newest revision's bundle reference resolved to a digest.
pub const BUNDLE_RESOLVED: &str = "BundleResolved";

/// Condition: the revision traffic should go to is the one serving.
pub const ROLLOUT_COMPLETE: &str = "RolloutComplete";

/// A service's name within its project.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct ServiceKey {
    pub(crate) project: String,
    pub(crate) name: String,
}

impl ServiceKey {
    pub(crate) fn new(project: impl Into<String>, name: impl Into<String>) -> Self {
        Self { project: project.into(), name: name.into() }
    }

    /// `project/name`, as the bus carries it.
    pub(crate) fn encode(&self) -> String {
        format!("{}/{}", self.project, self.name)
    }

    /// The inverse of [`ServiceKey::encode`].
    pub(crate) fn decode(text: &str) -> Option<Self> {
        let (project, name) = text.split_once('/')?;
        (!project.is_empty() && !name.is_empty()).then(|| Self::new(project, name))
    }
}

impl fmt::Display for ServiceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.project, self.name)
    }
}

/// The name of `service`'s revision minted at `generation`.
pub(crate) fn revision_name(service: &str, generation: i64) -> String {
    format!("{service}-{generation:05}")
}

/// The owner recorded on every lease of one incarnation of a service.
pub(crate) fn lease_owner(service: &str, uid: &str) -> String {
    format!("{LEASE_OWNER_PREFIX}{service}@{uid}")
}

/// What the owner of every lease revisions asks for starts with.
pub(crate) const LEASE_OWNER_PREFIX: &str = "revisions/";

/// The service a lease owner [`lease_owner`] made names; `None` for any other owner.
pub(crate) fn service_of_owner(owner: &str) -> Option<&str> {
    // A service name is a DNS label: the first `@` ends it.
    let (service, _uid) = owner.strip_prefix(LEASE_OWNER_PREFIX)?.split_once('@')?;
    (!service.is_empty()).then_some(service)
}

/// Which lease of a revision an idempotency key names: replica `slot`, the
/// `attempt`th lease asked for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SlotKey {
    pub(crate) revision: String,
    pub(crate) uid: String,
    pub(crate) slot: u32,
    pub(crate) attempt: u32,
}

impl SlotKey {
    pub(crate) fn encode(&self) -> String {
        format!("{}/{}/{}/{}", self.revision, self.uid, self.slot, self.attempt)
    }

    pub(crate) fn decode(key: &str) -> Option<Self> {
        let mut parts = key.split('/');
        let revision = parts.next()?.to_owned();
        let uid = parts.next()?.to_owned();
        let slot = parts.next()?.parse().ok()?;
        let attempt = parts.next()?.parse().ok()?;
        if parts.next().is_some() || revision.is_empty() || uid.is_empty() {
            return None;
        }
        Some(Self { revision, uid, slot, attempt })
    }
}

/// A fresh incarnation id for a service.
pub(crate) fn new_uid() -> String {
    hex::encode(rand::random::<[u8; 6]>())
}

/// The replicas a template asks for: unset means one.
pub(crate) fn replicas(template: &ServiceTemplate) -> u32 {
    template.replicas.unwrap_or(1)
}

/// The compute each replica of `template` reserves: its resources, or the
/// defaults when it leaves them unset.
pub(crate) fn resources(template: &ServiceTemplate) -> Capacity {
    template
        .resources
        .filter(|r| r.cpu_millis > 0 && r.memory_bytes > 0)
        .unwrap_or(Capacity { cpu_millis: DEFAULT_CPU_MILLIS, memory_bytes: DEFAULT_MEMORY_BYTES })
}

/// Whether `a` and `b` run the same thing the same way, their resources
/// aside: what lets a replica of one serve as the other once resized.
pub(crate) fn differs_only_in_resources(a: &ServiceTemplate, b: &ServiceTemplate) -> bool {
    let without = |template: &ServiceTemplate| ServiceTemplate {
        resources: None,
        replicas: Some(replicas(template)),
        ..template.clone()
    };
    without(a) == without(b)
}

/// The SHA-256 (hex) of the canonical encoding of a declaration: the
/// protobuf encoding with maps taken out and appended sorted, and `replicas`
/// set to what it means.
pub(crate) fn fingerprint(template: &ServiceTemplate, source: &Source) -> String {
    let mut template = template.clone();
    template.replicas = Some(replicas(&template));
    let env: BTreeMap<String, String> = std::mem::take(&mut template.env).into_iter().collect();
    let mut source = source.clone();
    let labels: BTreeMap<String, String> = std::mem::take(&mut source.labels).into_iter().collect();

    let mut hasher = Sha256::new();
    let mut part = |bytes: &[u8]| {
        hasher.update((bytes.len() as u64).to_be_bytes());
        hasher.update(bytes);
    };
    part(&template.encode_to_vec());
    part(&source.encode_to_vec());
    for map in [&env, &labels] {
        part(&(map.len() as u64).to_be_bytes());
        for (key, value) in map {
            part(key.as_bytes());
            part(value.as_bytes());
        }
    }
    hex::encode(hasher.finalize())
}

pub(crate) use berth_proto::timestamp_from_ms as timestamp;

/// A condition as it should read now, before its transition time is settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Observed {
    pub(crate) kind: &'static str,
    pub(crate) status: ConditionStatus,
    pub(crate) reason: String,
    pub(crate) message: String,
}

impl Observed {
    pub(crate) fn new(
        kind: &'static str,
        status: ConditionStatus,
        reason: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Self { kind, status, reason: reason.into(), message: message.into() }
    }

    pub(crate) fn holds(kind: &'static str) -> Self {
        Self::new(kind, ConditionStatus::True, "", "")
    }
}

/// Sets `observed` in `conditions`, keeping its transition time when its
/// status did not change.
pub(crate) fn set_condition(conditions: &mut Vec<Condition>, observed: &Observed, now_ms: i64, generation: u64) {
    let status = observed.status as i32;
    match conditions.iter_mut().find(|c| c.r#type == observed.kind) {
        Some(existing) => {
            if existing.status != status {
                existing.status = status;
                existing.last_transition_time = Some(timestamp(now_ms));
            }
            existing.reason.clone_from(&observed.reason);
            existing.message.clone_from(&observed.message);
            existing.observed_generation = generation;
        }
        None => conditions.push(Condition {
            r#type: observed.kind.to_owned(),
            status,
            reason: observed.reason.clone(),
            message: observed.message.clone(),
            last_transition_time: Some(timestamp(now_ms)),
            observed_generation: generation,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn revision_names_sort_by_generation_and_never_collide() {
        assert_eq!(revision_name("web", 3), "web-00003");
        assert_ne!(revision_name("web-00001", 1), revision_name("web", 1));
    }

    #[test]
    fn a_lease_owner_names_its_service_and_no_other_owner_does() {
        assert_eq!(service_of_owner(&lease_owner("web", "u-1")), Some("web"));
        assert_eq!(service_of_owner(&lease_owner("a-b", "u@2")), Some("a-b"), "the name ends at the first @");
        for other in ["load", "revisions/", "revisions/web", "revisions/@u-1", "egress/web@u-1"] {
            assert_eq!(service_of_owner(other), None, "{other}");
        }
    }

    #[test]
    fn slot_keys_round_trip_and_refuse_other_shapes() {
        let key = SlotKey { revision: "web-00002".into(), uid: "abc".into(), slot: 1, attempt: 4 };
        assert_eq!(SlotKey::decode(&key.encode()), Some(key));
        assert_eq!(SlotKey::decode("web-00002/abc/1"), None);
        assert_eq!(SlotKey::decode("web-00002/abc/x/1"), None);
        assert_eq!(SlotKey::decode("web-00002/abc/1/1/9"), None);
    }

    #[test]
    fn a_fingerprint_ignores_map_order_and_the_default_replica_count() {
        let mut a = ServiceTemplate::default();
        let mut b = ServiceTemplate { replicas: Some(1), ..Default::default() };
        for n in 0..20 {
            a.env.insert(format!("K{n}"), n.to_string());
        }
        for n in (0..20).rev() {
            b.env.insert(format!("K{n}"), n.to_string());
        }
        assert_eq!(fingerprint(&a, &Source::default()), fingerprint(&b, &Source::default()));
        b.env.insert("K0".into(), "changed".into());
        assert_ne!(fingerprint(&a, &Source::default()), fingerprint(&b, &Source::default()));
        let labelled = Source { labels: [("pipeline".into(), "1".into())].into(), ..Default::default() };
        assert_ne!(fingerprint(&a, &Source::default()), fingerprint(&a, &labelled));
    }

    #[test]
    fn a_condition_keeps_its_transition_time_while_its_status_holds() {
        let mut conditions = Vec::new();
        let failing = Observed::new(BUNDLE_RESOLVED, ConditionStatus::False, "TagNotFound", "no tag");
        set_condition(&mut conditions, &failing, 1_000, 1);
        let still = Observed::new(BUNDLE_RESOLVED, ConditionStatus::False, "RegistryUnavailable", "down");
        set_condition(&mut conditions, &still, 2_000, 1);
        assert_eq!(conditions[0].last_transition_time, Some(timestamp(1_000)));
        assert_eq!(conditions[0].reason, "RegistryUnavailable");
        set_condition(&mut conditions, &Observed::holds(BUNDLE_RESOLVED), 3_000, 2);
        assert_eq!(conditions[0].last_transition_time, Some(timestamp(3_000)));
        assert_eq!(conditions[0].observed_generation, 2);
        assert_eq!(conditions.len(), 1);
    }
}
