//! The node's identity in the agent's data directory: its key, certificate,
//! CA bundle, node id, incarnation and heartbeat interval, kept so that a
//! restarted agent resumes as the same node without a join token.
//!
//! # What is stored
//! ```text
//! DATA_DIR/agent.lock          held (flock) by the one agent using DATA_DIR
//! DATA_DIR/identity            symlink to the current generation
//! DATA_DIR/identity.<n>/       one complete identity:
//!     node.key  (0600)         the node's private key, PKCS#8 PEM
//!     node.pem                 its certificate, PEM
//!     ca.pem                   every CA the node trusts, PEM
//!     node.json                node id, incarnation, heartbeat interval,
//!                              when the certificate was received
//! DATA_DIR/revoked.json        written when an operator revoked the node
//! ```
//!
//! # Crash safety
//! A new identity (join, renewal, new CA bundle, rejoin) is written whole into
//! a fresh generation directory, flushed, and then published by renaming a new
//! symlink over `identity`, the way Kubernetes writes secret volumes. A crash
//! at any point leaves `identity` naming either the old generation or the new
//! one, never a mix of the two; leftovers are removed on the next open.
//!
//! # Who writes this
//! Only the agent holding `agent.lock`; a second agent on the same directory
//! is refused at start.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use berth_core::Identity;
use berth_mtls::{TlsMaterial, cert_not_after, certs_from_pem, identity_from_cert};

use crate::files::FileError;
use crate::generations::{Generations, TMP_SUFFIX, sync_dir, write_synced};

/// The symlink naming the current generation.
const CURRENT: &str = "identity";
/// Generation directories are `identity.<n>`.
const GENERATION_PREFIX: &str = "identity.";
const KEY_FILE: &str = "node.key";
const CERT_FILE: &str = "node.pem";
const CA_FILE: &str = "ca.pem";
const RECORD_FILE: &str = "node.json";
const REVOKED_FILE: &str = "revoked.json";
const LOCK_FILE: &str = "agent.lock";

/// Why the identity in the data directory could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum IdentityDirError {
    /// A file or directory could not be created, read or written.
    #[error(transparent)]
    Io(#[from] crate::files::FileError),
    /// Another agent is running on the same data directory.
    #[error("data directory {path} is in use by another berth-agent")]
    Locked {
        /// The data directory.
        path: String,
    },
    /// The stored identity is unreadable or does not hang together.
    #[error("node identity in {path} is unusable: {detail}; move it away and join again with a join token")]
    Corrupt {
        /// The generation directory.
        path: String,
        /// What is wrong with it.
        detail: String,
    },
}

/// The node's identity: who it is, the session it holds, and the key material
/// that proves it.
#[derive(Clone)]
pub(crate) struct NodeIdentity {
    /// The id the server chose at join.
    pub(crate) node_id: String,
    /// The incarnation heartbeats carry; a stale one is fenced.
    pub(crate) incarnation: u64,
    /// How often to heartbeat, as the server last said.
    pub(crate) heartbeat_interval: Duration,
    /// The node certificate, PEM.
    pub(crate) cert_pem: String,
    /// Its private key, PKCS#8 PEM.
    pub(crate) key_pem: String,
    /// Every CA the node trusts, PEM.
    pub(crate) ca_bundle_pem: String,
    /// When this agent received the certificate, by its own clock.
    pub(crate) cert_received_at: SystemTime,
    /// When the certificate expires.
    pub(crate) cert_not_after: SystemTime,
}

impl std::fmt::Debug for NodeIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeIdentity")
            .field("node_id", &self.node_id)
            .field("incarnation", &self.incarnation)
            .field("heartbeat_interval", &self.heartbeat_interval)
            .field("cert_not_after", &self.cert_not_after)
            .finish_non_exhaustive()
    }
}

impl NodeIdentity {
    /// Builds an identity from what the server sent, checking that the
    /// certificate names `node_id`. `received_at` starts the certificate's
    /// life as this agent counts it.
    pub(crate) fn new(
        node_id: String,
        incarnation: u64,
        heartbeat_interval: Duration,
        material: TlsMaterial,
        received_at: SystemTime,
    ) -> Result<Self, String> {
        let certs = certs_from_pem("certificate", &material.cert_chain_pem).map_err(|e| e.to_string())?;
        let named = identity_from_cert(&certs[0]);
        let expected = Identity::node(node_id.clone()).map_err(|e| e.to_string())?;
        if named.as_ref() != Some(&expected) {
            let named = named.map_or_else(|| "no berth identity".to_string(), |id| id.to_string());
            return Err(format!("the certificate names {named}, not {expected}"));
        }
        let not_after = cert_not_after(&certs[0]).map_err(|e| e.to_string())?;
        Ok(Self {
            node_id,
            incarnation,
            heartbeat_interval,
            cert_pem: material.cert_chain_pem,
            key_pem: material.key_pem,
            ca_bundle_pem: material.ca_bundle_pem,
            cert_received_at: received_at,
            cert_not_after: UNIX_EPOCH + Duration::from_secs(not_after.max(0) as u64),
        })
    }

