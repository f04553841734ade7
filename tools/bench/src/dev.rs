//! A real `berth dev` for the scenarios measured end to end: started as a
//! process of its own on a scratch data directory and seven free loopback
//! ports, driven through the `berth` CLI and its admin identity, and
//! stopped only once the node stopped every replica the scenario made.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use berth_mtls::{TlsCredentials, TlsMaterial};
use berth_proto::agent::v1 as agent;
use berth_rpc::Channel;
use tokio::io::AsyncBufReadExt as _;

/// How long `berth dev` may take to print its banner, and its node to be UP.
pub(crate) const START_DEADLINE: Duration = Duration::from_secs(90);

/// How long `berth dev` may take to exit after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(20);

/// How many ports `berth dev` takes from its base: identity, revisions,
/// leases, egress, the agent, the router's HTTP and HTTPS.
const PORTS: u16 = 7;

/// A step of the set-up that failed, and how.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {detail}")]
pub(crate) struct DevError {
    /// The step.
    pub(crate) what: &'static str,
    /// What went wrong.
    pub(crate) detail: String,
}

/// Names the step a failure happened in.
pub(crate) fn setup(what: &'static str) -> impl Fn(String) -> DevError {
    move |detail| DevError { what, detail }
}

/// Why a scenario on a real `berth dev` could not run to the end.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DevBenchError {
    /// A step of the set-up failed.
    #[error(transparent)]
    Setup(#[from] DevError),
    /// A call to the mesh failed.
    #[error("{what}: {status}")]
    Rpc {
        /// The call.
        what: &'static str,
        /// What was answered.
        status: String,
    },
    /// The report could not be written.
    #[error("cannot write the report: {0}")]
    Output(String),
}

/// Names the call a failure came from.
pub(crate) fn rpc(what: &'static str) -> impl Fn(tonic::Status) -> DevBenchError {
    move |status| DevBenchError::Rpc { what, status: status.to_string() }
}

/// Latency figures of one series of timings, in milliseconds.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct Series {
    pub(crate) count: usize,
    pub(crate) p50_ms: Option<f64>,
    pub(crate) p99_ms: Option<f64>,
    pub(crate) max_ms: Option<f64>,
}

impl Series {
    /// The figures of `samples`, in milliseconds.
    pub(crate) fn of(mut samples: Vec<f64>) -> Self {
        samples.sort_by(f64::total_cmp);
        Self {
            count: samples.len(),
            p50_ms: crate::egress::percentile(&samples, 0.50),
            p99_ms: crate::egress::percentile(&samples, 0.99),
            max_ms: samples.last().copied(),
        }
    }

    /// `title` on a line of its own, then a table of `rows` (label, series)
    /// under a `count p50 p99 max` header, the labels in a column as wide as
    /// the longest.
    pub(crate) fn table(title: &str, rows: &[(&str, &Series)]) -> String {
        let latency = crate::leases::latency;
        let width = rows.iter().map(|(label, _)| label.chars().count()).max().unwrap_or(0) + 2;
        let mut out = format!("{title}\n{:<width$}{:>8}{:>12}{:>12}{:>12}\n", "", "count", "p50", "p99", "max");
        for (label, series) in rows {
            out.push_str(&format!(
                "{label:<width$}{:>8}{:>12}{:>12}{:>12}\n",
                series.count,
                latency(series.p50_ms),
                latency(series.p99_ms),
                latency(series.max_ms)
            ));
        }
        out
    }
}

/// Which port of `berth dev` a channel dials.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Port {
    Identity = 0,
    Revisions = 1,
    Leases = 2,
    Egress = 3,
    Agent = 4,
}

/// A `berth dev` process and how to reach it.
pub(crate) struct Dev {
    exe: PathBuf,
    data: PathBuf,
    base: u16,
    child: tokio::process::Child,
    /// The services applied, deleted before `berth dev` stops.
    services: Vec<String>,
    /// Whether its node ran a workload, which `stop` waits out.
    ran_workloads: bool,
}

