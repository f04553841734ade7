//! Registry mirrors against real OCI registries (Debian's `docker-registry`)
//! on loopback ports: a mirror is asked first, whatever it serves is
//! verified, a mirror that refuses connections or serves other content is
//! passed over for the origin (and left out of the client's next
//! operations for a while), and the origin's credentials reach a mirror
//! only when it is configured to get them.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod common;

use berth_bundle::testing::TestRegistry;
use berth_bundle::{
    BundleCache, BundleClient, BundleReference, CacheError, CacheOptions, Digest, PackedBundle, RegistryConfig,
    RegistryCredentials, RegistryError, RegistryMirror,
};

use common::anonymous;

/// A client that asks `mirrors` (as `--registry-mirror` writes them) first.
fn mirrored(mirrors: &[String]) -> BundleClient {
    let mirrors = mirrors.iter().map(|m| m.parse::<RegistryMirror>().unwrap()).collect();
    BundleClient::new(RegistryConfig { mirrors, ..RegistryConfig::default() }).unwrap()
}

/// Pushes the same bundle to `team/app:v1` in every registry; its digest.
async fn push_to(registries: &[&TestRegistry], bundle: &PackedBundle, credentials: &RegistryCredentials) -> Digest {
    let plain = common::client();
    for registry in registries {
        let reference = BundleReference::parse(&registry.reference("team/app:v1")).unwrap();
        plain.push(bundle, &reference, credentials).await.unwrap();
    }
    bundle.digest().clone()
}

/// Pulls `reference` at `digest` into a fresh cache through `client`; what
/// was installed, file by file.
async fn pull(
    client: &BundleClient,
    reference: &BundleReference,
    digest: &Digest,
    credentials: &RegistryCredentials,
) -> Result<Snapshot, CacheError> {
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = BundleCache::open(cache_dir.path(), CacheOptions::default()).await.unwrap();
    let ready = cache.pull(client, &reference.pinned(digest), credentials).await?;
    Ok(common::snapshot(&ready.definition().root))
}

type Snapshot = std::collections::BTreeMap<std::path::PathBuf, String>;

#[tokio::test]
async fn a_mirror_is_asked_first_and_serves_tags_and_content_while_the_origin_is_down() {
    let mut origin = TestRegistry::start().await.unwrap();
    let mirror = TestRegistry::start().await.unwrap();
    let source = common::bundle_dir("mirrored");
    let bundle = PackedBundle::from_dir(source.path()).unwrap();
    let digest = push_to(&[&origin, &mirror], &bundle, &anonymous()).await;
    let reference = BundleReference::parse(&origin.reference("team/app:v1")).unwrap();
    let client = mirrored(&[format!("{}={}", origin.host(), mirror.host())]);

    // First: where the two disagree on a tag, the mirror's answer is taken.
    let newer = PackedBundle::from_dir(common::bundle_dir("only at the origin").path()).unwrap();
    common::client().push(&newer, &reference, &anonymous()).await.unwrap();
    assert_eq!(common::client().resolve(&reference, &anonymous()).await.unwrap(), *newer.digest());
    assert_eq!(client.resolve(&reference, &anonymous()).await.unwrap(), digest, "the mirror was asked first");
    origin.stop();

    let direct = common::client().resolve(&reference, &anonymous()).await;
    assert!(matches!(direct, Err(RegistryError::RegistryUnavailable { .. })), "{direct:?}");
    assert_eq!(client.resolve(&reference, &anonymous()).await.unwrap(), digest, "the mirror resolved the tag");
    let pulled = pull(&client, &reference, &digest, &anonymous()).await.unwrap();
    assert_eq!(pulled, common::snapshot(source.path()));

    // A mirror of another registry is never asked.
    let elsewhere = mirrored(&[format!("registry.example={}", mirror.host())]);
    let refused = elsewhere.resolve(&reference, &anonymous()).await;
    assert!(matches!(refused, Err(RegistryError::RegistryUnavailable { .. })), "{refused:?}");
}

#[tokio::test]
async fn a_mirror_that_refuses_connections_or_serves_other_content_is_passed_over_for_the_origin() {
    let origin = TestRegistry::start().await.unwrap();
    let tampered = TestRegistry::start().await.unwrap();
    let source = common::bundle_dir("origin");
    let bundle = PackedBundle::from_dir(source.path()).unwrap();
    let digest = push_to(&[&origin, &tampered], &bundle, &anonymous()).await;
    let reference = BundleReference::parse(&origin.reference("team/app:v1")).unwrap();

    // The mirror's copy of the layer, flipped where it stores it, size kept.
    common::tamper_layer(&tampered, &bundle);
    let alone = mirrored(&[]);
    let tampered_reference = BundleReference::parse(&tampered.reference("team/app:v1")).unwrap();
    common::pull_refused_as_tampered(&alone, &tampered_reference, &digest).await;

    // Nothing listens where the first mirror is; the second serves other
    // bytes under the layer's digest. Both are passed over, and what is
    // installed is the origin's, whole.
    let refusing = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let client = mirrored(&[format!("{}={refusing}", origin.host()), format!("{}={}", origin.host(), tampered.host())]);
    assert_eq!(client.resolve(&reference, &anonymous()).await.unwrap(), digest);
    let pulled = pull(&client, &reference, &digest, &anonymous()).await.unwrap();
    assert_eq!(pulled, common::snapshot(source.path()));
}

