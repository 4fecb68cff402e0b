//! `/v1/embeddings`: vectors pooled from the real model's token states,
//! through the same door (rate limits, admission) as a completion.

use crate::harness::*;
use serde_json::{json, Value};

fn vectors(v: &Value) -> Vec<Vec<f64>> {
    v["data"]
        .as_array()
        .expect("data")
        .iter()
        .enumerate()
        .map(|(i, d)| {
            assert_eq!(d["index"], i, "entries in input order: {d}");
            assert_eq!(d["object"], "embedding");
            d["embedding"]
                .as_array()
                .expect("a float array")
                .iter()
                .map(|x| x.as_f64().expect("a float"))
                .collect()
        })
        .collect()
}

fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na: f64 = a.iter().map(|x| x * x).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| x * x).sum::<f64>().sqrt();
    dot / (na * nb)
}

fn tokens(srv: &Server, text: &str) -> u64 {
    let r = srv.post("/tokenize", &json!({ "prompt": text }));
    assert_eq!(r.status, 200);
    r.body_json()["count"].as_u64().expect("count")
}

#[test]
fn embeddings_are_normalized_in_order_and_the_same_however_they_are_batched() {
    let srv = Server::start(&["--pooling", "mean"]);
    let short = "The cat sat on the mat.";
    let other = "Stock markets fell sharply today.";
    // Over one pass's worth of embedding tokens: prefilled in chunks.
    let long = long_prompt(12);
    assert!(tokens(&srv, &long) > 130, "the long input spans chunks");
    let inputs = json!([short, long, short, other]);
    let r = srv.post("/v1/embeddings", &json!({ "input": inputs }));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let body = r.body_json();
    assert_eq!(body["object"], "list");
    let v = vectors(&body);
    assert_eq!(v.len(), 4);
    let width = v[0].len();
    assert!(width > 0);
    for (i, e) in v.iter().enumerate() {
        assert_eq!(e.len(), width, "input {i}");
        let norm = e.iter().map(|x| x * x).sum::<f64>().sqrt();
        assert!((norm - 1.0).abs() < 1e-3, "input {i} has norm {norm}");
    }
    // The same text, after another input in the same slot: the same vector.
    assert!(cosine(&v[0], &v[2]) > 0.9999, "{}", cosine(&v[0], &v[2]));
    assert!(cosine(&v[0], &v[3]) < 0.999, "different texts differ");
    let want: u64 = [short, &long, short, other]
        .iter()
        .map(|t| tokens(&srv, t))
        .sum();
    assert_eq!(body["usage"]["prompt_tokens"], want);
    assert_eq!(body["usage"]["total_tokens"], want);

    // Alone, and while a stream decodes beside it (its chunks then share
    // steps with the stream's tokens): the same vectors.
    let alone = vectors(
        &srv.post("/v1/embeddings", &json!({ "input": long }))
            .body_json(),
    );
    let chat = json!({
        "messages": [{"role": "user", "content": "Count from one to fifty in words."}],
        "temperature": 0, "max_tokens": 120, "ignore_eos": true, "stream": true
    });
    let mut sse = Sse::open(srv.addr, "/v1/chat/completions", &chat);
    assert_eq!(sse.status, 200);
    // The stream is decoding once its first token came.
    while let Some(c) = sse.next_json() {
        if !delta_text(&c).is_empty() {
            break;
        }
    }
    let beside = srv.post("/v1/embeddings", &json!({ "input": [long, short] }));
    assert_eq!(beside.status, 200);
    let beside = vectors(&beside.body_json());
    let (text, chunks) = collect_stream(&mut sse);
    assert!(!text.is_empty());
    assert!(chunks
        .iter()
        .any(|c| c["choices"][0]["finish_reason"] == "length"));
    assert!(cosine(&alone[0], &v[1]) > 0.9999);
    assert!(
        cosine(&beside[0], &v[1]) > 0.9999,
        "{}",
        cosine(&beside[0], &v[1])
    );
    assert!(cosine(&beside[1], &v[0]) > 0.9999);

    // base64 (the OpenAI SDKs' default): the same floats, little-endian.
    let b = srv.post(
        "/v1/embeddings",
        &json!({"input": short, "encoding_format": "base64", "model": "any", "user": "u"}),
    );
    assert_eq!(b.status, 200);
    let text = b.body_json()["data"][0]["embedding"]
        .as_str()
        .expect("a base64 string")
        .to_string();
    let floats = decode_f32_base64(&text);
    assert_eq!(floats.len(), width);
    let floats: Vec<f64> = floats.iter().map(|&x| f64::from(x)).collect();
    assert!(cosine(&floats, &v[0]) > 0.9999);

    // Token ids are inputs too; what cannot be served is refused by name.
    let ids = srv.post("/v1/embeddings", &json!({"input": [[1, 2, 3], [4, 5]]}));
    assert_eq!(ids.status, 200);
    assert_eq!(ids.body_json()["usage"]["prompt_tokens"], 5);
    for (body, param) in [
        (json!({"input": "a", "dimensions": 8}), "dimensions"),
        (
            json!({"input": "a", "encoding_format": "int8"}),
            "encoding_format",
        ),
        (json!({"input": []}), "input"),
        (json!({"input": [""]}), "input"),
        (json!({"input": "a", "normalize": false}), "normalize"),
    ] {
        let r = srv.post("/v1/embeddings", &body);
        assert_eq!(r.status, 400, "{body}");
        assert_eq!(r.body_json()["error"]["param"], param, "{body}");
    }
    // The log names the request's inputs and pooling.
    assert!(srv.log().contains("inputs=4 pooling=mean"));
}

