//! Standard OCI container images as the node reads them: telling an image's
//! manifest from a berth bundle's, picking the node's platform out of an
//! image index, and reading what the image config says to run.
//!
//! # What is accepted
//! OCI image manifests and indexes, and their Docker schema 2 equivalents
//! (`application/vnd.docker.distribution.manifest.v2+json` and
//! `.list.v2+json`), which registries still serve for many images. Layers
//! must be tar, gzip'd tar, or their Docker names; zstd layers and
//! foreign layers are refused naming the layer. Schema 1 manifests are
//! refused.
//!
//! # What runs
//! [`ImageRun`] is the config's `Entrypoint`, `Cmd`, `Env`, `WorkingDir` and
//! `User`, as the image declares them; the node lays the lease's `command`,
//! `args` and `env` over them as Kubernetes does (`command` replaces the
//! Entrypoint, `args` the Cmd).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::format::{
    BUNDLE_ARTIFACT_TYPE, BUNDLE_CONFIG_MEDIA_TYPE, Descriptor, FormatError, LAYER_TAR_GZIP_MEDIA_TYPE,
    LAYER_TAR_MEDIA_TYPE, OCI_INDEX_MEDIA_TYPE, OCI_MANIFEST_MEDIA_TYPE,
};

/// Docker's schema 2 image manifest.
pub const DOCKER_MANIFEST_MEDIA_TYPE: &str = "application/vnd.docker.distribution.manifest.v2+json";
/// Docker's schema 2 manifest list (its image index).
pub const DOCKER_MANIFEST_LIST_MEDIA_TYPE: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
/// Docker's gzip'd layer.
pub const DOCKER_LAYER_GZIP_MEDIA_TYPE: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";
/// Docker's plain tar layer.
pub const DOCKER_LAYER_TAR_MEDIA_TYPE: &str = "application/vnd.docker.image.rootfs.diff.tar";

/// Every manifest kind a node asks a registry for.
pub(crate) const ACCEPTED_MANIFESTS: [&str; 4] =
    [OCI_MANIFEST_MEDIA_TYPE, OCI_INDEX_MEDIA_TYPE, DOCKER_MANIFEST_MEDIA_TYPE, DOCKER_MANIFEST_LIST_MEDIA_TYPE];

/// What a manifest digest names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ManifestKind {
    /// A berth bundle.
    Bundle,
    /// A container image's manifest.
    Image(ImageManifest),
    /// An index of per-platform image manifests.
    Index(Vec<Descriptor>),
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct AnyManifest {
    schema_version: u32,
    #[serde(default)]
    media_type: Option<String>,
    #[serde(default)]
    artifact_type: Option<String>,
    #[serde(default)]
    config: Option<Descriptor>,
    #[serde(default)]
    layers: Option<Vec<Descriptor>>,
    #[serde(default)]
    manifests: Option<Vec<IndexEntry>>,
}

#[derive(Debug, Deserialize)]
struct IndexEntry {
    #[serde(flatten)]
    descriptor: Descriptor,
    #[serde(default)]
    platform: Option<Platform>,
}

#[derive(Debug, Deserialize)]
struct Platform {
    architecture: String,
    os: String,
}

/// A container image's manifest: its config and its layers, bottom first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ImageManifest {
    /// The image config blob.
    pub(crate) config: Descriptor,
    /// The layers, applied in order.
    pub(crate) layers: Vec<Descriptor>,
}

fn not_an_image(reason: impl Into<String>) -> FormatError {
    FormatError::NotAnImage(reason.into())
}

