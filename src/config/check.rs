//! What a configuration must be before anything starts: every key known to this build (a typo
//! is named with the key it was probably meant to be) and every value inside its range.

use std::collections::BTreeSet;

use serde_json::Value;

use super::tls::{Pem, read_pem};
use super::{BrokerSettings, Error, Settings};

/// Refuses keys, from the file or the environment, that no setting has.
pub(super) fn known_keys(built: &config::Config, file: Option<&str>) -> Result<(), Error> {
    let known = keys_of(&serde_json::to_value(Settings::defaults()).expect("settings serialise"));
    let given = built
        .clone()
        .try_deserialize::<Value>()
        .map_err(|e| Error(e.to_string()))?;
    for key in keys_of(&given) {
        // Keep times of single workflows are keyed by workflow name.
        if known.contains(&key) || key.starts_with("retention.workflows.") {
            continue;
        }
        let env_name = env_name(&key);
        let from = if std::env::var_os(&env_name).is_some() {
            format!("set by {env_name}")
        } else {
            format!("in {}", file.unwrap_or("the configuration file"))
        };
        let hint = match nearest(&key, &known) {
            Some(near) => format!("; did you mean {near}?"),
            None => "; see config/default.toml for every key".into(),
        };
        return Err(Error(format!("unknown setting {key} ({from}){hint}")));
    }
    Ok(())
}

/// Dotted paths of the leaves of a table (`worker.concurrency`, ...).
fn keys_of(value: &Value) -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    let mut stack = vec![(String::new(), value)];
    while let Some((path, v)) = stack.pop() {
        match v {
            Value::Object(map) => {
                for (k, child) in map {
                    let key = if path.is_empty() {
                        k.clone()
                    } else {
                        format!("{path}.{k}")
                    };
                    stack.push((key, child));
                }
            }
            _ => {
                keys.insert(path);
            }
        }
    }
    keys
}

/// The known key closest to `key` (edit distance at most a third of its length).
fn nearest<'a>(key: &str, known: &'a BTreeSet<String>) -> Option<&'a str> {
    known
        .iter()
        .map(|k| (distance(key, k), k))
        .filter(|(d, _)| *d <= key.len().div_ceil(3))
        .min()
        .map(|(_, k)| k.as_str())
}

/// Levenshtein distance.
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (diagonal + usize::from(ca != *cb))
                .min(row[j] + 1)
                .min(above + 1);
            diagonal = above;
        }
    }
    row[b.len()]
}

/// The whole-number settings and their ranges (inclusive).
const LIMITS: [(&str, i128, i128); 44] = [
    ("database.max_connections", 1, 10_000),
    ("database.connect_timeout_ms", 1, 3_600_000),
    ("broker.delivery_limit", 1, 1_000_000),
    // Replicas of a quorum queue: more than 7 slows every write for no gain (RabbitMQ's advice).
    ("broker.quorum_group_size", 1, 7),
    ("broker.confirm_timeout_ms", 1, 3_600_000),
    ("worker.concurrency", 1, 65_535),
    ("worker.max_batch", 1, 10_000),
    ("worker.lease_secs", 2, 86_400),
    ("worker.heartbeat_secs", 1, 86_399),
    ("worker.busy_retry_ms", 1, 3_600_000),
    ("worker.newer_version_wait_secs", 1, 604_800),
    ("worker.max_message_bytes", 1_024, 1 << 30),
    ("worker.call_retries", 0, 100),
    ("worker.max_attempts", 1, 1_000),
    ("worker.retry_base_ms", 1, 3_600_000),
    ("worker.step_timeout_secs", 1, 604_800),
    ("relay.eager_grace_ms", 0, 3_600_000),
    ("relay.batch_size", 1, 100_000),
    ("relay.poll_interval_ms", 1, 3_600_000),
    ("supervisor.interval_ms", 1, 3_600_000),
    ("waits.poll_ms", 10, 60_000),
    ("flow.poll_ms", 10, 60_000),
    ("flow.aging_secs", 1, 86_400),
    // Up to ten years: a wait is a row and a due time, whatever its length.
    ("waits.max_secs", 1, 315_360_000),
    ("waits.event_keep_secs", 1, 315_360_000),
    ("waits.event_retention_secs", 0, 315_360_000),
    ("retention.keep_secs", 0, 315_360_000),
    ("retention.tombstone_secs", 3_600, 315_360_000),
    ("retention.inbox_secs", 3_600, 315_360_000),
    ("retention.audit_secs", 0, 315_360_000),
    ("retention.interval_secs", 1, 86_400),
    ("retention.batch", 1, 10_000),
    ("retention.duty_percent", 1, 100),
    ("guards.breaker_open_secs", 1, 86_400),
    ("guards.repeat_limit", 0, 1_000_000),
    ("model.timeout_ms", 1, 3_600_000),
    // 0: no limit. A billion per minute is far beyond any provider's, and far below the bigint
    // the window's sum is kept in.
    ("model.requests_per_minute", 0, 1_000_000_000),
    ("model.tokens_per_minute", 0, 1_000_000_000),
    ("process.startup_timeout_secs", 0, 86_400),
    ("process.drain_delay_ms", 0, 600_000),
    ("api.body_limit_bytes", 1_024, 1 << 30),
    ("api.request_timeout_secs", 1, 3_600),
    ("api.idempotency_retention_secs", 60, 31_536_000),
    ("api.console_session_secs", 60, 2_592_000),
];

