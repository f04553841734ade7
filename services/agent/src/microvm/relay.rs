//! The node's side of a microVM's Workload API: a socket the lease's own
//! host user may reach, relayed by the agent to the lease's Workload API.
//!
//! QEMU runs as the lease's user of the workload range once it has set
//! up (`-runas`), and so do the programs it starts for each guest
//! connection. The lease's Workload API socket lies in the agent's data
//! directory, which only root enters; so each VM gets a directory of its
//! own under [`RELAY_BASE`] (searchable by every user, listable by root
//! alone; the lease's directory is its user's alone) whose socket the
//! agent accepts on and carries, byte for byte, to the lease's own socket.
//! The agent's Workload API still knows the caller by the socket it was
//! reached on.
//!
//! # Invariants
//! - A relay's directory and socket are its lease's user's, mode 0700 and
//!   0600: no other lease's user reaches them.
//! - Where the relay sends is kept in the VM's run directory, so an agent
//!   restarted while the VM runs listens again at the same path (QEMU's
//!   command line names it) and sends to the same socket.
//! - A relay ends, and its directory goes, with its VM.

use std::collections::BTreeMap;
use std::os::unix::fs::{DirBuilderExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;

use crate::instances::io;
use crate::provider::ProviderError;

/// Where the node's relays live: memory-backed, root's.
pub(crate) const RELAY_BASE: &str = "/run/berth";

/// The file in a VM's run directory naming the socket its relay sends to.
const TARGET_FILE: &str = "workload-api-target";

/// The relay's socket in its lease's directory.
const SOCKET: &str = "workload-api.sock";

/// How long a failed accept waits before the next.
const ACCEPT_RETRY: Duration = Duration::from_millis(50);

/// The relays of one provider: under [`RELAY_BASE`], in a directory named
/// by its data directory (two agents on one host keep theirs apart), each
/// running until its VM ends or the agent stops.
#[derive(Debug)]
pub(crate) struct Relays {
    root: PathBuf,
    /// The agent's stop: every relay ends with it.
    shutdown: CancellationToken,
    /// By lease: stops that lease's relay.
    running: Mutex<BTreeMap<String, CancellationToken>>,
}

impl Relays {
    pub(crate) fn new(data_dir: &Path, shutdown: CancellationToken) -> Self {
        Self { root: Self::root_of(data_dir), shutdown, running: Mutex::default() }
    }

    fn root_of(data_dir: &Path) -> PathBuf {
        let name = format!("vm-{:08x}", crate::egress::fnv32(data_dir.as_os_str().as_encoded_bytes()));
        Path::new(RELAY_BASE).join(name)
    }

    /// Removes every relay directory of the provider on `data_dir`, once
    /// no agent runs there (their relays ended with it).
    pub(crate) fn remove_all(data_dir: &Path) {
        let _ = std::fs::remove_dir_all(Self::root_of(data_dir));
    }

    /// The socket `lease_id`'s relay listens on.
    pub(crate) fn socket(&self, lease_id: &str) -> PathBuf {
        self.root.join(lease_id).join(SOCKET)
    }

    /// Listens for `lease_id` as the user `uid`, sending each connection to
    /// `target`, until [`Relays::close`] or the agent stops; `target` is
    /// kept in `run_dir` for [`Relays::reopen`].
    pub(crate) fn open(
        &self,
        lease_id: &str,
        target: &Path,
        uid: u32,
        run_dir: &Path,
    ) -> Result<PathBuf, ProviderError> {
        let kept = run_dir.join(TARGET_FILE);
        std::fs::write(&kept, target.as_os_str().as_encoded_bytes()).map_err(|e| io("writing", &kept, e))?;
        self.listen(lease_id, target, uid)
    }

    /// Listens again for a VM found running after a restart, when it has a
    /// relay; `None` when it has none.
    pub(crate) fn reopen(&self, lease_id: &str, uid: u32, run_dir: &Path) -> Option<Result<PathBuf, ProviderError>> {
        let target = std::fs::read(run_dir.join(TARGET_FILE)).ok()?;
        let target = PathBuf::from(<std::ffi::OsString as std::os::unix::ffi::OsStringExt>::from_vec(target));
        Some(self.listen(lease_id, &target, uid))
    }

    /// Stops `lease_id`'s relay, if it runs, and removes its directory, and
    /// the provider's when no other relay is left in it.
    pub(crate) fn close(&self, lease_id: &str) {
        if let Some(stop) = self.running.lock().unwrap_or_else(PoisonError::into_inner).remove(lease_id) {
            stop.cancel();
        }
        let _ = std::fs::remove_dir_all(self.root.join(lease_id));
        let _ = std::fs::remove_dir(&self.root);
    }

    /// Makes [`RELAY_BASE`] and the provider's directory, each searchable
    /// by every user and listable by root alone.
    fn searchable_root(&self) -> Result<(), ProviderError> {
        for dir in [Path::new(RELAY_BASE), self.root.as_path()] {
            std::fs::DirBuilder::new().recursive(true).mode(0o711).create(dir).map_err(|e| io("creating", dir, e))?;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))
                .map_err(|e| io("opening to search", dir, e))?;
        }
        Ok(())
    }

    fn listen(&self, lease_id: &str, target: &Path, uid: u32) -> Result<PathBuf, ProviderError> {
        let dir = self.root.join(lease_id);
        let _ = std::fs::remove_dir_all(&dir);
        // Twice at most: another relay's close may remove the provider's directory between.
        let mut tries = 0;
        loop {
            self.searchable_root()?;
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => break,
                Err(error) if error.kind() == std::io::ErrorKind::NotFound && tries == 0 => tries += 1,
                Err(error) => return Err(io("creating", &dir, error)),
            }
        }
        std::os::unix::fs::chown(&dir, Some(uid), Some(uid)).map_err(|e| io("giving the lease", &dir, e))?;
        let socket = dir.join(SOCKET);
        let listener = {
            let std_listener =
                std::os::unix::net::UnixListener::bind(&socket).map_err(|e| io("listening on", &socket, e))?;
            std_listener.set_nonblocking(true).map_err(|e| io("listening on", &socket, e))?;
            UnixListener::from_std(std_listener).map_err(|e| io("listening on", &socket, e))?
        };
        std::os::unix::fs::chown(&socket, Some(uid), Some(uid)).map_err(|e| io("giving the lease", &socket, e))?;
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| io("closing to other users", &socket, e))?;
        // A relay listening before (a relaunch, or one re-listened) stops.
        let stop = self.shutdown.child_token();
        if let Some(old) =
            self.running.lock().unwrap_or_else(PoisonError::into_inner).insert(lease_id.into(), stop.clone())
        {
            old.cancel();
        }
        tokio::spawn(relay(listener, target.to_path_buf(), stop));
        Ok(socket)
    }
}

