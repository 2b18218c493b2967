//! How the API says no: a status code and a JSON body [`ErrorBody`] (`{"error": code,
//! "message": ...}`) with what to do. Failures of trailmark itself are opaque to the client (the
//! request id leads to the log line that says what happened).

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use crate::error::Report;
use crate::{dlq, operator, store};

/// The one shape of every error the API answers, whoever refuses (a handler, the text check at
/// the door, the body limit, axum's own 404 and 405).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// A machine-readable code (`bad_request`, `not_found`, `conflict`, `unknown_workflow`, ...).
    pub error: String,
    /// What happened and what to do, for a person.
    pub message: String,
    /// The field, parameter or header at fault, where there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// The run's status, when a decision does not fit it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
}

/// An API error response.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    body: ErrorBody,
}

impl ApiError {
    /// An error with `status`, a machine-readable `code` and a message for a person.
    pub fn new(status: StatusCode, code: &str, message: impl Into<String>) -> Self {
        let body = ErrorBody {
            error: code.to_owned(),
            message: message.into(),
            field: None,
            status: None,
        };
        Self { status, body }
    }

    /// Names the field, parameter or header at fault.
    pub fn with_field(mut self, field: impl Into<String>) -> Self {
        self.body.field = Some(field.into());
        self
    }

    /// Names the run's status a decision did not fit.
    pub fn with_run_status(mut self, status: &str) -> Self {
        self.body.status = Some(status.to_owned());
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
        let mut response = (self.status, Json(self.body)).into_response();
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
        Self::bad_request(bad.message).with_field(bad.field)
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
                Self::conflict(e.to_string()).with_run_status(status.as_str())
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
