//! Cache volumes' heads as nodes see them through `NodeLeases`, on both
//! backends: a lease's view is published only once its workload succeeded,
//! of two leases started from one head exactly one publishes, each lease
//! keeps its first outcome, and a lease reaches only its own project's
//! volumes, only those its workload names.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod support;

use berth_testkit::on_both_backends;

use berth_leases::LeasesConfig;
use berth_proto::identity::v1::NodeState;
use berth_proto::leases::v1;
use berth_proto::leases::v1::{CacheOutcome, LeasePhase};
use berth_proto::types::v1::{CacheCommit, CacheMount};
use support::{Backend, GIB, Ledger, ask, fast_config, node};
use tonic::Code;

/// Two nodes that contain their workloads, as a cache volume needs.
fn nodes() -> Vec<berth_proto::identity::v1::Node> {
    ["n-1", "n-2"]
        .into_iter()
        .map(|id| {
            let mut node = node(id, "", NodeState::Up, 4000, 8 * GIB);
            node.labels.insert("berth.runtime".into(), "runc".into());
            node.labels.insert("berth.contained".into(), "true".into());
            node
        })
        .collect()
}

fn digest(n: u8) -> String {
    format!("sha256:{}", format!("{n:02x}").repeat(32))
}

/// Places a lease in `project` mounting `key` with `commit`.
async fn place(ledger: &Ledger, name: &str, project: &str, key: &str, commit: CacheCommit) -> v1::Lease {
    let mut request = ask(name, 100, 64 << 20);
    request.project = project.to_owned();
    let mount = CacheMount { key: key.to_owned(), path: "/cache".to_owned(), commit: commit as i32 };
    request.workload.as_mut().unwrap().cache = vec![mount];
    ledger.leases(0).request_lease(request).await.unwrap().into_inner().lease.unwrap()
}

async fn open(
    ledger: &Ledger,
    lease: &v1::Lease,
    key: &str,
    held: &[u64],
) -> Result<v1::OpenCacheResponse, tonic::Status> {
    let request = v1::OpenCacheRequest {
        node_id: lease.node_id.clone(),
        lease_id: lease.lease_id.clone(),
        epoch: lease.epoch,
        key: key.to_owned(),
        held_generations: held.to_vec(),
    };
    ledger.node(&lease.node_id).open_cache(request).await.map(tonic::Response::into_inner)
}

/// `lease`'s node asking to publish the view it started at `base` from, sealed as `sealed`.
fn commit_request(lease: &v1::Lease, base: u64, sealed: u8) -> v1::CommitCacheRequest {
    v1::CommitCacheRequest {
        node_id: lease.node_id.clone(),
        lease_id: lease.lease_id.clone(),
        epoch: lease.epoch,
        key: "deps".to_owned(),
        base_generation: base,
        digest: digest(sealed),
        size_bytes: 1000 + u64::from(sealed),
        ..Default::default()
    }
}

async fn commit(
    ledger: &Ledger,
    lease: &v1::Lease,
    base: u64,
    sealed: u8,
) -> Result<v1::CommitCacheResponse, tonic::Status> {
    let request = commit_request(lease, base, sealed);
    ledger.node(&lease.node_id).commit_cache(request).await.map(tonic::Response::into_inner)
}

/// Runs `lease` to `phase`, as its node would report it.
async fn end(ledger: &Ledger, lease: &v1::Lease, phase: LeasePhase) {
    ledger.report(lease, lease.epoch, LeasePhase::Running).await.unwrap();
    ledger.report(lease, lease.epoch, phase).await.unwrap();
}

