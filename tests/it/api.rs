//! The OpenAI-compatible surface: answers, streaming, UTF-8, errors.

use crate::harness::*;
use serde_json::json;
use std::time::Duration;

fn chat(content: &str, extra: serde_json::Value) -> serde_json::Value {
    let mut body = json!({"messages": [{"role": "user", "content": content}], "temperature": 0});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[test]
fn greedy_is_deterministic_and_streaming_matches_the_whole_response() {
    let srv = Server::start(&[]);
    let body = chat(
        "Name three colours of the rainbow.",
        json!({"max_tokens": 40}),
    );
    let a = srv.post("/v1/chat/completions", &body);
    let b = srv.post("/v1/chat/completions", &body);
    assert_eq!(a.status, 200);
    let (a, b) = (a.body_json(), b.body_json());
    let text = a["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(!text.trim().is_empty(), "generated text is empty: {a}");
    assert_eq!(
        text,
        b["choices"][0]["message"]["content"].as_str().unwrap()
    );
    assert_eq!(a["object"], "chat.completion");
    let usage = &a["usage"];
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 5);
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
    );

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let mut sse = Sse::open(srv.addr, "/v1/chat/completions", &streamed);
    assert_eq!(sse.status, 200);
    let (stream_text, chunks) = collect_stream(&mut sse);
    assert_eq!(stream_text, text, "streamed and whole responses differ");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    let finish: Vec<_> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["finish_reason"].as_str())
        .collect();
    assert_eq!(
        finish,
        vec![a["choices"][0]["finish_reason"].as_str().unwrap()]
    );
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(last["usage"][k], usage[k], "{k}");
    }
    // The repeats took the prompt from the prefix cache, all but its last token.
    let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap();
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);
    for u in [&b["usage"], &last["usage"]] {
        assert_eq!(
            u["prompt_tokens_details"]["cached_tokens"],
            prompt_tokens - 1
        );
    }
}

