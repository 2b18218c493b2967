//! `api.tokens`: who may use the ops API and console, in which role, known by the SHA-256 of
//! their token. Parsed here, with the settings, so a malformed entry stops a process at start-up
//! (in `config::check`) before any HTTP surface exists, and `trailmark token new` makes entries.

use std::str::FromStr;

use serde::Serialize;
use sha2::{Digest, Sha256};

/// What a token may do; each role includes the ones below it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Read everything except dead letters' bodies and the audit trail.
    Viewer,
    /// Also decide about runs (resume, undo, cancel, approve, reject) and requeue dead letters.
    Operator,
    /// Also purge dead letters, reveal their bodies and read the audit trail.
    Admin,
}

impl Role {
    /// The role's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Viewer => "viewer",
            Self::Operator => "operator",
            Self::Admin => "admin",
        }
    }
}

impl FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "viewer" => Ok(Self::Viewer),
            "operator" => Ok(Self::Operator),
            "admin" => Ok(Self::Admin),
            other => Err(format!(
                "unknown role {other:?}: use viewer, operator or admin"
            )),
        }
    }
}

/// One configured token: who holds it, their role, and the SHA-256 of the token.
#[derive(Debug, Clone)]
pub struct Token {
    /// Who holds it (recorded as the actor of what they do).
    pub name: String,
    /// What it may do.
    pub role: Role,
    pub(crate) hash: [u8; 32],
}

impl Token {
    /// The SHA-256 of the token, hex (what a console session remembers of it).
    pub fn hash_hex(&self) -> String {
        hex::encode(self.hash)
    }
}

/// Parses `api.tokens` entries, `name:role:sha256`.
///
/// The same hash twice is refused: one token would be two people, or two roles, and which one
/// a request got would depend on the order of the list.
pub fn parse_tokens(entries: &[String]) -> Result<Vec<Token>, String> {
    let tokens = entries
        .iter()
        .map(|e| parse_token(e))
        .collect::<Result<Vec<_>, _>>()?;
    for (i, t) in tokens.iter().enumerate() {
        if let Some(first) = tokens[..i].iter().find(|f| f.hash == t.hash) {
            return Err(format!(
                "api.tokens: {:?} ({}) and {:?} ({}) have the same hash, so one token would hold both; give each holder a token of their own (`trailmark token new`) and remove the other entry",
                first.name,
                first.role.as_str(),
                t.name,
                t.role.as_str()
            ));
        }
    }
    Ok(tokens)
}

fn parse_token(entry: &str) -> Result<Token, String> {
    let shown = entry.split(':').take(2).collect::<Vec<_>>().join(":");
    let mut parts = entry.splitn(3, ':');
    let (Some(name), Some(role), Some(hash)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(format!(
            "api.tokens entry {shown:?} is not name:role:sha256; make one with `trailmark token new`"
        ));
    };
    let role: Role = role.parse()?;
    let bytes = hex::decode(hash)
        .ok()
        .and_then(|b| <[u8; 32]>::try_from(b).ok())
        .ok_or_else(|| {
            format!("api.tokens entry for {name:?}: the hash must be 64 hex digits (a SHA-256)")
        })?;
    if name.is_empty() {
        return Err("api.tokens entry with an empty name".into());
    }
    Ok(Token {
        name: name.to_owned(),
        role,
        hash: bytes,
    })
}

/// A new random token and its configuration entry (`name:role:sha256`).
pub fn new_token(name: &str, role: Role) -> (String, String) {
    let secret = format!(
        "tm_{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    );
    let entry = format!("{name}:{}:{}", role.as_str(), hash_token(&secret));
    (secret, entry)
}

/// The SHA-256 of a token, hex: what the configuration stores.
pub fn hash_token(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// The token that `presented` is, compared against every configured one in constant time.
#[cfg(feature = "ops-http")]
pub fn identify<'a>(tokens: &'a [Token], presented: &str) -> Option<&'a Token> {
    let hash: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
    let mut found = None;
    // No early exit: the time taken does not depend on which token matched, or where.
    for token in tokens {
        if bool::from(subtle::ConstantTimeEq::ct_eq(&token.hash[..], &hash[..])) {
            found = Some(token);
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_entries_say_what_is_wrong_without_the_hash() {
        assert!(
            parse_tokens(&["maria:boss:00".into()])
                .unwrap_err()
                .contains("unknown role")
        );
        let e = parse_tokens(&["maria:admin:abc".into()]).unwrap_err();
        assert!(e.contains("64 hex digits"), "{e}");
        assert!(
            parse_tokens(&["maria".into()])
                .unwrap_err()
                .contains("name:role:sha256")
        );
    }

    #[test]
    fn the_same_hash_under_two_entries_is_refused_naming_both() {
        let hash = hash_token("tm_shared");
        let e = parse_tokens(&[format!("vera:viewer:{hash}"), format!("ada:admin:{hash}")])
            .unwrap_err();
        assert!(
            e.contains("\"vera\" (viewer)") && e.contains("\"ada\" (admin)"),
            "{e}"
        );
        assert!(!e.contains(&hash), "the hash is not repeated: {e}");
        let other = hash_token("tm_other");
        assert!(
            parse_tokens(&[format!("vera:viewer:{hash}"), format!("ada:admin:{other}")]).is_ok()
        );
    }
}
