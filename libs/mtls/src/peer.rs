//! Reading the berth identity back out of a certificate a peer presented.
//!
//! A mesh certificate names its identity in one berth DNS SAN; a workload's
//! X.509-SVID names it in one SPIFFE URI SAN and nothing else. The listener's
//! client verifier ([`crate::TlsCredentials`]) checks a certificate carrying
//! a SPIFFE URI only against the workload bundle and any other only against
//! the mesh bundle, so which authority signed it and what it is read as
//! always agree.

use berth_core::{Identity, IdentityError, WorkloadId};
use rustls_pki_types::CertificateDer;
use x509_parser::extensions::GeneralName;

/// The scheme of a SPIFFE ID in a URI SAN.
const SPIFFE_SCHEME: &str = "spiffe://";

/// The berth identity named by a certificate's SANs, if it carries one.
///
/// The certificate has already been verified by the time this runs; a
/// certificate with no berth SAN, with two different ones, or with both a
/// SPIFFE ID and a berth DNS name names nobody and is treated as anonymous
/// by the caller.
pub fn identity_from_cert(cert: &CertificateDer<'_>) -> Option<Identity> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    let san = parsed.subject_alternative_name().ok()??;
    let mut found: Option<Identity> = None;
    let mut spiffe_ids = 0;
    for name in &san.value.general_names {
        let named = match name {
            GeneralName::DNSName(dns) => match Identity::from_san(dns) {
                Ok(id) => id,
                Err(IdentityError::NotBerth(_)) => continue,
                Err(IdentityError::BadName(_)) => return None,
            },
            GeneralName::URI(uri) if uri.starts_with(SPIFFE_SCHEME) => {
                spiffe_ids += 1;
                Identity::Workload(WorkloadId::parse(uri).ok()?)
            }
            _ => continue,
        };
        match &found {
            Some(existing) if *existing != named => return None,
            _ => found = Some(named),
        }
    }
    // An SVID has exactly one URI SAN.
    if spiffe_ids > 1 {
        return None;
    }
    found
}

/// Whether a certificate carries a SPIFFE ID, and so is a workload's SVID
/// to be checked against the workload bundle only.
pub(crate) fn names_spiffe_id(cert: &CertificateDer<'_>) -> bool {
    let Ok((_, parsed)) = x509_parser::parse_x509_certificate(cert.as_ref()) else { return false };
    let Ok(Some(san)) = parsed.subject_alternative_name() else { return false };
    san.value.general_names.iter().any(|name| matches!(name, GeneralName::URI(uri) if uri.starts_with(SPIFFE_SCHEME)))
}
