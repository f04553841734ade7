//! JWT-SVIDs: short-lived ES256 tokens naming a workload's SPIFFE ID for an
//! audience, signed with a workload authority's key, and the JWK set that
//! verifies them, built from the same trust bundle the X.509-SVIDs chain to.
//!
//! # Invariants
//! - A token is signed by the authority's own (P-256) key and names it by
//!   `kid`, the authority certificate's fingerprint; the JWK set holds one
//!   key per certificate of the bundle, so a rotation that stages a new
//!   authority publishes its key before it signs anything, exactly as for
//!   X.509-SVIDs.
//! - A token verifies only with a key of the set, for an audience it names,
//!   before it expires; anything else is refused, naming why.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use jsonwebtoken::jwk::{
    AlgorithmParameters, CommonParameters, EllipticCurve, EllipticCurveKeyParameters, EllipticCurveKeyType, Jwk,
    JwkSet, KeyAlgorithm, PublicKeyUse,
};
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use rustls_pki_types::CertificateDer;

use crate::MtlsError;
use crate::pem::{certs_from_pem, fingerprint};

/// The OID of an elliptic-curve public key, and of the P-256 curve.
const EC_PUBLIC_KEY: &str = "1.2.840.10045.2.1";
const P256: &str = "1.2.840.10045.3.1.7";

/// What a JWT-SVID claims.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct JwtSvidClaims {
    /// The SPIFFE ID it names.
    pub sub: String,
    /// Who it is for.
    pub aud: Vec<String>,
    /// When it expires, seconds since the Unix epoch.
    pub exp: i64,
    /// When it was issued, seconds since the Unix epoch.
    pub iat: i64,
}

fn jwt_error(what: &str) -> impl Fn(jsonwebtoken::errors::Error) -> MtlsError + '_ {
    move |error| MtlsError::Jwt(format!("{what}: {error}"))
}

fn unix_now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// Signs `claims` as an ES256 JWT with the PKCS#8 P-256 key `key_der`,
/// naming the key `kid`.
pub(crate) fn sign(claims: &JwtSvidClaims, key_der: &[u8], kid: &str) -> Result<String, MtlsError> {
    let mut header = Header::new(Algorithm::ES256);
    header.kid = Some(kid.to_owned());
    let key = EncodingKey::from_ec_der(key_der);
    jsonwebtoken::encode(&header, claims, &key).map_err(jwt_error("cannot sign the JWT-SVID"))
}

/// The claims of a JWT-SVID for `spiffe_id` and `audience`, issued now and
/// living `ttl`.
pub(crate) fn claims(spiffe_id: &str, audience: &[String], ttl: Duration) -> Result<JwtSvidClaims, MtlsError> {
    if audience.is_empty() || audience.iter().any(String::is_empty) {
        return Err(MtlsError::Jwt("a JWT-SVID needs at least one audience, and no empty one".into()));
    }
    if !spiffe_id.starts_with("spiffe://") {
        return Err(MtlsError::Jwt(format!("'{spiffe_id}' is not a SPIFFE ID")));
    }
    let iat = unix_now();
    Ok(JwtSvidClaims {
        sub: spiffe_id.to_owned(),
        aud: audience.to_vec(),
        exp: iat + i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX / 2),
        iat,
    })
}

/// The JWK set (JSON) of every P-256 key among the certificates of
/// `bundle_pem`, each named by its certificate's fingerprint.
pub fn jwks(bundle_pem: &str) -> Result<String, MtlsError> {
    let keys = certs_from_pem("workload bundle", bundle_pem)?
        .iter()
        .filter_map(|cert| jwk(cert).transpose())
        .collect::<Result<Vec<_>, _>>()?;
    serde_json::to_string(&JwkSet { keys }).map_err(|e| MtlsError::Jwt(format!("cannot encode the JWK set: {e}")))
}

/// The JWK of a certificate's key, when it is P-256.
fn jwk(cert: &CertificateDer<'_>) -> Result<Option<Jwk>, MtlsError> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|e| MtlsError::Pem { what: "certificate", detail: e.to_string() })?;
    let spki = parsed.public_key();
    let curve = spki.algorithm.parameters.as_ref().and_then(|p| p.as_oid().ok()).map(|oid| oid.to_id_string());
    if spki.algorithm.algorithm.to_id_string() != EC_PUBLIC_KEY || curve.as_deref() != Some(P256) {
        return Ok(None);
    }
    let point = &spki.subject_public_key.data;
    // Uncompressed: 0x04, then x and y of 32 bytes each.
    if point.len() != 65 || point[0] != 4 {
        return Ok(None);
    }
    let b64 = |bytes: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
    Ok(Some(Jwk {
        common: CommonParameters {
            public_key_use: Some(PublicKeyUse::Other("jwt-svid".into())),
            key_id: Some(fingerprint(cert)),
            key_algorithm: Some(KeyAlgorithm::ES256),
            ..CommonParameters::default()
        },
        algorithm: AlgorithmParameters::EllipticCurve(EllipticCurveKeyParameters {
            key_type: EllipticCurveKeyType::EC,
            curve: EllipticCurve::P256,
            x: b64(&point[1..33]),
            y: b64(&point[33..]),
        }),
    }))
}

