-- Each authority serves one purpose: 'mesh' signs the mesh's certificates
-- (every row before this migration), 'workload' signs workloads' X.509-SVIDs,
-- under a root of its own that no mesh endpoint trusts. Each purpose has its
-- own single active authority. SQLite cannot drop a column's UNIQUE, so the
-- table is rebuilt.
CREATE TABLE authorities_by_purpose (
    fingerprint       TEXT PRIMARY KEY,
    purpose           TEXT NOT NULL DEFAULT 'mesh' CHECK (purpose IN ('mesh', 'workload')),
    cert_pem          TEXT NOT NULL,
    sealed_key        BLOB NOT NULL,
    state             TEXT NOT NULL CHECK (state IN ('prepared', 'active', 'retired')),
    active_slot       INTEGER CHECK (active_slot = 1),
    created_at_ms     BIGINT NOT NULL,
    activated_at_ms   BIGINT,
    not_after_ms      BIGINT NOT NULL,
    last_signed_not_after_ms BIGINT NOT NULL DEFAULT 0,
    CONSTRAINT authorities_one_active_per_purpose UNIQUE (purpose, active_slot)
);
INSERT INTO authorities_by_purpose (fingerprint, purpose, cert_pem, sealed_key, state, active_slot, created_at_ms,
    activated_at_ms, not_after_ms, last_signed_not_after_ms)
SELECT fingerprint, 'mesh', cert_pem, sealed_key, state, active_slot, created_at_ms, activated_at_ms, not_after_ms,
    last_signed_not_after_ms
FROM authorities;
DROP TABLE authorities;
ALTER TABLE authorities_by_purpose RENAME TO authorities;
