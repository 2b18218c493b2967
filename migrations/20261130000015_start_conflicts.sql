-- Same key, different payload is an error for the events that start runs too: the inbox keeps a
-- hash of each run-start event's body, so an event that reuses a processed message id with
-- another body is told apart from a repeat of the same event. Step messages (written by trailmark
-- itself with fresh ids) leave it NULL.
ALTER TABLE trailmark.inbox ADD COLUMN body_hash TEXT;
