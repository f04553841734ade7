//! The bundle as an OCI artifact: an OCI image manifest whose `artifactType` is
//! [`BUNDLE_ARTIFACT_TYPE`], a JSON config blob ([`BundleConfig`]) and exactly one layer, a
//! tar (gzip'd or plain) of the bundle directory.
//!
//! # Why one tar layer
//! A single tar layer works with every registry and every tool that copies OCI artifacts
//! (oras, skopeo, crane) and extracts in one pass. The per-file view lives in the config's
//! module list (each regular file's path, digest and size), which the cache checks after
//! extraction, so nothing is lost by not giving each module a layer of its own.
//!
//! # Invariants
//! What [`BundleManifest::parse`] and [`BundleConfig::parse`] return came from bytes no
//! larger than [`MAX_MANIFEST_BYTES`] / [`MAX_CONFIG_BYTES`] and is a berth bundle: the
//! config's media type is [`BUNDLE_CONFIG_MEDIA_TYPE`], `artifactType` is unset or
//! [`BUNDLE_ARTIFACT_TYPE`], there is exactly one layer of a tar media type, every digest
//! is a well-formed sha256, and the run definition passes [`crate::spec::validate`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::digest::Digest;
use crate::spec::{self, BundlePort, BundleSpec, SpecError};

/// The `artifactType` of a bundle's manifest.
pub const BUNDLE_ARTIFACT_TYPE: &str = "application/vnd.berth.bundle.v1";
/// The media type of a bundle's config blob.
pub const BUNDLE_CONFIG_MEDIA_TYPE: &str = "application/vnd.berth.bundle.config.v1+json";
/// The media type of an OCI image manifest.
pub const OCI_MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
/// The media type of an OCI image index (a layout's `index.json`).
pub const OCI_INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";
/// The media type of the gzip'd tar layer `berth bundle push` writes.
pub const LAYER_TAR_GZIP_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
/// The media type of a plain tar layer, which the cache also accepts.
pub const LAYER_TAR_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar";
/// The annotation that carries a tag in an OCI layout's `index.json`.
pub const REF_NAME_ANNOTATION: &str = "org.opencontainers.image.ref.name";

/// The largest manifest read; real ones are a few hundred bytes.
pub const MAX_MANIFEST_BYTES: u64 = 4 << 20;
/// The largest config blob read; its module list grows with the file count.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// Why a manifest or config is not a bundle berth can use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// The bytes are not JSON of the expected shape.
    #[error("the {what} is not valid JSON of the expected shape: {reason}")]
    Json {
        /// `manifest` or `config`.
        what: &'static str,
        /// What the parser said.
        reason: String,
    },
    /// The manifest is an OCI manifest but not of a berth bundle.
    #[error("not a berth bundle: {0}")]
    NotABundle(String),
    /// The config's run definition or module list breaks a rule.
    #[error("the bundle config is invalid: {0}")]
    Config(#[source] SpecError),
    /// The manifest, index or config is not of a container image this node can run.
    #[error("not a runnable container image: {0}")]
    NotAnImage(String),
}

/// A content descriptor: what a manifest or index says about a blob.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    /// The blob's media type.
    pub media_type: String,
    /// The blob's digest.
    pub digest: Digest,
    /// The blob's size in bytes.
    pub size: u64,
    /// The artifact type of the manifest this descriptor points to, in an index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_type: Option<String>,
    /// Annotations, e.g. the tag of an index entry.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

impl Descriptor {
    /// A descriptor of `bytes`.
    pub(crate) fn of(media_type: &str, bytes: &[u8]) -> Self {
        Self {
            media_type: media_type.to_owned(),
            digest: Digest::of(bytes),
            size: bytes.len() as u64,
            artifact_type: None,
            annotations: BTreeMap::new(),
        }
    }
}

/// A bundle's manifest: an OCI image manifest with one tar layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BundleManifest {
    /// Always 2.
    pub schema_version: u32,
    /// [`OCI_MANIFEST_MEDIA_TYPE`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    /// [`BUNDLE_ARTIFACT_TYPE`] for bundles berth wrote.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_type: Option<String>,
    /// The config blob.
    pub config: Descriptor,
    /// The one tar layer.
    pub layers: Vec<Descriptor>,
    /// Annotations, unused by berth.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

