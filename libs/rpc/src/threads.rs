//! Serving threads: a runtime a thread, each serving the connections dealt
//! to it, for the servers whose every request crosses the host (the
//! router's public listeners, the agent's data plane).
//!
//! On a work-stealing runtime a request that passes from one task to
//! another (a client's connection, the call it makes upstream, the
//! connection that carries it) wakes whichever worker is idle, and most of
//! such a server's CPU goes to threads waking each other, not to its work.
//! Here a connection is dealt, when it is accepted, to one thread in turn;
//! its socket is registered with that thread's runtime and every task it
//! spawns runs there, so a request never leaves the thread its connection
//! lives on. Measured in BENCHMARKS.md ("A runtime per serving thread").
//!
//! # Invariants
//! - A connection's socket, and the tasks spawned while serving it, belong
//!   to the one runtime it was dealt to.
//! - Connections are dealt in turn, so they spread evenly whatever the
//!   kernel's wake-up order.
//! - The threads run until the last handle to them is dropped; then every
//!   task still on them is dropped with their runtimes.

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::net::TcpStream;
use tokio::runtime::Handle;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Runtimes on threads of their own; see the module docs.
#[derive(Debug)]
pub struct ServingThreads {
    runtimes: Vec<Handle>,
    next: AtomicUsize,
    /// Cancelled when the last handle is dropped: each thread then ends its runtime.
    stop: CancellationToken,
}

impl ServingThreads {
    /// Starts `count` threads (at least one) named `name-N`, each running a
    /// single-threaded runtime with I/O and timers.
    pub fn start(name: &str, count: usize) -> io::Result<Arc<Self>> {
        let stop = CancellationToken::new();
        let mut runtimes = Vec::new();
        for index in 0..count.max(1) {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            runtimes.push(runtime.handle().clone());
            let stopped = stop.clone();
            std::thread::Builder::new().name(format!("{name}-{index}")).spawn(move || {
                runtime.block_on(stopped.cancelled());
            })?;
        }
        Ok(Arc::new(Self { runtimes, next: AtomicUsize::new(0), stop }))
    }

    /// One serving thread a CPU this process may use.
    pub fn per_cpu(name: &str) -> io::Result<Arc<Self>> {
        Self::start(name, std::thread::available_parallelism().map_or(1, usize::from))
    }

    /// How many threads serve.
    pub fn count(&self) -> usize {
        self.runtimes.len()
    }

    /// The thread the next connection goes to: each in turn.
    fn next(&self) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed) % self.runtimes.len()
    }

    /// Deals `tcp` to the next thread in turn: takes it off the calling
    /// runtime, and on that thread's registers it there and runs
    /// `serve(thread, tcp)`. Returns at once; an error means the socket
    /// could not leave the calling runtime (it is closed).
    pub fn deal<F, Fut>(&self, tcp: TcpStream, serve: F) -> io::Result<()>
    where
        F: FnOnce(usize, TcpStream) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let tcp = tcp.into_std()?;
        let thread = self.next();
        drop(self.spawn(thread, async move {
            match TcpStream::from_std(tcp) {
                Ok(tcp) => serve(thread, tcp).await,
                Err(error) => tracing::warn!(%error, thread, "a serving thread cannot take a connection"),
            }
        }));
        Ok(())
    }

    /// Runs `future` on thread `index` (taken modulo the count).
    pub(crate) fn spawn<F>(&self, index: usize, future: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.runtimes[index % self.runtimes.len()].spawn(future)
    }
}

impl Drop for ServingThreads {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::oneshot;

    #[tokio::test]
    async fn connections_are_dealt_to_each_thread_in_turn_and_run_there() {
        let threads = ServingThreads::start("test-serving", 3).expect("threads");
        assert_eq!(threads.count(), 3);
        let mut names = Vec::new();
        for _ in 0..6 {
            let index = threads.next();
            let name = threads
                .spawn(index, async {
                    // A task spawned from a dealt one stays on its thread.
                    tokio::spawn(async { std::thread::current().name().map(str::to_string) }).await.expect("task")
                })
                .await
                .expect("dealt");
            names.push(name.expect("a named thread"));
        }
        assert_eq!(
            names,
            [
                "test-serving-0",
                "test-serving-1",
                "test-serving-2",
                "test-serving-0",
                "test-serving-1",
                "test-serving-2"
            ]
        );
    }

    #[tokio::test]
    async fn dropping_the_last_handle_ends_the_threads_and_their_tasks() {
        let threads = ServingThreads::start("test-ending", 2).expect("threads");
        let (held, released) = oneshot::channel::<()>();
        let waiting = threads.spawn(0, async move {
            let _held = held;
            std::future::pending::<()>().await;
        });
        drop(threads);
        // The task is dropped with its runtime, and what it held with it.
        let _ = tokio::time::timeout(std::time::Duration::from_secs(10), released).await.expect("released in time");
        assert!(waiting.await.expect_err("cancelled").is_cancelled());
    }
}
