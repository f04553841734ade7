//! The egress domain with no I/O: listener protocols, route actions, host
//! patterns, a service's egress selection, and the names of the conditions
//! and reasons the compiled plan reports.
//!
//! # Host patterns
//! A route names destinations as exact host names (`api.example.com`) or a
//! suffix wildcard (`*.example.com`), which matches subdomains only: it
//! matches `a.example.com` and `a.b.example.com`, never `example.com`.
//! Names are lowercase DNS names; the API refuses anything else, so matching
//! is a byte comparison.

use std::fmt;

use berth_proto::egress::v1 as proto;

/// The project an empty project field means.
pub const DEFAULT_PROJECT: &str = "default";

/// resolv.conf's `ndots` when a project's DNS config sets none.
pub const DEFAULT_NDOTS: u32 = 1;

/// The gateway a service takes when its template names none.
pub const DEFAULT_GATEWAY: &str = "default";

/// Condition on each service of a plan: whether its egress selection resolved.
pub const EGRESS_READY: &str = "EgressReady";

/// Condition on each gateway: whether it is in the plan.
pub const READY: &str = "Ready";

/// Condition on each listener, and on each parent of a route: whether it was
/// taken into the plan.
pub const ACCEPTED: &str = "Accepted";

/// Condition on a TCP listener that more than one allow route names.
pub const CONFLICTED: &str = "Conflicted";

/// Reasons the conditions above carry, one CamelCase word each.
pub mod reason {
    /// The selection, gateway, listener or parent was taken into the plan.
    pub const ACCEPTED: &str = "Accepted";
    /// The service names a gateway (or takes `default`) that does not exist.
    pub const GATEWAY_NOT_FOUND: &str = "GatewayNotFound";
    /// The service's gateway exists but no accepted route allows anything through it.
    pub const NO_ROUTES: &str = "NoRoutes";
    /// The service's template disables egress: nothing leaves it.
    pub const DISABLED: &str = "Disabled";
    /// The route's parent names a gateway or listener that does not exist.
    pub const NO_MATCHING_PARENT: &str = "NoMatchingParent";
    /// The parent exists, but none of its listeners can carry the route.
    pub const NOT_ALLOWED_BY_LISTENERS: &str = "NotAllowedByListeners";
    /// A TCP listener is named by more than one allow route; the first by name carries it.
    pub const ROUTE_CONFLICT: &str = "RouteConflict";
}

/// What a listener speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    /// A plain HTTP forward proxy; the destination is the request's Host.
    Http,
    /// An HTTP CONNECT proxy; the destination is the CONNECT authority.
    HttpsConnect,
    /// Plain TCP: each connection goes to the one destination its route names.
    Tcp,
}

impl Protocol {
    /// The protocol a proto enum value names; `None` for unspecified or unknown values.
    pub fn from_proto(value: i32) -> Option<Self> {
        match proto::ListenerProtocol::try_from(value).ok()? {
            proto::ListenerProtocol::Http => Some(Self::Http),
            proto::ListenerProtocol::HttpsConnect => Some(Self::HttpsConnect),
            proto::ListenerProtocol::Tcp => Some(Self::Tcp),
            proto::ListenerProtocol::Unspecified => None,
        }
    }

    /// The proto enum value.
    pub fn to_proto(self) -> proto::ListenerProtocol {
        match self {
            Self::Http => proto::ListenerProtocol::Http,
            Self::HttpsConnect => proto::ListenerProtocol::HttpsConnect,
            Self::Tcp => proto::ListenerProtocol::Tcp,
        }
    }

    /// The name people read, e.g. in `berth egress gateway get`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Http => "HTTP",
            Self::HttpsConnect => "HTTPS_CONNECT",
            Self::Tcp => "TCP",
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a route does with the traffic it matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RouteAction {
    /// Let it through.
    Allow,
    /// Refuse it, even when another route allows it.
    Deny,
}

impl RouteAction {
    /// The action a proto enum value names: unspecified means allow; `None`
    /// for unknown values.
    pub fn from_proto(value: i32) -> Option<Self> {
        match proto::RouteAction::try_from(value).ok()? {
            proto::RouteAction::Unspecified | proto::RouteAction::Allow => Some(Self::Allow),
            proto::RouteAction::Deny => Some(Self::Deny),
        }
    }

    /// The proto enum value.
    pub fn to_proto(self) -> proto::RouteAction {
        match self {
            Self::Allow => proto::RouteAction::Allow,
            Self::Deny => proto::RouteAction::Deny,
        }
    }
}

/// A destination host as a route names it. Patterns sort as they are
/// written (`*.example.com` before `example.com`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum HostPattern {
    /// Exactly this host name.
    Exact(String),
    /// Any subdomain of this name (written `*.name`), never the name itself.
    Suffix(String),
}

/// Why a host pattern was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostPatternError {
    /// Empty, too long, or not lowercase DNS labels separated by dots.
    #[error("'{0}' is not a host name: use lowercase DNS labels separated by '.', at most 253 bytes")]
    NotAHostName(String),
    /// A `*` anywhere but as the whole first label.
    #[error("'{0}' has a misplaced '*': a wildcard is written '*.example.com' and matches subdomains only")]
    MisplacedWildcard(String),
}

