//! The gRPC plumbing every berth process shares: an mTLS listener whose
//! credentials can be swapped live, the access layer that admits each RPC
//! only to the caller kinds its proto declares, health and reflection, the
//! server bootstrap with graceful shutdown, the mTLS client connector, and
//! the caller's side of an agent's data plane ([`tunnel`]).
//!
//! # Expected flow
//! A service binds a [`Listener`], adds its tonic services to a
//! [`ServerBuilder`], and awaits [`ServerBuilder::serve`] with a
//! `CancellationToken` that [`shutdown_signal`] cancels on SIGTERM or Ctrl-C.
//! Handlers read the caller with [`caller`] and, for node RPCs,
//! [`require_own_node`].

mod access;
mod client;
mod deadline;
pub mod invalid;
mod listener;
mod revocations;
mod server;
pub mod threads;
pub mod tunnel;

pub use access::{AccessLayer, AccessPolicy, caller, require_own_node, require_own_workload};
pub use client::{
    Channel, ClientError, FollowingChannel, PER_CALL_HEADERS, UnindexedPerCallHeaders, connect, connect_anonymous,
};
pub use listener::{EXPIRED_GRACE, Listener, PeerInfo, certificate_expired};
pub use revocations::{CertificateFloor, Revocations};
pub use server::{
    MAX_REQUEST_BYTES, READINESS_INTERVAL, READINESS_TIMEOUT, ReadinessProbe, RpcError, ServerBuilder, ServingHealth,
    shutdown_signal,
};
