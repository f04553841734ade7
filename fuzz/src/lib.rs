//! Fuzz targets for every parser that takes input from outside the mesh: a
//! joining host's CSR, a bundle's manifest and config as a registry serves
//! them, and its tar layer.
//!
//! Each target is a plain function over bytes so that two drivers share it:
//! `cargo fuzz run NAME` (libFuzzer, the binaries in `fuzz_targets/`) and the
//! seed-corpus test in `tests/seeds.rs`, which `make test` runs.
//!
//! # What each target holds the code to
//! - It returns (an error is fine) and never panics, whatever the bytes.
//! - `tar_layer` never writes outside the directory it extracts into.

use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

use base64::Engine as _;
use berth_bundle::{BundleConfig, BundleLimits, BundleManifest};
use berth_core::Identity;
use berth_mtls::CertificateAuthority;

/// Limits small enough that a fuzzer explores them, not the disk.
const FUZZ_LIMITS: BundleLimits = BundleLimits { max_total_bytes: 1 << 20, max_file_bytes: 1 << 18, max_entries: 256 };

/// The CA the CSR target signs with: made once, as key generation dwarfs
/// parsing.
fn authority() -> &'static CertificateAuthority {
    static CA: OnceLock<CertificateAuthority> = OnceLock::new();
    CA.get_or_init(|| match CertificateAuthority::generate("berth fuzz CA", Duration::from_secs(3600)) {
        Ok(ca) => ca,
        Err(error) => panic!("a CA for fuzzing: {error}"),
    })
}

/// A joining host's CSR, as the text of the `Join` request carries it and, so
/// that the DER parser is reached too, as DER wrapped in PEM.
pub fn csr(data: &[u8]) {
    let Ok(identity) = Identity::node("fuzz") else { return };
    let ttl = Duration::from_secs(60);
    let text = String::from_utf8_lossy(data);
    let _ = authority().sign_csr(&text, &identity, &[], ttl);
    let wrapped = format!(
        "-----BEGIN CERTIFICATE REQUEST-----\n{}\n-----END CERTIFICATE REQUEST-----\n",
        base64::engine::general_purpose::STANDARD.encode(data)
    );
    let _ = authority().sign_csr(&wrapped, &identity, &[], ttl);
}

/// A bundle's config blob as a registry serves it.
pub fn bundle_config(data: &[u8]) {
    let _ = BundleConfig::parse(data);
}

/// A bundle's manifest as a registry serves it.
pub fn bundle_manifest(data: &[u8]) {
    let _ = BundleManifest::parse(data);
}

/// A bundle's layer, both as a plain tar and gzip'd, extracted into a fresh
/// directory inside a fresh parent; anything appearing in the parent besides
/// that directory was written outside it.
pub fn tar_layer(data: &[u8]) {
    for gzip in [false, true] {
        let Ok(parent) = tempfile::tempdir() else { return };
        let dest = parent.path().join("bundle");
        if std::fs::create_dir(&dest).is_err() {
            return;
        }
        let _ = if gzip {
            berth_bundle::extract_tar(flate2::read::GzDecoder::new(data), &dest, &FUZZ_LIMITS)
        } else {
            berth_bundle::extract_tar(data, &dest, &FUZZ_LIMITS)
        };
        assert_only_child(parent.path(), &dest);
    }
}

fn assert_only_child(parent: &Path, child: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else { return };
    for entry in entries.flatten() {
        assert_eq!(entry.path(), child, "extraction wrote {} outside the bundle directory", entry.path().display());
    }
}
