//! OpenAI's `max_tokens` defaults, and request ids: echoed, naming the completion, tagging the log.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_default_to_16_tokens_and_chat_to_the_end_of_the_context() {
    let server = Server::start(&[]);
    let client = reqwest::Client::new();
    let post = |path: &str, body: Value| client.post(server.url(path)).json(&body).send();
    let completion: Value = post(
        "/v1/completions",
        json!({"prompt": "Hello, the", "ignore_eos": true, "temperature": 0}),
    )
    .await
    .expect("send")
    .json()
    .await
    .expect("json");
    assert_eq!(completion["usage"]["completion_tokens"], 16, "{completion}");
    assert_eq!(completion["choices"][0]["finish_reason"], "length");
    let asked: Value = post("/v1/completions", completion_body(20))
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    assert_eq!(asked["usage"]["completion_tokens"], 20, "{asked}");

    let models: Value = client
        .get(server.url("/v1/models"))
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    let context = models["data"][0]["max_model_len"]
        .as_u64()
        .expect("max_model_len");
    let chat: Value = post(
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": true, "temperature": 0}),
    )
    .await
    .expect("send")
    .json()
    .await
    .expect("json");
    let usage = &chat["usage"];
    assert_eq!(
        usage["prompt_tokens"]
            .as_u64()
            .zip(usage["completion_tokens"].as_u64())
            .map(|(p, c)| p + c),
        Some(context),
        "{chat}"
    );
    assert_eq!(chat["choices"][0]["finish_reason"], "length");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_ids_are_echoed_name_the_completion_and_tag_the_log() {
    let server = Server::start(&[]);
    let client = reqwest::Client::new();

    let response = client
        .post(server.url("/v1/completions"))
        .header("x-request-id", "trace-42.a")
        .json(&completion_body(2))
        .send()
        .await
        .expect("send");
    assert_eq!(header(&response, "x-request-id"), Some("trace-42.a"));
    let body: Value = response.json().await.expect("json");
    assert_eq!(body["id"], "cmpl-trace-42.a");

    let mut streamed = chat_body();
    streamed["stream"] = json!(true);
    let response = client
        .post(server.url("/v1/chat/completions"))
        .header("x-request-id", "chat-7")
        .json(&streamed)
        .send()
        .await
        .expect("send");
    assert_eq!(header(&response, "x-request-id"), Some("chat-7"));
    let text = response.text().await.expect("stream");
    let chunks: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("a JSON chunk"))
        .collect();
    assert!(!chunks.is_empty(), "{text}");
    assert!(
        chunks.iter().all(|c| c["id"] == "chatcmpl-chat-7"),
        "{text}"
    );

    let too_long = "x".repeat(129);
    for given in [None, Some("has space"), Some(too_long.as_str())] {
        let mut request = client
            .post(server.url("/v1/completions"))
            .json(&completion_body(1));
        if let Some(id) = given {
            request = request.header("x-request-id", id);
        }
        let response = request.send().await.expect("send");
        let echoed = header(&response, "x-request-id").unwrap_or("").to_string();
        assert!(
            echoed.len() == 32 && echoed.bytes().all(|b| b.is_ascii_hexdigit()),
            "{given:?} -> {echoed:?}"
        );
        let body: Value = response.json().await.expect("json");
        assert_eq!(body["id"], format!("cmpl-{echoed}"), "{given:?}");
    }

    let missing = client
        .get(server.url("/v1/engines"))
        .header("x-request-id", "err-1")
        .send()
        .await
        .expect("send");
    assert_eq!(header(&missing, "x-request-id"), Some("err-1"));

    let log = server.log();
    let tagged: Vec<&str> = log.lines().filter(|l| l.contains("trace-42.a")).collect();
    for needle in ["submitted", "POST /v1/completions"] {
        assert!(
            tagged.iter().any(|l| l.contains(needle)),
            "no line with {needle:?} in the request's span:\n{log}"
        );
    }
    assert!(
        log.lines()
            .filter(|l| l.contains("submitted"))
            .all(|l| l.contains("request{id=")),
        "{log}"
    );
}
