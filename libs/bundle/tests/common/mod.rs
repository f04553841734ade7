//! Bundle directories and snapshots shared by the integration tests.

#![allow(dead_code, unreachable_pub, reason = "each test binary uses a different part")]

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use berth_bundle::{
    BundleCache, BundleClient, BundleReference, CacheError, CacheOptions, Digest, RegistryConfig, RegistryCredentials,
    RegistryError,
};

/// Flips the bytes of `bundle`'s layer where `registry` stores it, keeping
/// its size: the registry then serves other content under the layer's digest.
pub fn tamper_layer(registry: &berth_bundle::testing::TestRegistry, bundle: &berth_bundle::PackedBundle) {
    let layer = &bundle.manifest().layers[0].digest;
    let stored = registry
        .storage_dir()
        .join("docker/registry/v2/blobs/sha256")
        .join(&layer.hex()[..2])
        .join(layer.hex())
        .join("data");
    let mut bytes = std::fs::read(&stored).unwrap();
    for byte in bytes.iter_mut().skip(20) {
        *byte ^= 0x5a;
    }
    std::fs::write(&stored, &bytes).unwrap();
}

/// A client with the default registry settings.
pub fn client() -> BundleClient {
    BundleClient::new(RegistryConfig::default()).unwrap()
}

/// No credentials.
pub fn anonymous() -> RegistryCredentials {
    RegistryCredentials::Anonymous
}

/// Pulls `reference` at `digest`, whose stored bytes were tampered with,
/// into a fresh cache: the pull is refused as a digest mismatch and the
/// cache keeps nothing of it. The cache and its directory, for more pulls.
pub async fn pull_refused_as_tampered(
    client: &BundleClient,
    reference: &BundleReference,
    digest: &Digest,
) -> (BundleCache, tempfile::TempDir) {
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = BundleCache::open(cache_dir.path(), CacheOptions::default()).await.unwrap();
    let pulled = cache.pull(client, &reference.pinned(digest), &anonymous()).await;
    assert!(matches!(pulled, Err(CacheError::Fetch(RegistryError::DigestMismatch { .. }))), "{pulled:?}");
    for kept in ["bundles/sha256", "blobs/sha256", "tmp"] {
        assert!(names(&cache_dir.path().join(kept)).is_empty(), "{kept} holds what was refused");
    }
    (cache, cache_dir)
}

/// A bundle directory with a `berth.toml`, an executable entrypoint, a nested data file
/// and an internal symlink; `marker` goes into the data file so bundles differ.
pub fn bundle_dir(marker: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_bundle(dir.path(), marker);
    dir
}

pub fn write_bundle(dir: &Path, marker: &str) {
    std::fs::write(
        dir.join("berth.toml"),
        r#"
entrypoint = "bin/app"
args = ["--serve", "--port=8080"]

[env]
GREETING = "hello"

[[ports]]
name = "http"
port = 8080
"#,
    )
    .unwrap();
    std::fs::create_dir_all(dir.join("bin")).unwrap();
    std::fs::write(dir.join("bin/app"), "#!/bin/sh\necho hello\n").unwrap();
    std::fs::set_permissions(dir.join("bin/app"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::create_dir_all(dir.join("share/data")).unwrap();
    std::fs::write(dir.join("share/data/marker.txt"), marker).unwrap();
    std::os::unix::fs::symlink("share/data/marker.txt", dir.join("current")).unwrap();
}

/// Every path under `dir` with what it is: file contents and executable bit, link
/// targets, directories.
pub fn snapshot(dir: &Path) -> BTreeMap<PathBuf, String> {
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, String>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    entries.sort();
    for path in entries {
        let rel = path.strip_prefix(root).unwrap().to_path_buf();
        let meta = std::fs::symlink_metadata(&path).unwrap();
        if meta.is_symlink() {
            out.insert(rel, format!("link -> {}", std::fs::read_link(&path).unwrap().display()));
        } else if meta.is_dir() {
            out.insert(rel, "dir".to_owned());
            walk(root, &path, out);
        } else {
            let exec = meta.permissions().mode() & 0o111 != 0;
            let content = String::from_utf8_lossy(&std::fs::read(&path).unwrap()).into_owned();
            out.insert(rel, format!("file exec={exec} {content}"));
        }
    }
}

/// Names directly in `dir`, sorted; empty when it does not exist.
pub fn names(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut names: Vec<String> = entries.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}
