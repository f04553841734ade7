//! The access layer: every RPC is admitted only to the caller kinds its
//! proto declares (`option (berth.auth.v1.access)`), before the handler runs.
//!
//! # Rules
//! - `grpc.health.v1.Health` admits anyone, certificate or not, so probes
//!   and load balancers can ask.
//! - A berth RPC admits the kinds in its declaration. A caller with no
//!   certificate gets `UNAUTHENTICATED`; a caller of another kind gets
//!   `PERMISSION_DENIED` naming who it is and who may call.
//! - Anything else (reflection, an unknown path) admits any caller with a
//!   verified certificate; tonic answers `UNIMPLEMENTED` for unknown paths.
//! - A node in the [`Revocations`] set gets `PERMISSION_DENIED` on every
//!   RPC, health included, whatever its certificate says; so does a node
//!   presenting a certificate issued before its floor (superseded by a
//!   renewal or a rejoin).
//! - Node RPCs additionally act only on the caller's own node id; the
//!   handler checks that with [`require_own_node`], since the id lives in
//!   the request body.
//! - Workload callers (an X.509-SVID's SPIFFE ID) act only on what their
//!   ID names; a handler admitting them checks the request against it with
//!   [`require_own_workload`] before it looks anything up, so a workload
//!   cannot tell another tenant's names from missing ones.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use berth_core::{CallerKind, Identity, WorkloadId};
use tonic::Status;

use crate::listener::PeerInfo;
use crate::revocations::Revocations;

const HEALTH_PREFIX: &str = "/grpc.health.v1.Health/";

/// Which caller kinds each RPC path admits.
#[derive(Clone, Copy)]
pub struct AccessPolicy {
    lookup: fn(&str) -> Option<&'static [CallerKind]>,
}

impl std::fmt::Debug for AccessPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AccessPolicy").finish_non_exhaustive()
    }
}

impl Default for AccessPolicy {
    fn default() -> Self {
        Self::berth()
    }
}

impl AccessPolicy {
    /// The declarations of the berth API.
    pub fn berth() -> Self {
        Self { lookup: berth_proto::access::allowed }
    }

    /// A policy from a lookup function, for services outside the berth API
    /// (tests, mostly).
    pub fn from_fn(lookup: fn(&str) -> Option<&'static [CallerKind]>) -> Self {
        Self { lookup }
    }

    /// Decides whether `identity` may call `path`.
    pub fn check(&self, path: &str, identity: Option<&Identity>) -> Result<(), Status> {
        if path.starts_with(HEALTH_PREFIX) {
            return Ok(());
        }
        let kind = identity.map_or(CallerKind::Anonymous, Identity::kind);
        match (self.lookup)(path) {
            Some(allowed) if allowed.contains(&kind) => Ok(()),
            Some(allowed) => match identity {
                None => Err(Status::unauthenticated(format!(
                    "{path} needs a client certificate signed by the berth CA (allowed: {})",
                    list(allowed)
                ))),
                Some(id) => {
                    Err(Status::permission_denied(format!("{id} may not call {path} (allowed: {})", list(allowed))))
                }
            },
            None if identity.is_some() => Ok(()),
            None => Err(Status::unauthenticated(format!("{path} needs a client certificate signed by the berth CA"))),
        }
    }
}

fn list(kinds: &[CallerKind]) -> String {
    kinds.iter().map(|k| k.as_str()).collect::<Vec<_>>().join(", ")
}

/// Tower layer applying an [`AccessPolicy`] and the revocation set to every
/// request.
#[derive(Debug, Clone, Default)]
pub struct AccessLayer {
    policy: AccessPolicy,
    revocations: Revocations,
}

impl AccessLayer {
    /// A layer enforcing `policy` and refusing the nodes in `revocations`.
    pub fn new(policy: AccessPolicy, revocations: Revocations) -> Self {
        Self { policy, revocations }
    }
}

impl<S> tower_layer::Layer<S> for AccessLayer {
    type Service = Access<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Access { inner, policy: self.policy, revocations: self.revocations.clone() }
    }
}

/// The service [`AccessLayer`] produces.
#[derive(Debug, Clone)]
pub struct Access<S> {
    inner: S,
    policy: AccessPolicy,
    revocations: Revocations,
}

