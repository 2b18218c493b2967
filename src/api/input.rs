//! Text from outside, checked where it enters: ids in paths, query parameters, the strings of a
//! JSON body, form fields, the headers the API reads. A NUL byte cannot be stored by Postgres
//! (which answers with an error the API would call a broken server), control characters have no
//! place in an id or a log line, and an unbounded reason is printed whole by `run show`. One
//! function, [`check`], decides for the API and the console alike; bad text is a 400 naming the
//! field.

use std::fmt;

/// What a piece of text is, which says what it may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A run id, a dead letter's id, a step or workflow name, a header value: printable, one
    /// line, at most [`MAX_ID`] bytes.
    Id,
    /// A person's reason for a decision: lines and tabs allowed, at most [`MAX_REASON`]
    /// characters.
    Reason,
    /// A query parameter or form field that is neither: one line, at most [`MAX_PARAM`] bytes.
    Param,
    /// A string inside a JSON document (a run's input, a scope): anything but NUL, which
    /// Postgres cannot store.
    Data,
}

/// Longest id accepted (bytes).
pub const MAX_ID: usize = 256;
/// Longest reason accepted (characters).
pub const MAX_REASON: usize = 2_000;
/// Longest other parameter accepted (bytes).
pub const MAX_PARAM: usize = 16_384;

/// Why a piece of text was refused, and which field held it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadText {
    /// The field, parameter or header, as the client named it.
    pub field: String,
    /// What is wrong and what to send instead.
    pub message: String,
}

impl fmt::Display for BadText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for BadText {}

/// The field's name as it may be shown (a field name is outside text too).
fn shown(field: &str) -> String {
    let clean: String = field
        .chars()
        .filter(|c| !c.is_control())
        .take(64)
        .collect();
    if clean.is_empty() {
        "a field".into()
    } else {
        clean
    }
}

/// Whether `value` may be `field` of this `kind`.
pub fn check(field: &str, value: &str, kind: Kind) -> Result<(), BadText> {
    let refuse = |what: String| {
        Err(BadText {
            field: shown(field),
            message: format!("{} {what}", shown(field)),
        })
    };
    if let Some(at) = value.chars().position(|c| c == '\0') {
        return refuse(format!(
            "contains a NUL byte (character {at}); send the text without it"
        ));
    }
    let allowed = |c: char| match kind {
        Kind::Data => true,
        Kind::Reason => c == '\n' || c == '\r' || c == '\t' || !c.is_control(),
        Kind::Id | Kind::Param => !c.is_control(),
    };
    if let Some((at, c)) = value.chars().enumerate().find(|(_, c)| !allowed(*c)) {
        return refuse(format!(
            "contains the control character U+{:04X} (character {at}); send printable text on one line",
            c as u32
        ));
    }
    match kind {
        Kind::Id if value.len() > MAX_ID => refuse(format!(
            "is {} bytes long; at most {MAX_ID} are accepted",
            value.len()
        )),
        Kind::Param if value.len() > MAX_PARAM => refuse(format!(
            "is {} bytes long; at most {MAX_PARAM} are accepted",
            value.len()
        )),
        Kind::Reason if value.chars().count() > MAX_REASON => refuse(format!(
            "is {} characters long; at most {MAX_REASON} are kept with a decision: say why in fewer words and put long evidence elsewhere (a ticket, a link)",
            value.chars().count()
        )),
        _ => Ok(()),
    }
}

/// Every string in a JSON document (and every key), checked as [`Kind::Data`]; the field is
/// the string's path in the document (`input.items[2].name`).
pub fn check_json(value: &serde_json::Value) -> Result<(), BadText> {
    fn walk(path: &str, value: &serde_json::Value) -> Result<(), BadText> {
        let here = |p: &str| if p.is_empty() { "the body".to_owned() } else { p.to_owned() };
        match value {
            serde_json::Value::String(s) => check(&here(path), s, Kind::Data),
            serde_json::Value::Array(items) => items
                .iter()
                .enumerate()
                .try_for_each(|(i, v)| walk(&format!("{}[{i}]", here(path)), v)),
            serde_json::Value::Object(map) => map.iter().try_for_each(|(k, v)| {
                let at = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                check(&format!("a key in {}", here(path)), k, Kind::Data)?;
                walk(&at, v)
            }),
            _ => Ok(()),
        }
    }
    walk("", value)
}