async fn a_view_is_published_only_when_its_workload_succeeded(backend: Backend) {
    let ledger = Ledger::start(backend, fast_config(), nodes()).await;

    // The first lease finds nothing: a miss from generation 0.
    let first = place(&ledger, "first", "", "deps", CacheCommit::Unspecified).await;
    let opened = open(&ledger, &first, "deps", &[]).await.unwrap();
    assert_eq!(opened.head.unwrap().generation, 0);
    assert_eq!(opened.observation.as_ref().unwrap().outcome(), CacheOutcome::Miss);
    // Not while it runs.
    ledger.report(&first, first.epoch, LeasePhase::Running).await.unwrap();
    let early = commit(&ledger, &first, 0, 1).await.unwrap_err();
    assert_eq!(early.code(), Code::FailedPrecondition, "{early:?}");
    assert!(early.message().contains("only once its workload ended"), "{early:?}");
    ledger.report(&first, first.epoch, LeasePhase::Done).await.unwrap();
    let published = commit(&ledger, &first, 0, 1).await.unwrap();
    assert!(published.committed);
    let head = published.head.unwrap();
    assert_eq!(
        (head.generation, head.digest.as_str(), head.lease_id.as_str()),
        (1, digest(1).as_str(), first.lease_id.as_str())
    );
    // Asked again (a lost answer): the same outcome, no second generation.
    let again = commit(&ledger, &first, 0, 2).await.unwrap();
    assert!(again.committed);
    assert_eq!(again.head.unwrap().generation, 1);
    let seen = ledger.get(&first.lease_id).await.cache;
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!((seen[0].base_generation, seen[0].committed_generation), (0, 1));

    // The next lease goes where the head is, though another node is freer,
    // and starts from it: a hit where the node holds it.
    let mut filler = ask("filler", 2000, GIB);
    filler.workload.as_mut().unwrap().runtime = berth_proto::types::v1::RuntimeClass::Contained as i32;
    let filler = ledger.leases(0).request_lease(filler).await.unwrap().into_inner().lease.unwrap();
    assert_eq!(filler.node_id, first.node_id, "the filler takes the first node's room: {filler:?}");
    let second = place(&ledger, "second", "", "deps", CacheCommit::OnSuccess).await;
    assert_eq!(second.node_id, first.node_id, "placed beside its head");
    let opened = open(&ledger, &second, "deps", &[1]).await.unwrap();
    assert_eq!(opened.head.unwrap().digest, digest(1));
    assert_eq!(opened.observation.unwrap().outcome(), CacheOutcome::Hit);
    // It fails: nothing is published, the head stays, and the reason is kept.
    end(&ledger, &second, LeasePhase::Failed).await;
    let refused = commit(&ledger, &second, 1, 3).await.unwrap();
    assert!(!refused.committed);
    assert_eq!(refused.head.unwrap().generation, 1);
    assert_eq!(refused.observation.unwrap().reason, "WorkloadFailed");

    // With commit ALWAYS a failed workload publishes; with NEVER nothing does.
    let always = place(&ledger, "always", "", "deps", CacheCommit::Always).await;
    open(&ledger, &always, "deps", &[]).await.unwrap();
    end(&ledger, &always, LeasePhase::Failed).await;
    assert_eq!(commit(&ledger, &always, 1, 4).await.unwrap().head.unwrap().generation, 2);
    let never = place(&ledger, "never", "", "deps", CacheCommit::Never).await;
    open(&ledger, &never, "deps", &[]).await.unwrap();
    end(&ledger, &never, LeasePhase::Done).await;
    let skipped = commit(&ledger, &never, 2, 5).await.unwrap();
    assert_eq!((skipped.committed, skipped.observation.unwrap().reason.as_str()), (false, "CommitNever"));

    // A node that could not seal says why, and that is what is kept.
    let broken = place(&ledger, "broken", "", "deps", CacheCommit::OnSuccess).await;
    open(&ledger, &broken, "deps", &[]).await.unwrap();
    end(&ledger, &broken, LeasePhase::Done).await;
    let request = v1::CommitCacheRequest {
        node_id: broken.node_id.clone(),
        lease_id: broken.lease_id.clone(),
        epoch: broken.epoch,
        key: "deps".into(),
        base_generation: 2,
        skip_reason: "SealFailed".into(),
        message: "no space left on device".into(),
        ..Default::default()
    };
    let settled = ledger.node(&broken.node_id).commit_cache(request).await.unwrap().into_inner();
    assert_eq!(settled.observation.unwrap().reason, "SealFailed");
    assert_eq!(commit(&ledger, &broken, 2, 6).await.unwrap().head.unwrap().generation, 2, "the first outcome is kept");
    ledger.cleanup().await;
}

