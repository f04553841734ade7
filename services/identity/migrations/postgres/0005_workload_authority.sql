-- Each authority serves one purpose: 'mesh' signs the mesh's certificates
-- (every row before this migration), 'workload' signs workloads' X.509-SVIDs,
-- under a root of its own that no mesh endpoint trusts. Each purpose has its
-- own single active authority.
ALTER TABLE authorities ADD COLUMN purpose TEXT NOT NULL DEFAULT 'mesh' CHECK (purpose IN ('mesh', 'workload'));
ALTER TABLE authorities DROP CONSTRAINT authorities_active_slot_key;
ALTER TABLE authorities ADD CONSTRAINT authorities_one_active_per_purpose UNIQUE (purpose, active_slot);
