//! Push, resolve, inspect and pull against a real OCI registry (Debian's
//! `docker-registry`) on a loopback port.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod common;

use std::os::unix::fs::PermissionsExt;

use berth_bundle::testing::TestRegistry;
use berth_bundle::{
    BundleCache, BundleClient, BundleReference, CacheError, CacheOptions, Digest, PackedBundle, RegistryConfig,
    RegistryCredentials, RegistryError,
};

use common::{anonymous, client};

async fn push(client: &BundleClient, dir: &std::path::Path, reference: &BundleReference) -> Digest {
    let bundle = PackedBundle::from_dir(dir).unwrap();
    let digest = client.push(&bundle, reference, &anonymous()).await.unwrap();
    assert_eq!(&digest, bundle.digest());
    digest
}

#[tokio::test]
async fn push_resolve_pull_and_pull_again_with_the_registry_stopped() {
    let mut registry = TestRegistry::start().await.unwrap();
    let client = client();
    let source = common::bundle_dir("first");
    let reference = BundleReference::parse(&registry.reference("team/app:v1")).unwrap();

    let digest = push(&client, source.path(), &reference).await;

    // The tag resolves to what the registry itself says the tag's manifest is.
    let resolved = client.resolve(&reference, &anonymous()).await.unwrap();
    assert_eq!(resolved, digest);
    let header = registry.manifest_digest("team/app", "v1").await.unwrap();
    assert_eq!(header.as_deref(), Some(digest.to_string().as_str()));

    // Inspect shows the artifact as pushed.
    let info = client.inspect(&reference, &anonymous()).await.unwrap();
    assert_eq!(info.digest, digest);
    assert_eq!(info.manifest.artifact_type.as_deref(), Some(berth_bundle::BUNDLE_ARTIFACT_TYPE));
    assert_eq!(info.manifest.config.media_type, berth_bundle::BUNDLE_CONFIG_MEDIA_TYPE);
    assert_eq!(info.config.entrypoint, "bin/app");
    let module_paths: Vec<&str> = info.config.modules.iter().map(|m| m.path.as_str()).collect();
    assert_eq!(module_paths, ["berth.toml", "bin/app", "share/data/marker.txt"]);

    // The cache pulls by digest only.
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = BundleCache::open(cache_dir.path(), CacheOptions::default()).await.unwrap();
    let by_tag = cache.pull(&client, &reference, &anonymous()).await;
    assert!(matches!(by_tag, Err(CacheError::NotPinned { .. })), "{by_tag:?}");

    let pinned = reference.pinned(&digest);
    let ready = cache.pull(&client, &pinned, &anonymous()).await.unwrap();
    let definition = ready.definition();
    assert_eq!(definition.digest, digest);
    assert_eq!(definition.root, cache.bundle_dir(&digest));
    assert_eq!(definition.entrypoint, definition.root.join("bin/app"));
    assert_eq!(definition.args, ["--serve", "--port=8080"]);
    assert_eq!(definition.env["GREETING"], "hello");
    assert_eq!(definition.ports[0].name, "http");
    assert_eq!(definition.ports[0].port, 8080);
    assert_eq!(common::snapshot(&definition.root), common::snapshot(source.path()));
    let mode = std::fs::metadata(&definition.entrypoint).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o755);
    let blob = cache_dir.path().join("blobs/sha256").join(digest.hex());
    assert!(blob.is_file(), "the manifest is stored content-addressed");
    drop(ready);

    // With the registry gone, the bundle still comes from the cache; resolving fails as
    // unavailable.
    registry.stop();
    let again = cache.pull(&client, &pinned, &anonymous()).await.unwrap();
    assert_eq!(again.definition().root, cache.bundle_dir(&digest));
    let unavailable = client.resolve(&reference, &anonymous()).await;
    assert!(matches!(unavailable, Err(RegistryError::RegistryUnavailable { .. })), "{unavailable:?}");

    // A new cache over the same directory (an agent restart) finds it too.
    drop(again);
    let reopened = BundleCache::open(cache_dir.path(), CacheOptions::default()).await.unwrap();
    let after_restart = reopened.pull(&client, &pinned, &anonymous()).await.unwrap();
    assert_eq!(common::snapshot(&after_restart.definition().root), common::snapshot(source.path()));
}

