//! The `Idempotency-Key` header on mutating requests (draft-ietf-httpapi-idempotency-key-header):
//! the first request under a key runs and its response is kept; a repeat with the same method,
//! path and body gets that response again (`Idempotent-Replayed: true`) without running; another
//! request under the key is 422; a repeat while the first still runs is 409. A double-click on a
//! bulk action (requeue by reason, undo) therefore runs it once. An answer that decided nothing
//! (403, 428, 5xx) is not kept, so the request may be sent again under the same key.

use axum::body::{Body, to_bytes};
use axum::extract::{OriginalUri, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

use super::AppState;
use super::error::ApiError;
use crate::store::idempotency::{self, Begun};

/// The header's name.
pub const HEADER: &str = "idempotency-key";

/// Longest key accepted.
const MAX_KEY: usize = 255;

/// Refuses (428) a bulk action sent without a key.
pub fn required(headers: &HeaderMap) -> Result<(), ApiError> {
    if headers.contains_key(HEADER) {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::PRECONDITION_REQUIRED,
            "idempotency_key_required",
            "this action touches many things at once: send an Idempotency-Key header (a UUID) so that a repeat cannot run it twice",
        ))
    }
}

/// Middleware for the API's POST requests.
pub async fn keyed(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let key = match request.headers().get(HEADER) {
        Some(k) if request.method() == Method::POST => k
            .to_str()
            .ok()
            .filter(|k| !k.is_empty() && k.len() <= MAX_KEY)
            .map(str::to_owned)
            .ok_or_else(|| {
                ApiError::bad_request("Idempotency-Key must be 1-255 visible characters")
            })?,
        _ => return Ok(next.run(request).await),
    };
    let (parts, body) = request.into_parts();
    let limit = state.engine.settings.api.body_limit_bytes;
    let bytes = to_bytes(body, limit).await.map_err(|_| {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            "the body is over api.body_limit_bytes",
        )
    })?;
    // The path as the client sent it (the nested router sees it without its /api/v1 prefix).
    let path = parts
        .extensions
        .get::<OriginalUri>()
        .map_or_else(|| parts.uri.path().to_owned(), |u| u.path().to_owned());
    let fingerprint = hex::encode(
        Sha256::new()
            .chain_update(parts.method.as_str())
            .chain_update(b" ")
            .chain_update(path.as_bytes())
            .chain_update(b"\n")
            .chain_update(&bytes)
            .finalize(),
    );
    let pool = &state.engine.pool;
    let mut conn = pool.acquire().await.map_err(crate::store::Error::from)?;
    match idempotency::begin(&mut conn, &key, &fingerprint).await? {
        Begun::Run => {}
        Begun::InProgress => {
            return Err(ApiError::conflict(
                "a request with this Idempotency-Key is still running; wait for its answer",
            ));
        }
        Begun::Mismatch => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency_key_reused",
                "this Idempotency-Key was used for another request; use a new key for a new request",
            ));
        }
        Begun::Replay { status, body } => {
            let mut response = (
                StatusCode::from_u16(status).unwrap_or(StatusCode::OK),
                [("content-type", "application/json")],
                body,
            )
                .into_response();
            response
                .headers_mut()
                .insert("idempotent-replayed", HeaderValue::from_static("true"));
            return Ok(response);
        }
    }
    drop(conn);
    let response = next
        .run(Request::from_parts(parts, Body::from(bytes)))
        .await;
    let (parts, body) = response.into_parts();
    let bytes = to_bytes(body, usize::MAX)
        .await
        .map_err(|e| ApiError::internal(&*e.into_inner()))?;
    if parts.status.is_server_error()
        || parts.status == StatusCode::FORBIDDEN
        || parts.status == StatusCode::PRECONDITION_REQUIRED
    {
        // Nothing was decided: the same request may be tried again under the same key (by
        // someone with the role, or once trailmark can answer).
        idempotency::release(pool, &key).await?;
    } else {
        idempotency::finish(pool, &key, parts.status.as_u16(), &bytes).await?;
    }
    Ok(Response::from_parts(parts, Body::from(bytes)))
}
