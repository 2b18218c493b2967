//! The demo's child processes: workers, the model server, naive passes. Each is this very binary
//! with a subcommand, logs to a file of its own, and cannot outlive the demo: it is killed when
//! its handle is dropped (error, Ctrl-C) and, through `PR_SET_PDEATHSIG`, when the demo itself
//! dies without cleaning up.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// A running child process; killed (SIGKILL) when dropped.
pub struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Proc {
    /// Starts `trailmark <args>` with `env`, stderr into `<logs>/<name>.log`.
    pub fn spawn(
        name: &str,
        args: &[&str],
        env: &[(String, String)],
        logs: &Path,
        stdout: bool,
    ) -> anyhow::Result<Self> {
        let log = logs.join(format!("{name}.log"));
        let file = std::fs::File::create(&log)
            .with_context(|| format!("creating the log file {}", log.display()))?;
        let exe =
            std::env::current_exe().context("finding the trailmark binary to start children")?;
        let mut cmd = Command::new(exe);
        cmd.args(args)
            .env_remove("TRAILMARK_FAILPOINTS")
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(if stdout {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stderr(Stdio::from(file))
            .kill_on_drop(true);
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd.spawn().with_context(|| format!("starting {name}"))?;
        Ok(Self {
            name: name.to_owned(),
            child,
            log,
        })
    }

    /// The process's name in messages.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where its log is.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// The first line it prints on stdout (how the model server tells its address).
    pub async fn first_line(&mut self, within: Duration) -> anyhow::Result<String> {
        let out = self
            .child
            .stdout
            .take()
            .context("stdout was not captured")?;
        let mut line = String::new();
        let mut reader = BufReader::new(out);
        let read = reader.read_line(&mut line);
        match tokio::time::timeout(within, read).await {
            Ok(Ok(n)) if n > 0 => Ok(line.trim().to_owned()),
            Ok(_) => bail!(
                "{} ended before saying anything; see {}",
                self.name,
                self.log.display()
            ),
            Err(_) => bail!(
                "{} said nothing within {within:?}; see {}",
                self.name,
                self.log.display()
            ),
        }
    }

    /// Its exit status if it has ended.
    pub fn exited(&mut self) -> anyhow::Result<Option<ExitStatus>> {
        Ok(self.child.try_wait()?)
    }

    /// Waits for it to end by itself.
    pub async fn wait(&mut self) -> anyhow::Result<ExitStatus> {
        Ok(self.child.wait().await?)
    }

    /// Asks it to stop (SIGTERM), waits briefly, then kills it.
    pub async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGTERM);
            }
        }
        if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// How a process ended, in words (`killed by SIGKILL`, `exit code 1`).
pub fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (_, Some(9)) => "killed by SIGKILL".into(),
        (_, Some(sig)) => format!("killed by signal {sig}"),
        (Some(code), _) => format!("exit code {code}"),
        _ => "ended".into(),
    }
}
