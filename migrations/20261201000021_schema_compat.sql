-- Rolling upgrades run `trailmark migrate` before they replace the binaries, so the processes of
-- the older build go on for a while on a newer schema. `oldest_build` is the newest migration a
-- build must know to run on this schema: additive migrations (a table, a nullable column, an
-- index) leave it alone, and builds that know this rule keep running over them; a migration
-- older builds cannot run on (a dropped or renamed column, a new NOT NULL) sets it to its own
-- version, and older builds then refuse to start with advice.
CREATE TABLE trailmark.schema_compat (
    one           BOOLEAN PRIMARY KEY DEFAULT true CHECK (one),
    oldest_build  BIGINT NOT NULL
);
INSERT INTO trailmark.schema_compat (oldest_build) VALUES (20261201000021);
