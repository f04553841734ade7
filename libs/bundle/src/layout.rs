//! OCI image-layout directories (`oci-layout`, `index.json`, `blobs/sha256/<hex>`), the
//! format skopeo, oras and crane read and write: a registry on disk, so `berth dev` can
//! deploy with no registry at all.
//!
//! # What is stored
//! Each blob once, under its digest; `index.json` lists manifests, a tag being the
//! `org.opencontainers.image.ref.name` annotation of an entry. Writing a tag that exists
//! moves it: the old entry is dropped, its blobs stay.
//!
//! # Who writes this
//! One writer at a time per directory. Every file is written to a temporary name and
//! renamed into place, so a reader (or a crash) never sees half a blob or half an index.

use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::digest::{Digest, HashingReader};
use crate::format::{BUNDLE_ARTIFACT_TYPE, Descriptor, ImageIndex, OCI_MANIFEST_MEDIA_TYPE, REF_NAME_ANNOTATION};
use crate::pack::PackedBundle;
use crate::registry_error::RegistryError;

/// The contents of the `oci-layout` marker file.
const LAYOUT_MARKER: &str = r#"{"imageLayoutVersion":"1.0.0"}"#;
/// The largest `index.json` read.
const MAX_INDEX_BYTES: u64 = 16 << 20;

/// Where a blob lives in a layout.
pub(crate) fn blob_path(dir: &Path, digest: &Digest) -> PathBuf {
    dir.join("blobs").join("sha256").join(digest.hex())
}

/// The digest of the manifest tagged `tag` in the layout at `dir`; the last entry wins
/// when a tool wrote the tag twice.
pub(crate) fn resolve(dir: &Path, tag: &str, reference: &str) -> Result<Digest, RegistryError> {
    let index = read_index(dir, reference)?;
    index
        .manifests
        .iter()
        .rev()
        .find(|entry| entry.annotations.get(REF_NAME_ANNOTATION).map(String::as_str) == Some(tag))
        .map(|entry| entry.digest.clone())
        .ok_or_else(|| RegistryError::TagNotFound { reference: reference.to_owned() })
}

fn read_index(dir: &Path, reference: &str) -> Result<ImageIndex, RegistryError> {
    let unavailable = |detail: String| RegistryError::RegistryUnavailable { registry: reference.to_owned(), detail };
    if !dir.join("oci-layout").is_file() {
        return Err(unavailable(format!("{} is not an OCI image layout (no oci-layout file)", dir.display())));
    }
    let path = dir.join("index.json");
    let bytes = read_bounded(&path, MAX_INDEX_BYTES).map_err(|e| unavailable(format!("{}: {e}", path.display())))?;
    serde_json::from_slice(&bytes).map_err(|e| unavailable(format!("{} is not an OCI index: {e}", path.display())))
}

/// Reads a whole file, refusing one larger than `limit`.
pub(crate) fn read_bounded(path: &Path, limit: u64) -> io::Result<Vec<u8>> {
    let file = fs::File::open(path)?;
    let mut bytes = Vec::new();
    file.take(limit + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("larger than {limit} bytes")));
    }
    Ok(bytes)
}

/// Writes `bundle` into the layout at `dir` (created if missing) and points `tag` at it.
/// Blocking.
pub(crate) fn write(dir: &Path, bundle: &PackedBundle, tag: Option<&str>) -> Result<(), RegistryError> {
    let write_error =
        |path: &Path, source: io::Error| RegistryError::Layout { path: path.display().to_string(), source };
    let blobs = dir.join("blobs").join("sha256");
    fs::create_dir_all(&blobs).map_err(|e| write_error(&blobs, e))?;
    let marker = dir.join("oci-layout");
    if !marker.is_file() {
        write_atomically(&marker, LAYOUT_MARKER.as_bytes()).map_err(|e| write_error(&marker, e))?;
    }
    for (descriptor, bytes) in bundle.blobs() {
        write_blob(dir, &descriptor.digest, bytes).map_err(|e| write_error(&blob_path(dir, &descriptor.digest), e))?;
    }
    write_blob(dir, bundle.digest(), bundle.manifest_bytes())
        .map_err(|e| write_error(&blob_path(dir, bundle.digest()), e))?;

    let index_path = dir.join("index.json");
    let mut index =
        if index_path.is_file() { read_index(dir, &dir.display().to_string())? } else { ImageIndex::default() };
    let mut entry = Descriptor::of(OCI_MANIFEST_MEDIA_TYPE, bundle.manifest_bytes());
    entry.artifact_type = Some(BUNDLE_ARTIFACT_TYPE.to_owned());
    match tag {
        Some(tag) => {
            index.manifests.retain(|m| m.annotations.get(REF_NAME_ANNOTATION).map(String::as_str) != Some(tag));
            entry.annotations.insert(REF_NAME_ANNOTATION.to_owned(), tag.to_owned());
            index.manifests.push(entry);
        }
        None if index.manifests.iter().any(|m| m.digest == *bundle.digest()) => {}
        None => index.manifests.push(entry),
    }
    let bytes = serde_json::to_vec_pretty(&index).map_err(|e| write_error(&index_path, io::Error::other(e)))?;
    write_atomically(&index_path, &bytes).map_err(|e| write_error(&index_path, e))
}

/// Writes a blob unless one with a matching digest is already there.
fn write_blob(dir: &Path, digest: &Digest, bytes: &[u8]) -> io::Result<()> {
    let path = blob_path(dir, digest);
    if let Ok(file) = fs::File::open(&path) {
        let mut hashing = HashingReader::new(file);
        io::copy(&mut hashing, &mut io::sink())?;
        if hashing.finish().0 == *digest {
            return Ok(());
        }
    }
    write_atomically(&path, bytes)
}

/// Writes `bytes` to a temporary file beside `path`, syncs it and renames it over `path`.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let parent = path.parent().unwrap_or(Path::new("."));
    let mut temp = tempfile::Builder::new().prefix(".tmp-").tempfile_in(parent)?;
    temp.write_all(bytes)?;
    // Readable by the other tools and users that read layouts, as a plain write would be.
    temp.as_file().set_permissions(fs::Permissions::from_mode(0o644))?;
    temp.as_file().sync_all()?;
    temp.persist(path).map_err(|e| e.error)?;
    Ok(())
}
