//! Interruption notices: the host's own tooling (a spot-interruption
//! handler, a maintenance script, a cloud's metadata poller) telling the
//! agent that its host is going away, so the node drains itself while there
//! is time to move its work.
//!
//! # How a notice arrives
//! - A file at `--interruption-file` (default `DATA_DIR/interruption-notice`):
//!   written by the host's tooling, holding how long the host has left
//!   (`2m`, `90s`; empty means `--interruption-deadline`). A file whose
//!   content changes is a new notice, with its new deadline.
//! - `SIGUSR1` to the agent: a notice with `--interruption-deadline`.
//!
//! # What it does
//! The agent asks identity to drain its own node with that deadline
//! (`Nodes/DrainNode`, which a node may call for itself and only to drain):
//! from there the control plane moves the node's work as for an operator's
//! drain. The call is retried until identity takes it or the agent stops;
//! each notice is acted on once.

use std::path::PathBuf;
use std::time::Duration;

use berth_core::backoff::Backoff;
use berth_proto::identity::v1::{DrainNodeRequest, nodes_client::NodesClient};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::node_channel::NodeChannel;
use crate::status::NodeSession;

/// The notice file's name in the data directory, unless configured.
pub(crate) const DEFAULT_FILE: &str = "interruption-notice";

/// How long a notice gives the node when it does not say.
pub(crate) const DEFAULT_DEADLINE: Duration = Duration::from_secs(120);

/// How often the notice file is looked for.
const POLL: Duration = Duration::from_secs(1);

/// The most of a notice file read: a duration fits in far less.
const MAX_NOTICE: u64 = 256;

/// One notice, as told apart from the last one acted on.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Notice {
    /// The file, with what it held.
    File(String),
    /// The n-th `SIGUSR1`.
    Signal(u64),
}

/// Follows the notice file and `SIGUSR1`, and drains the node on each notice.
#[derive(Debug)]
pub(crate) struct InterruptionWatch {
    pub(crate) file: PathBuf,
    pub(crate) default_deadline: Duration,
    pub(crate) identity: NodeChannel,
    pub(crate) session: watch::Receiver<NodeSession>,
    pub(crate) backoff: Backoff,
    pub(crate) shutdown: CancellationToken,
}

impl InterruptionWatch {
    /// Runs until the agent stops.
    pub(crate) async fn run(mut self) {
        let mut usr1 = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined1()) {
            Ok(signal) => Some(signal),
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGUSR1; interruption notices come by file only");
                None
            }
        };
        let (mut last, mut signals) = (None::<Notice>, 0u64);
        loop {
            let signalled = tokio::select! {
                () = self.shutdown.cancelled() => return,
                Some(()) = async { match usr1.as_mut() { Some(usr1) => usr1.recv().await, None => std::future::pending().await } } => true,
                () = tokio::time::sleep(POLL) => false,
            };
            let (notice, deadline) = if signalled {
                signals += 1;
                (Notice::Signal(signals), self.default_deadline)
            } else {
                match self.read_file().await {
                    Some(text) => {
                        let deadline = self.deadline_in(&text);
                        (Notice::File(text), deadline)
                    }
                    None => continue,
                }
            };
            if last.as_ref() == Some(&notice) {
                continue;
            }
            tracing::warn!(?notice, ?deadline, "interruption notice: draining this node");
            if self.drain(deadline).await {
                last = Some(notice);
            } else {
                return;
            }
        }
    }

    /// What the notice file holds, trimmed; `None` while there is none.
    async fn read_file(&self) -> Option<String> {
        use tokio::io::AsyncReadExt as _;
        let file = tokio::fs::File::open(&self.file).await.ok()?;
        let mut text = String::new();
        file.take(MAX_NOTICE).read_to_string(&mut text).await.ok()?;
        Some(text.trim().to_string())
    }

    /// The deadline a notice file's text names, else the default.
    fn deadline_in(&self, text: &str) -> Duration {
        if text.is_empty() {
            return self.default_deadline;
        }
        match berth_runtime::parse_duration(text) {
            Ok(deadline) if !deadline.is_zero() => deadline,
            _ => {
                tracing::warn!(file = %self.file.display(), %text,
                    default = ?self.default_deadline, "the interruption notice names no deadline; using the default");
                self.default_deadline
            }
        }
    }

    /// Asks identity to drain this node, retrying until it answers; false
    /// when the agent stopped first.
    async fn drain(&mut self, deadline: Duration) -> bool {
        loop {
            let node_id = self.session.borrow().node_id.clone();
            let request = DrainNodeRequest {
                node_id: node_id.clone(),
                undrain: false,
                deadline: prost_types::Duration::try_from(deadline).ok(),
            };
            let mut client = NodesClient::new(self.identity.channel());
            let outcome = tokio::select! {
                () = self.shutdown.cancelled() => return false,
                outcome = self.identity.call(client.drain_node(self.identity.request(request))) => outcome,
            };
            match outcome {
                Ok(_) => {
                    tracing::warn!(%node_id, ?deadline, "this node drains: its work moves to other nodes");
                    self.backoff.reset();
                    return true;
                }
                Err(status) => {
                    let retry = self.backoff.next_delay();
                    tracing::warn!(%node_id, error = %status.message(), retry_in = ?retry,
                        "cannot drain this node for its interruption notice; retrying");
                    tokio::select! {
                        () = self.shutdown.cancelled() => return false,
                        () = tokio::time::sleep(retry) => {}
                    }
                }
            }
        }
    }
}