/// What a value that did not even parse must be, when the driver's message names its key.
pub(super) fn explain(parse_error: &str) -> String {
    let key = parse_error
        .split("for key `")
        .nth(1)
        .and_then(|rest| rest.split('`').next());
    match key.and_then(|k| LIMITS.iter().find(|(name, ..)| *name == k)) {
        Some((key, min, max)) => {
            format!("{parse_error}; {key} must be a whole number from {min} to {max}")
        }
        None => format!("{parse_error}; see config/default.toml for every key and its unit"),
    }
}

/// Refuses values outside their ranges, naming the key and the range.
pub(super) fn ranges(s: &Settings) -> Result<(), Error> {
    let values = serde_json::to_value(s).expect("settings serialise");
    for (key, min, max) in LIMITS {
        let value = key
            .split('.')
            .try_fold(&values, |v, part| v.get(part))
            .and_then(|v| v.as_i64().map(i128::from).or(v.as_u64().map(i128::from)))
            .expect("every limited key is a whole-number setting");
        if !(min..=max).contains(&value) {
            return Err(Error(format!(
                "{key} is {value}; it must be from {min} to {max} (see config/default.toml)"
            )));
        }
    }
    let w = &s.worker;
    if w.heartbeat_secs >= w.lease_secs {
        return Err(Error(format!(
            "worker.heartbeat_secs ({}) must be below worker.lease_secs ({}), or the lease expires between heartbeats",
            w.heartbeat_secs, w.lease_secs
        )));
    }
    for (workflow, secs) in &s.retention.workflows {
        if *secs > 315_360_000 {
            return Err(Error(format!(
                "retention.workflows.{workflow} is {secs}; it must be from 0 (keep for ever) to 315360000 (ten years) (see config/default.toml)"
            )));
        }
    }
    super::tokens::parse_tokens(&s.api.tokens).map_err(Error)?;
    database_scheme(&s.database.url)?;
    database_hosts(&s.database.hosts)?;
    model_limits(&s.model)?;
    let g = &s.guards;
    if g.max_cost < 0.0 || !g.max_cost.is_finite() {
        return Err(Error(format!(
            "guards.max_cost is {}; it must be 0 (no limit) or more",
            g.max_cost
        )));
    }
    Ok(())
}

/// Refuses a model limit with no model to hold it against: the offline answer calls nothing, so
/// the limit would do nothing, which is most likely a `model.base_url` that was meant to be set.
fn model_limits(m: &crate::model::ModelSettings) -> Result<(), Error> {
    let limits = [
        ("model.requests_per_minute", m.requests_per_minute),
        ("model.tokens_per_minute", m.tokens_per_minute),
    ];
    match limits.iter().find(|(_, v)| *v > 0) {
        Some((key, value)) if !m.is_configured() => Err(Error(format!(
            "{key} is {value}, but model.base_url is empty: no model is configured, so there is nothing to limit; set model.base_url, or set {key} to 0"
        ))),
        _ => Ok(()),
    }
}

