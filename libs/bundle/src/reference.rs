//! Where a bundle lives: a registry reference (`host/repo:tag`, `host/repo@sha256:…`) or an
//! OCI image-layout directory (`oci:DIR:TAG`, `oci:DIR@sha256:…`).
//!
//! # Spelling
//! Anything that starts with `oci:` names a layout directory, the way skopeo spells it;
//! everything else is a registry reference, parsed as docker and oras parse them (a bare
//! `repo:tag` means Docker Hub, a missing tag means `latest`). A tag in a layout is the
//! `org.opencontainers.image.ref.name` annotation of an entry in its `index.json`.
//!
//! # Invariants
//! A digest in a reference is always sha256 and well formed; with both a tag and a
//! digest, the digest decides what is fetched.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use crate::digest::{Digest, DigestError};

/// The prefix that marks an OCI image-layout directory reference.
pub const LAYOUT_PREFIX: &str = "oci:";

/// The tag a reference without tag or digest stands for.
pub const DEFAULT_TAG: &str = "latest";

/// The longest tag the OCI distribution spec allows.
const MAX_TAG_LEN: usize = 128;

/// Why a string is not a bundle reference.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReferenceError {
    /// Nothing was given.
    #[error("the bundle reference is empty")]
    Empty,
    /// A registry reference that does not parse.
    #[error("`{reference}` is not a registry reference (host/repo:tag or host/repo@sha256:<hex>): {reason}")]
    Registry {
        /// The reference as given.
        reference: String,
        /// What the parser refused.
        reason: String,
    },
    /// An `oci:` reference without a directory.
    #[error("`{reference}` names no directory; write oci:DIR:TAG or oci:DIR@sha256:<hex>")]
    LayoutDir {
        /// The reference as given.
        reference: String,
    },
    /// A tag with characters or a length the OCI spec does not allow.
    #[error("`{tag}` in `{reference}` is not a tag: up to 128 of A-Z a-z 0-9 _ . -, not starting with . or -")]
    Tag {
        /// The reference as given.
        reference: String,
        /// The tag part.
        tag: String,
    },
    /// The digest part is not a sha256 digest.
    #[error("`{reference}` has a bad digest: {source}")]
    Digest {
        /// The reference as given.
        reference: String,
        /// Why the digest was refused.
        #[source]
        source: DigestError,
    },
}

/// A bundle in a registry.
#[derive(Clone, PartialEq, Eq)]
pub struct RegistryReference {
    inner: oci_client::Reference,
    digest: Option<Digest>,
}

impl RegistryReference {
    /// The registry's `host[:port]`.
    pub fn registry(&self) -> &str {
        self.inner.resolve_registry()
    }

    /// The repository path inside the registry.
    pub fn repository(&self) -> &str {
        self.inner.repository()
    }

    /// The tag, when the reference has one.
    pub fn tag(&self) -> Option<&str> {
        self.inner.tag()
    }

    /// The digest, when the reference pins one.
    pub fn digest(&self) -> Option<&Digest> {
        self.digest.as_ref()
    }

    /// The reference as oci-client wants it.
    pub(crate) fn oci(&self) -> &oci_client::Reference {
        &self.inner
    }

    /// The same repository, tag and digest at `registry`: where a mirror of
    /// this reference's registry serves it.
    pub(crate) fn on_registry(&self, registry: &str) -> Self {
        let (registry, repository) = (registry.to_owned(), self.inner.repository().to_owned());
        let inner = match (self.inner.tag(), self.inner.digest()) {
            (Some(tag), Some(digest)) => {
                oci_client::Reference::with_tag_and_digest(registry, repository, tag.to_owned(), digest.to_owned())
            }
            (None, Some(digest)) => oci_client::Reference::with_digest(registry, repository, digest.to_owned()),
            (tag, None) => oci_client::Reference::with_tag(registry, repository, tag.unwrap_or(DEFAULT_TAG).to_owned()),
        };
        Self { inner, digest: self.digest.clone() }
    }

    /// Whether `registry` names this reference's registry, as written or as
    /// resolved (`docker.io` is `index.docker.io`).
    pub(crate) fn is_on(&self, registry: &str) -> bool {
        registry == self.inner.registry() || registry == self.inner.resolve_registry()
    }

    /// The same repository pinned to `digest`, without a tag.
    fn pinned(&self, digest: &Digest) -> Self {
        let inner = oci_client::Reference::with_digest(
            self.inner.registry().to_owned(),
            self.inner.repository().to_owned(),
            digest.to_string(),
        );
        Self { inner, digest: Some(digest.clone()) }
    }
}

