-- A worker removes the rows it published itself by their row ids, which its commit statement
-- hands back, so the unique index on message ids (one more index entry per outbox row, about a
-- tenth of a step's WAL) goes. Message ids stay unique by construction (random, one per message);
-- the consumers' inboxes are what drop a repeated one. Older builds run on this schema (their
-- removal by message id reads the outbox without the index).
ALTER TABLE trailmark.outbox DROP CONSTRAINT outbox_message_id_key;
