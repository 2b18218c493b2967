//! The frame every page shares (navigation, who is logged in, the logout form) and the small
//! pieces pages are built from: times the browser shows in its own zone, status badges, boxes
//! for what went wrong and what was done.

use chrono::{DateTime, Utc};
use maud::{DOCTYPE, Markup, html};

use super::session::Person;
use crate::config::tokens::Role;
use crate::domain::RunStatus;

/// A whole page: the frame around `body`. `person` is `None` on the login page.
pub fn page(title: &str, person: Option<&Person>, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · trailmark" }
                // htmx would add a <style> of its own, which the policy (no inline styles) refuses.
                meta name="htmx-config" content=r#"{"includeIndicatorStyles":false}"#;
                link rel="stylesheet" href="/assets/console.css";
                script src="/assets/htmx.min.js" defer {}
                script src="/assets/console.js" defer {}
            }
            body {
                header {
                    a.brand href="/" { "trailmark" }
                    @if let Some(p) = person {
                        nav {
                            a href="/" { "Home" }
                            a href="/runs" { "Runs" }
                            a href="/dead-letters" { "Dead letters" }
                            a href="/schedules" { "Schedules" }
                            a href="/limits" { "Limits" }
                            a href="/workflows" { "Workflows" }
                            @if p.role >= Role::Admin { a href="/audit" { "Audit" } }
                        }
                        form.who method="post" action="/logout" {
                            (csrf_field(p))
                            span { (p.name) " (" (p.role.as_str()) ")" }
                            button type="submit" { "Log out" }
                        }
                    }
                }
                main { h1 { (title) } (body) }
            }
        }
    }
}

/// The hidden field every form of a logged-in person carries.
pub fn csrf_field(p: &Person) -> Markup {
    html! { input type="hidden" name="csrf" value=(p.csrf); }
}

/// A time in UTC; `console.js` rewrites it in the browser's own zone.
pub fn time(at: DateTime<Utc>) -> Markup {
    html! {
        time datetime=(at.to_rfc3339()) { (at.format("%Y-%m-%d %H:%M:%S UTC")) }
    }
}

/// An optional time, or a dash.
pub fn maybe_time(at: Option<DateTime<Utc>>) -> Markup {
    match at {
        Some(at) => time(at),
        None => html! { "–" },
    }
}

/// A time carried as text (a dead letter's header): shown in the browser's zone when it parses,
/// as written when it does not, since a header is whatever the sender wrote.
pub fn text_time(at: Option<&str>) -> Markup {
    match at.map(|t| (t, DateTime::parse_from_rfc3339(t))) {
        Some((_, Ok(parsed))) => time(parsed.with_timezone(&Utc)),
        Some((raw, Err(_))) => html! { (raw) },
        None => html! { "–" },
    }
}

/// A run's status as a badge (its class colours it).
pub fn status(s: RunStatus) -> Markup {
    html! { span.status.(s.as_str()) data-status=(s.as_str()) { (s.as_str()) } }
}

/// What went wrong, where the person acted.
pub fn error_box(message: &str) -> Markup {
    html! { p.error role="alert" { (message) } }
}

/// What was done, after a redirect.
pub fn done_box(message: &str) -> Markup {
    html! { p.done role="status" { (message) } }
}

/// The first line of a text, at most `max` characters.
pub fn one_line(text: &str, max: usize) -> String {
    let line = text.lines().next().unwrap_or_default();
    match line.char_indices().nth(max) {
        Some((cut, _)) => format!("{}…", &line[..cut]),
        None => line.to_owned(),
    }
}

/// JSON shown as preformatted text.
pub fn json_block(value: &serde_json::Value) -> Markup {
    let text = serde_json::to_string_pretty(value).unwrap_or_default();
    html! { pre.json { (text) } }
}

/// The vendored htmx, kept as shipped (Zero-Clause BSD).
pub const HTMX: &str = include_str!("assets/htmx.min.js");
/// The console's style sheet.
pub const CSS: &str = include_str!("assets/console.css");
/// The console's own script: local times, nothing else.
pub const JS: &str = include_str!("assets/console.js");