/// Accepts on `listener` until `stop`, carrying each connection to `target`.
async fn relay(listener: UnixListener, target: PathBuf, stop: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let Ok((mut inside, _)) = accepted else {
            tokio::time::sleep(ACCEPT_RETRY).await;
            continue;
        };
        let (target, stop) = (target.clone(), stop.clone());
        tokio::spawn(async move {
            let Ok(mut outside) = UnixStream::connect(&target).await else { return };
            tokio::select! {
                () = stop.cancelled() => {}
                _ = tokio::io::copy_bidirectional(&mut inside, &mut outside) => {}
            }
        });
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use std::io::Write as _;
    use std::os::unix::fs::MetadataExt as _;

    use tokio::io::AsyncReadExt as _;

    use super::*;

    async fn greeting(socket: &Path) -> String {
        let mut stream = UnixStream::connect(socket).await.unwrap();
        let mut read = String::new();
        tokio::time::timeout(Duration::from_secs(10), stream.read_to_string(&mut read)).await.unwrap().unwrap();
        read
    }

    #[tokio::test]
    async fn a_relay_is_its_leases_user_alone_carries_each_connection_and_listens_again_after_a_restart() {
        if !berth_testkit::runs_as_root("a relay given to a lease's user") {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("agent.sock");
        let listener = std::os::unix::net::UnixListener::bind(&target).unwrap();
        std::thread::spawn(move || {
            for mut stream in listener.incoming().map_while(Result::ok) {
                let _ = stream.write_all(b"the workload api\n");
            }
        });
        let agent = CancellationToken::new();
        let relays = Relays::new(tmp.path(), agent.clone());
        let socket = relays.open("lease-r", &target, 310_500, tmp.path()).unwrap();
        let (file, dir) = (std::fs::metadata(&socket).unwrap(), std::fs::metadata(socket.parent().unwrap()).unwrap());
        assert_eq!((file.uid(), file.mode() & 0o777), (310_500, 0o600), "the socket is the lease's user's alone");
        assert_eq!((dir.uid(), dir.mode() & 0o777), (310_500, 0o700), "so is its directory");
        let root = std::fs::metadata(&relays.root).unwrap();
        assert_eq!((root.uid(), root.mode() & 0o777), (0, 0o711), "every user may pass, none may list");
        assert_eq!(greeting(&socket).await, "the workload api\n");
        assert_eq!(greeting(&socket).await, "the workload api\n", "each connection is carried");

        // The agent stops; the next one listens again where QEMU's command line says.
        agent.cancel();
        let relays = Relays::new(tmp.path(), CancellationToken::new());
        let again = relays.reopen("lease-r", 310_500, tmp.path()).unwrap().unwrap();
        assert_eq!(again, socket);
        assert_eq!(greeting(&socket).await, "the workload api\n");
        relays.close("lease-r");
        assert!(!socket.parent().unwrap().exists(), "a relay's directory goes with its VM");
        assert!(!relays.root.exists(), "and the provider's, with its last relay");

        // A VM without a relay has none to listen again for.
        let none = relays.reopen("lease-x", 310_501, &tmp.path().join("nothing"));
        assert!(none.is_none());
    }
}
