//! Push, resolve and pull through an OCI image-layout directory with no registry, and the
//! cache's verification and eviction.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod common;

use std::path::Path;

use berth_bundle::{
    BundleCache, BundleClient, BundleReference, CacheError, CacheOptions, Digest, PackedBundle, REF_NAME_ANNOTATION,
    RegistryError, UnsafeEntry,
};

use common::{anonymous, client};

fn layout_ref(dir: &Path, tag: &str) -> BundleReference {
    BundleReference::parse(&format!("oci:{}:{tag}", dir.display())).unwrap()
}

async fn push_dir(client: &BundleClient, source: &Path, reference: &BundleReference) -> Digest {
    let bundle = PackedBundle::from_dir(source).unwrap();
    client.push(&bundle, reference, &anonymous()).await.unwrap()
}

#[tokio::test]
async fn push_resolve_and_pull_through_a_layout_directory() {
    let client = client();
    let layout = tempfile::tempdir().unwrap();
    let source = common::bundle_dir("from a layout");
    let reference = layout_ref(&layout.path().join("bundles"), "v1");

    let digest = push_dir(&client, source.path(), &reference).await;

    // The directory is a standard OCI layout, tagged the way skopeo and oras read it.
    let root = layout.path().join("bundles");
    let marker: serde_json::Value = serde_json::from_slice(&std::fs::read(root.join("oci-layout")).unwrap()).unwrap();
    assert_eq!(marker["imageLayoutVersion"], "1.0.0");
    let index: serde_json::Value = serde_json::from_slice(&std::fs::read(root.join("index.json")).unwrap()).unwrap();
    assert_eq!(index["manifests"][0]["digest"], digest.to_string());
    assert_eq!(index["manifests"][0]["annotations"][REF_NAME_ANNOTATION], "v1");
    assert!(root.join("blobs/sha256").join(digest.hex()).is_file());

    assert_eq!(client.resolve(&reference, &anonymous()).await.unwrap(), digest);
    let info = client.inspect(&reference, &anonymous()).await.unwrap();
    assert_eq!(info.config.entrypoint, "bin/app");

    let cache_dir = tempfile::tempdir().unwrap();
    let cache = BundleCache::open(cache_dir.path(), CacheOptions::default()).await.unwrap();
    let ready = cache.pull(&client, &reference.pinned(&digest), &anonymous()).await.unwrap();
    assert_eq!(common::snapshot(&ready.definition().root), common::snapshot(source.path()));

    // Moving the tag: a changed bundle pushed to v1 resolves to its new digest; another
    // tag beside it is untouched.
    let other = layout_ref(&root, "v0");
    assert_eq!(push_dir(&client, source.path(), &other).await, digest);
    std::fs::write(source.path().join("share/data/marker.txt"), "changed").unwrap();
    let moved = push_dir(&client, source.path(), &reference).await;
    assert_ne!(moved, digest);
    assert_eq!(client.resolve(&reference, &anonymous()).await.unwrap(), moved);
    assert_eq!(client.resolve(&other, &anonymous()).await.unwrap(), digest);

    let missing = client.resolve(&layout_ref(&root, "v7"), &anonymous()).await;
    assert!(matches!(missing, Err(RegistryError::TagNotFound { .. })), "{missing:?}");
    let nowhere = client.resolve(&layout_ref(&layout.path().join("absent"), "v1"), &anonymous()).await;
    assert!(matches!(nowhere, Err(RegistryError::RegistryUnavailable { .. })), "{nowhere:?}");
}

#[tokio::test]
async fn a_tampered_layout_blob_is_refused_and_leaves_nothing() {
    let client = client();
    let layout = tempfile::tempdir().unwrap();
    let reference = layout_ref(layout.path(), "v1");
    let bundle = PackedBundle::from_dir(common::bundle_dir("x").path()).unwrap();
    let digest = client.push(&bundle, &reference, &anonymous()).await.unwrap();

    let layer = layout.path().join("blobs/sha256").join(bundle.manifest().layers[0].digest.hex());
    let mut bytes = std::fs::read(&layer).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&layer, &bytes).unwrap();

    let (cache, cache_dir) = common::pull_refused_as_tampered(&client, &reference, &digest).await;

    // A manifest that does not hash to the digest asked for is refused the same way.
    let manifest = layout.path().join("blobs/sha256").join(digest.hex());
    let mut text = std::fs::read(&manifest).unwrap();
    text.push(b' ');
    std::fs::write(&manifest, &text).unwrap();
    let pulled = cache.pull(&client, &reference.pinned(&digest), &anonymous()).await;
    assert!(matches!(pulled, Err(CacheError::Fetch(RegistryError::DigestMismatch { .. }))), "{pulled:?}");
    assert!(common::names(&cache_dir.path().join("bundles/sha256")).is_empty());
}

/// Writes a hand-made bundle whose layer is `tar` into an OCI layout at `dir`, tagged `v1`.
fn write_raw_bundle(dir: &Path, tar: &[u8]) -> Digest {
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    let put = |bytes: &[u8]| {
        let digest = Digest::of(bytes);
        std::fs::write(blobs.join(digest.hex()), bytes).unwrap();
        (digest, bytes.len())
    };
    let config = br#"{"entrypoint":"/bin/true"}"#;
    let (config_digest, config_size) = put(config);
    let (layer_digest, layer_size) = put(tar);
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "artifactType": berth_bundle::BUNDLE_ARTIFACT_TYPE,
        "config": {
            "mediaType": berth_bundle::BUNDLE_CONFIG_MEDIA_TYPE,
            "digest": config_digest.to_string(),
            "size": config_size,
        },
        "layers": [{
            "mediaType": berth_bundle::LAYER_TAR_MEDIA_TYPE,
            "digest": layer_digest.to_string(),
            "size": layer_size,
        }],
    });
    let (digest, size) = put(&serde_json::to_vec(&manifest).unwrap());
    std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": digest.to_string(),
            "size": size,
            "annotations": {REF_NAME_ANNOTATION: "v1"},
        }],
    });
    std::fs::write(dir.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
    digest
}

