//! Free loopback ports for servers a test starts in another process.
//!
//! A port found by binding `127.0.0.1:0` comes from the kernel's ephemeral
//! range, the same range every outgoing connection on the machine takes its
//! local port from: between the probe letting it go and the server binding
//! it, any connection may take it ("Address already in use"). Ports are
//! drawn below that range instead, where only servers bind: each process
//! starts at a random port and walks on from there, so one process never
//! hands out a port twice (its servers may not have bound the last one yet)
//! and two processes rarely meet.

use std::hash::{BuildHasher as _, Hasher as _};
use std::net::{Ipv4Addr, TcpListener};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

/// The next port this process tries; 0 until the first draw.
static NEXT: AtomicU32 = AtomicU32::new(0);

/// Serializes draws, so two threads never take the same run.
static DRAWING: Mutex<()> = Mutex::new(());

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
/// below the kernel's ephemeral range, and never handed out before by this
/// process (until it has walked the whole range).
///
/// # Panics
/// When 2,000 runs are taken (a machine whose low ports are all in use).
pub fn free_ports(count: u16) -> u16 {
    let _drawing = DRAWING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let end = u32::from(ephemeral_start().max(LOWEST + count + 1));
    let (lowest, count32) = (u32::from(LOWEST), u32::from(count));
    let span = end - lowest - count32;
    if NEXT.load(Ordering::SeqCst) == 0 {
        let random = std::collections::hash_map::RandomState::new().build_hasher().finish();
        NEXT.store(lowest + u32::try_from(random % u64::from(span)).unwrap_or(0), Ordering::SeqCst);
    }
    for _ in 0..2_000 {
        let mut first = NEXT.load(Ordering::SeqCst);
        if first < lowest || first + count32 > end {
            first = lowest;
        }
        NEXT.store(first + count32, Ordering::SeqCst);
        let first = u16::try_from(first).unwrap_or(LOWEST);
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
    fn ports_are_drawn_below_the_ephemeral_range_are_free_and_never_handed_out_twice() {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..200 {
            let first = free_ports(3);
            assert!(first >= LOWEST && first + 3 <= ephemeral_start(), "{first}");
            TcpListener::bind((Ipv4Addr::LOCALHOST, first + 2)).unwrap();
            for port in first..first + 3 {
                assert!(seen.insert(port), "port {port} handed out twice");
            }
        }
    }
}
