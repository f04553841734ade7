-- Each cache generation's OCI artifact in the cache registry, which a node
-- that does not hold the generation pulls by this digest; '' when it was not
-- pushed (no cache registry configured, or the push failed).
ALTER TABLE cache_generations ADD COLUMN artifact TEXT NOT NULL DEFAULT '';
