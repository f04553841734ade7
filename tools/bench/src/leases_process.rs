//! The leases replica under test: the real `berth-leases` binary, run as a
//! process of its own with certificate files, a store and a bus made for
//! the run, so its throughput and memory are its own.
//!
//! # What is stored
//! A temporary directory (removed at the end) with the replica's
//! certificate files and its log; its store and bus are the caller's
//! (see [`crate::process`]).

use std::net::SocketAddr;
use std::path::PathBuf;

use berth_mtls::{TlsCredentials, TlsMaterial};

use crate::process::{ChildProcess, ServiceProcessError, free_loopback_port, sibling_binary};
use crate::procfs::Memory;

/// Where and how the leases replica runs.
#[derive(Debug)]
pub(crate) struct LeasesLaunch<'a> {
    /// Its own certificate, key and CA bundle (a `leases` service identity).
    pub(crate) material: TlsMaterial,
    /// Credentials the bench probes its health with.
    pub(crate) probe: &'a TlsCredentials,
    /// Its store: `postgres://` (a scratch database) or `sqlite://` under the run's directory.
    pub(crate) database_url: String,
    /// Its bus: `redis://` or `memory://`.
    pub(crate) redis_url: String,
    /// Where it follows the node registry.
    pub(crate) identity_addr: SocketAddr,
    /// Its lease TTL in seconds.
    pub(crate) lease_ttl_seconds: u64,
    /// Where it listens; `None` picks a free loopback port.
    pub(crate) listen: Option<SocketAddr>,
}

/// A running `berth-leases`.
#[derive(Debug)]
pub(crate) struct LeasesProcess {
    child: ChildProcess,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl LeasesProcess {
    /// Writes the certificate files, starts the replica on a free loopback
    /// port and waits until it serves.
    pub(crate) async fn start(launch: LeasesLaunch<'_>) -> Result<Self, ServiceProcessError> {
        let binary = sibling_binary("berth-leases")?;
        let dir = tempfile::Builder::new()
            .prefix("berth-bench-leases-")
            .tempdir()
            .map_err(|source| ServiceProcessError::Io { what: "cannot create a temporary directory", source })?;
        let write = |name: &str, text: &str| -> Result<PathBuf, ServiceProcessError> {
            let path = dir.path().join(name);
            std::fs::write(&path, text)
                .map_err(|source| ServiceProcessError::Io { what: "cannot write a certificate file", source })?;
            Ok(path)
        };
        let cert = write("leases.crt", &launch.material.cert_chain_pem)?;
        let key = write("leases.key", &launch.material.key_pem)?;
        let ca = write("ca.crt", &launch.material.ca_bundle_pem)?;
        let addr = match launch.listen {
            Some(addr) => addr,
            None => free_loopback_port()?,
        };
        let mut command = tokio::process::Command::new(&binary);
        command
            .arg("--listen")
            .arg(addr.to_string())
            .arg("--tls-cert")
            .arg(cert)
            .arg("--tls-key")
            .arg(key)
            .arg("--ca-file")
            .arg(ca)
            .arg("--database-url")
            .arg(&launch.database_url)
            .arg("--redis-url")
            .arg(&launch.redis_url)
            .arg("--identity-addr")
            .arg(launch.identity_addr.to_string())
            .arg("--lease-ttl")
            .arg(launch.lease_ttl_seconds.to_string());
        let child = ChildProcess::spawn("berth-leases", &binary, command, dir.path().join("leases.log"))?;
        child.wait_until_serving(addr, launch.probe).await?;
        Ok(Self { child, addr, _dir: dir })
    }

    /// The replica's process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.pid()
    }

    /// Where it serves.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its resident memory now and its peak so far.
    pub(crate) fn memory(&self) -> Option<Memory> {
        self.child.memory()
    }

    /// Resolves once it has exited, with the reason as an error.
    pub(crate) async fn exited(&self) -> ServiceProcessError {
        self.child.exited().await
    }

    /// SIGTERM, then SIGKILL after [`STOP_TIMEOUT`].
    pub(crate) async fn stop(self) {
        self.child.stop().await;
    }
}