/// Refuses a database URL of another kind of server (`mysql://...`), which the Postgres driver
/// would otherwise try as if it were Postgres and fail with words about the wrong thing.
fn database_scheme(url: &str) -> Result<(), Error> {
    let scheme = url.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
    match scheme.as_deref() {
        Some("postgres" | "postgresql") => Ok(()),
        _ => Err(Error(format!(
            "DATABASE_URL {} is not a PostgreSQL URL: trailmark keeps its runs in PostgreSQL; give postgres://user@host:5432/database",
            crate::redact::url(url)
        ))),
    }
}

/// Refuses a host list entry that is empty, holds a URL, or names a port that is not a port.
fn database_hosts(hosts: &[String]) -> Result<(), Error> {
    for h in hosts {
        let bad = |why: &str| {
            Err(Error(format!(
                "database.hosts holds {:?}, {why}: give `host` or `host:port` per entry (user, password and database come from DATABASE_URL)",
                crate::redact::url(h)
            )))
        };
        if h.trim().is_empty() {
            return bad("an empty entry");
        }
        if h.contains('/') || h.contains('@') {
            return bad("which looks like a URL");
        }
        let (_, port) = super::split_host(h);
        if port.is_none() && h.matches(':').count() == 1 {
            return bad("whose port is not a number from 1 to 65535");
        }
        if port == Some(0) {
            return bad("whose port is 0");
        }
    }
    Ok(())
}

/// Refuses TLS settings that cannot work, before anything connects: a certificate file that
/// cannot be read or holds no certificate (or key), a CA that the connection would not use, half
/// of a client certificate.
pub(super) fn tls(s: &Settings) -> Result<(), Error> {
    database_tls(&s.database.url)?;
    broker_tls(&s.broker)
}

/// The TLS parameters of a Postgres URL (libpq's names, which the driver reads too).
fn database_tls(url: &str) -> Result<(), Error> {
    // A URL that does not parse is refused, with its problem, by the driver when it connects.
    let Ok(parsed) = url::Url::parse(url) else {
        return Ok(());
    };
    let param = |names: &[&str]| {
        parsed
            .query_pairs()
            .find(|(k, _)| names.contains(&k.as_ref()))
            .map(|(_, v)| v.into_owned())
    };
    let mode = param(&["sslmode", "ssl-mode"]);
    if let Some(root) = param(&["sslrootcert", "ssl-root-cert", "ssl-ca"]) {
        // The driver checks the certificate only with verify-ca and verify-full (libpq's require
        // also checks it when a root certificate is given; this driver does not): with any other
        // mode the CA file would be ignored without a word.
        let why = match mode.as_deref() {
            Some("verify-ca" | "verify-full") => None,
            None => Some("no sslmode".to_owned()),
            Some(other) => Some(format!(
                "sslmode={other}, which does not check the server's certificate"
            )),
        };
        if let Some(why) = why {
            return Err(Error(format!(
                "DATABASE_URL sets sslrootcert but {why}: add sslmode=verify-full (or verify-ca, which does not check the host name)"
            )));
        }
        read_pem("DATABASE_URL's sslrootcert", &root, Pem::Certificates).map_err(file)?;
    }
    match (
        param(&["sslcert", "ssl-cert"]),
        param(&["sslkey", "ssl-key"]),
    ) {
        (Some(cert), Some(key)) => {
            read_pem("DATABASE_URL's sslcert", &cert, Pem::Certificates).map_err(file)?;
            read_pem("DATABASE_URL's sslkey", &key, Pem::PrivateKey).map_err(file)?;
        }
        (None, None) => {}
        _ => {
            return Err(Error(
                "DATABASE_URL sets only one of sslcert and sslkey: a client certificate needs both"
                    .into(),
            ));
        }
    }
    Ok(())
}

