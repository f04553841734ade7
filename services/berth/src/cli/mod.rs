//! The admin CLI: join tokens, nodes and certificates spoken to identity,
//! leases, capacity and logs to leases, services and revisions to
//! revisions, each over mTLS with an admin certificate.
//!
//! # Where the connection comes from
//! `--server`, `--ca`, `--cert` and `--key` (or `BERTH_SERVER`, `BERTH_CA`,
//! `BERTH_CERT`, `BERTH_KEY`); the three files default to the ones
//! `berth dev` writes in `--data-dir`, so a dev mesh needs no flags at all.
//! `--server` is identity; the lease commands find leases with
//! `--leases-server`, the service commands find revisions with
//! `--revisions-server`, and `logs` streams a workload's output through
//! leases, never dialling a node.
//!
//! # What a failure looks like
//! One line, `berth: error: ...`, and exit code 1. gRPC statuses are turned
//! into plain words here, once, for every command; bad flag values never get
//! this far: clap refuses them as usage errors (exit code 2).

mod bootstrap;
mod cache;
mod cert;
mod egress;
mod health;
mod lease;
mod logs;
mod node;
pub(crate) mod output;
mod service;
mod spec_fields;
mod spec_file;
mod token;

use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_mtls::{TlsCredentials, TlsMaterial};
use berth_rpc::Channel;
use berth_runtime::StartError;
use tonic::Code;

pub(crate) use bootstrap::BootstrapArgs;
pub(crate) use cache::CacheArgs;
pub(crate) use cert::CertArgs;
pub(crate) use egress::EgressArgs;
pub(crate) use health::HealthArgs;
pub(crate) use lease::{CapacityArgs, LeaseArgs};
pub(crate) use logs::LogsArgs;
pub(crate) use node::NodeArgs;
pub(crate) use service::{RevisionArgs, ServiceArgs};
pub(crate) use token::TokenArgs;

/// How long one admin call may take, connecting included, before it is
/// given up.
const RPC_TIMEOUT: Duration = Duration::from_secs(30);

/// How a command prints its result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum OutputFormat {
    /// Aligned columns for people.
    Table,
    /// The response as JSON, for scripts: the proto3 JSON mapping grpcurl
    /// prints (lowerCamelCase field names, enum value names, 64-bit
    /// integers as strings).
    Json,
}

/// Which projects a list covers: one (the default one unless named), or
/// every project.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct ProjectScopeArgs {
    /// Only those of this project [default: default].
    #[arg(long, value_name = "PROJECT", conflicts_with = "all_projects")]
    pub(crate) project: Option<String>,
    /// Those of every project.
    #[arg(long)]
    pub(crate) all_projects: bool,
}

/// Where identity is and who we are to it; shared by every admin command.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Global options")]
pub(crate) struct ClientArgs {
    /// The identity service to talk to.
    #[arg(long, env = "BERTH_SERVER", default_value = "127.0.0.1:7443", value_name = "HOST:PORT",
          value_parser = parse_server, global = true)]
    server: String,
    /// PEM bundle of the CAs to verify the servers with [default: <DATA_DIR>/ca.pem].
    #[arg(long, env = "BERTH_CA", value_name = "FILE", global = true)]
    ca: Option<PathBuf>,
    /// PEM admin certificate to present [default: <DATA_DIR>/admin.pem].
    #[arg(long, env = "BERTH_CERT", value_name = "FILE", global = true)]
    cert: Option<PathBuf>,
    /// PEM private key of that certificate [default: <DATA_DIR>/admin-key.pem].
    #[arg(long, env = "BERTH_KEY", value_name = "FILE", global = true)]
    key: Option<PathBuf>,
    /// Where `berth dev` keeps its files; only used for the defaults of
    /// --ca, --cert and --key.
    #[arg(long, env = "BERTH_DATA_DIR", default_value = ".berth/dev", value_name = "DIR", global = true)]
    data_dir: PathBuf,
    /// Output format.
    #[arg(short = 'o', long, env = "BERTH_OUTPUT", value_enum, default_value_t = OutputFormat::Table,
          value_name = "FORMAT", global = true)]
    output: OutputFormat,
}

