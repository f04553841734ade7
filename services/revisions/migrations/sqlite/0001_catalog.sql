-- One row per service: the declaration as last applied (`template` and
-- `source`, the protobuf encodings of berth.revisions.v1.ServiceTemplate and
-- Source), the traffic pin, the revision serving now, and the status the
-- control plane observed (berth.revisions.v1.ServiceStatus, protobuf).
-- `uid` tells one incarnation of a name from the next: it is part of every
-- lease's owner and idempotency key. `version` grows with every write, so a
-- watcher tells a change from a repeat.
CREATE TABLE services (
    project         TEXT NOT NULL,
    name            TEXT NOT NULL,
    uid             TEXT NOT NULL,
    generation      BIGINT NOT NULL CHECK (generation >= 1),
    template        BLOB NOT NULL,
    source          BLOB NOT NULL,
    pinned_revision TEXT NOT NULL DEFAULT '',
    live_revision   TEXT NOT NULL DEFAULT '',
    status          BLOB NOT NULL,
    created_at_ms   BIGINT NOT NULL,
    updated_at_ms   BIGINT NOT NULL,
    version         BIGINT NOT NULL,
    PRIMARY KEY (project, name)
);

-- One row per revision: an immutable snapshot of a service's template and
-- source (`fingerprint` is the SHA-256 of their canonical encoding), the
-- digest its bundle resolved to (empty until it resolves; written once), how
-- resolution is going, and where its rollout stands (`state`).
CREATE TABLE revisions (
    project               TEXT NOT NULL,
    name                  TEXT NOT NULL,
    service               TEXT NOT NULL,
    generation            BIGINT NOT NULL,
    template              BLOB NOT NULL,
    source                BLOB NOT NULL,
    fingerprint           TEXT NOT NULL,
    digest                TEXT NOT NULL DEFAULT '',
    resolve_reason        TEXT NOT NULL DEFAULT '',
    resolve_message       TEXT NOT NULL DEFAULT '',
    resolve_attempts      BIGINT NOT NULL DEFAULT 0,
    resolve_changed_at_ms BIGINT NOT NULL,
    next_resolve_at_ms    BIGINT NOT NULL DEFAULT 0,
    state                 TEXT NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'ready', 'failed')),
    state_reason          TEXT NOT NULL DEFAULT '',
    state_message         TEXT NOT NULL DEFAULT '',
    state_changed_at_ms   BIGINT NOT NULL,
    rollout_started_at_ms BIGINT,
    replicas_running      BIGINT NOT NULL DEFAULT 0,
    created_at_ms         BIGINT NOT NULL,
    PRIMARY KEY (project, name)
);
CREATE INDEX revisions_by_service ON revisions (project, service, generation);

-- Services deleted while leases of theirs may still be open: the deploy
-- reconciler releases every lease the incarnation owns, then forgets the row.
CREATE TABLE deleted_services (
    project       TEXT NOT NULL,
    name          TEXT NOT NULL,
    uid           TEXT NOT NULL,
    deleted_at_ms BIGINT NOT NULL,
    PRIMARY KEY (project, name, uid)
);
