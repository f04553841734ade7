-- A lease's last in-place resize. `resize_state` is '' (never resized),
-- 'pending', 'applied' or 'deferred'; `resize_cpu_millis` and
-- `resize_memory_bytes` are the size asked for. While one is pending the
-- lease's node row reserves the larger of `cpu_millis`/`memory_bytes` and the
-- asked size in each dimension; once applied the lease's own columns are the
-- new size. A resize is a change watchers and the node see, so it stamps
-- `change_seq` like a phase move.
ALTER TABLE leases ADD COLUMN resize_state TEXT NOT NULL DEFAULT ''
    CHECK (resize_state IN ('', 'pending', 'applied', 'deferred'));
ALTER TABLE leases ADD COLUMN resize_cpu_millis BIGINT NOT NULL DEFAULT 0 CHECK (resize_cpu_millis >= 0);
ALTER TABLE leases ADD COLUMN resize_memory_bytes BIGINT NOT NULL DEFAULT 0 CHECK (resize_memory_bytes >= 0);
ALTER TABLE leases ADD COLUMN resize_reason TEXT NOT NULL DEFAULT '';
ALTER TABLE leases ADD COLUMN resize_message TEXT NOT NULL DEFAULT '';

DROP TRIGGER leases_stamp_change;
CREATE TRIGGER leases_stamp_change
    AFTER UPDATE OF phase, epoch, node_id, reason, resize_state, resize_cpu_millis, resize_memory_bytes ON leases
BEGIN
    UPDATE lease_changes SET last_seq = last_seq + 1;
    UPDATE leases SET change_seq = (SELECT last_seq FROM lease_changes) WHERE lease_id = NEW.lease_id;
END;
