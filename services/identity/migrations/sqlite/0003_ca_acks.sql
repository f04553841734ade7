-- The CA bundle each node last said it trusts, as the SHA-256 (hex) of the
-- bundle's PEM, so a prepared CA is activated only once every UP node has it.
-- Written only when a node's bundle changes, not on every heartbeat.
CREATE TABLE node_ca_acks (
    node_id        TEXT PRIMARY KEY,
    bundle_sha256  TEXT NOT NULL,
    acked_at_ms    BIGINT NOT NULL
);
