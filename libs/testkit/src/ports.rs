//! Free loopback ports for servers a test starts in another process.
//!
//! A port found by binding `127.0.0.1:0` comes from the kernel's ephemeral
//! range, the same range every outgoing connection on the machine takes its
//! local port from: between the probe letting it go and the server binding
//! it, any connection may take it ("Address already in use"). Ports are
//! drawn at random below that range instead, where only servers bind.

use std::hash::{BuildHasher as _, Hasher as _};
use std::net::{Ipv4Addr, TcpListener};

/// Where the draw starts: above the ports well-known services use.
const LOWEST: u16 = 10_000;

/// The first of the kernel's ephemeral ports (32768 unless set otherwise).
fn ephemeral_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// The first of `count` consecutive loopback ports nothing listens on now,
/// drawn at random below the kernel's ephemeral range.
///
/// # Panics
/// When 200 draws find no such run (a machine whose low ports are all taken).
pub fn free_ports(count: u16) -> u16 {
    let end = ephemeral_start().max(LOWEST + count + 1);
    let span = u64::from(end - LOWEST - count);
    for _ in 0..200 {
        let random = std::collections::hash_map::RandomState::new().build_hasher().finish();
        let first = LOWEST + u16::try_from(random % span).unwrap_or(0);
        if (0..count).all(|i| TcpListener::bind((Ipv4Addr::LOCALHOST, first + i)).is_ok()) {
            return first;
        }
    }
    panic!("no {count} consecutive free loopback ports below {end}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_drawn_below_the_ephemeral_range_and_are_free() {
        for _ in 0..20 {
            let first = free_ports(3);
            assert!(first >= LOWEST && first + 3 <= ephemeral_start(), "{first}");
            TcpListener::bind((Ipv4Addr::LOCALHOST, first + 2)).unwrap();
        }
    }
}
