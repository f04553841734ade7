//! `Mesh/GetEndpoints`: the mesh's directory. A client that reached
//! identity learns here where revisions, leases, egress and the router are,
//! so the CLI and operators need one address, and no client guesses a
//! service's port from identity's.
//!
//! # Invariants
//! - The directory is what the operator gave identity (`--endpoint
//!   NAME=HOST:PORT`), fixed for the process's life: identity vouches for
//!   no address, and a client verifies each service's certificate as it
//!   dials it.
//! - An address with no host (`:7444`) is at the host the caller reached
//!   identity by: one entry serves callers that reach the mesh by different
//!   names (a published port on the host, a name on a private network).

use std::collections::BTreeMap;

use berth_proto::identity::v1;
use tonic::{Request, Response, Status};

use crate::IdentityService;

/// The mesh's services by name, and where each is reached.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Endpoints(BTreeMap<String, String>);

impl Endpoints {
    /// Endpoints from `NAME=HOST:PORT` (or `NAME=:PORT`) entries; a name
    /// given twice keeps its last address.
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<Self, String> {
        let mut endpoints = Endpoints::default();
        for entry in entries {
            let entry = entry.as_ref().trim();
            let (name, addr) = entry
                .split_once('=')
                .ok_or_else(|| format!("endpoint '{entry}' is not NAME=HOST:PORT (e.g. leases=:7445)"))?;
            endpoints.insert(name.trim(), addr.trim())?;
        }
        Ok(endpoints)
    }

    /// Adds `name` at `addr` (`HOST:PORT` or `:PORT`).
    pub fn insert(&mut self, name: &str, addr: &str) -> Result<(), String> {
        if !berth_core::is_dns_label(name) {
            return Err(format!(
                "endpoint name '{name}' is not a service name: use 1-63 lowercase letters, digits or '-'"
            ));
        }
        let (host, port) =
            addr.rsplit_once(':').ok_or_else(|| format!("endpoint {name}: '{addr}' is not HOST:PORT or :PORT"))?;
        if host.contains('/') || host.contains(char::is_whitespace) {
            return Err(format!("endpoint {name}: '{host}' is not a host name or address"));
        }
        port.parse::<u16>()
            .ok()
            .filter(|port| *port != 0)
            .ok_or_else(|| format!("endpoint {name}: '{port}' is not a port (1-65535)"))?;
        self.0.insert(name.to_string(), addr.to_string());
        Ok(())
    }

    /// Every endpoint, ordered by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(name, addr)| (name.as_str(), addr.as_str()))
    }
}

#[tonic::async_trait]
impl v1::mesh_server::Mesh for IdentityService {
    async fn get_endpoints(
        &self,
        _request: Request<v1::GetEndpointsRequest>,
    ) -> Result<Response<v1::GetEndpointsResponse>, Status> {
        let endpoints = self
            .endpoints()
            .iter()
            .map(|(service, address)| v1::MeshEndpoint { service: service.to_string(), address: address.to_string() })
            .collect();
        Ok(Response::new(v1::GetEndpointsResponse { endpoints }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_read_name_equals_address_and_name_what_is_wrong() {
        let endpoints = Endpoints::parse(&["revisions=:7444", "leases=leases.berth.svc:7445", "router=[::1]:8080"]);
        let endpoints = endpoints.unwrap();
        let listed: Vec<_> = endpoints.iter().collect();
        assert_eq!(listed, [("leases", "leases.berth.svc:7445"), ("revisions", ":7444"), ("router", "[::1]:8080")]);

        let refused = |entry: &str| Endpoints::parse(&[entry]).unwrap_err();
        assert_eq!(refused("leases"), "endpoint 'leases' is not NAME=HOST:PORT (e.g. leases=:7445)");
        assert!(refused("Leases=:7445").starts_with("endpoint name 'Leases' is not a service name"));
        assert_eq!(refused("leases=7445"), "endpoint leases: '7445' is not HOST:PORT or :PORT");
        assert_eq!(refused("leases=host:0"), "endpoint leases: '0' is not a port (1-65535)");
        assert_eq!(refused("leases=http://x:1"), "endpoint leases: 'http://x' is not a host name or address");
    }
}
