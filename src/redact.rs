//! The one place that hides secrets in what trailmark prints: every URL shown in a log line, an
//! error or a command's output passes through [`url()`], and text that came from elsewhere (a
//! server's error body) through [`text`] with the secrets the caller knows. Secrets are
//! passwords in a URL's user info, query parameters that carry credentials (`password=`,
//! `sslpassword=`, tokens, keys), the model's API key and HTTP `Authorization` values.

/// What replaces a secret.
pub const MASK: &str = "***";

/// `raw` with its password and every credential-bearing query parameter masked; a URL that does
/// not parse shows only its scheme, since it may still hold a secret.
pub fn url(raw: &str) -> String {
    let Ok(mut parsed) = url::Url::parse(raw) else {
        return match raw.split_once("://") {
            Some((scheme, _)) if scheme.chars().all(|c| c.is_ascii_alphanumeric()) => {
                format!("{scheme}://<unparsable URL>")
            }
            _ => "<unparsable URL>".into(),
        };
    };
    // User info the parser did not recognise as such (no host to attach it to) stays hidden.
    if parsed.host().is_none() && raw.contains('@') {
        return format!("{}:<redacted>", parsed.scheme());
    }
    if parsed.password().is_some() {
        // Fails only for URLs that cannot have user info, which then hold no password.
        let _ = parsed.set_password(Some(MASK));
    }
    let pairs: Vec<(String, String)> = parsed
        .query_pairs()
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    if pairs.iter().any(|(k, _)| secret_parameter(k)) {
        let mut query = url::form_urlencoded::Serializer::new(String::new());
        for (k, v) in &pairs {
            query.append_pair(k, if secret_parameter(k) { MASK } else { v });
        }
        parsed.set_query(Some(&query.finish()));
    }
    parsed.to_string()
}

/// Whether a query parameter of this name may carry a credential.
fn secret_parameter(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    [
        "pass",
        "secret",
        "token",
        "key",
        "sig",
        "auth",
        "credential",
    ]
    .iter()
    .any(|word| name.contains(word))
}

/// `text` with every one of `secrets` masked (empty secrets are ignored).
pub fn text(text: &str, secrets: &[&str]) -> String {
    let mut out = text.to_string();
    for secret in secrets.iter().filter(|s| !s.is_empty()) {
        out = out.replace(secret, MASK);
    }
    out
}

/// An HTTP header value as it may be shown: `Authorization` and other credential headers masked.
pub fn header(name: &str, value: &str) -> String {
    let name = name.to_ascii_lowercase();
    if name == "authorization" || name == "proxy-authorization" || secret_parameter(&name) {
        MASK.into()
    } else {
        value.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_form_of_a_url_credential_is_masked_and_the_rest_kept() {
        let shown = url("amqp://guest:s3cret@10.0.0.1:5672/%2f");
        assert_eq!(shown, "amqp://guest:***@10.0.0.1:5672/%2f");
        let shown =
            url("postgres://127.0.0.1:5432/db?user=postgres&password=S3cret&sslmode=require");
        assert!(
            !shown.contains("S3cret") && shown.contains("user=postgres"),
            "{shown}"
        );
        assert!(shown.contains("sslmode=require"), "{shown}");
        let shown = url("postgres://u@h/db?sslpassword=K3y&application_name=x");
        assert!(
            !shown.contains("K3y") && shown.contains("application_name=x"),
            "{shown}"
        );
        assert!(!url("https://api.example.com/v1?api-key=abc123").contains("abc123"));
        assert_eq!(url("postgres://u:pw@[bad"), "postgres://<unparsable URL>");
        assert_eq!(url("no scheme u:pw@host"), "<unparsable URL>");
    }

    #[test]
    fn known_secrets_and_authorization_headers_are_masked() {
        assert_eq!(
            text("bad key sk-1 for sk-1", &["sk-1", ""]),
            "bad key *** for ***"
        );
        assert_eq!(header("Authorization", "Bearer sk-1"), MASK);
        assert_eq!(
            header("content-type", "application/json"),
            "application/json"
        );
    }
}
