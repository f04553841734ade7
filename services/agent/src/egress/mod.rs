//! Egress on the node: each tenant's outbound traffic held to the plan the
//! egress service compiled for it.
//!
//! - [`rules`]: a tenant's plan compiled into what each service may reach,
//!   and the verdict on one request.
//! - [`proxy`]: the HTTP forward proxy (with CONNECT) of one service.
//! - [`proxies`]: the node's proxies, one set per tenant, with their network
//!   namespaces; applies whole node states.
//! - [`netns`]: the namespaces that leave a tenant's replicas no way out
//!   but its proxy, where the agent runs as root on Linux.
//! - [`launch`]: the provider wrapper that attaches every replica to its
//!   tenant's proxy (and namespace).
//! - [`follower`]: the `WatchEgress` / `AckEgress` loop with the egress service.
//!
//! # Expected flow
//! With an egress service configured, the agent starts the proxies, wraps
//! its provider, and follows the node's egress state. A replica is attached
//! before it starts, whether or not a plan for its tenant has arrived (until
//! one does, its proxy refuses everything); each state that arrives swaps the
//! rules of every tenant at once, without restarting a listener.

mod dns;
mod follower;
mod launch;
mod netns;
mod proxies;
mod proxy;
mod rules;

pub(crate) use dns::{SERVICES_ADDR, SERVICES_PORT};
pub(crate) use follower::{EgressFollower, GrpcNodeEgress};
pub(crate) use launch::EgressProvider;
pub(crate) use netns::fnv32;
pub use netns::{NamespaceError, connect_in_namespace};
pub use proxies::{Attachment, EgressError, EgressIsolation, EgressProxies, EgressSettings, EgressStatus, Enforcement};
pub use proxy::{DEFAULT_PROXY_CONNECT_TIMEOUT, DEFAULT_PROXY_HEAD_TIMEOUT, ProxyTiming};
pub use rules::RulesError;
