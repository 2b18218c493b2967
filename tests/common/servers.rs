//! Servers of a test's own, beside the main ones: a temporary directory, Postgres's tools run
//! as the `postgres` user, process checks.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use super::text;

/// A directory removed with everything in it when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("tm-servers-{tag}"));
        std::fs::create_dir_all(&dir).expect("create the test's directory");
        // Postgres runs as its own user and must reach its data directory inside.
        set_mode(&dir, 0o755);
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

/// Runs `cmd` to its end and returns its output; panics, with the output, when it fails.
pub fn run_ok(cmd: &mut Command, what: &str) -> Output {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run it: {e}"));
    assert!(out.status.success(), "{what} failed: {:?}", text(&out));
    out
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// `program` as the `postgres` user when this test runs as root (initdb refuses root).
pub fn as_postgres(program: &Path) -> Command {
    if is_root() {
        let mut cmd = Command::new("runuser");
        cmd.args(["-u", "postgres", "--"]).arg(program);
        cmd
    } else {
        Command::new(program)
    }
}

/// Whether process `pid` still exists.
pub fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

/// The `bin` directory of the newest PostgreSQL installed.
pub fn pg_bin() -> PathBuf {
    std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL's server binaries under /usr/lib/postgresql")
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|bin| bin.join("initdb").exists())
        .max_by_key(|bin| {
            let version = bin.parent().and_then(Path::file_name);
            version.and_then(|v| v.to_str()?.parse::<u32>().ok())
        })
        .expect("an initdb under /usr/lib/postgresql/*/bin")
}

/// Appends `text` to the file at `path`.
pub fn append(path: &Path, text: &str) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
    f.write_all(text.as_bytes()).unwrap();
}