#[test]
fn text_completions_stream_and_stop_strings() {
    let srv = Server::start(&[]);
    let body = json!({"prompt": "1, 2, 3, 4,", "temperature": 0, "max_tokens": 30});
    let whole = srv.post("/v1/completions", &body).body_json();
    let text = whole["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(text.contains(" 5"), "unexpected continuation {text:?}");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let mut sse = Sse::open(srv.addr, "/v1/completions", &streamed);
    assert_eq!(collect_stream(&mut sse).0, text);

    // A stop string ends generation and is not part of the text.
    let mut stopped = body.clone();
    stopped["stop"] = json!([" 7"]);
    let r = srv.post("/v1/completions", &stopped).body_json();
    let t = r["choices"][0]["text"].as_str().unwrap();
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    assert!(
        !t.contains(" 7") && text.starts_with(t),
        "{t:?} vs {text:?}"
    );

    // max_tokens is honoured exactly with ignore_eos.
    let r = srv
        .post(
            "/v1/completions",
            &json!({"prompt": "Hello", "max_tokens": 7, "ignore_eos": true, "temperature": 0}),
        )
        .body_json();
    assert_eq!(r["usage"]["completion_tokens"], 7);
    assert_eq!(r["choices"][0]["finish_reason"], "length");
}

#[test]
fn multibyte_utf8_arrives_intact_and_every_event_is_json() {
    let srv = Server::start(&[]);
    let body = json!({
        "prompt": "Translate to Japanese and Chinese, with emoji: I love coffee ☕ ->",
        "temperature": 0, "max_tokens": 48, "ignore_eos": true, "logprobs": 1,
    });
    let whole = srv.post("/v1/completions", &body).body_json();
    let text = whole["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(
        !text.is_ascii(),
        "the test needs non-ASCII output: {text:?}"
    );
    assert!(
        !text.contains('\u{FFFD}'),
        "a character arrived broken: {text:?}"
    );
    // The test is only meaningful if some character was split across tokens:
    // such tokens render alone as U+FFFD in the per-token logprobs.
    let tokens = whole["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .unwrap();
    assert!(
        tokens
            .iter()
            .any(|t| t.as_str().unwrap().contains('\u{FFFD}')),
        "no character was split across tokens; pick another prompt: {tokens:?}"
    );

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let mut sse = Sse::open(srv.addr, "/v1/completions", &streamed);
    let mut joined = String::new();
    let mut saw_done = false;
    while let Some(data) = sse.next_data() {
        if data == "[DONE]" {
            saw_done = true;
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(&data).expect("every SSE event is JSON");
        let piece = delta_text(&v);
        assert!(
            !piece.contains('\u{FFFD}'),
            "a streamed piece is broken: {piece:?}"
        );
        joined.push_str(&piece);
    }
    assert!(saw_done);
    assert_eq!(joined, text);
}

#[test]
fn bad_requests_get_a_json_4xx_and_the_server_keeps_serving() {
    let srv = Server::start(&["--max-body-bytes", "4096"]);
    let json_ct = [("Content-Type", "application/json")];
    type Case<'a> = (
        &'a str,
        &'a str,
        Vec<u8>,
        Vec<(&'a str, &'a str)>,
        u16,
        &'a str,
    );
    let cases: Vec<Case> = vec![
        (
            "POST",
            "/v1/chat/completions",
            b"{not json".to_vec(),
            json_ct.to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/v1/chat/completions",
            b"[1,2]".to_vec(),
            json_ct.to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/v1/chat/completions",
            br#"{"messages":[]}"#.to_vec(),
            json_ct.to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/v1/chat/completions",
            br#"{"messages":[{"role":"wizard","content":"x"}]}"#.to_vec(),
            json_ct.to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/v1/chat/completions",
            br#"{"messages":[{"role":"user","content":"x"}],"temperature":"warm"}"#.to_vec(),
            json_ct.to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/v1/chat/completions",
            br#"{"messages":[{"role":"user","content":"x"}],"max_tokens":-5}"#.to_vec(),
            json_ct.to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/v1/chat/completions",
            b"{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}".to_vec(),
            json_ct.to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/v1/chat/completions",
            "[".repeat(3000).into_bytes(),
            json_ct.to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/v1/completions",
            br#"{"prompt":[1, 99999999]}"#.to_vec(),
            json_ct.to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/v1/completions",
            br#"{"prompt":""}"#.to_vec(),
            json_ct.to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/v1/chat/completions",
            br#"{"messages":[{"role":"user","content":"x"}]}"#.to_vec(),
            vec![("Content-Type", "text/plain")],
            415,
            "unsupported_media_type",
        ),
        (
            "POST",
            "/v1/chat/completions",
            vec![b' '; 8192],
            json_ct.to_vec(),
            413,
            "body_too_large",
        ),
        (
            "GET",
            "/v1/chat/completions",
            Vec::new(),
            vec![],
            405,
            "method_not_allowed",
        ),
        ("GET", "/v2/anything", Vec::new(), vec![], 404, "not_found"),
    ];
    for (method, path, body, headers, status, code) in cases {
        let body_opt = (!body.is_empty()).then_some(body.as_slice());
        let r = request(srv.addr, method, path, body_opt, &headers);
        assert_eq!(
            r.status,
            status,
            "{method} {path} {:?}",
            String::from_utf8_lossy(&body)
        );
        let v = r.body_json();
        assert_eq!(v["error"]["code"], code, "{v}");
        assert!(v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    }

    // Prompt longer than the context: 400 naming both numbers.
    let long = json!({"prompt": long_prompt(500), "max_tokens": 1});
    let r = srv.post("/v1/completions", &long);
    // The body is over 4096 bytes here; use a server with the default body cap.
    assert_eq!(r.status, 413);
    let srv2 = Server::start(&["--ctx", "2048"]);
    let r = srv2.post(
        "/v1/completions",
        &json!({"prompt": long_prompt(200), "max_tokens": 1}),
    );
    assert_eq!(r.status, 400);
    let msg = r.body_json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(msg.contains("2048") && msg.contains("tokens"), "{msg}");
    let prompt_tokens: String = msg
        .chars()
        .skip_while(|c| !c.is_ascii_digit())
        .take_while(char::is_ascii_digit)
        .collect();
    assert!(prompt_tokens.parse::<usize>().unwrap() > 2048, "{msg}");
    // max_tokens that would overflow the context is refused too.
    let r = srv2.post(
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 5000}),
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.body_json()["error"]["code"], "context_length_exceeded");

    // A huge declared body is refused from Content-Length alone. (tiny_http used
    // to allocate the declared size to drain it: 100 GB here, which aborts.)
    {
        use std::io::Write;
        let mut s = connect(srv.addr);
        s.write_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
              Content-Length: 100000000000\r\n\r\n{\"messages\":",
        )
        .unwrap();
        let mut r = std::io::BufReader::new(s);
        let (status, _) = sluice_bench::http::read_head(&mut r).unwrap();
        assert_eq!(status, 413);
    }

    // Still serving.
    assert_eq!(request(srv.addr, "GET", "/health", None, &[]).status, 200);
    let ok = srv.post(
        "/v1/chat/completions",
        &chat("Hi", json!({"max_tokens": 4})),
    );
    assert_eq!(ok.status, 200);
    assert!(srv.metric("sluice_requests_rejected_total{reason=\"invalid\"}") >= 11.0);
}

#[test]
fn models_health_and_metrics_endpoints() {
    let srv = Server::start(&[]);
    let models = request(srv.addr, "GET", "/v1/models", None, &[]).body_json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "SmolLM2-135M-Instruct.Q4_1");
    let health = request(srv.addr, "GET", "/health", None, &[]);
    assert_eq!(health.status, 200);
    assert_eq!(health.body_json()["status"], "ok");
    srv.post(
        "/v1/chat/completions",
        &chat("Hi", json!({"max_tokens": 3})),
    );
    assert_eq!(srv.metric("sluice_requests_completed_total"), 1.0);
    assert_eq!(srv.metric("sluice_requests_accepted_total"), 1.0);
    assert_eq!(srv.metric("sluice_kv_cells_reserved"), 0.0);
    assert_eq!(srv.metric("sluice_kv_cells_used"), 0.0);
    // One request: one first token, two gaps between its three tokens, one end.
    let i = "{class=\"interactive\"}";
    assert_eq!(
        srv.metric(&format!("sluice_time_to_first_token_seconds_count{i}")),
        1.0
    );
    assert_eq!(
        srv.metric(&format!("sluice_inter_token_seconds_count{i}")),
        2.0
    );
    assert_eq!(srv.metric(&format!("sluice_request_seconds_count{i}")), 1.0);
    assert_eq!(
        srv.metric(&format!("sluice_queue_wait_seconds_count{i}")),
        1.0
    );
    assert!(srv.metric(&format!("sluice_time_to_first_token_seconds_sum{i}")) > 0.0);
    assert_eq!(
        srv.metric("sluice_time_to_first_token_seconds_bucket{class=\"interactive\",le=\"+Inf\"}"),
        1.0
    );
    assert_eq!(
        srv.metric("sluice_time_to_first_token_seconds_count{class=\"batch\"}"),
        0.0
    );
    // One log line per request, with its outcome and token counts.
    let log = srv.log();
    let line = log
        .lines()
        .find(|l| l.contains("POST /v1/chat/completions 200"))
        .unwrap_or_else(|| panic!("no request line in the log:\n{log}"));
    assert!(line.contains("completion=3"), "{line}");
}

