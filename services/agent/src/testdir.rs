//! A temporary directory for tests that run workloads in it (test builds
//! only): above the providers and `/proc` reading it cleans up with, so none
//! of them imports it back.

use std::path::Path;

use crate::procfs::PROC_ROOT;

/// A temporary directory for tests that run workloads in it: dropping it
/// kills every process still working in it first, so a failed test leaves
/// nothing running behind.
pub(crate) struct TestDir(tempfile::TempDir);

impl TestDir {
    pub(crate) fn new() -> Self {
        Self(tempfile::tempdir().unwrap_or_else(|e| panic!("cannot make a temporary directory: {e}")))
    }

    pub(crate) fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        crate::destroy_containers(self.0.path());
        let Ok(entries) = std::fs::read_dir(PROC_ROOT) else { return };
        for pid in entries.filter_map(Result::ok).filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok()) {
            let proc = Path::new(PROC_ROOT).join(pid.to_string());
            let cwd = std::fs::read_link(proc.join("cwd"));
            // A contained workload's root is under the directory; a gVisor
            // sandbox names it on its command line.
            let root = std::fs::read_link(proc.join("root"));
            let cmdline = std::fs::read(proc.join("cmdline")).unwrap_or_default();
            let named = String::from_utf8_lossy(&cmdline).contains(&*self.0.path().to_string_lossy());
            if (cwd.is_ok_and(|cwd| cwd.starts_with(self.0.path()))
                || root.is_ok_and(|root| root.starts_with(self.0.path()))
                || named)
                && let Some(pid) = rustix::process::Pid::from_raw(pid)
            {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
    }
}
