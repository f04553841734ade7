-- Cache volumes. Each (project, key) has published generations, numbered
-- from 1 and never reused (`last_generation` outlives a rollback and a
-- delete), whose content is sealed on the node that published it and named
-- by its digest; `cache_heads.generation` names the one new leases start
-- from. Publishing is a compare-and-swap of the head row from the
-- generation the lease's view started from (0: none), so of two leases that
-- started from one head exactly one publishes. A generation row is written
-- in the same transaction as the head moves to it, so no head names a
-- generation that is not recorded.
CREATE TABLE cache_heads (
    project TEXT NOT NULL,
    cache_key TEXT NOT NULL,
    generation BIGINT NOT NULL CHECK (generation >= 0),
    last_generation BIGINT NOT NULL CHECK (last_generation >= generation),
    PRIMARY KEY (project, cache_key)
);

CREATE TABLE cache_generations (
    project TEXT NOT NULL,
    cache_key TEXT NOT NULL,
    generation BIGINT NOT NULL CHECK (generation > 0),
    digest TEXT NOT NULL,
    size_bytes BIGINT NOT NULL CHECK (size_bytes >= 0),
    lease_id TEXT NOT NULL,
    -- The node that sealed it, which holds it: placement prefers it for the
    -- volume's next lease.
    node_id TEXT NOT NULL,
    published_at_ms BIGINT NOT NULL,
    -- 1 while pinned: never collected.
    pinned BIGINT NOT NULL DEFAULT 0 CHECK (pinned IN (0, 1)),
    PRIMARY KEY (project, cache_key, generation)
);

-- Projects whose cache volumes are turned off: a lease opening one gets an
-- empty view and publishes nothing.
CREATE TABLE cache_disabled (
    project TEXT PRIMARY KEY
);

-- What each cache volume of a lease did (berth.leases.v1.CacheObservation,
-- encoded as repeated field 1 of a message): written only by the lease's
-- node through OpenCache and CommitCache, the first outcome of each kept.
ALTER TABLE leases ADD COLUMN cache BYTEA NOT NULL DEFAULT ''::bytea;
