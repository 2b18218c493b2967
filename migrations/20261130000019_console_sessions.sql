-- Console sessions: a browser that logged in with an API token holds a random session id in an
-- HttpOnly cookie. Only the id's hash is stored, with the hash of the token used (a token taken
-- out of the configuration ends its sessions; the role is read from the configuration on every
-- request) and the session's CSRF secret for its forms.
CREATE TABLE trailmark.console_sessions (
    id_hash     TEXT PRIMARY KEY,
    token_hash  TEXT NOT NULL,
    csrf        TEXT NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    expires_at  TIMESTAMPTZ NOT NULL
);
CREATE INDEX console_sessions_expiry_idx ON trailmark.console_sessions (expires_at);
