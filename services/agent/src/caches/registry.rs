//! Moving sealed generations between a node and the cache registry: the
//! push after a seal, so that a node that does not hold a volume's head can
//! start a view from it, and the fetch that does so.
//!
//! # Invariants
//! - A fetched generation is used only once its unpacked tree's digest is
//!   the one the ledger recorded for it (never the artifact's own word), and
//!   it is recorded as held only then: a registry serving other content
//!   fails the fetch, and the lease's view starts empty.
//! - A fetch that starts from a generation the node holds links that tree's
//!   files into its scratch and lets the later layers replace them (a layer
//!   unpacks a file by removing what is at its path and writing a new one),
//!   so the sealed tree it started from is never written.
//! - A push reuses the layers of the generation the view started from when
//!   that one was pushed, stacks fewer than `MAX_CACHE_CHAIN` generations
//!   and the node holds its tree, adding one layer of what the lease
//!   changed; otherwise it packs the whole tree.
//! - The registry's credentials live in memory for one transfer; nothing of
//!   them is written to disk or logged.
//! - Transfers work in scratch directories under the volume's `staging/`,
//!   named by the lease, which the sweep removes once the lease is gone.

use berth_bundle::{
    BundleClient, BundleLimits, CacheConfig, Descriptor, Digest, MAX_CACHE_CHAIN, RegistryCredentials,
    pack_cache_layers,
};
use berth_proto::leases::v1::{CacheGeneration, CacheRegistry};

use super::{CacheError, CacheVolumes, Sealed, View};

/// The credentials `registry` names.
fn credentials(registry: &CacheRegistry) -> RegistryCredentials {
    if registry.username.is_empty() {
        RegistryCredentials::Anonymous
    } else {
        RegistryCredentials::Basic { username: registry.username.clone(), password: registry.password.clone() }
    }
}

fn registry_error(registry: &CacheRegistry, why: impl std::fmt::Display) -> CacheError {
    CacheError::Registry { repository: registry.repository.clone(), why: why.to_string() }
}

async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, CacheError> + Send + 'static,
) -> Result<T, CacheError> {
    tokio::task::spawn_blocking(work).await.map_err(|e| CacheError::Interrupted(e.to_string()))?
}

/// What a fetched generation may hold: bounded by the node's disk, not by
/// a bundle's limits.
const FETCH_LIMITS: BundleLimits =
    BundleLimits { max_total_bytes: 1 << 50, max_file_bytes: 1 << 50, max_entries: 50_000_000 };

/// One lease's transfers between the node's cache volumes and the registry.
#[derive(Debug, Clone, Copy)]
pub struct Transfer<'a> {
    /// The node's volumes.
    pub volumes: &'a CacheVolumes,
    /// What speaks to the registry.
    pub client: &'a BundleClient,
    /// Where, and with what credentials.
    pub registry: &'a CacheRegistry,
    /// The lease the transfer is for: its scratch directories are named by it.
    pub lease_id: &'a str,
}

/// A generation fetched and sealed: its tree, and how many of its
/// artifact's layers were pulled (fewer than all when it grew from one the
/// node held).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetched {
    pub sealed: Sealed,
    pub pulled_layers: usize,
    pub layers: usize,
}

