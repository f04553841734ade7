//! What a template or lease may say about the cache volumes it mounts, in
//! one place, so that every service that accepts a mount (revisions,
//! leases, the node that mounts it) accepts the same ones.

/// The longest key a cache volume may have.
pub const MAX_CACHE_KEY: usize = 128;

/// The most cache volumes one workload may mount.
pub const MAX_CACHE_MOUNTS: usize = 8;

/// Why `key` cannot name a cache volume; `None` when it can. A key is
/// letters, digits, `-`, `_` and `.`, starting with a letter or digit (so
/// it is a safe file name on a node), at most [`MAX_CACHE_KEY`] bytes.
pub fn cache_key_problem(key: &str) -> Option<String> {
    if key.is_empty() || key.len() > MAX_CACHE_KEY {
        return Some(format!("must be 1 to {MAX_CACHE_KEY} bytes"));
    }
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if !key.starts_with(|c: char| c.is_ascii_alphanumeric()) || !key.chars().all(allowed) {
        return Some(format!("`{key}` is not letters, digits, '-', '_' and '.' starting with a letter or digit"));
    }
    None
}

/// Why `path` cannot be where a cache volume is mounted inside a
/// workload's root; `None` when it can: absolute, normalized (no `.` or
/// `..` component, no empty one), not the root itself, nor under `/proc`,
/// `/sys` or `/dev`.
pub fn cache_path_problem(path: &str) -> Option<String> {
    if path.len() > crate::MAX_WORKING_DIR || path.contains('\0') {
        return Some(format!("must be at most {} bytes without NUL", crate::MAX_WORKING_DIR));
    }
    let Some(rest) = path.strip_prefix('/') else { return Some(format!("`{path}` is not an absolute path")) };
    let parts: Vec<&str> = rest.split('/').collect();
    if rest.is_empty() || parts.iter().any(|part| part.is_empty() || *part == "." || *part == "..") {
        return Some(format!("`{path}` is not a normalized path below /"));
    }
    if matches!(parts[0], "proc" | "sys" | "dev") {
        return Some(format!("`{path}` is under /{}, which the runtime owns", parts[0]));
    }
    None
}

/// Why `repository` cannot be where cache generations are kept; `None`
/// when it can: `host[:port]/path` with no tag or digest, each path
/// component lowercase letters and digits joined by `.`, `_`, `__` or `-`
/// (an OCI repository name, to which a project's name is appended).
pub fn cache_repository_problem(repository: &str) -> Option<String> {
    let usage = || Some("must be HOST[:PORT]/PATH, e.g. registry.internal:5000/berth-caches".to_owned());
    if repository.contains("://") || repository.contains('@') {
        return usage();
    }
    let Some((host, path)) = repository.trim_end_matches('/').split_once('/') else { return usage() };
    let host_ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '[' | ']');
    if host.is_empty() || !host.chars().all(host_ok) {
        return usage();
    }
    let component_ok = |part: &str| {
        let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
        part.starts_with(alnum)
            && part.ends_with(alnum)
            && part.chars().all(|c| alnum(c) || matches!(c, '.' | '_' | '-'))
            && !part.contains("..")
            && !part.contains("___")
    };
    if path.split('/').any(|part| !component_ok(part)) {
        return Some(format!(
            "`{path}` is not an OCI repository path: lowercase letters and digits joined by '.', '_' or '-'"
        ));
    }
    None
}

/// What is wrong with a workload's cache mounts, given as (key, path)
/// pairs: the first problem, naming the mount by its index. Keys and paths
/// are each unique.
pub fn cache_mounts_problem<'a>(mounts: impl IntoIterator<Item = (&'a str, &'a str)>) -> Option<String> {
    let mut keys = std::collections::HashSet::new();
    let mut paths = std::collections::HashSet::new();
    for (index, (key, path)) in mounts.into_iter().enumerate() {
        if index >= MAX_CACHE_MOUNTS {
            return Some(format!("at most {MAX_CACHE_MOUNTS} cache volumes per workload"));
        }
        if let Some(problem) = cache_key_problem(key) {
            return Some(format!("[{index}].key {problem}"));
        }
        if let Some(problem) = cache_path_problem(path) {
            return Some(format!("[{index}].path {problem}"));
        }
        if !keys.insert(key) {
            return Some(format!("[{index}].key `{key}` is mounted twice"));
        }
        if !paths.insert(path) {
            return Some(format!("[{index}].path `{path}` has two volumes"));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_safe_file_names() {
        for good in ["cargo-main", "model.v2", "a", "deps_2024"] {
            assert_eq!(cache_key_problem(good), None, "{good}");
        }
        for bad in ["", ".hidden", "-x", "a/b", "..", "a b", "ü", &"k".repeat(129)] {
            assert!(cache_key_problem(bad).is_some(), "{bad:?}");
        }
    }

    #[test]
    fn paths_are_absolute_normalized_and_outside_what_the_runtime_owns() {
        for good in ["/cache", "/cache/cargo", "/home/app/.cache"] {
            assert_eq!(cache_path_problem(good), None, "{good}");
        }
        for bad in ["", "/", "cache", "/a//b", "/a/../b", "/a/./b", "/a/", "/proc/x", "/sys", "/dev/shm", "/a\0"] {
            assert!(cache_path_problem(bad).is_some(), "{bad:?}");
        }
    }

    #[test]
    fn cache_repositories_are_a_host_and_an_oci_path() {
        for good in ["127.0.0.1:5000/caches", "registry.internal/berth/caches", "r:5000/a-b.c_d/"] {
            assert_eq!(cache_repository_problem(good), None, "{good}");
        }
        for bad in ["", "caches", "https://r/c", "r/Caches", "r/c@sha256:00", "r/-c", "r/c:tag", "/c"] {
            assert!(cache_repository_problem(bad).is_some(), "{bad:?}");
        }
    }

    #[test]
    fn mounts_name_the_first_bad_one_and_are_unique() {
        assert_eq!(cache_mounts_problem([("a", "/a"), ("b", "/b")]), None);
        assert!(cache_mounts_problem([("a", "/a"), ("a", "/b")]).unwrap().contains("[1].key `a` is mounted twice"));
        assert!(cache_mounts_problem([("a", "/a"), ("b", "/a")]).unwrap().contains("[1].path"));
        assert!(cache_mounts_problem([("a", "/a"), ("", "/b")]).unwrap().starts_with("[1].key"));
        let many: Vec<(String, String)> = (0..9).map(|i| (format!("k{i}"), format!("/c{i}"))).collect();
        assert!(
            cache_mounts_problem(many.iter().map(|(k, p)| (k.as_str(), p.as_str()))).unwrap().contains("at most 8")
        );
    }
}
