-- The Postgres backend pid of the lease holder's presence connection. A process killed with
-- kill -9 loses its connections at once, so its leases become claimable immediately instead of
-- after lease_secs; a frozen process keeps its connection and its lease until it expires.
ALTER TABLE trailmark.runs ADD COLUMN lease_pid INTEGER;
