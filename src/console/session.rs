//! Logging in to the console with an API token, and who a request comes from after that.
//!
//! The token is asked once; the browser then holds a random session id in an HttpOnly,
//! SameSite=Strict cookie (Secure when the request came over HTTPS through a proxy). Only the
//! id's hash is stored, with the hash of the token: the role is read from the configuration on
//! every request, so taking a token out of `api.tokens` ends its sessions at once. Every POST of
//! a logged-in person must carry the session's CSRF secret (checked here, before any handler).

use axum::body::{Body, to_bytes};
use axum::extract::{Query, Request, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::{Extension, Form};
use axum_extra::extract::cookie::{Cookie, CookieJar, SameSite};
use maud::{Markup, html};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::layout::{error_box, page};
use super::{ConsoleState, Shown};
use crate::config::tokens::{Role, identify};
use crate::operator::Decider;
use crate::store::console_sessions;

/// The session cookie's name.
pub const COOKIE: &str = "tm_console";

/// Who is logged in, as a request sees them.
#[derive(Debug, Clone)]
pub struct Person {
    /// The token's name: the actor of what they do.
    pub name: String,
    /// Its role, from the configuration now.
    pub role: Role,
    /// The secret this session's forms carry.
    pub csrf: String,
}

impl Person {
    /// Whether the person's role is `role` or above.
    pub fn may(&self, role: Role) -> bool {
        self.role >= role
    }

    /// Refuses (403) a person whose role is below `role`, naming what `what` needs.
    pub fn require(&self, role: Role, what: &str) -> Result<(), Shown> {
        if self.may(role) {
            return Ok(());
        }
        Err(Shown::new(
            StatusCode::FORBIDDEN,
            "Not allowed",
            format!(
                "{what} needs the {} role; {} has {}",
                role.as_str(),
                self.name,
                self.role.as_str()
            ),
        ))
    }

    /// The person as the decider of an action, with their reason.
    pub fn decider(&self, reason: &str) -> Decider {
        Decider {
            actor: self.name.clone(),
            reason: reason.trim().to_owned(),
            role: self.role.as_str().into(),
            via: "console",
            request_id: None,
        }
    }
}

fn sha256_hex(s: &str) -> String {
    hex::encode(Sha256::digest(s.as_bytes()))
}

fn random_secret() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// Where to go after logging in: a path of this console, never another site.
#[derive(Debug, Deserialize)]
pub struct NextQuery {
    next: Option<String>,
}

fn local_path(next: Option<&str>) -> &str {
    match next {
        Some(p) if p.starts_with('/') && !p.starts_with("//") && !p.contains('\\') => p,
        _ => "/",
    }
}

fn login_form(next: &str, problem: Option<&str>) -> Markup {
    page(
        "Log in",
        None,
        html! {
            @if let Some(problem) = problem { (error_box(problem)) }
            form.box method="post" action="/login" {
                input type="hidden" name="next" value=(next);
                label { "API token " input type="password" name="token" autocomplete="current-password" required autofocus; }
                button type="submit" { "Log in" }
            }
            p.muted { "Tokens are made with " code { "trailmark token new" } "; your role decides what you may do here." }
        },
    )
}

/// `GET /login`.
pub async fn login_page(Query(q): Query<NextQuery>) -> Markup {
    login_form(local_path(q.next.as_deref()), None)
}

/// The login form.
#[derive(Debug, Deserialize)]
pub struct LoginForm {
    token: String,
    next: Option<String>,
}

/// `POST /login`: a known token opens a session.
pub async fn login(
    State(state): State<ConsoleState>,
    headers: HeaderMap,
    jar: CookieJar,
    Form(form): Form<LoginForm>,
) -> Result<Response, Shown> {
    let next = local_path(form.next.as_deref()).to_owned();
    let Some(token) = identify(&state.tokens, form.token.trim()) else {
        let page = login_form(
            &next,
            Some("this token is not known; ask an admin for one (`trailmark token new`)"),
        );
        return Ok((StatusCode::UNAUTHORIZED, page).into_response());
    };
    let id = random_secret();
    let mut conn = state.engine.pool.acquire().await.map_err(Shown::store)?;
    console_sessions::open(
        &mut conn,
        &sha256_hex(&id),
        &token.hash_hex(),
        &random_secret(),
        state.engine.settings.api.console_session_secs,
    )
    .await?;
    tracing::info!(actor = %token.name, role = token.role.as_str(), "console login");
    let https = headers
        .get("x-forwarded-proto")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"https"));
    let cookie = Cookie::build((COOKIE, id))
        .http_only(true)
        .same_site(SameSite::Strict)
        .secure(https)
        .path("/");
    Ok((jar.add(cookie), Redirect::to(&next)).into_response())
}

/// `POST /logout`.
pub async fn logout(State(state): State<ConsoleState>, jar: CookieJar) -> Result<Response, Shown> {
    if let Some(c) = jar.get(COOKIE) {
        console_sessions::close(&state.engine.pool, &sha256_hex(c.value())).await?;
    }
    let jar = jar.remove(Cookie::build(COOKIE).path("/"));
    Ok((jar, Redirect::to("/login")).into_response())
}

/// Middleware: a console page needs a live session whose token is still configured; a POST
/// also needs the session's CSRF secret in its form. Without a session, a page redirects to the
/// login form.
pub async fn require(
    State(state): State<ConsoleState>,
    jar: CookieJar,
    request: Request,
    next: Next,
) -> Result<Response, Shown> {
    let session = match jar.get(COOKIE) {
        Some(c) => console_sessions::get(&state.engine.pool, &sha256_hex(c.value())).await?,
        None => None,
    };
    let person = session.and_then(|s| {
        let token = state
            .tokens
            .iter()
            .find(|t| bool::from(t.hash_hex().as_bytes().ct_eq(s.token_hash.as_bytes())))?;
        Some(Person {
            name: token.name.clone(),
            role: token.role,
            csrf: s.csrf,
        })
    });
    let Some(person) = person else {
        let here = request
            .uri()
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned();
        let to = format!("/login?next={}", urlencode(&here));
        return Ok(Redirect::to(&to).into_response());
    };
    let mut request = if request.method() == Method::POST {
        checked_form(request, &person, state.engine.settings.api.body_limit_bytes).await?
    } else {
        request
    };
    request.extensions_mut().insert(person);
    Ok(next.run(request).await)
}

/// The request with its form read once, after its CSRF field was checked.
async fn checked_form(request: Request, person: &Person, limit: usize) -> Result<Request, Shown> {
    let (parts, body) = request.into_parts();
    let bytes = to_bytes(body, limit).await.map_err(|_| {
        Shown::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "Too large",
            "the form is larger than api.body_limit_bytes",
        )
    })?;
    let presented = url::form_urlencoded::parse(&bytes)
        .find(|(k, _)| k == "csrf")
        .map(|(_, v)| v.into_owned())
        .unwrap_or_default();
    if !bool::from(presented.as_bytes().ct_eq(person.csrf.as_bytes())) {
        return Err(Shown::new(
            StatusCode::FORBIDDEN,
            "Form refused",
            "this form did not come from your console session (its CSRF field is missing or wrong); reload the page and send it again",
        ));
    }
    Ok(Request::from_parts(parts, Body::from(bytes)))
}

fn urlencode(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

/// The person a handler serves (put there by [`require`]).
pub type Me = Extension<Person>;
