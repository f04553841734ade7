-- Join tokens: only the SHA-256 of each secret is kept, hex encoded.
CREATE TABLE join_tokens (
    token_id       TEXT PRIMARY KEY,
    secret_sha256  TEXT NOT NULL,
    tier           TEXT NOT NULL,
    labels_json    TEXT NOT NULL,
    description    TEXT NOT NULL,
    created_by     TEXT NOT NULL,
    created_at_ms  BIGINT NOT NULL,
    expires_at_ms  BIGINT NOT NULL,
    max_uses       BIGINT NOT NULL CHECK (max_uses >= 1),
    uses           BIGINT NOT NULL DEFAULT 0 CHECK (uses >= 0),
    revoked_at_ms  BIGINT
);
CREATE INDEX join_tokens_by_creation ON join_tokens (created_at_ms);

-- The node registry. `incarnation` fences a stale agent; `revision` grows on
-- every write so replicas apply a row only when it is newer than theirs.
CREATE TABLE nodes (
    node_id                   TEXT PRIMARY KEY,
    name                      TEXT NOT NULL,
    tier                      TEXT NOT NULL,
    advertise_addr            TEXT NOT NULL,
    state                     TEXT NOT NULL CHECK (state IN ('joining', 'up', 'down', 'draining', 'revoked')),
    incarnation               BIGINT NOT NULL CHECK (incarnation >= 1),
    revision                  BIGINT NOT NULL,
    labels_json               TEXT NOT NULL,
    version                   TEXT NOT NULL,
    capacity_cpu_millis       BIGINT NOT NULL,
    capacity_memory_bytes     BIGINT NOT NULL,
    usage_cpu_millis          BIGINT NOT NULL,
    usage_memory_bytes        BIGINT NOT NULL,
    join_token_id             TEXT NOT NULL,
    joined_at_ms              BIGINT NOT NULL,
    state_changed_at_ms       BIGINT NOT NULL,
    last_heartbeat_at_ms      BIGINT,
    certificate_expires_at_ms BIGINT NOT NULL,
    -- Set while an operator has the node drained, whatever its liveness.
    drained_at_ms             BIGINT,
    -- Set when the monitor reaped the node; cleared by a rejoin.
    reaped_at_ms              BIGINT,
    revoked_at_ms             BIGINT,
    revoked_reason            TEXT NOT NULL DEFAULT ''
);
-- At most one live node per (tier, advertise address): the backstop behind
-- the heartbeat's own check, which names the other node.
CREATE UNIQUE INDEX nodes_one_live_per_address ON nodes (tier, advertise_addr) WHERE state IN ('up', 'draining');
CREATE INDEX nodes_by_tier ON nodes (tier, node_id);