impl Dev {
    /// Starts `berth dev` on a data directory under `scratch` with `extra`
    /// flags, and waits for its node to be UP.
    pub(crate) async fn start(scratch: &Path, extra: &[&str]) -> Result<Self, DevError> {
        let exe = crate::process::sibling_binary("berth").map_err(|e| setup("the berth executable")(e.to_string()))?;
        let data = scratch.join("data");
        let base = free_port_base().ok_or_else(|| setup("ports")(format!("no {PORTS} consecutive free ports")))?;
        let mut child = tokio::process::Command::new(&exe)
            .args(["dev", "--data-dir"])
            .arg(&data)
            .args(["--port-base", &base.to_string()])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| setup("starting berth dev")(e.to_string()))?;
        let stdout = child.stdout.take().ok_or_else(|| setup("berth dev")("no stdout".into()))?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let banner = tokio::time::timeout(START_DEADLINE, async {
            while let Ok(Some(line)) = lines.next_line().await {
                if line.starts_with("berth dev is running") {
                    return true;
                }
            }
            false
        })
        .await;
        if banner != Ok(true) {
            return Err(setup("berth dev")(format!("no banner within {START_DEADLINE:?}")));
        }
        // Keep reading so the process never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let dev = Self { exe, data, base, child, services: Vec::new(), ran_workloads: false };
        dev.node_up().await?;
        Ok(dev)
    }

    /// Its data directory (the admin's and the node's identities, the CA).
    pub(crate) fn data(&self) -> &Path {
        &self.data
    }

    /// Identity's port; revisions is one above, leases two.
    pub(crate) fn base(&self) -> u16 {
        self.base
    }

    /// The `berth dev` process's id (its node agent runs in it), while it runs.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    async fn node_up(&self) -> Result<(), DevError> {
        let deadline = Instant::now() + START_DEADLINE;
        loop {
            let listed = self.cli(&["capacity", "-o", "json"]).await.unwrap_or_default();
            let up = serde_json::from_str::<serde_json::Value>(&listed).ok().is_some_and(|parsed| {
                parsed["nodes"].as_array().into_iter().flatten().any(|n| n["state"] == "NODE_STATE_UP")
            });
            if up {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(setup("the dev node")(format!("not UP within {START_DEADLINE:?}")));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// `berth ARGS` as the dev admin; its stdout, or why it failed.
    pub(crate) async fn cli(&self, args: &[&str]) -> Result<String, String> {
        let out = tokio::process::Command::new(&self.exe)
            .args(args)
            .env("BERTH_SERVER", format!("127.0.0.1:{}", self.base))
            .env("BERTH_DATA_DIR", &self.data)
            .env("RUST_LOG", "warn")
            .output()
            .await
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!("berth {args:?}: {}", String::from_utf8_lossy(&out.stderr).trim()))
        }
    }

    /// The dev admin's identity.
    pub(crate) fn admin(&self) -> Result<TlsCredentials, DevError> {
        let material = TlsMaterial::from_files(
            self.data.join("admin.pem"),
            self.data.join("admin-key.pem"),
            self.data.join("ca.pem"),
        )
        .map_err(|e| setup("the dev admin identity")(e.to_string()))?;
        TlsCredentials::new(material).map_err(|e| setup("the dev admin identity")(e.to_string()))
    }

    /// A channel to `port` as the dev admin.
    pub(crate) fn channel(&self, port: Port) -> Result<Channel, DevError> {
        berth_rpc::connect(&format!("127.0.0.1:{}", self.base + port as u16), self.admin()?)
            .map_err(|e| setup("a channel to berth dev")(e.to_string()))
    }

    /// Packs `spec` (a `berth.toml`) into a bundle pushed to an OCI layout
    /// under `scratch`; its reference.
    pub(crate) async fn push_bundle(&self, scratch: &Path, name: &str, spec: &str) -> Result<String, DevError> {
        let bundle = scratch.join(name);
        std::fs::create_dir_all(&bundle).map_err(|e| setup("the bundle")(e.to_string()))?;
        std::fs::write(bundle.join(berth_bundle::SPEC_FILE), spec).map_err(|e| setup("the bundle")(e.to_string()))?;
        let reference = format!("oci:{}:{name}", scratch.join("oci").display());
        let bundle_dir = bundle.display().to_string();
        self.cli(&["bundle", "push", &bundle_dir, &reference]).await.map_err(setup("pushing the bundle"))?;
        Ok(reference)
    }

    /// Applies `spec` (a service template as JSON) as service `name`, and
    /// waits for its replicas to run; it is deleted before `berth dev`
    /// stops.
    pub(crate) async fn apply(&mut self, scratch: &Path, name: &str, spec: &serde_json::Value) -> Result<(), DevError> {
        let path = scratch.join(format!("{name}.json"));
        std::fs::write(&path, spec.to_string()).map_err(|e| setup("a spec file")(e.to_string()))?;
        if !self.services.iter().any(|s| s == name) {
            self.services.push(name.to_string());
        }
        let path = path.display().to_string();
        self.cli(&["service", "apply", "-f", &path, "--name", name, "--wait"]).await.map_err(setup("the service"))?;
        Ok(())
    }

    /// Says the node runs workloads of leases the scenario asked for itself
    /// (and releases before stopping): `stop` waits until the node has
    /// destroyed them, so none outlives the run, nor its cgroup.
    pub(crate) fn ran_workloads(&mut self) {
        self.ran_workloads = true;
    }

    /// Deletes every service applied and waits for the node to have stopped
    /// their replicas (and any other workload it ran), so none outlives the
    /// run, then stops `berth dev`.
    pub(crate) async fn stop(mut self) {
        for service in &self.services {
            if let Err(error) = self.cli(&["service", "delete", service]).await {
                eprintln!("bench: cannot delete service {service}: {error}");
            }
        }
        // The leases end at once; the node then stops the replicas.
        if (self.ran_workloads || !self.services.is_empty())
            && let Ok(channel) = self.channel(Port::Agent)
        {
            let mut agent = agent::agent_client::AgentClient::new(channel);
            let deadline = Instant::now() + Duration::from_secs(60);
            while Instant::now() < deadline {
                // The node lists an ended instance a while (its logs); it is
                // done with one once it is final and runs nothing.
                let listed = agent.list_instances(agent::ListInstancesRequest::default()).await;
                if listed.is_ok_and(|r| r.into_inner().instances.iter().all(|i| !i.phase().is_open() && i.pid == 0)) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        // SIGTERM first: the node closes its proxies and removes the
        // tenants' network namespaces on the way out.
        if let Some(pid) =
            self.child.id().and_then(|id| i32::try_from(id).ok()).and_then(rustix::process::Pid::from_raw)
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        if tokio::time::timeout(STOP_TIMEOUT, self.child.wait()).await.is_err() {
            eprintln!("bench: berth dev did not exit {STOP_TIMEOUT:?} after SIGTERM; killing it");
            let _ = self.child.kill().await;
        }
    }
}

/// [`PORTS`] consecutive free loopback ports (the first of them).
fn free_port_base() -> Option<u16> {
    for _ in 0..50 {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").ok()?;
        let base = probe.local_addr().ok()?.port();
        drop(probe);
        if base > 65_000 {
            continue;
        }
        if (0..PORTS).all(|i| std::net::TcpListener::bind(("127.0.0.1", base + i)).is_ok()) {
            return Some(base);
        }
    }
    None
}
