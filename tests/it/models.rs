//! Any GGUF, tested: a second model family (Gemma 3 270M: another
//! architecture with sliding-window attention, another quantisation, Q4_K_M,
//! a 262,144-token vocabulary, and no chat template in the GGUF, so sluice's
//! built-in Gemma turns) runs the smoke set: chat, streaming, a reused prefix,
//! structured output, `n` > 1.

use crate::harness::*;
use serde_json::{json, Value};

fn gemma() -> Server {
    Server::launch(
        &[std::path::Path::new(binary())],
        &second_model_path(),
        &["--ctx", "4096"],
        &[],
    )
}

fn chat(content: &str, extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": content}],
                          "max_tokens": 16, "temperature": 0});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn ok(srv: &Server, body: &Value) -> Value {
    srv.post_ok("/v1/chat/completions", body)
}

#[test]
fn a_gemma_model_chats_streams_reuses_a_prefix_follows_a_schema_and_gives_n_choices() {
    let srv = gemma();
    assert!(
        srv.log().contains("(gemma3 ") && srv.log().contains("chat: Gemma's turns, built in"),
        "{}",
        srv.log()
    );

    // Chat, then the same request streamed: greedy, so the same text.
    let body = chat("Name three colours.", json!({}));
    let v = ok(&srv, &body);
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let n = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(n >= 1 && !text.is_empty(), "{v}");
    let mut sse = Sse::open(
        srv.addr,
        "/v1/chat/completions",
        &chat("Name three colours.", json!({"stream": true})),
    );
    assert_eq!(sse.status, 200);
    let (streamed, chunks) = collect_stream(&mut sse);
    assert_eq!(streamed, text, "streamed and whole answers differ");
    assert!(
        chunks.len() as u64 > n,
        "{} chunks for {n} tokens",
        chunks.len()
    );
    let last = chunks.last().unwrap();
    assert!(!last["choices"][0]["finish_reason"].is_null(), "{last}");

    // A long shared system prompt: the second request reuses its KV.
    let system = long_prompt(40);
    let ask = |q: &str| {
        json!({"messages": [{"role": "system", "content": system},
                            {"role": "user", "content": q}],
               "max_tokens": 4, "temperature": 0})
    };
    let first = ok(&srv, &ask("Summarise it."));
    let second = ok(&srv, &ask("What is it about?"));
    let prompt = second["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(prompt > 200, "{second}");
    assert!(
        cached * 2 > prompt && cached < prompt,
        "cached {cached} of {prompt} prompt tokens; first: {first}"
    );

    // Structured output: the answer parses and keeps to the schema.
    let schema = json!({"type": "object", "additionalProperties": false,
        "properties": {"name": {"type": "string", "maxLength": 12},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]});
    let v = ok(
        &srv,
        &chat(
            "Describe a person as JSON.",
            json!({"max_tokens": 80, "response_format":
                   {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}}),
        ),
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    let person: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{e}: {content}"));
    let keys: Vec<&String> = person.as_object().unwrap().keys().collect();
    assert_eq!(keys.len(), 2, "{person}");
    assert!(
        person["name"].as_str().unwrap().chars().count() <= 12,
        "{person}"
    );
    let age = person["age"].as_i64().unwrap();
    assert!((0..=120).contains(&age), "{person}");

    // n = 2: two choices, indexed, their tokens summed in usage.
    let v = ok(
        &srv,
        &chat(
            "Say something.",
            json!({"n": 2, "temperature": 0.9, "seed": 7, "max_tokens": 6}),
        ),
    );
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "{v}");
    assert_eq!(choices[0]["index"], 0);
    assert_eq!(choices[1]["index"], 1);
    let total = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((2..=12).contains(&total), "{v}");
}
