//! The certificate authority: a self-signed ECDSA P-256 root that signs every
//! leaf in the mesh.
//!
//! # What it signs
//! Leaves are short-lived and usable for both server and client auth, since
//! every berth process is both. The identity SAN comes from the caller of
//! [`CertificateAuthority::sign_csr`], never from the CSR, so a node cannot
//! ask for a name it was not given.

use std::time::Duration;

use berth_core::{Identity, WorkloadId};
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, PKCS_ECDSA_P256_SHA256, PKCS_ECDSA_P384_SHA384,
    PKCS_ED25519, SanType, SerialNumber,
};
use rustls_pki_types::CertificateDer;
use time::OffsetDateTime;

use crate::MtlsError;
use crate::pem::{certs_from_pem, fingerprint};

/// Clock skew tolerated between the authority and the hosts checking its
/// certificates: leaves are valid from this long before they were signed.
pub const BACKDATE: Duration = Duration::from_secs(5 * 60);

/// A CA certificate and its signing key.
pub struct CertificateAuthority {
    cert_pem: String,
    cert_der: CertificateDer<'static>,
    key: KeyPair,
}

impl std::fmt::Debug for CertificateAuthority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertificateAuthority").field("fingerprint", &self.fingerprint()).finish_non_exhaustive()
    }
}

/// A signed leaf certificate.
#[derive(Debug, Clone)]
pub struct IssuedCertificate {
    /// The leaf, PEM.
    pub cert_pem: String,
    /// When it becomes valid (its issue time, backdated for clock skew),
    /// seconds since the Unix epoch.
    pub not_before: i64,
    /// When it stops being valid, seconds since the Unix epoch.
    pub not_after: i64,
}

