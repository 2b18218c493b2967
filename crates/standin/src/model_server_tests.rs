//! The stand-in model server's promises: deterministic answers, scripted failures, honest counts.

use super::*;
use sha2::{Digest, Sha256};

fn hello() -> ChatRequest {
    ChatRequest::new(vec![
        ChatMessage::system("be brief"),
        ChatMessage::user("hello"),
    ])
}

async fn post_json(server: &ModelServer, body: &str) -> (u16, Value) {
    let resp = reqwest::Client::new()
        .post(format!("{}/chat/completions", server.base_url()))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("stand-in reachable");
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

async fn stats_of(server: &ModelServer) -> Value {
    let url = format!("{}/stats", server.base_url());
    reqwest::get(url).await.unwrap().json().await.unwrap()
}

#[test]
fn answer_is_deterministic_prefixed_and_padded() {
    let a = standin_answer(&hello(), 200);
    assert_eq!(a, standin_answer(&hello(), 200));
    assert_eq!(a.len(), 200);
    let json = serde_json::to_vec(&hello().messages).unwrap();
    let prefix = format!(
        "stand-in answer {}",
        &hex::encode(Sha256::digest(&json))[..16]
    );
    assert!(a.starts_with(&prefix), "{a}");
    let other = ChatRequest::new(vec![ChatMessage::user("goodbye")]);
    assert_ne!(standin_answer(&other, 200), a);
}

#[test]
fn answer_smaller_than_its_prefix_keeps_the_prefix() {
    assert_eq!(
        standin_answer(&hello(), 0).len(),
        "stand-in answer ".len() + 16
    );
}

#[tokio::test]
async fn response_has_the_openai_completion_shape() {
    let server = ModelServer::start(ModelServerOptions::default())
        .await
        .unwrap();
    let body = json!({"model": "m1", "messages": hello().messages}).to_string();
    let (status, json) = post_json(&server, &body).await;
    assert_eq!(status, 200);
    assert_eq!(json["object"], "chat.completion");
    assert_eq!(json["model"], "m1");
    assert_eq!(json["choices"][0]["index"], 0);
    assert_eq!(json["choices"][0]["finish_reason"], "stop");
    assert_eq!(json["choices"][0]["message"]["role"], "assistant");
    assert_eq!(
        json["choices"][0]["message"]["content"],
        standin_answer(&hello(), 64)
    );
    // "be brief" + "hello" = 13 chars -> 4 tokens; 64 chars -> 16 tokens.
    assert_eq!(
        json["usage"],
        json!({"prompt_tokens": 4, "completion_tokens": 16, "total_tokens": 20})
    );
    server.shutdown().await;
}

#[tokio::test]
async fn script_is_consumed_in_order_and_counted_in_stats() {
    let script = vec![
        Scripted::Status(503),
        Scripted::RateLimited {
            retry_after_secs: 3,
        },
        Scripted::Malformed,
    ];
    let server = ModelServer::start(ModelServerOptions {
        script,
        ..Default::default()
    })
    .await
    .unwrap();
    let body = json!({"model": "m", "messages": hello().messages}).to_string();
    assert_eq!(post_json(&server, &body).await.0, 503);
    assert_eq!(post_json(&server, &body).await.0, 429);
    let (status, json) = post_json(&server, &body).await;
    assert_eq!(status, 200);
    assert!(json.get("choices").is_none(), "{json}");
    assert_eq!(post_json(&server, &body).await.0, 200);
    let stats = stats_of(&server).await;
    assert_eq!(
        (stats["calls"].clone(), stats["answered"].clone()),
        (json!(4), json!(1))
    );
    assert_eq!(
        stats["rate_limited"], 0,
        "scripted 429s are not the limits'"
    );
    assert_eq!((server.calls(), server.answered()), (4, 1));
    server.shutdown().await;
}

#[tokio::test]
async fn undecodable_request_is_counted_and_refused() {
    let server = ModelServer::start(ModelServerOptions::default())
        .await
        .unwrap();
    assert_eq!(post_json(&server, "not json").await.0, 400);
    assert_eq!((server.calls(), server.answered()), (1, 0));
    server.shutdown().await;
}

#[tokio::test]
async fn responder_text_replaces_the_deterministic_answer() {
    let responder: Responder = Arc::new(|req: &ChatRequest| {
        let last = req.messages.last()?;
        (last.content == "hello").then(|| "custom reply".to_string())
    });
    let opts = ModelServerOptions {
        responder: Some(responder),
        ..Default::default()
    };
    let server = ModelServer::start(opts).await.unwrap();
    let body = json!({"messages": hello().messages}).to_string();
    let (_, json) = post_json(&server, &body).await;
    assert_eq!(json["choices"][0]["message"]["content"], "custom reply");
    assert_eq!(json["model"], "stand-in");
    let other = json!({"messages": [{"role": "user", "content": "other"}]}).to_string();
    let (_, json) = post_json(&server, &other).await;
    assert!(
        json["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .starts_with("stand-in answer ")
    );
    server.shutdown().await;
}

#[tokio::test]
async fn shutdown_does_not_wait_out_a_long_scripted_delay() {
    let script = vec![Scripted::Delay(Duration::from_secs(60))];
    let server = ModelServer::start(ModelServerOptions {
        script,
        ..Default::default()
    })
    .await
    .unwrap();
    let url = format!("{}/chat/completions", server.base_url());
    let body = json!({"messages": hello().messages});
    let pending =
        tokio::spawn(async move { reqwest::Client::new().post(url).json(&body).send().await });
    while server.calls() == 0 {
        tokio::task::yield_now().await;
    }
    let started = std::time::Instant::now();
    server.shutdown().await;
    assert!(started.elapsed() < Duration::from_secs(10));
    pending.abort();
}

#[tokio::test]
async fn limits_per_minute_answer_429_with_retry_after_and_count_what_they_refused() {
    // Each `hello` answer is 4 prompt and 16 answer tokens: two fit in 50, a third does not.
    let server = ModelServer::start(ModelServerOptions {
        tokens_per_minute: 50,
        ..Default::default()
    })
    .await
    .unwrap();
    let body = json!({"messages": hello().messages}).to_string();
    assert_eq!(post_json(&server, &body).await.0, 200);
    assert_eq!(post_json(&server, &body).await.0, 200);
    let refused = reqwest::Client::new()
        .post(format!("{}/chat/completions", server.base_url()))
        .header("content-type", "application/json")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status().as_u16(), 429);
    let retry_after: u64 = refused.headers()[header::RETRY_AFTER]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (59..=60).contains(&retry_after),
        "room once the first answer is a minute old: {retry_after}"
    );
    assert_eq!(
        (server.calls(), server.answered(), server.rate_limited()),
        (3, 2, 1)
    );
    assert_eq!(
        server.busiest_minute(),
        Usage {
            requests: 2,
            tokens: 40
        }
    );
    let stats = stats_of(&server).await;
    assert_eq!(stats["rate_limited"], 1);
    assert_eq!(
        stats["busiest_minute"],
        json!({"requests": 2, "tokens": 40})
    );
    server.shutdown().await;

    let server = ModelServer::start(ModelServerOptions {
        requests_per_minute: 1,
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(post_json(&server, &body).await.0, 200);
    assert_eq!(post_json(&server, &body).await.0, 429);
    assert_eq!(server.rate_limited(), 1);
    assert_eq!(
        server.busiest_minute(),
        Usage {
            requests: 1,
            tokens: 20
        }
    );
    server.shutdown().await;
}
