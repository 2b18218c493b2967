//! The drive loop: the drill's environment and processes, the control run, the runs, each
//! fault at its moment, forced reviews resumed, and the wait until every run has settled.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

use super::check;
use super::events::Events;
use super::fleet::Fleet;
use super::keys::{KeyFigures, Keyed};
use super::proxy::Proxy;
use super::python::{self, Python};
use super::report::{EngineSeams, FaultFigures, Report};
use super::schedule::{self, Fault, Planned, Rng};
use super::tap::Tap;
use super::{Config, Error, RUN_PREFIX, Result, Target, faults, say};
use trailmark::broker::Outgoing;
use trailmark::config::Settings;
use trailmark::domain::{RunId, RunStartEvent};
use trailmark::engine::Engine;
use trailmark::failpoint::Failpoints;
use trailmark::inspect;
use trailmark::operator::{self, Decider, Resume};
use trailmark::seams::{self, Seam};
use trailmark::workflow::Registry;
use trailmark_bench::env::BenchEnv;

/// Everything a drill holds while it runs.
struct Drill<'a> {
    env: BenchEnv,
    cfg: &'a Config,
    engine: std::sync::Arc<Engine>,
    fleet: Fleet,
    rng: Rng,
    vhost: Option<&'a str>,
    proxies: Vec<Proxy>,
    calls_dir: std::path::PathBuf,
    /// The Python step endpoint, in a drill of `pychain`.
    python: Option<Python>,
    poison: Vec<String>,
    /// Each fault's name and moment; recovery is read from the steps' commit times at the end.
    moments: Vec<Moment>,
    /// The drill's run ids, for the runs' waits at the end.
    ids: Vec<String>,
    injected: BTreeMap<Fault, u32>,
    reviews_resumed: i64,
    /// The runs' events, when they wait for one.
    events: Option<Events>,
    /// The concurrency keys the runs are spread over (`--tenants`), and what was seen of them.
    keyed: Option<Keyed>,
    key_figures: Option<KeyFigures>,
}

/// Runs the whole drill in its own environment, which is removed afterwards (unless kept)
/// whatever happened.
pub async fn run(
    base: &Settings,
    registry: Registry,
    target: &Target,
    cfg: &Config,
    vhost: Option<&str>,
    keyed: Option<Keyed>,
) -> Result<Report> {
    let mut env = BenchEnv::create_named(base, None, "drill").await?;
    say(
        cfg,
        &format!(
            "database {}, broker prefix {}, logs in {}",
            env.db_name,
            env.prefix,
            env.log_dir.display()
        ),
    );
    let mut target = target.clone();
    let outcome = match prepare(&mut env, cfg, &mut target).await {
        Ok(owned) => drive(env, registry, &target, cfg, (vhost, keyed), owned).await,
        Err(e) => Err((e, env)),
    };
    let (result, env) = match outcome {
        Ok((report, env)) => (Ok(report), env),
        Err((e, env)) => (Err(e), env),
    };
    if let Some(receiver) = target.receiver.as_ref().filter(|_| !cfg.keep)
        && let Err(e) = receiver.teardown(&env.settings).await
    {
        tracing::warn!(error = %e, "the drill could not remove its receiver's tables");
    }
    if cfg.keep {
        say(cfg, &kept(&env.db_name, &env.prefix, vhost));
    } else {
        let log_dir = env.log_dir.clone();
        let left = env.teardown().await;
        if !left.is_empty() {
            tracing::warn!(left = ?left, "the drill could not remove everything it created");
        }
        // The processes' logs and call logs are evidence only when a promise broke.
        if matches!(&result, Ok(report) if report.ok()) {
            let _ = std::fs::remove_dir_all(&log_dir);
        } else {
            say(
                cfg,
                &format!("logs kept in {} for a look", log_dir.display()),
            );
        }
    }
    result
}

/// What the drill starts beside its processes.
struct Owned {
    proxies: Vec<Proxy>,
    calls_dir: std::path::PathBuf,
    python: Option<Python>,
}