impl CertificateAuthority {
    /// Creates a new root valid for `validity`, named `common_name`.
    pub fn generate(common_name: &str, validity: Duration) -> Result<Self, MtlsError> {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(MtlsError::Generate)?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, common_name);
        dn.push(DnType::OrganizationName, "berth");
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages =
            vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let now = OffsetDateTime::now_utc();
        params.not_before = now - BACKDATE;
        params.not_after = now + validity;
        params.serial_number = Some(random_serial());
        let cert = params.self_signed(&key).map_err(MtlsError::Generate)?;
        Ok(Self { cert_pem: cert.pem(), cert_der: cert.der().clone(), key })
    }

    /// Loads a CA from its certificate and PKCS#8 key, both PEM.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self, MtlsError> {
        let cert_der = certs_from_pem("CA certificate", cert_pem)?.remove(0);
        let key =
            KeyPair::from_pem(key_pem).map_err(|e| MtlsError::Pem { what: "CA private key", detail: e.to_string() })?;
        // Fails when the key does not belong to the certificate's issuer data.
        Issuer::from_ca_cert_der(&cert_der, &key).map_err(MtlsError::Generate)?;
        Ok(Self { cert_pem: cert_pem.to_string(), cert_der, key })
    }

    /// The CA certificate, PEM.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The CA private key, PKCS#8 PEM. Callers keep it encrypted at rest.
    pub fn key_pem(&self) -> String {
        self.key.serialize_pem()
    }

    /// SHA-256 of the CA certificate's DER, lowercase hex.
    pub fn fingerprint(&self) -> String {
        fingerprint(&self.cert_der)
    }

    /// Signs the public key of a CSR for `identity`, valid for `ttl`.
    ///
    /// The CSR's signature must verify (proof the requester holds the key) and
    /// its key must be ECDSA P-256/P-384 or Ed25519. `extra_sans` are the host
    /// names or IPs a server is dialled by.
    pub fn sign_csr(
        &self,
        csr_pem: &str,
        identity: &Identity,
        extra_sans: &[String],
        ttl: Duration,
    ) -> Result<IssuedCertificate, MtlsError> {
        let csr = checked_csr(csr_pem)?;
        let now = OffsetDateTime::now_utc();
        self.sign(&csr.public_key, identity, extra_sans, now - BACKDATE, now + ttl)
    }

    /// Signs the public key of a CSR as an X.509-SVID: its only name is the
    /// URI SAN `spiffe_id`, no DNS name, so no berth endpoint takes it for a
    /// mesh identity. The CSR is checked as [`Self::sign_csr`] checks it.
    pub fn sign_svid_csr(
        &self,
        csr_pem: &str,
        spiffe_id: &WorkloadId,
        ttl: Duration,
    ) -> Result<IssuedCertificate, MtlsError> {
        let csr = checked_csr(csr_pem)?;
        let uri = spiffe_id.uri().to_owned().try_into().map_err(MtlsError::Generate)?;
        let now = OffsetDateTime::now_utc();
        self.sign_leaf(&csr.public_key, String::new(), vec![SanType::URI(uri)], now - BACKDATE, now + ttl)
    }

    /// A JWT-SVID naming `spiffe_id` for `audience`, issued now and living
    /// `ttl`, signed with this authority's (P-256) key and naming it by the
    /// authority's fingerprint: the token, and what it claims.
    pub fn sign_jwt_svid(
        &self,
        spiffe_id: &str,
        audience: &[String],
        ttl: Duration,
    ) -> Result<(String, crate::JwtSvidClaims), MtlsError> {
        if self.key.algorithm() != &PKCS_ECDSA_P256_SHA256 {
            return Err(MtlsError::Jwt("this authority's key is not P-256, so it signs no JWT-SVID".into()));
        }
        let claims = crate::jwt::claims(spiffe_id, audience, ttl)?;
        let token = crate::jwt::sign(&claims, &self.key.serialize_der(), &self.fingerprint())?;
        Ok((token, claims))
    }

    /// Generates a key and a certificate for `identity` in one step, for the
    /// callers that hold the CA themselves (bootstrap, tests). Returns the
    /// certificate and the PKCS#8 key, both PEM.
    pub fn issue(
        &self,
        identity: &Identity,
        extra_sans: &[String],
        ttl: Duration,
    ) -> Result<(IssuedCertificate, String), MtlsError> {
        let now = OffsetDateTime::now_utc();
        self.issue_with_validity(identity, extra_sans, now - BACKDATE, now + ttl)
    }

    /// Like [`Self::issue`] with an explicit validity window (an already
    /// expired certificate, for instance).
    pub fn issue_with_validity(
        &self,
        identity: &Identity,
        extra_sans: &[String],
        not_before: OffsetDateTime,
        not_after: OffsetDateTime,
    ) -> Result<(IssuedCertificate, String), MtlsError> {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(MtlsError::Generate)?;
        let cert = self.sign(&key, identity, extra_sans, not_before, not_after)?;
        Ok((cert, key.serialize_pem()))
    }

    fn sign(
        &self,
        public_key: &impl rcgen::PublicKeyData,
        identity: &Identity,
        extra_sans: &[String],
        not_before: OffsetDateTime,
        not_after: OffsetDateTime,
    ) -> Result<IssuedCertificate, MtlsError> {
        let name = identity.dns_san().ok_or_else(|| {
            MtlsError::Csr(format!("{identity} is named by a SPIFFE ID: its certificate is an SVID, not a mesh one"))
        })?;
        let mut sans = vec![name.clone()];
        sans.extend(extra_sans.iter().filter(|s| !s.is_empty()).cloned());
        sans.dedup();
        let sans = sans
            .into_iter()
            .map(|s| match s.parse() {
                Ok(ip) => Ok(SanType::IpAddress(ip)),
                Err(_) => s.try_into().map(SanType::DnsName),
            })
            .collect::<Result<_, _>>()
            .map_err(MtlsError::Generate)?;
        self.sign_leaf(public_key, name, sans, not_before, not_after)
    }

    /// Signs a leaf for `public_key` named `sans`, with `common_name` as its
    /// subject (none when empty).
    fn sign_leaf(
        &self,
        public_key: &impl rcgen::PublicKeyData,
        common_name: String,
        sans: Vec<SanType>,
        not_before: OffsetDateTime,
        not_after: OffsetDateTime,
    ) -> Result<IssuedCertificate, MtlsError> {
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        if !common_name.is_empty() {
            dn.push(DnType::CommonName, common_name);
        }
        params.distinguished_name = dn;
        params.subject_alt_names = sans;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        params.use_authority_key_identifier_extension = true;
        params.not_before = not_before;
        params.not_after = not_after;
        params.serial_number = Some(random_serial());
        let issuer = Issuer::from_ca_cert_der(&self.cert_der, &self.key).map_err(MtlsError::Generate)?;
        let cert = params.signed_by(public_key, &issuer).map_err(MtlsError::Generate)?;
        Ok(IssuedCertificate {
            cert_pem: cert.pem(),
            not_before: not_before.unix_timestamp(),
            not_after: not_after.unix_timestamp(),
        })
    }
}