/// A tar with one symlink `escape -> ../../outside` after a harmless file.
fn escaping_tar() -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(tar::EntryType::Regular);
    header.set_size(2);
    header.set_mode(0o644);
    builder.append_data(&mut header, "ok.txt", &b"ok"[..]).unwrap();
    let mut link = tar::Header::new_gnu();
    link.set_entry_type(tar::EntryType::Symlink);
    link.set_size(0);
    builder.append_link(&mut link, "escape", "../../outside").unwrap();
    builder.into_inner().unwrap()
}

#[tokio::test]
async fn an_unsafe_layer_is_refused_naming_the_entry_and_leaves_nothing() {
    let client = client();
    let layout = tempfile::tempdir().unwrap();
    let digest = write_raw_bundle(layout.path(), &escaping_tar());
    let reference = layout_ref(layout.path(), "v1");
    assert_eq!(client.resolve(&reference, &anonymous()).await.unwrap(), digest);

    let parent = tempfile::tempdir().unwrap();
    let cache_dir = parent.path().join("cache");
    let cache = BundleCache::open(&cache_dir, CacheOptions::default()).await.unwrap();
    let before = common::names(parent.path());
    let pulled = cache.pull(&client, &reference.pinned(&digest), &anonymous()).await;
    let Err(CacheError::Unsafe { source: berth_bundle::ExtractError::Refused { entry, reason }, .. }) = pulled else {
        panic!("expected the layer to be refused, got {pulled:?}");
    };
    assert_eq!(entry, "escape");
    assert_eq!(reason, UnsafeEntry::SymlinkEscapes("../../outside".into()));
    assert_eq!(common::names(parent.path()), before);
    assert!(common::names(&cache_dir.join("bundles/sha256")).is_empty());
    assert!(common::names(&cache_dir.join("blobs/sha256")).is_empty());
    assert!(common::names(&cache_dir.join("tmp")).is_empty());
}

#[tokio::test]
async fn eviction_keeps_pinned_bundles_and_drops_the_least_recently_used() {
    let client = client();
    let layout = tempfile::tempdir().unwrap();
    let mut digests = Vec::new();
    for name in ["a", "b", "c"] {
        let source = common::bundle_dir(&name.repeat(4096));
        digests.push(push_dir(&client, source.path(), &layout_ref(layout.path(), name)).await);
    }
    let [a, b, c] = [0, 1, 2].map(|i| layout_ref(layout.path(), "x").pinned(&digests[i]));

    // Measure one bundle, then budget for two of them.
    let probe_dir = tempfile::tempdir().unwrap();
    let probe = BundleCache::open(probe_dir.path(), CacheOptions::default()).await.unwrap();
    drop(probe.pull(&client, &a, &anonymous()).await.unwrap());
    let one = probe.usage().bytes;
    assert!(one > 4096, "{one}");

    let cache_dir = tempfile::tempdir().unwrap();
    let options = CacheOptions { budget_bytes: one * 2 + one / 2, ..CacheOptions::default() };
    let cache = BundleCache::open(cache_dir.path(), options).await.unwrap();
    let present = |digest: &Digest| cache.bundle_dir(digest).is_dir();

    // A is the least recently used but pinned; B goes when C arrives.
    let held_a = cache.pull(&client, &a, &anonymous()).await.unwrap();
    drop(cache.pull(&client, &b, &anonymous()).await.unwrap());
    drop(cache.pull(&client, &c, &anonymous()).await.unwrap());
    assert!(present(&digests[0]), "pinned A was evicted");
    assert!(!present(&digests[1]), "B, the least recently used unpinned bundle, was kept");
    assert!(present(&digests[2]));
    assert!(!cache_dir.path().join("blobs/sha256").join(digests[1].hex()).exists(), "B's manifest blob was kept");
    assert_eq!(cache.usage().bundles, 2);

    // Unpinned and now least recently used (C was used since), A goes when B returns.
    drop(held_a);
    drop(cache.get(&digests[2]).await.unwrap().unwrap());
    let held_b = cache.pull(&client, &b, &anonymous()).await.unwrap();
    assert!(!present(&digests[0]), "A, the least recently used, was kept");
    assert!(present(&digests[1]));
    assert!(present(&digests[2]));

    // Everything pinned (after a restart with a tighter budget): over budget, but nothing
    // in use is removed.
    drop(held_b);
    drop(cache);
    let tight = BundleCache::open(cache_dir.path(), CacheOptions { budget_bytes: 1, ..options }).await.unwrap();
    assert_eq!(tight.usage().bundles, 2);
    let kept_b = tight.get(&digests[1]).await.unwrap().unwrap();
    let kept_c = tight.get(&digests[2]).await.unwrap().unwrap();
    let report = tight.evict().await.unwrap();
    assert!(report.evicted.is_empty());
    assert!(report.over_budget);
    drop(kept_c);
    let report = tight.evict().await.unwrap();
    assert_eq!(report.evicted, [digests[2].clone()]);
    assert!(report.over_budget);
    assert!(tight.bundle_dir(&digests[1]).is_dir());
    assert!(!tight.bundle_dir(&digests[2]).exists());
    drop(kept_b);
}