/// The children's settings: a short lease, the engine seams, the proxies when latency is
/// drilled, and the Python step endpoint in a drill of `pychain`.
async fn prepare(env: &mut BenchEnv, cfg: &Config, target: &mut Target) -> Result<Owned> {
    if let Some(receiver) = &target.receiver {
        let prepared = receiver
            .prepare(&env.settings, target.input.clone())
            .await?;
        target.input = prepared.input;
        for (k, v) in &prepared.child_env {
            env.set_child_env(k, v);
        }
    }
    if let Some(program) = &cfg.program {
        env.exe = program.clone();
    }
    if let Some(n) = cfg.worker_concurrency {
        env.set_child_env("TRAILMARK__WORKER__CONCURRENCY", &n.to_string());
    }
    // Started first: its ledger pool is counted as one more process's connections, and every
    // process below gets its environment.
    let python = if python::serves(&target.workflow) {
        Some(Python::start(env, cfg.seed).await?)
    } else {
        None
    };
    // Every process gets the pool that lets all of them fit in the server's free connections.
    let processes = cfg.workers + cfg.relays + cfg.supervisors + usize::from(python.is_some());
    let pool = env.pool_for(processes).await?;
    env.set_child_pool(pool);
    let calls_dir = env.log_dir.join("calls");
    std::fs::create_dir_all(&calls_dir)
        .map_err(|e| Error::Failed(format!("creating {}: {e}", calls_dir.display())))?;
    env.set_child_env("TRAILMARK__WORKER__LEASE_SECS", &cfg.lease_secs.to_string());
    env.set_child_env(
        "TRAILMARK__WORKER__HEARTBEAT_SECS",
        &(cfg.lease_secs / 3).max(1).to_string(),
    );
    env.set_child_env(seams::ENV, &cfg.faults.seams_spec(cfg.seed, &calls_dir));
    let mut proxies = Vec::new();
    if cfg.faults.latency > 0 {
        let db = env.settings.database.url.clone();
        let amqp = env.settings.broker.url.clone();
        for (var, url) in [("DATABASE_URL", db), ("AMQP_URL", amqp)] {
            let (proxied, proxy) = through_proxy(&url).await?;
            env.set_child_env(var, &proxied);
            proxies.push(proxy);
        }
    }
    Ok(Owned {
        proxies,
        calls_dir,
        python,
    })
}

/// A proxy to the server of `url`, and the same URL pointing at the proxy.
async fn through_proxy(url: &str) -> Result<(String, Proxy)> {
    let mut parsed = url::Url::parse(url)
        .map_err(|e| Error::Failed(format!("{} is not a URL: {e}", trailmark::redact::url(url))))?;
    let host = parsed.host_str().unwrap_or("127.0.0.1").to_owned();
    let port = parsed
        .port_or_known_default()
        .unwrap_or(match parsed.scheme() {
            "amqp" => 5672,
            _ => 5432,
        });
    let proxy = Proxy::start(format!("{host}:{port}"))
        .await
        .map_err(|e| Error::Failed(format!("starting the latency proxy: {e}")))?;
    let _ = parsed.set_host(Some("127.0.0.1"));
    let _ = parsed.set_port(Some(proxy.addr().port()));
    Ok((parsed.to_string(), proxy))
}

type Outcome = std::result::Result<(Report, BenchEnv), (Error, BenchEnv)>;

async fn drive(
    env: BenchEnv,
    registry: Registry,
    target: &Target,
    cfg: &Config,
    (vhost, keyed): (Option<&str>, Option<Keyed>),
    owned: Owned,
) -> Outcome {
    let engine = match Engine::with_pool(
        env.settings.clone(),
        registry,
        Failpoints::default(),
        env.pool.clone(),
    ) {
        Ok(engine) => engine,
        Err(e) => return Err((Error::Failed(format!("the drill's engine: {e}")), env)),
    };
    let fleet = match Fleet::start(
        &env,
        (cfg.workers, cfg.relays, cfg.supervisors),
        cfg.mixed_versions,
    ) {
        Ok(fleet) => fleet,
        Err(e) => return Err((e, env)),
    };
    let mut drill = Drill {
        env,
        cfg,
        engine,
        fleet,
        rng: Rng::new(cfg.seed),
        vhost,
        proxies: owned.proxies,
        calls_dir: owned.calls_dir,
        python: owned.python,
        poison: Vec::new(),
        moments: Vec::new(),
        ids: Vec::new(),
        injected: BTreeMap::new(),
        reviews_resumed: 0,
        events: None,
        keyed,
        key_figures: None,
    };
    drill.events = Events::new(
        &target.input,
        &drill.env.settings.broker,
        drill.env.topology(),
    );
    let result = drill.everything(target).await;
    drill.fleet.stop(Duration::from_secs(5)).await;
    if let Some(py) = drill.python.as_mut() {
        py.stop();
    }
    match result {
        Ok(report) => Ok((report, drill.env)),
        Err(e) => Err((e, drill.env)),
    }
}