    /// The PEM material the node serves and dials with.
    pub(crate) fn material(&self) -> TlsMaterial {
        TlsMaterial {
            cert_chain_pem: self.cert_pem.clone(),
            key_pem: self.key_pem.clone(),
            ca_bundle_pem: self.ca_bundle_pem.clone(),
        }
    }

    /// When a renewal is due: half way from receiving the certificate to its
    /// expiry. Counted from receipt rather than `notBefore` because the
    /// authority backdates certificates to absorb clock skew.
    pub(crate) fn renew_after(&self) -> SystemTime {
        let life = self.cert_not_after.duration_since(self.cert_received_at).unwrap_or_default();
        self.cert_received_at + life / 2
    }

    /// Whether the certificate has expired at `now`.
    pub(crate) fn expired_at(&self, now: SystemTime) -> bool {
        now >= self.cert_not_after
    }
}

/// What `node.json` holds.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct NodeRecord {
    node_id: String,
    incarnation: u64,
    heartbeat_interval_ms: u64,
    cert_received_at_ms: u64,
}

/// What `revoked.json` holds.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Revocation {
    /// The node that was revoked.
    pub(crate) node_id: String,
    /// When the agent learned of it, milliseconds since the Unix epoch.
    pub(crate) revoked_at_ms: u64,
}

/// The agent's data directory, locked for this agent.
#[derive(Debug)]
pub(crate) struct IdentityDir {
    root: PathBuf,
    // Held for the life of the agent: flock is released when the file closes.
    _lock: File,
}

impl IdentityDir {
    /// Creates the directory (0700) if needed, takes its lock, and removes
    /// what an interrupted write left behind. An existing directory keeps its
    /// mode: the key is protected by its own file and generation directory.
    pub(crate) fn open(root: &Path) -> Result<Self, IdentityDirError> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(root)
            .map_err(|source| io("create", root, source))?;
        let lock_path = root.join(LOCK_FILE);
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&lock_path)
            .map_err(|source| io("open", &lock_path, source))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(IdentityDirError::Locked { path: root.display().to_string() });
            }
            Err(std::fs::TryLockError::Error(source)) => return Err(io("lock", &lock_path, source)),
        }
        let dir = Self { root: root.to_path_buf(), _lock: lock };
        dir.remove_stale()?;
        Ok(dir)
    }

    /// The data directory.
    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    /// The current identity, or `None` when the node never joined.
    pub(crate) fn load(&self) -> Result<Option<NodeIdentity>, IdentityDirError> {
        let current = self.root.join(CURRENT);
        match std::fs::symlink_metadata(&current) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(io("read", &current, source)),
        }
        let corrupt = |detail: String| IdentityDirError::Corrupt { path: current.display().to_string(), detail };
        let record_path = current.join(RECORD_FILE);
        let record: NodeRecord = serde_json::from_str(&read(&record_path)?)
            .map_err(|e| corrupt(format!("{}: {e}", record_path.display())))?;
        let material = TlsMaterial {
            cert_chain_pem: read(&current.join(CERT_FILE))?,
            key_pem: read(&current.join(KEY_FILE))?,
            ca_bundle_pem: read(&current.join(CA_FILE))?,
        };
        // The key must match the certificate and the bundle must parse, or
        // the agent would fail at its first handshake instead of here.
        berth_mtls::TlsCredentials::new(material.clone()).map_err(|e| corrupt(e.to_string()))?;
        NodeIdentity::new(
            record.node_id,
            record.incarnation,
            Duration::from_millis(record.heartbeat_interval_ms),
            material,
            UNIX_EPOCH + Duration::from_millis(record.cert_received_at_ms),
        )
        .map(Some)
        .map_err(corrupt)
    }

    /// Writes `identity` as the new current generation; see the module docs
    /// for why a crash never leaves half of it.
    pub(crate) fn save(&self, identity: &NodeIdentity) -> Result<(), IdentityDirError> {
        let record = NodeRecord {
            node_id: identity.node_id.clone(),
            incarnation: identity.incarnation,
            heartbeat_interval_ms: identity.heartbeat_interval.as_millis().min(u64::MAX as u128) as u64,
            cert_received_at_ms: unix_ms(identity.cert_received_at),
        };
        let record = serde_json::to_string_pretty(&record).map_err(|e| IdentityDirError::Corrupt {
            path: self.root.display().to_string(),
            detail: format!("cannot encode {RECORD_FILE}: {e}"),
        })?;
        self.generations().publish(
            &[
                (KEY_FILE, identity.key_pem.as_bytes(), 0o600),
                (CERT_FILE, identity.cert_pem.as_bytes(), 0o644),
                (CA_FILE, identity.ca_bundle_pem.as_bytes(), 0o644),
                (RECORD_FILE, record.as_bytes(), 0o644),
            ],
            None,
        )?;
        self.remove_stale()
    }

    /// The revocation this data directory records, if any.
    pub(crate) fn revocation(&self) -> Result<Option<Revocation>, IdentityDirError> {
        let path = self.root.join(REVOKED_FILE);
        match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text)
                .map(Some)
                .map_err(|e| IdentityDirError::Corrupt { path: path.display().to_string(), detail: e.to_string() }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(io("read", &path, source)),
        }
    }

    /// Records that `node_id` was revoked, so a restarted agent does not
    /// heartbeat with an identity the control plane refuses.
    pub(crate) fn record_revocation(&self, node_id: &str) -> Result<(), IdentityDirError> {
        let revocation = Revocation { node_id: node_id.to_string(), revoked_at_ms: unix_ms(SystemTime::now()) };
        let text = serde_json::to_string_pretty(&revocation).map_err(|e| IdentityDirError::Corrupt {
            path: self.root.join(REVOKED_FILE).display().to_string(),
            detail: e.to_string(),
        })?;
        let staging = self.root.join(format!("{REVOKED_FILE}{TMP_SUFFIX}"));
        write_synced(&staging, text.as_bytes(), 0o644)?;
        let path = self.root.join(REVOKED_FILE);
        std::fs::rename(&staging, &path).map_err(|source| io("rename", &staging, source))?;
        Ok(sync_dir(&self.root)?)
    }

    fn generations(&self) -> Generations<'_> {
        Generations { root: &self.root, current: CURRENT, prefix: GENERATION_PREFIX }
    }

    /// Removes every generation but the current one, and staging leftovers.
    fn remove_stale(&self) -> Result<(), IdentityDirError> {
        Ok(self.generations().remove_stale(&[REVOKED_FILE])?)
    }
}

