//! Reading the berth identity back out of a certificate a peer presented.

use berth_core::{Identity, IdentityError};
use rustls_pki_types::CertificateDer;
use x509_parser::extensions::GeneralName;

/// The berth identity named by a certificate's DNS SANs, if it carries one.
///
/// The certificate has already been verified against the trust bundle by the
/// time this runs; a certificate with no berth SAN, or with two different
/// ones, names nobody and is treated as anonymous by the caller.
pub fn identity_from_cert(cert: &CertificateDer<'_>) -> Option<Identity> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    let san = parsed.subject_alternative_name().ok()??;
    let mut found: Option<Identity> = None;
    for name in &san.value.general_names {
        let GeneralName::DNSName(dns) = name else { continue };
        match Identity::from_san(dns) {
            Ok(id) => match &found {
                Some(existing) if *existing != id => return None,
                _ => found = Some(id),
            },
            Err(IdentityError::NotBerth(_)) => {}
            Err(IdentityError::BadName(_)) => return None,
        }
    }
    found
}
