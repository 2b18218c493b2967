//! The key a run is counted under: a field of its input, named by a dotted path, read once when
//! the run starts.

use serde_json::Value;

/// The longest key value a run may carry (bytes): keys are stored and indexed with every waiting
/// run and named in metrics labels, so a value past this is refused at start.
pub const MAX_KEY_LEN: usize = 128;

/// A field of a run's input that names its key, e.g. `tenant` or `customer.id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyField {
    path: Vec<String>,
}

/// Why a key field or a run's key value was refused, naming the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The declared path is not one a field can be named by.
    #[error(
        "key field {0:?} is not a dotted path of input field names (letters, digits, _ and -, e.g. \"tenant\" or \"customer.id\")"
    )]
    BadPath(String),
    /// The run's input has no such field (or it is null).
    #[error("the input has no field {field} (the workflow's key); start the run with it set")]
    Missing {
        /// The field.
        field: String,
    },
    /// The field holds something that cannot be a key (an object or an array).
    #[error("the input's field {field} is {kind}; a key must be a string, a number or a boolean")]
    NotScalar {
        /// The field.
        field: String,
        /// What it holds.
        kind: &'static str,
    },
    /// The value is empty or too long.
    #[error(
        "the input's field {field} is {len} bytes; a key must be 1 to {MAX_KEY_LEN} bytes (pass a short id, not a document)"
    )]
    BadLength {
        /// The field.
        field: String,
        /// Its length.
        len: usize,
    },
}

impl KeyField {
    /// Parses a dotted path; refused when a segment is empty or holds other characters.
    pub fn parse(path: &str) -> Result<Self, KeyError> {
        let segments: Vec<String> = path.split('.').map(str::to_owned).collect();
        let fine = |s: &String| {
            !s.is_empty()
                && s.len() <= 64
                && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        };
        if path.len() > 256 || !segments.iter().all(fine) {
            return Err(KeyError::BadPath(path.to_owned()));
        }
        Ok(Self { path: segments })
    }

    /// The path as declared.
    pub fn name(&self) -> String {
        self.path.join(".")
    }

    /// The run's key: the field's value as text (a string as it is, a number or boolean as
    /// JSON writes it).
    pub fn value_in(&self, input: &Value) -> Result<String, KeyError> {
        let field = self.name();
        let mut at = input;
        for segment in &self.path {
            at = match at.get(segment) {
                Some(v) => v,
                None => return Err(KeyError::Missing { field }),
            };
        }
        let text = match at {
            Value::Null => return Err(KeyError::Missing { field }),
            Value::String(s) => s.clone(),
            Value::Number(n) => n.to_string(),
            Value::Bool(b) => b.to_string(),
            Value::Array(_) => return Err(KeyError::NotScalar { field, kind: "an array" }),
            Value::Object(_) => return Err(KeyError::NotScalar { field, kind: "an object" }),
        };
        if text.is_empty() || text.len() > MAX_KEY_LEN {
            return Err(KeyError::BadLength { field, len: text.len() });
        }
        Ok(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_key_is_read_from_a_dotted_path_and_refused_naming_the_field() {
        let k = KeyField::parse("customer.id").unwrap();
        assert_eq!(k.value_in(&json!({"customer": {"id": 7}})).unwrap(), "7");
        assert_eq!(
            k.value_in(&json!({"customer": {}})),
            Err(KeyError::Missing { field: "customer.id".into() })
        );
        let long = "x".repeat(MAX_KEY_LEN + 1);
        let err = k.value_in(&json!({"customer": {"id": long}})).unwrap_err();
        assert!(err.to_string().contains("customer.id"), "{err}");
        assert!(KeyField::parse("a..b").is_err());
        assert!(KeyField::parse("tenant name").is_err());
        assert!(matches!(
            KeyField::parse("t").unwrap().value_in(&json!({"t": [1]})),
            Err(KeyError::NotScalar { .. })
        ));
    }
}
