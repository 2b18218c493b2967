//! `pychain`, the `chain` workflow written with the Python SDK (`sdk/python/examples/chain.py`),
//! as a real process: the tests, the drill and the bench start it, kill it with SIGKILL and
//! start it again, and point workers at it through `remote.endpoints`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The workflow's name.
pub const NAME: &str = "pychain";
/// The endpoint's name in `remote.endpoints`.
pub const ENDPOINT: &str = "py";
/// The path the endpoint is served under.
const PREFIX: &str = "/trailmark";

/// The repository's root (this crate lives in `crates/testkit`).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The Python that has the SDK installed: `TRAILMARK_PYTHON`, else the virtualenv
/// `scripts/setup` makes (`target/pyvenv`), or why there is none.
pub fn python() -> Result<PathBuf, String> {
    if let Ok(p) = std::env::var("TRAILMARK_PYTHON") {
        return Ok(PathBuf::from(p));
    }
    let venv = root().join("target/pyvenv/bin/python");
    if venv.exists() {
        return Ok(venv);
    }
    Err(format!(
        "no Python with the trailmark SDK: run scripts/setup (it makes {}) or set TRAILMARK_PYTHON",
        venv.display()
    ))
}

/// A `pychain` server: its port and secret, and the process while it runs.
pub struct PyChain {
    /// The port it listens on (kept across restarts).
    pub port: u16,
    /// The shared secret.
    pub secret: String,
    database_url: String,
    extra: Vec<(String, String)>,
    child: Option<Child>,
}

impl PyChain {
    /// Starts one on a free port, writing its ledger rows to `database_url`, with `extra`
    /// environment (kill spots, `PYCHAIN_FIXED`); returns once it listens.
    pub fn start(database_url: &str, extra: &[(&str, &str)]) -> Result<Self, String> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("no free port: {e}"))?
            .port();
        let mut server = Self {
            port,
            secret: format!("pychain-{}", uuid_like()),
            database_url: database_url.to_owned(),
            extra: extra
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            child: None,
        };
        server.restart()?;
        Ok(server)
    }

    /// The `remote.endpoints` entry that names it.
    pub fn endpoint(&self) -> String {
        format!("{ENDPOINT}=http://127.0.0.1:{}{PREFIX}", self.port)
    }

    /// The environment a trailmark process needs to carry `pychain`: the endpoint, its secret,
    /// and the operator's consent to the ledger table its manifest declares (a worker refuses a
    /// manifest declaring a table it was not allowed).
    pub fn worker_env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("TRAILMARK__REMOTE__ENDPOINTS", self.endpoint()),
            ("TRAILMARK_REMOTE_SECRET_PY", self.secret.clone()),
            (
                "TRAILMARK__REMOTE__LOCAL_TABLES",
                crate::ledger::TABLE.name().to_owned(),
            ),
        ]
    }

    /// Starts the process (again, after a kill), on the same port; returns once it listens.
    pub fn restart(&mut self) -> Result<(), String> {
        let script = root().join("sdk/python/examples/chain.py");
        let child = Command::new(python()?)
            .arg(&script)
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--prefix", PREFIX])
            .env("TRAILMARK_SECRET", &self.secret)
            .env("DATABASE_URL", &self.database_url)
            .envs(self.extra.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", script.display()))?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if let Some(status) = self.exited() {
                return Err(format!("pychain exited before it listened: {status}"));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "pychain did not listen on {} within 30 s",
                    self.port
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// The exit status, once the process has ended (a kill spot fired, or it was killed).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut()?.try_wait().ok().flatten()
    }

    /// The process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL, from outside, and reaped.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for PyChain {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A unique enough suffix for a secret (not a security boundary: a test's own process pair).
fn uuid_like() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("{nanos:032x}-{}", std::process::id())
}
