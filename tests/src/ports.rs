//! Free loopback ports for the processes the harness starts: drawn below
//! the kernel's ephemeral range (see [`berth_testkit::free_ports`]), so no
//! outgoing connection takes one before the harness's process binds it.

use std::net::{Ipv4Addr, SocketAddr};

/// A loopback port nothing listens on right now.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(berth_testkit::free_ports(1))
}

/// A loopback address with a free port.
pub fn free_loopback_addr() -> anyhow::Result<SocketAddr> {
    Ok(SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()?)))
}