/// The broker's TLS files, and the URL that must use TLS for them to mean anything.
fn broker_tls(b: &BrokerSettings) -> Result<(), Error> {
    let files = [
        ("broker.ca_file", &b.ca_file, Pem::Certificates),
        (
            "broker.client_cert_file",
            &b.client_cert_file,
            Pem::Certificates,
        ),
        (
            "broker.client_key_file",
            &b.client_key_file,
            Pem::PrivateKey,
        ),
    ];
    for parsed in b
        .addresses()
        .into_iter()
        .filter_map(|u| url::Url::parse(u).ok())
    {
        // RabbitMQ's URI spec names TLS files in the query; this client ignores them, so a URL
        // that sets them would connect without them.
        let ignored = |k: &str| match k {
            "cacertfile" => Some("broker.ca_file"),
            "certfile" => Some("broker.client_cert_file"),
            "keyfile" => Some("broker.client_key_file"),
            _ => None,
        };
        if let Some((k, setting)) = parsed
            .query_pairs()
            .find_map(|(k, _)| ignored(&k).map(|s| (k.into_owned(), s)))
        {
            return Err(Error(format!(
                "AMQP_URL sets {k}, which trailmark's RabbitMQ client does not read: set {setting} instead ({})",
                env_name(setting)
            )));
        }
    }
    let tls = b.addresses().into_iter().all(|u| {
        u.trim_start()
            .get(..8)
            .is_some_and(|scheme| scheme.eq_ignore_ascii_case("amqps://"))
    });
    for (setting, path, kind) in files {
        if path.is_empty() {
            continue;
        }
        if !tls {
            return Err(Error(format!(
                "{setting} is set but AMQP_URL does not use TLS (amqp://): use amqps:// (port 5671 by default), or leave {setting} empty"
            )));
        }
        read_pem(setting, path, kind).map_err(file)?;
    }
    if b.client_cert_file.is_empty() != b.client_key_file.is_empty() {
        return Err(Error(
            "only one of broker.client_cert_file and broker.client_key_file is set: a client certificate needs both".into(),
        ));
    }
    Ok(())
}

/// The environment variable that sets `key` (`broker.ca_file` -> `TRAILMARK__BROKER__CA_FILE`).
fn env_name(key: &str) -> String {
    format!("TRAILMARK__{}", key.replace('.', "__").to_ascii_uppercase())
}

