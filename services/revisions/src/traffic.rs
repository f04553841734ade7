//! How a service's traffic is split among its revisions: the targets
//! `SetTraffic` declares (Knative's shape: a revision or `latest`, a
//! percent, a tag), checked, stored, and resolved against the live revision
//! for the routers.
//!
//! # How it maps onto the rollout
//! A split with a `latest` target rolls out and serves the newest revision
//! as an unpinned service does; one without is pinned to its largest share
//! (the first of equals), which is what the rollout makes live. Every
//! other revision a target names is kept running beside it, as the live
//! one is, and is never released or collected while named. A pin is a
//! split of one revision at 100 percent; no split at all is `latest` at 100.
//!
//! # Invariants
//! - Stored targets are always valid: the percents sum to 100, each target
//!   names a revision or `latest` (not both), tags are distinct DNS labels
//!   that fit a host name's first label beside the service's name.
//! - What routers see ([`routed`]) is read off the stored split and the live
//!   revision of the same row, so the two never disagree.

use std::collections::HashSet;

use berth_proto::revisions::v1::{SessionAffinity, TrafficTarget};
use berth_rpc::invalid::{Checker, Invalid, shown};
use prost::Message as _;

/// How the targets (and the session affinity) are stored: their protobuf
/// encoding in one message, so a row from before affinity reads as none.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct StoredTraffic {
    #[prost(message, repeated, tag = "1")]
    pub(crate) targets: Vec<TrafficTarget>,
    #[prost(message, optional, tag = "2")]
    pub(crate) affinity: Option<SessionAffinity>,
}

impl StoredTraffic {
    pub(crate) fn encode(targets: &[TrafficTarget], affinity: Option<&SessionAffinity>) -> Vec<u8> {
        StoredTraffic { targets: targets.to_vec(), affinity: affinity.cloned() }.encode_to_vec()
    }
}

/// The longest header or cookie name an affinity may name.
const MAX_AFFINITY_NAME: usize = 64;

/// Headers that name the request itself, never a client's session.
const NOT_AFFINITY_HEADERS: [&str; 9] = [
    "host",
    "connection",
    "content-length",
    "transfer-encoding",
    "upgrade",
    "te",
    "keep-alive",
    "proxy-connection",
    "cookie",
];

/// Checks the affinity a `SetTraffic` asks for; the one to store (none when
/// both names are empty), its header name lowercased.
pub(crate) fn affinity(requested: Option<&SessionAffinity>) -> Result<Option<SessionAffinity>, Invalid> {
    let Some(requested) = requested else { return Ok(None) };
    let (header, cookie) = (requested.header.trim().to_ascii_lowercase(), requested.cookie.trim());
    let mut check = Checker::default();
    // RFC 9110 tokens: what both a header and a cookie name may be made of.
    let token = |name: &str| {
        !name.is_empty()
            && name.len() <= MAX_AFFINITY_NAME
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
    };
    match (header.is_empty(), cookie.is_empty()) {
        (true, true) => return Ok(None),
        (false, false) => check.bad("affinity", "give either a header or a cookie, not both"),
        (false, true) if !token(&header) => check.bad(
            "affinity.header",
            format!("'{}' is not a header name (1-{MAX_AFFINITY_NAME} letters, digits or -)", shown(&header)),
        ),
        (false, true) if NOT_AFFINITY_HEADERS.contains(&header.as_str()) || header.starts_with(':') => {
            check.bad("affinity.header", format!("'{header}' describes the request, not a client's session"));
        }
        (true, false) if !token(cookie) => check.bad(
            "affinity.cookie",
            format!("'{}' is not a cookie name (1-{MAX_AFFINITY_NAME} letters, digits or -)", shown(cookie)),
        ),
        _ => {}
    }
    check.finish().map(|()| Some(SessionAffinity { header, cookie: cookie.to_owned() }))
}

/// A DNS label's longest length: `<tag>--<service>` must fit one.
const MAX_LABEL: usize = 63;

