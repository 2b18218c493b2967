//! `deploy/rabbitmq/definitions.json` against the code: the file holds exactly what
//! `Topology::declare` declares for the default settings, a vhost loaded from it takes `migrate`
//! and a `chain` run without PRECONDITION_FAILED, and queues declared otherwise (an earlier
//! trailmark without `x-quorum-initial-group-size`, another delivery limit) are kept with a
//! warning or refused with what to do.

mod common;

use std::path::Path;
use std::time::Duration;

use common::vhost::{Vhost, rabbitmqctl};
use common::{TestEnv, text};
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use serde_json::Value;
use trailmark::broker::{self, KeptGroupSize, QUORUM_GROUP_SIZE_ARG, Topology};
use trailmark::config::Settings;
use trailmark::domain::RunStatus;

const DEFINITIONS: &str = "deploy/rabbitmq/definitions.json";

fn definitions_file() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(DEFINITIONS);
    let raw = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{DEFINITIONS}: {e}"));
    serde_json::from_str(&raw).unwrap_or_else(|e| panic!("{DEFINITIONS} is not JSON: {e}"))
}

/// What the code declares under the default settings, as a definitions document for `/`.
fn declared_by_default() -> Value {
    let settings = Settings::load_from(None).expect("defaults load");
    Topology::from_settings(&settings.broker).definitions("/")
}

#[test]
fn the_definitions_file_holds_exactly_what_the_code_declares_for_the_default_prefix() {
    let expected = declared_by_default();
    // A maintainer who changed the topology writes the file anew with
    // `TRAILMARK_WRITE_DEFINITIONS=1 cargo test --test definitions`, and reviews the diff.
    if std::env::var_os("TRAILMARK_WRITE_DEFINITIONS").is_some() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(DEFINITIONS);
        let body = serde_json::to_string_pretty(&expected).expect("serialise") + "\n";
        std::fs::write(&path, body).expect("write the definitions file");
    }
    let file = definitions_file();
    let queues = |doc: &Value| -> Vec<(String, Value)> {
        doc["queues"]
            .as_array()
            .expect("a queues array")
            .iter()
            .map(|q| {
                (
                    q["name"].as_str().unwrap().to_owned(),
                    q["arguments"].clone(),
                )
            })
            .collect()
    };
    // Queue by queue first, so a drift names the queue and the argument.
    let (in_file, in_code) = (queues(&file), queues(&expected));
    for (name, args) in &in_code {
        let found = in_file.iter().find(|(n, _)| n == name);
        let Some((_, file_args)) = found else {
            panic!("{DEFINITIONS} lacks queue {name}, which trailmark declares with {args}");
        };
        assert_eq!(
            file_args, args,
            "queue {name}: {DEFINITIONS} has other arguments than trailmark declares"
        );
        assert_eq!(args["x-queue-type"], "quorum", "{name}");
        assert_eq!(args[QUORUM_GROUP_SIZE_ARG], 3, "{name}");
    }
    assert_eq!(
        in_file.len(),
        in_code.len(),
        "{DEFINITIONS} has queues trailmark does not declare"
    );
    assert_eq!(
        file,
        expected,
        "{DEFINITIONS} differs from what trailmark declares; it should read:\n{}",
        serde_json::to_string_pretty(&expected).unwrap()
    );
}

