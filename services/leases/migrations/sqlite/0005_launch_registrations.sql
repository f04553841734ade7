-- Launch registrations: a node takes one for a lease it holds open, before
-- the workload starts, and identity spends it once to sign that launch's
-- workload certificate. A registration is not stored when taken: it carries
-- its lease, epoch, node and expiry, signed (HMAC-SHA256) with the one key
-- below, which the first replica to need it creates. Only spent ones are
-- recorded, under the SHA-256 of what was presented, until they expire, so a
-- replay is refused.
CREATE TABLE launch_registration_key (
    id  INTEGER PRIMARY KEY CHECK (id = 1),
    key BLOB NOT NULL
);
CREATE TABLE launch_registrations (
    secret_sha256 TEXT PRIMARY KEY,
    lease_id      TEXT NOT NULL,
    epoch         BIGINT NOT NULL,
    node_id       TEXT NOT NULL,
    expires_at_ms BIGINT NOT NULL,
    spent_at_ms   BIGINT NOT NULL,
    spent_by      TEXT NOT NULL
);
CREATE INDEX launch_registrations_by_expiry ON launch_registrations (expires_at_ms);
