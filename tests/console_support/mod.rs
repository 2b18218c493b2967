//! Driving the console in headless Chromium through WebDriver (Debian's `chromium` and
//! `chromium-driver`), against an in-process trailmark that serves the console on a port of its
//! own, with one token per role. A failing test leaves a screenshot of the page it was on in
//! `target/console-screenshots/`; with `TRAILMARK_CONSOLE_SHOTS=DIR` the flows also save the
//! pages the README shows.

#![allow(dead_code)]

use std::panic::AssertUnwindSafe;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use fantoccini::elements::Element;
use fantoccini::{Client, ClientBuilder, Locator};
use futures_util::FutureExt;
use serde_json::json;
use trailmark::api::{Role, new_token};
use trailmark::config::Settings;
use trailmark::engine::Engine;
use trailmark::failpoint::Failpoints;
use trailmark::workflow::Registry;

use crate::common::{self, ChildGuard, Running, TestEnv};

/// Bound on every wait.
pub const WAIT: Duration = Duration::from_secs(60);

/// The tokens of one test: a viewer, an operator and an admin.
#[derive(Clone)]
pub struct Tokens {
    pub viewer: String,
    pub operator: String,
    pub admin: String,
    entries: Vec<String>,
}

impl Tokens {
    pub fn new() -> Self {
        let (viewer, v) = new_token("vera", Role::Viewer);
        let (operator, o) = new_token("otto", Role::Operator);
        let (admin, a) = new_token("ada", Role::Admin);
        Self {
            viewer,
            operator,
            admin,
            entries: vec![v, o, a],
        }
    }

    /// `settings` with these tokens and the API on a free port; returns the console's address.
    pub fn serve_on(&self, settings: &mut Settings) -> String {
        let port = common::closed_port();
        settings.api.listen = format!("127.0.0.1:{port}");
        settings.api.tokens = self.entries.clone();
        format!("http://127.0.0.1:{port}")
    }
}

/// Runs `registry` in this process with the console served for `tokens` (at `base` when given,
/// e.g. the address a stopped process served, else on a free port); returns the console's address
/// and the running components.
pub async fn serve_at(
    env: &TestEnv,
    tokens: &Tokens,
    registry: Registry,
    base: Option<&str>,
) -> (String, Running) {
    let mut settings = env.settings.clone();
    let base = match base {
        Some(b) => {
            settings.api.listen = b.trim_start_matches("http://").to_owned();
            settings.api.tokens = tokens.entries.clone();
            b.to_owned()
        }
        None => tokens.serve_on(&mut settings),
    };
    let engine = Engine::with_pool(settings, registry, Failpoints::default(), env.pool.clone())
        .expect("engine");
    let running = env.spawn_all(engine);
    let http = reqwest::Client::new();
    let live = format!("{base}/livez");
    common::eventually("the console to answer", WAIT, || async {
        http.get(&live).send().await.ok().map(|_| ())
    })
    .await
    .expect("the console never answered");
    (base, running)
}

/// [`serve_at`] on a free port.
pub async fn serve(env: &TestEnv, tokens: &Tokens, registry: Registry) -> (String, Running) {
    serve_at(env, tokens, registry, None).await
}

/// A headless Chromium, its chromedriver, and the console's address.
pub struct Browser {
    pub client: Client,
    pub base: String,
    _driver: ChildGuard,
    test: String,
}