impl<S> Access<S> {
    fn decide(&self, path: &str, peer: Option<&PeerInfo>) -> Result<(), Status> {
        let identity = peer.and_then(|p| p.identity.as_ref());
        if let Some(node) = identity.and_then(Identity::node_id) {
            if self.revocations.is_revoked(node) {
                return Err(Status::permission_denied(format!("node '{node}' is revoked")));
            }
            if let Some(issued) = peer.and_then(|p| p.issued_at)
                && let Some(why) = self.revocations.superseded(node, issued)
            {
                return Err(Status::permission_denied(why));
            }
        }
        self.policy.check(path, identity)
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B, ResBody> tower_service::Service<http::Request<B>> for Access<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: Default + Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let peer = req.extensions().get::<PeerInfo>();
        match self.decide(req.uri().path(), peer) {
            Ok(()) => Box::pin(self.inner.call(req)),
            Err(status) => {
                tracing::info!(path = req.uri().path(), code = ?status.code(), message = status.message(), "call refused");
                Box::pin(std::future::ready(Ok(status.into_http())))
            }
        }
    }
}

/// The verified identity of the caller of `req`; `UNAUTHENTICATED` when it
/// presented no certificate.
pub fn caller<T>(req: &tonic::Request<T>) -> Result<&Identity, Status> {
    req.extensions()
        .get::<PeerInfo>()
        .and_then(|p| p.identity.as_ref())
        .ok_or_else(|| Status::unauthenticated("this call needs a client certificate signed by the berth CA"))
}

/// Checks that the caller is the node `node_id` names, and returns it.
pub fn require_own_node<'a, T>(req: &'a tonic::Request<T>, node_id: &str) -> Result<&'a str, Status> {
    let id = caller(req)?;
    match id.node_id() {
        Some(own) if own == node_id => Ok(own),
        Some(own) => {
            Err(Status::permission_denied(format!("node '{own}' may act only on its own node id, not '{node_id}'")))
        }
        None => Err(Status::permission_denied(format!("{id} is not a node"))),
    }
}

/// Holds a workload caller to what its SPIFFE ID names. Any other caller
/// passes (the access layer already admitted its kind); a workload passes
/// when `owns` holds for its ID, and otherwise gets `PERMISSION_DENIED`
/// naming it and `what` it asked for.
pub fn require_own_workload<T>(
    req: &tonic::Request<T>,
    what: impl FnOnce() -> String,
    owns: impl FnOnce(&WorkloadId) -> bool,
) -> Result<(), Status> {
    let workload = req.extensions().get::<PeerInfo>().and_then(|p| p.identity.as_ref()).and_then(Identity::workload);
    match workload {
        Some(id) if !owns(id) => Err(Status::permission_denied(format!(
            "workload '{id}' may read only what its SPIFFE ID names, not {}",
            what()
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(path: &str) -> Option<&'static [CallerKind]> {
        match path {
            "/t.A/AdminOnly" => Some(&[CallerKind::Admin]),
            "/t.A/Open" => Some(&[CallerKind::Anonymous, CallerKind::Node]),
            _ => None,
        }
    }

    #[test]
    fn decisions_follow_the_declared_kinds() {
        let p = AccessPolicy::from_fn(table);
        let admin = Identity::admin("ops").unwrap();
        let node = Identity::node("n1").unwrap();
        assert!(p.check("/t.A/AdminOnly", Some(&admin)).is_ok());
        assert_eq!(p.check("/t.A/AdminOnly", Some(&node)).unwrap_err().code(), tonic::Code::PermissionDenied);
        assert_eq!(p.check("/t.A/AdminOnly", None).unwrap_err().code(), tonic::Code::Unauthenticated);
        assert!(p.check("/t.A/Open", None).is_ok());
        assert!(p.check("/grpc.health.v1.Health/Check", None).is_ok());
        assert!(p.check("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", Some(&node)).is_ok());
        assert_eq!(
            p.check("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", None).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
    }

    #[test]
    fn denial_names_the_caller_and_the_allowed_kinds() {
        let p = AccessPolicy::from_fn(table);
        let node = Identity::node("n1").unwrap();
        let msg = p.check("/t.A/AdminOnly", Some(&node)).unwrap_err().message().to_string();
        assert!(msg.contains("node 'n1'") && msg.contains("allowed: admin"), "{msg}");
    }
}
