-- One row per node that was ever placed on: what its open leases reserve, and
-- its assignment log. `assignment_cursor` grows by one with every change the
-- node must act on (a lease placed, a new epoch, a lease leaving the open
-- phases), in the same transaction as the change, so the node's changes are
-- numbered in commit order. `resume_floor` is the highest cursor of a lease
-- forgotten after its retention: a stream cannot resume from below it.
CREATE TABLE node_ledger (
    node_id           TEXT PRIMARY KEY,
    cpu_allocated     BIGINT NOT NULL DEFAULT 0 CHECK (cpu_allocated >= 0),
    memory_allocated  BIGINT NOT NULL DEFAULT 0 CHECK (memory_allocated >= 0),
    open_leases       BIGINT NOT NULL DEFAULT 0 CHECK (open_leases >= 0),
    assignment_cursor BIGINT NOT NULL DEFAULT 0,
    resume_floor      BIGINT NOT NULL DEFAULT 0
);

-- Every lease, open or final until its retention passes. `epoch` fences every
-- write a stale holder could make; `seq` is the node's assignment cursor at
-- the lease's last change. `expires_at_ms` is not indexed (the reaper finds
-- due leases through the bus), so a renewal is a heap-only update.
CREATE TABLE leases (
    lease_id            TEXT PRIMARY KEY,
    project             TEXT NOT NULL,
    idempotency_key     TEXT NOT NULL,
    owner               TEXT NOT NULL,
    node_id             TEXT NOT NULL,
    phase               TEXT NOT NULL CHECK (phase IN ('pending', 'bound', 'launching', 'running', 'done', 'failed', 'released', 'expired')),
    epoch               BIGINT NOT NULL CHECK (epoch >= 1),
    cpu_millis          BIGINT NOT NULL CHECK (cpu_millis > 0),
    memory_bytes        BIGINT NOT NULL CHECK (memory_bytes > 0),
    tier                TEXT NOT NULL,
    spread_group        TEXT NOT NULL,
    -- The berth.leases.v1.Workload message, protobuf-encoded.
    workload            BYTEA NOT NULL,
    reason              TEXT NOT NULL DEFAULT '',
    message             TEXT NOT NULL DEFAULT '',
    exit_code           BIGINT,
    created_at_ms       BIGINT NOT NULL,
    phase_changed_at_ms BIGINT NOT NULL,
    expires_at_ms       BIGINT,
    seq                 BIGINT NOT NULL,
    CONSTRAINT leases_one_per_idempotency_key UNIQUE (project, idempotency_key)
) WITH (fillfactor = 80);
CREATE INDEX leases_by_node ON leases (node_id, seq);
CREATE INDEX leases_by_project ON leases (project, created_at_ms);
CREATE INDEX leases_open_by_spread_group ON leases (project, spread_group, node_id)
    WHERE spread_group <> '' AND phase IN ('pending', 'bound', 'launching', 'running');
CREATE INDEX leases_final_by_age ON leases (phase_changed_at_ms)
    WHERE phase IN ('done', 'failed', 'released', 'expired');
