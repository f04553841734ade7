//! One node agent as a process of its own (`berth-agent`), in its own
//! network namespace when the mesh has them, with its data directory kept
//! across restarts so a restarted agent resumes its node and adopts what
//! it left running.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context as _, bail};

use crate::netns::NodeNamespace;
use crate::process::{ManagedProcess, ProcessSpec};

/// How a node is cut off from the control plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// Its network namespace's link is down; the agent keeps running.
    Network,
    /// The agent is frozen with SIGSTOP (no namespace to cut); its
    /// workloads keep running.
    Frozen,
}

/// A node agent the mesh runs.
#[derive(Debug)]
pub struct AgentProcess {
    name: String,
    spec: ProcessSpec,
    api_addr: SocketAddr,
    // Before the namespace: a dropped agent is killed before its namespace goes.
    process: Option<ManagedProcess>,
    cut: Option<Cut>,
    namespace: Option<NodeNamespace>,
}

impl AgentProcess {
    /// An agent that will run as `spec`, reachable from the host at
    /// `api_addr`, inside `namespace` if given (the spec must say so too).
    pub fn new(name: String, spec: ProcessSpec, api_addr: SocketAddr, namespace: Option<NodeNamespace>) -> Self {
        Self { name, spec, api_addr, process: None, cut: None, namespace }
    }

    /// The node name it joins under (`--name`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where the host dials its agent API.
    pub fn api_addr(&self) -> SocketAddr {
        self.api_addr
    }

    /// Its pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().filter(|p| p.is_running()).map(ManagedProcess::pid)
    }

    /// Whether the process runs (a frozen agent runs).
    pub fn is_running(&self) -> bool {
        self.process.as_ref().is_some_and(ManagedProcess::is_running)
    }

    /// Whether it is cut off now, and how.
    pub fn cut_state(&self) -> Option<Cut> {
        self.cut
    }

    /// How it will be cut off: by its network if it has a namespace.
    pub fn cut_kind(&self) -> Cut {
        if self.namespace.is_some() { Cut::Network } else { Cut::Frozen }
    }

    /// Changes how the agent is started (flags, environment), from its
    /// next start on.
    pub fn reconfigure(&mut self, change: impl FnOnce(ProcessSpec) -> ProcessSpec) {
        self.spec = change(self.spec.clone());
    }

    /// Its log, every life of it; empty when there is none yet.
    pub fn log_text(&self) -> String {
        // Lossy: a workload's bytes in a logged error must not hide the rest.
        std::fs::read(self.spec.log()).map(|log| String::from_utf8_lossy(&log).into_owned()).unwrap_or_default()
    }

    /// How many times `needle` appears in its log, every life of it.
    pub fn log_count(&self, needle: &str) -> usize {
        self.log_text().matches(needle).count()
    }

    /// Starts the agent (again); a no-op while it runs.
    pub fn start(&mut self) -> anyhow::Result<()> {
        if self.is_running() {
            return Ok(());
        }
        self.process = Some(self.spec.spawn()?);
        Ok(())
    }

    /// `kill -9`: the agent dies at once, its workloads keep running.
    pub async fn kill(&mut self) -> anyhow::Result<()> {
        match self.process.as_mut() {
            Some(process) => process.kill().await,
            None => bail!("agent {} is not running", self.name),
        }
    }

    /// SIGTERM (the agent leaves its workloads running), SIGKILL after `grace`.
    pub async fn stop(&mut self, grace: Duration) -> anyhow::Result<()> {
        if let Some(process) = self.process.as_mut() {
            process.terminate(grace).await?;
        }
        self.cut = None;
        Ok(())
    }

    /// Cuts the node off from everything (see [`Cut`]).
    pub fn cut(&mut self) -> anyhow::Result<Cut> {
        let kind = self.cut_kind();
        match (&self.namespace, &self.process) {
            (Some(namespace), _) => namespace.cut()?,
            (None, Some(process)) => process.suspend()?,
            (None, None) => bail!("agent {} is not running", self.name),
        }
        self.cut = Some(kind);
        Ok(kind)
    }

    /// Ends the cut.
    pub fn heal(&mut self) -> anyhow::Result<()> {
        match self.cut.take() {
            Some(Cut::Network) => self.namespace.as_ref().context("a network cut without a namespace")?.heal(),
            Some(Cut::Frozen) => self.process.as_ref().context("a frozen agent without a process")?.resume(),
            None => Ok(()),
        }
    }

    /// Its log, every life of it appended.
    pub fn log_path(&self) -> &std::path::Path {
        self.spec.log()
    }

    /// The last lines of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        crate::process::log_tail(self.spec.log(), lines)
    }
}
