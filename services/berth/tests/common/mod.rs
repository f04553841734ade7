//! What every end-to-end test of the `berth` binary needs: free ports and a
//! real `berth dev` started on them.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// How long `berth dev` may take to print its banner.
const BANNER_DEADLINE: Duration = Duration::from_secs(60);

/// A port base whose five ports are free right now.
pub(crate) fn free_port_base() -> u16 {
    for _ in 0..50 {
        let probe = TcpListener::bind("127.0.0.1:0").expect("a free port");
        let base = probe.local_addr().expect("a bound port").port();
        drop(probe);
        if base > 65000 {
            continue;
        }
        if (0..5).all(|i| TcpListener::bind(("127.0.0.1", base + i)).is_ok()) {
            return base;
        }
    }
    panic!("no five consecutive free ports");
}

/// Stops a `berth dev` on `dir` as Ctrl-C does (SIGTERM: it stops its node's
/// workloads first), SIGKILL if it has not exited within a few seconds, then
/// destroys any container its node left, so no test leaves one behind.
#[allow(clippy::disallowed_methods, reason = "called from Drop and plain tests, outside any runtime")]
pub(crate) fn stop_dev(child: &mut Child, dir: &Path) {
    if let Ok(pid) = i32::try_from(child.id()) {
        let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status();
    }
    for _ in 0..200 {
        if matches!(child.try_wait(), Ok(Some(_))) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(25));
    }
    let _ = child.kill();
    let _ = child.wait();
    berth_agent::destroy_containers(&dir.join("agent"));
}

/// Starts `berth dev` on `dir` and `base` and waits for its banner; the
/// caller owns (and stops, with [`stop_dev`]) the process.
pub(crate) fn spawn_dev(dir: &Path, base: u16) -> Child {
    spawn_dev_with(dir, base, &[])
}

/// Like [`spawn_dev`], with `extra` flags for `berth dev`.
pub(crate) fn spawn_dev_with(dir: &Path, base: u16, extra: &[&str]) -> Child {
    let mut child = Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["dev", "--data-dir"])
        .arg(dir)
        .args(["--port-base", &base.to_string()])
        .args(extra)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("berth binary runs");
    let stdout = child.stdout.take().expect("a piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.starts_with("berth dev is running") {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(BANNER_DEADLINE).expect("berth dev printed its banner");
    child
}
