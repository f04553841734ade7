//! Standard OCI container images through the node's cache, from a real
//! registry (Debian's `docker-registry`): pulled by digest, every blob
//! verified, layers unpacked in order with whiteouts applied into one root,
//! the config read, kept across a reopen; and hostile images refused naming
//! the entry, with nothing written outside the cache.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod common;

use std::path::Path;

use berth_bundle::test_image::{Layer, TestImage, busybox_present};
use berth_bundle::testing::TestRegistry;
use berth_bundle::{BundleCache, BundleReference, CacheError, CacheOptions, ExtractError, RegistryCredentials};

use common::client;

async fn cache(dir: &Path) -> BundleCache {
    BundleCache::open(dir, CacheOptions::default()).await.unwrap()
}

fn pinned(registry: &TestRegistry, repository: &str, digest: &berth_bundle::Digest) -> BundleReference {
    BundleReference::parse(&format!("{}@{digest}", registry.reference(repository))).unwrap()
}

#[tokio::test]
async fn an_image_is_pulled_by_digest_unpacked_in_order_and_kept_across_a_reopen() {
    assert!(busybox_present(), "the tests build images from busybox-static (make test installs it)");
    let mut registry = TestRegistry::start().await.unwrap();
    let image = TestImage::new(&["/bin/httpd", "-f"], &["-p", "8080"], &["PATH=/bin", "MODE=image"], "/www")
        .layer(
            Layer::busybox(&["sh", "httpd"])
                .unwrap()
                .dir("www", 0o755)
                .file("www/index.html", b"first layer\n", 0o644)
                .file("www/secret.txt", b"removed by the second layer\n", 0o600),
        )
        .unwrap()
        .layer(Layer::new().file("www/index.html", b"second layer\n", 0o644).whiteout("www/secret.txt"))
        .unwrap();
    let digest =
        image.push(&client(), &registry.reference("team/web:v1"), &RegistryCredentials::Anonymous).await.unwrap();
    assert_eq!(digest, image.digest());

    // The tag resolves to the image's manifest, as for a bundle.
    let tag = BundleReference::parse(&registry.reference("team/web:v1")).unwrap();
    assert_eq!(client().resolve(&tag, &RegistryCredentials::Anonymous).await.unwrap(), digest);

    let dir = tempfile::tempdir().unwrap();
    let cache = cache(dir.path()).await;
    let ready = cache.pull(&client(), &pinned(&registry, "team/web", &digest), &RegistryCredentials::Anonymous).await;
    let ready = ready.unwrap();
    let definition = ready.definition();
    let run = definition.image.as_ref().expect("an image, not a bundle");
    assert_eq!(run.entrypoint, ["/bin/httpd", "-f"]);
    assert_eq!(run.cmd, ["-p", "8080"]);
    assert_eq!(run.env["MODE"], "image");
    assert_eq!(run.working_dir, "/www");
    let root = &definition.root;
    assert_eq!(std::fs::read_to_string(root.join("www/index.html")).unwrap(), "second layer\n");
    assert!(!root.join("www/secret.txt").exists(), "the whiteout removed it");
    assert!(!root.join("www/.wh.secret.txt").exists(), "whiteout markers are not files of the root");
    assert_eq!(std::fs::read_link(root.join("bin/httpd")).unwrap(), Path::new("busybox"));
    assert!(root.join("bin/busybox").is_file());
    drop(ready);

    // Reopened with the registry gone, the image is still there and runs the same.
    registry.stop();
    drop(cache);
    let reopened = BundleCache::open(dir.path(), CacheOptions::default()).await.unwrap();
    let again = reopened.get(&digest).await.unwrap().expect("kept across a reopen");
    assert_eq!(again.definition().image.as_ref().unwrap().cmd, ["-p", "8080"]);
    assert_eq!(reopened.usage().bundles, 1);
}

#[tokio::test]
async fn an_images_user_is_found_in_its_root_with_what_its_layers_gave_it_and_kept_across_a_reopen() {
    assert!(busybox_present(), "the tests build images from busybox-static (make test installs it)");
    let mut registry = TestRegistry::start().await.unwrap();
    let passwd = b"root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:App:/home/app:/bin/sh\n";
    let image = TestImage::as_user(&["/bin/sh"], &[], &["PATH=/bin"], "/home/app", "app")
        .layer(
            Layer::busybox(&["sh"])
                .unwrap()
                .dir("etc", 0o755)
                .file("etc/passwd", passwd, 0o644)
                .file("etc/group", b"root:x:0:\napp:x:1000:\n", 0o644)
                .dir("home", 0o755)
                .owned_by(1000, 1000)
                .dir("home/app", 0o755)
                .file("home/app/.profile", b"", 0o644)
                .file("home/app/old", b"removed by the second layer\n", 0o644)
                .dir("srv", 0o755),
        )
        .unwrap()
        .layer(Layer::new().whiteout("home/app/old").owned_by(0, 0).dir("srv", 0o755).owned_by(1000, 0).file(
            "home/app/notes",
            b"",
            0o600,
        ))
        .unwrap();
    let reference = registry.reference("team/app:v1");
    let digest = image.push(&client(), &reference, &RegistryCredentials::Anonymous).await.unwrap();

    let dir = tempfile::tempdir().unwrap();
    let cache = cache(dir.path()).await;
    let ready = cache.pull(&client(), &pinned(&registry, "team/app", &digest), &RegistryCredentials::Anonymous).await;
    let ready = ready.unwrap();
    let account = ready.definition().image.as_ref().unwrap().account.clone().expect("app is not root");
    assert_eq!((account.name.as_deref(), account.uid, account.gid), (Some("app"), 1000, 1000));
    assert_eq!(account.home.as_deref(), Some("/home/app"));
    let owned: Vec<(String, bool, bool)> =
        account.owned.iter().map(|o| (o.path.display().to_string(), o.owner, o.group)).collect();
    assert_eq!(
        owned,
        [
            ("home/app".to_owned(), true, true),
            ("home/app/.profile".to_owned(), true, true),
            ("home/app/notes".to_owned(), true, false),
        ],
        "later layers replace owners and a whiteout forgets"
    );
    use std::os::unix::fs::MetadataExt as _;
    let meta = std::fs::metadata(ready.definition().root.join("home/app")).unwrap();
    assert_eq!((meta.uid(), meta.gid()), unpacking_ids(), "the shared root keeps no owner of the image's");
    drop(ready);

    registry.stop();
    drop(cache);
    let reopened = BundleCache::open(dir.path(), CacheOptions::default()).await.unwrap();
    let again = reopened.get(&digest).await.unwrap().expect("kept across a reopen");
    assert_eq!(again.definition().image.as_ref().unwrap().account.as_deref(), Some(&*account));
}

