//! No form of a secret is ever printed: a sentinel secret in every form a credential takes
//! (a Postgres password in the URL's user info and in `password=` / `sslpassword=`, a RabbitMQ
//! password, the model's API key, sent as an HTTP `Authorization` header) is searched for in
//! every line of output and log of a full run, with DEBUG logging on, and of failed connections.

mod common;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::{TestEnv, closed_port, text};
use trailmark::domain::RunStatus;
use trailmark_standin::model_server::{ModelServer, ModelServerOptions};

/// A RabbitMQ user that exists for the test only.
struct BrokerUser(String);

impl BrokerUser {
    fn create(name: &str, password: &str) -> Self {
        let ctl = |args: &[&str]| {
            let out = Command::new("rabbitmqctl")
                .args(args)
                .output()
                .expect("rabbitmqctl");
            assert!(
                out.status.success(),
                "rabbitmqctl {args:?}: {:?}",
                text(&out)
            );
        };
        ctl(&["add_user", name, password]);
        ctl(&["set_permissions", "-p", "/", name, ".*", ".*", ".*"]);
        Self(name.to_owned())
    }
}

impl Drop for BrokerUser {
    fn drop(&mut self) {
        let _ = Command::new("rabbitmqctl")
            .args(["delete_user", &self.0])
            .output();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_form_of_a_secret_appears_in_any_output_or_log_of_a_full_run() {
    let env = TestEnv::new().await;
    let tag = &env.prefix;
    let secrets = [
        format!("PgUserInfo{}", &tag[7..]),
        format!("PgQueryPw{}", &tag[7..]),
        format!("PgSslPw{}", &tag[7..]),
        format!("MqPw{}", &tag[7..]),
        format!("ModelKey{}", &tag[7..]),
    ];
    let user = BrokerUser::create(&format!("{tag}-user"), &secrets[3]);
    let model = ModelServer::start(ModelServerOptions::default())
        .await
        .expect("model server");
    let server = common::base_url().replace("postgres@", &format!("postgres:{}@", secrets[0]));
    let database_url = format!(
        "{server}/{}?password={}&sslpassword={}",
        env.db_name, secrets[1], secrets[2]
    );
    let amqp_url = format!("amqp://{}:{}@127.0.0.1:5672/%2f", user.0, secrets[3]);
    let with_secrets = |args: &[&str]| {
        let mut cmd = env.command(args);
        cmd.env("DATABASE_URL", &database_url)
            .env("AMQP_URL", &amqp_url)
            .env("TRAILMARK__MODEL__BASE_URL", model.base_url())
            .env("TRAILMARK__MODEL__API_KEY", &secrets[4])
            .env("RUST_LOG", "debug")
            .stdin(Stdio::null());
        cmd
    };
    let run = |args: &[&str], extra: &[(&str, String)]| -> (String, Output) {
        let mut cmd = with_secrets(args);
        cmd.envs(extra.iter().map(|(k, v)| (*k, v.as_str())));
        (args.join(" "), cmd.output().expect("run trailmark"))
    };
    let mut seen: Vec<(String, Output)> = vec![run(&["migrate"], &[])];
    assert!(
        seen[0].1.status.success(),
        "migrate: {:?}",
        text(&seen[0].1)
    );

    let serve = with_secrets(&["serve"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn serve");
    let mut serve = common::ChildGuard(Some(serve));
    seen.push(run(
        &[
            "run",
            "start",
            "chain",
            "--run-id",
            "r-secret",
            "--input",
            r#"{"steps":3}"#,
            "--wait",
        ],
        &[],
    ));
    env.wait_status("r-secret", RunStatus::Succeeded, Duration::from_secs(60))
        .await;
    assert!(
        model.calls() >= 3,
        "the model with the secret key was asked"
    );
    seen.push(run(&["run", "show", "r-secret", "--json"], &[]));
    seen.push(run(&["run", "list"], &[]));
    seen.push(run(&["dlq", "list"], &[]));
    // Failures print URLs too: each server unreachable, and the broker refusing the password.
    let port = closed_port();
    seen.push(run(
        &["run", "list"],
        &[(
            "DATABASE_URL",
            database_url.replace(":5432/", &format!(":{port}/")),
        )],
    ));
    seen.push(run(
        &["run", "start", "chain", "--run-id", "r-x"],
        &[("AMQP_URL", amqp_url.replace(":5672/", &format!(":{port}/")))],
    ));
    seen.push(run(
        &["run", "start", "chain", "--run-id", "r-x"],
        &[(
            "AMQP_URL",
            amqp_url.replace(&secrets[3], &format!("{}x", secrets[3])),
        )],
    ));
    seen.push(run(
        &["serve"],
        &[(
            "AMQP_URL",
            amqp_url.replace(&secrets[3], &format!("{}x", secrets[3])),
        )],
    ));

    serve.signal(libc::SIGTERM);
    let child = serve.0.take().expect("serve");
    let serve_out = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .expect("serve output");
    assert_eq!(
        serve_out.status.code(),
        Some(0),
        "serve did not stop on SIGTERM"
    );
    model.shutdown().await;
    let serve_out = Some(serve_out);
    let mut all = String::new();
    for (what, out) in &seen {
        let (stdout, stderr) = text(out);
        all += &format!("--- {what}\n{stdout}{stderr}");
    }
    if let Some(out) = serve_out {
        let (stdout, stderr) = text(&out);
        all += &format!("--- serve\n{stdout}{stderr}");
    }
    assert!(all.contains("run r-secret") || all.contains("\"run_id\": \"r-secret\""));
    for secret in &secrets {
        if let Some(at) = all.find(secret.as_str()) {
            let from = at.saturating_sub(300);
            panic!(
                "secret {secret} printed: ...{}...",
                &all[from..at + secret.len()]
            );
        }
    }
}
