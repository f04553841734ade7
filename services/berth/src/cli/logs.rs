//! `berth logs LEASE [-f]`: a lease's output, streamed through the leases
//! service from the agent of the node it is placed on: the command reaches
//! the control plane only, never a node.
//!
//! # Expected flow
//! leases streams the output (`Leases/GetLeaseLogs`): the tail first, then,
//! with `-f`, what is written after, until the workload ends. A followed
//! lease that has not started yet is waited for.
//!
//! # Invariants
//! Output is passed through byte for byte, standard output to stdout and
//! standard error to stderr, each written as it arrives; `-o` does not apply.

use std::io::Write;
use std::time::Duration;

use berth_proto::leases::v1::GetLeaseLogsRequest;
use berth_proto::leases::v1::leases_client::LeasesClient;
use berth_proto::types::v1::LogStream;
use tonic::Code;

use super::lease::{LeasesServerArgs, get_lease, is_starting};
use super::output;
use super::{CliError, ClientArgs};

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
    pub(crate) async fn run(self) -> Result<(), CliError> {
        let credentials = self.client.credentials()?;
        let leases = self.leases.connect(&self.client, credentials.clone()).await?;
        let mut leases_client = LeasesClient::new(leases.channel.clone());
        let mut lease = get_lease(&mut leases_client, &leases, &self.lease_id).await?;
        if lease.node_id.is_empty() {
            return Err(CliError::Unplaced { lease_id: lease.lease_id, phase: output::lease_phase(lease.phase) });
        }

        let request = GetLeaseLogsRequest {
            lease_id: lease.lease_id.clone(),
            follow: self.follow,
            tail_lines: self.tail.unwrap_or(0),
        };
        // No deadline: a followed stream lasts as long as the workload does.
        let mut stream = loop {
            match leases_client.get_lease_logs(request.clone()).await {
                Ok(stream) => break stream.into_inner(),
                Err(status) if self.follow && status.code() == Code::NotFound && is_starting(lease.phase) => {
                    tokio::time::sleep(START_POLL).await;
                    lease = get_lease(&mut leases_client, &leases, &lease.lease_id).await?;
                }
                Err(status) => return Err(leases.status_error(status)),
            }
        };
        let sink = Sink { stdout: !self.stderr_only, stderr: !self.stdout_only };
        while let Some(chunk) = stream.message().await.map_err(|s| leases.status_error(s))? {
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
