//! `berth logs LEASE [-f]`: a lease's output, fetched from the agent of the
//! node it is placed on.
//!
//! # Expected flow
//! leases says which node holds the lease, identity says where that node's
//! agent listens, and the agent streams the output: the tail first, then,
//! with `-f`, what is written after, until the workload ends. A followed
//! lease that has not started yet is waited for.
//!
//! # Invariants
//! Output is passed through byte for byte, standard output to stdout and
//! standard error to stderr, each written as it arrives; `-o` does not apply.

use std::io::Write;
use std::time::Duration;

use berth_proto::agent::v1::agent_client::AgentClient;
use berth_proto::agent::v1::{GetLogsRequest, LogStream};
use berth_proto::identity::v1::GetNodeRequest;
use berth_proto::identity::v1::nodes_client::NodesClient;
use berth_proto::leases::v1::leases_client::LeasesClient;
use berth_runtime::StartError;
use tonic::Code;

use super::lease::{LeasesServerArgs, get_lease, is_starting};
use super::output;
use super::{CliError, ClientArgs, Connection};

/// How often a followed lease that has not started yet is looked at again.
const START_POLL: Duration = Duration::from_millis(250);

/// Flags of `berth logs`.
#[derive(Debug, clap::Args)]
pub(crate) struct LogsArgs {
    // The command's own flags come before the flattened connection flags,
    // whose help heading would otherwise carry over to them.
    /// The lease whose output to show.
    #[arg(value_name = "LEASE_ID")]
    lease_id: String,
    /// Keep printing new output until the lease's workload ends (or Ctrl-C).
    #[arg(short = 'f', long)]
    follow: bool,
    /// Start with only the last N lines of each output [default: all the
    /// node kept].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    tail: Option<u32>,
    /// Only the workload's standard error.
    #[arg(long, conflicts_with = "stdout_only")]
    stderr_only: bool,
    /// Only the workload's standard output.
    #[arg(long)]
    stdout_only: bool,
    #[command(flatten)]
    client: ClientArgs,
    #[command(flatten)]
    leases: LeasesServerArgs,
}

impl LogsArgs {
    pub(crate) async fn run(self) -> Result<(), StartError> {
        Ok(self.execute().await?)
    }

    async fn execute(self) -> Result<(), CliError> {
        let credentials = self.client.credentials()?;
        let leases = self.leases.connect(&self.client, credentials.clone())?;
        let mut leases_client = LeasesClient::new(leases.channel.clone());
        let mut lease = get_lease(&mut leases_client, &leases, &self.lease_id).await?;
        if lease.node_id.is_empty() {
            return Err(CliError::Unplaced { lease_id: lease.lease_id, phase: output::lease_phase(lease.phase) });
        }

        let identity = Connection::open("identity", &self.client.server, credentials.clone())?;
        let node = NodesClient::new(identity.channel.clone())
            .get_node(identity.request(GetNodeRequest { node_id: lease.node_id.clone() }))
            .await
            .map_err(|s| identity.status_error(s))?
            .into_inner()
            .node
            .ok_or(CliError::IncompleteResponse("the node"))?;
        if node.advertise_addr.is_empty() {
            return Err(CliError::NoAgentAddress { node_id: node.node_id });
        }
        let agent = Connection::open(format!("the agent of node {}", node.node_id), &node.advertise_addr, credentials)?;
        let mut agent_client = AgentClient::new(agent.channel.clone());

        let request = GetLogsRequest {
            lease_id: lease.lease_id.clone(),
            follow: self.follow,
            tail_lines: self.tail.unwrap_or(0),
        };
        // No deadline: a followed stream lasts as long as the workload does.
        let mut stream = loop {
            match agent_client.get_logs(request.clone()).await {
                Ok(stream) => break stream.into_inner(),
                Err(status) if self.follow && status.code() == Code::NotFound && is_starting(lease.phase) => {
                    tokio::time::sleep(START_POLL).await;
                    lease = get_lease(&mut leases_client, &leases, &lease.lease_id).await?;
                }
                Err(status) => return Err(agent.status_error(status)),
            }
        };
        let sink = Sink { stdout: !self.stderr_only, stderr: !self.stdout_only };
        while let Some(chunk) = stream.message().await.map_err(|s| agent.status_error(s))? {
            if !sink.write(LogStream::try_from(chunk.stream).unwrap_or(LogStream::Stdout), &chunk.data)? {
                break;
            }
        }
        Ok(())
    }
}

/// Which of the workload's outputs are passed on.
#[derive(Debug, Clone, Copy)]
struct Sink {
    stdout: bool,
    stderr: bool,
}

impl Sink {
    /// Writes `data` where `stream` goes. False once stdout's reader went
    /// away (`| head`), which ends the command quietly.
    fn write(self, stream: LogStream, data: &[u8]) -> Result<bool, CliError> {
        let written = match stream {
            LogStream::Stderr if self.stderr => {
                let mut stderr = std::io::stderr().lock();
                stderr.write_all(data).and_then(|()| stderr.flush())
            }
            LogStream::Stderr => Ok(()),
            LogStream::Stdout | LogStream::Unspecified if self.stdout => {
                let mut stdout = std::io::stdout().lock();
                stdout.write_all(data).and_then(|()| stdout.flush())
            }
            LogStream::Stdout | LogStream::Unspecified => Ok(()),
        };
        match written {
            Ok(()) => Ok(true),
            Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
            Err(error) => Err(CliError::Output(error)),
        }
    }
}