async fn of_two_leases_started_from_one_head_exactly_one_publishes(backend: Backend) {
    let ledger = Ledger::start(backend, fast_config(), nodes()).await;
    let mut leases = Vec::new();
    for name in ["a", "b", "c", "d"] {
        let lease = place(&ledger, name, "", "deps", CacheCommit::OnSuccess).await;
        assert_eq!(open(&ledger, &lease, "deps", &[]).await.unwrap().head.unwrap().generation, 0);
        end(&ledger, &lease, LeasePhase::Done).await;
        leases.push(lease);
    }
    // All four at once, each from generation 0.
    let mut tasks = tokio::task::JoinSet::new();
    for (n, lease) in leases.iter().enumerate() {
        let mut client = ledger.node(&lease.node_id);
        let request = v1::CommitCacheRequest {
            node_id: lease.node_id.clone(),
            lease_id: lease.lease_id.clone(),
            epoch: lease.epoch,
            key: "deps".to_owned(),
            base_generation: 0,
            digest: digest(u8::try_from(n).unwrap() + 10),
            size_bytes: 1000,
            ..Default::default()
        };
        tasks.spawn(async move { client.commit_cache(request).await.unwrap().into_inner() });
    }
    let outcomes: Vec<v1::CommitCacheResponse> = tasks.join_all().await;
    assert_eq!(outcomes.iter().filter(|o| o.committed).count(), 1, "{outcomes:#?}");
    for lost in outcomes.iter().filter(|o| !o.committed) {
        let seen = lost.observation.as_ref().unwrap();
        assert_eq!(seen.reason, "CommitConflict", "{seen:?}");
        assert!(seen.message.contains("generation 1 was published first"), "{seen:?}");
        assert_eq!(lost.head.as_ref().unwrap().generation, 1);
    }
    ledger.cleanup().await;
}

async fn a_lease_reaches_only_the_volumes_its_workload_names_in_its_project(backend: Backend) {
    let ledger = Ledger::start(backend, fast_config(), nodes()).await;
    let theirs = place(&ledger, "theirs", "other", "deps", CacheCommit::OnSuccess).await;
    open(&ledger, &theirs, "deps", &[]).await.unwrap();
    end(&ledger, &theirs, LeasePhase::Done).await;
    assert!(commit(&ledger, &theirs, 0, 1).await.unwrap().committed);

    // The same key in another project is another volume: it starts empty.
    let ours = place(&ledger, "ours", "", "deps", CacheCommit::OnSuccess).await;
    assert_eq!(open(&ledger, &ours, "deps", &[1]).await.unwrap().head.unwrap().generation, 0);
    // A key the workload does not name is refused, as is any other node.
    let unnamed = open(&ledger, &ours, "secrets", &[]).await.unwrap_err();
    assert_eq!(unnamed.code(), Code::FailedPrecondition, "{unnamed:?}");
    assert!(unnamed.message().contains("mounts no cache volume secrets"), "{unnamed:?}");
    let other_node = if ours.node_id == "n-1" { "n-2" } else { "n-1" };
    let request = v1::OpenCacheRequest {
        node_id: other_node.to_owned(),
        lease_id: ours.lease_id.clone(),
        epoch: ours.epoch,
        key: "deps".into(),
        held_generations: Vec::new(),
    };
    let foreign = ledger.node(other_node).open_cache(request).await.unwrap_err();
    assert_eq!(foreign.code(), Code::PermissionDenied, "{foreign:?}");
    let bad = open(&ledger, &ours, "../deps", &[]).await.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument, "{bad:?}");

    // A bad mount is refused when the lease is asked for, naming it.
    let mut request = ask("bad", 100, 64 << 20);
    let mount = |key: &str, path: &str| CacheMount { key: key.into(), path: path.into(), commit: 0 };
    request.workload.as_mut().unwrap().cache = vec![mount("deps", "/cache"), mount("deps", "/other")];
    let refused = ledger.leases(0).request_lease(request).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(refused.message().contains("workload.cache: [1].key `deps` is mounted twice"), "{refused:?}");
    ledger.cleanup().await;
}

