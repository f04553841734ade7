-- Which of a node's certificates are still its own: those issued (their
-- notBefore, seconds) at or after the floor. Set at join and rejoin to the
-- issued certificate's; moved on when the node presents a renewed one, after
-- an overlap (`certificate_next_floor_s` from `certificate_floor_moves_at_ms`).
-- 0 refuses nothing: rows from before this column take a floor from their
-- node's next heartbeat.
ALTER TABLE nodes ADD COLUMN certificate_floor_s BIGINT NOT NULL DEFAULT 0;
ALTER TABLE nodes ADD COLUMN certificate_next_floor_s BIGINT NOT NULL DEFAULT 0;
ALTER TABLE nodes ADD COLUMN certificate_floor_moves_at_ms BIGINT NOT NULL DEFAULT 0;
