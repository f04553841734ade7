-- When a drained node's remaining leases are released: set by a drain given
-- a deadline, cleared by one without and when the drain is lifted. Leases
-- follows it from the node registry.
ALTER TABLE nodes ADD COLUMN drain_deadline_ms BIGINT;
