//! The ops console: server-rendered pages at `/` of the API's address, for on-call people who
//! would rather look than read JSON. It is a face over the same functions as the API and the
//! CLI (the store's listings, the run overview, operator decisions, the dead-letter passes), with
//! the API's tokens and roles. Pages are HTML built in Rust ([maud]); htmx (vendored, version
//! 2.0.11, Zero-Clause BSD) only refreshes a running run's live part. Everything works without
//! JavaScript: forms post and redirect.
//!
//! | file | part |
//! |---|---|
//! | `session.rs` | login with a token, the session cookie, CSRF, who is asking |
//! | `layout.rs` | the page frame and small pieces |
//! | `home.rs` | what needs a person: review, retrying and stuck runs, counts, dead letters; the runs list |
//! | `run.rs` | one run: handover note, timeline, decisions, undo preview |
//! | `letters.rs` | dead letters: by reason, one letter, reveal, requeue, purge |
//! | `admin.rs` | workflow contracts, the audit trail |

mod admin;
mod home;
mod layout;
mod letters;
mod limits;
mod once;
mod run;
mod schedules;
mod session;

use std::sync::Arc;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use maud::html;

use crate::config::tokens::Token;
use crate::engine::Engine;
use crate::error::Report;
use crate::{dlq, operator, store};

/// What every console handler reaches.
#[derive(Clone)]
pub(crate) struct ConsoleState {
    engine: Arc<Engine>,
    tokens: Arc<Vec<Token>>,
}

/// The console's routes, to be merged at the root of the API's router.
pub(crate) fn router(engine: Arc<Engine>, tokens: Arc<Vec<Token>>) -> Router {
    let state = ConsoleState { engine, tokens };
    let pages = Router::new()
        .route("/", get(home::home))
        .route("/runs", get(home::runs))
        .route("/runs/{run_id}", get(run::show))
        .route("/runs/{run_id}/live", get(run::live))
        .route(
            "/runs/{run_id}/undo",
            get(run::undo_preview).post(run::undo),
        )
        .route("/runs/{run_id}/decide", post(run::decide))
        .route("/dead-letters", get(letters::list))
        .route("/dead-letters/{id}", get(letters::show))
        .route("/dead-letters/{id}/reveal", post(letters::reveal))
        .route(
            "/dead-letters/act/{action}",
            get(letters::confirm).post(letters::act),
        )
        .route("/limits", get(limits::list).post(limits::set))
        .route("/schedules", get(schedules::list))
        .route("/schedules/{name}/{action}", post(schedules::act))
        .route("/workflows", get(admin::workflows))
        .route("/audit", get(admin::audit))
        .route("/logout", post(session::logout))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            session::require,
        ));
    Router::new()
        .route("/login", get(session::login_page).post(session::login))
        .route(
            "/assets/htmx.min.js",
            get(|| asset(layout::HTMX, "text/javascript")),
        )
        .route(
            "/assets/console.js",
            get(|| asset(layout::JS, "text/javascript")),
        )
        .route(
            "/assets/console.css",
            get(|| asset(layout::CSS, "text/css")),
        )
        .merge(pages)
        .with_state(state)
}

async fn asset(body: &'static str, kind: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, kind),
            (header::CACHE_CONTROL, "public, max-age=3600"),
        ],
        body,
    )
        .into_response()
}

/// A page that says what went wrong, with the status that fits.
#[derive(Debug)]
pub(crate) struct Shown {
    status: StatusCode,
    title: String,
    message: String,
}

impl Shown {
    fn new(status: StatusCode, title: &str, message: impl Into<String>) -> Self {
        Self {
            status,
            title: title.to_owned(),
            message: message.into(),
        }
    }

    fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "Not found", message)
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "Not understood", message)
    }

    fn store(e: impl Into<store::Error>) -> Self {
        Self::from(e.into())
    }
}

impl IntoResponse for Shown {
    fn into_response(self) -> Response {
        let body = layout::page(
            &self.title,
            None,
            html! {
                (layout::error_box(&self.message))
                p { a href="/" { "Back to the console" } }
            },
        );
        (self.status, body).into_response()
    }
}

impl From<store::Error> for Shown {
    fn from(e: store::Error) -> Self {
        match &e {
            store::Error::Unavailable { .. } => {
                tracing::warn!(error = %Report(&e), "console: a server is unreachable");
                Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "Unavailable",
                    format!("{}; try again shortly", Report(&e)),
                )
            }
            _ => {
                tracing::error!(error = %Report(&e), "console: the page failed");
                Self::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "Failed",
                    "trailmark failed to show this page; its log has the details",
                )
            }
        }
    }
}

/// The console's error page for a request refused before any handler (see `api::edge`).
pub(crate) fn refused(status: StatusCode, title: &str, message: &str) -> Response {
    Shown::new(status, title, message).into_response()
}

impl From<dlq::Error> for Shown {
    fn from(e: dlq::Error) -> Self {
        if let dlq::Error::NotFound { .. } = &e {
            return Self::not_found(format!(
                "{e}; it may have been requeued or purged (the audit trail says), or the id is mistyped: the list of dead letters has the ones there are"
            ));
        }
        tracing::warn!(error = %Report(&e), "console: the dead-letter queue failed");
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "Dead letters unavailable",
            Report(&e).to_string(),
        )
    }
}

impl From<crate::schedule::Error> for Shown {
    fn from(e: crate::schedule::Error) -> Self {
        use crate::schedule::Error as E;
        match e {
            E::NotFound(_) => Self::not_found(e.to_string()),
            E::Invalid { .. } => Self::bad_request(e.to_string()),
            E::Conflict(_) => Self::new(StatusCode::CONFLICT, "Conflict", e.to_string()),
            E::Store(s) => Self::from(s),
        }
    }
}

/// What a refused decision answers: 404 for a missing run, 409 for one it does not fit.
fn refusal(e: &operator::Error) -> StatusCode {
    match e {
        operator::Error::NotFound(_) => StatusCode::NOT_FOUND,
        operator::Error::Refused { .. } => StatusCode::CONFLICT,
        operator::Error::Store(store::Error::Unavailable { .. }) => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}
