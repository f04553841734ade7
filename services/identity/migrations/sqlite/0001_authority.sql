-- The certificate authorities identity holds. The private key is stored only
-- sealed (AEAD under a key derived from --auth-secret).
CREATE TABLE authorities (
    fingerprint       TEXT PRIMARY KEY,
    cert_pem          TEXT NOT NULL,
    sealed_key        BLOB NOT NULL,
    state             TEXT NOT NULL CHECK (state IN ('prepared', 'active', 'retired')),
    -- 1 for the one active authority, NULL otherwise: the unique index lets
    -- two replicas racing to create the first CA end with one.
    active_slot       INTEGER UNIQUE CHECK (active_slot = 1),
    created_at_ms     BIGINT NOT NULL,
    activated_at_ms   BIGINT,
    not_after_ms      BIGINT NOT NULL,
    -- The latest expiry of any certificate this authority signed: a retired
    -- authority stays in the bundle until then.
    last_signed_not_after_ms BIGINT NOT NULL DEFAULT 0
);
