//! Workflow definitions: named, versioned lists of steps with declared kinds, compensations,
//! key recipes and the rules for when a person must decide.

use std::future::Future;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde_json::Value;

use super::{Handler, Next, StepContext, StepError, StepKind, StepOutcome};
use crate::domain::StepAddress;
use crate::guard::Budget;

/// How to undo a `write` or `message` step: a handler that posts reversals (new entries that point
/// at the originals; nothing is deleted), each under the key `undo:<original key>`.
#[derive(Clone)]
pub struct Compensation {
    /// What it does, for `trailmark contract` (e.g. "posts a reversal entry per adjustment").
    pub note: String,
    /// The code; it reads the original step through `ctx.undo()`.
    pub handler: Handler,
    /// Lists the reversals the code would write, for an undo's preview (optional).
    pub reversals: Option<super::reversal::Lister>,
}

/// One declared step.
#[derive(Clone)]
pub struct StepDef {
    /// Name, unique within the workflow.
    pub name: String,
    /// Declared kind.
    pub kind: StepKind,
    /// The code.
    pub handler: Handler,
    /// How to undo it (write and message steps).
    pub compensation: Option<Compensation>,
    /// How its idempotency keys are built, for `trailmark contract` (e.g. `run_id:invoice_no:line:kind`).
    pub key_recipe: Option<String>,
    /// Run only when no item of the run is in doubt (nothing parked, no effect of unknown
    /// outcome); otherwise wait for a person with the evidence attached.
    pub freeze_unless_clear: bool,
    /// Where a rejected human step sends the run (`None`: the run is cancelled).
    pub on_reject: Option<String>,
}

/// The type a workflow's input must have: parsed from the run-start event's `input` (declare it
/// with `#[serde(deny_unknown_fields)]` so that a misspelt field is refused, not ignored), then
/// checked. An input that fails either is refused before the run exists: `trailmark run start`
/// says why at once, and a worker dead-letters such an event as `bad_input`.
pub trait Input: DeserializeOwned {
    /// Checks what the type cannot say (ranges, formats); the error says what to fix.
    fn check(&self) -> Result<(), String> {
        Ok(())
    }
}

/// A workflow's input check, as declared with [`Workflow::input`].
type InputCheck = Arc<dyn Fn(&Value) -> Result<(), String> + Send + Sync>;

/// A named, versioned workflow.
#[derive(Clone)]
pub struct Workflow {
    /// Name used in run-start events.
    pub name: String,
    /// Version recorded on each run; a step message for an unknown version is dead-lettered.
    pub version: i32,
    /// Steps in declaration order; the first one starts every run.
    pub steps: Vec<StepDef>,
    /// Per-run budget; `None` uses the configured default.
    pub budget: Option<Budget>,
    /// The check of a run's input; `None` accepts any JSON.
    input: Option<InputCheck>,
    /// How its runs share capacity: concurrency keys and limits, debounce of starts.
    pub flow: crate::flow::Rules,
}