/// Says what `bytes` (a verified manifest) is: a bundle, an image, or an
/// index; for an index, only the entries this node can run, best first.
pub(crate) fn classify(bytes: &[u8]) -> Result<ManifestKind, FormatError> {
    let manifest: AnyManifest =
        serde_json::from_slice(bytes).map_err(|e| FormatError::Json { what: "manifest", reason: e.to_string() })?;
    if manifest.schema_version != 2 {
        return Err(not_an_image(format!("schemaVersion is {}, not 2", manifest.schema_version)));
    }
    let bundle = manifest.artifact_type.as_deref() == Some(BUNDLE_ARTIFACT_TYPE)
        || manifest.config.as_ref().is_some_and(|c| c.media_type == BUNDLE_CONFIG_MEDIA_TYPE);
    if bundle {
        return Ok(ManifestKind::Bundle);
    }
    let media_type = manifest.media_type.as_deref().unwrap_or_default();
    if let Some(entries) = manifest.manifests {
        if !matches!(media_type, "" | OCI_INDEX_MEDIA_TYPE | DOCKER_MANIFEST_LIST_MEDIA_TYPE) {
            return Err(not_an_image(format!("an index of media type {media_type}")));
        }
        let (os, architecture) = node_platform();
        let runnable: Vec<Descriptor> = entries
            .into_iter()
            .filter(|entry| {
                entry.platform.as_ref().is_some_and(|p| p.os == os && p.architecture == architecture)
                    && matches!(
                        entry.descriptor.media_type.as_str(),
                        OCI_MANIFEST_MEDIA_TYPE | DOCKER_MANIFEST_MEDIA_TYPE
                    )
            })
            .map(|entry| entry.descriptor)
            .collect();
        if runnable.is_empty() {
            return Err(not_an_image(format!("the index has no image for {os}/{architecture}")));
        }
        return Ok(ManifestKind::Index(runnable));
    }
    if !matches!(media_type, "" | OCI_MANIFEST_MEDIA_TYPE | DOCKER_MANIFEST_MEDIA_TYPE) {
        return Err(not_an_image(format!("a manifest of media type {media_type}")));
    }
    let config = manifest.config.ok_or_else(|| not_an_image("the manifest has no config"))?;
    let layers = manifest.layers.unwrap_or_default();
    for layer in &layers {
        if !is_tar_layer(&layer.media_type) {
            return Err(not_an_image(format!(
                "layer {} has media type {}, which is not a tar or gzip'd tar layer",
                layer.digest, layer.media_type
            )));
        }
    }
    Ok(ManifestKind::Image(ImageManifest { config, layers }))
}

/// Whether a layer of `media_type` is one the unpacker reads.
fn is_tar_layer(media_type: &str) -> bool {
    matches!(
        media_type,
        LAYER_TAR_GZIP_MEDIA_TYPE | LAYER_TAR_MEDIA_TYPE | DOCKER_LAYER_GZIP_MEDIA_TYPE | DOCKER_LAYER_TAR_MEDIA_TYPE
    )
}

/// This node's platform in OCI's words.
fn node_platform() -> (&'static str, &'static str) {
    let architecture = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    };
    ("linux", architecture)
}

/// What an image config says to run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRun {
    /// `Entrypoint`: the program and its first arguments.
    pub entrypoint: Vec<String>,
    /// `Cmd`: arguments after the entrypoint, or the program when there is none.
    pub cmd: Vec<String>,
    /// `Env`, in order, as `NAME` → value.
    pub env: BTreeMap<String, String>,
    /// `WorkingDir`; empty means `/`.
    pub working_dir: String,
    /// `User`, as the image gives it (`name`, `uid`, `uid:gid`); empty means root.
    pub user: String,
    /// `user` as found in the image's unpacked root: what the image gives
    /// it. `None` for root, and until the image is unpacked.
    #[serde(skip)]
    pub account: Option<std::sync::Arc<crate::ImageUser>>,
    /// Who the image's layers say owns what, where not root: what another
    /// user than `user` is resolved against. Empty until unpacked.
    #[serde(skip)]
    pub owners: std::sync::Arc<crate::ImageOwners>,
}

