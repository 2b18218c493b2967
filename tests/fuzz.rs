//! Fuzzing the parsers that read what other systems send: the step message decoder, the
//! run-start event parser, dead letters' headers and bodies, the configuration loader, and the
//! ids and URLs they carry. Each target first replays its corpus (`tests/fuzz-corpus/<target>/`,
//! inputs worth keeping: valid messages and the odd ones that once mattered), then runs
//! generated inputs: mutations of the corpus (bytes flipped, cut, spliced) and inputs built from
//! scratch. None may panic; what parses must survive a round trip.
//!
//! `TRAILMARK_FUZZ_CASES` sets the generated cases per target (default 1,000, seconds in CI);
//! the README gives the long run's command. A failing case is shrunk by proptest and saved in
//! `tests/fuzz.proptest-regressions`, which is kept in the repository and replayed first.

use std::path::PathBuf;

use lapin::types::{AMQPValue, ByteArray, FieldArray, FieldTable, LongString, ShortString};
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence};
use trailmark::config::Settings;
use trailmark::dlq::{BodyView, DeadLetter, headers_json};
use trailmark::domain::{IdempotencyKey, RunId, RunStartEvent, StepMessage};

/// Body limit the decoders are fuzzed with (small, so the oversized branch is reached).
const LIMIT: usize = 4096;

fn config() -> Config {
    let cases = std::env::var("TRAILMARK_FUZZ_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1_000);
    Config {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..Config::default()
    }
}

/// The corpus of one target, as bytes.
fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz-corpus")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("corpus entry").path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{} holds no corpus", dir.display());
    files
        .iter()
        .map(|f| std::fs::read(f).expect("corpus file"))
        .collect()
}

/// A corpus entry changed the way fuzzers change inputs: a byte flipped, the tail cut, a run of
/// random bytes spliced in.
fn mutated(seeds: Vec<Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    let n = seeds.len();
    (
        0..n,
        any::<usize>(),
        any::<u8>(),
        0..4u8,
        prop::collection::vec(any::<u8>(), 0..16),
    )
        .prop_map(move |(i, at, byte, how, splice)| {
            let mut s = seeds[i].clone();
            let at = if s.is_empty() { 0 } else { at % s.len() };
            match how {
                0 if !s.is_empty() => s[at] ^= byte | 1,
                1 => s.truncate(at),
                2 => {
                    s.splice(at..at, splice);
                }
                _ => s.extend(splice),
            }
            s
        })
}

/// Bodies: the corpus mutated, arbitrary bytes, or JSON objects with the fields messages have,
/// holding values of any type.
fn bodies(target: &str) -> impl Strategy<Value = Vec<u8>> {
    let known = prop::sample::select(vec![
        "v",
        "message_id",
        "run_id",
        "workflow",
        "version",
        "step",
        "seq",
        "input",
    ])
    .prop_map(String::from);
    let field = prop_oneof![3 => known, 1 => ".{0,8}"];
    let value = prop_oneof![
        Just(serde_json::Value::Null),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<f64>().prop_map(serde_json::Value::from),
        ".{0,40}".prop_map(serde_json::Value::from),
        Just(serde_json::json!({"nested": [1, "two", null]})),
    ];
    let object = prop::collection::btree_map(field, value, 0..8)
        .prop_map(|m| serde_json::to_vec(&m).expect("a map serialises"));
    prop_oneof![
        4 => mutated(corpus(target)),
        2 => prop::collection::vec(any::<u8>(), 0..LIMIT + 64),
        3 => object,
    ]
}

/// What a decoder must do with any body: refuse it with a known reason, or give a message that
/// encodes back to a body it decodes to again.
fn decodes_or_refuses<T, E>(
    body: &[u8],
    decode: impl Fn(&[u8]) -> Result<T, trailmark::domain::DecodeError>,
    encode: impl Fn(&T) -> E,
) -> Result<(), TestCaseError>
where
    T: std::fmt::Debug + PartialEq,
    E: AsRef<[u8]>,
{
    match decode(body) {
        Ok(msg) => {
            let again = decode(encode(&msg).as_ref());
            prop_assert_eq!(again.as_ref().ok(), Some(&msg), "round trip of {:?}", msg);
        }
        Err(e) => {
            let known = ["oversized", "undecodable", "unsupported_version"];
            prop_assert!(
                known.contains(&e.code()),
                "reason {:?} for {:?}",
                e.code(),
                e
            );
            if body.len() > LIMIT {
                prop_assert_eq!(e.code(), "oversized");
            }
        }
    }
    Ok(())
}

#[test]
fn the_step_message_decoder_refuses_or_round_trips_every_body() {
    for body in corpus("step") {
        decodes_or_refuses(
            &body,
            |b| StepMessage::decode(b, LIMIT),
            StepMessage::encode,
        )
        .unwrap();
    }
    proptest!(config(), |(body in bodies("step"))| {
        decodes_or_refuses(&body, |b| StepMessage::decode(b, LIMIT), StepMessage::encode)?;
    });
}

#[test]
fn the_run_start_parser_refuses_or_round_trips_every_body() {
    for body in corpus("start") {
        decodes_or_refuses(
            &body,
            |b| RunStartEvent::decode(b, LIMIT),
            RunStartEvent::encode,
        )
        .unwrap();
    }
    proptest!(config(), |(body in bodies("start"))| {
        decodes_or_refuses(&body, |b| RunStartEvent::decode(b, LIMIT), RunStartEvent::encode)?;
    });
}

