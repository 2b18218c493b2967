//! Who may call the API: bearer tokens, stored in the configuration as SHA-256 hashes with a
//! name and a role. A missing or unknown token is 401 (with `WWW-Authenticate`), a role too low
//! for the request 403. Tokens are compared in constant time.


use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;

use super::AppState;
use super::error::ApiError;

pub use crate::config::tokens::{Role, Token, hash_token, identify, new_token, parse_tokens};

/// Who made a request.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The token's name.
    pub name: String,
    /// Its role.
    pub role: Role,
    /// The request's id (`x-request-id`).
    pub request_id: Option<String>,
}

impl Caller {
    /// The caller as the decider of an action, with their reason: how the decision and the
    /// audit trail record them.
    pub fn decider(&self, reason: &str) -> crate::operator::Decider {
        crate::operator::Decider {
            actor: self.name.clone(),
            reason: reason.to_owned(),
            role: self.role.as_str().into(),
            via: "api",
            request_id: self.request_id.clone(),
        }
    }

    /// Refuses (403) a caller whose role is below `role`.
    pub fn require(&self, role: Role) -> Result<(), ApiError> {
        if self.role >= role {
            Ok(())
        } else {
            Err(ApiError::forbidden(format!(
                "this needs the {} role; {} has {}",
                role.as_str(),
                self.name,
                self.role.as_str()
            )))
        }
    }
}

/// Middleware: a request to the API needs a valid bearer token; the caller is put in the
/// request's extensions.
pub async fn authenticate(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let Some(token) = presented.and_then(|p| identify(&state.tokens, p)) else {
        return Err(ApiError::unauthorized(match presented {
            None => "send a token: Authorization: Bearer <token>",
            Some(_) => "this token is not known; ask an admin for one (`trailmark token new`)",
        }));
    };
    // The role an endpoint needs is checked before its body is read, so a caller whose role
    // is too low learns that, not what is wrong with the body.
    let path = request
        .extensions()
        .get::<axum::extract::OriginalUri>()
        .map_or_else(|| request.uri().path().to_owned(), |u| u.path().to_owned());
    if let Some(endpoint) = super::openapi::endpoint_for(request.method().as_str(), &path)
        && token.role < endpoint.role
    {
        return Err(ApiError::forbidden(format!(
            "{} {} needs the {} role; {} has {}",
            endpoint.method,
            endpoint.path,
            endpoint.role.as_str(),
            token.name,
            token.role.as_str()
        )));
    }
    let request_id = request
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    request.extensions_mut().insert(Caller {
        name: token.name.clone(),
        role: token.role,
        request_id,
    });
    Ok(next.run(request).await)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_token_is_recognised_by_its_entry_and_nothing_else_is() {
        let (secret, entry) = new_token("maria", Role::Operator);
        let tokens = parse_tokens(&[entry]).unwrap();
        let found = identify(&tokens, &secret).expect("recognised");
        assert_eq!((found.name.as_str(), found.role), ("maria", Role::Operator));
        assert!(identify(&tokens, "tm_other").is_none());
        assert!(!hash_token(&secret).contains(&secret));
    }
}
