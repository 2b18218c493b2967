//! What every request and response passes on its way in and out, API and console alike:
//! [`guard`] checks the text a request carries in its path, query, the headers trailmark reads
//! and a console form's body (with [`super::input::check`]) before any handler, log line or
//! Postgres sees it; [`documented`] turns whatever answer of the API is not yet the documented
//! JSON (axum's own 404 and 405, the body limit's 413, the timeout's 504, a panic's 500) into
//! it; [`secure`] adds the security headers; [`strip_unreadable_id`] takes an unreadable
//! `x-request-id` off before the id layers and the log see it.

use axum::body::{Body, to_bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::input::{self, BadText};

/// The request id's header (an unreadable one is taken off by [`strip_unreadable_id`]).
const REQUEST_ID: &str = "x-request-id";

fn is_api(path: &str) -> bool {
    path == "/api" || path.starts_with("/api/")
}

fn refuse(api: bool, bad: BadText) -> Response {
    if api {
        ApiError::from(bad).into_response()
    } else {
        crate::console::refused(StatusCode::BAD_REQUEST, "Not understood", &bad.message)
    }
}

/// Marks a request whose `x-request-id` was unreadable and removed, so that [`guard`] still
/// answers 400 naming the header.
#[derive(Debug, Clone)]
struct UnreadableRequestId(BadText);

/// Middleware, outermost: an `x-request-id` that is not a readable id is removed before anything
/// (the span, the id layers, the answer) sees it, so the request gets a fresh id like one that
/// sent none; the mark it leaves makes [`guard`] refuse the request all the same.
pub async fn strip_unreadable_id(mut request: Request, next: Next) -> Response {
    let bad = request
        .headers()
        .get_all(REQUEST_ID)
        .iter()
        .find_map(|v| input::check_header(REQUEST_ID, v).err());
    if let Some(bad) = bad {
        request.headers_mut().remove(REQUEST_ID);
        request.extensions_mut().insert(UnreadableRequestId(bad));
    }
    next.run(request).await
}

/// Middleware: the text of a request, checked where it enters.
pub async fn guard(State(limit): State<usize>, request: Request, next: Next) -> Response {
    let path = request.uri().path().to_owned();
    let api = is_api(&path);
    let method = request.method().clone();
    let template = api
        .then(|| super::openapi::endpoint_for(method.as_str(), &path))
        .flatten();
    let names = |i: usize| {
        let part = template?.path.split('/').nth(i)?;
        Some(part.strip_prefix('{')?.strip_suffix('}')?.to_owned())
    };
    if let Err(bad) = input::check_path(&path, names) {
        return refuse(api, bad);
    }
    if let Some(query) = request.uri().query()
        && let Err(bad) = input::check_form(query.as_bytes())
    {
        return refuse(api, bad);
    }
    if let Some(UnreadableRequestId(bad)) = request.extensions().get() {
        return refuse(api, bad.clone());
    }
    for value in request.headers().get_all("idempotency-key") {
        if let Err(bad) = input::check_header("idempotency-key", value) {
            return refuse(api, bad);
        }
    }
    if request
        .headers()
        .get_all(header::AUTHORIZATION)
        .iter()
        .any(|v| v.to_str().is_err())
    {
        return refuse(
            api,
            BadText {
                field: "Authorization".into(),
                message: "the Authorization header is not readable text; send Authorization: Bearer <token>".into(),
            },
        );
    }
    // A console form is read here whole (the session check reads it again for its CSRF field).
    if !api && method == Method::POST {
        let (parts, body) = request.into_parts();
        let Ok(bytes) = to_bytes(body, limit).await else {
            return crate::console::refused(
                StatusCode::PAYLOAD_TOO_LARGE,
                "Too large",
                "the form is larger than api.body_limit_bytes; send less",
            );
        };
        if let Err(bad) = input::check_form(&bytes) {
            return refuse(false, bad);
        }
        return next.run(Request::from_parts(parts, Body::from(bytes))).await;
    }
    next.run(request).await
}

/// Middleware: every error the API answers is `{"error", "message"}` JSON, whoever made it.
pub async fn documented(request: Request, next: Next) -> Response {
    let path = request.uri().path().to_owned();
    let method = request.method().clone();
    let response = next.run(request).await;
    let status = response.status();
    let json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !is_api(&path) || json || !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let shown: String = path.chars().take(200).collect();
    let error = match status {
        StatusCode::NOT_FOUND => ApiError::not_found(format!(
            "there is no endpoint {method} {shown}; /api/v1/openapi.json lists them"
        )),
        StatusCode::METHOD_NOT_ALLOWED => ApiError::new(
            status,
            "method_not_allowed",
            format!(
                "{shown} does not take {method}; /api/v1/openapi.json lists what each path takes"
            ),
        ),
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::too_large(),
        StatusCode::UNSUPPORTED_MEDIA_TYPE => ApiError::unsupported_media_type(),
        StatusCode::REQUEST_TIMEOUT | StatusCode::GATEWAY_TIMEOUT => ApiError::new(
            status,
            "timeout",
            "the request took longer than api.request_timeout_secs and was stopped; try again, or narrow it (a smaller limit)",
        ),
        s if s.is_server_error() => ApiError::new(
            s,
            "internal",
            "trailmark failed to answer; its log has the details under this request's id",
        ),
        s => ApiError::new(
            s,
            "bad_request",
            format!(
                "the request was refused ({}); see /api/v1/openapi.json",
                s.canonical_reason().unwrap_or("client error")
            ),
        ),
    };
    let (parts, _) = response.into_parts();
    let mut fresh = error.into_response();
    for (name, value) in &parts.headers {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            fresh.headers_mut().insert(name, value.clone());
        }
    }
    fresh
}

/// Middleware: the security headers. Nothing is framed, sniffed or cached (pages and answers
/// can show dead letters' bodies, handover notes and errors); the console's static assets keep
/// the cache header they set.
pub async fn secure(request: Request, next: Next) -> Response {
    let api = is_api(request.uri().path());
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    let csp = if api {
        "default-src 'none'; frame-ancestors 'none'"
    } else {
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    };
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(csp),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    if !headers.contains_key(header::CACHE_CONTROL) {
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    response
}
