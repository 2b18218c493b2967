-- One definition of "the process behind this presence pid has died" (see worker::presence), for
-- both users: the claim (a dead worker's lease is free) and the relay (a dead worker's held
-- outbox rows are published at once). Postgres ends a backend as soon as its client's socket
-- closes, so a pid missing from pg_stat_activity means the client process is gone.
CREATE FUNCTION trailmark.process_gone(presence_pid INTEGER) RETURNS BOOLEAN
    LANGUAGE sql STABLE
    AS $$ SELECT presence_pid IS NOT NULL
                 AND NOT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = presence_pid) $$;
