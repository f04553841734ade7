-- Where each replica listens on its node, as its node reported when it ran:
-- `name=port` pairs joined by commas, the first the one PORT names; empty
-- before that, and for a workload without ports.
ALTER TABLE leases ADD COLUMN ports TEXT NOT NULL DEFAULT '';
