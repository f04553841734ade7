-- When each revision last stopped taking traffic (a rollout moved past it,
-- a traffic split dropped it): its replicas are kept for the drain after
-- that, so routers stop sending to them before they are stopped. NULL for
-- a revision that never stopped taking traffic, and for those from before.
ALTER TABLE revisions ADD COLUMN unrouted_at_ms INTEGER;
