-- How each service's traffic is split, as SetTraffic last declared it: the
-- protobuf encoding of its targets. Empty (all to the latest ready revision)
-- for services from before.
ALTER TABLE services ADD COLUMN traffic BLOB NOT NULL DEFAULT x'';
