//! `berth health`: asks one berth process whether it serves, through its
//! `grpc.health.v1` service, for the places that cannot speak mTLS gRPC
//! themselves: a container's `HEALTHCHECK`, a Kubernetes exec probe.
//!
//! Every berth port speaks TLS only, so kubelet's own gRPC probe (plaintext)
//! cannot ask; health admits callers without a client certificate, so this
//! check needs nothing but the CA bundle to verify the server with. The
//! images run it as `berth health` with `BERTH_HEALTH_SERVER` and
//! `BERTH_HEALTH_CA` set, so the check itself needs no shell.
//!
//! # What a check reports
//! Exit 0 and one line on stdout when the server answers `SERVING`; exit 1
//! and one `berth: error:` line when it answers anything else, cannot be
//! reached, fails the TLS handshake, or gives no answer within `--timeout`.

use std::path::PathBuf;
use std::time::Duration;

use berth_runtime::{StartError, parse_duration};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// Flags of `berth health`.
#[derive(Debug, clap::Args)]
pub(crate) struct HealthArgs {
    /// The process to ask, by an address its certificate names: a service's
    /// own port (`127.0.0.1:7444`), an agent's advertise address.
    #[arg(long, env = "BERTH_HEALTH_SERVER", default_value = "127.0.0.1:7443", value_name = "HOST:PORT",
          value_parser = super::parse_server)]
    server: String,
    /// PEM bundle of the CAs the server's certificate must chain to; in a
    /// service's own container, the bundle it trusts (`BERTH_CA_FILE`)
    /// when this is not given.
    #[arg(long, env = "BERTH_HEALTH_CA", value_name = "FILE")]
    ca: Option<PathBuf>,
    /// The service's own CA bundle, from its environment.
    #[arg(long = "service-ca-file", env = "BERTH_CA_FILE", value_name = "FILE", hide = true)]
    service_ca: Option<PathBuf>,
    /// The gRPC service to ask about, e.g. `berth.leases.v1.Leases`; empty
    /// asks about the whole server.
    #[arg(long, env = "BERTH_HEALTH_SERVICE", default_value = "", value_name = "NAME")]
    service: String,
    /// How long the check may take, connecting included (e.g. `3s`, `500ms`).
    #[arg(long, env = "BERTH_HEALTH_TIMEOUT", default_value = "5s", value_name = "DURATION",
          value_parser = parse_duration)]
    timeout: Duration,
}

