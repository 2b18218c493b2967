//! The API's extractors: axum's `Path`, `Query` and `Json`, whose refusals (a query value that
//! does not parse, broken JSON, a missing field, a body that is not JSON) become the documented
//! JSON error naming the field, here and nowhere else. A JSON body's strings are checked with
//! [`super::input::check_json`] before a handler sees them.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use serde::de::DeserializeOwned;

use super::error::ApiError;
use super::input;

/// The first name in backticks in one of serde's messages (``missing field `reason` ``).
fn backticked(text: &str) -> Option<&str> {
    let start = text.find('`')? + 1;
    let len = text[start..].find('`')?;
    Some(&text[start..start + len])
}

/// The path's parameters (already checked as text by [`super::edge::guard`]).
pub struct Path<T>(pub T);

impl<T, S> FromRequestParts<S> for Path<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|p| Self(p.0))
            .map_err(|r| {
                let text = r.body_text();
                let e = ApiError::bad_request(format!("the path does not fit: {text}"));
                match backticked(&text) {
                    Some(field) => e.with_field(field),
                    None => e,
                }
            })
    }
}

/// The query's parameters.
pub struct Query<T>(pub T);

impl<T, S> FromRequestParts<S> for Query<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        let query = parts.uri.query().unwrap_or_default();
        let deserializer =
            serde_urlencoded::Deserializer::new(url::form_urlencoded::parse(query.as_bytes()));
        serde_path_to_error::deserialize(deserializer)
            .map(Self)
            .map_err(|e| {
                let field = e.path().to_string();
                let inner = e.into_inner().to_string();
                let field = match backticked(&inner) {
                    Some(f) if field == "." => f.to_owned(),
                    _ => field,
                };
                ApiError::bad_request(format!(
                    "query parameter {field} does not fit: {inner}; /api/v1/openapi.json says what each takes"
                ))
                .with_field(field)
            })
    }
}

/// A JSON body.
pub struct Body<T>(pub T);

impl<T, S> FromRequest<S> for Body<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        let json = request
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .map(|v| v.trim().to_ascii_lowercase())
            .is_some_and(|v| v == "application/json" || v.ends_with("+json"));
        if !json {
            return Err(ApiError::unsupported_media_type());
        }
        let bytes = Bytes::from_request(request, state).await.map_err(|r| {
            if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::too_large()
            } else {
                ApiError::bad_request(format!("the body could not be read: {}", r.body_text()))
            }
        })?;
        let value: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| {
            ApiError::bad_request(format!(
                "the body is not JSON ({e}); send one JSON object, e.g. {{\"reason\": \"...\"}}"
            ))
        })?;
        input::check_json(&value)?;
        serde_path_to_error::deserialize(value)
            .map(Self)
            .map_err(|e| {
                let path = e.path().to_string();
                let inner = e.into_inner().to_string();
                let field = match backticked(&inner) {
                    Some(f) if path == "." || inner.starts_with("missing field") => {
                        if path == "." { f.to_owned() } else { format!("{path}.{f}") }
                    }
                    _ => path,
                };
                ApiError::bad_request(format!(
                    "the body's {field} does not fit: {inner}; /api/v1/openapi.json describes the body"
                ))
                .with_field(field)
            })
    }
}

/// `{}`: the default of a body's optional JSON object (a run's input, an event's payload).
pub(super) fn empty_object() -> serde_json::Value {
    serde_json::json!({})
}