fn io(action: &'static str, path: &Path, source: std::io::Error) -> IdentityDirError {
    IdentityDirError::Io(FileError::new(action, path, source))
}

fn read(path: &Path) -> Result<String, IdentityDirError> {
    std::fs::read_to_string(path).map_err(|source| io("read", path, source))
}

pub(crate) fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis().min(u64::MAX as u128) as u64)
}

#[cfg(test)]
mod tests {
    use berth_mtls::CertificateAuthority;

    use super::*;

    fn identity(ca: &CertificateAuthority, node_id: &str, incarnation: u64) -> NodeIdentity {
        let (cert, key) =
            ca.issue(&Identity::node(node_id).unwrap(), &["127.0.0.1".into()], Duration::from_secs(600)).unwrap();
        let material = TlsMaterial { cert_chain_pem: cert.cert_pem, key_pem: key, ca_bundle_pem: ca.cert_pem().into() };
        NodeIdentity::new(node_id.into(), incarnation, Duration::from_millis(1500), material, SystemTime::now())
            .unwrap()
    }

    fn ca() -> CertificateAuthority {
        CertificateAuthority::generate("test CA", Duration::from_secs(3600)).unwrap()
    }

    #[test]
    fn saved_identity_loads_back_with_a_private_key_file() {
        let parent = tempfile::tempdir().unwrap();
        let root = parent.path().join("agent");
        let dir = IdentityDir::open(&root).unwrap();
        assert!(dir.load().unwrap().is_none());
        let saved = identity(&ca(), "n-1", 3);
        dir.save(&saved).unwrap();

        let loaded = dir.load().unwrap().unwrap();
        assert_eq!(loaded.node_id, "n-1");
        assert_eq!(loaded.incarnation, 3);
        assert_eq!(loaded.heartbeat_interval, Duration::from_millis(1500));
        assert_eq!(loaded.key_pem, saved.key_pem);
        assert_eq!(unix_ms(loaded.cert_received_at), unix_ms(saved.cert_received_at));
        use std::os::unix::fs::PermissionsExt as _;
        let key = root.join(CURRENT).join(KEY_FILE);
        assert_eq!(std::fs::metadata(key).unwrap().permissions().mode() & 0o777, 0o600);
        let generation = std::fs::canonicalize(root.join(CURRENT)).unwrap();
        assert_eq!(std::fs::metadata(generation).unwrap().permissions().mode() & 0o777, 0o700);
        assert_eq!(std::fs::metadata(&root).unwrap().permissions().mode() & 0o777, 0o700);
    }