/// Runs one lease of `deps` from the head to DONE and publishes its view as
/// `sealed`; the generation it became.
async fn publish(ledger: &Ledger, name: &str, sealed: u8) -> u64 {
    let lease = place(ledger, name, "", "deps", CacheCommit::OnSuccess).await;
    let base = open(ledger, &lease, "deps", &[]).await.unwrap().head.unwrap().generation;
    end(ledger, &lease, LeasePhase::Done).await;
    let outcome = commit(ledger, &lease, base, sealed).await.unwrap();
    assert!(outcome.committed, "{outcome:?}");
    outcome.observation.unwrap().committed_generation
}

fn caches(ledger: &Ledger) -> v1::caches_client::CachesClient<berth_rpc::Channel> {
    v1::caches_client::CachesClient::new(ledger.admin_channel(0))
}

fn named(generation: u64) -> (String, String, u64) {
    (String::new(), "deps".to_owned(), generation)
}

async fn operators_roll_back_pin_collect_and_delete_volumes_and_turn_a_project_off(backend: Backend) {
    let ledger = Ledger::start(backend, LeasesConfig { cache_keep: 2, ..fast_config() }, nodes()).await;
    let mut caches = caches(&ledger);
    assert_eq!(publish(&ledger, "p1", 1).await, 1);
    assert_eq!(publish(&ledger, "p2", 2).await, 2);
    let (project, key, generation) = named(2);
    let pin = v1::PinCacheGenerationRequest { project, key, generation, pinned: true };
    assert!(caches.pin_cache_generation(pin).await.unwrap().into_inner().generation.unwrap().pinned);
    for n in 3..=5 {
        assert_eq!(publish(&ledger, &format!("p{n}"), n).await, u64::from(n));
    }
    // Kept: the head (5), the newest two others (4, 3) and the pinned one (2); 1 was collected.
    let get = v1::GetCacheRequest { project: String::new(), key: "deps".into() };
    let got = caches.get_cache(get.clone()).await.unwrap().into_inner();
    let kept: Vec<u64> = got.generations.iter().map(|g| g.generation).collect();
    assert_eq!(kept, [5, 4, 3, 2]);
    let volume = got.volume.unwrap();
    assert_eq!((volume.head.unwrap().generation, volume.generations, volume.enabled), (5, 4, true));
    assert_eq!(volume.size_bytes, [5, 4, 3, 2].iter().map(|n| 1000 + n).sum::<u64>());
    let listed = caches.list_caches(v1::ListCachesRequest::default()).await.unwrap().into_inner().volumes;
    assert_eq!(listed.iter().map(|v| v.key.as_str()).collect::<Vec<_>>(), ["deps"]);

    // A rollback: the next lease starts from 3, and publishes 6, never a reused number.
    let (project, key, generation) = named(3);
    caches.set_cache_head(v1::SetCacheHeadRequest { project, key, generation }).await.unwrap();
    let lease = place(&ledger, "after-rollback", "", "deps", CacheCommit::OnSuccess).await;
    let opened = open(&ledger, &lease, "deps", &[]).await.unwrap().head.unwrap();
    assert_eq!((opened.generation, opened.digest), (3, digest(3)));
    end(&ledger, &lease, LeasePhase::Done).await;
    assert_eq!(commit(&ledger, &lease, 3, 9).await.unwrap().observation.unwrap().committed_generation, 6);
    let (project, key, generation) = named(1);
    let gone = caches.set_cache_head(v1::SetCacheHeadRequest { project, key, generation }).await.unwrap_err();
    assert_eq!(gone.code(), Code::NotFound, "{gone:?}");
    assert!(gone.message().contains("generation 1 of cache volume default/deps"), "{gone:?}");

    // Turned off: a lease gets nothing and publishes nothing, at once.
    let off = v1::SetProjectCachingRequest { project: String::new(), enabled: false };
    caches.set_project_caching(off).await.unwrap();
    let lease = place(&ledger, "while-off", "", "deps", CacheCommit::OnSuccess).await;
    let opened = open(&ledger, &lease, "deps", &[6]).await.unwrap();
    assert_eq!(opened.head.unwrap().generation, 0);
    assert_eq!(opened.observation.unwrap().reason, "CacheDisabled");
    end(&ledger, &lease, LeasePhase::Done).await;
    assert!(!commit(&ledger, &lease, 0, 10).await.unwrap().committed);
    assert!(!caches.get_cache(get.clone()).await.unwrap().into_inner().volume.unwrap().enabled);
    let on = v1::SetProjectCachingRequest { project: String::new(), enabled: true };
    caches.set_project_caching(on).await.unwrap();

    // Deleted: gone from the list, and the next lease starts empty at a new number.
    let delete = v1::DeleteCacheRequest { project: String::new(), key: "deps".into() };
    caches.delete_cache(delete).await.unwrap();
    assert_eq!(caches.get_cache(get).await.unwrap_err().code(), Code::NotFound);
    assert!(caches.list_caches(v1::ListCachesRequest::default()).await.unwrap().into_inner().volumes.is_empty());
    assert_eq!(publish(&ledger, "after-delete", 11).await, 7);

    // Bad names are refused, naming the field.
    let bad = v1::GetCacheRequest { project: String::new(), key: "../deps".into() };
    let refused = caches.get_cache(bad).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(refused.message().contains("key"), "{refused:?}");
    ledger.cleanup().await;
}