/// A query string or form body (`a=1&b=x+y`) decoded strictly: a percent escape that is not
/// one, or bytes that are not UTF-8, are refused naming the parameter, and every name and value
/// is checked as [`Kind::Param`] (a reason as [`Kind::Reason`]).
pub fn check_form(raw: &[u8]) -> Result<(), BadText> {
    for pair in raw.split(|b| *b == b'&').filter(|p| !p.is_empty()) {
        let mut halves = pair.splitn(2, |b| *b == b'=');
        let name = decode(halves.next().unwrap_or_default());
        let value = decode(halves.next().unwrap_or_default());
        let name = name
            .and_then(|n| String::from_utf8(n).ok())
            .ok_or_else(|| BadText {
                field: "a parameter".into(),
                message: "a parameter's name is not UTF-8 text (or has a broken %-escape); send UTF-8, percent-encoded".into(),
            })?;
        check("a parameter's name", &name, Kind::Param)?;
        let value = value
            .and_then(|v| String::from_utf8(v).ok())
            .ok_or_else(|| BadText {
                field: shown(&name),
                message: format!(
                    "{} is not UTF-8 text (or has a broken %-escape); send UTF-8, percent-encoded",
                    shown(&name)
                ),
            })?;
        let kind = if name == "reason" { Kind::Reason } else { Kind::Param };
        check(&name, &value, kind)?;
    }
    Ok(())
}

/// `application/x-www-form-urlencoded` decoding of one name or value; `None` for a broken escape.
fn decode(raw: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        match raw[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = raw.get(i + 1..i + 3)?;
                let hex = std::str::from_utf8(hex).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    Some(out)
}

/// Every `/`-separated segment of a raw (still percent-encoded) path, decoded strictly and
/// checked as [`Kind::Id`]; `names` gives a segment's field name (an endpoint's `{run_id}`).
pub fn check_path(raw: &str, names: impl Fn(usize) -> Option<String>) -> Result<(), BadText> {
    for (i, segment) in raw.split('/').enumerate() {
        let field = names(i).unwrap_or_else(|| "the path".into());
        let text = decode_path(segment.as_bytes())
            .and_then(|b| String::from_utf8(b).ok())
            .ok_or_else(|| BadText {
                field: field.clone(),
                message: format!(
                    "{field} is not UTF-8 text (or has a broken %-escape); send UTF-8, percent-encoded"
                ),
            })?;
        check(&field, &text, Kind::Id)?;
    }
    Ok(())
}

/// Percent-decoding of a path segment (a `+` is itself there).
fn decode_path(raw: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        if raw[i] == b'%' {
            let hex = std::str::from_utf8(raw.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(raw[i]);
            i += 1;
        }
    }
    Some(out)
}

/// A header the API reads: readable text (visible ASCII), then checked as [`Kind::Id`].
pub fn check_header(name: &str, value: &axum::http::HeaderValue) -> Result<(), BadText> {
    let text = value.to_str().map_err(|_| BadText {
        field: name.into(),
        message: format!("the {name} header is not readable text; send visible ASCII"),
    })?;
    check(name, text, Kind::Id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nul_control_characters_and_length_are_refused_naming_the_field() {
        assert!(check("run_id", "night-2026-10-13", Kind::Id).is_ok());
        let e = check("run_id", "r\0", Kind::Id).unwrap_err();
        assert_eq!(e.field, "run_id");
        assert!(e.message.contains("NUL"), "{e}");
        let e = check("id", "a\u{1b}[31m", Kind::Id).unwrap_err();
        assert!(e.message.contains("U+001B"), "{e}");
        assert!(check("reason", "line one\nline two\ttab", Kind::Reason).is_ok());
        assert!(check("reason", "bell\u{7}", Kind::Reason).is_err());
        let e = check("reason", &"x".repeat(MAX_REASON + 1), Kind::Reason).unwrap_err();
        assert!(e.message.contains("2000"), "{e}");
        assert!(check("run_id", &"x".repeat(MAX_ID + 1), Kind::Id).is_err());
        assert!(check("input", "tab\tand\nlines", Kind::Data).is_ok());
        assert!(check("input", "nul\0", Kind::Data).is_err());
    }

    #[test]
    fn json_strings_and_keys_are_checked_with_their_path() {
        let ok = serde_json::json!({"reason": "x", "input": {"a": ["b\n"]}});
        assert!(check_json(&ok).is_ok());
        let bad = serde_json::json!({"input": {"items": ["ok", "n\u{0}l"]}});
        assert_eq!(check_json(&bad).unwrap_err().field, "input.items[1]");
        let key = serde_json::json!({"input": {"k\u{0}": 1}});
        assert!(check_json(&key).is_err());
    }

    #[test]
    fn forms_are_decoded_strictly() {
        assert!(check_form(b"status=failed&limit=5&reason=a+b%0Ac").is_ok());
        assert_eq!(check_form(b"workflow=a%00b").unwrap_err().field, "workflow");
        assert_eq!(check_form(b"cursor=%FF%FE").unwrap_err().field, "cursor");
        assert!(check_form(b"limit=%zz").is_err());
        assert!(check_form(b"reason=%07").is_err());
    }

    #[test]
    fn path_segments_are_decoded_strictly_and_named() {
        let names = |i: usize| (i == 4).then(|| "run_id".to_owned());
        assert!(check_path("/api/v1/runs/night%2F1", names).is_ok());
        assert_eq!(check_path("/api/v1/runs/a%00b", names).unwrap_err().field, "run_id");
        assert_eq!(check_path("/api/v1/runs/%C3%28", names).unwrap_err().field, "run_id");
        assert!(check_path("/dead-letters/%zz", |_| None).is_err());
    }
}