/// Standard base64 to little-endian f32s (the test's own decoder).
fn decode_f32_base64(text: &str) -> Vec<f32> {
    let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut bits = 0u32;
    let mut n = 0;
    let mut bytes = Vec::new();
    for c in text.bytes().filter(|&c| c != b'=') {
        let v = alphabet.iter().position(|&a| a == c).expect("base64") as u32;
        bits = (bits << 6) | v;
        n += 6;
        if n >= 8 {
            n -= 8;
            bytes.push((bits >> n) as u8);
            bits &= (1 << n) - 1;
        }
    }
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn a_model_without_pooling_refuses_embeddings_and_runs_nothing() {
    // SmolLM2's GGUF names no pooling type.
    let srv = Server::start(&[]);
    let r = srv.post("/v1/embeddings", &json!({"input": "hello"}));
    assert_eq!(r.status, 400);
    let e = r.body_json();
    assert_eq!(e["error"]["param"], "model");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--pooling"),
        "{e}"
    );
    assert_eq!(srv.metric("sluice_requests_accepted_total"), 0.0);
}

#[test]
fn embeddings_are_charged_in_prompt_tokens_and_admitted_like_completions() {
    // A bucket of 100 tokens that refills at 0.01 token/s: what time adds
    // while the test runs (a token per 100 s) decides nothing below.
    let srv = Server::start(&[
        "--pooling",
        "last",
        "--client-rate",
        "0.01",
        "--client-burst",
        "100",
    ]);
    let text = "One two three four five six seven eight nine ten.";
    let n = tokens(&srv, text) as usize;
    // Each request costs m * n tokens: two fit in the bucket, a third does
    // not (by a margin of at least 10 tokens).
    let m = 40usize.div_ceil(n);
    let cost = m * n;
    assert!((40..=45).contains(&cost), "{m} x {n} tokens");
    let inputs = json!(vec![text; m]);
    for _ in 0..2 {
        let r = srv.post("/v1/embeddings", &json!({ "input": inputs }));
        assert_eq!(r.status, 200);
        assert_eq!(r.body_json()["usage"]["prompt_tokens"], cost);
        assert_eq!(vectors(&r.body_json()).len(), m);
    }
    let r = srv.post("/v1/embeddings", &json!({ "input": inputs }));
    assert_eq!(r.status, 429, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.body_json()["error"]["code"], "rate_limit_exceeded");
    // More than the whole bucket: retrying cannot help.
    let r = srv.post("/v1/embeddings", &json!({"input": vec![text; 3 * m]}));
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-should-retry"), Some("false"));
    // Both ran through admission and the engine's prompt count.
    assert_eq!(srv.metric("sluice_requests_accepted_total"), 2.0);
    assert_eq!(srv.metric("sluice_prompt_tokens_total"), (2 * cost) as f64);
}