/// The ids this test unpacks as, who own every unpacked entry: those of a
/// file it makes.
fn unpacking_ids() -> (u32, u32) {
    use std::os::unix::fs::MetadataExt as _;
    let probe = tempfile::NamedTempFile::new().unwrap();
    let meta = probe.as_file().metadata().unwrap();
    (meta.uid(), meta.gid())
}

#[tokio::test]
async fn an_image_whose_user_it_does_not_have_is_refused_naming_the_user() {
    let registry = TestRegistry::start().await.unwrap();
    let image = TestImage::as_user(&["/bin/sh"], &[], &[], "", "ghost")
        .layer(Layer::new().dir("etc", 0o755).file("etc/passwd", b"root:x:0:0::/root:/bin/sh\n", 0o644))
        .unwrap();
    let reference = registry.reference("team/ghost:v1");
    let digest = image.push(&client(), &reference, &RegistryCredentials::Anonymous).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cache = cache(dir.path()).await;
    let error = cache
        .pull(&client(), &pinned(&registry, "team/ghost", &digest), &RegistryCredentials::Anonymous)
        .await
        .unwrap_err();
    let message = error.to_string();
    assert!(message.contains("`ghost`") && message.contains("/etc/passwd"), "{message}");
    assert_eq!(cache.usage().bundles, 0, "nothing is kept of it");
}

#[tokio::test]
async fn hostile_images_are_refused_naming_the_entry_and_nothing_lands_outside() {
    let registry = TestRegistry::start().await.unwrap();
    let outside = tempfile::tempdir().unwrap();
    let escape = outside.path().join("escaped");
    let cases: Vec<(&str, TestImage, &str)> = vec![
        (
            "dotdot",
            TestImage::new(&["/bin/sh"], &[], &[], "").layer(Layer::new().file("../../escaped", b"x", 0o644)).unwrap(),
            "../../escaped",
        ),
        (
            "link-parent",
            TestImage::new(&["/bin/sh"], &[], &[], "")
                .layer(Layer::new().symlink("etc", outside.path().to_str().unwrap()))
                .unwrap()
                .layer(Layer::new().file("etc/escaped", b"x", 0o644))
                .unwrap(),
            "etc/escaped",
        ),
        (
            "whiteout-dotdot",
            TestImage::new(&["/bin/sh"], &[], &[], "")
                .layer(Layer::new().dir("a", 0o755).file("a/.wh...", b"", 0o644))
                .unwrap(),
            "a/.wh...",
        ),
    ];
    let dir = tempfile::tempdir().unwrap();
    let cache = cache(dir.path()).await;
    for (name, image, entry) in cases {
        let digest = image
            .push(&client(), &registry.reference(&format!("evil/{name}:v1")), &RegistryCredentials::Anonymous)
            .await
            .unwrap();
        let pulled = cache
            .pull(&client(), &pinned(&registry, &format!("evil/{name}"), &digest), &RegistryCredentials::Anonymous)
            .await;
        match pulled {
            Err(CacheError::Unsafe { source: ExtractError::Refused { entry: refused, .. }, .. }) => {
                assert_eq!(refused, entry, "{name}");
            }
            other => panic!("{name}: {other:?}"),
        }
        assert!(!escape.exists(), "{name} wrote outside the cache");
        assert!(cache.get(&digest).await.unwrap().is_none(), "{name} left a root behind");
    }

    // A truncated layer: an archive error, not half a root.
    let whole = Layer::new().file("big", &vec![7u8; 256 << 10], 0o644).finish().unwrap();
    let truncated = TestImage::new(&["/bin/sh"], &[], &[], "").raw_layer(whole[..whole.len() / 2].to_vec());
    let digest = truncated
        .push(&client(), &registry.reference("evil/truncated:v1"), &RegistryCredentials::Anonymous)
        .await
        .unwrap();
    let pulled =
        cache.pull(&client(), &pinned(&registry, "evil/truncated", &digest), &RegistryCredentials::Anonymous).await;
    assert!(matches!(pulled, Err(CacheError::Unsafe { source: ExtractError::Archive(_), .. })), "{pulled:?}");
    assert!(cache.get(&digest).await.unwrap().is_none());
    let leftovers: Vec<_> = std::fs::read_dir(dir.path().join("tmp")).unwrap().collect();
    assert!(leftovers.is_empty(), "refused pulls leave nothing in tmp: {leftovers:?}");
}
