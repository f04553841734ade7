-- A second node holding each volume's head. `follower` is the node that held
-- the head before the newest publish, when another node published it ('' for
-- none): it is asked (FollowCaches) to fetch each new head from the cache
-- registry, so that the volume's next lease finds a node holding its head
-- even when the sealer has no room. `cache_holders` keeps the newest
-- generation each following node reported holding; placement prefers a node
-- holding the head, sealer or holder alike.
ALTER TABLE cache_heads ADD COLUMN follower TEXT NOT NULL DEFAULT '';

CREATE TABLE cache_holders (
    project TEXT NOT NULL,
    cache_key TEXT NOT NULL,
    node_id TEXT NOT NULL,
    generation BIGINT NOT NULL CHECK (generation > 0),
    PRIMARY KEY (project, cache_key, node_id)
);
