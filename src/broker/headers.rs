//! Conversions between AMQP header tables and plain string maps (what the outbox stores).

use std::collections::BTreeMap;

use lapin::types::{AMQPValue, FieldTable};

/// A string map as an AMQP header table.
pub fn map_to_headers(map: &BTreeMap<String, String>) -> FieldTable {
    let mut table = FieldTable::default();
    for (k, v) in map {
        table.insert(k.as_str().into(), AMQPValue::LongString(v.as_str().into()));
    }
    table
}

/// An AMQP header table as strings; numbers are printed, nested values rendered for display.
pub fn headers_to_map(table: Option<&FieldTable>) -> BTreeMap<String, String> {
    let Some(table) = table else {
        return BTreeMap::new();
    };
    table
        .inner()
        .iter()
        .map(|(k, v)| (k.to_string(), value_str(v)))
        .collect()
}

/// One header as a string, if present.
pub fn header_str(table: Option<&FieldTable>, key: &str) -> Option<String> {
    table?.inner().get(key).map(value_str)
}

fn value_str(v: &AMQPValue) -> String {
    match v {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.to_string(),
        AMQPValue::LongInt(n) => n.to_string(),
        AMQPValue::LongUInt(n) => n.to_string(),
        AMQPValue::LongLongInt(n) => n.to_string(),
        AMQPValue::ShortInt(n) => n.to_string(),
        AMQPValue::ShortUInt(n) => n.to_string(),
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::Timestamp(t) => t.to_string(),
        other => format!("{other:?}"),
    }
}