/// Generates an ECDSA P-256 key and a CSR for it; returns `(csr_pem, key_pem)`.
/// The CSR names `common_name` only: the authority decides the SANs.
pub fn generate_csr(common_name: &str) -> Result<(String, String), MtlsError> {
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(MtlsError::Generate)?;
    Ok((csr_for(common_name, &key)?, key.serialize_pem()))
}

/// A CSR naming `common_name` for the key in `key_pem` (PKCS#8 PEM): how a
/// key kept across renewals asks for its next certificate.
pub fn csr_for_key(common_name: &str, key_pem: &str) -> Result<String, MtlsError> {
    let key = KeyPair::from_pem(key_pem).map_err(MtlsError::Generate)?;
    csr_for(common_name, &key)
}

fn csr_for(common_name: &str, key: &KeyPair) -> Result<String, MtlsError> {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    params.distinguished_name = dn;
    let csr = params.serialize_request(key).map_err(MtlsError::Generate)?;
    csr.pem().map_err(MtlsError::Generate)
}

/// A CSR whose signature verifies and whose key is one berth signs.
fn checked_csr(csr_pem: &str) -> Result<CertificateSigningRequestParams, MtlsError> {
    check_csr_key(csr_pem)?;
    let csr = CertificateSigningRequestParams::from_pem(csr_pem).map_err(|e| MtlsError::Csr(e.to_string()))?;
    let alg = csr.public_key.algorithm();
    if alg != &PKCS_ECDSA_P256_SHA256 && alg != &PKCS_ECDSA_P384_SHA384 && alg != &PKCS_ED25519 {
        return Err(MtlsError::WeakKey("unsupported signature algorithm".into()));
    }
    Ok(csr)
}

/// Refuses a CSR whose key is not one berth signs, before its signature is
/// checked, so that a weak key is reported as such rather than as a bad
/// signature.
fn check_csr_key(csr_pem: &str) -> Result<(), MtlsError> {
    use rustls_pki_types::CertificateSigningRequestDer;
    use rustls_pki_types::pem::PemObject;
    use x509_parser::prelude::FromDer;
    use x509_parser::public_key::PublicKey;

    let der =
        CertificateSigningRequestDer::from_pem_slice(csr_pem.as_bytes()).map_err(|e| MtlsError::Csr(e.to_string()))?;
    let (_, csr) = x509_parser::certification_request::X509CertificationRequest::from_der(der.as_ref())
        .map_err(|e| MtlsError::Csr(e.to_string()))?;
    let spki = &csr.certification_request_info.subject_pki;
    if spki.algorithm.algorithm == x509_parser::oid_registry::OID_SIG_ED25519 {
        return Ok(());
    }
    match spki.parsed() {
        Ok(PublicKey::EC(ec)) if matches!(ec.key_size(), 256 | 384) => Ok(()),
        Ok(PublicKey::EC(ec)) => Err(MtlsError::WeakKey(format!("{}-bit EC key", ec.key_size()))),
        Ok(PublicKey::RSA(rsa)) => Err(MtlsError::WeakKey(format!("{}-bit RSA key", rsa.key_size()))),
        Ok(_) => Err(MtlsError::WeakKey("key type not supported".into())),
        Err(e) => Err(MtlsError::Csr(e.to_string())),
    }
}