#[test]
fn tokenize_counts_what_a_request_is_charged_and_detokenize_inverts_it() {
    let srv = Server::start(&[]);
    let messages = json!([{"role": "user", "content": "Say hi."}]);
    let t = srv.post("/tokenize", &json!({"messages": messages}));
    assert_eq!(t.status, 200, "{}", String::from_utf8_lossy(&t.body));
    let t = t.body_json();
    let count = t["count"].as_u64().expect("count");
    assert_eq!(t["tokens"].as_array().expect("tokens").len() as u64, count);
    // The same count the chat request is charged for.
    let r = srv.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 2, "temperature": 0}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        r.body_json()["usage"]["prompt_tokens"].as_u64(),
        Some(count)
    );
    // Text: tokens and back (and the /v1/ aliases).
    let t = srv.post("/v1/tokenize", &json!({"prompt": "Hello there, world."}));
    let ids = t.body_json()["tokens"].clone();
    let d = srv.post("/v1/detokenize", &json!({"tokens": ids}));
    assert_eq!(d.status, 200);
    assert_eq!(d.body_json()["prompt"], "Hello there, world.");
    // Ids outside the vocabulary, and unknown fields, are 400s naming them.
    let d = srv.post("/detokenize", &json!({"tokens": [1_000_000_000]}));
    assert_eq!(d.status, 400);
    assert_eq!(d.body_json()["error"]["param"], "tokens");
    let t = srv.post("/tokenize", &json!({"prompt": "x", "frobnicate": 1}));
    assert_eq!(t.status, 400);
    assert_eq!(t.body_json()["error"]["param"], "frobnicate");
    // The model by its id; another id is 404.
    let list = request(srv.addr, "GET", "/v1/models", None, &[]).body_json();
    let id = list["data"][0]["id"].as_str().expect("id").to_string();
    let one = request(srv.addr, "GET", &format!("/v1/models/{id}"), None, &[]);
    assert_eq!(one.status, 200);
    assert_eq!(one.body_json(), list["data"][0]);
    assert_eq!(
        request(srv.addr, "GET", "/v1/models/gpt-4o", None, &[]).status,
        404
    );
}

