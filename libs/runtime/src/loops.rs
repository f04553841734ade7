//! The loops a process runs beside its server (a replica's campaign for a
//! leader loop and the work it leads), tracked so that a stopping process
//! waits for them.
//!
//! A loop that leads resigns as it ends. A process that exited before its
//! loops had ended would leave its term to lapse, and the other replicas
//! would wait out a whole leader TTL before one took over: every rolling
//! restart of a leader would stop its loop for that long. [`run_main`]
//! waits for every loop spawned here, up to [`LOOPS_GRACE`], once the
//! process's body has returned well (a body that failed may not have
//! stopped its loops, and exits at once).
//!
//! # Invariants
//! - Every loop spawned here ends soon after the shutdown token it watches
//!   is cancelled; the wait is bounded all the same, so a loop that does not
//!   end never keeps a process from exiting.
//!
//! [`run_main`]: crate::run_main

use std::future::Future;
use std::sync::LazyLock;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long a stopping process waits for its loops to end.
pub const LOOPS_GRACE: Duration = Duration::from_secs(5);

static LOOPS: LazyLock<TaskTracker> = LazyLock::new(TaskTracker::new);

/// Spawns `future` as one of the process's loops: a stopping process waits
/// for it (see the module docs).
pub fn spawn_loop<F>(future: F) -> JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    LOOPS.spawn(future)
}

/// Waits, up to `grace`, for every loop spawned so far to end; whether they
/// all did.
pub(crate) async fn wait_for_loops(grace: Duration) -> bool {
    LOOPS.close();
    tokio::time::timeout(grace, LOOPS.wait()).await.is_ok()
}

/// Cancels `closing` once `shutdown` is: a replica's own token, which its
/// loops and open streams end on, follows the process's. Cancelled first,
/// `closing` lets the watch go.
pub fn close_with(shutdown: &CancellationToken, closing: &CancellationToken) {
    let (shutdown, closing) = (shutdown.clone(), closing.clone());
    tokio::spawn(async move {
        tokio::select! {
            () = shutdown.cancelled() => closing.cancel(),
            () = closing.cancelled() => {}
        }
    });
}
