//! The step protocol's signatures: HMAC-SHA256 with the endpoint's shared secret over the
//! timestamp, the method, the path and the body, so that neither side accepts a forged, altered
//! or re-aimed request (a signed manifest read cannot be replayed as a step call).

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The header with the request's time, in Unix seconds.
pub const TIMESTAMP: &str = "trailmark-timestamp";
/// The header with the signature, `v1=<hex>`.
pub const SIGNATURE: &str = "trailmark-signature";
/// How far a request's time may be from the receiver's clock.
pub const WINDOW_SECS: i64 = 300;
/// The shortest secret accepted: HMAC-SHA256's own key size.
pub const MIN_SECRET_BYTES: usize = 32;

/// Why a request's signature is refused; the text is safe to send back (it names no secret).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// No timestamp or signature header.
    #[error("the request is not signed (headers {TIMESTAMP} and {SIGNATURE})")]
    Unsigned,
    /// The timestamp is not a number or is outside the window.
    #[error("the request's {TIMESTAMP} is not within {WINDOW_SECS} s of the receiver's clock")]
    Stale,
    /// The signature does not match the request.
    #[error("the signature does not match the request (wrong secret, or the body was changed)")]
    Mismatch,
}

fn mac(secret: &[u8], ts: i64, method: &str, path: &str, body: &[u8]) -> Hmac<Sha256> {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes a key of any size");
    mac.update(format!("{ts}\n{method}\n{path}\n").as_bytes());
    mac.update(body);
    mac
}

/// The signature header's value for a request.
pub fn sign(secret: &[u8], ts: i64, method: &str, path: &str, body: &[u8]) -> String {
    let tag = mac(secret, ts, method, path, body).finalize().into_bytes();
    format!("v1={}", hex::encode(tag))
}

/// Checks a request's signature headers against its method, path and body at time `now`; the
/// comparison is constant-time.
pub fn verify(
    secret: &[u8],
    headers: (Option<&str>, Option<&str>),
    method: &str,
    path: &str,
    body: &[u8],
    now: i64,
) -> Result<(), Refused> {
    let (Some(ts), Some(signature)) = headers else {
        return Err(Refused::Unsigned);
    };
    let ts: i64 = ts.trim().parse().map_err(|_| Refused::Stale)?;
    if (now - ts).abs() > WINDOW_SECS {
        return Err(Refused::Stale);
    }
    let tag = signature
        .trim()
        .strip_prefix("v1=")
        .and_then(|h| hex::decode(h).ok())
        .ok_or(Refused::Mismatch)?;
    mac(secret, ts, method, path, body)
        .verify_slice(&tag)
        .map_err(|_| Refused::Mismatch)
}

/// The current Unix time in seconds.
pub fn now() -> i64 {
    chrono::Utc::now().timestamp()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

    #[test]
    fn a_signed_request_passes_and_any_change_is_refused() {
        let sig = sign(SECRET, 1000, "POST", "/cb/model", b"{\"call\":1}");
        let ok = |sig: &str, path: &str, body: &[u8], now| {
            verify(SECRET, (Some("1000"), Some(sig)), "POST", path, body, now)
        };
        assert_eq!(ok(&sig, "/cb/model", b"{\"call\":1}", 1100), Ok(()));
        assert_eq!(
            ok(&sig, "/cb/model", b"{\"call\":2}", 1100),
            Err(Refused::Mismatch)
        );
        assert_eq!(
            ok(&sig, "/cb/park", b"{\"call\":1}", 1100),
            Err(Refused::Mismatch)
        );
        assert_eq!(
            ok(&sig, "/cb/model", b"{\"call\":1}", 1301),
            Err(Refused::Stale)
        );
        assert_eq!(
            verify(SECRET, (None, Some(&sig)), "POST", "/cb/model", b"", 1000),
            Err(Refused::Unsigned)
        );
        let other = sign(
            b"another secret of thirty-two bytes!",
            1000,
            "POST",
            "/cb/model",
            b"{\"call\":1}",
        );
        assert_eq!(
            ok(&other, "/cb/model", b"{\"call\":1}", 1000),
            Err(Refused::Mismatch)
        );
    }

    #[test]
    fn the_signature_matches_a_vector_made_by_another_implementation() {
        // Computed with Python's hmac module; the Python SDK's tests check the same vector.
        assert_eq!(
            sign(SECRET, 1700000000, "GET", "/trailmark/manifest", b""),
            "v1=a5002d7f5d8577b9f3af32b148ff10ed0d3e7d82882b7e84cfce3b0d2c729050"
        );
    }
}
