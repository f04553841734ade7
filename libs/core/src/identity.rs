use std::fmt;

use crate::WorkloadId;

/// The trust domain every berth identity lives under.
pub const TRUST_DOMAIN: &str = "berth.internal";

/// The zone services are named in inside the mesh: a workload reaches
/// `<service>.<project>.berth.internal` through its tenant's resolver and
/// the router, whatever public domain the router also serves.
pub const SERVICE_ZONE: &str = TRUST_DOMAIN;

/// What kind of caller an RPC may admit. `Anonymous` is a caller that
/// presented no client certificate (only `Join` and health admit it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CallerKind {
    /// No client certificate was presented.
    Anonymous,
    /// A host joined through identity; acts only on its own node id.
    Node,
    /// A control-plane service.
    Service,
    /// An operator.
    Admin,
    /// A data-plane router: reaches replicas through the agents.
    Router,
    /// A workload presenting its own X.509-SVID; acts only on what its
    /// SPIFFE ID names (its project, service and lease).
    Workload,
}

impl CallerKind {
    /// The lowercase word used in logs, errors and the SAN scheme.
    pub fn as_str(self) -> &'static str {
        match self {
            CallerKind::Anonymous => "anonymous",
            CallerKind::Node => "node",
            CallerKind::Service => "service",
            CallerKind::Admin => "admin",
            CallerKind::Router => "router",
            CallerKind::Workload => "workload",
        }
    }
}

impl fmt::Display for CallerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An authenticated identity, as named by a certificate's SAN.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Identity {
    /// `<node-id>.node.berth.internal`
    Node(String),
    /// `<service>.svc.berth.internal`
    Service(String),
    /// `<name>.admin.berth.internal`
    Admin(String),
    /// `<name>.router.berth.internal`
    Router(String),
    /// A workload's SPIFFE ID, from the URI SAN of its X.509-SVID (signed by
    /// the workload authority, never by the mesh CA).
    Workload(WorkloadId),
}

/// Why a name could not be turned into an [`Identity`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// The name is not under the berth trust domain.
    #[error("'{0}' is not a berth identity (expected <name>.<node|svc|admin|router>.{TRUST_DOMAIN})")]
    NotBerth(String),
    /// The label before the kind is not a DNS label.
    #[error(
        "'{0}' is not a valid identity name: use 1-63 lowercase letters, digits or '-', not starting or ending with '-'"
    )]
    BadName(String),
}

impl Identity {
    /// Builds a node identity, checking the id is a DNS label.
    pub fn node(id: impl Into<String>) -> Result<Self, IdentityError> {
        Self::checked(id.into(), Identity::Node)
    }

    /// Builds a service identity, checking the name is a DNS label.
    pub fn service(name: impl Into<String>) -> Result<Self, IdentityError> {
        Self::checked(name.into(), Identity::Service)
    }

    /// Builds an admin identity, checking the name is a DNS label.
    pub fn admin(name: impl Into<String>) -> Result<Self, IdentityError> {
        Self::checked(name.into(), Identity::Admin)
    }

    /// Builds a router identity, checking the name is a DNS label.
    pub fn router(name: impl Into<String>) -> Result<Self, IdentityError> {
        Self::checked(name.into(), Identity::Router)
    }

    fn checked(name: String, make: fn(String) -> Identity) -> Result<Self, IdentityError> {
        if is_dns_label(&name) { Ok(make(name)) } else { Err(IdentityError::BadName(name)) }
    }

    /// The kind of caller this identity is.
    pub fn kind(&self) -> CallerKind {
        match self {
            Identity::Node(_) => CallerKind::Node,
            Identity::Service(_) => CallerKind::Service,
            Identity::Admin(_) => CallerKind::Admin,
            Identity::Router(_) => CallerKind::Router,
            Identity::Workload(_) => CallerKind::Workload,
        }
    }

    /// The name within its kind: the node id, service name or admin name;
    /// a workload's whole SPIFFE ID.
    pub fn name(&self) -> &str {
        match self {
            Identity::Node(n) | Identity::Service(n) | Identity::Admin(n) | Identity::Router(n) => n,
            Identity::Workload(id) => id.uri(),
        }
    }

    /// The workload's SPIFFE ID, when this is a workload.
    pub fn workload(&self) -> Option<&WorkloadId> {
        match self {
            Identity::Workload(id) => Some(id),
            _ => None,
        }
    }

    /// The node id, when this is a node.
    pub fn node_id(&self) -> Option<&str> {
        match self {
            Identity::Node(n) => Some(n),
            _ => None,
        }
    }

    /// The DNS SAN that carries this identity in a certificate; `None` for
    /// a workload, which a URI SAN names.
    pub fn dns_san(&self) -> Option<String> {
        let kind = match self {
            Identity::Node(_) => "node",
            Identity::Service(_) => "svc",
            Identity::Admin(_) => "admin",
            Identity::Router(_) => "router",
            Identity::Workload(_) => return None,
        };
        Some(format!("{}.{kind}.{TRUST_DOMAIN}", self.name()))
    }

    /// The subject alternative name that carries this identity in a
    /// certificate: a DNS name, or a workload's SPIFFE ID.
    pub fn to_san(&self) -> String {
        self.dns_san().unwrap_or_else(|| self.name().to_owned())
    }

    /// Reads an identity from a DNS SAN; `Err(NotBerth)` for names outside the
    /// trust domain, which callers skip when scanning a certificate.
    pub fn from_san(san: &str) -> Result<Self, IdentityError> {
        let not_berth = || IdentityError::NotBerth(san.to_string());
        let rest = san.strip_suffix(TRUST_DOMAIN).and_then(|r| r.strip_suffix('.')).ok_or_else(not_berth)?;
        let (name, kind) = rest.rsplit_once('.').ok_or_else(not_berth)?;
        match kind {
            "node" => Identity::node(name),
            "svc" => Identity::service(name),
            "admin" => Identity::admin(name),
            "router" => Identity::router(name),
            _ => Err(not_berth()),
        }
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} '{}'", self.kind(), self.name())
    }
}

/// Whether `s` is an RFC 1123 DNS label: 1-63 of `[a-z0-9-]`, not starting or
/// ending with `-`.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && !s.starts_with('-')
        && !s.ends_with('-')
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn san_round_trips_for_every_kind() {
        for id in [
            Identity::node("n-0123").unwrap(),
            Identity::service("leases").unwrap(),
            Identity::admin("alice").unwrap(),
            Identity::router("edge-1").unwrap(),
        ] {
            assert_eq!(Identity::from_san(&id.to_san()).unwrap(), id);
        }
        assert_eq!(Identity::service("identity").unwrap().to_san(), "identity.svc.berth.internal");
    }

    #[test]
    fn names_outside_the_trust_domain_are_not_identities() {
        for san in [
            "localhost",
            "berth.internal",
            "x.berth.internal",
            "a.pod.berth.internal",
            "a.node.berth.internal.evil.com",
        ] {
            assert!(matches!(Identity::from_san(san), Err(IdentityError::NotBerth(_))), "{san}");
        }
    }

    #[test]
    fn bad_labels_are_refused() {
        for name in ["", "-a", "a-", "A", "a.b", "a_b", &"x".repeat(64)] {
            assert!(Identity::node(name).is_err(), "{name:?}");
        }
        assert!(matches!(Identity::from_san("a.b.node.berth.internal"), Err(IdentityError::BadName(_))));
    }
}