/// Why an admin command failed. Each message is the whole line the user sees.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CliError {
    /// A certificate, key or CA file could not be read.
    #[error(
        "cannot read {role} {path}: {source}; start `berth dev` to create it (or give the --data-dir it \
         runs with: the default, .berth/dev, is relative to where it runs), or pass {flag} FILE"
    )]
    MissingFile {
        /// What the file is for, e.g. "client certificate".
        role: &'static str,
        /// The file.
        path: String,
        /// The flag that names it.
        flag: &'static str,
        /// Why it could not be read.
        #[source]
        source: std::io::Error,
    },
    /// The certificate, key and CA files were read but do not make usable credentials.
    #[error("cannot use {files}: {source}")]
    Credentials {
        /// The three files, flag by flag.
        files: String,
        /// What rustls or the PEM parser refused.
        #[source]
        source: Box<berth_mtls::MtlsError>,
    },
    /// The server address could not make a channel.
    #[error("{0}")]
    Address(#[source] Box<berth_rpc::ClientError>),
    /// No connection to the service could be made (refused, timed out, TLS handshake failed).
    #[error("cannot reach {service} at {server}: {detail}")]
    Unreachable {
        /// The service dialled, e.g. "identity".
        service: String,
        /// The address dialled.
        server: String,
        /// Why, from the transport.
        detail: String,
    },
    /// The service answered with an error status.
    /// The server's message, led by the status in plain words (e.g.
    /// "permission denied") unless it already says so.
    #[error("{0}")]
    Refused(String),
    /// The service does not serve the call (an older server, or one not built yet).
    #[error("{service} at {server} does not serve this call yet: {message}")]
    Unsupported {
        /// The service dialled, e.g. "identity".
        service: String,
        /// The address dialled.
        server: String,
        /// The server's message.
        message: String,
    },
    /// The service answered, but without a field the call promises.
    #[error("the server answered without {0}")]
    IncompleteResponse(&'static str),
    /// No address was given for a service and identity names none.
    #[error(
        "identity at {server} names no {service} endpoint (identity's --endpoint {service}=HOST:PORT); pass {flag} HOST:PORT"
    )]
    NoEndpoint {
        /// The service looked for.
        service: &'static str,
        /// Identity's address.
        server: String,
        /// The flag that names it.
        flag: &'static str,
    },
    /// A spec file was refused before anything was sent.
    #[error(transparent)]
    Spec(#[from] spec_file::SpecError),
    /// The revision `--wait` waited for failed; the one before it keeps serving.
    #[error("revision {revision} failed: {condition} {reason}: {message}")]
    RolloutFailed {
        /// The revision.
        revision: String,
        /// The condition that says so, e.g. "Ready".
        condition: String,
        /// Why, one CamelCase word.
        reason: String,
        /// Why, in a sentence.
        message: String,
    },
    /// `--wait` gave up before the revision took the traffic.
    #[error("revision {revision} is not live after {waited}: {progress}")]
    WaitTimedOut {
        /// The revision waited for.
        revision: String,
        /// How long, as the user wrote it.
        waited: String,
        /// Where it stood when given up.
        progress: String,
    },
    /// The lease was never placed on a node, so no node holds its output.
    #[error("lease {lease_id} is {phase} and on no node, so it has no output")]
    Unplaced {
        /// The lease.
        lease_id: String,
        /// Its phase, as people read it.
        phase: String,
    },
    /// A key or CSR could not be generated locally.
    #[error("cannot generate a key: {0}")]
    KeyGeneration(#[source] Box<berth_mtls::MtlsError>),
    /// A file the command writes could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Standard output could not be written.
    #[error("cannot write output: {0}")]
    Output(#[source] std::io::Error),
    /// An answer could not be put into JSON.
    #[error("cannot print the answer as JSON: {0}")]
    Json(#[source] berth_proto::json::JsonError),
}

impl From<CliError> for StartError {
    fn from(error: CliError) -> Self {
        // The message already carries its sources: one line, said once.
        StartError::Invalid(error.to_string().replace('\n', " "))
    }
}

/// A lazily connected mTLS channel to one berth service, the address it
/// dials, and what to call that service in messages.
#[derive(Debug, Clone)]
pub(crate) struct Connection {
    channel: Channel,
    server: String,
    service: String,
}

/// The connection to identity, which most commands talk to.
pub(crate) type IdentityConnection = Connection;

impl ClientArgs {
    /// Reads the credential files and makes the channel to identity; nothing
    /// is dialled until the first call.
    fn connect(&self) -> Result<IdentityConnection, CliError> {
        Connection::open("identity", &self.server, self.credentials()?)
    }

    /// Where the mesh's `service` is: `given` (its flag, `flag`) when the
    /// user named it, else where identity says (`Mesh/GetEndpoints`).
    async fn endpoint(
        &self,
        service: &'static str,
        given: Option<&String>,
        flag: &'static str,
        credentials: &TlsCredentials,
    ) -> Result<String, CliError> {
        if let Some(address) = given {
            return Ok(address.clone());
        }
        let identity = Connection::open("identity", &self.server, credentials.clone())?;
        let endpoints = berth_proto::identity::v1::mesh_client::MeshClient::new(identity.channel.clone())
            .get_endpoints(identity.request(berth_proto::identity::v1::GetEndpointsRequest {}))
            .await
            .map_err(|status| identity.status_error(status))?
            .into_inner()
            .endpoints;
        endpoints
            .into_iter()
            .find(|endpoint| endpoint.service == service && !endpoint.address.is_empty())
            .map(|endpoint| at_identity_host(&self.server, &endpoint.address))
            .ok_or_else(|| CliError::NoEndpoint { service, server: self.server.clone(), flag })
    }

    /// The admin credentials from --cert, --key and --ca, read once so one
    /// command can dial several services with them.
    fn credentials(&self) -> Result<TlsCredentials, CliError> {
        let cert = self.cert.clone().unwrap_or_else(|| self.data_dir.join("admin.pem"));
        let key = self.key.clone().unwrap_or_else(|| self.data_dir.join("admin-key.pem"));
        let ca = self.ca.clone().unwrap_or_else(|| self.data_dir.join("ca.pem"));
        // The certificate first: when nothing is there, it is the file the
        // user most needs to hear about.
        let material = TlsMaterial {
            cert_chain_pem: read_credential("client certificate", "--cert", &cert)?,
            key_pem: read_credential("client key", "--key", &key)?,
            ca_bundle_pem: read_credential("CA bundle", "--ca", &ca)?,
        };
        TlsCredentials::new(material).map_err(|source| CliError::Credentials {
            files: format!("--cert {} with --key {} and --ca {}", cert.display(), key.display(), ca.display()),
            source: Box::new(source),
        })
    }
}

fn read_credential(role: &'static str, flag: &'static str, path: &Path) -> Result<String, CliError> {
    std::fs::read_to_string(path).map_err(|source| CliError::MissingFile {
        role,
        path: path.display().to_string(),
        flag,
        source,
    })
}

impl Connection {
    /// A channel to `service` at `server`; nothing is dialled until the
    /// first call.
    fn open(service: impl Into<String>, server: &str, credentials: TlsCredentials) -> Result<Self, CliError> {
        let channel = berth_rpc::connect(server, credentials).map_err(|e| CliError::Address(Box::new(e)))?;
        Ok(Connection { channel, server: server.to_string(), service: service.into() })
    }

    /// `message` as a request bounded by [`RPC_TIMEOUT`].
    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(RPC_TIMEOUT);
        request
    }

    /// What `call` (a call on this connection) answered, or why it did not,
    /// in words a user can act on.
    async fn answer<T>(
        &self,
        call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, CliError> {
        call.await.map(tonic::Response::into_inner).map_err(|s| self.status_error(s))
    }

    /// The status in words a user can act on.
    fn status_error(&self, status: tonic::Status) -> CliError {
        let message = one_line(status.message());
        let refused = |what: &str| {
            let line =
                if message.to_lowercase().contains(what) { message.clone() } else { format!("{what}: {message}") };
            CliError::Refused(line)
        };
        let unreachable = |detail: String| CliError::Unreachable {
            service: self.service.clone(),
            server: self.server.clone(),
            detail,
        };
        match status.code() {
            // A status with a transport error behind it never reached a
            // handler: the connection itself failed.
            Code::Unavailable | Code::Unknown if std::error::Error::source(&status).is_some() => {
                unreachable(transport_detail(&status, &self.service))
            }
            Code::Unavailable => refused(&format!("{} is unavailable", self.service)),
            Code::DeadlineExceeded => unreachable(format!("no answer within {}s", RPC_TIMEOUT.as_secs())),
            Code::PermissionDenied => refused("permission denied"),
            Code::Unauthenticated => refused("not authenticated"),
            Code::NotFound => refused("not found"),
            Code::InvalidArgument | Code::OutOfRange => refused("invalid argument"),
            Code::AlreadyExists => refused("already exists"),
            Code::FailedPrecondition => refused("refused"),
            Code::ResourceExhausted => refused("limit reached"),
            // The client's own stack cancels a call whose connection died
            // under it, e.g. when the server's TLS refused our certificate.
            Code::Cancelled => {
                unreachable(format!("the connection closed before {} answered ({message})", self.service))
            }
            Code::Aborted => refused("interrupted, try again"),
            Code::Unimplemented => {
                CliError::Unsupported { service: self.service.clone(), server: self.server.clone(), message }
            }
            Code::Ok | Code::Unknown | Code::Internal | Code::DataLoss => refused(&format!("{} failed", self.service)),
        }
    }
}

/// Wrappers the transport puts around the error that says what happened.
const TRANSPORT_WRAPPERS: [&str; 2] = ["transport error", "connection error"];

/// The transport error behind a status, its sources on one line without
/// repeats or wrappers, with a hint when the TLS handshake failed.
fn transport_detail(status: &tonic::Status, service: &str) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut source = std::error::Error::source(status);
    while let Some(error) = source {
        let mut text = one_line(&error.to_string());
        for wrapper in TRANSPORT_WRAPPERS {
            text =
                text.strip_prefix(wrapper).map_or(text.clone(), |rest| rest.trim_start_matches(':').trim().to_string());
        }
        if !text.is_empty() && !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        source = error.source();
    }
    let detail = if parts.is_empty() { one_line(status.message()) } else { parts.join(": ") };
    if detail.contains("invalid peer certificate") {
        format!("{detail} ({service}'s certificate does not verify against --ca; is it this cluster's CA bundle?)")
    } else if detail.contains("received fatal alert") {
        format!("{detail} ({service} refused the handshake; is --cert signed by this cluster's CA?)")
    } else {
        detail
    }
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `address` as identity at `server` gave it: one with no host (`:7444`)
/// is at the host `server` names.
fn at_identity_host(server: &str, address: &str) -> String {
    if !address.starts_with(':') {
        return address.to_string();
    }
    let server = server.strip_prefix("https://").unwrap_or(server);
    let host = server.rsplit_once(':').map_or(server, |(host, _)| host);
    format!("{host}{address}")
}

/// `host:port`, `[v6]:port` or `https://host:port`.
fn parse_server(value: &str) -> Result<String, String> {
    // `$(POD_IP):7447` on an IPv6 cluster comes without brackets.
    let value = &berth_core::bracket_ipv6(value);
    let rest = value.strip_prefix("https://").unwrap_or(value);
    let (host, port) = rest.rsplit_once(':').ok_or_else(|| format!("'{value}' is not HOST:PORT"))?;
    if host.is_empty() || host.contains('/') {
        return Err(format!("'{value}' is not HOST:PORT"));
    }
    port.parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(|| format!("'{port}' is not a port (1-65535)"))?;
    Ok(value.to_string())
}

/// A lifetime such as `3600s`, `30m`, `1h` or `7d` (a bare number is
/// seconds), in whole seconds and at least one.
fn parse_ttl(value: &str) -> Result<u32, String> {
    let ttl = berth_runtime::parse_duration(value)?;
    if ttl.subsec_nanos() != 0 {
        return Err(format!("'{value}' is not a whole number of seconds"));
    }
    match u32::try_from(ttl.as_secs()) {
        Ok(0) => Err(format!("'{value}' is zero; a lifetime must be at least 1s")),
        Ok(seconds) => Ok(seconds),
        Err(_) => Err(format!("'{value}' is too long")),
    }
}

/// A label `key=value`; the key may not be empty.
fn parse_label(value: &str) -> Result<(String, String), String> {
    match value.split_once('=') {
        Some((key, val)) if !key.trim().is_empty() => Ok((key.trim().to_string(), val.to_string())),
        _ => Err(format!("'{value}' is not KEY=VALUE")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_takes_units_and_bare_seconds() {
        assert_eq!(parse_ttl("3600s"), Ok(3600));
        assert_eq!(parse_ttl("30m"), Ok(1800));
        assert_eq!(parse_ttl("1h"), Ok(3600));
        assert_eq!(parse_ttl("2d"), Ok(172_800));
        assert_eq!(parse_ttl("45"), Ok(45));
    }

    #[test]
    fn ttl_refuses_zero_fractions_garbage_and_overflow() {
        for bad in ["", "0s", "500ms", "h", "1x", "1.5h", "-5m", "99999999999999999999s", "50000d"] {
            assert!(parse_ttl(bad).is_err(), "{bad} should be refused");
        }
    }

    #[test]
    fn an_endpoint_without_a_host_is_at_the_host_identity_was_reached_by() {
        assert_eq!(at_identity_host("127.0.0.1:7443", ":7445"), "127.0.0.1:7445");
        assert_eq!(at_identity_host("https://[::1]:7443", ":7444"), "[::1]:7444");
        assert_eq!(at_identity_host("identity:7443", "leases.berth.svc:7445"), "leases.berth.svc:7445");
    }

    #[test]
    fn server_must_be_host_and_port() {
        assert!(parse_server("127.0.0.1:7443").is_ok());
        assert!(parse_server("identity.berth:7443").is_ok());
        assert!(parse_server("https://identity:7443").is_ok());
        assert!(parse_server("[::1]:7443").is_ok());
        assert_eq!(parse_server("fd00::5:7447").unwrap(), "[fd00::5]:7447", "as $(POD_IP):7447 reads on IPv6");
        for bad in ["identity", ":7443", "identity:", "identity:http", "identity:0", "identity:70000"] {
            assert!(parse_server(bad).is_err(), "{bad} should be refused");
        }
    }

    #[test]
    fn label_needs_a_key() {
        assert_eq!(parse_label("rack=r4"), Ok(("rack".into(), "r4".into())));
        assert_eq!(parse_label("empty="), Ok(("empty".into(), String::new())));
        assert!(parse_label("rack").is_err());
        assert!(parse_label("=r4").is_err());
    }
}
