//! Who a replica is: the name it campaigns under for its service's elected
//! loops. (Its host's wall clock, in the epoch milliseconds berth stores
//! time in, is `berth_core::wall_clock_ms`, re-exported here.)

/// `<host>-<random>`: the pod or host name when the environment names one
/// (`HOSTNAME`, else `service`), so operators can tell which replica leads,
/// and eight random hex digits so two replicas on one host never share it.
pub fn replica_id(service: &str) -> String {
    let host = std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty() && h.len() <= 64);
    let suffix: String = rand::random::<[u8; 4]>().iter().map(|b| format!("{b:02x}")).collect();
    format!("{}-{suffix}", host.as_deref().unwrap_or(service))
}

pub use berth_core::wall_clock_ms;

#[cfg(test)]
mod tests {
    #[test]
    fn two_replicas_on_one_host_get_different_ids_that_name_it() {
        let (a, b) = (super::replica_id("leases"), super::replica_id("leases"));
        assert_ne!(a, b);
        let host = std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty() && h.len() <= 64);
        let prefix = format!("{}-", host.as_deref().unwrap_or("leases"));
        for id in [&a, &b] {
            let suffix = id.strip_prefix(&prefix).unwrap_or_else(|| panic!("{id} does not start with {prefix}"));
            assert!(suffix.len() == 8 && suffix.chars().all(|c| c.is_ascii_hexdigit()), "{id}");
        }
    }
}
