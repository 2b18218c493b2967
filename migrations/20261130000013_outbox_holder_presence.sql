-- A row the committing worker publishes itself carries that worker's presence backend pid (see
-- worker::presence). When that backend is gone (the worker died between its commit and its
-- publish), the relay takes the row at once instead of waiting out `relay.eager_grace_ms`, the
-- same way a dead worker's leases are free at once.
ALTER TABLE trailmark.outbox ADD COLUMN holder_pid INTEGER;
