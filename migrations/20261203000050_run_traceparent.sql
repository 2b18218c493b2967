-- The run's W3C trace context (`traceparent`), set when the run starts: the parent of every step
-- attempt's span. Step messages carry it as a header; a step re-queued without one (an operator's
-- resume, a wake-up) finds it here. Nullable with no default, so adding it rewrites no row.
ALTER TABLE trailmark.runs ADD COLUMN traceparent text;