/// Verifies `token` with a key of the JWK set `jwks_json` for `audience`:
/// its claims when it verifies, unexpired, naming that audience.
pub fn verify_jwt_svid(token: &str, jwks_json: &str, audience: &str) -> Result<JwtSvidClaims, MtlsError> {
    let set: JwkSet =
        serde_json::from_str(jwks_json).map_err(|e| MtlsError::Jwt(format!("the JWK set does not parse: {e}")))?;
    let header = jsonwebtoken::decode_header(token).map_err(jwt_error("the token is not a JWT"))?;
    if header.alg != Algorithm::ES256 {
        return Err(MtlsError::Jwt(format!("the token is signed with {:?}; JWT-SVIDs here are ES256", header.alg)));
    }
    let kid = header.kid.ok_or_else(|| MtlsError::Jwt("the token names no key (kid)".into()))?;
    let jwk = set.find(&kid).ok_or_else(|| MtlsError::Jwt(format!("the token's key {kid} is not in the bundle")))?;
    let key = DecodingKey::from_jwk(jwk).map_err(jwt_error("the bundle's key is unusable"))?;
    let mut validation = Validation::new(Algorithm::ES256);
    validation.set_audience(&[audience]);
    validation.set_required_spec_claims(&["exp", "aud", "sub"]);
    validation.leeway = 0;
    let data = jsonwebtoken::decode::<JwtSvidClaims>(token, &key, &validation)
        .map_err(jwt_error("the token does not verify"))?;
    if !data.claims.sub.starts_with("spiffe://") {
        return Err(MtlsError::Jwt(format!("the token's subject '{}' is not a SPIFFE ID", data.claims.sub)));
    }
    Ok(data.claims)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

    use super::*;
    use crate::CertificateAuthority;

    const ID: &str = "spiffe://berth.internal/ns/shop/svc/web/lease/l-1";

    #[test]
    fn a_token_verifies_with_its_authoritys_jwks_for_its_audience_only() {
        let ca = CertificateAuthority::generate("workloads", Duration::from_secs(3600)).unwrap();
        let other = CertificateAuthority::generate("other", Duration::from_secs(3600)).unwrap();
        let bundle = format!("{}{}", ca.cert_pem(), other.cert_pem());
        let set = jwks(&bundle).unwrap();
        let (token, claims) = ca.sign_jwt_svid(ID, &["db".into(), "cache".into()], Duration::from_secs(300)).unwrap();
        assert_eq!(claims.exp - claims.iat, 300);
        let verified = verify_jwt_svid(&token, &set, "cache").unwrap();
        assert_eq!(verified, claims);
        assert_eq!(verified.sub, ID);

        let wrong_audience = verify_jwt_svid(&token, &set, "web").unwrap_err().to_string();
        assert!(wrong_audience.contains("does not verify"), "{wrong_audience}");
        let unknown_key = verify_jwt_svid(&token, &jwks(other.cert_pem()).unwrap(), "db").unwrap_err().to_string();
        assert!(unknown_key.contains("not in the bundle"), "{unknown_key}");
        let mut forged = token.clone();
        forged.replace_range(forged.len() - 4.., "AAAA");
        assert!(verify_jwt_svid(&forged, &set, "db").is_err(), "a changed signature does not verify");

        let stale = JwtSvidClaims { exp: claims.iat - 1, ..claims };
        let key = crate::private_key_der(&ca.key_pem()).unwrap();
        let expired = sign(&stale, &key, &ca.fingerprint()).unwrap();
        let error = verify_jwt_svid(&expired, &set, "db").unwrap_err().to_string();
        assert!(error.contains("Expired"), "{error}");
    }

    #[test]
    fn a_token_needs_an_audience_and_a_spiffe_id() {
        let ca = CertificateAuthority::generate("workloads", Duration::from_secs(3600)).unwrap();
        assert!(ca.sign_jwt_svid(ID, &[], Duration::from_secs(60)).unwrap_err().to_string().contains("audience"));
        assert!(ca.sign_jwt_svid("web", &["db".into()], Duration::from_secs(60)).is_err());
    }
}
