-- The trace of the request that created each lease, so the node that
-- launches it reports its work in that trace. Empty for leases from before.
ALTER TABLE leases ADD COLUMN traceparent TEXT NOT NULL DEFAULT '';
