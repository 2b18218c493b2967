//! Local writes: rows a step writes into a table of trailmark's own database, inserted by the
//! step's commit statement itself. The row, the checkpoint, the inbox row and the next step's
//! outbox row are one statement, so the write happens exactly once without an intent recorded
//! before it or a result after it; its key column is the idempotency key, and a row already
//! standing under the key with other values is a conflict, never a silent skip.

use serde_json::{Map, Value};

/// A table steps write to with their commit: its name, its key column (primary key or unique)
/// and the columns a write fills (the key among them). Declared once, as a `static`, by the
/// workflow that writes to it; other columns take their defaults.
#[derive(Debug, PartialEq, Eq)]
pub struct LocalTable {
    name: &'static str,
    key: &'static str,
    columns: &'static [&'static str],
}

/// Why a table declaration or a row cannot be written (a bug in the workflow: the run stops for
/// review with this text).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("local write to {table}: {why}")]
pub struct BadLocalWrite {
    /// The table named.
    pub table: String,
    /// What is wrong, and how to fix it.
    pub why: String,
}

impl LocalTable {
    /// Declares `name` (`table` or `schema.table`), keyed by `key`, filled in `columns`.
    pub const fn new(
        name: &'static str,
        key: &'static str,
        columns: &'static [&'static str],
    ) -> Self {
        Self { name, key, columns }
    }

    /// The table's name as declared.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The key column.
    pub fn key(&self) -> &'static str {
        self.key
    }

    /// The columns a write fills, the key first.
    pub fn columns(&self) -> impl Iterator<Item = &'static str> + '_ {
        std::iter::once(self.key).chain(self.columns.iter().copied().filter(|c| *c != self.key))
    }

    /// The columns compared with a row already standing under the key (all but the key).
    pub fn compared(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.columns().skip(1)
    }

    /// The name, quoted for SQL (`"schema"."table"`).
    pub fn quoted(&self) -> String {
        self.name
            .split('.')
            .map(quote)
            .collect::<Vec<_>>()
            .join(".")
    }

    /// Checks that every name is a plain lower-case SQL identifier (so it can be spliced into
    /// the commit statement) and that the key is one of the columns.
    pub fn check(&self) -> Result<(), BadLocalWrite> {
        let bad = |why: String| BadLocalWrite {
            table: self.name.to_owned(),
            why,
        };
        let parts: Vec<&str> = self.name.split('.').collect();
        if parts.len() > 2 || !parts.iter().all(|p| identifier(p)) {
            return Err(bad(
                "the table must be named `table` or `schema.table` in lower-case letters, digits and _".into(),
            ));
        }
        if let Some(c) = self.columns().find(|c| !identifier(c)) {
            return Err(bad(format!(
                "column {c:?} is not a lower-case identifier (letters, digits and _)"
            )));
        }
        if !self.columns.contains(&self.key) {
            return Err(bad(format!(
                "the key column {:?} must be one of the declared columns",
                self.key
            )));
        }
        Ok(())
    }

    /// A row for this table: an object holding exactly the declared columns, the key not null.
    pub fn row(&'static self, row: Value) -> Result<LocalWrite, BadLocalWrite> {
        self.check()?;
        let bad = |why: String| BadLocalWrite {
            table: self.name.to_owned(),
            why,
        };
        let Value::Object(fields) = row else {
            return Err(bad("a row must be a JSON object of column values".into()));
        };
        if let Some(extra) = fields.keys().find(|k| !self.columns.contains(&k.as_str())) {
            return Err(bad(format!(
                "column {extra:?} is not declared (declared: {})",
                self.columns.join(", ")
            )));
        }
        if let Some(missing) = self.columns().find(|c| !fields.contains_key(*c)) {
            return Err(bad(format!(
                "the row has no value for column {missing:?} (give null for none)"
            )));
        }
        let key = match &fields[self.key] {
            Value::Null => return Err(bad(format!("the key column {:?} is null", self.key))),
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        Ok(LocalWrite {
            table: self,
            key,
            row: fields,
        })
    }
}

/// One row a step writes with its commit.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalWrite {
    /// Where it goes.
    pub table: &'static LocalTable,
    /// The key column's value, as text (for messages and `run show`).
    pub key: String,
    /// The row: every declared column.
    pub row: Map<String, Value>,
}

impl LocalWrite {
    /// `table:key`, the write's name in messages and listings.
    pub fn label(&self) -> String {
        format!("{}:{}", self.table.name, self.key)
    }

    /// What the step row keeps of the write: `[table, key, request hash]`, the hash being the
    /// one a shadow run's record of the same row gets, so a fork's diff compares the two.
    pub fn record(&self) -> Value {
        let row = Value::Object(self.row.clone());
        Value::Array(vec![
            self.table.name.into(),
            self.key.clone().into(),
            super::request_hash(&row).into(),
        ])
    }
}

fn identifier(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some('a'..='z' | '_'))
        && chars.all(|c| matches!(c, 'a'..='z' | '0'..='9' | '_'))
        && s.len() <= 63
}

fn quote(ident: &str) -> String {
    format!("\"{ident}\"")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    static LEDGER: LocalTable =
        LocalTable::new("app.ledger", "reference", &["reference", "amount", "note"]);

    #[test]
    fn a_row_names_its_key_and_every_declared_column() {
        let w = LEDGER
            .row(json!({ "reference": "r-1:0", "amount": 12, "note": null }))
            .unwrap();
        assert_eq!(w.key, "r-1:0");
        assert_eq!(w.label(), "app.ledger:r-1:0");
        let hash = crate::domain::request_hash(
            &json!({ "reference": "r-1:0", "amount": 12, "note": null }),
        );
        assert_eq!(w.record(), json!(["app.ledger", "r-1:0", hash]));
        assert_eq!(LEDGER.quoted(), "\"app\".\"ledger\"");
        assert_eq!(LEDGER.compared().collect::<Vec<_>>(), ["amount", "note"]);
    }

    #[test]
    fn a_row_with_a_missing_extra_or_null_key_column_is_refused_naming_it() {
        let missing = LEDGER.row(json!({ "reference": "k", "amount": 1 }));
        assert!(missing.unwrap_err().why.contains("\"note\""));
        let extra = LEDGER.row(json!({ "reference": "k", "amount": 1, "note": "", "x": 1 }));
        assert!(extra.unwrap_err().why.contains("\"x\" is not declared"));
        let null = LEDGER.row(json!({ "reference": null, "amount": 1, "note": "" }));
        assert!(null.unwrap_err().why.contains("is null"));
        assert!(LEDGER.row(json!([1])).is_err());
    }

    #[test]
    fn names_that_are_not_plain_identifiers_are_refused() {
        static QUOTED: LocalTable = LocalTable::new("app.\"x\"", "k", &["k"]);
        static KEYLESS: LocalTable = LocalTable::new("t", "k", &["a"]);
        static COLUMN: LocalTable = LocalTable::new("t", "k", &["k", "a;drop"]);
        assert!(QUOTED.check().is_err());
        assert!(KEYLESS.check().unwrap_err().why.contains("key column"));
        assert!(COLUMN.check().unwrap_err().why.contains("a;drop"));
    }
}