impl Drill<'_> {
    async fn everything(&mut self, target: &Target) -> Result<Report> {
        let topology = self.env.topology();
        self.env
            .wait_consumers(
                &topology.steps_queue(),
                self.cfg.workers as u32,
                Duration::from_secs(60),
            )
            .await?;
        // The limit is in force before the first start, and sampled from then on.
        let watch = match &self.keyed {
            Some(keyed) => {
                keyed.set_limit(&self.env.pool).await?;
                Some(keyed.watch(self.env.pool.clone()))
            }
            None => None,
        };
        let tap = (self.cfg.faults.dup > 0.0).then(|| {
            Tap::start(
                self.env.settings.broker.clone(),
                topology.clone(),
                self.cfg.faults.dup,
                self.cfg.seed,
            )
        });
        let mut outcome = self.runs(target).await;
        if outcome.is_ok()
            && let Err(e) = self.outbox_drained().await
        {
            outcome = Err(e);
        }
        if outcome.is_ok()
            && let Some(events) = self.events.as_mut()
            && let Err(e) = events.settle(&self.env.pool).await
        {
            outcome = Err(e);
        }
        let copies = match tap {
            Some(tap) => tap.stop().await,
            None => 0,
        };
        let keys = match watch {
            Some(watch) => Some(watch.stop(&self.env.pool).await),
            None => None,
        };
        let (ids, steps_per_run, keys_per_run, twice) = outcome?;
        self.key_figures = keys.transpose()?;
        self.report(target, &ids, steps_per_run, keys_per_run, twice, copies)
            .await
    }

    /// The control run, then the drill's runs under faults; returns the run ids, the control's
    /// steps and keys, and how many runs were started twice.
    async fn runs(&mut self, target: &Target) -> Result<(Vec<String>, i64, i64, i64)> {
        let control = format!("{RUN_PREFIX}control");
        if let Some(events) = self.events.as_mut() {
            let no_faults = super::Faults::none();
            events.add(
                std::slice::from_ref(&control),
                &mut self.rng,
                &no_faults,
                false,
            );
        }
        self.start(target, std::slice::from_ref(&control), 0.0)
            .await?;
        say(
            self.cfg,
            "control run started (no faults from outside; the engine seams are on)",
        );
        self.wait(std::slice::from_ref(&control), Vec::new(), 1.0)
            .await?;
        let runs = check::runs(&self.env.pool, std::slice::from_ref(&control), 0).await?;
        if runs.succeeded != 1 {
            return Err(Error::Failed(format!(
                "the control run {control} did not succeed ({runs:?}); a workflow must succeed without faults before a drill can tell anything; see `trailmark run show {control}` with --keep"
            )));
        }
        let (steps, keys) = check::one_run(&self.env.pool, &control).await?;
        let ids: Vec<String> = (0..self.cfg.runs)
            .map(|i| format!("{RUN_PREFIX}{i}"))
            .collect();
        self.ids = ids.clone();
        if let Some(events) = self.events.as_mut() {
            events.add(&ids, &mut self.rng, &self.cfg.faults, true);
        }
        let twice = self
            .start(target, &ids, self.cfg.faults.started_twice)
            .await?;
        say(
            self.cfg,
            &format!(
                "{} runs started ({twice} of them twice); a run takes {steps} steps and {keys} keyed writes",
                ids.len()
            ),
        );
        let plan = schedule::plan(
            &self.cfg.faults.counts(self.python.is_some()),
            &self.cfg.faults.hooks,
            &mut self.rng,
        );
        let total = (steps * ids.len() as i64) as f64;
        self.wait(&ids, plan, total).await?;
        Ok((ids, steps, keys, twice))
    }

    /// Publishes the start events of `ids`, a `twice` share of them a second time (with another
    /// message id, somewhere later); returns how many were doubled.
    async fn start(&mut self, target: &Target, ids: &[String], twice: f64) -> Result<i64> {
        let topology = self.env.topology();
        let mut msgs: Vec<Outgoing> = Vec::new();
        let mut doubled = Vec::new();
        for (i, id) in ids.iter().enumerate() {
            let run_id =
                RunId::parse(id).map_err(|e| Error::Failed(format!("drill run id {id}: {e}")))?;
            let input = match &self.keyed {
                Some(keyed) => keyed.input(&target.input, i),
                None => target.input.clone(),
            };
            let event = RunStartEvent::new(run_id, &target.workflow, input);
            msgs.push(topology.run_start(&event));
            if self.rng.unit() < twice {
                doubled.push(topology.run_start(&event));
            }
        }
        let n = doubled.len() as i64;
        for copy in doubled {
            let at = self.rng.range(0, msgs.len() as u64 + 1) as usize;
            msgs.insert(at.max(1).min(msgs.len()), copy);
        }
        self.env.publish(&msgs).await?;
        Ok(n)
    }

    /// Drives `ids` until every one has settled (or nothing moved for `quiet_secs`), injecting
    /// each planned fault once `total` steps times its share are done (`check::standing`: a
    /// settled run counts its whole share).
    async fn wait(&mut self, ids: &[String], mut plan: Vec<Planned>, total: f64) -> Result<()> {
        let mut last = (-1i64, Instant::now());
        let mut moving = ids.len() as i64;
        let mut said = Instant::now();
        loop {
            for seam in self.fleet.check(&self.env)? {
                tracing::debug!(seam, "a process killed itself at its seam");
                self.moments.push(Moment::at("kill at seam", Utc::now()));
            }
            if let Some(py) = self.python.as_mut()
                && py.check(&self.env.log_dir).await?
            {
                tracing::debug!("the Python endpoint killed itself at its spot");
                self.moments.push(Moment::at("kill at seam", Utc::now()));
            }
            self.resume_forced_reviews().await;
            if let Some(events) = self.events.as_mut()
                && let Err(e) = events.tick(&self.env.pool).await
            {
                // Postgres is down (a fault of ours): the next round sends what is due.
                tracing::debug!(error = %e, "the drill's events wait for the next round");
            }
            let per_run = (total / ids.len() as f64).ceil() as i64;
            let (done, unsettled) = match check::standing(&self.env.pool, ids, per_run).await {
                Ok(standing) => standing,
                // Postgres is down (a fault of ours): keep driving with what was last read; the
                // next round reads again.
                _ => (last.0, moving.max(1)),
            };
            moving = unsettled;
            if done != last.0 {
                last = (done, Instant::now());
            }
            while let Some(p) = plan.first().copied() {
                if (done as f64) < p.at * total {
                    break;
                }
                plan.remove(0);
                self.inject(p.fault).await?;
                last.1 = Instant::now();
            }
            if unsettled == 0 {
                return Ok(());
            }
            if last.1.elapsed() > Duration::from_secs(self.cfg.quiet_secs) {
                say(
                    self.cfg,
                    &format!(
                        "no step committed for {} s; {unsettled} runs have not settled",
                        self.cfg.quiet_secs
                    ),
                );
                let vhost = self.vhost.unwrap_or("/");
                let log_dir = &self.env.log_dir;
                for line in
                    check::stall_report(&self.env.pool, log_dir, vhost, &self.env.prefix).await
                {
                    say(self.cfg, &format!("stall: {line}"));
                }
                return Ok(());
            }
            if said.elapsed() > Duration::from_secs(5) {
                said = Instant::now();
                let injected: u32 = self.injected.values().sum();
                say(
                    self.cfg,
                    &format!(
                        "{done} steps done, {unsettled} of {} runs moving, {injected} faults injected, {} to come",
                        ids.len(),
                        plan.len()
                    ),
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits, with the processes still running, until the outbox holds no unpublished row or
    /// the relay's grace for eagerly published rows and ten seconds more have passed: a run's
    /// last step commits its outgoing messages with it, and a worker publishes and forgets them
    /// (or the relay takes them after the grace) a moment after the run already reads settled.
    async fn outbox_drained(&self) -> Result<()> {
        let grace = self.env.settings.relay.eager_grace_ms.max(0) as u64;
        let deadline = Instant::now() + Duration::from_millis(grace) + Duration::from_secs(10);
        while check::unpublished(&self.env.pool).await? > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }

    /// Resumes, as a person would after approving, every run the review seam stopped.
    async fn resume_forced_reviews(&mut self) {
        let stopped = inspect::runs_in_review_mentioning(&self.env.pool, &Seam::Review.marker())
            .await
            .unwrap_or_default();
        let who = Decider::cli(
            "drill",
            "forced into review by the drill's review seam; approved and resumed",
        );
        for run in stopped {
            match operator::resume(&self.engine, &run, &who, Resume::Again).await {
                Ok(_) => self.reviews_resumed += 1,
                Err(e) => {
                    tracing::debug!(run, error = %e, "resume of a forced review failed; trying again next round")
                }
            }
        }
    }

    async fn inject(&mut self, fault: Fault) -> Result<()> {
        let since = Utc::now();
        let f = &self.cfg.faults;
        match fault {
            Fault::Kill => {
                let killed = self.fleet.kill(&self.env, &mut self.rng, f.kill_in_turn)?;
                tracing::debug!(killed, "kill -9");
            }
            Fault::Pause => {
                let slot = self.fleet.freeze(&mut self.rng);
                let frozen = Utc::now();
                tokio::time::sleep(self.cfg.pause_length()).await;
                self.fleet.thaw(slot);
                *self.injected.entry(fault).or_default() += 1;
                // Recovery is measured from its end (runs another worker held went on anyway);
                // what it held back, over the time the worker was stopped.
                let thawed = Utc::now();
                self.moments.push(Moment {
                    name: fault.name().into(),
                    since: thawed,
                    window: (frozen, thawed),
                });
                return Ok(());
            }
            Fault::Broker => {
                let vhost = self.vhost.unwrap_or("/");
                faults::broker(f.broker_mode, vhost).await?;
            }
            Fault::Postgres => {
                faults::postgres(f.postgres_mode, &self.env.pool, &self.env.db_name).await?
            }
            Fault::Poison => {
                let sent = self.poison.len() as u32;
                let n = (f.poison - sent).min(10);
                let topology = self.env.topology();
                let ids =
                    faults::poison(&self.env.settings.broker, &topology, n, sent, &mut self.rng)
                        .await?;
                self.poison.extend(ids);
            }
            Fault::Latency => {
                let delay = Duration::from_millis(self.rng.range(20, 200));
                for p in &self.proxies {
                    p.set_delay(delay);
                }
                tokio::time::sleep(Duration::from_millis(self.rng.range(1000, 3000))).await;
                for p in &self.proxies {
                    p.cut_all();
                    p.set_delay(Duration::ZERO);
                }
            }
            Fault::PythonKill => {
                if let Some(py) = self.python.as_mut() {
                    py.kill().await?;
                }
            }
            Fault::Hook(i) => {
                let hook = &f.hooks[usize::from(i)];
                say(self.cfg, &format!("hook {}: {}", hook.name, hook.command));
                faults::hook(hook, &self.env).await?;
                *self.injected.entry(fault).or_default() += 1;
                // Measured from its end, when what it breaks is broken (a kill, a failover).
                self.moments.push(Moment::at(&hook.name, Utc::now()));
                return Ok(());
            }
        }
        *self.injected.entry(fault).or_default() += 1;
        self.moments.push(Moment::at(fault.name(), since));
        Ok(())
    }

    /// The DLQ's letters once every poison message is in it, or after two leases and 10 s: a
    /// batch sent just before the runs settled may still be on its way there (in a prefetch, or
    /// back from a killed worker), and a missing one is a broken promise only past that.
    async fn dead_letters(&self, conflicts: &[String]) -> Result<crate::report::DeadLetters> {
        let within = Duration::from_secs(2 * self.cfg.lease_secs + 10);
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let d = check::dead_letters(&self.env.settings.broker, &self.poison, conflicts).await?;
            if d.poison_missing.is_empty() || tokio::time::Instant::now() >= deadline {
                return Ok(d);
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    async fn report(
        &mut self,
        target: &Target,
        ids: &[String],
        steps_per_run: i64,
        keys_per_run: i64,
        twice: i64,
        copies: u64,
    ) -> Result<Report> {
        let pool = self.env.pool.clone();
        let runs = check::runs(&pool, ids, steps_per_run).await?;
        let succeeded = check::succeeded(&pool, ids).await?;
        let keys = check::keys(&pool, &succeeded).await?;
        let receiver = match &target.receiver {
            Some(r) => Some(r.count(&pool, &succeeded).await?),
            None => None,
        };
        let logs = check::call_logs(&self.calls_dir)?;
        let conflicts = self
            .events
            .as_ref()
            .map(Events::conflicts)
            .unwrap_or_default();
        let dead_letters = self.dead_letters(&conflicts).await?;
        let unpublished = check::unpublished(&pool).await?;
        let mut report = Report {
            workflow: target.workflow.clone(),
            seed: self.cfg.seed,
            lease_secs: self.cfg.lease_secs,
            runs,
            dead_letters,
            model_calls: logs.models,
            fencing: logs.fencing,
            seam_kills: self.fleet.seam_kills.clone(),
            ..Report::default()
        };
        report.effects.expected = keys_per_run * succeeded.len() as i64;
        report.effects.keys = keys;
        report.effects.applied = receiver.map(|(rows, _)| rows);
        report.effects.duplicated = receiver.map(|(rows, distinct)| rows - distinct);
        report.effects.calls_repeated = logs.calls_repeated;
        let positions = check::positions(&pool, ids).await?;
        report.engine_seams = EngineSeams {
            model_500: chosen(
                &positions,
                self.cfg.seed,
                Seam::Model500,
                self.cfg.faults.model_500,
            ),
            late_tool: chosen(
                &positions,
                self.cfg.seed,
                Seam::LateTool,
                self.cfg.faults.late_tool,
            ),
            reviews_resumed: self.reviews_resumed,
            started_twice: twice,
            duplicated_deliveries: copies,
        };
        report.faults = self.fault_figures().await?;
        report.invariants = check::verdicts(&report, unpublished);
        if let Some(events) = self.events.as_mut() {
            let refused = report.dead_letters.event_conflicts;
            let (figures, invariants) = events.check(&pool, refused).await?;
            report.events = Some(figures);
            report.invariants.extend(invariants);
        }
        if let Some(k) = self.key_figures.take() {
            report.invariants.extend(super::keys::verdicts(&k));
            report.keys = Some(k);
        }
        if self.cfg.mixed_versions {
            let v = check::versions(&pool, ids).await?;
            report
                .invariants
                .push(check::versions_verdict(&v, self.cfg.workers));
            report.versions = Some(v);
        }
        let fan_outs = inspect::fan_outs(&pool, ids).await?;
        if fan_outs.fan_outs > 0 {
            report.invariants.extend(check::fan_out_verdicts(&fan_outs));
            report.fan_outs = Some(fan_outs);
        }
        report.exits = self.fleet.unexpected_exits.clone();
        if let Some(py) = &self.python {
            let figures = py.figures();
            if figures.spot_kills > 0 {
                let seam = format!("python.{}", figures.spot);
                *report.seam_kills.entry(seam).or_default() += figures.spot_kills;
            }
            report
                .exits
                .extend(figures.unexpected_exits.iter().cloned());
            report.python = Some(figures);
        }
        report.commits_by_process = check::commits_by_process(&self.calls_dir, &self.fleet.names)?;
        Ok(report)
    }

    /// Per fault kind: how often, the time from each to the next committed step, the longest
    /// stall of all commits and the longest wait of one run.
    async fn fault_figures(&self) -> Result<Vec<FaultFigures>> {
        let mut by: BTreeMap<String, Vec<Option<f64>>> = BTreeMap::new();
        let mut stalls: BTreeMap<String, f64> = BTreeMap::new();
        let mut waits: BTreeMap<String, (f64, String)> = BTreeMap::new();
        for m in &self.moments {
            let next = faults::next_commit(&self.env.pool, m.since).await?;
            by.entry(m.name.clone()).or_default().push(next);
            if let Some(stall) = faults::longest_stall(&self.env.pool, m.since).await? {
                let worst = stalls.entry(m.name.clone()).or_default();
                *worst = worst.max(stall);
            }
            let wait = inspect::longest_run_wait(&self.env.pool, &self.ids, m.window).await?;
            if let Some((run, ms)) = wait {
                let worst = waits.entry(m.name.clone()).or_default();
                if ms > worst.0 {
                    *worst = (ms, run);
                }
            }
        }
        Ok(by
            .into_iter()
            .map(|(fault, times)| {
                let stall_max_ms = stalls.get(&fault).copied();
                let wait = waits.get(&fault);
                let mut ok: Vec<f64> = times.iter().flatten().copied().collect();
                ok.sort_by(f64::total_cmp);
                FaultFigures {
                    injected: times.len() as u32,
                    recovery_p50_ms: (!ok.is_empty()).then(|| ok[ok.len() / 2]),
                    recovery_max_ms: ok.last().copied(),
                    without_progress: times.iter().filter(|t| t.is_none()).count() as u32,
                    stall_max_ms,
                    run_wait_max_ms: wait.map(|w| w.0),
                    run_waited_longest: wait.map(|w| w.1.clone()),
                    fault,
                }
            })
            .collect())
    }
}

/// A fault as the report measures it: its name, the moment recovery is timed from, and the
/// window in which the runs' waits are read (for a pause: while the worker was stopped).
struct Moment {
    name: String,
    since: DateTime<Utc>,
    window: (DateTime<Utc>, DateTime<Utc>),
}

impl Moment {
    /// A fault at `since`, its window the [`faults::STALL_WINDOW_SECS`] after it.
    fn at(name: &str, since: DateTime<Utc>) -> Self {
        let end =
            since + chrono::Duration::milliseconds((faults::STALL_WINDOW_SECS * 1000.0) as i64);
        Self {
            name: name.into(),
            since,
            window: (since, end),
        }
    }
}

/// Positions that `seam` chose (it fired there if attempt 1 got that far).
fn chosen(positions: &[(String, i32)], seed: u64, seam: Seam, rate: f64) -> i64 {
    positions
        .iter()
        .filter(|(run, seq)| rate > 0.0 && seams::chosen(seed, seam, run, *seq) < rate)
        .count() as i64
}

/// What `--keep` left, and how to remove it when done looking.
fn kept(db: &str, prefix: &str, vhost: Option<&str>) -> String {
    let (vhost_kept, vhost_rm) = match vhost {
        Some(vh) => (
            format!(", vhost {vh}"),
            format!("; `rabbitmqctl delete_vhost {vh}`"),
        ),
        None => (
            String::new(),
            format!("; delete the queues and exchanges named {prefix}.*"),
        ),
    };
    format!(
        "kept database {db}, broker prefix {prefix}{vhost_kept}; remove them when done: `dropdb {db}`{vhost_rm}"
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn keep_names_the_vhost_it_keeps() {
        let said = super::kept("tm_drill_1", "tmdrill-1", Some("tmdrill-vh-1"));
        assert!(
            said.contains("vhost tmdrill-vh-1") && said.contains("delete_vhost tmdrill-vh-1"),
            "{said}"
        );
        assert!(!super::kept("tm_drill_1", "tmdrill-1", None).contains("vhost"));
    }
}
