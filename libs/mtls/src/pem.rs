//! PEM decoding shared by the authority and the credential holders.

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};

use crate::MtlsError;

/// Every certificate in a PEM bundle, in order; an empty bundle is an error.
pub fn certs_from_pem(what: &'static str, pem: &str) -> Result<Vec<CertificateDer<'static>>, MtlsError> {
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| MtlsError::Pem { what, detail: e.to_string() })?;
    if certs.is_empty() {
        return Err(MtlsError::Pem { what, detail: "no CERTIFICATE block found".into() });
    }
    Ok(certs)
}

/// The first private key in a PEM document (PKCS#8, SEC1 or PKCS#1).
pub(crate) fn key_from_pem(pem: &str) -> Result<PrivateKeyDer<'static>, MtlsError> {
    PrivateKeyDer::from_pem_slice(pem.as_bytes())
        .map_err(|e| MtlsError::Pem { what: "private key", detail: e.to_string() })
}

/// SHA-256 of a certificate's DER, lowercase hex: how berth names a CA in a
/// bundle and how an agent pins one.
pub fn fingerprint(cert: &CertificateDer<'_>) -> String {
    hex::encode(Sha256::digest(cert.as_ref()))
}

/// When a certificate becomes valid and when it expires, as seconds since
/// the Unix epoch.
pub fn cert_validity(cert: &CertificateDer<'_>) -> Result<(i64, i64), MtlsError> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|e| MtlsError::Pem { what: "certificate", detail: e.to_string() })?;
    Ok((parsed.validity().not_before.timestamp(), parsed.validity().not_after.timestamp()))
}

/// The host names and IPs a certificate names beside its berth identity:
/// what a service is dialled by, to be kept when it is renewed.
pub fn cert_host_names(cert: &CertificateDer<'_>) -> Result<Vec<String>, MtlsError> {
    use x509_parser::extensions::GeneralName;
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|e| MtlsError::Pem { what: "certificate", detail: e.to_string() })?;
    let Ok(Some(san)) = parsed.subject_alternative_name() else { return Ok(Vec::new()) };
    let mut names = Vec::new();
    for name in &san.value.general_names {
        match name {
            GeneralName::DNSName(dns) if berth_core::Identity::from_san(dns).is_err() => names.push((*dns).to_owned()),
            GeneralName::IPAddress(bytes) => match bytes.len() {
                4 => names.push(std::net::Ipv4Addr::from(<[u8; 4]>::try_from(*bytes).unwrap_or_default()).to_string()),
                16 => {
                    names.push(std::net::Ipv6Addr::from(<[u8; 16]>::try_from(*bytes).unwrap_or_default()).to_string())
                }
                _ => {}
            },
            _ => {}
        }
    }
    Ok(names)
}

/// The expiry of a certificate, as seconds since the Unix epoch.
pub fn cert_not_after(cert: &CertificateDer<'_>) -> Result<i64, MtlsError> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|e| MtlsError::Pem { what: "certificate", detail: e.to_string() })?;
    Ok(parsed.validity().not_after.timestamp())
}

/// The DER (PKCS#8 for a key berth made) of the private key in a PEM
/// document: what the SPIFFE Workload API hands a workload.
pub fn private_key_der(pem: &str) -> Result<Vec<u8>, MtlsError> {
    Ok(key_from_pem(pem)?.secret_der().to_vec())
}

/// The URIs a certificate names as subject alternative names: a SPIFFE ID
/// is one.
pub fn cert_uris(cert: &CertificateDer<'_>) -> Result<Vec<String>, MtlsError> {
    use x509_parser::extensions::GeneralName;
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|e| MtlsError::Pem { what: "certificate", detail: e.to_string() })?;
    let Ok(Some(san)) = parsed.subject_alternative_name() else { return Ok(Vec::new()) };
    Ok(san
        .value
        .general_names
        .iter()
        .filter_map(|name| match name {
            GeneralName::URI(uri) => Some((*uri).to_owned()),
            _ => None,
        })
        .collect())
}