#[tokio::test]
async fn moving_a_tag_resolves_to_the_new_digest() {
    let registry = TestRegistry::start().await.unwrap();
    let client = client();
    let reference = BundleReference::parse(&registry.reference("team/app:stable")).unwrap();
    let source = common::bundle_dir("one");
    let first = push(&client, source.path(), &reference).await;
    assert_eq!(client.resolve(&reference, &anonymous()).await.unwrap(), first);

    // Pushing the same directory again is the same bundle.
    assert_eq!(push(&client, source.path(), &reference).await, first);

    std::fs::write(source.path().join("share/data/marker.txt"), "two").unwrap();
    let second = push(&client, source.path(), &reference).await;
    assert_ne!(first, second);
    assert_eq!(client.resolve(&reference, &anonymous()).await.unwrap(), second);
    let header = registry.manifest_digest("team/app", "stable").await.unwrap();
    assert_eq!(header.as_deref(), Some(second.to_string().as_str()));

    // The old digest is still pullable by digest: revisions pinned to it keep running.
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = BundleCache::open(cache_dir.path(), CacheOptions::default()).await.unwrap();
    let old = cache.pull(&client, &reference.pinned(&first), &anonymous()).await.unwrap();
    assert_eq!(std::fs::read_to_string(old.definition().root.join("share/data/marker.txt")).unwrap(), "one");
}

#[tokio::test]
async fn unknown_tags_are_tag_not_found_and_bad_references_invalid() {
    let registry = TestRegistry::start().await.unwrap();
    let client = client();
    let source = common::bundle_dir("x");
    push(&client, source.path(), &BundleReference::parse(&registry.reference("team/app:v1")).unwrap()).await;

    for missing in ["team/app:v9", "team/nothing:v1"] {
        let reference = BundleReference::parse(&registry.reference(missing)).unwrap();
        let result = client.resolve(&reference, &anonymous()).await;
        assert!(matches!(result, Err(RegistryError::TagNotFound { .. })), "{missing}: {result:?}");
        let by_text = client.resolve_str(&registry.reference(missing), &anonymous()).await;
        assert!(matches!(by_text, Err(RegistryError::TagNotFound { .. })), "{missing}: {by_text:?}");
    }
    let found = client.resolve_str(&registry.reference("team/app:v1"), &anonymous()).await;
    assert!(found.is_ok(), "{found:?}");
    for bad in ["", "Team/App:v1", &registry.reference("team/app@sha256:abc")] {
        let result = client.resolve_str(bad, &anonymous()).await;
        assert!(matches!(result, Err(RegistryError::InvalidReference { .. })), "{bad}: {result:?}");
    }
}

#[tokio::test]
async fn a_stopped_registry_is_unavailable() {
    let mut registry = TestRegistry::start().await.unwrap();
    let reference = BundleReference::parse(&registry.reference("team/app:v1")).unwrap();
    registry.stop();
    let client = client();
    let resolved = client.resolve(&reference, &anonymous()).await;
    let Err(error) = resolved else { panic!("resolve succeeded against a stopped registry") };
    assert!(error.is_unavailable(), "{error:?}");
    let bundle = PackedBundle::from_dir(common::bundle_dir("x").path()).unwrap();
    let pushed = client.push(&bundle, &reference, &anonymous()).await;
    assert!(matches!(pushed, Err(RegistryError::RegistryUnavailable { .. })), "{pushed:?}");

    // Back on the same port, it answers again.
    registry.restart().await.unwrap();
    let digest = client.push(&bundle, &reference, &anonymous()).await.unwrap();
    assert_eq!(client.resolve(&reference, &anonymous()).await.unwrap(), digest);
}

