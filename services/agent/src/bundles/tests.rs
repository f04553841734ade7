//! The bundle store against OCI layout directories (the same code paths as a
//! registry, without one) and the rules that turn a bundle and a lease into
//! what runs.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt as _;

use berth_bundle::{BundlePort, CacheOptions, PackedBundle, RegistryConfig};

use super::credentials::IssuedCredentials;
use super::*;
use crate::provider::ImageOverrides;
use crate::testdir::TestDir;

/// A bundle directory whose program prints `word`.
fn bundle_dir(word: &str) -> TestDir {
    let dir = TestDir::new();
    let root = dir.path();
    std::fs::write(
        root.join("berth.toml"),
        "entrypoint = \"bin/app\"\nargs = [\"--serve\"]\n\n[env]\nGREETING = \"hello\"\n\n\
         [[ports]]\nname = \"http\"\nport = 8080\n",
    )
    .unwrap();
    std::fs::create_dir(root.join("bin")).unwrap();
    std::fs::write(root.join("bin/app"), format!("#!/bin/sh\necho {word}\n")).unwrap();
    std::fs::set_permissions(root.join("bin/app"), std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

fn client() -> BundleClient {
    BundleClient::new(RegistryConfig::default()).unwrap()
}

/// Packs `dir` into the layout at `layout` under `tag`; its digest.
async fn push(dir: &Path, layout: &Path, tag: &str) -> Digest {
    let packed = PackedBundle::from_dir(dir).unwrap();
    let reference = BundleReference::parse(&format!("oci:{}:{tag}", layout.display())).unwrap();
    client().push(&packed, &reference, &RegistryCredentials::Anonymous).await.unwrap()
}

async fn store(cache_dir: &Path, budget_bytes: u64) -> BundleStore {
    let options = CacheOptions { budget_bytes, ..CacheOptions::default() };
    BundleStore::new(BundleCache::open(cache_dir, options).await.unwrap(), client())
}

fn ask(project: &str, revision: &str, layout: &Path, digest: &Digest) -> BundleAsk {
    BundleAsk {
        lease_id: format!("l-{revision}"),
        project: project.into(),
        service: "web".into(),
        revision: revision.into(),
        reference: format!("oci:{}@{digest}", layout.display()),
        digest: digest.to_string(),
        insecure: false,
        secret: String::new(),
        image: false,
    }
}

#[tokio::test]
async fn a_tenant_runs_a_bundle_it_fetched_without_the_source_and_another_tenant_must_reach_the_source() {
    let source = bundle_dir("one");
    let layout = TestDir::new();
    let layout_dir = layout.path().join("layout");
    let digest = push(source.path(), &layout_dir, "v1").await;
    let cache = TestDir::new();
    let store = store(cache.path(), u64::MAX).await;

    let first = ask("team-a", "web-00001", &layout_dir, &digest);
    let ready = store.warm(&first).await.unwrap();
    let definition = ready.definition();
    assert_eq!(definition.digest, digest);
    assert_eq!(definition.entrypoint, definition.root.join("bin/app"));
    assert_eq!(std::fs::read_to_string(&definition.entrypoint).unwrap(), "#!/bin/sh\necho one\n");
    let resolved = store.resolve("team-a", "web", "web-00001").await.unwrap().unwrap();
    assert_eq!(resolved.definition(), definition, "the revision resolves to what was pulled");
    assert!(store.resolve("team-b", "web", "web-00001").await.unwrap().is_none(), "tenants do not share names");

    // The source is gone: the tenant that fetched the bundle still runs it,
    // under this revision name or another.
    std::fs::remove_dir_all(&layout_dir).unwrap();
    store.warm(&first).await.unwrap();
    store.warm(&ask("team-a", "web-00002", &layout_dir, &digest)).await.unwrap();
    // Another tenant naming the same digest has to show it can read it.
    let error = store.warm(&ask("team-b", "web-00001", &layout_dir, &digest)).await.unwrap_err();
    assert_eq!(error.reason(), "BundleNotFound", "{error}");
    assert!(error.to_string().contains(&digest.to_string()), "{error}");
    assert!(store.resolve("team-b", "web", "web-00001").await.unwrap().is_none());
}

#[tokio::test]
async fn a_digest_the_source_does_not_have_fails_naming_the_digest() {
    let source = bundle_dir("one");
    let layout = TestDir::new();
    push(source.path(), layout.path(), "v1").await;
    let cache = TestDir::new();
    let store = store(cache.path(), u64::MAX).await;
    let missing = Digest::of(b"no such manifest");
    let error = store.warm(&ask("", "", layout.path(), &missing)).await.unwrap_err();
    assert_eq!(error.reason(), "BundleNotFound", "{error}");
    assert!(error.to_string().contains(&missing.to_string()), "{error}");

    // A reference pinned to another digest than the lease's is refused
    // before anything is fetched.
    let mut crossed = ask("", "", layout.path(), &missing);
    crossed.digest = Digest::of(b"another").to_string();
    let error = store.warm(&crossed).await.unwrap_err();
    assert_eq!(error.reason(), "BundleInvalid", "{error}");
    assert!(error.to_string().contains("pinned to"), "{error}");
    let mut garbled = crossed;
    garbled.digest = "sha256:nope".into();
    assert_eq!(store.warm(&garbled).await.unwrap_err().reason(), "BundleInvalid");
}

#[tokio::test]
async fn a_bundle_a_lease_holds_is_never_evicted_and_one_no_lease_holds_is() {
    let (one, two) = (bundle_dir("one"), bundle_dir("two"));
    let layout = TestDir::new();
    let first = push(one.path(), layout.path(), "one").await;
    let second = push(two.path(), layout.path(), "two").await;
    let cache = TestDir::new();
    // Room for nothing: every bundle no lease holds goes.
    let store = store(cache.path(), 1).await;

    let held = store.warm(&ask("", "", layout.path(), &first)).await.unwrap();
    let other = store.warm(&ask("", "", layout.path(), &second)).await.unwrap();
    assert!(held.definition().root.is_dir(), "a held bundle was evicted by the next pull");
    assert_eq!(store.inner.cache.usage().bundles, 2);

    drop(other);
    store.evict().await;
    assert!(held.definition().root.is_dir(), "a held bundle was evicted");
    assert_eq!(store.inner.cache.usage().bundles, 1, "the bundle nothing holds stays past the budget");
    assert!(!store.inner.cache.bundle_dir(&second).exists());
}

/// Hands out whatever it was given, and records which leases asked.
#[derive(Debug)]
struct Handed {
    answer: Result<IssuedCredentials, CredentialsError>,
    asked: Mutex<Vec<String>>,
}

impl Handed {
    fn store(cache: BundleCache, answer: Result<IssuedCredentials, CredentialsError>) -> (BundleStore, Arc<Handed>) {
        let handed = Arc::new(Handed { answer, asked: Mutex::new(Vec::new()) });
        let source: Arc<dyn PullCredentials> = handed.clone();
        (BundleStore::with_credentials(cache, client(), Some(source)), handed)
    }

    fn asked(&self) -> Vec<String> {
        self.asked.lock().unwrap().clone()
    }
}

#[async_trait::async_trait]
impl PullCredentials for Handed {
    async fn fetch(&self, lease_id: &str) -> Result<IssuedCredentials, CredentialsError> {
        self.asked.lock().unwrap().push(lease_id.to_owned());
        self.answer.clone()
    }
}

const USER: &str = "ci";
const PASSWORD: &str = "pull-s3cret";

fn issued(registry: &str, password: &str) -> IssuedCredentials {
    IssuedCredentials {
        registry: registry.to_owned(),
        credentials: RegistryCredentials::Basic { username: USER.into(), password: password.into() },
        expires_at: SystemTime::now() + std::time::Duration::from_secs(60),
    }
}

/// A registry behind htpasswd holding one bundle, and a lease of it naming
/// the credentials `team`.
async fn private_registry() -> (berth_bundle::testing::TestRegistry, BundleAsk, Digest) {
    let registry = berth_bundle::testing::TestRegistry::start_with_htpasswd(USER, PASSWORD).await.unwrap();
    let source = bundle_dir("private");
    let packed = PackedBundle::from_dir(source.path()).unwrap();
    let reference = BundleReference::parse(&registry.reference("team/app:v1")).unwrap();
    let basic = RegistryCredentials::Basic { username: USER.into(), password: PASSWORD.into() };
    let digest = client().push(&packed, &reference, &basic).await.unwrap();
    let ask = BundleAsk {
        lease_id: "l-private".into(),
        project: "team".into(),
        service: "web".into(),
        revision: "web-00001".into(),
        reference: format!("{}@{digest}", registry.reference("team/app")),
        digest: digest.to_string(),
        insecure: false,
        secret: "team".into(),
        image: false,
    };
    (registry, ask, digest)
}

async fn cache(dir: &TestDir) -> BundleCache {
    BundleCache::open(dir.path(), CacheOptions::default()).await.unwrap()
}

#[tokio::test]
async fn a_private_bundle_is_pulled_with_the_credentials_revisions_hands_out_for_the_lease() {
    let (registry, ask, digest) = private_registry().await;
    let dir = TestDir::new();
    let (store, handed) = Handed::store(cache(&dir).await, Ok(issued(&registry.host(), PASSWORD)));
    let ready = store.warm(&ask).await.unwrap();
    assert_eq!(ready.definition().digest, digest);
    assert_eq!(handed.asked(), ["l-private"]);
    // The tenant's next replica of the revision needs neither registry nor credentials.
    let mut next = ask.clone();
    next.lease_id = "l-next".into();
    store.warm(&next).await.unwrap();
    assert_eq!(handed.asked(), ["l-private"]);
}

#[tokio::test]
async fn without_credentials_a_private_bundle_fails_the_launch_as_unauthorized() {
    let (registry, ask, _) = private_registry().await;

    // Revisions hands out a password the registry refuses.
    let dir = TestDir::new();
    let (store, _) = Handed::store(cache(&dir).await, Ok(issued(&registry.host(), "wrong")));
    let error = store.warm(&ask).await.unwrap_err();
    assert_eq!(error.reason(), "BundleUnauthorized", "{error}");
    assert!(error.to_string().contains("unauthorized at"), "{error}");

    // Revisions refuses: the lease is not this node's, say.
    let (store, _) =
        Handed::store(cache(&dir).await, Err(CredentialsError::Refused("lease l-private is not open".into())));
    let error = store.warm(&ask).await.unwrap_err();
    assert_eq!(error.reason(), "BundleUnauthorized", "{error}");
    let message = error.to_string();
    assert!(
        message.contains("Unauthorized") && message.contains("`team`") && message.contains("not open"),
        "{message}"
    );

    // Revisions cannot be reached: worth trying again.
    let (store, _) = Handed::store(cache(&dir).await, Err(CredentialsError::Unavailable("refused".into())));
    assert_eq!(store.warm(&ask).await.unwrap_err().reason(), "BundleUnavailable");

    // No revisions address: the anonymous pull is refused, naming the flag.
    let store = BundleStore::new(cache(&dir).await, client());
    let error = store.warm(&ask).await.unwrap_err();
    assert_eq!(error.reason(), "BundleUnauthorized", "{error}");
    assert!(error.to_string().contains("--revisions-addr"), "{error}");

    // No secret named: pulled anonymously and refused by the registry.
    let (store, handed) = Handed::store(cache(&dir).await, Ok(issued(&registry.host(), PASSWORD)));
    let anonymous = BundleAsk { secret: String::new(), ..ask.clone() };
    assert_eq!(store.warm(&anonymous).await.unwrap_err().reason(), "BundleUnauthorized");
    assert!(handed.asked().is_empty(), "a lease naming no credentials asks for none");
}

#[tokio::test]
async fn credentials_for_another_registry_are_never_sent() {
    let (registry, ask, _) = private_registry().await;
    let dir = TestDir::new();
    let (store, _) = Handed::store(cache(&dir).await, Ok(issued("registry.example.com", PASSWORD)));
    let error = store.warm(&ask).await.unwrap_err();
    assert_eq!(error.reason(), "BundleUnauthorized", "{error}");
    let message = error.to_string();
    assert!(message.contains(&format!("for registry registry.example.com, not {}", registry.host())), "{message}");

    let mut expired = issued(&registry.host(), PASSWORD);
    expired.expires_at = SystemTime::now() - std::time::Duration::from_secs(1);
    let (store, _) = Handed::store(cache(&dir).await, Ok(expired));
    assert!(store.warm(&ask).await.unwrap_err().to_string().contains("expired"));
}

fn definition(root: &Path) -> BundleDefinition {
    BundleDefinition {
        digest: Digest::of(b"bundle"),
        root: root.to_path_buf(),
        entrypoint: root.join("bin/app"),
        args: vec!["--serve".into()],
        env: BTreeMap::from([("GREETING".into(), "hello".into()), ("LEVEL".into(), "info".into())]),
        ports: vec![BundlePort { name: "http".into(), port: 8080 }],
        image: None,
    }
}

fn lease_spec() -> LaunchSpec {
    LaunchSpec {
        program: Program::Entrypoint,
        args: Vec::new(),
        env: BTreeMap::new(),
        ..LaunchSpec::for_test("lease-1", "")
    }
}

#[test]
fn a_bundle_runs_its_entrypoint_with_its_own_settings_under_the_lease_overrides() {
    let dir = bundle_dir("one");
    let root = dir.path();
    std::fs::write(root.join("bin/other"), "#!/bin/sh\n").unwrap();
    let definition = definition(root);

    let plain = bundle_spec(&definition, lease_spec()).unwrap();
    assert_eq!(plain.program, Program::Bundled("bin/app".into()));
    assert_eq!(plain.root, WorkloadRoot::Bundle { dir: root.to_path_buf(), digest: definition.digest.to_string() });
    assert_eq!(plain.args, ["--serve"]);
    assert_eq!(plain.env["GREETING"], "hello");
    assert_eq!(plain.env[BUNDLE_DIGEST_VAR], definition.digest.to_string());
    assert_eq!(plain.ports, ["http"], "the bundle's ports when the lease names none");

    let mut overridden = lease_spec();
    overridden.args = vec!["--once".into()];
    overridden.env.insert("LEVEL".into(), "debug".into());
    overridden.ports = vec!["web".into()];
    let overridden = bundle_spec(&definition, overridden).unwrap();
    assert_eq!(overridden.program, Program::Bundled("bin/app".into()));
    assert_eq!(overridden.args, ["--once"], "the lease's arguments replace the bundle's");
    assert_eq!((overridden.env["LEVEL"].as_str(), overridden.env["GREETING"].as_str()), ("debug", "hello"));
    assert_eq!(overridden.ports, ["web"]);

    let mut own = lease_spec();
    own.program = Program::Command("bin/other".into());
    let own = bundle_spec(&definition, own).unwrap();
    assert_eq!(own.program, Program::Bundled("bin/other".into()));
    assert!(own.args.is_empty(), "a command of the lease's own does not take the bundle's arguments");

    for (command, expected) in [("python3", "python3"), ("/bin/true", "/bin/true")] {
        let mut spec = lease_spec();
        spec.program = Program::Command(command.into());
        assert_eq!(bundle_spec(&definition, spec).unwrap().program, Program::Command(expected.into()));
    }
}

#[test]
fn a_program_that_is_not_in_the_bundle_or_leads_out_of_it_is_refused() {
    let dir = bundle_dir("one");
    let root = dir.path();
    std::os::unix::fs::symlink("/bin/sh", root.join("bin/escape")).unwrap();
    std::os::unix::fs::symlink("../../outside", root.join("bin/up")).unwrap();
    let definition = definition(root);

    for (command, says) in [
        ("../bin/app", "without `.` or `..`"),
        ("bin/../../x", "without `.` or `..`"),
        ("bin/escape", "leads outside the bundle"),
        ("bin/up", "is not a file in the bundle"),
        ("bin/missing", "is not a file in the bundle"),
        ("bin", "is not a file in the bundle"),
    ] {
        let mut spec = lease_spec();
        spec.program = Program::Command(command.into());
        let error = bundle_spec(&definition, spec).unwrap_err();
        assert_eq!(error.reason(), "InvalidCommand", "{command}: {error}");
        let message = error.to_string();
        assert!(message.contains(command) && message.contains(says), "{command}: {message}");
    }

    let escaping = BundleDefinition { entrypoint: root.join("bin/escape"), ..definition.clone() };
    let error = bundle_spec(&escaping, lease_spec()).unwrap_err();
    assert_eq!(error.reason(), "BundleInvalid", "{error}");
    assert!(error.to_string().contains("entrypoint `bin/escape` leads outside the bundle"), "{error}");
}

#[test]
fn an_image_runs_its_entrypoint_and_cmd_under_the_lease_command_args_and_env_as_kubernetes_does() {
    let run = ImageRun {
        entrypoint: vec!["/bin/httpd".into(), "-f".into()],
        cmd: vec!["-p".into(), "8080".into()],
        env: BTreeMap::from([("PATH".into(), "/bin".into()), ("MODE".into(), "image".into())]),
        working_dir: "/www".into(),
        user: String::new(),
        account: None,
        owners: Default::default(),
    };
    let definition = BundleDefinition {
        image: Some(std::sync::Arc::new(run)),
        entrypoint: std::path::PathBuf::new(),
        args: Vec::new(),
        env: BTreeMap::new(),
        ports: Vec::new(),
        ..definition(Path::new("/cache/bundles/sha256/abc"))
    };
    let argv = |spec: &LaunchSpec| {
        let Program::Command(program) = &spec.program else { panic!("{:?}", spec.program) };
        std::iter::once(program.clone()).chain(spec.args.iter().cloned()).collect::<Vec<_>>()
    };

    let plain = bundle_spec(&definition, lease_spec()).unwrap();
    assert_eq!(argv(&plain), ["/bin/httpd", "-f", "-p", "8080"]);
    assert_eq!(
        plain.root,
        WorkloadRoot::Image {
            dir: "/cache/bundles/sha256/abc".into(),
            digest: definition.digest.to_string(),
            working_dir: "/www".into(),
            account: None,
        }
    );
    assert_eq!(plain.env["MODE"], "image");
    assert_eq!(plain.env[BUNDLE_DIGEST_VAR], definition.digest.to_string());

    let mut args_only = lease_spec();
    args_only.args = vec!["-p".into(), "9090".into()];
    args_only.env.insert("MODE".into(), "lease".into());
    let args_only = bundle_spec(&definition, args_only).unwrap();
    assert_eq!(argv(&args_only), ["/bin/httpd", "-f", "-p", "9090"], "args replace the Cmd");
    assert_eq!(args_only.env["MODE"], "lease", "the lease's env over the image's");

    let mut command = lease_spec();
    command.program = Program::Command("sh".into());
    assert_eq!(argv(&bundle_spec(&definition, command).unwrap()), ["sh"], "a command alone drops the Cmd");

    let empty = BundleDefinition { image: Some(std::sync::Arc::new(ImageRun::default())), ..definition.clone() };
    let refused = bundle_spec(&empty, lease_spec()).unwrap_err();
    assert_eq!(refused.reason(), "BundleInvalid");
    assert!(refused.to_string().contains("no Entrypoint nor Cmd"), "{refused}");
}

#[test]
fn a_lease_sets_the_images_working_directory_and_user_in_place_of_its_configs() {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(root.path().join("etc")).unwrap();
    std::fs::create_dir_all(root.path().join("srv/data")).unwrap();
    std::fs::write(
        root.path().join("etc/passwd"),
        "root:x:0:0::/root:/bin/sh\napp:x:1000:1000::/home/app:\nweb:x:33:33::/srv:\n",
    )
    .unwrap();
    let owners: berth_bundle::ImageOwners = serde_json::from_str(r#"[["srv/data", 33, 33]]"#).unwrap();
    let run = ImageRun {
        entrypoint: vec!["/bin/sh".into()],
        working_dir: "/home/app".into(),
        user: "app".into(),
        account: berth_bundle::ImageUser::resolve("app", root.path(), &owners).unwrap().map(std::sync::Arc::new),
        owners: std::sync::Arc::new(owners),
        ..ImageRun::default()
    };
    let definition = BundleDefinition { image: Some(std::sync::Arc::new(run)), ..definition(root.path()) };
    let account_of = |spec: &LaunchSpec| match &spec.root {
        WorkloadRoot::Image { working_dir, account, .. } => (
            working_dir.clone(),
            account.as_ref().and_then(|a| a.name.clone()),
            account.as_ref().map(|a| a.owned.len()),
        ),
        other => panic!("{other:?}"),
    };
    let plain = bundle_spec(&definition, lease_spec()).unwrap();
    assert_eq!(account_of(&plain), ("/home/app".into(), Some("app".into()), Some(0)), "the image's own");

    let mut overridden = lease_spec();
    overridden.image = ImageOverrides { working_dir: "/srv".into(), user: "web".into() };
    let overridden = bundle_spec(&definition, overridden).unwrap();
    assert_eq!(
        account_of(&overridden),
        ("/srv".into(), Some("web".into()), Some(1)),
        "the lease's, with what web owns"
    );

    let mut as_root = lease_spec();
    as_root.image.user = "0".into();
    assert_eq!(account_of(&bundle_spec(&definition, as_root).unwrap()).1, None, "root is given nothing");

    let mut ghost = lease_spec();
    ghost.image.user = "ghost".into();
    let refused = bundle_spec(&definition, ghost).unwrap_err();
    assert_eq!(refused.reason(), "BundleInvalid");
    assert!(
        refused.to_string().contains("user `ghost` cannot be used") && refused.to_string().contains("/etc/passwd"),
        "{refused}"
    );

    let dir = bundle_dir("plain");
    let mut on_a_bundle = lease_spec();
    on_a_bundle.image.user = "app".into();
    let refused = bundle_spec(&self::definition(dir.path()), on_a_bundle).unwrap_err();
    assert!(refused.to_string().contains("applies only to a container image"), "{refused}");
}
