-- Single-use launch registrations: a node takes one for a lease it holds open,
-- before the workload starts, and identity spends it once to sign that
-- launch's workload certificate. Only the secret's SHA-256 is kept, so the
-- table holds nothing a caller could present. `spent_at_ms` is set when it is
-- redeemed or revoked (`spent_by` says which); it is good only while unset,
-- before `expires_at_ms`, and while its lease is open on `node_id` at `epoch`.
CREATE TABLE launch_registrations (
    secret_sha256 TEXT PRIMARY KEY,
    lease_id      TEXT NOT NULL,
    epoch         BIGINT NOT NULL,
    node_id       TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    expires_at_ms BIGINT NOT NULL,
    spent_at_ms   BIGINT,
    spent_by      TEXT NOT NULL DEFAULT ''
);
CREATE INDEX launch_registrations_by_lease ON launch_registrations (lease_id, epoch);
CREATE INDEX launch_registrations_by_expiry ON launch_registrations (expires_at_ms);
