-- Which routers serve which routes. `route_generation` grows with each change
-- to what routers send a service's requests to (its live revision, its traffic
-- split); a revision traffic left records the generation that left it out
-- (`unrouted_generation`), and is stopped once every router alive
-- acknowledged that generation or a later one, or after the drain.
ALTER TABLE services ADD COLUMN route_generation INTEGER NOT NULL DEFAULT 0;
ALTER TABLE revisions ADD COLUMN unrouted_generation INTEGER;

-- Each router replica's last call: it is alive while this is recent.
CREATE TABLE routers (
    router     TEXT NOT NULL,
    instance   TEXT NOT NULL,
    seen_at_ms INTEGER NOT NULL,
    PRIMARY KEY (router, instance)
);

-- The newest route generation each router replica acknowledged for each
-- service.
CREATE TABLE route_acks (
    router       TEXT NOT NULL,
    instance     TEXT NOT NULL,
    project      TEXT NOT NULL,
    service      TEXT NOT NULL,
    generation   INTEGER NOT NULL,
    acked_at_ms  INTEGER NOT NULL,
    PRIMARY KEY (project, service, router, instance)
);