    #[test]
    fn a_new_generation_replaces_the_old_one_whole() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = IdentityDir::open(tmp.path()).unwrap();
        let ca = ca();
        dir.save(&identity(&ca, "n-1", 1)).unwrap();
        dir.save(&identity(&ca, "n-2", 2)).unwrap();
        assert_eq!(dir.load().unwrap().unwrap().node_id, "n-2");
        let generations: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .filter_map(|e| e.unwrap().file_name().to_str()?.strip_prefix(GENERATION_PREFIX)?.parse::<u64>().ok())
            .collect();
        assert_eq!(generations, vec![2], "old generations are removed");
    }

    #[test]
    fn a_crash_mid_write_leaves_the_previous_identity_in_force() {
        let tmp = tempfile::tempdir().unwrap();
        let ca = ca();
        {
            let dir = IdentityDir::open(tmp.path()).unwrap();
            dir.save(&identity(&ca, "n-1", 1)).unwrap();
        }
        // What a crash after writing half of the next generation leaves:
        // a staging directory with a key and no certificate, a finished
        // generation that was never published, and a dangling staging link.
        let staging = tmp.path().join("identity.2.tmp");
        std::fs::create_dir(&staging).unwrap();
        std::fs::write(staging.join(KEY_FILE), "half").unwrap();
        std::fs::create_dir(tmp.path().join("identity.3")).unwrap();
        std::os::unix::fs::symlink("identity.3", tmp.path().join("identity.tmp")).unwrap();

        let dir = IdentityDir::open(tmp.path()).unwrap();
        assert_eq!(dir.load().unwrap().unwrap().node_id, "n-1");
        assert!(!staging.exists() && !tmp.path().join("identity.3").exists());
        assert!(std::fs::symlink_metadata(tmp.path().join("identity.tmp")).is_err());
    }

    #[test]
    fn a_second_agent_on_the_same_directory_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let first = IdentityDir::open(tmp.path()).unwrap();
        let err = IdentityDir::open(tmp.path()).unwrap_err();
        assert!(matches!(err, IdentityDirError::Locked { .. }), "{err}");
        drop(first);
        IdentityDir::open(tmp.path()).unwrap();
    }

    #[test]
    fn a_key_that_does_not_match_the_certificate_is_reported_not_used() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = IdentityDir::open(tmp.path()).unwrap();
        let ca = ca();
        dir.save(&identity(&ca, "n-1", 1)).unwrap();
        let other = identity(&ca, "n-2", 1);
        std::fs::write(tmp.path().join(CURRENT).join(KEY_FILE), other.key_pem).unwrap();
        let err = dir.load().unwrap_err();
        assert!(matches!(err, IdentityDirError::Corrupt { .. }), "{err}");
        assert!(err.to_string().contains("join again"), "{err}");
    }

    #[test]
    fn a_certificate_for_another_node_is_refused() {
        let ca = ca();
        let (cert, key) = ca.issue(&Identity::node("n-9").unwrap(), &[], Duration::from_secs(60)).unwrap();
        let material = TlsMaterial { cert_chain_pem: cert.cert_pem, key_pem: key, ca_bundle_pem: ca.cert_pem().into() };
        let err = NodeIdentity::new("n-1".into(), 1, Duration::from_secs(1), material, SystemTime::now()).unwrap_err();
        assert!(err.contains("node 'n-9'"), "{err}");
    }

    #[test]
    fn renewal_is_due_half_way_from_receipt_to_expiry() {
        let mut id = identity(&ca(), "n-1", 1);
        let received = UNIX_EPOCH + Duration::from_secs(1_000);
        id.cert_received_at = received;
        id.cert_not_after = received + Duration::from_secs(10);
        assert_eq!(id.renew_after(), received + Duration::from_secs(5));
        assert!(!id.expired_at(received + Duration::from_secs(9)));
        assert!(id.expired_at(received + Duration::from_secs(10)));
    }

    #[test]
    fn revocation_is_remembered() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = IdentityDir::open(tmp.path()).unwrap();
        assert_eq!(dir.revocation().unwrap(), None);
        dir.record_revocation("n-1").unwrap();
        assert_eq!(dir.revocation().unwrap().unwrap().node_id, "n-1");
    }
}
