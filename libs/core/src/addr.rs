//! `host:port` as operators and orchestrators write it.
//!
//! Kubernetes substitutes a pod's IP into `$(POD_IP):7447` with no brackets,
//! which for an IPv6 address reads `fd00::5:7447`. Every port berth is told
//! of follows the address, so the last `:` group of an unbracketed IPv6
//! literal is its port; [`bracket_ipv6`] writes such an address the way URIs,
//! TLS names and identity's checks expect it (`[fd00::5]:7447`).

use std::net::Ipv6Addr;

/// `value` with an unbracketed IPv6 host put in brackets; anything else
/// (an IPv4 or DNS host, an already bracketed one, text that is no address)
/// is returned as it is, for the caller's own checks to judge.
pub fn bracket_ipv6(value: &str) -> String {
    if value.starts_with('[') || value.matches(':').count() < 2 {
        return value.to_string();
    }
    match value.rsplit_once(':') {
        Some((host, port)) if host.parse::<Ipv6Addr>().is_ok() && port.parse::<u16>().is_ok() => {
            format!("[{host}]:{port}")
        }
        _ => value.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_unbracketed_ipv6_host_is_bracketed() {
        assert_eq!(bracket_ipv6("fd00::5:7447"), "[fd00::5]:7447");
        assert_eq!(bracket_ipv6("2001:db8::1:443"), "[2001:db8::1]:443");
        assert_eq!(bracket_ipv6("[fd00::5]:7447"), "[fd00::5]:7447");
        assert_eq!(bracket_ipv6("10.0.0.7:7447"), "10.0.0.7:7447");
        assert_eq!(bracket_ipv6("agent:7447"), "agent:7447");
        // A port that is no port, or a host that is no address, is left for
        // the caller's checks to refuse by name.
        assert_eq!(bracket_ipv6("fd00::5:99999"), "fd00::5:99999");
        assert_eq!(bracket_ipv6("not::an:addr"), "not::an:addr");
    }
}
