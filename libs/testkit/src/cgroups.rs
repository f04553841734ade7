//! What a contained workload's cgroup says about it, read from `/proc` and
//! `/sys/fs/cgroup` as an operator would: which processes a lease's cgroup
//! holds, and the memory limit it enforces. Both cgroup layouts are read:
//! the unified tree, and v1's memory controller.

use std::path::Path;

/// The memory limit of the cgroup `pid` is in, in bytes; `None` when it is
/// not limited (an uncontained workload) or the process is gone.
pub fn memory_limit_of(pid: u32) -> Option<u64> {
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let root = Path::new("/sys/fs/cgroup");
    let (file, path) = if root.join("cgroup.controllers").exists() {
        ("memory.max", cgroups.lines().find_map(|line| line.strip_prefix("0::"))?.to_string())
    } else {
        let line =
            cgroups.lines().find(|line| line.split(':').nth(1).is_some_and(|c| c.split(',').any(|c| c == "memory")))?;
        ("memory.limit_in_bytes", format!("memory{}", line.splitn(3, ':').nth(2)?))
    };
    let text = std::fs::read_to_string(root.join(path.trim_start_matches('/')).join(file)).ok()?;
    text.trim().parse().ok().filter(|limit: &u64| *limit < (1 << 50))
}

/// The processes whose cgroup path has a component named `name` (a
/// contained lease's cgroup is named by its lease id), lowest pid first.
pub fn processes_in_cgroup(name: &str) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    let mut pids: Vec<u32> = entries
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let pid = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let cgroups = std::fs::read_to_string(entry.path().join("cgroup")).ok()?;
            let named = cgroups
                .lines()
                .filter_map(|line| line.splitn(3, ':').nth(2))
                .any(|path| path.split('/').any(|part| part == name));
            named.then_some(pid)
        })
        .collect();
    pids.sort_unstable();
    pids
}