#[test]
fn a_chat_template_file_replaces_the_models_and_its_refusals_are_400s() {
    let dir = std::env::temp_dir().join(format!("sluice-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("plain.jinja");
    // A template of its own: "ROLE: content" lines, and a refusal of chats
    // that do not end with the user.
    std::fs::write(
        &path,
        "{% if messages[-1]['role'] != 'user' %}{{ raise_exception('the last message must be the user\\'s') }}{% endif %}\
{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}ASSISTANT:",
    )
    .unwrap();
    let srv = Server::start(&["--chat-template-file", path.to_str().unwrap()]);
    assert!(
        srv.log().contains("chat: the Jinja template in"),
        "{}",
        srv.log()
    );
    let messages = json!([{"role": "user", "content": "Say hi."}]);
    let r = srv.post("/tokenize", &json!({"messages": messages}));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let chat_tokens = r.body_json()["count"].as_u64().unwrap();
    let r = srv.post("/tokenize", &json!({"prompt": "USER: Say hi.\nASSISTANT:"}));
    assert_eq!(
        r.body_json()["count"].as_u64().unwrap(),
        chat_tokens,
        "the file's template rendered"
    );
    let r = srv.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(
        r.body_json()["usage"]["prompt_tokens"].as_u64().unwrap(),
        chat_tokens
    );
    let r = srv.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "max_tokens": 2}),
    );
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    let e = &r.body_json()["error"];
    assert_eq!(e["param"], "messages", "{e}");
    assert_eq!(e["message"], "the last message must be the user's", "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_chat_template_file_that_does_not_compile_stops_start_up_with_its_line() {
    let dir = std::env::temp_dir().join(format!("sluice-badtemplate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.jinja");
    std::fs::write(&path, "ok\n{% for %}").unwrap();
    let out = std::process::Command::new(binary())
        .args(["serve", "--port", "0", "--chat-template-file"])
        .arg(&path)
        .arg("--model")
        .arg(model_path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("chat template does not compile") && err.contains("line 2"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn n_choices_are_n_sequences_counted_in_admission_and_streamed_by_index() {
    let srv = Server::start(&[]);
    let body = json!({"messages": [{"role": "user", "content": "Name a colour."}],
                      "n": 3, "max_tokens": 6, "temperature": 1, "seed": 7, "ignore_eos": true});
    let r = srv.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let v = r.body_json();
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 3, "{v}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "{v}");
        assert_eq!(c["finish_reason"], "length", "{v}");
    }
    // The prompt is counted once, the completions summed.
    assert_eq!(v["usage"]["completion_tokens"], 18, "{v}");
    // Three sequences: three admitted, three completed.
    assert_eq!(srv.metric("sluice_requests_accepted_total"), 3.0);
    assert_eq!(srv.metric("sluice_tokens_generated_total"), 18.0);

    // Streamed: each chunk names its choice, each choice ends once.
    let mut stream = body.clone();
    stream["stream"] = json!(true);
    stream["n"] = json!(2);
    let mut sse = Sse::open(srv.addr, "/v1/chat/completions", &stream);
    assert_eq!(sse.status, 200);
    let mut text = [String::new(), String::new()];
    let mut finished = [0, 0];
    while let Some(c) = sse.next_json() {
        let i = c["choices"][0]["index"].as_u64().expect("index") as usize;
        text[i].push_str(&delta_text(&c));
        if c["choices"][0]["finish_reason"].is_string() {
            finished[i] += 1;
        }
    }
    assert_eq!(finished, [1, 1]);
    assert!(text.iter().all(|t| !t.is_empty()), "{text:?}");
    assert_eq!(srv.metric("sluice_requests_accepted_total"), 5.0);
    // A client that leaves stops every choice.
    let generated = srv.metric("sluice_tokens_generated_total");
    let mut long = body.clone();
    long["max_tokens"] = json!(2000);
    let s = send_json(srv.addr, "/v1/chat/completions", &long);
    wait_until(Duration::from_secs(120), "the choices to generate", || {
        srv.metric("sluice_tokens_generated_total") > generated
    });
    drop(s);
    wait_until(Duration::from_secs(120), "every choice cancelled", || {
        srv.metric("sluice_requests_cancelled_total{reason=\"disconnect\"}") == 3.0
    });
    // More than 8 is a 400 naming n.
    let mut many = body.clone();
    many["n"] = json!(9);
    let r = srv.post("/v1/chat/completions", &many);
    assert_eq!(r.status, 400);
    assert_eq!(r.body_json()["error"]["param"], "n");
}

#[test]
fn a_template_that_renders_tools_gets_them_and_the_format_the_answer_is_held_to() {
    let dir = std::env::temp_dir().join(format!("sluice-tools-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tools.jinja");
    // A template with a call syntax of its own, as Hermes-style ones have.
    std::fs::write(
        &path,
        "{% if tools %}TOOLS:{% for t in tools %} {{ t['function']['name'] }}{% endfor %} (call with <tool_call>)\n{% endif %}\
{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}ASSISTANT:",
    )
    .unwrap();
    let srv = Server::start(&["--chat-template-file", path.to_str().unwrap()]);
    let weather = json!({"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}});
    let messages = json!([{"role": "user", "content": "Weather in Paris?"}]);
    let prompt = |choice: &str| -> String {
        let r = srv.post(
            "/tokenize",
            &json!({"messages": messages, "tools": [weather], "tool_choice": choice}),
        );
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let tokens = r.body_json()["tokens"].clone();
        let r = srv.post("/detokenize", &json!({ "tokens": tokens }));
        r.body_json()["prompt"].as_str().unwrap().to_string()
    };
    let auto = prompt("auto");
    assert!(
        auto.contains("TOOLS: get_weather (call with <tool_call>)"),
        "{auto}"
    );
    assert!(
        auto.contains("Whatever call syntax is described above"),
        "{auto}"
    );
    assert!(auto.contains("{\"response\": \"<your answer>\"}"), "{auto}");
    let required = prompt("required");
    assert!(required.contains("Whatever call syntax"), "{required}");
    assert!(!required.contains("\"response\""), "{required}");
    let none = prompt("none");
    assert!(none.contains("TOOLS: get_weather"), "{none}");
    assert!(!none.contains("Whatever call syntax"), "{none}");
    // The answer is one of the two forms.
    let r = srv.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "tools": [weather], "max_tokens": 40, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let v = r.body_json();
    let m = &v["choices"][0]["message"];
    assert!(
        m["tool_calls"].is_array() != m["content"].is_string(),
        "a call or text: {v}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn ignore_eos_runs_to_max_tokens_without_ending_the_text() {
    // No prefix cache: every request below prefills its prompt afresh, so
    // that greedy answers to the same prompt compute the same logits.
    let srv = Server::start(&["--prefix-cache-mb", "0"]);
    let ask = chat(
        "Answer with one word: is the sky blue?",
        json!({"max_tokens": 40}),
    );
    let answer = |body: &serde_json::Value| {
        let r = srv.post("/v1/chat/completions", body);
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let v = r.body_json();
        let text = v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        let finish = v["choices"][0]["finish_reason"]
            .as_str()
            .unwrap()
            .to_string();
        (
            text,
            finish,
            v["usage"]["completion_tokens"].as_u64().unwrap(),
        )
    };
    // The test needs an answer that ends before max_tokens.
    let (plain, finish, n) = answer(&ask);
    assert_eq!(finish, "stop", "{plain:?}");
    assert!(n < 40, "{n}");

    // ignore_eos: 40 tokens, and none ends the text.
    let mut ignoring = ask.clone();
    ignoring["ignore_eos"] = json!(true);
    let (text, finish, n) = answer(&ignoring);
    assert_eq!((finish.as_str(), n), ("length", 40), "{text:?}");
    assert!(text.starts_with(&plain), "{text:?} after {plain:?}");
    // The same text as when the end-of-turn and end-of-text tokens are
    // biased away: never sampled, not sampled and then skipped in the text.
    let id = |special: &str| {
        let t = srv
            .post("/tokenize", &json!({"prompt": special}))
            .body_json();
        let ids = t["tokens"].as_array().expect("tokens").clone();
        assert_eq!(ids.len(), 1, "{special} is one special token: {t}");
        ids[0].as_u64().expect("id").to_string()
    };
    let mut biased = ask.clone();
    biased["logit_bias"] = json!({id("<|im_end|>"): -100, id("<|endoftext|>"): -100});
    let (expected, finish, n) = answer(&biased);
    assert_eq!((finish.as_str(), n), ("length", 40), "{expected:?}");
    assert_eq!(text, expected);
}
