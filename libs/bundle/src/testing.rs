//! A real OCI registry for tests: Debian's `docker-registry` (Distribution 2.8) serving
//! from a temporary directory on a free loopback port, stopped when dropped; open, behind
//! htpasswd basic auth, or over HTTPS with a certificate from a private CA.
//!
//! # Sharing
//! Each [`TestRegistry`] is its own process with its own storage, so tests never see
//! each other's repositories and need no cleanup beyond dropping it.

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The registry binary's name, as Debian installs it.
pub const REGISTRY_BINARY: &str = "docker-registry";

/// How long a fresh registry may take to answer `/v2/`.
const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// How many free ports to try when another process takes the one picked.
const START_ATTEMPTS: usize = 5;

/// Why the test registry could not run.
#[derive(Debug, thiserror::Error)]
pub enum TestRegistryError {
    /// The binary is not installed.
    #[error("`{REGISTRY_BINARY}` was not found in /usr/bin or on PATH: install docker-registry (make test does it)")]
    Missing,
    /// A file or process operation failed.
    #[error("test registry: {0}")]
    Io(#[from] io::Error),
    /// The registry did not start answering.
    #[error("docker-registry did not come up on {addr}: {log}")]
    NotReady {
        /// The address it was told to listen on.
        addr: SocketAddr,
        /// The end of its log.
        log: String,
    },
    /// The test certificates could not be generated.
    #[error("cannot generate the test certificates: {0}")]
    Tls(String),
    /// The password could not be hashed for htpasswd.
    #[error("cannot hash the test password: {0}")]
    Hash(String),
}

/// A running `docker-registry` on `127.0.0.1`.
#[derive(Debug)]
pub struct TestRegistry {
    dir: tempfile::TempDir,
    binary: PathBuf,
    addr: SocketAddr,
    child: Option<Child>,
    ca_pem: Option<String>,
}

/// How a test registry is set up.
#[derive(Debug, Default)]
struct Setup {
    htpasswd: Option<String>,
    tls: Option<TlsFiles>,
}

#[derive(Debug)]
struct TlsFiles {
    ca_pem: String,
    cert_pem: String,
    key_pem: String,
}

impl TestRegistry {
    /// Starts a registry that anyone may push to and pull from.
    pub async fn start() -> Result<Self, TestRegistryError> {
        Self::start_with(Setup::default()).await
    }

    /// Starts a registry that takes only `username` with `password` (HTTP basic auth from
    /// an htpasswd file, bcrypt-hashed).
    pub async fn start_with_htpasswd(username: &str, password: &str) -> Result<Self, TestRegistryError> {
        let hash = bcrypt::hash(password, 4).map_err(|e| TestRegistryError::Hash(e.to_string()))?;
        Self::start_with(Setup { htpasswd: Some(format!("{username}:{hash}\n")), tls: None }).await
    }

    /// Starts a registry serving HTTPS with a certificate for `127.0.0.1` and `localhost`
    /// from a fresh private CA, whose PEM is [`Self::ca_pem`].
    pub async fn start_with_tls() -> Result<Self, TestRegistryError> {
        Self::start_with(Setup { htpasswd: None, tls: Some(private_ca()?) }).await
    }

    async fn start_with(setup: Setup) -> Result<Self, TestRegistryError> {
        let binary = find_binary().ok_or(TestRegistryError::Missing)?;
        let dir = tempfile::Builder::new().prefix("berth-registry-").tempdir()?;
        if let Some(lines) = &setup.htpasswd {
            std::fs::write(dir.path().join("htpasswd"), lines)?;
        }
        if let Some(tls) = &setup.tls {
            std::fs::write(dir.path().join("cert.pem"), &tls.cert_pem)?;
            std::fs::write(dir.path().join("key.pem"), &tls.key_pem)?;
        }
        let mut last_error = None;
        for _ in 0..START_ATTEMPTS {
            let addr = free_port()?;
            write_config(dir.path(), addr, &setup)?;
            match spawn_and_wait(&binary, dir.path(), addr).await {
                Ok(child) => {
                    let ca_pem = setup.tls.map(|tls| tls.ca_pem);
                    return Ok(Self { dir, binary, addr, child: Some(child), ca_pem });
                }
                // Most likely another process took the port between picking and binding.
                Err(error) => last_error = Some(error),
            }
        }
        Err(last_error.unwrap_or(TestRegistryError::Missing))
    }

    /// The PEM of the CA that signed the registry's certificate, when it serves HTTPS.
    pub fn ca_pem(&self) -> Option<&str> {
        self.ca_pem.as_deref()
    }

