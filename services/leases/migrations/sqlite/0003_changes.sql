-- The lease change log `WatchLeases` resumes from. Every change a watcher sees
-- (insert; phase, epoch, node or reason moved) stamps the lease's `change_seq`
-- with the next number of `last_seq`; a renewal alone does not. Writers are
-- serialised here, so numbers follow commit order, and a reader's cursor is
-- `last_seq + 1` as it read: `change_seq >= cursor` finds everything it has
-- not seen. `resume_floor` is the highest `change_seq` of a lease forgotten
-- after its retention: a cursor at or below it cannot be resumed from.
ALTER TABLE leases ADD COLUMN change_seq BIGINT NOT NULL DEFAULT 0;
CREATE INDEX leases_by_change ON leases (change_seq);

CREATE TABLE lease_changes (
    id           INTEGER PRIMARY KEY CHECK (id = 1),
    last_seq     BIGINT NOT NULL DEFAULT 0,
    resume_floor BIGINT NOT NULL DEFAULT 0
);
INSERT INTO lease_changes (id) VALUES (1);

CREATE TRIGGER leases_stamp_insert AFTER INSERT ON leases
BEGIN
    UPDATE lease_changes SET last_seq = last_seq + 1;
    UPDATE leases SET change_seq = (SELECT last_seq FROM lease_changes) WHERE lease_id = NEW.lease_id;
END;

CREATE TRIGGER leases_stamp_change AFTER UPDATE OF phase, epoch, node_id, reason ON leases
BEGIN
    UPDATE lease_changes SET last_seq = last_seq + 1;
    UPDATE leases SET change_seq = (SELECT last_seq FROM lease_changes) WHERE lease_id = NEW.lease_id;
END;
