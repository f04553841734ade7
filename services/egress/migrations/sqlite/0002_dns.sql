-- Each project's DNS config as applied (`spec`: the protobuf encoding of
-- berth.egress.v1.DnsConfig, canonical), in the shape of the other declared
-- objects so one path writes and reads them all: `name` is always 'dns' and
-- `status` is empty. `generation` grows with every apply that changed `spec`.
CREATE TABLE dns_configs (
    project       TEXT NOT NULL,
    name          TEXT NOT NULL,
    spec          BLOB NOT NULL,
    status        BLOB NOT NULL,
    generation    BIGINT NOT NULL CHECK (generation >= 1),
    created_at_ms BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL,
    PRIMARY KEY (project, name)
);