async fn a_node_is_told_the_cache_registry_and_each_generation_keeps_its_artifact(backend: Backend) {
    let registry = berth_leases::CacheRegistryConfig {
        repository: "registry.internal:5000/caches/".into(),
        username: "nodes".into(),
        password: "s3cret".into(),
    };
    let config = LeasesConfig { cache_registry: Some(registry), ..fast_config() };
    let ledger = Ledger::start(backend, config, nodes()).await;
    let lease = place(&ledger, "pushed", "team-a", "deps", CacheCommit::OnSuccess).await;
    let told = open(&ledger, &lease, "deps", &[]).await.unwrap().registry.unwrap();
    assert_eq!(
        (told.repository.as_str(), told.username.as_str(), told.password.as_str()),
        ("registry.internal:5000/caches/team-a", "nodes", "s3cret"),
        "one repository per project"
    );
    end(&ledger, &lease, LeasePhase::Done).await;
    let mut request = v1::CommitCacheRequest {
        node_id: lease.node_id.clone(),
        lease_id: lease.lease_id.clone(),
        epoch: lease.epoch,
        key: "deps".to_owned(),
        base_generation: 0,
        skip_reason: "SealFailed".to_owned(),
        artifact: digest(9),
        ..Default::default()
    };
    let orphan = ledger.node(&lease.node_id).commit_cache(request.clone()).await.unwrap_err();
    assert_eq!(orphan.code(), Code::InvalidArgument, "an artifact without a sealed view: {orphan:?}");
    assert!(orphan.message().contains("artifact"), "{orphan:?}");
    request.skip_reason.clear();
    request.digest = digest(1);
    request.artifact = "latest".to_owned();
    let bad = ledger.node(&lease.node_id).commit_cache(request.clone()).await.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument, "{bad:?}");
    request.artifact = digest(9);
    let head = ledger.node(&lease.node_id).commit_cache(request).await.unwrap().into_inner().head.unwrap();
    assert_eq!((head.generation, head.artifact.as_str()), (1, digest(9).as_str()));

    // The next lease of the volume is told where generation 1 is, on any node.
    let next = place(&ledger, "next", "team-a", "deps", CacheCommit::OnSuccess).await;
    let opened = open(&ledger, &next, "deps", &[]).await.unwrap();
    assert_eq!(opened.head.unwrap().artifact, digest(9));
    assert!(opened.registry.is_some());
    let request = v1::GetCacheRequest { project: "team-a".into(), key: "deps".into() };
    let kept = caches(&ledger).get_cache(request).await.unwrap().into_inner();
    assert_eq!(kept.generations[0].artifact, digest(9));

    // A project whose caching is off is told no registry: its views publish nothing.
    let request = v1::SetProjectCachingRequest { project: "team-a".into(), enabled: false };
    caches(&ledger).set_project_caching(request).await.unwrap();
    let off = place(&ledger, "off", "team-a", "deps", CacheCommit::OnSuccess).await;
    assert!(open(&ledger, &off, "deps", &[]).await.unwrap().registry.is_none());
    ledger.cleanup().await;
}