#[derive(Debug, Deserialize)]
struct ImageConfigFile {
    #[serde(default)]
    os: Option<String>,
    #[serde(default)]
    config: Option<ImageConfigSection>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct ImageConfigSection {
    #[serde(default)]
    entrypoint: Option<Vec<String>>,
    #[serde(default)]
    cmd: Option<Vec<String>>,
    #[serde(default)]
    env: Option<Vec<String>>,
    #[serde(default)]
    working_dir: Option<String>,
    #[serde(default)]
    user: Option<String>,
}

impl ImageRun {
    /// Reads an image config blob.
    pub(crate) fn parse(bytes: &[u8]) -> Result<Self, FormatError> {
        let file: ImageConfigFile = serde_json::from_slice(bytes)
            .map_err(|e| FormatError::Json { what: "image config", reason: e.to_string() })?;
        if let Some(os) = &file.os
            && os != "linux"
        {
            return Err(not_an_image(format!("the image is for {os}, not linux")));
        }
        let config = file.config.unwrap_or_default();
        let mut env = BTreeMap::new();
        for pair in config.env.unwrap_or_default() {
            let (name, value) = pair.split_once('=').unwrap_or((pair.as_str(), ""));
            if name.is_empty() || name.contains('\0') || value.contains('\0') {
                return Err(not_an_image(format!("Env entry `{pair}` is not NAME=value")));
            }
            env.insert(name.to_owned(), value.to_owned());
        }
        let run = Self {
            entrypoint: config.entrypoint.unwrap_or_default(),
            cmd: config.cmd.unwrap_or_default(),
            env,
            working_dir: config.working_dir.unwrap_or_default(),
            user: config.user.unwrap_or_default(),
            account: None,
            owners: Default::default(),
        };
        if run.entrypoint.iter().chain(&run.cmd).chain([&run.working_dir, &run.user]).any(|s| s.contains('\0')) {
            return Err(not_an_image("the config holds a NUL byte"));
        }
        if !run.working_dir.is_empty() && !run.working_dir.starts_with('/') {
            return Err(not_an_image(format!("WorkingDir `{}` is not absolute", run.working_dir)));
        }
        Ok(run)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digest::Digest;

    fn descriptor(media_type: &str, body: &[u8]) -> serde_json::Value {
        let d = Descriptor::of(media_type, body);
        serde_json::json!({"mediaType": d.media_type, "digest": d.digest.to_string(), "size": d.size})
    }

    #[test]
    fn image_manifests_indexes_and_bundles_are_told_apart() {
        let image = serde_json::json!({
            "schemaVersion": 2, "mediaType": DOCKER_MANIFEST_MEDIA_TYPE,
            "config": descriptor("application/vnd.docker.container.image.v1+json", b"{}"),
            "layers": [descriptor(DOCKER_LAYER_GZIP_MEDIA_TYPE, b"a"), descriptor(LAYER_TAR_MEDIA_TYPE, b"b")],
        });
        let ManifestKind::Image(parsed) = classify(image.to_string().as_bytes()).unwrap() else {
            panic!("not an image")
        };
        assert_eq!(parsed.layers.len(), 2);
        assert_eq!(parsed.layers[0].digest, Digest::of(b"a"));

        let bundle = serde_json::json!({
            "schemaVersion": 2, "artifactType": BUNDLE_ARTIFACT_TYPE,
            "config": descriptor(BUNDLE_CONFIG_MEDIA_TYPE, b"{}"), "layers": [],
        });
        assert_eq!(classify(bundle.to_string().as_bytes()).unwrap(), ManifestKind::Bundle);

        let (os, arch) = node_platform();
        let mut ours = descriptor(OCI_MANIFEST_MEDIA_TYPE, b"ours");
        ours["platform"] = serde_json::json!({"os": os, "architecture": arch});
        let mut other = descriptor(OCI_MANIFEST_MEDIA_TYPE, b"other");
        other["platform"] = serde_json::json!({"os": "windows", "architecture": arch});
        let index =
            serde_json::json!({"schemaVersion": 2, "mediaType": OCI_INDEX_MEDIA_TYPE, "manifests": [other, ours]});
        let ManifestKind::Index(entries) = classify(index.to_string().as_bytes()).unwrap() else { panic!("no index") };
        assert_eq!(entries.iter().map(|d| d.digest.clone()).collect::<Vec<_>>(), vec![Digest::of(b"ours")]);

        let foreign = serde_json::json!({"schemaVersion": 2, "manifests": [other]});
        let error = classify(foreign.to_string().as_bytes()).unwrap_err().to_string();
        assert!(error.contains("no image for linux/"), "{error}");
    }

    #[test]
    fn zstd_layers_and_schema_one_are_refused_naming_what_is_wrong() {
        let zstd = serde_json::json!({
            "schemaVersion": 2, "config": descriptor("application/vnd.oci.image.config.v1+json", b"{}"),
            "layers": [descriptor("application/vnd.oci.image.layer.v1.tar+zstd", b"z")],
        });
        let error = classify(zstd.to_string().as_bytes()).unwrap_err().to_string();
        assert!(error.contains("tar+zstd") && error.contains(&Digest::of(b"z").to_string()), "{error}");
        let v1 = serde_json::json!({"schemaVersion": 1, "name": "x"});
        assert!(classify(v1.to_string().as_bytes()).unwrap_err().to_string().contains("schemaVersion is 1"));
    }

    #[test]
    fn the_config_gives_entrypoint_cmd_env_working_dir_and_user() {
        let config = serde_json::json!({
            "os": "linux", "architecture": "amd64",
            "config": {"Entrypoint": ["/bin/httpd", "-f"], "Cmd": ["-p", "8080"],
                       "Env": ["PATH=/bin", "EMPTY=", "A=b=c"], "WorkingDir": "/www", "User": "1000:1000"},
        });
        let run = ImageRun::parse(config.to_string().as_bytes()).unwrap();
        assert_eq!(run.entrypoint, ["/bin/httpd", "-f"]);
        assert_eq!(run.cmd, ["-p", "8080"]);
        assert_eq!(run.env["A"], "b=c");
        assert_eq!(run.env["EMPTY"], "");
        assert_eq!((run.working_dir.as_str(), run.user.as_str()), ("/www", "1000:1000"));

        let relative = serde_json::json!({"config": {"WorkingDir": "www"}});
        assert!(ImageRun::parse(relative.to_string().as_bytes()).unwrap_err().to_string().contains("WorkingDir"));
        let windows = serde_json::json!({"os": "windows"});
        assert!(ImageRun::parse(windows.to_string().as_bytes()).is_err());
    }
}
