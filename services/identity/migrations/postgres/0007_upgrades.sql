-- Fleet upgrades of the node agent. An upgrade names its artifact pinned to
-- a digest and the nodes it covers, in the order they go; its controller
-- starts each node by writing the node's `upgrade_*` columns, which the
-- node's heartbeat answer carries and its reports update.
CREATE TABLE upgrades (
    upgrade_id       TEXT PRIMARY KEY,
    reference        TEXT NOT NULL,
    artifact         TEXT NOT NULL,
    state            TEXT NOT NULL CHECK (state IN ('running', 'paused', 'done', 'superseded')),
    reason           TEXT NOT NULL DEFAULT '',
    max_unavailable  BIGINT NOT NULL CHECK (max_unavailable >= 1),
    canary           BIGINT NOT NULL CHECK (canary >= 0),
    max_failures     BIGINT NOT NULL CHECK (max_failures >= 0),
    created_by       TEXT NOT NULL,
    created_at_ms    BIGINT NOT NULL
);
CREATE INDEX upgrades_by_creation ON upgrades (created_at_ms);

CREATE TABLE upgrade_nodes (
    upgrade_id      TEXT NOT NULL REFERENCES upgrades (upgrade_id) ON DELETE CASCADE,
    node_id         TEXT NOT NULL,
    ordinal         BIGINT NOT NULL,
    state           TEXT NOT NULL CHECK (state IN ('pending', 'started', 'upgrading', 'succeeded', 'failed')),
    reason          TEXT NOT NULL DEFAULT '',
    version         TEXT NOT NULL DEFAULT '',
    started_at_ms   BIGINT,
    finished_at_ms  BIGINT,
    PRIMARY KEY (upgrade_id, node_id)
);

-- The node's latest upgrade: what it was asked for (set by the controller)
-- and what it said of it (set by its heartbeats).
ALTER TABLE nodes ADD COLUMN upgrade_id TEXT NOT NULL DEFAULT '';
ALTER TABLE nodes ADD COLUMN upgrade_artifact TEXT NOT NULL DEFAULT '';
ALTER TABLE nodes ADD COLUMN upgrade_state TEXT NOT NULL DEFAULT '';
ALTER TABLE nodes ADD COLUMN upgrade_reason TEXT NOT NULL DEFAULT '';
ALTER TABLE nodes ADD COLUMN upgrade_version TEXT NOT NULL DEFAULT '';
