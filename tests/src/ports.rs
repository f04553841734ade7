//! Free loopback ports for the processes the harness starts.
//!
//! A port is found by binding `127.0.0.1:0` and letting it go again, so
//! another process may take it before the harness's process binds it; on a
//! test machine that window is small, and a process that cannot bind fails
//! its start with the address named.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};

use anyhow::Context as _;

/// A loopback port nothing listens on right now.
pub fn free_port() -> anyhow::Result<u16> {
    let probe = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("cannot find a free loopback port")?;
    Ok(probe.local_addr().context("cannot find a free loopback port")?.port())
}

/// A loopback address with a free port.
pub fn free_loopback_addr() -> anyhow::Result<SocketAddr> {
    Ok(SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()?)))
}
