//! Traces across every hop: one run is one trace, exported with OTLP/HTTP when configured.
//!
//! Where a run starts (a run-start message, `POST /api/v1/runs`, `trailmark run start`, a
//! schedule) the caller's W3C `traceparent` is read, or a new trace begins; a `run <workflow>`
//! span marks the start and its context is the run's: stored on the run row and carried, as a
//! `traceparent` header, by every step message of the run (through the outbox and the relay
//! unchanged). Each step attempt is a `step <name>` span whose parent is that run context, not
//! the previous step's span: a re-queued or redelivered step (a crash, an expired lease, a
//! resume) has the same parent as its first attempt, so both attempts sit side by side in the
//! trace. Model calls (`chat <model>`, OpenTelemetry GenAI attributes) and outside writes
//! (`effect <tool>`) are children of their step attempt's span; an answer or a result served
//! from the journal makes no span, it is counted on the step span instead.
//!
//! Off by default: without an endpoint no exporter exists, [`enabled`] is false, and every
//! function here returns at once; a caller's `traceparent` is still passed along as a header
//! copy, so services after trailmark stay in the caller's trace.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{
    Span as _, SpanKind, Status, TraceContextExt, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SdkTracer, SdkTracerProvider,
};

use crate::config::TracingSettings;

/// The W3C header (AMQP or HTTP) that carries a trace context, and the name the run row and
/// step messages keep it under.
pub const TRACEPARENT: &str = "traceparent";

/// The environment variables of the standard OTLP exporter configuration that turn tracing on.
const ENDPOINT_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
];

/// The process's tracer, set once by [`init`] when an endpoint is configured.
static TRACER: OnceLock<SdkTracer> = OnceLock::new();

/// Why tracing could not start.
#[derive(Debug, thiserror::Error)]
#[error(
    "the OTLP trace exporter cannot start: {0}; fix tracing.otlp_endpoint (TRAILMARK__TRACING__OTLP_ENDPOINT) or OTEL_EXPORTER_OTLP_ENDPOINT, or leave both empty to run without traces"
)]
pub struct InitError(String);

/// The running exporter; dropping it sends the spans still queued (for at most 2 s).
pub struct Exporting {
    provider: SdkTracerProvider,
}

impl Drop for Exporting {
    fn drop(&mut self) {
        let _ = self.provider.shutdown_with_timeout(Duration::from_secs(2));
    }
}

/// Starts exporting spans when an endpoint is configured (`tracing.otlp_endpoint`, else the
/// standard `OTEL_EXPORTER_OTLP_ENDPOINT`); `None` when tracing stays off or was started before.
/// Long-running processes call it once at start and keep the guard until they exit.
pub fn init(settings: &TracingSettings) -> Result<Option<Exporting>, InitError> {
    let from_env = ENDPOINT_VARS
        .iter()
        .any(|v| std::env::var(v).is_ok_and(|s| !s.is_empty()));
    if (settings.otlp_endpoint.is_empty() && !from_env) || TRACER.get().is_some() {
        return Ok(None);
    }
    let mut exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary);
    if !settings.otlp_endpoint.is_empty() {
        // The same rule as OTEL_EXPORTER_OTLP_ENDPOINT: a base URL, the signal's path added.
        let base = settings.otlp_endpoint.trim_end_matches('/');
        exporter = exporter.with_endpoint(format!("{base}/v1/traces"));
    }
    let exporter = exporter.build().map_err(|e| InitError(e.to_string()))?;
    let mut batch = BatchConfigBuilder::default();
    if settings.export_interval_ms > 0 {
        batch = batch.with_scheduled_delay(Duration::from_millis(settings.export_interval_ms));
    }
    let processor = BatchSpanProcessor::builder(exporter)
        .with_batch_config(batch.build())
        .build();
    let mut resource = Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name("trailmark");
    }
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_resource(resource.build())
        .build();
    if TRACER.set(provider.tracer("trailmark")).is_err() {
        return Ok(None);
    }
    tracing::info!("exporting traces with OTLP/HTTP");
    Ok(Some(Exporting { provider }))
}

/// Whether spans are made and exported in this process.
pub fn enabled() -> bool {
    TRACER.get().is_some()
}

/// The trace context in a `traceparent` value, if it is a valid one.
fn extract(traceparent: &str) -> Option<Context> {
    let carrier = HashMap::from([(TRACEPARENT.to_owned(), traceparent.to_owned())]);
    let cx = TraceContextPropagator::new().extract(&carrier);
    cx.span().span_context().is_valid().then_some(cx)
}

/// `cx` as a `traceparent` value.
fn inject(cx: &Context) -> Option<String> {
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(cx, &mut carrier);
    carrier.remove(TRACEPARENT)
}

/// The trace context of a new run, to store on its row and carry on its step messages: a
/// `run <workflow>` span, child of the caller's context when `caller` is a valid `traceparent`,
/// else the first span of a new trace. With tracing off: the caller's valid context unchanged.
pub fn run_started(caller: Option<&str>, run_id: &str, workflow: &str) -> Option<String> {
    let parent = caller.and_then(extract);
    let Some(tracer) = TRACER.get() else {
        return parent.and(caller.map(str::to_owned));
    };
    let parent = parent.unwrap_or_default();
    let mut span = tracer
        .span_builder(format!("run {workflow}"))
        .with_kind(SpanKind::Consumer)
        .with_attributes([
            KeyValue::new("trailmark.run.id", run_id.to_owned()),
            KeyValue::new("trailmark.workflow", workflow.to_owned()),
        ])
        .start_with_context(tracer, &parent);
    let context = span.span_context().clone();
    span.end();
    inject(&Context::new().with_remote_span_context(context))
}

