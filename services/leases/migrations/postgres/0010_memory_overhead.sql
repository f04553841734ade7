-- What a lease holds of its node's memory beyond its size (a microVM's VMM,
-- and the rest of the smallest guest when it asked for less), charged at
-- placement from its node's labels and given back with the rest of its
-- reservation, so the node row's allocation stays the sum of its open
-- leases' reservations whatever the node declares later.
ALTER TABLE leases ADD COLUMN memory_overhead_bytes BIGINT NOT NULL DEFAULT 0;
