-- Eager publish: a worker publishes the messages it just committed itself, right after the
-- commit, and the relay only picks a row up once `available_at` has passed. The relay stays the
-- safety net (a worker that dies between commit and publish delays its run by the grace period,
-- never loses a message); rows queued by operators and the supervisor are available at once.
ALTER TABLE trailmark.outbox ADD COLUMN available_at TIMESTAMPTZ NOT NULL DEFAULT now();