/// The longest host name DNS allows.
const MAX_HOST_NAME: usize = 253;

impl HostPattern {
    /// Reads `api.example.com` or `*.example.com`.
    pub fn parse(text: &str) -> Result<Self, HostPatternError> {
        let shown = || text.chars().take(64).collect::<String>();
        if let Some(suffix) = text.strip_prefix("*.") {
            if suffix.contains('*') {
                return Err(HostPatternError::MisplacedWildcard(shown()));
            }
            return if is_host_name(suffix) {
                Ok(Self::Suffix(suffix.to_owned()))
            } else {
                Err(HostPatternError::NotAHostName(shown()))
            };
        }
        if text.contains('*') {
            return Err(HostPatternError::MisplacedWildcard(shown()));
        }
        if is_host_name(text) { Ok(Self::Exact(text.to_owned())) } else { Err(HostPatternError::NotAHostName(shown())) }
    }

    /// Whether `host` (lowercase, no trailing dot) is a destination this pattern names.
    pub fn matches(&self, host: &str) -> bool {
        match self {
            Self::Exact(name) => host == name,
            Self::Suffix(suffix) => {
                host.len() > suffix.len() + 1
                    && host.ends_with(suffix.as_str())
                    && host.as_bytes()[host.len() - suffix.len() - 1] == b'.'
            }
        }
    }

    /// Whether it is a wildcard.
    pub fn is_wildcard(&self) -> bool {
        matches!(self, Self::Suffix(_))
    }
}

impl HostPattern {
    /// The pattern as written, byte by byte.
    fn written(&self) -> impl Iterator<Item = u8> + '_ {
        let (prefix, name): (&[u8], &str) = match self {
            Self::Exact(name) => (b"", name),
            Self::Suffix(suffix) => (b"*.", suffix),
        };
        prefix.iter().copied().chain(name.bytes())
    }
}

impl Ord for HostPattern {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.written().cmp(other.written())
    }
}

impl PartialOrd for HostPattern {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for HostPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Exact(name) => f.write_str(name),
            Self::Suffix(suffix) => write!(f, "*.{suffix}"),
        }
    }
}

/// Whether `text` is a lowercase DNS name: labels of `[a-z0-9-]` (not
/// starting or ending with `-`), separated by single dots.
fn is_host_name(text: &str) -> bool {
    !text.is_empty() && text.len() <= MAX_HOST_NAME && text.split('.').all(berth_core::is_dns_label)
}

/// Where a service's outbound traffic goes, as its template says.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Selection {
    /// Through the project's gateway of this name (`default` when the template names none).
    Gateway(String),
    /// Nowhere: nothing leaves the service.
    Disabled,
}

impl Selection {
    /// The selection a template's `egress` field makes: unset or an empty
    /// gateway means the project's `default` gateway.
    pub fn from_proto(egress: Option<&berth_proto::revisions::v1::EgressSelection>) -> Self {
        match egress {
            Some(egress) if egress.disabled => Self::Disabled,
            Some(egress) if !egress.gateway.is_empty() => Self::Gateway(egress.gateway.clone()),
            _ => Self::Gateway(DEFAULT_GATEWAY.to_owned()),
        }
    }
}

/// `project`, or the default project when empty.
pub(crate) fn project_or_default(project: &str) -> &str {
    if project.is_empty() { DEFAULT_PROJECT } else { project }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards_match_subdomains_only() {
        let wildcard = HostPattern::parse("*.example.com").unwrap();
        assert!(wildcard.matches("api.example.com"));
        assert!(wildcard.matches("a.b.example.com"));
        assert!(!wildcard.matches("example.com"));
        assert!(!wildcard.matches("badexample.com"));
        assert!(!wildcard.matches(".example.com"));
        let exact = HostPattern::parse("example.com").unwrap();
        assert!(exact.matches("example.com"));
        assert!(!exact.matches("api.example.com"));
        assert_eq!(wildcard.to_string(), "*.example.com");
    }

    #[test]
    fn malformed_host_patterns_are_refused() {
        for bad in ["", "*", "*.", "Example.com", "a..b", "-a.com", "a*.com", "*.*.com", "api.*.com", "a b.com"] {
            assert!(HostPattern::parse(bad).is_err(), "{bad:?} should be refused");
        }
        assert!(HostPattern::parse(&format!("{}.com", "a".repeat(64))).is_err());
        assert!(HostPattern::parse("localhost").is_ok());
        assert!(HostPattern::parse("10.0.0.1").is_ok());
    }

    #[test]
    fn an_unset_or_empty_selection_takes_the_default_gateway() {
        use berth_proto::revisions::v1::EgressSelection;
        assert_eq!(Selection::from_proto(None), Selection::Gateway("default".into()));
        let empty = EgressSelection::default();
        assert_eq!(Selection::from_proto(Some(&empty)), Selection::Gateway("default".into()));
        let named = EgressSelection { gateway: "corp".into(), disabled: false };
        assert_eq!(Selection::from_proto(Some(&named)), Selection::Gateway("corp".into()));
        let disabled = EgressSelection { gateway: "corp".into(), disabled: true };
        assert_eq!(Selection::from_proto(Some(&disabled)), Selection::Disabled);
    }
}
