//! The Python step endpoint of a drill of `pychain`: the drill starts it on its own database,
//! gives every process it starts the endpoint's environment, kills it with SIGKILL from outside
//! (`--python-kill`) and starts it again at once, as it does its own processes. Each restart
//! after such a kill is armed to kill itself once at the endpoint's kill spot (chosen from the
//! seed): inside the step's code, where an outside kill rarely lands (after the model's answer,
//! between `effect/begin` and the write, between the write and `effect/end`, before the
//! step's answer).

use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;

use serde::Serialize;

use super::{Error, Result};
use trailmark_bench::env::BenchEnv;
use trailmark_bench::python::{PythonEndpoint, WORKFLOW};

/// The kill spots of `sdk/python/examples/chain.py` (`PYCHAIN_KILL_AT`).
pub const SPOTS: [&str; 4] = [
    "after_model",
    "after_begin",
    "after_insert",
    "before_answer",
];

/// Whether a drill of `workflow` owns the Python endpoint that serves it.
pub fn serves(workflow: &str) -> bool {
    workflow == WORKFLOW
}

/// What happened to the endpoint during the drill.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PythonFigures {
    /// SIGKILLs from outside (`--python-kill`).
    pub killed: u32,
    /// The kill spot each restart after such a kill was armed at.
    pub spot: String,
    /// Times the endpoint killed itself there.
    pub spot_kills: u32,
    /// Times it was started again (after either kind of kill, or an exit of its own).
    pub restarts: u32,
    /// The longest it took to listen again (ms).
    pub restart_max_ms: f64,
    /// Exits the drill did not cause, with their status.
    pub unexpected_exits: Vec<String>,
}

/// The drill's endpoint.
pub struct Python {
    endpoint: PythonEndpoint,
    /// `PYCHAIN_KILL_ONCE`: while it exists the spot does not fire; removing it arms the next
    /// process, which makes it again just before it kills itself.
    fired: PathBuf,
    armed: bool,
    figures: PythonFigures,
}

impl Python {
    /// Starts the endpoint on `env`'s database, unarmed, and gives its environment to every
    /// process `env` starts from now on.
    pub async fn start(env: &mut BenchEnv, seed: u64) -> Result<Self> {
        let spot = SPOTS[(seed % SPOTS.len() as u64) as usize];
        // Beside the processes' logs, not among the call logs (every file there is read).
        let fired = env.log_dir.join("pychain-spot-fired");
        std::fs::write(&fired, b"")
            .map_err(|e| Error::Failed(format!("creating {}: {e}", fired.display())))?;
        let extra = vec![
            ("PYCHAIN_KILL_AT".to_owned(), spot.to_owned()),
            ("PYCHAIN_KILL_ONCE".to_owned(), fired.display().to_string()),
        ];
        let endpoint = PythonEndpoint::start(&env.settings.database.url, extra).await?;
        endpoint.give_to(env);
        Ok(Self {
            endpoint,
            fired,
            armed: false,
            figures: PythonFigures {
                spot: spot.to_owned(),
                ..PythonFigures::default()
            },
        })
    }

    /// SIGKILL from outside, then started again, armed at the kill spot.
    pub async fn kill(&mut self) -> Result<()> {
        self.arm()?;
        let took = self.endpoint.kill9_and_restart().await?;
        self.figures.killed += 1;
        self.restarted(took);
        Ok(())
    }

    /// Starts the endpoint again if it has exited; returns whether it killed itself at its
    /// spot (an exit the drill did not cause is recorded as one).
    pub async fn check(&mut self, log_dir: &std::path::Path) -> Result<bool> {
        let Some(status) = self.endpoint.exited() else {
            return Ok(false);
        };
        let fired = self.armed && status.signal() == Some(9) && self.fired.exists();
        if fired {
            self.armed = false;
            self.figures.spot_kills += 1;
        } else {
            self.figures.unexpected_exits.push(format!(
                "the Python endpoint exited on its own ({status}); its output is on the drill's stderr (logs in {})",
                log_dir.display()
            ));
        }
        let took = self.endpoint.restart().await?;
        self.restarted(took);
        Ok(fired)
    }

    /// The figures so far.
    pub fn figures(&self) -> PythonFigures {
        self.figures.clone()
    }

    /// SIGKILL, at the end of the drill (after the processes that call it have stopped).
    pub fn stop(&mut self) {
        self.endpoint.stop();
    }

    /// Arms the next process: the spot fires once the file is gone.
    fn arm(&mut self) -> Result<()> {
        match std::fs::remove_file(&self.fired) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(Error::Failed(format!(
                    "arming the Python endpoint's kill spot ({}): {e}",
                    self.fired.display()
                )));
            }
        }
        self.armed = true;
        Ok(())
    }

    fn restarted(&mut self, took: std::time::Duration) {
        self.figures.restarts += 1;
        let ms = took.as_secs_f64() * 1000.0;
        self.figures.restart_max_ms = self.figures.restart_max_ms.max(ms);
    }
}