impl BundleManifest {
    /// The manifest of a bundle with this config and layer.
    pub(crate) fn new(config: Descriptor, layer: Descriptor) -> Self {
        Self {
            schema_version: 2,
            media_type: Some(OCI_MANIFEST_MEDIA_TYPE.to_owned()),
            artifact_type: Some(BUNDLE_ARTIFACT_TYPE.to_owned()),
            config,
            layers: vec![layer],
            annotations: BTreeMap::new(),
        }
    }

    /// Parses and checks a manifest fetched from anywhere.
    pub fn parse(bytes: &[u8]) -> Result<Self, FormatError> {
        if bytes.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(FormatError::NotABundle(format!("the manifest is larger than {MAX_MANIFEST_BYTES} bytes")));
        }
        let manifest: Self =
            serde_json::from_slice(bytes).map_err(|e| FormatError::Json { what: "manifest", reason: e.to_string() })?;
        if manifest.schema_version != 2 {
            return Err(FormatError::NotABundle(format!("schemaVersion is {}, not 2", manifest.schema_version)));
        }
        if let Some(media_type) = &manifest.media_type
            && media_type != OCI_MANIFEST_MEDIA_TYPE
        {
            return Err(FormatError::NotABundle(format!("the manifest's media type is {media_type}")));
        }
        if let Some(artifact_type) = &manifest.artifact_type
            && artifact_type != BUNDLE_ARTIFACT_TYPE
        {
            return Err(FormatError::NotABundle(format!(
                "artifactType is {artifact_type}, not {BUNDLE_ARTIFACT_TYPE}"
            )));
        }
        if manifest.config.media_type != BUNDLE_CONFIG_MEDIA_TYPE {
            return Err(FormatError::NotABundle(format!(
                "the config's media type is {}, not {BUNDLE_CONFIG_MEDIA_TYPE}",
                manifest.config.media_type
            )));
        }
        if manifest.config.size > MAX_CONFIG_BYTES {
            return Err(FormatError::NotABundle(format!(
                "the config is {} bytes, more than the {MAX_CONFIG_BYTES} allowed",
                manifest.config.size
            )));
        }
        match manifest.layers.as_slice() {
            [layer] if is_tar_layer(&layer.media_type) => Ok(manifest),
            [layer] => {
                Err(FormatError::NotABundle(format!("the layer's media type is {}, not a tar", layer.media_type)))
            }
            layers => Err(FormatError::NotABundle(format!("{} layers; a bundle has exactly one", layers.len()))),
        }
    }

    /// The one tar layer (present in every manifest [`Self::parse`] accepted).
    pub fn layer(&self) -> Option<&Descriptor> {
        self.layers.first()
    }

    /// The manifest's bytes as stored and hashed.
    pub(crate) fn to_bytes(&self) -> Vec<u8> {
        // Serializing plain structs and maps to a Vec cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// Whether a layer media type is one the cache can extract.
pub(crate) fn is_tar_layer(media_type: &str) -> bool {
    media_type == LAYER_TAR_GZIP_MEDIA_TYPE || media_type == LAYER_TAR_MEDIA_TYPE
}

/// A regular file in the bundle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BundleModule {
    /// The path inside the bundle, `/`-separated.
    pub path: String,
    /// The file's digest.
    pub digest: Digest,
    /// The file's size in bytes.
    pub size: u64,
}

/// A bundle's config blob: how to run it and what files it holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BundleConfig {
    /// The program: a path inside the bundle, or an absolute path on the node.
    pub entrypoint: String,
    /// Arguments passed to the program.
    #[serde(default)]
    pub args: Vec<String>,
    /// Environment variables for the program.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// The ports the program listens on.
    #[serde(default)]
    pub ports: Vec<BundlePort>,
    /// Every regular file in the bundle, sorted by path.
    #[serde(default)]
    pub modules: Vec<BundleModule>,
}

impl BundleConfig {
    /// The config of a bundle run as `spec`, holding `modules`.
    pub(crate) fn new(spec: BundleSpec, modules: Vec<BundleModule>) -> Self {
        Self { entrypoint: spec.entrypoint, args: spec.args, env: spec.env, ports: spec.ports, modules }
    }