/// Header values of every AMQP type, nested a few levels.
fn amqp_value() -> impl Strategy<Value = AMQPValue> {
    let leaf = prop_oneof![
        any::<bool>().prop_map(AMQPValue::Boolean),
        any::<i8>().prop_map(AMQPValue::ShortShortInt),
        any::<i32>().prop_map(AMQPValue::LongInt),
        any::<i64>().prop_map(AMQPValue::LongLongInt),
        any::<u64>().prop_map(AMQPValue::Timestamp),
        any::<f64>().prop_map(AMQPValue::Double),
        ".{0,24}".prop_map(|s| AMQPValue::LongString(LongString::from(s))),
        prop::collection::vec(any::<u8>(), 0..24)
            .prop_map(|b| AMQPValue::LongString(LongString::from(b))),
        prop::collection::vec(any::<u8>(), 0..8)
            .prop_map(|b| AMQPValue::ByteArray(ByteArray::from(b))),
        Just(AMQPValue::Void),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4)
                .prop_map(|v| AMQPValue::FieldArray(FieldArray::from(v))),
            table(inner).prop_map(AMQPValue::FieldTable),
        ]
    })
}

/// Header names dead letters carry (trailmark's, the broker's `x-death` and its fields) and
/// random ones.
fn header_name() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "x-trailmark-reason",
            "x-trailmark-detail",
            "x-trailmark-queue",
            "x-trailmark-failed-at",
            "x-trailmark-deliveries",
            "x-trailmark-requeued",
            "x-trailmark-exchange",
            "x-trailmark-routing-key",
            "x-death",
            "x-first-death-reason",
            "x-first-death-queue",
            "reason",
            "queue",
            "time",
            "count",
            "exchange",
            "routing-keys",
            "x-delivery-count",
        ])
        .prop_map(String::from),
        "[a-z-]{0,12}",
    ]
}

fn table(values: impl Strategy<Value = AMQPValue>) -> impl Strategy<Value = FieldTable> {
    prop::collection::vec((header_name(), values), 0..6).prop_map(|pairs| {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert(ShortString::from(k), v);
        }
        t
    })
}

/// An `x-death` array as the broker writes it, with fields of any type.
fn x_death() -> impl Strategy<Value = FieldTable> {
    table(amqp_value()).prop_map(|death| {
        let mut t = FieldTable::default();
        let deaths = FieldArray::from(vec![AMQPValue::FieldTable(death)]);
        t.insert(ShortString::from("x-death"), AMQPValue::FieldArray(deaths));
        t
    })
}

#[test]
fn dead_letters_are_read_whatever_their_headers_and_bodies() {
    let bodies = prop_oneof![
        mutated(corpus("letter")),
        prop::collection::vec(any::<u8>(), 0..256)
    ];
    let headers = prop_oneof![table(amqp_value()), x_death()];
    proptest!(config(), |(
        headers in prop::option::of(headers),
        id in prop::option::of(".{0,12}"),
        routing_key in ".{0,12}",
        body in bodies,
    )| {
        let letter = DeadLetter::read(id.as_deref(), headers.as_ref(), &routing_key, &body, 20);
        prop_assert!(!letter.id.is_empty());
        prop_assert!(!letter.reason.is_empty());
        prop_assert_eq!(letter.body_bytes, body.len());
        let _ = headers_json(headers.as_ref());
        let _ = BodyView::of(&body);
    });
}

/// TOML files as people write them: the defaults with lines cut, spliced and changed, and
/// `[section] key = value` lines of any shape.
fn config_files() -> impl Strategy<Value = Vec<u8>> {
    let line = (
        prop::sample::select(vec![
            "database", "broker", "worker", "relay", "api", "model", "guards", "process", "x",
        ]),
        "[a-z_]{1,16}",
        prop_oneof![
            any::<i64>().prop_map(|n| n.to_string()),
            "\"[^\"\\\\]{0,20}\"".prop_map(String::from),
            Just("true".to_owned()),
            Just("[\"a:viewer:00\"]".to_owned()),
            ".{0,12}".prop_map(String::from),
        ],
    )
        .prop_map(|(section, key, value)| format!("[{section}]\n{key} = {value}\n").into_bytes());
    prop_oneof![mutated(corpus("config")), line]
}

#[test]
fn the_config_loader_refuses_bad_files_with_an_error_never_a_panic() {
    let dir = std::env::temp_dir().join(format!("trailmark-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("fuzzed.toml");
    let path = file.to_str().unwrap().to_owned();
    for text in corpus("config") {
        std::fs::write(&file, &text).unwrap();
        let _ = Settings::load_from(Some(&path));
    }
    proptest!(config(), |(text in config_files())| {
        std::fs::write(&file, &text).unwrap();
        if let Err(e) = Settings::load_from(Some(&path)) {
            prop_assert!(!e.to_string().is_empty());
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn ids_and_urls_from_outside_parse_or_are_refused_and_secrets_stay_hidden() {
    proptest!(config(), |(
        raw in ".{0,80}",
        password in "[A-Za-z0-9]{8,16}",
        host in "[a-z0-9.-]{0,20}",
        rest in "[/?=&a-z0-9%]{0,20}",
    )| {
        if let Ok(id) = RunId::parse(&raw) {
            prop_assert_eq!(id.as_str(), raw.as_str());
        }
        let _ = IdempotencyKey::parse(&raw);
        let _ = trailmark::redact::url(&raw);
        let url = format!("postgres://user:{password}@{host}{rest}");
        let shown = trailmark::redact::url(&url);
        prop_assert!(!shown.contains(&password), "{} shown as {}", url, shown);
        let amqp = format!("amqp://guest:{password}@{host}:5672/{rest}");
        prop_assert!(!trailmark::redact::url(&amqp).contains(&password));
    });
}
