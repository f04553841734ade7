//! Container images the tests build themselves, since no public registry is
//! reachable from a test: layers made of tar entries (Debian's static
//! `busybox` as the base), an image config, and a push of the whole image to
//! a registry as an OCI image manifest.

use std::io::{self, Write as _};
use std::path::Path;

use crate::client::{BundleClient, RegistryCredentials};
use crate::digest::Digest;
use crate::format::{Descriptor, LAYER_TAR_GZIP_MEDIA_TYPE, OCI_MANIFEST_MEDIA_TYPE};
use crate::reference::BundleReference;
use crate::registry_error::RegistryError;

/// Where Debian's `busybox-static` puts its binary.
pub const BUSYBOX: &str = "/bin/busybox";

/// The media type of an OCI image config.
const IMAGE_CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";

/// One layer, built entry by entry.
pub struct Layer {
    builder: tar::Builder<Vec<u8>>,
    /// The uid and gid of the entries added next.
    owner: (u64, u64),
}

impl std::fmt::Debug for Layer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Layer")
    }
}

impl Default for Layer {
    fn default() -> Self {
        Self::new()
    }
}

impl Layer {
    /// An empty layer.
    pub fn new() -> Self {
        Self { builder: tar::Builder::new(Vec::new()), owner: (0, 0) }
    }

    /// The entries added from now on belong to `uid`:`gid` (root's until this).
    pub fn owned_by(mut self, uid: u64, gid: u64) -> Self {
        self.owner = (uid, gid);
        self
    }

    /// A layer holding `/bin/busybox` from the host and `/bin/NAME` links to
    /// it for each of `applets`, plus an empty world-writable `/tmp`.
    pub fn busybox(applets: &[&str]) -> io::Result<Self> {
        let binary = std::fs::read(BUSYBOX)?;
        let mut layer = Self::new().dir("bin", 0o755).dir("tmp", 0o1777).file("bin/busybox", &binary, 0o755);
        for applet in applets {
            layer = layer.symlink(&format!("bin/{applet}"), "busybox");
        }
        Ok(layer)
    }

    fn header(&self, kind: tar::EntryType, path: &str, size: u64, mode: u32) -> tar::Header {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(kind);
        header.set_size(size);
        header.set_mode(mode);
        header.set_mtime(0);
        header.set_uid(self.owner.0);
        header.set_gid(self.owner.1);
        // Names are set raw so a test can write what a hostile image would.
        let name = path.as_bytes();
        let field = &mut header.as_old_mut().name;
        let len = name.len().min(field.len());
        field[..len].copy_from_slice(&name[..len]);
        header.set_cksum();
        header
    }

    /// A directory.
    pub fn dir(mut self, path: &str, mode: u32) -> Self {
        let header = self.header(tar::EntryType::Directory, path, 0, mode);
        self.builder.append(&header, io::empty()).unwrap_or_default();
        self
    }

    /// A regular file.
    pub fn file(mut self, path: &str, body: &[u8], mode: u32) -> Self {
        let header = self.header(tar::EntryType::Regular, path, body.len() as u64, mode);
        self.builder.append(&header, body).unwrap_or_default();
        self
    }

    /// A symbolic link to `target`.
    pub fn symlink(mut self, path: &str, target: &str) -> Self {
        let mut header = self.header(tar::EntryType::Symlink, path, 0, 0o777);
        header.set_link_name(target).unwrap_or_default();
        header.set_cksum();
        self.builder.append(&header, io::empty()).unwrap_or_default();
        self
    }

    /// A whiteout removing `path` of the layers below.
    pub fn whiteout(self, path: &str) -> Self {
        let (dir, name) = path.rsplit_once('/').map_or(("", path), |(d, n)| (d, n));
        let marker = if dir.is_empty() { format!(".wh.{name}") } else { format!("{dir}/.wh.{name}") };
        self.file(&marker, b"", 0o644)
    }

