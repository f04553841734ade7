-- Gateways and routes as declared (`spec`: the protobuf encoding of the
-- berth.egress.v1 Apply*Request with project and name cleared), with the
-- status the elected full pass last wrote (`status`: GatewayStatus or
-- RouteStatus, protobuf). `generation` grows with every apply that changed
-- `spec`; a status write never touches it.
CREATE TABLE gateways (
    project       TEXT NOT NULL,
    name          TEXT NOT NULL,
    spec          BLOB NOT NULL,
    status        BLOB NOT NULL,
    generation    BIGINT NOT NULL CHECK (generation >= 1),
    created_at_ms BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL,
    PRIMARY KEY (project, name)
);

CREATE TABLE routes (
    project       TEXT NOT NULL,
    name          TEXT NOT NULL,
    spec          BLOB NOT NULL,
    status        BLOB NOT NULL,
    generation    BIGINT NOT NULL CHECK (generation >= 1),
    created_at_ms BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL,
    PRIMARY KEY (project, name)
);

-- One compiled plan per project: `content` is the protobuf encoding of
-- berth.egress.v1.EgressPlan without its generation, node acks and compile
-- time, which are columns. `generation` grows only when `content` changes.
CREATE TABLE plans (
    project        TEXT PRIMARY KEY,
    generation     BIGINT NOT NULL CHECK (generation >= 1),
    content        BLOB NOT NULL,
    compiled_at_ms BIGINT NOT NULL
);

-- What each node was sent: its state's generation (grows with every change to
-- the set of plans it hosts or to one of those plans; a row is never deleted,
-- so it never goes back) and the generation it last acknowledged.
CREATE TABLE nodes (
    node_id          TEXT PRIMARY KEY,
    generation       BIGINT NOT NULL CHECK (generation >= 1),
    changed_at_ms    BIGINT NOT NULL,
    acked_generation BIGINT NOT NULL DEFAULT 0,
    acked_at_ms      BIGINT,
    ack_error        TEXT NOT NULL DEFAULT ''
);

-- The plans in each node's current state: one row per (node, project) hosted,
-- `plan_generation` always equal to plans.generation (both change in one
-- transaction, with nodes.generation), and the plan generation the node last
-- acknowledged applying, with how it enforces it
-- (berth.egress.v1.EgressEnforcement).
CREATE TABLE node_plans (
    node_id               TEXT NOT NULL,
    project               TEXT NOT NULL,
    plan_generation       BIGINT NOT NULL,
    acked_plan_generation BIGINT NOT NULL DEFAULT 0,
    acked_at_ms           BIGINT,
    ack_error             TEXT NOT NULL DEFAULT '',
    ack_enforcement       BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (node_id, project)
);
CREATE INDEX node_plans_by_project ON node_plans (project, node_id);