/// Checks the targets a `SetTraffic` asks for, for service `service`; the
/// split to store (a pin becomes one target at 100 percent).
pub(crate) fn requested(
    service: &str,
    pinned_revision: &str,
    targets: &[TrafficTarget],
) -> Result<Vec<TrafficTarget>, Invalid> {
    let mut check = Checker::default();
    if !pinned_revision.is_empty() && !targets.is_empty() {
        check.bad("targets", "give either pinned_revision or targets, not both");
        return check.finish().map(|()| Vec::new());
    }
    if !pinned_revision.is_empty() {
        return Ok(vec![TrafficTarget {
            revision: pinned_revision.to_owned(),
            latest: false,
            percent: 100,
            tag: String::new(),
        }]);
    }
    let mut tags = HashSet::new();
    let mut sum: u64 = 0;
    for (i, target) in targets.iter().enumerate() {
        let field = |name: &str| format!("targets[{i}].{name}");
        match (target.revision.is_empty(), target.latest) {
            (true, false) => check.bad(field("revision"), "name a revision, or set latest"),
            (false, true) => check.bad(field("revision"), "must be empty when latest is set"),
            _ => {}
        }
        if !target.revision.is_empty()
            && (target.revision.len() > 128 || !target.revision.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'))
        {
            check.bad(field("revision"), format!("'{}' is not a revision name", shown(&target.revision)));
        }
        if target.percent > 100 {
            check.bad(field("percent"), format!("must be at most 100, not {}", target.percent));
        }
        sum += u64::from(target.percent);
        if !target.tag.is_empty() {
            check.dns_label(&field("tag"), &target.tag, "a tag");
            if target.tag.len() + 2 + service.len() > MAX_LABEL {
                check.bad(
                    field("tag"),
                    format!("'{}--{service}' must fit a host name label ({MAX_LABEL} characters)", target.tag),
                );
            }
            if !tags.insert(target.tag.as_str()) {
                check.bad(field("tag"), format!("'{}' is given to two targets", target.tag));
            }
        }
    }
    if !targets.is_empty() && sum != 100 {
        check.bad("targets", format!("the percents sum to {sum}, not 100"));
    }
    check.finish().map(|()| targets.to_vec())
}

/// The revision traffic is pinned to under `targets`: none when a target
/// follows the latest (or there is no split), else the largest share.
pub(crate) fn pinned(targets: &[TrafficTarget]) -> String {
    if targets.is_empty() || targets.iter().any(|t| t.latest) {
        return String::new();
    }
    let mut largest: Option<&TrafficTarget> = None;
    for target in targets {
        if largest.is_none_or(|l| target.percent > l.percent) {
            largest = Some(target);
        }
    }
    largest.map(|t| t.revision.clone()).unwrap_or_default()
}

/// The revisions `targets` name by name (not `latest`), each once.
pub(crate) fn named(targets: &[TrafficTarget]) -> Vec<&str> {
    let mut names: Vec<&str> = Vec::new();
    for target in targets.iter().filter(|t| !t.latest) {
        if !names.contains(&target.revision.as_str()) {
            names.push(&target.revision);
        }
    }
    names
}

/// The split as routers follow it: `latest` resolved to `live`; no split is
/// `live` at 100 percent; nothing while no revision is live.
///
/// A split that gives no share to `latest` or to the live revision (a pin
/// to another revision, say) takes the traffic once the rollout makes the
/// revision it pins live, which it does once that revision's replicas run:
/// until then the live revision keeps every request, and the split's tagged
/// targets are reachable by their tags already, at no percent. So a pin to
/// a revision whose replicas were stopped never leaves the service with no
/// replica to answer while they start.
pub(crate) fn routed(targets: &[TrafficTarget], live: &str) -> Vec<TrafficTarget> {
    if targets.is_empty() {
        if live.is_empty() {
            return Vec::new();
        }
        return vec![TrafficTarget { revision: live.to_owned(), latest: true, percent: 100, tag: String::new() }];
    }
    let follows_live = |target: &TrafficTarget| target.percent > 0 && (target.latest || target.revision == live);
    if !live.is_empty() && !targets.iter().any(follows_live) {
        let holding = TrafficTarget { revision: live.to_owned(), latest: false, percent: 100, tag: String::new() };
        let tagged = targets.iter().filter(|target| !target.tag.is_empty());
        return std::iter::once(holding)
            .chain(tagged.map(|target| TrafficTarget { percent: 0, ..target.clone() }))
            .collect();
    }
    targets
        .iter()
        .map(|target| {
            let mut routed = target.clone();
            if target.latest {
                routed.revision = live.to_owned();
            }
            routed
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn to(revision: &str, percent: u32, tag: &str) -> TrafficTarget {
        TrafficTarget { revision: revision.into(), latest: false, percent, tag: tag.into() }
    }

    fn latest(percent: u32) -> TrafficTarget {
        TrafficTarget { revision: String::new(), latest: true, percent, tag: String::new() }
    }

    fn fields(error: Invalid) -> Vec<String> {
        error.fields().into_iter().map(str::to_owned).collect()
    }

    #[test]
    fn an_affinity_names_one_header_or_one_cookie_and_nothing_is_none() {
        let ask = |header: &str, cookie: &str| SessionAffinity { header: header.into(), cookie: cookie.into() };
        assert_eq!(affinity(None).unwrap(), None);
        assert_eq!(affinity(Some(&ask("", ""))).unwrap(), None);
        assert_eq!(affinity(Some(&ask("X-User-Id", ""))).unwrap(), Some(ask("x-user-id", "")));
        assert_eq!(affinity(Some(&ask("", "berth-session"))).unwrap(), Some(ask("", "berth-session")));
        for (bad, field) in [
            (ask("x-user", "session"), "affinity"),
            (ask("x user", ""), "affinity.header"),
            (ask("Host", ""), "affinity.header"),
            (ask(&"h".repeat(65), ""), "affinity.header"),
            (ask("", "a=b"), "affinity.cookie"),
            (ask("", "a;b"), "affinity.cookie"),
        ] {
            let error = affinity(Some(&bad)).unwrap_err();
            assert_eq!(fields(error.clone()), [field], "{bad:?}: {error:?}");
        }
    }

    #[test]
    fn a_pin_is_one_target_at_100_and_nothing_is_latest_at_100() {
        assert_eq!(requested("web", "web-00002", &[]).unwrap(), [to("web-00002", 100, "")]);
        assert!(requested("web", "", &[]).unwrap().is_empty());
        assert_eq!(pinned(&[]), "");
        assert_eq!(routed(&[], "web-00003"), [TrafficTarget { latest: true, ..to("web-00003", 100, "") }]);
        assert!(routed(&[], "").is_empty(), "nothing is routed before a revision is live");
    }

    #[test]
    fn a_split_is_checked_whole_naming_each_bad_target() {
        let good = [to("web-00001", 90, ""), to("web-00002", 10, "canary")];
        assert_eq!(requested("web", "", &good).unwrap(), good);
        let cases: Vec<(Vec<TrafficTarget>, &str)> = vec![
            (vec![to("web-00001", 90, "")], "targets"),
            (vec![to("web-00001", 101, ""), latest(0)], "targets[0].percent"),
            (vec![to("", 100, "")], "targets[0].revision"),
            (vec![TrafficTarget { latest: true, ..to("web-00001", 100, "") }], "targets[0].revision"),
            (vec![to("web/1", 100, "")], "targets[0].revision"),
            (vec![to("web-00001", 50, "a"), to("web-00002", 50, "a")], "targets[1].tag"),
            (vec![to("web-00001", 100, "Not_A_Label")], "targets[0].tag"),
            (vec![to("web-00001", 100, &"t".repeat(60))], "targets[0].tag"),
        ];
        for (targets, field) in cases {
            let error = requested("web", "", &targets).unwrap_err();
            assert!(fields(error.clone()).contains(&field.to_owned()), "{targets:?}: {error:?}");
        }
        let both = requested("web", "web-00001", &good).unwrap_err();
        assert_eq!(fields(both), ["targets"]);
    }

    #[test]
    fn a_split_without_latest_is_pinned_to_its_largest_share_and_latest_resolves_to_the_live_revision() {
        assert_eq!(pinned(&[to("web-00001", 10, ""), to("web-00002", 90, "")]), "web-00002");
        assert_eq!(pinned(&[to("web-00001", 50, ""), to("web-00002", 50, "")]), "web-00001", "the first of equals");
        assert_eq!(pinned(&[to("web-00001", 90, ""), latest(10)]), "", "a latest target follows the rollout");
        let split = [to("web-00001", 80, "stable"), latest(20), to("web-00001", 0, "old")];
        assert_eq!(named(&split), ["web-00001"]);
        let routed = routed(&split, "web-00004");
        assert_eq!(routed[1].revision, "web-00004");
        assert!(routed[1].latest);
        assert_eq!(routed[0], split[0]);
    }

    #[test]
    fn a_split_naming_neither_latest_nor_the_live_revision_waits_for_the_rollout_with_its_tags_reachable() {
        let holding = to("web-00002", 100, "");
        // A pin to a revision that is not live yet: the live one keeps the traffic.
        assert_eq!(routed(&[to("web-00001", 100, "")], "web-00002"), std::slice::from_ref(&holding));
        let split = [to("web-00001", 90, "stable"), to("web-00003", 10, "")];
        assert_eq!(routed(&split, "web-00002"), [holding, to("web-00001", 0, "stable")]);
        // Once the rollout made the pinned revision live, the split is routed as stored.
        assert_eq!(routed(&split, "web-00001"), split);
        // A split naming the live revision is routed at once: routers send
        // a share with no replica running nothing, the rest to the others.
        let with_live = [to("web-00001", 90, ""), to("web-00002", 10, "")];
        assert_eq!(routed(&with_live, "web-00002"), with_live);
        // The live revision named for its tag alone takes no share: held too.
        let tag_only = [to("web-00001", 100, ""), to("web-00002", 0, "old")];
        assert_eq!(routed(&tag_only, "web-00002"), [to("web-00002", 100, ""), to("web-00002", 0, "old")]);
        // Before any revision is live there is nothing to hold to.
        assert_eq!(routed(&split, ""), split);
    }
}
