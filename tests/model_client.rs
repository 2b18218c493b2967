//! The model client driven against the stand-in model server over real HTTP, one promise per
//! test.

use std::time::Duration;

use trailmark::model::{
    ChatAnswer, ChatMessage, ChatRequest, Error, ModelClient, ModelSettings, Result,
};
use trailmark_standin::model_server::{ModelServer, ModelServerOptions, Scripted, standin_answer};

const KEY: &str = "sk-test-SECRET-KEY";

async fn server(script: Vec<Scripted>) -> ModelServer {
    let opts = ModelServerOptions {
        script,
        ..ModelServerOptions::default()
    };
    ModelServer::start(opts)
        .await
        .expect("stand-in model server starts")
}

fn settings(base_url: String) -> ModelSettings {
    ModelSettings {
        base_url,
        model: "test-model".into(),
        api_key: KEY.into(),
        timeout_ms: 5_000,
        cost_per_1k_prompt_tokens: 1.0,
        cost_per_1k_completion_tokens: 2.0,
        ..ModelSettings::default()
    }
}

fn hello() -> ChatRequest {
    ChatRequest::new(vec![ChatMessage::user("hello world")])
}

async fn ask(server: &ModelServer) -> Result<ChatAnswer> {
    ModelClient::new(&settings(server.base_url()))?
        .chat(&hello())
        .await
}

#[tokio::test]
async fn answer_carries_content_tokens_and_cost() {
    let srv = server(vec![]).await;
    let answer = ask(&srv).await.expect("answer");
    assert_eq!(answer.content, standin_answer(&hello(), 64));
    assert_eq!(answer.model, "test-model");
    assert_eq!((answer.prompt_tokens, answer.completion_tokens), (3, 16));
    assert!(
        (answer.cost - (0.003 + 0.032)).abs() < 1e-9,
        "cost {}",
        answer.cost
    );
    assert!(answer.latency_ms < 5_000);
    assert_eq!((srv.calls(), srv.answered()), (1, 1));
    srv.shutdown().await;
}

#[tokio::test]
async fn server_error_is_temporary_and_next_call_succeeds() {
    let srv = server(vec![Scripted::Status(500)]).await;
    let client = ModelClient::new(&settings(srv.base_url())).unwrap();
    let err = client.chat(&hello()).await.unwrap_err();
    assert!(matches!(err, Error::Unavailable { status: 500 }), "{err:?}");
    assert!(err.is_temporary());
    client.chat(&hello()).await.expect("second call answers");
    assert_eq!((srv.calls(), srv.answered()), (2, 1));
    srv.shutdown().await;
}

#[tokio::test]
async fn rate_limit_reports_the_servers_retry_after() {
    let srv = server(vec![Scripted::RateLimited {
        retry_after_secs: 7,
    }])
    .await;
    let err = ask(&srv).await.unwrap_err();
    assert!(
        matches!(err, Error::RateLimited { retry_after: Some(d) } if d == Duration::from_secs(7)),
        "{err:?}"
    );
    assert!(err.is_temporary());
    srv.shutdown().await;
}

#[tokio::test]
async fn answer_slower_than_the_timeout_is_a_timeout() {
    let srv = server(vec![Scripted::Delay(Duration::from_secs(3))]).await;
    let client = ModelClient::new(&ModelSettings {
        timeout_ms: 200,
        ..settings(srv.base_url())
    })
    .unwrap();
    let err = client.chat(&hello()).await.unwrap_err();
    assert!(matches!(err, Error::Timeout), "{err:?}");
    assert!(err.is_temporary());
    srv.shutdown().await;
}

#[tokio::test]
async fn refused_credentials_are_auth_and_never_temporary() {
    for status in [401, 403] {
        let srv = server(vec![Scripted::Status(status)]).await;
        let err = ask(&srv).await.unwrap_err();
        assert!(
            matches!(err, Error::Auth { status: s } if s == status),
            "{err:?}"
        );
        assert!(!err.is_temporary());
        srv.shutdown().await;
    }
}