/// The span of one step attempt, while it runs (nothing when tracing is off).
#[derive(Clone, Default)]
pub struct StepSpan(Option<Context>);

/// Where a step attempt is, for its span's attributes.
#[derive(Clone, Copy)]
pub struct Attempt<'a> {
    /// The run.
    pub run_id: &'a str,
    /// The step's address.
    pub step: &'a str,
    /// Its position in the run.
    pub seq: i32,
    /// Which attempt at that position (1-based, counted across crashes).
    pub attempt: i32,
    /// The fence the attempt holds.
    pub fence: i64,
}

impl Attempt<'_> {
    /// The span of this attempt, not started yet, with the attributes every step span has.
    fn span(&self) -> opentelemetry::trace::SpanBuilder {
        opentelemetry::trace::SpanBuilder::from_name(format!("step {}", self.step))
            .with_kind(SpanKind::Consumer)
            .with_attributes([
                KeyValue::new("trailmark.run.id", self.run_id.to_owned()),
                KeyValue::new("trailmark.step", self.step.to_owned()),
                KeyValue::new("trailmark.step.position", i64::from(self.seq)),
                KeyValue::new("trailmark.step.attempt", i64::from(self.attempt)),
                KeyValue::new("trailmark.fence", self.fence),
            ])
    }
}

/// The status of an attempt whose worker stopped (kill -9, a lost host) before it committed.
pub const INTERRUPTED: &str =
    "attempt interrupted: its worker stopped before committing (lease taken over)";

/// Records the span of an attempt that never ended its own (its process died with it), from
/// what Postgres knows: `at` names it, `start`..`end` is the window the caller knows it lay in
/// (see `worker::step`). Child of the run context like every attempt, status error.
pub fn interrupted(
    run_trace: Option<&str>,
    at: &Attempt<'_>,
    (start, end): (SystemTime, SystemTime),
) {
    let Some(tracer) = TRACER.get() else {
        return;
    };
    let parent = run_trace.and_then(extract).unwrap_or_default();
    let mut span = at
        .span()
        .with_start_time(start)
        .start_with_context(tracer, &parent);
    span.set_attribute(KeyValue::new("trailmark.step.outcome", "interrupted"));
    span.set_attribute(KeyValue::new("trailmark.step.reconstructed", true));
    span.set_status(Status::error(INTERRUPTED));
    span.end_with_timestamp(end);
}

impl StepSpan {
    /// Starts the span of a step attempt, child of the run context `run_trace` (a new trace
    /// when the run has none, e.g. one started before tracing was turned on).
    pub fn start(run_trace: Option<&str>, at: &Attempt<'_>) -> Self {
        let Some(tracer) = TRACER.get() else {
            return Self(None);
        };
        let parent = run_trace.and_then(extract).unwrap_or_default();
        let span = at.span().start_with_context(tracer, &parent);
        Self(Some(parent.with_span(span)))
    }

    /// Records an attribute on the step span (a count of journaled answers served, ...).
    pub fn set(&self, attribute: KeyValue) {
        if let Some(cx) = &self.0 {
            cx.span().set_attribute(attribute);
        }
    }

    /// Ends the span with how the attempt ended (`committed`, `retry`, `review`, ...).
    pub fn end(&self, outcome: &str) {
        if let Some(cx) = &self.0 {
            let span = cx.span();
            span.set_attribute(KeyValue::new("trailmark.step.outcome", outcome.to_owned()));
            if outcome == "infrastructure" || outcome == "review" {
                span.set_status(Status::error(outcome.to_owned()));
            }
            span.end();
        }
    }

    /// Starts a child span of this step attempt; `name` is built only when tracing is on.
    pub fn child(&self, name: impl FnOnce() -> String, attributes: Vec<KeyValue>) -> ChildSpan {
        let (Some(cx), Some(tracer)) = (&self.0, TRACER.get()) else {
            return ChildSpan(None);
        };
        let span = tracer
            .span_builder(name())
            .with_kind(SpanKind::Client)
            .with_attributes(attributes)
            .start_with_context(tracer, cx);
        ChildSpan(Some(cx.with_span(span)))
    }

    /// Whether spans are being made for this attempt (skip building attributes otherwise).
    pub fn is_recording(&self) -> bool {
        self.0.is_some()
    }
}

/// A model call's or an outside write's span under its step attempt's.
pub struct ChildSpan(Option<Context>);

impl ChildSpan {
    /// Ends the span with its final attributes, as an error when `error` says why it failed.
    pub fn end(self, attributes: impl FnOnce() -> Vec<KeyValue>, error: Option<String>) {
        let Some(cx) = self.0 else {
            return;
        };
        let span = cx.span();
        span.set_attributes(attributes());
        if let Some(why) = error {
            span.set_status(Status::error(why));
        }
        span.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_valid_caller_context_passes_through_while_tracing_is_off() {
        let caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(run_started(Some(caller), "r", "w").as_deref(), Some(caller));
        assert_eq!(run_started(Some("garbage"), "r", "w"), None);
        assert_eq!(run_started(None, "r", "w"), None);
        assert!(
            !StepSpan::start(
                Some(caller),
                &Attempt {
                    run_id: "r",
                    step: "s",
                    seq: 0,
                    attempt: 1,
                    fence: 1
                }
            )
            .is_recording()
        );
    }
}