    /// The layer as a gzip'd tar.
    pub fn finish(self) -> io::Result<Vec<u8>> {
        let tar = self.builder.into_inner()?;
        let mut gzip = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gzip.write_all(&tar)?;
        gzip.finish()
    }
}

/// A whole image: its config and its gzip'd layers, bottom first.
#[derive(Debug, Clone)]
pub struct TestImage {
    config: Vec<u8>,
    layers: Vec<Vec<u8>>,
}

impl TestImage {
    /// An image for linux/this machine running `entrypoint` then `cmd`,
    /// with `env` (`NAME=value`) and `working_dir`.
    pub fn new(entrypoint: &[&str], cmd: &[&str], env: &[&str], working_dir: &str) -> Self {
        Self::as_user(entrypoint, cmd, env, working_dir, "")
    }

    /// [`Self::new`], whose config's `User` is `user`.
    pub fn as_user(entrypoint: &[&str], cmd: &[&str], env: &[&str], working_dir: &str, user: &str) -> Self {
        let architecture = match std::env::consts::ARCH {
            "x86_64" => "amd64",
            "aarch64" => "arm64",
            other => other,
        };
        let config = serde_json::json!({
            "architecture": architecture,
            "os": "linux",
            "config": {"Entrypoint": entrypoint, "Cmd": cmd, "Env": env, "WorkingDir": working_dir, "User": user},
            "rootfs": {"type": "layers", "diff_ids": []},
        });
        Self { config: config.to_string().into_bytes(), layers: Vec::new() }
    }

    /// The image with `layer` on top.
    pub fn layer(mut self, layer: Layer) -> io::Result<Self> {
        self.layers.push(layer.finish()?);
        Ok(self)
    }

    /// The image with raw, already gzip'd layer bytes on top.
    pub fn raw_layer(mut self, gzip: Vec<u8>) -> Self {
        self.layers.push(gzip);
        self
    }

    /// The manifest, and every blob it names.
    fn assemble(&self) -> (Vec<u8>, Vec<(Descriptor, Vec<u8>)>) {
        let config = Descriptor::of(IMAGE_CONFIG_MEDIA_TYPE, &self.config);
        let mut blobs = vec![(config.clone(), self.config.clone())];
        let layers: Vec<Descriptor> =
            self.layers.iter().map(|bytes| Descriptor::of(LAYER_TAR_GZIP_MEDIA_TYPE, bytes)).collect();
        blobs.extend(layers.iter().cloned().zip(self.layers.iter().cloned()));
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST_MEDIA_TYPE,
            "config": config,
            "layers": layers,
        });
        (manifest.to_string().into_bytes(), blobs)
    }

    /// The manifest digest the image will have.
    pub fn digest(&self) -> Digest {
        Digest::of(&self.assemble().0)
    }

    /// Pushes the image to `reference` (`host/repo:tag`, a registry), and
    /// returns its manifest digest.
    pub async fn push(
        &self,
        client: &BundleClient,
        reference: &str,
        credentials: &RegistryCredentials,
    ) -> Result<Digest, RegistryError> {
        let parsed = BundleReference::parse(reference)
            .map_err(|e| RegistryError::InvalidReference { reference: reference.to_owned(), reason: e.to_string() })?;
        let BundleReference::Registry(registry) = parsed else {
            return Err(RegistryError::InvalidReference {
                reference: reference.to_owned(),
                reason: "test images are pushed to registries only".to_owned(),
            });
        };
        let (manifest, blobs) = self.assemble();
        let borrowed: Vec<(&Descriptor, &[u8])> = blobs.iter().map(|(d, b)| (d, b.as_slice())).collect();
        client.push_to_registry(&registry, &borrowed, &manifest, credentials).await?;
        Ok(Digest::of(&manifest))
    }
}

/// Whether the host has the busybox these images are built from.
pub fn busybox_present() -> bool {
    Path::new(BUSYBOX).is_file()
}