impl fmt::Display for RegistryReference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.inner.registry(), self.inner.repository())?;
        if let Some(tag) = self.inner.tag() {
            write!(f, ":{tag}")?;
        }
        if let Some(digest) = &self.digest {
            write!(f, "@{digest}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for RegistryReference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// A bundle in an OCI image-layout directory.
#[derive(Clone, PartialEq, Eq)]
pub struct LayoutReference {
    dir: PathBuf,
    tag: Option<String>,
    digest: Option<Digest>,
}

impl LayoutReference {
    /// The layout directory (holding `oci-layout`, `index.json` and `blobs/`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The tag, when the reference has one.
    pub fn tag(&self) -> Option<&str> {
        self.tag.as_deref()
    }

    /// The digest, when the reference pins one.
    pub fn digest(&self) -> Option<&Digest> {
        self.digest.as_ref()
    }
}

impl fmt::Display for LayoutReference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{LAYOUT_PREFIX}{}", self.dir.display())?;
        if let Some(tag) = &self.tag {
            write!(f, ":{tag}")?;
        }
        if let Some(digest) = &self.digest {
            write!(f, "@{digest}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for LayoutReference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Where a bundle lives.
#[derive(Clone, PartialEq, Eq)]
pub enum BundleReference {
    /// In a registry, spoken to over the OCI distribution API.
    Registry(RegistryReference),
    /// In an OCI image-layout directory on this machine.
    Layout(LayoutReference),
}

impl BundleReference {
    /// Parses a reference; see the module docs for the spellings.
    pub fn parse(text: &str) -> Result<Self, ReferenceError> {
        let text = text.trim();
        if text.is_empty() {
            return Err(ReferenceError::Empty);
        }
        match text.strip_prefix(LAYOUT_PREFIX) {
            Some(rest) => parse_layout(text, rest).map(Self::Layout),
            None => parse_registry(text).map(Self::Registry),
        }
    }

    /// The tag, when the reference has one.
    pub fn tag(&self) -> Option<&str> {
        match self {
            Self::Registry(r) => r.tag(),
            Self::Layout(l) => l.tag(),
        }
    }

    /// The digest, when the reference pins one.
    pub fn digest(&self) -> Option<&Digest> {
        match self {
            Self::Registry(r) => r.digest(),
            Self::Layout(l) => l.digest(),
        }
    }

    /// The same bundle location pinned to `digest` (the tag dropped): what a revision
    /// records once its tag is resolved, and what the cache pulls.
    pub fn pinned(&self, digest: &Digest) -> Self {
        match self {
            Self::Registry(r) => Self::Registry(r.pinned(digest)),
            Self::Layout(l) => {
                Self::Layout(LayoutReference { dir: l.dir.clone(), tag: None, digest: Some(digest.clone()) })
            }
        }
    }

    /// Whether this is a registry reference.
    pub fn is_registry(&self) -> bool {
        matches!(self, Self::Registry(_))
    }
}

impl FromStr for BundleReference {
    type Err = ReferenceError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::parse(text)
    }
}

impl fmt::Display for BundleReference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Registry(r) => fmt::Display::fmt(r, f),
            Self::Layout(l) => fmt::Display::fmt(l, f),
        }
    }
}

impl fmt::Debug for BundleReference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

fn parse_registry(text: &str) -> Result<RegistryReference, ReferenceError> {
    let inner = oci_client::Reference::try_from(text)
        .map_err(|e| ReferenceError::Registry { reference: text.to_owned(), reason: e.to_string() })?;
    let digest = inner
        .digest()
        .map(|d| d.parse::<Digest>())
        .transpose()
        .map_err(|source| ReferenceError::Digest { reference: text.to_owned(), source })?;
    Ok(RegistryReference { inner, digest })
}

