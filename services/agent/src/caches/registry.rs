//! Moving sealed generations between a node and the cache registry: the
//! push after a seal, so that a node that does not hold a volume's head can
//! start a view from it, and the fetch that does so.
//!
//! # Invariants
//! - A fetched generation is used only once its unpacked tree's digest is
//!   the one the ledger recorded for it (never the artifact's own word), and
//!   it is recorded as held only then: a registry serving other content
//!   fails the fetch, and the lease's view starts empty.
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

impl Transfer<'_> {
    /// Pulls generation `head` of (project, key) from the registry and seals it
    /// on this node as that generation, for the lease's view to start from.
    pub async fn fetch(&self, head: &CacheGeneration) -> Result<Sealed, CacheError> {
        let Self { volumes, client, registry, lease_id } = *self;
        let artifact: Digest = head.artifact.parse().map_err(|e| registry_error(registry, e))?;
        let (owned, lease, project, key) =
            (volumes.clone(), lease_id.to_owned(), head.project.clone(), head.key.clone());
        let scratch = blocking(move || owned.scratch(&lease, &project, &key, "fetch")).await?;
        let (layers, tree) = (scratch.join("layers"), scratch.join("tree"));
        let made = std::fs::create_dir(&layers).and_then(|()| std::fs::create_dir(&tree));
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
                )
                .await
                .map_err(|e| registry_error(registry, e)),
        };
        let sealed = match pulled {
            Ok(_config) => {
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
        sealed
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
