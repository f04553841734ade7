//! A Redis server of the test's own on a free loopback port, with nothing
//! persisted (`--save '' --appendonly no`): restarting it loses every key,
//! exactly as a production Redis without persistence does, and `FLUSHALL`
//! can be sent without touching the Redis other tests share.

use std::net::Ipv4Addr;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, bail};
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::TcpStream;

use crate::ports::free_port;
use crate::process::{ManagedProcess, ProcessSpec};

/// Overrides the `redis-server` binary.
pub const REDIS_SERVER_ENV: &str = "BERTH_E2E_REDIS_SERVER";

/// How long the server may take to answer PING.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// How long one command may take.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);

/// A private Redis server.
#[derive(Debug)]
pub struct PrivateRedis {
    dir: tempfile::TempDir,
    port: u16,
    process: Option<ManagedProcess>,
}

impl PrivateRedis {
    /// Starts a server on a free port, its directory a new temporary one.
    pub async fn start() -> anyhow::Result<Self> {
        Self::start_in(&std::env::temp_dir()).await
    }

    /// Starts a server on a free port, its directory a new one under `parent`.
    pub async fn start_in(parent: &Path) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("berth-e2e-redis-")
            .tempdir_in(parent)
            .with_context(|| format!("cannot make a directory in {}", parent.display()))?;
        let mut redis = Self { dir, port: free_port()?, process: None };
        redis.start_again().await?;
        Ok(redis)
    }

    /// The URL services are given.
    pub fn url(&self) -> String {
        format!("redis://{}:{}", Ipv4Addr::LOCALHOST, self.port)
    }

    /// Whether the server process runs.
    pub fn is_running(&self) -> bool {
        self.process.as_ref().is_some_and(ManagedProcess::is_running)
    }

    /// Starts the server (again) on the same port, empty, and waits for PING.
    pub async fn start_again(&mut self) -> anyhow::Result<()> {
        if self.is_running() {
            return Ok(());
        }
        let program = std::env::var_os(REDIS_SERVER_ENV).unwrap_or_else(|| "redis-server".into());
        let process = ProcessSpec::new("redis-server", program, self.dir.path().join("redis.log"))
            .arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .current_dir(self.dir.path())
            .spawn()?;
        let pongs = async || self.command(&["PING"]).await.is_ok_and(|answer| answer == "+PONG");
        process.until_ready("answer PING", READY_TIMEOUT, Duration::from_millis(50), pongs).await?;
        self.process = Some(process);
        Ok(())
    }

    /// Stops the server (SIGTERM: with nothing to save it exits at once);
    /// every key is gone.
    pub async fn stop(&mut self) -> anyhow::Result<()> {
        if let Some(mut process) = self.process.take() {
            process.terminate(Duration::from_secs(10)).await?;
        }
        Ok(())
    }

    /// Stops the server, keeps it down for `down_for`, and starts it again empty.
    pub async fn restart(&mut self, down_for: Duration) -> anyhow::Result<()> {
        self.stop().await?;
        tokio::time::sleep(down_for).await;
        self.start_again().await
    }

    /// `FLUSHALL`: every key of every database is gone, the server stays up.
    pub async fn flushall(&self) -> anyhow::Result<()> {
        let answer = self.command(&["FLUSHALL"]).await?;
        if answer != "+OK" {
            bail!("FLUSHALL answered {answer}");
        }
        Ok(())
    }

    /// Sends one command in RESP and returns the first line of the answer.
    pub async fn command(&self, args: &[&str]) -> anyhow::Result<String> {
        let exchange = async {
            let mut stream = TcpStream::connect((Ipv4Addr::LOCALHOST, self.port)).await?;
            let mut request = format!("*{}\r\n", args.len());
            for arg in args {
                request.push_str(&format!("${}\r\n{arg}\r\n", arg.len()));
            }
            stream.write_all(request.as_bytes()).await?;
            let mut line = String::new();
            BufReader::new(stream).read_line(&mut line).await?;
            Ok::<_, std::io::Error>(line.trim_end().to_string())
        };
        tokio::time::timeout(COMMAND_TIMEOUT, exchange)
            .await
            .context("redis did not answer in time")?
            .with_context(|| format!("redis command {}", args.first().copied().unwrap_or_default()))
    }
}