/// `DIR`, `DIR:TAG`, `DIR@DIGEST` or `DIR:TAG@DIGEST`. A colon followed by something
/// with a `/` belongs to the directory, so `oci:/tmp/a:b/layout` has no tag.
fn parse_layout(text: &str, rest: &str) -> Result<LayoutReference, ReferenceError> {
    let (rest, digest) = match rest.rsplit_once('@') {
        Some((before, digest)) if digest.starts_with("sha") => {
            let digest = digest
                .parse::<Digest>()
                .map_err(|source| ReferenceError::Digest { reference: text.to_owned(), source })?;
            (before, Some(digest))
        }
        _ => (rest, None),
    };
    let (dir, tag) = match rest.rsplit_once(':') {
        Some((dir, tag)) if !tag.contains('/') => (dir, Some(tag.to_owned())),
        _ => (rest, None),
    };
    if dir.is_empty() {
        return Err(ReferenceError::LayoutDir { reference: text.to_owned() });
    }
    if let Some(tag) = &tag
        && !is_tag(tag)
    {
        return Err(ReferenceError::Tag { reference: text.to_owned(), tag: tag.clone() });
    }
    let tag = if tag.is_none() && digest.is_none() { Some(DEFAULT_TAG.to_owned()) } else { tag };
    Ok(LayoutReference { dir: PathBuf::from(dir), tag, digest })
}

/// `[A-Za-z0-9_][A-Za-z0-9._-]{0,127}`, the OCI distribution spec's tag grammar.
pub(crate) fn is_tag(tag: &str) -> bool {
    let mut bytes = tag.bytes();
    let first_ok = bytes.next().is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_');
    first_ok && tag.len() <= MAX_TAG_LEN && bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIGEST: &str = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    #[test]
    fn registry_references_keep_host_repo_tag_and_digest() {
        let r = BundleReference::parse("127.0.0.1:5000/team/app:v3").unwrap();
        let BundleReference::Registry(reg) = &r else { panic!("not a registry reference") };
        assert_eq!(reg.registry(), "127.0.0.1:5000");
        assert_eq!(reg.repository(), "team/app");
        assert_eq!(reg.tag(), Some("v3"));
        assert_eq!(r.digest(), None);
        assert_eq!(r.to_string(), "127.0.0.1:5000/team/app:v3");

        let pinned = BundleReference::parse(&format!("registry.example.com/app@{DIGEST}")).unwrap();
        assert_eq!(pinned.digest().unwrap().to_string(), DIGEST);
        assert_eq!(pinned.tag(), None);
        assert_eq!(r.pinned(pinned.digest().unwrap()).to_string(), format!("127.0.0.1:5000/team/app@{DIGEST}"));
    }

    #[test]
    fn registry_reference_without_tag_means_latest() {
        let r = BundleReference::parse("localhost:5000/app").unwrap();
        assert_eq!(r.tag(), Some("latest"));
    }

    #[test]
    fn bad_registry_references_are_refused() {
        assert_eq!(BundleReference::parse("  "), Err(ReferenceError::Empty));
        assert!(matches!(BundleReference::parse("Host/UPPER:tag"), Err(ReferenceError::Registry { .. })));
        assert!(matches!(BundleReference::parse("host/app@sha256:abc"), Err(ReferenceError::Registry { .. })));
        assert!(matches!(BundleReference::parse("host/app:bad tag"), Err(ReferenceError::Registry { .. })));
    }

    #[test]
    fn layout_references_split_dir_tag_and_digest() {
        let r = BundleReference::parse("oci:/tmp/layout:v1").unwrap();
        let BundleReference::Layout(l) = &r else { panic!("not a layout reference") };
        assert_eq!(l.dir(), Path::new("/tmp/layout"));
        assert_eq!(l.tag(), Some("v1"));

        let r = BundleReference::parse(&format!("oci:rel/dir@{DIGEST}")).unwrap();
        assert_eq!(r.tag(), None);
        assert_eq!(r.digest().unwrap().to_string(), DIGEST);
        assert_eq!(r.to_string(), format!("oci:rel/dir@{DIGEST}"));

        let r = BundleReference::parse("oci:/tmp/a:b/layout").unwrap();
        let BundleReference::Layout(l) = &r else { panic!("not a layout reference") };
        assert_eq!(l.dir(), Path::new("/tmp/a:b/layout"));
        assert_eq!(l.tag(), Some("latest"));
    }

    #[test]
    fn bad_layout_references_are_refused() {
        assert!(matches!(BundleReference::parse("oci::v1"), Err(ReferenceError::LayoutDir { .. })));
        assert!(matches!(BundleReference::parse("oci:/tmp/x:.hidden"), Err(ReferenceError::Tag { .. })));
        assert!(matches!(BundleReference::parse("oci:/tmp/x@sha256:zz"), Err(ReferenceError::Digest { .. })));
        assert!(matches!(
            BundleReference::parse("oci:/tmp/x@sha512:00"),
            Err(ReferenceError::Digest { source: DigestError::UnsupportedAlgorithm(_), .. })
        ));
    }
}