    /// `127.0.0.1:PORT`, the registry part of a reference.
    pub fn host(&self) -> String {
        self.addr.to_string()
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A reference into this registry, e.g. `reference("team/app:v1")`.
    pub fn reference(&self, repository_and_tag: &str) -> String {
        format!("{}/{repository_and_tag}", self.host())
    }

    /// Where the registry keeps its blobs and repositories (Distribution's filesystem
    /// layout, `docker/registry/v2/...`), for tests that tamper with what it serves.
    pub fn storage_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Stops the registry; its storage stays until it is dropped.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port with the same storage.
    pub async fn restart(&mut self) -> Result<(), TestRegistryError> {
        self.stop();
        self.child = Some(spawn_and_wait(&self.binary, self.dir.path(), self.addr).await?);
        Ok(())
    }

    /// The `Docker-Content-Digest` the registry answers an anonymous plain-HTTP
    /// `HEAD /v2/<repository>/manifests/<tag>` with, or `None` when it sends none.
    pub async fn manifest_digest(&self, repository: &str, tag: &str) -> Result<Option<String>, TestRegistryError> {
        let path = format!("/v2/{repository}/manifests/{tag}");
        let accept = "application/vnd.oci.image.manifest.v1+json";
        let (_, headers) = head(self.addr, &path, accept).await?;
        Ok(headers.into_iter().find(|(name, _)| name.eq_ignore_ascii_case("docker-content-digest")).map(|(_, v)| v))
    }
}

impl Drop for TestRegistry {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Runs the registry with the config in `dir` and waits until `/v2/` answers.
async fn spawn_and_wait(binary: &Path, dir: &Path, addr: SocketAddr) -> Result<Child, TestRegistryError> {
    let log_path = dir.join("registry.log");
    let log = std::fs::File::create(&log_path)?;
    let mut child = Command::new(binary)
        .arg("serve")
        .arg(dir.join("config.yml"))
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()?;
    let deadline = tokio::time::Instant::now() + READY_TIMEOUT;
    loop {
        let exited = child.try_wait()?.is_some();
        // Any HTTP answer will do: a TLS registry answers plain HTTP with a 400.
        if !exited && head(addr, "/v2/", "").await.is_ok() {
            return Ok(child);
        }
        if exited || tokio::time::Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(5).collect::<Vec<_>>().into_iter().rev().collect();
            return Err(TestRegistryError::NotReady { addr, log: tail.join(" | ") });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn find_binary() -> Option<PathBuf> {
    let system = Path::new("/usr/bin").join(REGISTRY_BINARY);
    if system.is_file() {
        return Some(system);
    }
    std::env::var_os("PATH")
        .and_then(|paths| std::env::split_paths(&paths).map(|dir| dir.join(REGISTRY_BINARY)).find(|p| p.is_file()))
}

fn free_port() -> io::Result<SocketAddr> {
    TcpListener::bind("127.0.0.1:0")?.local_addr()
}

fn write_config(dir: &Path, addr: SocketAddr, setup: &Setup) -> io::Result<()> {
    let mut config = format!(
        "version: 0.1\n\
         log:\n  level: warn\n  accesslog:\n    disabled: true\n\
         storage:\n  filesystem:\n    rootdirectory: {root}\n  delete:\n    enabled: true\n\
         http:\n  addr: {addr}\n  secret: berth-test-registry\n",
        root = dir.join("data").display(),
    );
    if setup.tls.is_some() {
        config.push_str(&format!(
            "  tls:\n    certificate: {}\n    key: {}\n",
            dir.join("cert.pem").display(),
            dir.join("key.pem").display()
        ));
    }
    if setup.htpasswd.is_some() {
        config.push_str(&format!(
            "auth:\n  htpasswd:\n    realm: berth-test\n    path: {}\n",
            dir.join("htpasswd").display()
        ));
    }
    std::fs::write(dir.join("config.yml"), config)
}

/// A CA and a server certificate it signed for `127.0.0.1` and `localhost`.
fn private_ca() -> Result<TlsFiles, TestRegistryError> {
    let generate = |e: rcgen::Error| TestRegistryError::Tls(e.to_string());
    let ca_key = rcgen::KeyPair::generate().map_err(generate)?;
    let mut ca_params = rcgen::CertificateParams::default();
    ca_params.distinguished_name.push(rcgen::DnType::CommonName, "berth test registry CA");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::DigitalSignature];
    let ca_cert = ca_params.self_signed(&ca_key).map_err(generate)?;
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let key = rcgen::KeyPair::generate().map_err(generate)?;
    let mut params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).map_err(generate)?;
    params.subject_alt_names.push(rcgen::SanType::IpAddress(std::net::IpAddr::from([127, 0, 0, 1])));
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let cert = params.signed_by(&key, &issuer).map_err(generate)?;
    Ok(TlsFiles { ca_pem: ca_cert.pem(), cert_pem: cert.pem(), key_pem: key.serialize_pem() })
}

/// A plain HTTP/1.1 HEAD: the status and the headers.
async fn head(addr: SocketAddr, path: &str, accept: &str) -> io::Result<(u16, Vec<(String, String)>)> {
    let mut stream = tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(addr))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))??;
    let accept = if accept.is_empty() { String::new() } else { format!("Accept: {accept}\r\n") };
    let request = format!("HEAD {path} HTTP/1.1\r\nHost: {addr}\r\n{accept}Connection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut response))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no answer"))??;
    let text = String::from_utf8_lossy(&response);
    let mut lines = text.split("\r\n");
    let status = lines
        .next()
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "not an HTTP response"))?;
    let headers = lines
        .take_while(|line| !line.is_empty())
        .filter_map(|line| line.split_once(':'))
        .map(|(name, value)| (name.trim().to_owned(), value.trim().to_owned()))
        .collect();
    Ok((status, headers))
}