fn boxed<F, Fut>(handler: F) -> Handler
where
    F: Fn(StepContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<StepOutcome, StepError>> + Send + 'static,
{
    Arc::new(move |ctx| Box::pin(handler(ctx)))
}

impl Workflow {
    /// An empty workflow.
    pub fn new(name: impl Into<String>, version: i32) -> Self {
        Self {
            name: name.into(),
            version,
            steps: Vec::new(),
            budget: None,
            input: None,
            flow: crate::flow::Rules::default(),
        }
    }

    /// Declares the type of this workflow's input (builder style); see [`Input`].
    pub fn input<T: Input>(mut self) -> Self {
        self.input = Some(Arc::new(|value: &Value| {
            // serde reads a struct from an array too ([1, 2] as the first two fields).
            if !value.is_object() {
                return Err(format!("the input must be a JSON object, got {value}"));
            }
            let parsed: T = serde_json::from_value(value.clone()).map_err(|e| e.to_string())?;
            parsed.check()
        }));
        self
    }

    /// Whether `input` is one this workflow accepts; the error says what is wrong with it.
    pub fn check_input(&self, input: &Value) -> Result<(), String> {
        if let Some(check) = &self.input {
            check(input)?;
        }
        self.flow.key_of(input).map_err(|e| e.to_string())?;
        // A debounced start is held under its key: one without a fit key would wait for ever.
        if let Some(d) = &self.flow.debounce {
            d.key.value_in(input).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Sets this workflow's per-run budget (builder style).
    pub fn with_budget(mut self, budget: Budget) -> Self {
        self.budget = Some(budget);
        self
    }

    /// Limits how many of its runs hold a step at once, per key and in all (builder style):
    /// `Workflow::new("chain", 1).concurrency(Concurrency::per_key("tenant", 2)?)`.
    pub fn concurrency(mut self, limits: crate::flow::Concurrency) -> Self {
        self.flow.concurrency = Some(limits);
        self
    }

    /// Debounces its run starts per key: of a burst, only the last start runs (builder style).
    pub fn debounce(mut self, debounce: crate::flow::Debounce) -> Self {
        self.flow.debounce = Some(debounce);
        self
    }

    /// Adds a step (builder style).
    pub fn step<F, Fut>(mut self, name: &str, kind: StepKind, handler: F) -> Self
    where
        F: Fn(StepContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<StepOutcome, StepError>> + Send + 'static,
    {
        self.steps.push(StepDef {
            name: name.to_owned(),
            kind,
            handler: boxed(handler),
            compensation: None,
            key_recipe: None,
            freeze_unless_clear: false,
            on_reject: None,
        });
        self
    }

    fn last(&mut self) -> &mut StepDef {
        self.steps
            .last_mut()
            .expect("declare a step before its compensation, key recipe or rules")
    }

    /// Declares how to undo the step added last. The compensation runs newest first during an
    /// undo, reads what the step did through `ctx.undo()`, and writes reversals under the keys
    /// `undo:<original key>`.
    ///
    /// ```
    /// # use serde_json::json;
    /// # use trailmark::domain::IdempotencyKey;
    /// # use trailmark::workflow::{StepKind, StepOutcome, Workflow};
    /// let wf = Workflow::new("pay", 1)
    ///     .step("post", StepKind::Write, |ctx| async move {
    ///         let key = IdempotencyKey::for_step(ctx.run_id(), "post", "invoice-7");
    ///         ctx.effect(&key, &json!({ "amount": 10 }), |_key| async { Ok(json!("posted")) })
    ///             .await?;
    ///         Ok(StepOutcome::finish(json!({ "invoice": "invoice-7" })))
    ///     })
    ///     .compensate("posts a reversal per entry", |ctx| async move {
    ///         let posted = ctx.undo().expect("runs as a compensation").output.clone();
    ///         let key = IdempotencyKey::for_step(ctx.run_id(), "post", "invoice-7").undo_of();
    ///         ctx.effect(&key, &posted, |_key| async { Ok(json!("reversed")) }).await?;
    ///         Ok(StepOutcome::next(json!({ "reversed": posted })))
    ///     });
    /// assert!(wf.find("post").unwrap().compensation.is_some());
    /// ```
    pub fn compensate<F, Fut>(mut self, note: &str, handler: F) -> Self
    where
        F: Fn(StepContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<StepOutcome, StepError>> + Send + 'static,
    {
        self.last().compensation = Some(Compensation {
            note: note.to_owned(),
            handler: boxed(handler),
            reversals: None,
        });
        self
    }

    /// Declares how to list, before an undo runs, the reversals the compensation declared last
    /// would write (for the preview a person confirms). Build the keys with the same code the
    /// compensation uses, so the preview is exactly what runs.
    ///
    /// ```
    /// # use serde_json::json;
    /// # use trailmark::workflow::{Reversal, StepKind, StepOutcome, Workflow};
    /// let wf = Workflow::new("pay", 1)
    ///     .step("post", StepKind::Write, |_ctx| async { Ok(StepOutcome::finish(json!({}))) })
    ///     .compensate("posts a reversal", |_ctx| async { Ok(StepOutcome::next(json!({}))) })
    ///     .reversals(|p| async move {
    ///         let key = format!("undo:{}:post:invoice-7", p.run_id());
    ///         Ok(vec![Reversal { key, what: "reverse invoice-7".into() }])
    ///     });
    /// assert!(wf.find("post").unwrap().compensation.as_ref().unwrap().reversals.is_some());
    /// ```
    pub fn reversals<F, Fut>(mut self, lister: F) -> Self
    where
        F: Fn(super::PreviewContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Vec<super::Reversal>, StepError>> + Send + 'static,
    {
        let compensation = self
            .last()
            .compensation
            .as_mut()
            .expect("declare the compensation before its reversals");
        compensation.reversals = Some(Arc::new(move |p| Box::pin(lister(p))));
        self
    }

    /// Documents how the step added last builds its idempotency keys.
    pub fn key_recipe(mut self, recipe: &str) -> Self {
        self.last().key_recipe = Some(recipe.to_owned());
        self
    }

    /// Freezes the step added last unless no item of the run is in doubt.
    pub fn freeze_unless_clear(mut self) -> Self {
        self.last().freeze_unless_clear = true;
        self
    }

    /// Sends the run to `step` when the human step added last is rejected.
    pub fn on_reject(mut self, step: &str) -> Self {
        self.last().on_reject = Some(step.to_owned());
        self
    }

    /// The step called `name`.
    pub fn find(&self, name: &str) -> Option<&StepDef> {
        self.steps.iter().find(|s| s.name == name)
    }

    /// The step every run starts with.
    pub fn first_step(&self) -> Option<StepAddress> {
        self.steps
            .first()
            .map(|s| StepAddress::step(s.name.as_str()))
    }

    /// Resolves `next` after `current` to a step, or `None` when the run ends.
    pub fn resolve_next(
        &self,
        current: &StepAddress,
        next: &Next,
    ) -> Result<Option<StepAddress>, StepError> {
        match next {
            Next::Finish => Ok(None),
            Next::Continue | Next::Wait => {
                let pos = self.steps.iter().position(|s| current == s.name.as_str());
                Ok(pos
                    .and_then(|p| self.steps.get(p + 1))
                    .map(|s| StepAddress::step(s.name.as_str())))
            }
            Next::Goto(name) if self.find(name).is_some() => {
                Ok(Some(StepAddress::step(name.as_str())))
            }
            Next::Goto(name) => Err(StepError::Unknown(format!(
                "step {current} chose next step {name:?}, which workflow {} v{} does not declare",
                self.name, self.version
            ))),
        }
    }
}
