-- The lease change log `WatchLeases` resumes from. Every change a watcher sees
-- (insert; phase, epoch, node or reason moved) stamps the lease's `change_seq`
-- with the id of the transaction that made it; a renewal alone does not, so
-- it stays a heap-only update. A reader's cursor is the oldest transaction
-- still running when it read (`pg_snapshot_xmin`): every change stamped below
-- it was committed and seen, and one made later carries an id at or above it,
-- so `change_seq >= cursor` finds everything the reader has not seen (and
-- perhaps a few it has, which a watcher sends again unchanged).
-- `resume_floor` is the highest `change_seq` of a lease forgotten after its
-- retention: a cursor at or below it cannot be resumed from. `last_seq` is
-- the embedded store's counter and stays 0 here.
ALTER TABLE leases ADD COLUMN change_seq BIGINT NOT NULL DEFAULT 0;
CREATE INDEX leases_by_change ON leases (change_seq);

CREATE TABLE lease_changes (
    id           INTEGER PRIMARY KEY CHECK (id = 1),
    last_seq     BIGINT NOT NULL DEFAULT 0,
    resume_floor BIGINT NOT NULL DEFAULT 0
);
INSERT INTO lease_changes (id) VALUES (1);

CREATE FUNCTION leases_stamp_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.change_seq := pg_current_xact_id()::text::bigint;
    RETURN NEW;
END
$$;

CREATE TRIGGER leases_stamp_change
    BEFORE INSERT OR UPDATE OF phase, epoch, node_id, reason ON leases
    FOR EACH ROW EXECUTE FUNCTION leases_stamp_change();