async fn a_project_over_its_budget_loses_its_oldest_generations_never_a_head(backend: Backend) {
    let config = LeasesConfig { cache_project_budget: Some(2500), ..fast_config() };
    let ledger = Ledger::start(backend, config, nodes()).await;
    for sealed in 1..=4 {
        // Each is 1000 + n bytes: past the third, the budget takes the oldest.
        assert_eq!(publish(&ledger, &format!("l-{sealed}"), sealed).await, u64::from(sealed));
    }
    let request = v1::GetCacheRequest { project: String::new(), key: "deps".into() };
    let kept = caches(&ledger).get_cache(request).await.unwrap().into_inner();
    let numbers: Vec<u64> = kept.generations.iter().map(|g| g.generation).collect();
    assert_eq!(numbers, [4, 3], "under 2500 bytes, the head kept");
    assert_eq!(kept.volume.unwrap().size_bytes, 1003 + 1004);
    ledger.cleanup().await;
}

/// Places a lease that takes `cpu_millis` of whatever node is freest, and no volume.
async fn occupy(ledger: &Ledger, name: &str, cpu_millis: u64) -> v1::Lease {
    ledger.leases(0).request_lease(ask(name, cpu_millis, GIB)).await.unwrap().into_inner().lease.unwrap()
}

/// Runs a lease of `deps` to DONE and publishes `sealed` as pushed; its node.
async fn publish_pushed(ledger: &Ledger, name: &str, base: u64, sealed: u8) -> String {
    let lease = place(ledger, name, "", "deps", CacheCommit::OnSuccess).await;
    open(ledger, &lease, "deps", &[]).await.unwrap();
    end(ledger, &lease, LeasePhase::Done).await;
    let request = v1::CommitCacheRequest { artifact: digest(sealed + 100), ..commit_request(&lease, base, sealed) };
    let done = ledger.node(&lease.node_id).commit_cache(request).await.unwrap().into_inner();
    assert!(done.committed, "{done:?}");
    lease.node_id
}

async fn follow(ledger: &Ledger, node_id: &str, held: &[u64]) -> Result<Vec<v1::CacheToFollow>, tonic::Status> {
    let held = held
        .iter()
        .map(|&generation| v1::HeldCache { project: "default".into(), key: "deps".into(), generation })
        .collect();
    let request = v1::FollowCachesRequest { node_id: node_id.to_owned(), held };
    Ok(ledger.node(node_id).follow_caches(request).await?.into_inner().follow)
}

