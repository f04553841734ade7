//! A workload's SPIFFE ID: who a replica is, as its X.509-SVID names it in
//! its one URI subject alternative name.
//!
//! `spiffe://<trust-domain>/ns/<project>/svc/<service>/rev/<revision>/lease/<lease>`,
//! with `svc` (and with it `rev`) left out for a lease no service owns, and
//! `rev` left out for a service lease with no revision. The same type builds
//! the ID identity signs and reads it back from a certificate a caller
//! presents, so the two can never disagree on the shape.

use std::fmt;

/// The scheme every SPIFFE ID starts with.
const SCHEME: &str = "spiffe://";

/// The longest SPIFFE ID accepted (the SPIFFE specification's limit for a URI SAN).
const MAX_LEN: usize = 2048;

/// A workload's SPIFFE ID, parsed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct WorkloadId {
    uri: String,
    trust_domain: String,
    project: String,
    service: Option<String>,
    revision: Option<String>,
    lease: String,
}

/// Why a URI is not a berth workload's SPIFFE ID.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "'{uri}' is not a berth workload SPIFFE ID ({why}); expected \
     spiffe://<trust-domain>/ns/<project>[/svc/<service>[/rev/<revision>]]/lease/<lease>"
)]
pub struct WorkloadIdError {
    uri: String,
    why: &'static str,
}

impl WorkloadId {
    /// The ID of lease `lease` in `project`, of `service`'s `revision` when
    /// it has them (empty strings for none), under `trust_domain`.
    pub fn new(
        trust_domain: &str,
        project: &str,
        service: &str,
        revision: &str,
        lease: &str,
    ) -> Result<Self, WorkloadIdError> {
        let mut uri = format!("{SCHEME}{trust_domain}/ns/{project}");
        if !service.is_empty() {
            uri.push_str(&format!("/svc/{service}"));
            if !revision.is_empty() {
                uri.push_str(&format!("/rev/{revision}"));
            }
        }
        uri.push_str(&format!("/lease/{lease}"));
        Self::parse(&uri)
    }

    /// Reads a SPIFFE ID, checking every segment.
    pub fn parse(uri: &str) -> Result<Self, WorkloadIdError> {
        let refuse = |why| WorkloadIdError { uri: uri.chars().take(128).collect(), why };
        if uri.len() > MAX_LEN {
            return Err(refuse("longer than 2048 bytes"));
        }
        let rest = uri.strip_prefix(SCHEME).ok_or_else(|| refuse("not a spiffe:// URI"))?;
        let (trust_domain, path) = rest.split_once('/').ok_or_else(|| refuse("no path"))?;
        if !is_trust_domain(trust_domain) {
            return Err(refuse("the trust domain is not lowercase letters, digits, '.', '-' and '_'"));
        }
        let segments: Vec<&str> = path.split('/').collect();
        if !segments.iter().all(|s| is_segment(s)) {
            return Err(refuse("a path segment is empty, '.' or '..', or holds a character outside [A-Za-z0-9._-]"));
        }
        let (service, revision) = match segments.as_slice() {
            ["ns", _, "lease", _] => (None, None),
            ["ns", _, "svc", service, "lease", _] => (Some(*service), None),
            ["ns", _, "svc", service, "rev", revision, "lease", _] => (Some(*service), Some(*revision)),
            _ => return Err(refuse("its path has another shape")),
        };
        Ok(Self {
            uri: uri.to_owned(),
            trust_domain: trust_domain.to_owned(),
            project: segments[1].to_owned(),
            service: service.map(str::to_owned),
            revision: revision.map(str::to_owned),
            lease: segments[segments.len() - 1].to_owned(),
        })
    }

    /// The whole ID, `spiffe://...`.
    pub fn uri(&self) -> &str {
        &self.uri
    }

    /// The trust domain it is under.
    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    /// The project the workload runs in.
    pub fn project(&self) -> &str {
        &self.project
    }

    /// The service whose replica it is; `None` for a bare lease.
    pub fn service(&self) -> Option<&str> {
        self.service.as_deref()
    }

    /// The revision it runs; `None` when it runs none.
    pub fn revision(&self) -> Option<&str> {
        self.revision.as_deref()
    }

    /// The lease it runs under.
    pub fn lease(&self) -> &str {
        &self.lease
    }
}

impl fmt::Display for WorkloadId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.uri)
    }
}

/// Whether `name` is a SPIFFE trust domain berth signs for: lowercase
/// letters, digits, `.`, `-` and `_`, at most 255 bytes.
pub fn is_trust_domain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'-' | b'_'))
}

/// Whether `segment` is a SPIFFE path segment.
fn is_segment(segment: &str) -> bool {
    !segment.is_empty()
        && segment != "."
        && segment != ".."
        && segment.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_names_what_the_lease_has_and_reads_back() {
        let full = WorkloadId::new("example.org", "shop", "web", "web-00003", "l-7").unwrap();
        assert_eq!(full.uri(), "spiffe://example.org/ns/shop/svc/web/rev/web-00003/lease/l-7");
        assert_eq!(WorkloadId::parse(full.uri()).unwrap(), full);
        assert_eq!(
            (full.project(), full.service(), full.revision(), full.lease()),
            ("shop", Some("web"), Some("web-00003"), "l-7")
        );
        let bare = WorkloadId::new("example.org", "default", "", "", "l-7").unwrap();
        assert_eq!(bare.uri(), "spiffe://example.org/ns/default/lease/l-7");
        assert_eq!((bare.service(), bare.revision()), (None, None));
        let service = WorkloadId::new("example.org", "shop", "web", "", "l-7").unwrap();
        assert_eq!(service.uri(), "spiffe://example.org/ns/shop/svc/web/lease/l-7");
        assert_eq!(service.trust_domain(), "example.org");
    }

    #[test]
    fn other_uris_are_refused_with_the_reason() {
        for bad in [
            "https://example.org/ns/a/lease/b",
            "spiffe://example.org",
            "spiffe://Example.org/ns/a/lease/b",
            "spiffe://example.org/ns/a",
            "spiffe://example.org/ns/a/lease/b/extra",
            "spiffe://example.org/ns//lease/b",
            "spiffe://example.org/ns/../lease/b",
            "spiffe://example.org/ns/a/rev/r/lease/b",
            "spiffe://example.org/ns/a b/lease/c",
            "spiffe://example.org/node/n-1",
        ] {
            let error = WorkloadId::parse(bad).unwrap_err().to_string();
            assert!(error.contains("not a berth workload SPIFFE ID"), "{bad}: {error}");
        }
        assert!(WorkloadId::parse(&format!("spiffe://a/ns/b/lease/{}", "c".repeat(2100))).is_err());
    }
}