fn random_serial() -> SerialNumber {
    let mut bytes: [u8; 16] = rand::random();
    // A positive INTEGER: the top bit clear.
    bytes[0] &= 0x7f;
    SerialNumber::from_slice(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity_from_cert;

    #[test]
    fn signed_csr_carries_the_authority_chosen_identity_only() {
        let ca = CertificateAuthority::generate("test CA", Duration::from_secs(3600)).unwrap();
        let (csr, _key) = generate_csr("evil.admin.berth.internal").unwrap();
        let node = Identity::node("n-1").unwrap();
        let cert = ca.sign_csr(&csr, &node, &["10.0.0.7".into(), "host-a".into()], Duration::from_secs(60)).unwrap();
        let der = certs_from_pem("certificate", &cert.cert_pem).unwrap().remove(0);
        assert_eq!(identity_from_cert(&der), Some(node));
    }

    #[test]
    fn an_svid_names_only_its_spiffe_id_and_no_mesh_identity() {
        let ca = CertificateAuthority::generate("workload CA", Duration::from_secs(3600)).unwrap();
        let (csr, _key) = generate_csr("web.svc.berth.internal").unwrap();
        let id = "spiffe://berth.internal/ns/default/svc/web/rev/web-00001/lease/l-1";
        let workload = WorkloadId::parse(id).unwrap();
        let cert = ca.sign_svid_csr(&csr, &workload, Duration::from_secs(60)).unwrap();
        let der = certs_from_pem("certificate", &cert.cert_pem).unwrap().remove(0);
        assert_eq!(
            identity_from_cert(&der),
            Some(Identity::Workload(workload)),
            "a workload, and no mesh identity, whatever the CSR asked for"
        );
        let (_, parsed) = x509_parser::parse_x509_certificate(der.as_ref()).unwrap();
        let sans = parsed.subject_alternative_name().unwrap().unwrap();
        let names: Vec<String> = sans.value.general_names.iter().map(|n| format!("{n:?}")).collect();
        assert_eq!(names, [format!("URI({id:?})")]);
        assert!(ca.issue(&Identity::Workload(WorkloadId::parse(id).unwrap()), &[], Duration::from_secs(60)).is_err());
    }

    #[test]
    fn tampered_csr_is_refused() {
        let ca = CertificateAuthority::generate("test CA", Duration::from_secs(3600)).unwrap();
        let (csr, _) = generate_csr("n").unwrap();
        let mut der = certs_pem_body(&csr);
        let mid = der.len() / 2;
        der[mid] ^= 0x01;
        let tampered = pem_encode("CERTIFICATE REQUEST", &der);
        let err = ca.sign_csr(&tampered, &Identity::node("n").unwrap(), &[], Duration::from_secs(60)).unwrap_err();
        assert!(matches!(err, MtlsError::Csr(_)), "{err}");
    }

    #[test]
    fn rsa_csr_is_refused_as_weak() {
        // A 1024-bit RSA CSR made with openssl; rcgen cannot generate RSA keys with ring.
        let csr = include_str!("../testdata/rsa1024.csr");
        let ca = CertificateAuthority::generate("test CA", Duration::from_secs(3600)).unwrap();
        let err = ca.sign_csr(csr, &Identity::node("n").unwrap(), &[], Duration::from_secs(60)).unwrap_err();
        assert!(matches!(err, MtlsError::WeakKey(_)), "{err}");
    }

    #[test]
    fn ca_round_trips_through_pem() {
        let ca = CertificateAuthority::generate("test CA", Duration::from_secs(3600)).unwrap();
        let again = CertificateAuthority::from_pem(ca.cert_pem(), &ca.key_pem()).unwrap();
        assert_eq!(again.fingerprint(), ca.fingerprint());
        let other = CertificateAuthority::generate("other", Duration::from_secs(3600)).unwrap();
        assert!(CertificateAuthority::from_pem(ca.cert_pem(), "garbage").is_err());
        let _ = other;
    }

    fn certs_pem_body(pem: &str) -> Vec<u8> {
        use base64::Engine as _;
        let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
        base64::engine::general_purpose::STANDARD.decode(body).unwrap()
    }

    fn pem_encode(label: &str, der: &[u8]) -> String {
        use base64::Engine as _;
        let body = base64::engine::general_purpose::STANDARD.encode(der);
        format!("-----BEGIN {label}-----\n{body}\n-----END {label}-----\n")
    }
}