#[tokio::test]
async fn other_client_errors_are_rejected_with_the_servers_reason() {
    let srv = server(vec![Scripted::Status(404)]).await;
    let err = ask(&srv).await.unwrap_err();
    let Error::Rejected {
        status: 404,
        detail,
    } = &err
    else {
        panic!("{err:?}")
    };
    assert!(detail.contains("scripted"), "{detail}");
    assert!(!err.is_temporary());
    srv.shutdown().await;
}

#[tokio::test]
async fn a_body_that_is_not_a_completion_is_malformed() {
    let srv = server(vec![Scripted::Malformed]).await;
    let err = ask(&srv).await.unwrap_err();
    assert!(matches!(err, Error::Malformed(_)), "{err:?}");
    assert!(err.is_temporary());
    assert_eq!((srv.calls(), srv.answered()), (1, 0));
    srv.shutdown().await;
}

#[tokio::test]
async fn refused_connection_is_connect_naming_the_endpoint() {
    let port = free_port().await;
    let client = ModelClient::new(&settings(format!("http://127.0.0.1:{port}/v1"))).unwrap();
    let err = client.chat(&hello()).await.unwrap_err();
    assert!(matches!(err, Error::Connect(_)), "{err:?}");
    assert!(
        err.to_string()
            .contains(&format!("127.0.0.1:{port}/v1/chat/completions")),
        "{err}"
    );
    assert!(err.is_temporary());
}

#[tokio::test]
async fn errors_never_show_the_api_key_or_url_password() {
    let script = vec![
        Scripted::Status(401),
        Scripted::Status(400),
        Scripted::Status(503),
        Scripted::RateLimited {
            retry_after_secs: 1,
        },
        Scripted::Malformed,
    ];
    let srv = server(script).await;
    let client = ModelClient::new(&settings(srv.base_url())).unwrap();
    let mut shown = vec![format!("{client:?}")];
    for _ in 0..5 {
        let err = client.chat(&hello()).await.unwrap_err();
        shown.push(format!("{err} {err:?}"));
    }
    let url = format!("http://bob:pw-SECRET@127.0.0.1:{}/v1", free_port().await);
    let client = ModelClient::new(&ModelSettings {
        api_key: String::new(),
        ..settings(url)
    })
    .unwrap();
    let err = client.chat(&hello()).await.unwrap_err();
    shown.push(format!("{err} {err:?} {client:?}"));
    for text in shown {
        assert!(!text.contains("SECRET"), "{text}");
    }
    srv.shutdown().await;
}

#[tokio::test]
async fn fallback_client_asks_the_fallback_model() {
    let srv = server(vec![]).await;
    let client = ModelClient::new(&ModelSettings {
        fallback_model: "small".into(),
        ..settings(srv.base_url())
    })
    .unwrap();
    let fallback = client.fallback().expect("fallback configured");
    assert_eq!(fallback.model(), "small");
    assert_eq!(fallback.chat(&hello()).await.unwrap().model, "small");
    assert!(
        ModelClient::new(&settings(srv.base_url()))
            .unwrap()
            .fallback()
            .is_none()
    );
    srv.shutdown().await;
}

#[test]
fn unusable_settings_fail_at_construction() {
    let ok = settings("http://127.0.0.1:1/v1/".into());
    assert!(ModelClient::new(&ok).is_ok());
    let bad = [
        ModelSettings {
            base_url: String::new(),
            ..ok.clone()
        },
        ModelSettings {
            base_url: "ftp://host/v1".into(),
            ..ok.clone()
        },
        ModelSettings {
            base_url: "http://u:p@host/v1".into(),
            ..ok.clone()
        },
        ModelSettings {
            model: " ".into(),
            ..ok.clone()
        },
        ModelSettings {
            timeout_ms: 0,
            ..ok.clone()
        },
        ModelSettings {
            api_key: "bad\nkey".into(),
            ..ok.clone()
        },
    ];
    for s in bad {
        let err = ModelClient::new(&s).unwrap_err();
        assert!(
            matches!(err, Error::Config(_)) && !err.is_temporary(),
            "{err:?}"
        );
        assert!(
            !err.to_string().contains("bad\nkey") && !err.to_string().contains("u:p@"),
            "{err}"
        );
    }
}

/// A port nobody listens on: bound, then released.
async fn free_port() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap().port()
}