#[tokio::test]
async fn wrong_or_missing_credentials_are_unauthorized() {
    let registry = TestRegistry::start_with_htpasswd("ci", "s3cret").await.unwrap();
    let client = client();
    let reference = BundleReference::parse(&registry.reference("team/app:v1")).unwrap();
    let bundle = PackedBundle::from_dir(common::bundle_dir("x").path()).unwrap();
    let wrong = RegistryCredentials::Basic { username: "ci".into(), password: "guess".into() };
    let right = RegistryCredentials::Basic { username: "ci".into(), password: "s3cret".into() };

    let pushed = client.push(&bundle, &reference, &wrong).await;
    assert!(matches!(pushed, Err(RegistryError::Unauthorized { .. })), "{pushed:?}");

    let digest = client.push(&bundle, &reference, &right).await.unwrap();
    assert_eq!(client.resolve(&reference, &right).await.unwrap(), digest);

    for credentials in [wrong, RegistryCredentials::Anonymous] {
        let resolved = client.resolve(&reference, &credentials).await;
        assert!(matches!(resolved, Err(RegistryError::Unauthorized { .. })), "{credentials:?}: {resolved:?}");
        let cache_dir = tempfile::tempdir().unwrap();
        let cache = BundleCache::open(cache_dir.path(), CacheOptions::default()).await.unwrap();
        let pulled = cache.pull(&client, &reference.pinned(&digest), &credentials).await;
        assert!(matches!(pulled, Err(CacheError::Fetch(RegistryError::Unauthorized { .. }))), "{pulled:?}");
    }
}

#[tokio::test]
async fn a_blob_served_with_other_content_is_refused_and_leaves_nothing() {
    let registry = TestRegistry::start().await.unwrap();
    let client = client();
    let reference = BundleReference::parse(&registry.reference("team/app:v1")).unwrap();
    let bundle = PackedBundle::from_dir(common::bundle_dir("x").path()).unwrap();
    let digest = client.push(&bundle, &reference, &anonymous()).await.unwrap();

    // Flip the layer's bytes where the registry stores them, keeping the size.
    common::tamper_layer(&registry, &bundle);

    let (cache, _cache_dir) = common::pull_refused_as_tampered(&client, &reference, &digest).await;
    assert_eq!(cache.usage().bundles, 0);
}

#[tokio::test]
async fn a_private_ca_makes_an_https_registry_trusted() {
    let registry = TestRegistry::start_with_tls().await.unwrap();
    let reference = BundleReference::parse(&registry.reference("team/app:v1")).unwrap();
    let bundle = PackedBundle::from_dir(common::bundle_dir("tls").path()).unwrap();

    let untrusting =
        BundleClient::new(RegistryConfig { plain_http_loopback: false, ..RegistryConfig::default() }).unwrap();
    let refused = untrusting.push(&bundle, &reference, &anonymous()).await;
    let Err(error) = refused else { panic!("a registry signed by an unknown CA was trusted") };
    assert!(error.to_string().contains("certificate"), "{error}");

    let trusting = BundleClient::new(RegistryConfig {
        plain_http_loopback: false,
        ca_pem: Some(registry.ca_pem().unwrap().to_owned()),
        ..RegistryConfig::default()
    })
    .unwrap();
    let digest = trusting.push(&bundle, &reference, &anonymous()).await.unwrap();
    assert_eq!(trusting.resolve(&reference, &anonymous()).await.unwrap(), digest);
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = BundleCache::open(cache_dir.path(), CacheOptions::default()).await.unwrap();
    let ready = cache.pull(&trusting, &reference.pinned(&digest), &anonymous()).await.unwrap();
    assert_eq!(std::fs::read_to_string(ready.definition().root.join("share/data/marker.txt")).unwrap(), "tls");
}