impl Transfer<'_> {
    /// Pulls generation `head` of (project, key) from the registry and seals it
    /// on this node as that generation, for the lease's view to start from.
    /// With `from`, a generation of the volume this node holds whose
    /// artifact's layers begin the head's, the pull starts from its tree
    /// (linked, never written) and takes only the layers after them.
    pub async fn fetch(&self, head: &CacheGeneration, from: Option<&CacheGeneration>) -> Result<Fetched, CacheError> {
        let Self { volumes, client, registry, lease_id } = *self;
        let artifact: Digest = head.artifact.parse().map_err(|e| registry_error(registry, e))?;
        let (owned, lease, project, key) =
            (volumes.clone(), lease_id.to_owned(), head.project.clone(), head.key.clone());
        let scratch = blocking(move || owned.scratch(&lease, &project, &key, "fetch")).await?;
        let (layers, tree) = (scratch.join("layers"), scratch.join("tree"));
        let made = std::fs::create_dir(&layers).and_then(|()| std::fs::create_dir(&tree));
        let skip = match (&made, from) {
            (Ok(()), Some(from)) => self.start_from(head, &artifact, from, &tree).await,
            _ => 0,
        };
        let pulled = match made {
            Err(error) => Err(registry_error(registry, error)),
            Ok(()) => client
                .pull_cache_generation(
                    &registry.repository,
                    &artifact,
                    &credentials(registry),
                    &layers,
                    &tree,
                    &FETCH_LIMITS,
                    skip,
                )
                .await
                .map_err(|e| registry_error(registry, e)),
        };
        let mut layers_in_all = 0;
        let sealed = match pulled {
            Ok((_config, count)) => {
                layers_in_all = count;
                let (owned, lease, head_owned, tree_owned) =
                    (volumes.clone(), lease_id.to_owned(), head.clone(), tree.clone());
                blocking(move || {
                    let sealed = owned.adopt(&lease, &head_owned.project, &head_owned.key, &tree_owned, &head_owned)?;
                    owned.record(&head_owned.project, &head_owned.key, head_owned.generation, &sealed.digest)?;
                    Ok(sealed)
                })
                .await
            }
            Err(error) => Err(error),
        };
        let owned = volumes.clone();
        let _ = tokio::task::spawn_blocking(move || owned.drop_scratch(&scratch)).await;
        sealed.map(|sealed| Fetched {
            sealed,
            pulled_layers: layers_in_all.saturating_sub(skip),
            layers: layers_in_all,
        })
    }

    /// Lays `from`'s tree out at `tree` (linked) when its artifact's layers
    /// begin `head`'s, so the pull skips them: how many to skip. Anything
    /// that does not line up starts from nothing.
    async fn start_from(
        &self,
        head: &CacheGeneration,
        artifact: &Digest,
        from: &CacheGeneration,
        tree: &std::path::Path,
    ) -> usize {
        let Self { volumes, client, registry, lease_id } = *self;
        if from.generation >= head.generation || from.artifact.is_empty() {
            return 0;
        }
        let (Some((held_tree, _)), Ok(from_artifact)) =
            (volumes.sealed_tree(&head.project, &head.key, &from.digest), from.artifact.parse::<Digest>())
        else {
            return 0;
        };
        let credentials = credentials(registry);
        let (Ok((head_layers, _)), Ok((from_layers, _))) = (
            client.cache_generation(&registry.repository, artifact, &credentials).await,
            client.cache_generation(&registry.repository, &from_artifact, &credentials).await,
        ) else {
            return 0;
        };
        if from_layers.is_empty() || !head_layers.starts_with(&from_layers) || from_layers.len() == head_layers.len() {
            return 0;
        }
        let (target, skip) = (tree.to_path_buf(), from_layers.len());
        let linked = blocking(move || {
            super::link_tree(&held_tree, &target).inspect_err(|_| {
                // What was linked goes; the pull starts over in an empty tree.
                let _ = std::fs::remove_dir_all(&target).and_then(|()| std::fs::create_dir(&target));
            })
        })
        .await;
        match linked {
            Ok(()) => skip,
            Err(error) => {
                tracing::info!(%lease_id, key = %head.key, %error, "cannot start the fetch from the generation held");
                0
            }
        }
    }

    /// Pushes the sealed tree `sealed` of the lease's `view` of (project,
    /// `view.key`) to the registry, over the layers of `base` (the generation
    /// the view started from) when that was pushed and this node holds it. The
    /// artifact's digest.
    pub async fn push(
        &self,
        project: &str,
        view: &View,
        base: &CacheGeneration,
        sealed: &Sealed,
    ) -> Result<Digest, CacheError> {
        let Self { volumes, client, registry, lease_id } = *self;
        let credentials = credentials(registry);
        // The base's layers, when a delta over them is possible.
        let mut below: Vec<Descriptor> = Vec::new();
        let mut base_tree = None;
        let mut chain = 1;
        if view.based && base.generation > 0 && !base.artifact.is_empty() {
            let held = volumes.sealed_tree(project, &view.key, &base.digest);
            let artifact: Result<Digest, _> = base.artifact.parse();
            if let (Some(tree), Ok(artifact)) = (held, artifact) {
                match client.cache_generation(&registry.repository, &artifact, &credentials).await {
                    Ok((layers, config)) if config.chain < MAX_CACHE_CHAIN => {
                        below = layers;
                        base_tree = Some(tree);
                        chain = config.chain.max(1) + 1;
                    }
                    Ok(_) => {}
                    Err(error) => {
                        tracing::info!(%lease_id, key = %view.key, %error,
                        "cannot read the base generation's layers; pushing the whole volume");
                    }
                }
            }
        }
        let (tree, index) = volumes
            .sealed_tree(project, &view.key, &sealed.digest)
            .ok_or_else(|| registry_error(registry, format!("the sealed tree {} is gone", sealed.digest)))?;
        let (owned, lease, project_owned, key) =
            (volumes.clone(), lease_id.to_owned(), project.to_owned(), view.key.clone());
        let scratch = blocking(move || owned.scratch(&lease, &project_owned, &key, "push")).await?;
        let scratch_owned = scratch.clone();
        let packed = blocking(move || {
            let base_index = base_tree.as_ref().map(|(_, index)| index.clone()).unwrap_or_default();
            let same = |path: &str| index.get(path).is_some_and(|digest| base_index.get(path) == Some(digest));
            let base_path = base_tree.as_ref().map(|(tree, _)| tree.as_path());
            pack_cache_layers(&tree, base_path, &same, &scratch_owned)
                .map_err(|e| super::io("pack the layers of", &tree, e))
        })
        .await;
        let pushed = match packed {
            Ok(layers) => {
                let config = CacheConfig { tree_digest: sealed.digest.clone(), chain };
                client
                    .push_cache_generation(&registry.repository, &view.key, &below, &layers, &config, &credentials)
                    .await
                    .map_err(|e| registry_error(registry, e))
            }
            Err(error) => Err(error),
        };
        let owned = volumes.clone();
        let _ = tokio::task::spawn_blocking(move || owned.drop_scratch(&scratch)).await;
        pushed
    }
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use berth_bundle::RegistryConfig;
    use berth_bundle::testing::TestRegistry;

    use super::*;
    use crate::testdir::TestDir;

    /// A view of `dir` as it is, with nothing of an overlay to go by.
    fn plain_view(dir: &Path, base_generation: u64) -> View {
        View {
            key: "deps".into(),
            inside: "/cache".into(),
            merged: dir.to_path_buf(),
            lower: PathBuf::from("/nonexistent"),
            upper: PathBuf::from("/nonexistent"),
            base_generation,
            based: true,
            commit: 0,
        }
    }

    fn write(dir: &Path, files: &[(&str, &str)]) {
        for (path, text) in files {
            let path = dir.join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
    }

    #[tokio::test]
    async fn a_node_holding_the_generation_a_head_grew_from_pulls_only_the_layers_after_it() {
        let registry_process = TestRegistry::start().await.unwrap();
        let registry = CacheRegistry {
            repository: format!("{}/berth-caches/default", registry_process.host()),
            ..Default::default()
        };
        let client = BundleClient::new(RegistryConfig::default()).unwrap();
        let tmp = TestDir::new();
        let sealer = CacheVolumes::new(&tmp.path().join("sealer"));
        let transfer = |volumes| Transfer { volumes, client: &client, registry: &registry, lease_id: "l-1" };

        // Generation 1, pushed whole; generation 2 changes one file and adds one, pushed as a layer over it.
        let one_dir = tmp.path().join("one");
        write(&one_dir, &[("a.txt", "alpha"), ("lib/blob", "unchanged bytes")]);
        let one = sealer.seal("l-1", "default", &plain_view(&one_dir, 0)).unwrap();
        sealer.record("default", "deps", 1, &one.digest).unwrap();
        let artifact = transfer(&sealer)
            .push("default", &plain_view(&one_dir, 0), &CacheGeneration::default(), &one)
            .await
            .unwrap();
        let first = CacheGeneration {
            project: "default".into(),
            key: "deps".into(),
            generation: 1,
            digest: one.digest.clone(),
            artifact: artifact.to_string(),
            ..Default::default()
        };
        let two_dir = tmp.path().join("two");
        write(&two_dir, &[("a.txt", "beta"), ("lib/blob", "unchanged bytes"), ("new.txt", "gamma")]);
        let two = sealer.seal("l-2", "default", &plain_view(&two_dir, 1)).unwrap();
        let artifact = transfer(&sealer).push("default", &plain_view(&two_dir, 1), &first, &two).await.unwrap();
        let second = CacheGeneration {
            generation: 2,
            digest: two.digest.clone(),
            artifact: artifact.to_string(),
            ..first.clone()
        };

        // A node that held nothing pulls generation 1 whole; from it, generation 2 is one layer.
        let follower = CacheVolumes::new(&tmp.path().join("follower"));
        let whole = transfer(&follower).fetch(&first, None).await.unwrap();
        assert_eq!((whole.pulled_layers, whole.layers, whole.sealed.digest.as_str()), (1, 1, one.digest.as_str()));
        let grown = transfer(&follower).fetch(&second, Some(&first)).await.unwrap();
        assert_eq!((grown.pulled_layers, grown.layers), (1, 2), "only the layer generation 2 added");
        assert_eq!(grown.sealed.digest, two.digest, "the same content the sealer sealed");
        assert_eq!(follower.held("default", "deps"), [2, 1]);
        let tree = |digest: &str| follower.sealed_tree("default", "deps", digest).unwrap().0;
        assert_eq!(std::fs::read_to_string(tree(&two.digest).join("a.txt")).unwrap(), "beta");
        assert_eq!(
            std::fs::read_to_string(tree(&one.digest).join("a.txt")).unwrap(),
            "alpha",
            "the tree it grew from is untouched"
        );
        assert!(!tree(&one.digest).join("new.txt").exists());

        // A generation that does not stack on the one named is pulled whole.
        let unrelated = transfer(&follower).fetch(&first, Some(&second)).await;
        assert_eq!(unrelated.unwrap().pulled_layers, 1, "an older head starts from nothing");
    }
}
