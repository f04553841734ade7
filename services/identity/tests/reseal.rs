//! Re-sealing the CA keys under a new auth secret, against both store
//! backends: every key moves at once while certificates are being signed,
//! a second run converges, a wrong secret changes nothing, the old secret
//! opens nothing afterwards, and a replica given its secret as a file
//! follows without a restart.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use berth_core::Identity;
use berth_identity::{Authority, AuthorityError, AuthorityTiming, Resealed};
use berth_store::Store;
use berth_store::testing::TestDb;
use tokio_util::sync::CancellationToken;

const OLD: &str = "0123456789abcdef0123456789abcdef-old";
const NEW: &str = "0123456789abcdef0123456789abcdef-new";

fn timing() -> AuthorityTiming {
    AuthorityTiming { min_prepared: Duration::ZERO, ..AuthorityTiming::default() }
}

async fn migrated(db: &TestDb) -> Store {
    let store = db.store().clone();
    store.migrate(berth_identity::MIGRATIONS).await.unwrap();
    store
}

macro_rules! both_backends {
    ($($name:ident),* $(,)?) => {
        mod postgres {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
              async fn $name() { super::$name(super::TestDb::postgres().await.unwrap()).await })*
        }
        mod sqlite {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
              async fn $name() { super::$name(super::TestDb::sqlite().await.unwrap()).await })*
        }
    };
}

both_backends!(
    a_reseal_moves_every_key_under_load_and_the_old_secret_opens_nothing,
    a_replica_given_its_secret_as_a_file_follows_a_reseal,
);

async fn a_reseal_moves_every_key_under_load_and_the_old_secret_opens_nothing(db: TestDb) {
    let store = migrated(&db).await;
    let running = Authority::open(store.clone(), OLD, timing()).await.unwrap();
    // Two keys: the active CA and a prepared one.
    running.prepare().await.unwrap();
    let active = running.active_fingerprint().await.unwrap();

    // A replica keeps signing while the keys are re-sealed under it.
    let stop = CancellationToken::new();
    let (signed, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let load = {
        let (running, stop, signed, failed) = (running.clone(), stop.clone(), signed.clone(), failed.clone());
        tokio::spawn(async move {
            let who = Identity::service("revisions").unwrap();
            while !stop.is_cancelled() {
                match running.issue_material(&who, &[], Duration::from_secs(600)).await {
                    Ok(_) => signed.fetch_add(1, Ordering::Relaxed),
                    Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                };
                // A cached signing view makes a call that never waits: without
                // a yield this loop would hold its worker, and a task woken
                // onto that worker (the pool's, the reseal's) would starve
                // behind it, as no request handler ever holds one.
                tokio::task::yield_now().await;
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let done = Authority::reseal(&store, OLD, NEW).await.unwrap();
    assert_eq!(done, Resealed { resealed: 2, already: 0 });
    let during = signed.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.cancel();
    load.await.unwrap();
    assert!(signed.load(Ordering::Relaxed) > during, "signing went on after the reseal");
    assert_eq!(failed.load(Ordering::Relaxed), 0, "no certificate failed during the reseal");

    // Run again (after a crash, say): nothing left to move.
    assert_eq!(Authority::reseal(&store, OLD, NEW).await.unwrap(), Resealed { resealed: 0, already: 2 });

    // Secrets that open nothing change nothing, and say which key refused.
    let wrong = "w".repeat(40);
    let refused = Authority::reseal(&store, &wrong, &"x".repeat(40)).await.unwrap_err();
    assert!(matches!(&refused, AuthorityError::ResealRefused { .. }), "{refused}");
    assert!(refused.to_string().contains("nothing was changed"), "{refused}");

    // The old secret opens nothing now; the new one opens the same CA.
    let with_old = Authority::open(db.connect().await.unwrap(), OLD, timing()).await;
    assert!(matches!(with_old, Err(AuthorityError::Unseal)), "{:?}", with_old.err());
    let with_new = Authority::open(db.connect().await.unwrap(), NEW, timing()).await.unwrap();
    assert_eq!(with_new.active_fingerprint().await.unwrap(), active);
    assert_eq!(with_new.bundle_pem().await.unwrap(), running.bundle_pem().await.unwrap());

    // The replica still holding the old secret never seals a new CA with it.
    let refused = running.prepare().await.unwrap_err();
    assert!(refused.to_string().contains("re-sealed under a new auth secret"), "{refused}");
    // The one with the new secret rotates, and the rotated CA opens under it.
    with_new.prepare().await.unwrap();
    with_new.activate(true).await.unwrap();
    let after = Authority::open(db.connect().await.unwrap(), NEW, timing()).await.unwrap();
    assert_ne!(after.active_fingerprint().await.unwrap(), active, "the rotated CA is active");
}

async fn a_replica_given_its_secret_as_a_file_follows_a_reseal(db: TestDb) {
    let store = migrated(&db).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("auth-secret");
    std::fs::write(&file, format!("{OLD}\n")).unwrap();
    let replica = Authority::open_with_secret_file(store.clone(), &file, timing()).await.unwrap();
    let first = replica.active_fingerprint().await.unwrap();

    Authority::reseal(&store, OLD, NEW).await.unwrap();
    std::fs::write(&file, format!("{NEW}\n")).unwrap();

    // It rotates with the secret now in its file: a replica started with the
    // new secret opens the CA it sealed.
    replica.prepare().await.unwrap();
    replica.activate(true).await.unwrap();
    let other = Authority::open(db.connect().await.unwrap(), NEW, timing()).await.unwrap();
    let rotated = other.active_fingerprint().await.unwrap();
    assert_ne!(rotated, first);
    assert_eq!(replica.active_fingerprint().await.unwrap(), rotated, "both replicas sign with the rotated CA");
    let who = Identity::service("leases").unwrap();
    replica.issue_material(&who, &[], Duration::from_secs(600)).await.unwrap();

    // A file it cannot read is named.
    let missing = Authority::open_with_secret_file(store.clone(), &dir.path().join("nope"), timing()).await;
    assert!(matches!(missing, Err(AuthorityError::SecretFile { .. })), "{:?}", missing.err());
}

#[tokio::test]
async fn berth_identity_reseal_moves_the_keys_and_refuses_a_short_secret() {
    let db = TestDb::sqlite().await.unwrap();
    let store = migrated(&db).await;
    let first = Authority::open(store.clone(), OLD, timing()).await.unwrap().active_fingerprint().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (old, new, short) = (dir.path().join("old"), dir.path().join("new"), dir.path().join("short"));
    std::fs::write(&old, format!("{OLD}\n")).unwrap();
    std::fs::write(&new, format!("{NEW}\n")).unwrap();
    std::fs::write(&short, "too short\n").unwrap();
    let reseal = |new: &std::path::Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_berth-identity"))
            .arg("reseal")
            .arg("--old-secret-file")
            .arg(&old)
            .arg("--new-secret-file")
            .arg(new)
            .args(["--database-url", db.url()])
            .env("RUST_LOG", "warn")
            .output()
            .unwrap()
    };
    let refused = reseal(&short);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("at least 32 characters"), "{refused:?}");

    let done = reseal(&new);
    let stdout = String::from_utf8_lossy(&done.stdout);
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    assert!(stdout.contains("re-sealed 1 CA key(s)"), "{stdout}");
    let reopened = Authority::open(db.connect().await.unwrap(), NEW, timing()).await.unwrap();
    assert_eq!(reopened.active_fingerprint().await.unwrap(), first);
}