/// Why a process was not found healthy. Each message is the whole line the
/// user (or the container runtime's log) sees.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HealthError {
    /// No CA bundle was named.
    #[error("no CA bundle to verify the server with: pass --ca FILE, or set BERTH_HEALTH_CA or BERTH_CA_FILE")]
    NoCa,
    /// The CA bundle could not be read.
    #[error("cannot read the CA bundle {path}: {source}; pass --ca FILE or set BERTH_HEALTH_CA")]
    ReadCa {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The CA bundle or the address made no channel.
    #[error("{0}")]
    Channel(#[source] berth_rpc::ClientError),
    /// No connection could be made, or the TLS handshake failed.
    #[error("cannot reach {server}: {detail}")]
    Unreachable {
        /// The address dialled.
        server: String,
        /// Why, from the transport.
        detail: String,
    },
    /// The server answered the check with an error status.
    #[error("{server} refused the health check ({code:?}): {message}")]
    Refused {
        /// The address dialled.
        server: String,
        /// The status code.
        code: tonic::Code,
        /// The server's message.
        message: String,
    },
    /// The server answered, and not `SERVING`.
    #[error("{server} reports {status} for {service}")]
    NotServing {
        /// The address dialled.
        server: String,
        /// The service asked about, or "the whole server".
        service: String,
        /// What it reported, e.g. `NOT_SERVING`.
        status: &'static str,
    },
    /// No answer came within `--timeout`.
    #[error("{server} gave no answer within {timeout:?}")]
    Timeout {
        /// The address dialled.
        server: String,
        /// The limit.
        timeout: Duration,
    },
}

impl From<HealthError> for StartError {
    fn from(error: HealthError) -> Self {
        StartError::Invalid(super::one_line(&error.to_string()))
    }
}

impl HealthArgs {
    /// The bundle to verify with: `--ca`, else the service's own.
    fn ca_file(&self) -> Result<&PathBuf, HealthError> {
        self.ca.as_ref().or(self.service_ca.as_ref()).ok_or(HealthError::NoCa)
    }

    pub(crate) async fn run(self) -> Result<(), HealthError> {
        let ca = self.ca_file()?;
        let ca_pem = std::fs::read_to_string(ca)
            .map_err(|source| HealthError::ReadCa { path: ca.display().to_string(), source })?;
        let channel = berth_rpc::connect_anonymous(&self.server, &ca_pem).map_err(HealthError::Channel)?;
        let mut request = tonic::Request::new(HealthCheckRequest { service: self.service.clone() });
        request.set_timeout(self.timeout);
        let answered = tokio::time::timeout(self.timeout, HealthClient::new(channel).check(request)).await;
        let server = self.server.clone();
        let response = match answered {
            Err(_) => return Err(HealthError::Timeout { server, timeout: self.timeout }),
            Ok(Err(status)) => return Err(status_error(&server, status)),
            Ok(Ok(response)) => response.into_inner(),
        };
        let status = ServingStatus::try_from(response.status).unwrap_or(ServingStatus::Unknown);
        let service = if self.service.is_empty() { "the whole server".to_string() } else { self.service.clone() };
        if status != ServingStatus::Serving {
            return Err(HealthError::NotServing { server, service, status: status.as_str_name() });
        }
        println!("{server}: {} ({service})", status.as_str_name());
        Ok(())
    }
}

/// A status that never reached a handler is a transport failure; anything
/// else is the server's answer.
fn status_error(server: &str, status: tonic::Status) -> HealthError {
    let unreachable = |detail: String| HealthError::Unreachable { server: server.to_string(), detail };
    match status.code() {
        tonic::Code::Unavailable | tonic::Code::Unknown if std::error::Error::source(&status).is_some() => {
            unreachable(super::transport_detail(&status, server))
        }
        // The client's own stack cancels a call whose connection died under
        // it, e.g. when the TLS handshake failed.
        tonic::Code::Cancelled => unreachable(format!("the connection closed before an answer ({})", status.message())),
        tonic::Code::DeadlineExceeded => unreachable("no answer before the deadline".into()),
        code => HealthError::Refused { server: server.to_string(), code, message: super::one_line(status.message()) },
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    #[derive(Debug, clap::Parser)]
    struct Probe {
        #[command(flatten)]
        health: HealthArgs,
    }

    #[test]
    fn the_server_defaults_to_identity_on_loopback_and_must_be_host_and_port() {
        let probe = Probe::try_parse_from(["probe", "--ca", "ca.pem"]).unwrap();
        assert_eq!(probe.health.server, "127.0.0.1:7443");
        assert_eq!(probe.health.timeout, Duration::from_secs(5));
        assert!(Probe::try_parse_from(["probe", "--ca", "ca.pem", "--server", "leases"]).is_err());
        let bare = Probe::try_parse_from(["probe", "--server", "127.0.0.1:7445"]).unwrap();
        assert!(bare.health.ca_file().unwrap_err().to_string().contains("pass --ca FILE"));
        // In a service's container, the bundle the service trusts; --ca wins.
        let own = Probe::try_parse_from(["probe", "--service-ca-file", "/pki/ca.pem"]).unwrap();
        assert_eq!(own.health.ca_file().unwrap(), &PathBuf::from("/pki/ca.pem"));
        let both = Probe::try_parse_from(["probe", "--service-ca-file", "/pki/ca.pem", "--ca", "other.pem"]).unwrap();
        assert_eq!(both.health.ca_file().unwrap(), &PathBuf::from("other.pem"));
    }

    #[test]
    fn a_transport_failure_reads_as_unreachable_and_an_answer_as_refused() {
        let refused = status_error("10.0.0.1:7443", tonic::Status::not_found("unknown service berth.nope.v1.X"));
        assert_eq!(
            refused.to_string(),
            "10.0.0.1:7443 refused the health check (NotFound): unknown service berth.nope.v1.X"
        );
        let cancelled = status_error("10.0.0.1:7443", tonic::Status::cancelled("h2 protocol error"));
        assert!(matches!(cancelled, HealthError::Unreachable { .. }), "{cancelled}");
    }
}