async fn a_second_node_follows_a_volumes_head_and_placement_prefers_either_holder(backend: Backend) {
    let registry = berth_leases::CacheRegistryConfig {
        repository: "registry.internal:5000/caches".into(),
        username: String::new(),
        password: String::new(),
    };
    let config = LeasesConfig { cache_registry: Some(registry), ..fast_config() };
    let mut fleet = nodes();
    let mut third = fleet[0].clone();
    third.node_id = "n-3".into();
    fleet.push(third);
    let ledger = Ledger::start(backend, config, fleet).await;

    // Generation 1 is sealed on n-1; nobody follows a volume only one node has published.
    assert_eq!(publish_pushed(&ledger, "one", 0, 1).await, "n-1");
    assert!(follow(&ledger, "n-1", &[1]).await.unwrap().is_empty());
    // n-1 full: generation 2 is sealed on another node from generation 1, and n-1 follows it.
    let blocker = occupy(&ledger, "blocker", 4000).await;
    assert_eq!(blocker.node_id, "n-1");
    let sealer = publish_pushed(&ledger, "two", 1, 2).await;
    assert_eq!(sealer, "n-2", "the freest node with room, by id");
    assert!(follow(&ledger, "n-3", &[]).await.unwrap().is_empty(), "only the follower is asked");
    let asked = follow(&ledger, "n-1", &[1]).await.unwrap();
    assert_eq!(asked.len(), 1, "{asked:?}");
    let head = asked[0].head.clone().unwrap();
    assert_eq!((head.generation, head.node_id.as_str(), head.artifact.clone()), (2, "n-2", digest(102)));
    assert_eq!(asked[0].registry.as_ref().unwrap().repository, "registry.internal:5000/caches/default");
    let from = asked[0].held.clone().unwrap();
    assert_eq!((from.generation, from.artifact), (1, digest(101)), "what it holds, for the pull to start from");
    // Once it reports holding the head it is asked for nothing, and shown as holding it.
    assert!(follow(&ledger, "n-1", &[2]).await.unwrap().is_empty());
    let request = v1::GetCacheRequest { project: String::new(), key: "deps".into() };
    let got = caches(&ledger).get_cache(request).await.unwrap().into_inner();
    assert_eq!(got.volume.unwrap().head.unwrap().held_by, ["n-1"]);

    // The sealer full and the follower less free than n-3: the next lease still goes to the follower.
    let release = |lease: v1::Lease| v1::ReleaseLeaseRequest { lease_id: lease.lease_id, ..Default::default() };
    ledger.leases(0).release_lease(release(blocker)).await.unwrap();
    let on_first = occupy(&ledger, "on-first", 4000).await;
    assert_eq!(occupy(&ledger, "on-sealer", 4000).await.node_id, "n-2");
    ledger.leases(0).release_lease(release(on_first)).await.unwrap();
    assert_eq!(occupy(&ledger, "small", 500).await.node_id, "n-1");
    let next = place(&ledger, "three", "", "deps", CacheCommit::OnSuccess).await;
    assert_eq!(next.node_id, "n-1", "a node holding the head is preferred over a freer one");
    let opened = open(&ledger, &next, "deps", &[2]).await.unwrap();
    assert_eq!(opened.observation.unwrap().outcome(), CacheOutcome::Hit);
    assert!(opened.held.is_none(), "a hit pulls nothing");
    // A node holding only an older generation misses, and is told which to pull from.
    let behind = place(&ledger, "behind", "", "deps", CacheCommit::OnSuccess).await;
    let opened = open(&ledger, &behind, "deps", &[1]).await.unwrap();
    assert_eq!(opened.observation.unwrap().outcome(), CacheOutcome::Miss);
    let from = opened.held.unwrap();
    assert_eq!((from.generation, from.artifact), (1, digest(101)));

    // A report must name real volumes and generations, and only for the caller's own node.
    let bad = v1::FollowCachesRequest {
        node_id: "n-1".into(),
        held: vec![v1::HeldCache { project: "default".into(), key: "deps".into(), generation: 0 }],
    };
    let refused = ledger.node("n-1").follow_caches(bad).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(refused.message().contains("held.generation"), "{refused:?}");
    let theirs = v1::FollowCachesRequest { node_id: "n-2".into(), held: Vec::new() };
    assert_eq!(ledger.node("n-1").follow_caches(theirs).await.unwrap_err().code(), Code::PermissionDenied);
    ledger.cleanup().await;
}

on_both_backends!(
    a_second_node_follows_a_volumes_head_and_placement_prefers_either_holder,
    a_project_over_its_budget_loses_its_oldest_generations_never_a_head,
    a_node_is_told_the_cache_registry_and_each_generation_keeps_its_artifact,
    a_view_is_published_only_when_its_workload_succeeded,
    of_two_leases_started_from_one_head_exactly_one_publishes,
    a_lease_reaches_only_the_volumes_its_workload_names_in_its_project,
    operators_roll_back_pin_collect_and_delete_volumes_and_turn_a_project_off,
);