    /// Parses and checks a config fetched from anywhere.
    pub fn parse(bytes: &[u8]) -> Result<Self, FormatError> {
        if bytes.len() as u64 > MAX_CONFIG_BYTES {
            return Err(FormatError::NotABundle(format!("the config is larger than {MAX_CONFIG_BYTES} bytes")));
        }
        let config: Self =
            serde_json::from_slice(bytes).map_err(|e| FormatError::Json { what: "config", reason: e.to_string() })?;
        spec::validate(&config.spec()).map_err(FormatError::Config)?;
        let mut seen = std::collections::BTreeSet::new();
        for (i, module) in config.modules.iter().enumerate() {
            if !spec::is_bundle_path(&module.path) {
                return Err(FormatError::Config(SpecError::Invalid {
                    field: format!("modules[{i}].path"),
                    reason: format!("`{}` is not a plain relative path", module.path),
                }));
            }
            if !seen.insert(module.path.as_str()) {
                return Err(FormatError::Config(SpecError::Invalid {
                    field: format!("modules[{i}].path"),
                    reason: format!("`{}` is listed twice", module.path),
                }));
            }
        }
        Ok(config)
    }

    /// The run definition part.
    pub fn spec(&self) -> BundleSpec {
        BundleSpec {
            entrypoint: self.entrypoint.clone(),
            args: self.args.clone(),
            env: self.env.clone(),
            ports: self.ports.clone(),
        }
    }

    /// The config's bytes as stored and hashed.
    pub(crate) fn to_bytes(&self) -> Vec<u8> {
        // Serializing plain structs and maps to a Vec cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// An OCI image index, as a layout's `index.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ImageIndex {
    pub(crate) schema_version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) media_type: Option<String>,
    #[serde(default)]
    pub(crate) manifests: Vec<Descriptor>,
    /// Whatever else another tool wrote, kept when the index is rewritten.
    #[serde(flatten)]
    pub(crate) other: BTreeMap<String, serde_json::Value>,
}

impl Default for ImageIndex {
    fn default() -> Self {
        Self {
            schema_version: 2,
            media_type: Some(OCI_INDEX_MEDIA_TYPE.to_owned()),
            manifests: Vec::new(),
            other: BTreeMap::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config_descriptor() -> Descriptor {
        Descriptor::of(BUNDLE_CONFIG_MEDIA_TYPE, b"{}")
    }

    #[test]
    fn a_written_manifest_parses_back() {
        let manifest = BundleManifest::new(config_descriptor(), Descriptor::of(LAYER_TAR_GZIP_MEDIA_TYPE, b"layer"));
        let parsed = BundleManifest::parse(&manifest.to_bytes()).unwrap();
        assert_eq!(parsed, manifest);
        let json: serde_json::Value = serde_json::from_slice(&manifest.to_bytes()).unwrap();
        assert_eq!(json["artifactType"], BUNDLE_ARTIFACT_TYPE);
        assert_eq!(json["mediaType"], OCI_MANIFEST_MEDIA_TYPE);
        assert_eq!(json["config"]["mediaType"], BUNDLE_CONFIG_MEDIA_TYPE);
    }

    #[test]
    fn container_images_and_multi_layer_manifests_are_not_bundles() {
        let mut image = BundleManifest::new(
            Descriptor::of("application/vnd.oci.image.config.v1+json", b"{}"),
            Descriptor::of(LAYER_TAR_GZIP_MEDIA_TYPE, b"layer"),
        );
        image.artifact_type = None;
        assert!(matches!(BundleManifest::parse(&image.to_bytes()), Err(FormatError::NotABundle(_))));

        let mut two = BundleManifest::new(config_descriptor(), Descriptor::of(LAYER_TAR_MEDIA_TYPE, b"a"));
        two.layers.push(Descriptor::of(LAYER_TAR_MEDIA_TYPE, b"b"));
        assert!(matches!(BundleManifest::parse(&two.to_bytes()), Err(FormatError::NotABundle(_))));

        let wasm = BundleManifest::new(config_descriptor(), Descriptor::of("application/wasm", b"a"));
        assert!(matches!(BundleManifest::parse(&wasm.to_bytes()), Err(FormatError::NotABundle(_))));
    }

    #[test]
    fn config_with_escaping_module_paths_is_refused() {
        let bad = concat!(
            r#"{"entrypoint":"app","modules":[{"path":"../../etc/passwd","#,
            r#""digest":"sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855","size":0}]}"#
        )
        .as_bytes();
        let Err(FormatError::Config(SpecError::Invalid { field, .. })) = BundleConfig::parse(bad) else {
            panic!("expected the module path to be refused");
        };
        assert_eq!(field, "modules[0].path");
    }

    #[test]
    fn index_keeps_fields_it_does_not_know() {
        let text = br#"{"schemaVersion":2,"manifests":[],"annotations":{"a":"b"}}"#;
        let index: ImageIndex = serde_json::from_slice(text).unwrap();
        let again: serde_json::Value = serde_json::to_value(&index).unwrap();
        assert_eq!(again["annotations"]["a"], "b");
    }
}