/// `doc` with its vhost and every object's `vhost` set to `vhost`: in RabbitMQ 3.10
/// `import_definitions` is global, and the file names the vhost of each object.
fn into_vhost(mut doc: Value, vhost: &str) -> Value {
    for named in doc["vhosts"].as_array_mut().into_iter().flatten() {
        named["name"] = Value::from(vhost);
    }
    for kind in ["exchanges", "queues", "bindings", "policies"] {
        for object in doc[kind].as_array_mut().into_iter().flatten() {
            object["vhost"] = Value::from(vhost);
        }
    }
    doc
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vhost_loaded_from_the_definitions_file_takes_migrate_and_a_chain_run() {
    let env = TestEnv::new().await;
    // Declared first so that it is dropped last, after the worker that uses it.
    let vhost = Vhost::create(env.prefix.clone());
    let doc = into_vhost(definitions_file(), &vhost.0);
    let body = serde_json::to_vec(&doc).unwrap();
    // From standard input (3.10 refuses `-` as a path); the import finishes asynchronously, so
    // the test waits for its last objects, the bindings.
    rabbitmqctl(&["import_definitions"], Some(&body)).expect("import the definitions");
    let default_prefix = Settings::load_from(None).unwrap().broker.prefix;
    let topology = Topology::new(&default_prefix, 1);
    let listed = |what: &'static str, columns: &'static [&'static str]| {
        let mut args = vec!["-q", what, "-p", vhost.0.as_str()];
        args.extend(columns);
        rabbitmqctl(&args, None).unwrap_or_default()
    };
    let imported = common::eventually("the import", Duration::from_secs(30), || {
        let queues = listed("list_queues", &["name"]);
        let bindings = listed(
            "list_bindings",
            &["source_name", "destination_name", "routing_key"],
        );
        let all_queues = topology
            .queues()
            .iter()
            .all(|q| queues.lines().any(|l| l.trim() == q.name));
        let all_bindings = topology.bindings().iter().all(|b| {
            let line = format!("{}\t{}\t{}", b.exchange, b.queue, b.routing_key);
            bindings.lines().any(|l| l == line)
        });
        async move { (all_queues && all_bindings).then_some(()) }
    })
    .await;
    assert!(
        imported.is_some(),
        "the import did not create every queue and binding: {}",
        listed("list_queues", &["name", "arguments"])
    );

    // The installation's processes: the test's database, the loaded vhost, the default prefix.
    let broker_env = [
        ("AMQP_URL", vhost.url()),
        ("TRAILMARK__BROKER__PREFIX", default_prefix.clone()),
    ];
    let out = env
        .command(&["migrate"])
        .envs(broker_env.iter().cloned())
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "migrate: {stdout}{stderr}");
    assert!(
        !stderr.contains("PRECONDITION_FAILED") && !stderr.contains(QUORUM_GROUP_SIZE_ARG),
        "migrate found the loaded queues different from its own: {stderr}"
    );
    let _serve = env.spawn_process_with(None, &broker_env);
    let out = env
        .command(&[
            "run",
            "start",
            "chain",
            "--run-id",
            "defs-1",
            "--input",
            r#"{"steps":5}"#,
        ])
        .envs(broker_env.iter().cloned())
        .output()
        .unwrap();
    assert!(out.status.success(), "run start: {:?}", text(&out));
    env.wait_status("defs-1", RunStatus::Succeeded, Duration::from_secs(60))
        .await;
    assert_eq!(
        env.chain_ledger("defs-1").await,
        (5, 5),
        "one ledger row per step"
    );
    assert_eq!(env.steps_done("defs-1").await, 5);
}

/// Declares `topology`'s queues as a trailmark before the group size declared them: the same
/// arguments without `x-quorum-initial-group-size`.
async fn declare_without_group_size(env: &TestEnv, topology: &Topology) {
    let conn = broker::connect(&env.settings.broker, "test-old-declare")
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    topology
        .delete(&ch)
        .await
        .expect("delete the test topology");
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    for q in topology.queues() {
        let mut args = q.arguments.inner().clone();
        args.remove(QUORUM_GROUP_SIZE_ARG);
        ch.queue_declare(q.name.as_str().into(), durable, FieldTable::from(args))
            .await
            .expect("declare as before");
    }
    let _ = conn.close(200, "done".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queues_declared_without_the_group_size_are_kept_by_migrate_with_a_warning() {
    let env = TestEnv::new().await;
    let topology = env.topology();
    declare_without_group_size(&env, &topology).await;

    let out = env.command(&["migrate"]).output().unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "migrate: {stdout}{stderr}");
    for q in topology.queues() {
        assert!(
            stderr.contains(&format!(
                "{} (declared without {QUORUM_GROUP_SIZE_ARG}",
                q.name
            )),
            "migrate does not name {}: {stderr}",
            q.name
        );
    }

    let conn = broker::connect(&env.settings.broker, "test").await.unwrap();
    let kept = topology.declare(&conn).await.expect("declare again");
    let expected: Vec<KeptGroupSize> = topology
        .queues()
        .into_iter()
        .map(|q| KeptGroupSize {
            queue: q.name,
            declared: None,
            configured: 3,
        })
        .collect();
    assert_eq!(kept, expected);
    let _ = conn.close(200, "done".into()).await;

    // The queues still work: a run goes through them.
    let _serve = env.spawn_process(None);
    env.start_run("chain", "old-1", serde_json::json!({"steps": 3}))
        .await;
    env.wait_status("old-1", RunStatus::Succeeded, Duration::from_secs(60))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_group_size_is_kept_but_another_delivery_limit_is_refused_naming_the_queue() {
    let env = TestEnv::new().await;
    let conn = broker::connect(&env.settings.broker, "test").await.unwrap();

    // Declared with 3 by the test setup (a single node accepts 3); 5 is configured now.
    let kept = env
        .topology()
        .with_quorum_group_size(5)
        .declare(&conn)
        .await
        .expect("another group size is kept");
    assert_eq!(kept.len(), env.topology().queues().len(), "{kept:?}");
    assert!(
        kept.iter()
            .all(|k| k.declared == Some(3) && k.configured == 5),
        "{kept:?}"
    );

    let limit = env.settings.broker.delivery_limit + 1;
    let other = Topology::new(&env.prefix, limit);
    let e = other
        .declare(&conn)
        .await
        .expect_err("another delivery limit is refused");
    let shown = trailmark::error::Report(&e).to_string();
    assert_eq!(
        trailmark::reaction::reaction(&e),
        trailmark::error::Reaction::Fix,
        "{shown}"
    );
    assert!(
        shown.contains(&format!("queue {}.runs.start", env.prefix))
            && shown.contains("x-delivery-limit")
            && shown.contains("trailmark migrate"),
        "{shown}"
    );
    let _ = conn.close(200, "done".into()).await;
}