fn file(e: super::tls::FileError) -> Error {
    Error(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_typo_names_the_key_it_was_meant_to_be() {
        let known: BTreeSet<String> =
            ["worker.concurrency", "worker.max_batch", "relay.batch_size"]
                .map(String::from)
                .into();
        assert_eq!(
            nearest("worker.concurency", &known),
            Some("worker.concurrency")
        );
        assert_eq!(nearest("worker.max_bach", &known), Some("worker.max_batch"));
        assert_eq!(nearest("nothing.like.it", &known), None);
    }

    #[test]
    fn keep_times_of_single_workflows_are_read_by_name_and_checked() {
        let path = std::env::temp_dir().join(format!("tm-retention-{}.toml", std::process::id()));
        let load = |text: &str| {
            std::fs::write(&path, text).unwrap();
            Settings::load_from(Some(path.to_str().unwrap())).map_err(|e| e.to_string())
        };
        let s = load("[retention]\nworkflows = { chain = 86400, reconcile = 0 }\n").unwrap();
        assert_eq!(s.retention.workflows["chain"], 86_400);
        assert_eq!(s.retention.workflows["reconcile"], 0);
        let refused = load("[retention]\nworkflows = { chain = 999999999999 }\n").unwrap_err();
        assert!(
            refused.contains("retention.workflows.chain is 999999999999"),
            "{refused}"
        );
        let refused = load("[retention]\nkeep_sec = 10\n").unwrap_err();
        assert!(
            refused.contains("did you mean retention.keep_secs?"),
            "{refused}"
        );
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn model_limits_are_read_and_bad_ones_refused_naming_the_field_and_why() {
        let path =
            std::env::temp_dir().join(format!("tm-model-limits-{}.toml", std::process::id()));
        let load = |text: &str| {
            std::fs::write(&path, text).unwrap();
            Settings::load_from(Some(path.to_str().unwrap())).map_err(|e| e.to_string())
        };
        let model = "[model]\nbase_url = \"http://127.0.0.1:1/v1\"\n";
        let s = load(&format!(
            "{model}requests_per_minute = 60\ntokens_per_minute = 90000\n"
        ))
        .unwrap();
        assert_eq!(
            (s.model.requests_per_minute, s.model.tokens_per_minute),
            (60, 90_000)
        );
        let s = load(model).unwrap();
        assert_eq!(
            (s.model.requests_per_minute, s.model.tokens_per_minute),
            (0, 0),
            "no limit unless set"
        );
        let refused = load(&format!("{model}tokens_per_minute = -5\n")).unwrap_err();
        assert!(
            refused.contains("model.tokens_per_minute must be a whole number from 0 to 1000000000"),
            "{refused}"
        );
        let refused = load(&format!("{model}requests_per_minute = 2000000000\n")).unwrap_err();
        assert!(
            refused.contains(
                "model.requests_per_minute is 2000000000; it must be from 0 to 1000000000"
            ),
            "{refused}"
        );
        let refused = load("[model]\ntokens_per_minute = 1000\n").unwrap_err();
        assert!(
            refused.contains("model.tokens_per_minute is 1000, but model.base_url is empty"),
            "{refused}"
        );
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn tls_settings_that_cannot_work_are_refused_naming_the_setting_and_the_file() {
        let dir = std::env::temp_dir().join(format!("tm-check-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // Only the PEM framing is checked at load; the handshake checks the rest.
        let ca = dir.join("ca.pem");
        std::fs::write(
            &ca,
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let ca = ca.display().to_string();
        let refused = |database_url: &str, broker: &dyn Fn(&mut BrokerSettings)| {
            let mut s = Settings::defaults();
            s.database.url = database_url.to_owned();
            broker(&mut s.broker);
            tls(&s).err().map(|e| e.to_string())
        };
        let pg = "postgres://u@db.example:5432/tm";
        let amqps = |b: &mut BrokerSettings| b.url = "amqps://u:pw@mq.example/%2f".into();
        assert_eq!(refused(pg, &|_| {}), None);
        let ok = format!("{pg}?sslmode=verify-full&sslrootcert={ca}");
        assert_eq!(refused(&ok, &|_| {}), None);
        type Change<'a> = Box<dyn Fn(&mut BrokerSettings) + 'a>;
        let cases: Vec<(String, Change, &str)> = vec![
            (
                format!("{pg}?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem"),
                Box::new(|_| {}),
                "DATABASE_URL's sslrootcert names /nonexistent/ca.pem, which cannot be read",
            ),
            (
                format!("{pg}?sslrootcert={ca}"),
                Box::new(|_| {}),
                "sets sslrootcert but no sslmode: add sslmode=verify-full",
            ),
            (
                format!("{pg}?sslmode=require&sslrootcert={ca}"),
                Box::new(|_| {}),
                "sslmode=require, which does not check the server's certificate",
            ),
            (
                format!("{pg}?sslmode=verify-full&sslcert={ca}"),
                Box::new(|_| {}),
                "only one of sslcert and sslkey",
            ),
            (
                pg.into(),
                Box::new(|b| b.ca_file = "/nonexistent/ca.pem".into()),
                "broker.ca_file is set but AMQP_URL does not use TLS (amqp://): use amqps://",
            ),
            (
                pg.into(),
                Box::new(move |b| {
                    amqps(b);
                    b.ca_file = "/nonexistent/ca.pem".into();
                }),
                "broker.ca_file names /nonexistent/ca.pem, which cannot be read",
            ),
            (
                pg.into(),
                Box::new(|b| {
                    amqps(b);
                    b.client_key_file = ca.clone();
                }),
                "broker.client_key_file names",
            ),
            (
                pg.into(),
                Box::new(|b| {
                    amqps(b);
                    b.client_cert_file = ca.clone();
                }),
                "only one of broker.client_cert_file and broker.client_key_file",
            ),
            (
                pg.into(),
                Box::new(|b| b.url = "amqps://mq.example/%2f?cacertfile=/etc/ca.pem".into()),
                "AMQP_URL sets cacertfile, which trailmark's RabbitMQ client does not read: set broker.ca_file instead (TRAILMARK__BROKER__CA_FILE)",
            ),
        ];
        let shown: Vec<_> = cases
            .iter()
            .map(|(url, broker, _)| refused(url, broker.as_ref()))
            .collect();
        let amqps_ok = refused(pg, &|b| {
            amqps(b);
            b.ca_file = ca.clone();
        });
        let _ = std::fs::remove_dir_all(&dir);
        for ((_, _, expected), shown) in cases.iter().zip(shown) {
            let shown = shown.unwrap_or_default();
            assert!(
                shown.contains(expected),
                "expected {expected:?} in {shown:?}"
            );
            assert!(!shown.contains("pw@"), "{shown}");
        }
        assert_eq!(amqps_ok, None);
    }

    #[test]
    fn one_token_hash_under_two_roles_stops_the_settings() {
        let mut s = Settings::defaults();
        let hash = super::super::tokens::hash_token("tm_shared");
        s.api.tokens = vec![format!("olga:viewer:{hash}"), format!("olga2:admin:{hash}")];
        let e = ranges(&s).unwrap_err().to_string();
        assert!(e.contains("api.tokens") && e.contains("same hash"), "{e}");
    }

    #[test]
    fn a_database_url_of_another_server_is_refused_without_its_password() {
        let mut s = Settings::defaults();
        for ok in [
            "postgres://u@db/x",
            "postgresql://u@db/x",
            "POSTGRES://u@db/x",
        ] {
            s.database.url = ok.into();
            assert!(ranges(&s).is_ok(), "{ok}");
        }
        for bad in ["mysql://u:pw@db/x", "db.example:5432/x", "sqlite://x.db"] {
            s.database.url = bad.into();
            let e = ranges(&s).unwrap_err().to_string();
            assert!(
                e.contains("not a PostgreSQL URL") && !e.contains(":pw@"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn database_hosts_are_host_or_host_and_port() {
        let mut s = Settings::defaults();
        s.database.hosts = vec!["db1:5433".into(), "db2".into(), "[::1]:5432".into()];
        assert!(ranges(&s).is_ok());
        for (bad, why) in [
            ("db:abc", "port is not a number"),
            ("db:70000", "port is not a number"),
            ("db:0", "port is 0"),
            (" ", "an empty entry"),
            ("postgres://u:pw@db/x", "looks like a URL"),
        ] {
            s.database.hosts = vec!["db1".into(), bad.into()];
            let e = ranges(&s).unwrap_err().to_string();
            assert!(
                e.contains("database.hosts") && e.contains(why) && !e.contains(":pw@"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn values_outside_their_range_are_refused_with_the_range() {
        let mut s = Settings::defaults();
        s.database.max_connections = 0;
        let e = ranges(&s).unwrap_err().to_string();
        assert!(
            e.contains("database.max_connections is 0") && e.contains("from 1 to"),
            "{e}"
        );
        let mut s = Settings::defaults();
        s.worker.max_batch = 0;
        assert!(
            ranges(&s)
                .unwrap_err()
                .to_string()
                .contains("worker.max_batch")
        );
        for size in [0, 8] {
            let mut s = Settings::defaults();
            s.broker.quorum_group_size = size;
            let e = ranges(&s).unwrap_err().to_string();
            assert!(
                e.contains(&format!("broker.quorum_group_size is {size}"))
                    && e.contains("from 1 to 7"),
                "{e}"
            );
        }
        let mut s = Settings::defaults();
        s.relay.eager_grace_ms = -5;
        assert!(
            ranges(&s)
                .unwrap_err()
                .to_string()
                .contains("relay.eager_grace_ms is -5")
        );
        let mut s = Settings::defaults();
        s.worker.heartbeat_secs = s.worker.lease_secs;
        assert!(
            ranges(&s)
                .unwrap_err()
                .to_string()
                .contains("below worker.lease_secs")
        );
        assert!(ranges(&Settings::defaults()).is_ok());
    }
}
