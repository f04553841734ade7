//! Which identity replica a node talks to when it is given several
//! (`--server a:7443,b:7443,c:7443`).
//!
//! A node holds one connection to identity, and a fleet's connections are
//! what an identity replica's memory is spent on, so the fleet must spread
//! across the replicas and stay spread:
//! - every node prefers the replica its node id hashes to
//!   ([`preferred_index`]), so a fleet spreads evenly without coordination,
//!   and the same fleet spreads the same way after every restart;
//! - a heartbeat that fails moves the node on to the next replica in the
//!   list, so a replica's loss costs its nodes one failed heartbeat each;
//! - a node away from its preferred replica goes back to it after
//!   [`RETURN_AFTER`], so a replica that comes back gets its share again.
//!
//! A join has no node id yet: it starts at a random replica and tries each
//! in turn until one answers.
//!
//! A single DNS name that resolves to several addresses spreads the same
//! way one level down: every connection dials them in a random order (see
//! `berth_rpc`'s connector).

use std::time::Duration;

use tokio::time::Instant;

/// How long a node stays on a replica other than its preferred one before
/// it goes back to try the preferred one again.
pub(crate) const RETURN_AFTER: Duration = Duration::from_secs(60);

/// The identity addresses in `list` (`host:port`, comma separated), in order.
pub(crate) fn parse(list: &str) -> Result<Vec<String>, String> {
    let addrs: Vec<String> = list.split(',').map(|addr| addr.trim().to_string()).collect();
    if addrs.iter().all(String::is_empty) {
        return Err("server: the identity service address (host:port) is required".into());
    }
    for addr in &addrs {
        let port = addr.rsplit_once(':').map(|(host, port)| (host, port.parse::<u16>()));
        match port {
            Some((host, Ok(port))) if !host.is_empty() && port > 0 => {}
            _ => {
                return Err(format!(
                    "server: {addr:?} is not host:port (several identity replicas are given as \
                     host:port,host:port)"
                ));
            }
        }
    }
    Ok(addrs)
}

/// The replica, of `count`, that the node `node_id` prefers: the same for
/// the same node and list across restarts and releases, and even across a
/// fleet (FNV-1a of the id, as the agent's other stable names use).
pub fn preferred_index(node_id: &str, count: usize) -> usize {
    usize::try_from(crate::egress::fnv32(node_id.as_bytes())).unwrap_or(0) % count.max(1)
}

/// The replica a node's heartbeats go to, and where they go next.
#[derive(Debug, Clone)]
pub(crate) struct IdentityServers {
    addrs: Vec<String>,
    preferred: usize,
    current: usize,
    /// When the node left its preferred replica; `None` while on it.
    away_since: Option<Instant>,
}

impl IdentityServers {
    /// The list `addrs` (never empty: [`parse`] refuses that) as the node
    /// `node_id` uses it, starting at its preferred replica.
    pub(crate) fn new(addrs: Vec<String>, node_id: &str) -> Self {
        let preferred = preferred_index(node_id, addrs.len());
        Self { addrs, preferred, current: preferred, away_since: None }
    }

    /// The replica to talk to now.
    pub(crate) fn current(&self) -> &str {
        &self.addrs[self.current]
    }

    /// Whether there is another replica to move to.
    pub(crate) fn several(&self) -> bool {
        self.addrs.len() > 1
    }

    /// A call to the current replica failed: moves on to the next one.
    /// Returns whether the replica changed.
    pub(crate) fn failed(&mut self, now: Instant) -> bool {
        if !self.several() {
            return false;
        }
        self.current = (self.current + 1) % self.addrs.len();
        if self.current == self.preferred {
            self.away_since = None;
        } else {
            self.away_since.get_or_insert(now);
        }
        true
    }

    /// After a call that was answered: goes back to the preferred replica
    /// once the node has been away from it for [`RETURN_AFTER`]. Returns
    /// whether the replica changed.
    pub(crate) fn answered(&mut self, now: Instant) -> bool {
        match self.away_since {
            Some(since) if now.duration_since(since) >= RETURN_AFTER => {
                self.current = self.preferred;
                self.away_since = None;
                true
            }
            _ => false,
        }
    }
}

/// `addrs` in the order a join tries them: all of them, from a random one.
pub(crate) fn join_order(addrs: &[String]) -> impl Iterator<Item = &str> {
    let start = if addrs.is_empty() { 0 } else { rand::random_range(0..addrs.len()) };
    addrs.iter().cycle().skip(start).take(addrs.len()).map(String::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(addrs: &[&str]) -> Vec<String> {
        addrs.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn a_list_of_host_ports_is_read_in_order_and_a_bad_entry_is_named() {
        assert_eq!(parse("a:1, b:2,c:3").unwrap(), list(&["a:1", "b:2", "c:3"]));
        assert_eq!(parse("identity:7443").unwrap(), list(&["identity:7443"]));
        assert_eq!(parse("[::1]:7443").unwrap(), list(&["[::1]:7443"]));
        assert!(parse(" ").unwrap_err().contains("is required"));
        let error = parse("a:1,,b:2").unwrap_err();
        assert!(error.contains(r#""" is not host:port"#), "{error}");
        let error = parse("a:1,b").unwrap_err();
        assert!(error.contains(r#""b" is not host:port"#), "{error}");
        assert!(parse("a:0").unwrap_err().contains(r#""a:0""#));
    }

    #[test]
    fn a_fleet_spreads_evenly_over_the_replicas() {
        let mut counts = [0_u32; 3];
        for node in 0..3000 {
            counts[preferred_index(&format!("node-{node:016x}"), 3)] += 1;
        }
        for count in counts {
            assert!((900..=1100).contains(&count), "{counts:?}");
        }
        assert_eq!(preferred_index("n", 1), 0);
        assert_eq!(preferred_index("n", 0), 0);
    }

    #[test]
    fn a_failure_moves_on_and_the_node_goes_back_to_its_replica_later() {
        let start = Instant::now();
        let mut servers = IdentityServers::new(list(&["a:1", "b:2", "c:3"]), "node-1");
        let home = servers.current().to_string();
        assert!(servers.failed(start));
        let away = servers.current().to_string();
        assert_ne!(away, home);
        assert!(!servers.answered(start + RETURN_AFTER / 2), "too early to go back");
        assert_eq!(servers.current(), away);
        assert!(servers.answered(start + RETURN_AFTER));
        assert_eq!(servers.current(), home);
        // Every replica failing in turn brings the node round to its own.
        for _ in 0..3 {
            servers.failed(start);
        }
        assert_eq!(servers.current(), home);
        assert!(!servers.answered(start + RETURN_AFTER * 2), "home: nothing to go back to");
    }

    #[test]
    fn one_replica_is_never_left() {
        let mut servers = IdentityServers::new(list(&["a:1"]), "node-1");
        assert!(!servers.failed(Instant::now()));
        assert_eq!(servers.current(), "a:1");
    }

    #[test]
    fn a_join_tries_every_replica_once() {
        let addrs = list(&["a:1", "b:2", "c:3"]);
        for _ in 0..20 {
            let mut order: Vec<&str> = join_order(&addrs).collect();
            order.sort_unstable();
            assert_eq!(order, ["a:1", "b:2", "c:3"]);
        }
    }
}
