//! Bundles: the OCI artifacts that carry a service's code. Packs a directory into one,
//! pushes it to a registry or an OCI layout directory, resolves tags to digests, and keeps
//! the node's verified, content-addressed cache of extracted bundles and of unpacked
//! standard OCI container images.
//!
//! # The artifact
//! An OCI image manifest with `artifactType` [`BUNDLE_ARTIFACT_TYPE`], a JSON config
//! ([`BundleConfig`], media type [`BUNDLE_CONFIG_MEDIA_TYPE`]: entrypoint, args, env, ports
//! and every file's path, digest and size) and one gzip'd tar layer of the directory.
//!
//! # Expected flow
//! `berth bundle push DIR REF` packs ([`PackedBundle::from_dir`]) and pushes
//! ([`BundleClient::push`]); the control plane resolves the tag once
//! ([`BundleClient::resolve`]) and records the digest; each node pulls that digest
//! ([`BundleCache::pull`]) and runs the [`BundleDefinition`] it gets back.

mod cache;
mod cache_artifact;
mod client;
mod digest;
mod extract;
mod format;
mod image;
mod image_user;
mod layout;
mod oci_image;
mod pack;
mod reference;
mod registry_error;
mod spec;
#[cfg(feature = "testing")]
pub mod test_image;
#[cfg(feature = "testing")]
pub mod testing;

pub use cache::{
    BundleCache, BundleDefinition, BundlePin, CacheError, CacheOptions, CacheUsage, DEFAULT_CACHE_BUDGET_BYTES,
    EvictionReport, ReadyBundle,
};
#[cfg(feature = "cli")]
mod flags;
pub use cache_artifact::{
    CACHE_ARTIFACT_TYPE, CACHE_CONFIG_MEDIA_TYPE, CACHE_LAYER_BYTES, CacheConfig, CachePullError, MAX_CACHE_CHAIN,
    PackedLayer, pack_cache_layers,
};
pub use client::{
    BundleClient, BundleInfo, DEFAULT_CONNECT_TIMEOUT, DEFAULT_READ_TIMEOUT, MIRROR_CONNECT_TIMEOUT,
    MIRROR_READ_TIMEOUT, MIRROR_RETRY_AFTER, RegistryConfig, RegistryCredentials, RegistryMirror,
};
pub use digest::{Digest, DigestError, SHA256_PREFIX};
pub use extract::{
    BundleLimits, ExtractError, ExtractStats, MAX_BUNDLE_BYTES, MAX_ENTRIES, MAX_FILE_BYTES, MAX_SYMLINK_HOPS,
    UnsafeEntry, extract_layer, extract_tar,
};
#[cfg(feature = "cli")]
pub use flags::RegistryArgs;
pub use format::{
    BUNDLE_ARTIFACT_TYPE, BUNDLE_CONFIG_MEDIA_TYPE, BundleConfig, BundleManifest, BundleModule, Descriptor,
    FormatError, LAYER_TAR_GZIP_MEDIA_TYPE, LAYER_TAR_MEDIA_TYPE, MAX_CONFIG_BYTES, MAX_MANIFEST_BYTES,
    OCI_INDEX_MEDIA_TYPE, OCI_MANIFEST_MEDIA_TYPE, REF_NAME_ANNOTATION,
};
pub use image::{unpack_image_layer, unpack_image_tar};
pub use image_user::{ImageOwners, ImageUser, OwnedPath};
pub use oci_image::{
    DOCKER_LAYER_GZIP_MEDIA_TYPE, DOCKER_LAYER_TAR_MEDIA_TYPE, DOCKER_MANIFEST_LIST_MEDIA_TYPE,
    DOCKER_MANIFEST_MEDIA_TYPE, ImageRun,
};
pub use pack::{PackError, PackedBundle};
pub use reference::{BundleReference, DEFAULT_TAG, LAYOUT_PREFIX, LayoutReference, ReferenceError, RegistryReference};
pub use registry_error::RegistryError;
pub use spec::{BundlePort, BundleSpec, SPEC_FILE, SpecError, validate};
