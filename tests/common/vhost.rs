//! A RabbitMQ vhost of a test's own, made and removed with `rabbitmqctl`.

#![allow(dead_code)]

use std::io::Write;
use std::process::{Command, Stdio};

use super::text;

/// Runs `rabbitmqctl` with `args` (and `stdin`), and says what it printed when it fails.
pub fn rabbitmqctl(args: &[&str], stdin: Option<&[u8]>) -> Result<String, String> {
    let mut child = Command::new("rabbitmqctl")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            format!(
                "rabbitmqctl {args:?} could not start ({e}); is RabbitMQ installed on this machine?"
            )
        })?;
    let mut input = child.stdin.take().expect("stdin");
    if let Some(bytes) = stdin {
        input.write_all(bytes).map_err(|e| e.to_string())?;
    }
    drop(input);
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    let (stdout, stderr) = text(&out);
    if out.status.success() {
        Ok(stdout)
    } else {
        Err(format!("rabbitmqctl {args:?} failed: {stdout}{stderr}"))
    }
}

/// A vhost of the test's own (`tmtest-<id>`, as `scripts/test` expects of what tests create),
/// open to the test user, deleted with everything in it when dropped, even after a failure.
pub struct Vhost(pub String);

impl Vhost {
    /// Creates `name`, open to the test user.
    pub fn create(name: String) -> Self {
        rabbitmqctl(&["add_vhost", &name], None).expect("add the test vhost");
        let vhost = Self(name);
        let user = url::Url::parse(&super::amqp_url())
            .expect("the test AMQP URL")
            .username()
            .to_owned();
        rabbitmqctl(
            &["set_permissions", "-p", &vhost.0, &user, ".*", ".*", ".*"],
            None,
        )
        .expect("open the test vhost to the test user");
        vhost
    }

    /// The test AMQP URL pointed at this vhost.
    pub fn url(&self) -> String {
        let mut url = url::Url::parse(&super::amqp_url()).expect("the test AMQP URL");
        url.set_path(&format!("/{}", self.0));
        url.to_string()
    }
}

impl Vhost {
    /// Deletes it now, with every connection to it (what an operator's mistake would do).
    pub fn delete(&self) {
        rabbitmqctl(&["delete_vhost", &self.0], None).expect("delete the test vhost");
    }
}

impl Drop for Vhost {
    fn drop(&mut self) {
        let listed = rabbitmqctl(&["-q", "list_vhosts", "name"], None).unwrap_or_default();
        if !listed.lines().any(|v| v == self.0) {
            return;
        }
        if let Err(e) = rabbitmqctl(&["delete_vhost", &self.0], None) {
            eprintln!("the test vhost {} is left behind: {e}", self.0);
        }
    }
}