impl Browser {
    /// Starts chromedriver on a free port and a headless Chromium session.
    pub async fn open(base: &str, test: &str) -> Self {
        let port = common::closed_port();
        // A workspace build (scripts/test) also links the DBOS peer, whose sqlx turns on rustls'
        // ring beside aws-lc-rs; with both, fantoccini's rustls cannot pick a provider by itself.
        let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
        let driver = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("chromedriver: {e}; install Debian's chromium and chromium-driver (.ci/run does)")
            });
        let driver = ChildGuard(Some(driver));
        let caps = json!({
            "goog:chromeOptions": {
                "binary": "/usr/bin/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--window-size=1280,1000", "--lang=en-GB"],
            }
        });
        let caps: serde_json::Map<String, serde_json::Value> =
            caps.as_object().unwrap().clone().into_iter().collect();
        let url = format!("http://127.0.0.1:{port}");
        let client = common::eventually("chromedriver to start a session", WAIT, || {
            let (url, caps) = (url.clone(), caps.clone());
            async move {
                ClientBuilder::rustls()
                    .ok()?
                    .capabilities(caps)
                    .connect(&url)
                    .await
                    .ok()
            }
        })
        .await
        .expect("no WebDriver session");
        Self {
            client,
            base: base.to_owned(),
            _driver: driver,
            test: test.to_owned(),
        }
    }

    /// `<style>` elements and `style` attributes on the page now: the console's content security
    /// policy refuses inline styles, so any would be a page that renders wrong.
    pub async fn inline_styles(&self) -> u64 {
        let js = "return document.querySelectorAll('style, [style]').length";
        let n = self
            .client
            .execute(js, vec![])
            .await
            .expect("run the count");
        n.as_u64().expect("a count")
    }

    /// Runs `flow`; if it panics, saves a screenshot of the page first.
    pub async fn run<F, Fut>(self, flow: F)
    where
        F: FnOnce(Arc<Browser>) -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        let me = Arc::new(self);
        let outcome = AssertUnwindSafe(flow(me.clone())).catch_unwind().await;
        if let Err(panic) = outcome {
            me.save("failure", "target/console-screenshots").await;
            let _ = me.client.clone().close().await;
            std::panic::resume_unwind(panic);
        }
        let _ = me.client.clone().close().await;
    }

    async fn save(&self, name: &str, dir: &str) {
        if let Ok(png) = self.client.screenshot().await {
            let _ = std::fs::create_dir_all(dir);
            let path = format!("{dir}/{}-{name}.png", self.test);
            let _ = std::fs::write(&path, png);
            eprintln!("screenshot saved: {path}");
        }
    }

    /// Saves the page for the README when `TRAILMARK_CONSOLE_SHOTS` names a folder.
    pub async fn shot_for_docs(&self, name: &str) {
        if let Ok(dir) = std::env::var("TRAILMARK_CONSOLE_SHOTS")
            && let Ok(png) = self.client.screenshot().await
        {
            let _ = std::fs::create_dir_all(&dir);
            let _ = std::fs::write(format!("{dir}/console-{name}.png"), png);
        }
    }

    /// Opens `path` of the console.
    pub async fn goto(&self, path: &str) {
        self.client
            .goto(&format!("{}{path}", self.base))
            .await
            .unwrap_or_else(|e| panic!("open {path}: {e}"));
    }

    /// Logs in with `token` through the login form.
    pub async fn login(&self, token: &str) {
        self.goto("/login").await;
        self.fill("input[name=token]", token).await;
        self.click("form button[type=submit]").await;
        self.find("header nav").await;
    }

    /// The element `css`, waiting for it to appear.
    pub async fn find(&self, css: &str) -> Element {
        self.client
            .wait()
            .at_most(WAIT)
            .for_element(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("no element {css}: {e}"))
    }

    /// Every element `css` now.
    pub async fn all(&self, css: &str) -> Vec<Element> {
        self.client
            .find_all(Locator::Css(css))
            .await
            .unwrap_or_default()
    }

    /// The text of `css`.
    pub async fn text(&self, css: &str) -> String {
        self.find(css).await.text().await.unwrap_or_default()
    }

    /// Types `value` into `css`.
    pub async fn fill(&self, css: &str, value: &str) {
        let e = self.find(css).await;
        e.clear().await.ok();
        e.send_keys(value)
            .await
            .unwrap_or_else(|err| panic!("type into {css}: {err}"));
    }

    /// Clicks `css`.
    pub async fn click(&self, css: &str) {
        self.find(css)
            .await
            .click()
            .await
            .unwrap_or_else(|e| panic!("click {css}: {e}"));
    }

    /// Waits until the text of `css` contains `wanted` (the page may reload meanwhile).
    pub async fn wait_text(&self, css: &str, wanted: &str) -> String {
        let found = common::eventually(&format!("{css} to say {wanted:?}"), WAIT, || async {
            let e = self.client.find(Locator::Css(css)).await.ok()?;
            let t = e.text().await.ok()?;
            t.contains(wanted).then_some(t)
        })
        .await;
        found.unwrap_or_else(|| panic!("{css} never said {wanted:?}"))
    }

    /// The path (and query) of the page now shown.
    pub async fn path(&self) -> String {
        let url = self.client.current_url().await.expect("current url");
        let path = url.path().to_owned();
        match url.query() {
            Some(q) => format!("{path}?{q}"),
            None => path,
        }
    }
}
