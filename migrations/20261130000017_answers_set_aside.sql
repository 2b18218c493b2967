-- Model answers an operator chose not to replay (`run resume --after-fix --ask-again`): the step
-- that stopped on them asks the model again, and the answers it had are kept here, word for word,
-- with the decision that set them aside. They were paid for, so the run's spending counts them.
CREATE TABLE trailmark.journal_set_aside (
    LIKE trailmark.journal INCLUDING DEFAULTS,
    set_aside_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX journal_set_aside_run_idx ON trailmark.journal_set_aside (run_id, seq);
