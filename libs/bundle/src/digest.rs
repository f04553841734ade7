//! Content digests, `sha256:<64 lowercase hex>`, the only names a bundle's blobs go by.
//!
//! # Invariants
//! A [`Digest`] always holds exactly 64 lowercase hex digits, so its hex part is safe to
//! use as a file name: a digest read from a manifest can never name a path outside the
//! directory it is joined to. Other algorithms are refused rather than trusted unverified.

use std::fmt;
use std::io::{self, Read};
use std::str::FromStr;

use sha2::{Digest as _, Sha256};

/// The algorithm prefix of every digest berth reads or writes.
pub const SHA256_PREFIX: &str = "sha256:";

/// Why a string is not a digest.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DigestError {
    /// The algorithm is not sha256, the only one berth verifies.
    #[error("digest `{0}` does not use sha256, the only algorithm supported")]
    UnsupportedAlgorithm(String),
    /// The hex part is not 64 lowercase hex digits.
    #[error("digest `{0}` is not sha256: followed by 64 lowercase hex digits")]
    Malformed(String),
}

/// A sha256 content digest.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest {
    hex: String,
}

impl Digest {
    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self { hex: hex::encode(Sha256::digest(bytes)) }
    }

    /// The digest from its 64 hex digits, without the `sha256:` prefix.
    pub fn from_hex(hex: &str) -> Result<Self, DigestError> {
        if hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            Ok(Self { hex: hex.to_owned() })
        } else {
            Err(DigestError::Malformed(format!("{SHA256_PREFIX}{hex}")))
        }
    }

    /// The 64 hex digits, the blob's file name in a content-addressed store.
    pub fn hex(&self) -> &str {
        &self.hex
    }
}

impl FromStr for Digest {
    type Err = DigestError;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        match value.split_once(':') {
            Some(("sha256", hex)) => Self::from_hex(hex),
            Some(_) => Err(DigestError::UnsupportedAlgorithm(value.to_owned())),
            None => Err(DigestError::Malformed(value.to_owned())),
        }
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{SHA256_PREFIX}{}", self.hex)
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl serde::Serialize for Digest {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Digest {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// A running sha256 over bytes as they pass, with their count.
#[derive(Debug, Default, Clone)]
pub(crate) struct Hasher {
    state: Sha256,
    len: u64,
}

impl Hasher {
    pub(crate) fn update(&mut self, bytes: &[u8]) {
        self.state.update(bytes);
        self.len += bytes.len() as u64;
    }

    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    pub(crate) fn finish(self) -> Digest {
        Digest { hex: hex::encode(self.state.finalize()) }
    }
}

/// A reader that hashes what is read through it.
#[derive(Debug)]
pub(crate) struct HashingReader<R> {
    inner: R,
    hasher: Hasher,
}

impl<R: Read> HashingReader<R> {
    pub(crate) fn new(inner: R) -> Self {
        Self { inner, hasher: Hasher::default() }
    }

    pub(crate) fn finish(self) -> (Digest, u64) {
        let len = self.hasher.len();
        (self.hasher.finish(), len)
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

/// The digest and size of everything `reader` yields.
pub(crate) fn digest_reader(reader: impl Read) -> io::Result<(Digest, u64)> {
    let mut hashing = HashingReader::new(reader);
    io::copy(&mut hashing, &mut io::sink())?;
    Ok(hashing.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_of_empty_is_the_well_known_one() {
        assert_eq!(
            Digest::of(b"").to_string(),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[test]
    fn parsing_round_trips_and_refuses_paths_and_other_algorithms() {
        let text = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        assert_eq!(text.parse::<Digest>().unwrap().to_string(), text);
        assert!(matches!("sha512:abcd".parse::<Digest>(), Err(DigestError::UnsupportedAlgorithm(_))));
        for bad in [
            "sha256:../../etc/passwd",
            "sha256:E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855",
            "sha256:abc",
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        ] {
            assert!(bad.parse::<Digest>().is_err(), "{bad} should be refused");
        }
    }

    #[test]
    fn hashing_reader_matches_digest_of() {
        let (digest, len) = digest_reader(&b"hello"[..]).unwrap();
        assert_eq!(digest, Digest::of(b"hello"));
        assert_eq!(len, 5);
    }
}