#[tokio::test]
async fn a_mirror_gets_the_origins_credentials_only_when_configured_to() {
    let mut origin = TestRegistry::start_with_htpasswd("ci", "s3cret").await.unwrap();
    let mirror = TestRegistry::start_with_htpasswd("ci", "s3cret").await.unwrap();
    let credentials = RegistryCredentials::Basic { username: "ci".into(), password: "s3cret".into() };
    let bundle = PackedBundle::from_dir(common::bundle_dir("private").path()).unwrap();
    let digest = push_to(&[&origin, &mirror], &bundle, &credentials).await;
    let reference = BundleReference::parse(&origin.reference("team/app:v1")).unwrap();

    // Anonymous to the mirror: it refuses, and the origin serves.
    let anonymous_mirror = mirrored(&[format!("{}={}", origin.host(), mirror.host())]);
    assert_eq!(anonymous_mirror.resolve(&reference, &credentials).await.unwrap(), digest);
    pull(&anonymous_mirror, &reference, &digest, &credentials).await.unwrap();

    // With the origin down, only a mirror given the credentials serves (each
    // client new: one that saw a mirror fail leaves it out for a while).
    origin.stop();
    let anonymous_mirror = mirrored(&[format!("{}={}", origin.host(), mirror.host())]);
    let failed = pull(&anonymous_mirror, &reference, &digest, &credentials).await;
    assert!(matches!(failed, Err(CacheError::Fetch(RegistryError::RegistryUnavailable { .. }))), "{failed:?}");
    let trusted = mirrored(&[format!("{}={},credentials", origin.host(), mirror.host())]);
    assert_eq!(trusted.resolve(&reference, &credentials).await.unwrap(), digest);
    pull(&trusted, &reference, &digest, &credentials).await.unwrap();
}

#[test]
fn a_mirror_is_written_origin_equals_mirror() {
    let plain: RegistryMirror = "docker.io=mirror.internal:5000".parse().unwrap();
    assert_eq!(
        (plain.origin.as_str(), plain.mirror.as_str(), plain.send_credentials),
        ("docker.io", "mirror.internal:5000", false)
    );
    let trusted: RegistryMirror = "ghcr.io=10.0.0.5:5000,credentials".parse().unwrap();
    assert!(trusted.send_credentials);
    assert_eq!(trusted.to_string(), "ghcr.io=10.0.0.5:5000,credentials");
    for bad in ["docker.io", "=m", "o=", "o=m,secrets", "o=o", "o=http://m", "o=m/x"] {
        let error = bad.parse::<RegistryMirror>().unwrap_err();
        assert!(error.contains("ORIGIN=MIRROR"), "{bad}: {error}");
    }
}

#[tokio::test]
async fn a_mirror_that_failed_is_left_out_of_the_next_operations_for_a_while() {
    let origin = TestRegistry::start().await.unwrap();
    let mut mirror = TestRegistry::start().await.unwrap();
    let at_origin = PackedBundle::from_dir(common::bundle_dir("origin").path()).unwrap();
    let at_mirror = PackedBundle::from_dir(common::bundle_dir("mirror").path()).unwrap();
    let reference = BundleReference::parse(&origin.reference("team/app:v1")).unwrap();
    common::client().push(&at_origin, &reference, &anonymous()).await.unwrap();
    let on_mirror = BundleReference::parse(&mirror.reference("team/app:v1")).unwrap();
    common::client().push(&at_mirror, &on_mirror, &anonymous()).await.unwrap();
    let client = mirrored(&[format!("{}={}", origin.host(), mirror.host())]);
    assert_eq!(client.resolve(&reference, &anonymous()).await.unwrap(), *at_mirror.digest());

    // Down once: the origin answers, and goes on answering for this client
    // after the mirror is back; a client that saw nothing fail asks it.
    mirror.stop();
    assert_eq!(client.resolve(&reference, &anonymous()).await.unwrap(), *at_origin.digest());
    mirror.restart().await.unwrap();
    assert_eq!(client.resolve(&reference, &anonymous()).await.unwrap(), *at_origin.digest(), "left out");
    let fresh = mirrored(&[format!("{}={}", origin.host(), mirror.host())]);
    assert_eq!(fresh.resolve(&reference, &anonymous()).await.unwrap(), *at_mirror.digest());
}
