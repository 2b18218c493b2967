//! How the API says no: a status code and a JSON body `{"error": code, "message": ...}` with
//! what to do. Failures of trailmark itself are opaque to the client (the request id leads to the
//! log line that says what happened).

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use crate::error::Report;
use crate::{dlq, operator, store};

/// An API error response.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    body: Map<String, Value>,
}

impl ApiError {
    /// An error with `status`, a machine-readable `code` and a message for a person.
    pub fn new(status: StatusCode, code: &str, message: impl Into<String>) -> Self {
        let mut body = Map::new();
        body.insert("error".into(), json!(code));
        body.insert("message".into(), json!(message.into()));
        Self { status, body }
    }

    /// Adds a field to the body.
    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.body.insert(key.into(), value.into());
        self
    }

    /// 400: the request is malformed.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }

    /// 413: the body is over `api.body_limit_bytes`.
    pub fn too_large() -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            "the body is over api.body_limit_bytes; send less (a page of ids at a time), or raise the setting",
        )
    }

    /// 415: the body is not declared JSON.
    pub fn unsupported_media_type() -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "send the body as JSON with the header content-type: application/json",
        )
    }

    /// 401: no valid token.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }

    /// 403: the token's role is too low.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "forbidden", message)
    }

    /// 404: no such thing.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    /// 409: the request does not fit the current state.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "conflict", message)
    }

    /// 500: trailmark failed; the details are in its log under the request id.
    pub fn internal(error: &(dyn std::error::Error + 'static)) -> Self {
        tracing::error!(error = %Report(error), "API request failed");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "trailmark failed to answer; its log has the details under this request's id",
        )
    }

    /// 503: a server trailmark needs is unreachable; try again.
    pub fn unavailable(error: &(dyn std::error::Error + 'static)) -> Self {
        tracing::warn!(error = %Report(error), "API request met an unavailable server");
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "a server trailmark needs is unreachable; try again shortly",
        )
    }

    /// The response's status.
    pub fn status(&self) -> StatusCode {
        self.status
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let unauthorized = self.status == StatusCode::UNAUTHORIZED;
        let mut response = (self.status, Json(Value::Object(self.body))).into_response();
        if unauthorized {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"trailmark\""),
            );
        }
        response
    }
}

impl From<super::input::BadText> for ApiError {
    fn from(bad: super::input::BadText) -> Self {
        Self::bad_request(bad.message).with("field", bad.field)
    }
}

impl From<store::Error> for ApiError {
    fn from(e: store::Error) -> Self {
        match &e {
            store::Error::Unavailable { .. } => Self::unavailable(&e),
            store::Error::FencedOut { .. } | store::Error::Conflict { .. } => {
                Self::conflict(e.to_string())
            }
            _ => Self::internal(&e),
        }
    }
}

impl From<operator::Error> for ApiError {
    fn from(e: operator::Error) -> Self {
        match e {
            operator::Error::NotFound(run) => Self::not_found(format!("run {run} not found")),
            operator::Error::Refused { status, .. } => {
                Self::conflict(e.to_string()).with("status", status.as_str())
            }
            operator::Error::Store(s) => s.into(),
            other => Self::internal(&other),
        }
    }
}

impl From<crate::diff::Error> for ApiError {
    fn from(e: crate::diff::Error) -> Self {
        match e {
            crate::diff::Error::NotFound(run) => Self::not_found(format!("run {run} not found")),
            crate::diff::Error::Store(s) => s.into(),
        }
    }
}

impl From<dlq::Error> for ApiError {
    fn from(e: dlq::Error) -> Self {
        match &e {
            dlq::Error::NotFound { .. } => Self::not_found(e.to_string()),
            dlq::Error::Broker(b) if b.reaction() == crate::error::Reaction::Retry => {
                Self::unavailable(&e)
            }
            _ => Self::internal(&e),
        }
    }
}
