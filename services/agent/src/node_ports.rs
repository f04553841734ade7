//! The range of host ports a node gives its workloads (`--node-ports`),
//! as Kubernetes has a NodePort range.
//!
//! Why a range of its own: a port found by binding port 0 comes from the
//! kernel's ephemeral range, the one every outgoing connection on the host
//! takes its local port from. Between the node giving a workload its port
//! and the workload binding it, any connection (a tunnel, a proxy's
//! upstream, a pull) may take it, and the workload fails to listen. The
//! default range lies above Linux's default ephemeral range (32768-60999),
//! where the kernel never picks a local port, and away from Kubernetes'
//! NodePorts (30000-32767), whose traffic kube-proxy redirects.
//!
//! # Invariants
//! - A range read from the flag holds at least one port and never port 0;
//!   one built by hand is walked as one port when its bounds are the wrong
//!   way round, and the node never hands out port 0 (see
//!   `crate::instances::PortBook`).
//! - The agent says at start, in a warning naming both, when its range
//!   overlaps the host's ephemeral range; it still runs (the operator
//!   chose both).

use std::fmt;

/// Host ports `first..=last`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodePorts {
    /// The first port of the range.
    pub first: u16,
    /// The last port of the range, included.
    pub last: u16,
}

impl Default for NodePorts {
    /// 61000-65535: above Linux's default ephemeral range.
    fn default() -> Self {
        Self { first: 61_000, last: 65_535 }
    }
}

impl fmt::Display for NodePorts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

impl std::str::FromStr for NodePorts {
    type Err = String;

    /// `FIRST-LAST`, both included, neither 0.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |why: &str| format!("'{s}' is not a port range ({why}): expected FIRST-LAST, e.g. 61000-65535");
        let (first, last) = first_last::<u16>(s).map_err(|why| match why {
            SpanError::NotANumber => bad("a port is a number from 1 to 65535"),
            why => bad(why.as_str()),
        })?;
        if first == 0 {
            return Err(bad("port 0 is no port"));
        }
        Ok(Self { first, last })
    }
}

/// Why a `FIRST-LAST` span did not read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SpanError {
    NoDash,
    NotANumber,
    Backwards,
}

impl SpanError {
    fn as_str(self) -> &'static str {
        match self {
            SpanError::NoDash => "no '-'",
            SpanError::NotANumber => "not a number",
            SpanError::Backwards => "the last is below the first",
        }
    }
}

/// The bounds of a `FIRST-LAST` span (white space around each allowed),
/// the last no lower than the first: the shape of the node's port range and
/// of its workload uids.
pub(crate) fn first_last<T: std::str::FromStr + PartialOrd>(s: &str) -> Result<(T, T), SpanError> {
    let (first, last) = s.split_once('-').ok_or(SpanError::NoDash)?;
    let number = |text: &str| text.trim().parse::<T>().map_err(|_| SpanError::NotANumber);
    let (first, last) = (number(first)?, number(last)?);
    if last < first {
        return Err(SpanError::Backwards);
    }
    Ok((first, last))
}

impl NodePorts {
    /// How many ports the range holds (one, for a range built by hand with
    /// its bounds the wrong way round).
    pub(crate) fn len(&self) -> usize {
        usize::from(self.last.saturating_sub(self.first)) + 1
    }

    /// The `index`th port of the range, counted from `start`'s place and
    /// wrapping at its end.
    pub(crate) fn nth_from(&self, start: usize, index: usize) -> u16 {
        let offset = (start + index) % self.len();
        self.first + u16::try_from(offset).unwrap_or(0)
    }

    /// The host's ephemeral range where it overlaps this one, as
    /// `/proc/sys/net/ipv4/ip_local_port_range` gives it (`None` where it
    /// does not overlap or cannot be read).
    pub(crate) fn ephemeral_overlap(&self) -> Option<NodePorts> {
        let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
        let mut bounds = text.split_whitespace().map(str::parse::<u16>);
        let ephemeral = NodePorts { first: bounds.next()?.ok()?, last: bounds.next()?.ok()? };
        (ephemeral.first <= self.last && self.first <= ephemeral.last).then_some(ephemeral)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_is_first_dash_last_and_a_bad_one_is_named_with_why() {
        assert_eq!("61000-65535".parse(), Ok(NodePorts::default()));
        assert_eq!(
            " 20000 - 20009 ".parse::<NodePorts>().map(|r| (r.len(), r.to_string())),
            Ok((10, "20000-20009".into()))
        );
        assert_eq!("7000-7000".parse::<NodePorts>().map(|r| r.len()), Ok(1));
        for (text, why) in [
            ("61000", "no '-'"),
            ("a-b", "a port is a number"),
            ("1-70000", "a port is a number"),
            ("0-10", "port 0 is no port"),
            ("20-10", "the last is below the first"),
        ] {
            let error = text.parse::<NodePorts>().unwrap_err();
            assert!(error.contains(&format!("'{text}'")) && error.contains(why), "{text}: {error}");
        }
    }

    #[test]
    fn a_walk_from_any_place_wraps_and_visits_every_port_once() {
        let range = NodePorts { first: 100, last: 104 };
        let walked: Vec<u16> = (0..range.len()).map(|i| range.nth_from(3, i)).collect();
        assert_eq!(walked, [103, 104, 100, 101, 102]);
    }
}
