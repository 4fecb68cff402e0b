//! Continuous batching and chunked prefill are right, and interleave.
//!
//! llama.cpp's CPU kernels do not give bit-identical logits for a sequence
//! computed alone and inside a batch (different batch shapes take different
//! matmul paths), so comparing generated text is the wrong test. These tests use
//! teacher forcing: record the tokens a sequence produces alone, replay exactly
//! those tokens in batches shared with other sequences, and compare the
//! log-probabilities position by position. A wrong position, sequence id, KV
//! cell or logits index gives garbage (top-1 agreement collapses, differences of
//! several nats); rounding gives small differences.

use crate::harness::*;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Share of positions whose top-1 token must agree.
const TOP1_AGREEMENT_MIN: f64 = 0.95;
/// Largest |Δ log-probability| of the forced token allowed at any position, and
/// the largest mean over all positions. Measured on this machine (SmolLM2 Q4_1,
/// AVX-512): teacher forcing among three others, max 0.0000 (bit-identical: Q4_1
/// matmuls and flash attention compute each row on its own); 64- vs 512-token
/// chunks over 5,935 positions, max 0.29 at a near-tie, mean under 0.01. A
/// misplaced position, sequence id, KV cell or logits row shifts many positions
/// by whole nats, so these bounds separate bugs from rounding with room to spare.
const LOGPROB_DELTA_MAX: f64 = 1.0;
const LOGPROB_DELTA_MEAN_MAX: f64 = 0.05;

pub struct Scored {
    pub token_ids: Vec<i64>,
    texts: Vec<String>,
    logprobs: Vec<Option<f64>>,
    /// Top-1 token text at each position (None for the first prompt token).
    top1: Vec<Option<String>>,
}

impl Scored {
    /// Positions `from..`.
    pub fn tail(&self, from: usize) -> Scored {
        Scored {
            token_ids: self.token_ids[from..].to_vec(),
            texts: self.texts[from..].to_vec(),
            logprobs: self.logprobs[from..].to_vec(),
            top1: self.top1[from..].to_vec(),
        }
    }
}

pub fn scored(v: &Value) -> Scored {
    let lp = &v["choices"][0]["logprobs"];
    let arr = |k: &str| {
        lp[k]
            .as_array()
            .unwrap_or_else(|| panic!("no logprobs.{k} in {v}"))
            .clone()
    };
    Scored {
        token_ids: arr("token_ids")
            .iter()
            .map(|t| t.as_i64().unwrap())
            .collect(),
        texts: arr("tokens")
            .iter()
            .map(|t| t.as_str().unwrap().to_string())
            .collect(),
        logprobs: arr("token_logprobs").iter().map(Value::as_f64).collect(),
        top1: arr("top_logprobs")
            .iter()
            .map(|m| {
                m.as_object().map(|m| {
                    m.iter()
                        .max_by(|a, b| a.1.as_f64().unwrap().total_cmp(&b.1.as_f64().unwrap()))
                        .map(|(k, _)| k.clone())
                        .unwrap()
                })
            })
            .collect(),
    }
}

pub struct Agreement {
    top1: f64,
    delta_max: f64,
    delta_mean: f64,
    positions: usize,
}

impl Agreement {
    pub fn check(&self, what: &str) {
        eprintln!(
            "{what}: top-1 agreement {:.4}, |Δ logprob| max {:.4}, mean {:.5}, over {} positions",
            self.top1, self.delta_max, self.delta_mean, self.positions
        );
        assert!(
            self.top1 >= TOP1_AGREEMENT_MIN,
            "{what}: top-1 agreement {}",
            self.top1
        );
        assert!(
            self.delta_max <= LOGPROB_DELTA_MAX,
            "{what}: max |Δ logprob| {}",
            self.delta_max
        );
        assert!(
            self.delta_mean <= LOGPROB_DELTA_MEAN_MAX,
            "{what}: mean |Δ logprob| {}",
            self.delta_mean
        );
    }
}

/// Compares positions `from..` of two scorings of the same tokens.
pub fn compare(a: &Scored, b: &Scored, from: usize) -> Agreement {
    assert_eq!(
        a.token_ids, b.token_ids,
        "the two runs scored different tokens"
    );
    let mut agree = 0;
    let mut n = 0;
    let mut delta_max: f64 = 0.0;
    let mut delta_sum = 0.0;
    for i in from..a.token_ids.len() {
        let (Some(la), Some(lb)) = (a.logprobs[i], b.logprobs[i]) else {
            continue;
        };
        n += 1;
        if a.top1[i] == b.top1[i] {
            agree += 1;
        }
        delta_max = delta_max.max((la - lb).abs());
        delta_sum += (la - lb).abs();
    }
    assert!(n > 0);
    Agreement {
        top1: agree as f64 / n as f64,
        delta_max,
        delta_mean: delta_sum / n as f64,
        positions: n,
    }
}

/// A stream that is read continuously in its own thread until `stop` is set,
/// so that it keeps decoding (an unread stream would pause).
fn background_stream(
    addr: std::net::SocketAddr,
    prompt: &str,
    stop: Arc<AtomicBool>,
) -> (std::thread::JoinHandle<usize>, Arc<AtomicUsize>) {
    background_stream_of(addr, prompt, 2000, stop)
}

/// `background_stream` of at most `max_tokens` tokens.
fn background_stream_of(
    addr: std::net::SocketAddr,
    prompt: &str,
    max_tokens: usize,
    stop: Arc<AtomicBool>,
) -> (std::thread::JoinHandle<usize>, Arc<AtomicUsize>) {
    let received = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&received);
    let body = json!({
        "prompt": prompt, "stream": true, "max_tokens": max_tokens, "ignore_eos": true,
        "temperature": 0.8, "seed": 7, "logprobs": 0,
    });
    let handle = std::thread::spawn(move || {
        let mut sse = Sse::open(addr, "/v1/completions", &body);
        assert_eq!(sse.status, 200);
        while !stop.load(Ordering::Relaxed) {
            match sse.next_json() {
                Some(v) => {
                    assert!(
                        v["choices"][0]["finish_reason"].is_null(),
                        "background stream ended early: {v}"
                    );
                    count.fetch_add(1, Ordering::Relaxed);
                }
                None => panic!("background stream ended early"),
            }
        }
        count.load(Ordering::Relaxed)
    });
    (handle, received)
}

#[test]
fn teacher_forcing_a_sequence_among_three_others_keeps_its_logits() {
    // A small step budget spreads the replay over many steps, each shared with
    // the three other sequences' decode tokens.
    let step_tokens = 16;
    // Explicit queue depth: the four requests may arrive while a step runs.
    // One context: with two, the request alone runs in the short requests'
    // context (flash attention on, f16 cache) and its replay joins the three
    // streams in the main one (K in q8_0), so the two scorings differ by the
    // pairing, not the batch (top-1 agreement 0.94 on a Xeon with AMX,
    // session 44). The two contexts side by side: the next test.
    let srv = Server::start(&[
        "--parallel",
        "4",
        "--queue-depth",
        "4",
        "--step-tokens",
        &step_tokens.to_string(),
        "--short-cells",
        "0",
    ]);
    let n_gen = 64;

    // Alone: greedy generation (decode steps of batch 1), echoing the prompt so
    // that the response carries every token id.
    let alone = srv
        .post(
            "/v1/completions",
            &json!({"prompt": "The history of the printing press begins", "temperature": 0,
                    "max_tokens": n_gen, "ignore_eos": true, "logprobs": 1, "echo": true}),
        )
        .body_json();
    let alone = scored(&alone);
    let n_prompt = alone.token_ids.len() - n_gen;

    // Three other sequences decoding while the same tokens are replayed.
    let stop = Arc::new(AtomicBool::new(false));
    let others: Vec<_> = [
        "Write a poem about the sea.",
        "List the planets:",
        "def fibonacci(n):",
    ]
    .iter()
    .map(|p| background_stream(srv.addr, p, Arc::clone(&stop)))
    .collect();
    wait_until(
        Duration::from_secs(120),
        "the three streams to decode",
        || others.iter().all(|(_, n)| n.load(Ordering::Relaxed) >= 2),
    );
    let mixed_before = srv.metric("sluice_steps_mixed_total");
    let replay = srv
        .post(
            "/v1/completions",
            &json!({"prompt": alone.token_ids, "temperature": 0, "max_tokens": 0, "logprobs": 1, "echo": true}),
        )
        .body_json();
    let mixed_after = srv.metric("sluice_steps_mixed_total");
    let still_running: Vec<usize> = others
        .iter()
        .map(|(_, n)| n.load(Ordering::Relaxed))
        .collect();
    stop.store(true, Ordering::Relaxed);
    for (h, _) in others {
        h.join().expect("background stream");
    }
    let replay = scored(&replay);
    assert_eq!(replay.texts, alone.texts);

    // The replay really shared its steps with decoding sequences: with 3 decode
    // tokens per step it needs ceil(len / (budget - 3)) prefill steps, all mixed.
    let len = alone.token_ids.len();
    let steps_needed = len.div_ceil(step_tokens - 3);
    assert!(
        mixed_after - mixed_before >= steps_needed as f64,
        "only {} mixed steps for a {len}-token replay (need {steps_needed}); others had {still_running:?} tokens",
        mixed_after - mixed_before
    );

    compare(&alone, &replay, n_prompt).check("teacher forcing");
    // Greedy: every generated token alone was its position's top-1.
    for i in n_prompt..len {
        assert_eq!(alone.top1[i].as_deref(), Some(alone.texts[i].as_str()));
    }
}

#[test]
fn short_and_long_requests_run_in_two_contexts_and_keep_their_logits_beside_each_other() {
    // Requests of at most 256 cells (prompt + max_tokens) run in the second
    // context (flash attention on, f16 cache), longer ones in the main one.
    let short_cells = 256;
    let srv = Server::start(&[
        "--short-cells",
        &short_cells.to_string(),
        "--parallel",
        "4",
        "--queue-depth",
        "4",
        "--step-tokens",
        "16",
    ]);
    assert!(
        srv.log().contains("run in a second context"),
        "no second context:\n{}",
        srv.log()
    );
    let starts = || srv.metric("sluice_short_context_requests_total");
    assert_eq!(starts(), 0.0);
    // Greedy answers with every token's log-probability: a short one (~10 +
    // 32 cells) and one whose prompt alone passes 256 cells.
    let generate = |prompt: Value, max_tokens: usize| {
        let r = srv.post(
            "/v1/completions",
            &json!({"prompt": prompt, "temperature": 0, "max_tokens": max_tokens,
                    "ignore_eos": true, "logprobs": 1, "echo": true}),
        );
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        scored(&r.body_json())
    };
    let short_prompt = json!("The history of the printing press begins");
    let long_prompt = json!(long_prompt(15));
    let short = generate(short_prompt.clone(), 32);
    let long = generate(long_prompt.clone(), 16);
    assert!(
        long.token_ids.len() > short_cells,
        "the long request holds {} cells",
        long.token_ids.len()
    );
    assert_eq!(starts(), 1.0, "the short request only");

    // Each again, decoding beside two streams, one in each context (the
    // short one first: a short request joins the main context when only it
    // runs sequences): every step's decode tokens are in both, in two
    // passes. A token, KV cell or logits row in the wrong context gives
    // garbage; in its own, each row is computed as it was alone.
    let stop = Arc::new(AtomicBool::new(false));
    let mut streams = Vec::new();
    for (prompt, max_tokens) in [
        ("List the planets:", 240),
        ("Write a poem about the sea.", 2000),
    ] {
        let (stream, received) =
            background_stream_of(srv.addr, prompt, max_tokens, Arc::clone(&stop));
        wait_until(Duration::from_secs(120), "the stream to decode", || {
            received.load(Ordering::Relaxed) >= 2
        });
        streams.push((stream, received));
    }
    assert_eq!(starts(), 2.0, "the short stream in the second context");
    for (prompt, max_tokens, alone, what) in [
        (&short_prompt, 32, &short, "a short request beside both"),
        (&long_prompt, 16, &long, "a long request beside both"),
    ] {
        let before: Vec<usize> = streams
            .iter()
            .map(|(_, n)| n.load(Ordering::Relaxed))
            .collect();
        let beside = generate(prompt.clone(), max_tokens);
        assert_eq!(beside.texts, alone.texts, "{what}");
        compare(alone, &beside, 1).check(what);
        for ((_, n), before) in streams.iter().zip(before) {
            assert!(
                n.load(Ordering::Relaxed) > before,
                "{what}: a stream decoded meanwhile"
            );
        }
    }
    stop.store(true, Ordering::Relaxed);
    for (stream, _) in streams {
        stream.join().expect("background stream");
    }
    // Placed by size: the short request twice and the short stream in the
    // second context; the long request twice and the long stream in the main.
    assert_eq!(starts(), 3.0);
}

fn score_long_prompt(step_tokens: &str, prompt: &str) -> Scored {
    let srv = Server::start(&["--step-tokens", step_tokens, "--parallel", "1"]);
    let r = srv.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 0, "logprobs": 1, "echo": true}),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    scored(&r.body_json())
}

#[test]
fn a_long_prompt_scores_the_same_in_64_and_512_token_chunks() {
    // Over 1,000 tokens: 18 chunks of 64 against 3 of 512, each chunk
    // attending to all the KV the ones before it wrote. (Twice as long costs
    // this test three times as much on an AVX2 box: 76 s, for no chunk
    // boundary it does not already cross.)
    let prompt = long_prompt(60);
    let small = score_long_prompt("64", &prompt);
    let large = score_long_prompt("512", &prompt);
    assert!(
        small.token_ids.len() > 1_024,
        "prompt has {} tokens",
        small.token_ids.len()
    );
    compare(&small, &large, 1).check("chunking");
}

#[test]
fn a_short_stream_keeps_receiving_tokens_while_a_long_prompt_is_prefilled() {
    let srv = Server::start(&["--step-tokens", "16"]);
    let steps_before = srv.metric("sluice_steps_total");
    let generated_before = srv.metric("sluice_tokens_generated_total");
    let mixed_before = srv.metric("sluice_steps_mixed_total");

    // Over 5,500 prompt tokens, at most 16 a step: its first token is more than
    // 340 steps away, the short stream needs about 34. (Small steps keep the
    // test short: 8 s here against 32 s at 64 a step.) The long stream is never
    // read; the server is killed mid-prefill at the end.
    let body =
        json!({"prompt": long_prompt(300), "stream": true, "max_tokens": 2, "temperature": 0});
    let long = Sse::open(srv.addr, "/v1/completions", &body);
    assert_eq!(long.status, 200);
    // The long prompt is being prefilled once the engine has taken a step.
    wait_until(
        Duration::from_secs(120),
        "the long prefill to start",
        || srv.metric("sluice_steps_total") > steps_before,
    );
    let n_short = 32;
    let body = json!({"messages": [{"role": "user", "content": "Count to fifty."}], "stream": true,
                      "max_tokens": n_short, "ignore_eos": true, "temperature": 0});
    let mut sse = Sse::open(srv.addr, "/v1/chat/completions", &body);
    assert_eq!(sse.status, 200);
    let mut short_tokens = 0;
    while let Some(v) = sse.next_json() {
        if !delta_text(&v).is_empty() {
            short_tokens += 1;
        }
    }
    assert!(short_tokens > 0);
    // Tokens are counted when sampled, before they are sent: every token
    // sampled up to the short stream's last is in the count, and none of them
    // is the long prompt's.
    let generated = srv.metric("sluice_tokens_generated_total") - generated_before;
    assert_eq!(
        generated, n_short as f64,
        "{generated} tokens sampled by the short stream's end; it asked {n_short}: the long prompt got its first token first"
    );
    // And the long prompt was prefilled in chunks mixed with the short
    // stream's decoding: each of its n_short - 1 decode steps also carried a
    // chunk. (A step's tokens go out after its decode pass, before its
    // prefill pass: the last step may still be running, so this waits for
    // it to be counted.)
    wait_until(
        Duration::from_secs(120),
        "every decode step of the short stream counted as mixed",
        || srv.metric("sluice_steps_mixed_total") - mixed_before >= (n_short - 1) as f64,
    );
    drop(long);
}

#[test]
fn a_prompt_alone_takes_whole_chunks_and_beside_a_stream_only_what_the_itl_target_allows() {
    // A 20 ms target: no CPU prefills 500 tokens in 16 ms, so beside a running
    // stream the derived budget must be far below the 512-token ceiling.
    // (No prompt taken whole beside the stream: `--itl-max-ms 0`; none in
    // large chunks alone with the stream decoded ahead: `--decode-ahead-ms
    // 0`, which a box that decodes a token in under half the 20 ms target
    // would otherwise do, leaving no mixed step to count.)
    let srv = Server::start(&[
        "--itl-target-ms",
        "20",
        "--itl-max-ms",
        "0",
        "--decode-ahead-ms",
        "0",
        "--parallel",
        "2",
    ]);
    let long = json!({"prompt": long_prompt(60), "max_tokens": 1, "temperature": 0});

    // Alone: nothing decodes, so prefill takes the largest chunks.
    let steps = srv.metric("sluice_steps_total");
    let r = srv.post("/v1/completions", &long);
    assert_eq!(r.status, 200);
    let prompt_tokens = r.body_json()["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 1024, "prompt has {prompt_tokens} tokens");
    let whole_chunks = prompt_tokens.div_ceil(512) as f64;
    assert_eq!(srv.metric("sluice_steps_total") - steps, whole_chunks);

    // Beside a decoding stream: every step gives the stream its token, and the
    // prompt gets only what fits the target, so it needs many more steps.
    let body = json!({"prompt": "Once upon a time", "stream": true, "max_tokens": 4000,
                      "ignore_eos": true, "temperature": 0});
    let mut stream = Sse::open(srv.addr, "/v1/completions", &body);
    assert_eq!(stream.status, 200);
    assert!(stream.next_json().is_some());
    let mixed = srv.metric("sluice_steps_mixed_total");
    let addr = srv.addr;
    // Another prompt, fresh (the first is in the prefix cache now), a fifth
    // of a whole chunk: alone it would go in one step; beside the stream each
    // step carries about a token of it, so its length is what this test's
    // time goes on.
    let again =
        json!({"prompt": format!("Again.\n{}", long_prompt(6)), "max_tokens": 1, "temperature": 0});
    let sender = std::thread::spawn(move || post_json(addr, "/v1/completions", &again));
    let mut budget_min = f64::MAX;
    while !sender.is_finished() {
        // Keep reading, so the stream never pauses; watch the planned budget.
        assert!(stream.next_json().is_some(), "the stream ended early");
        budget_min = budget_min.min(srv.metric("sluice_step_budget_tokens"));
    }
    let r = sender.join().expect("client");
    assert_eq!(r.status, 200);
    let prompt_tokens = r.body_json()["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        (64..=512).contains(&prompt_tokens),
        "prompt has {prompt_tokens} tokens"
    );
    let whole_chunks = prompt_tokens.div_ceil(512) as f64;
    let mixed = srv.metric("sluice_steps_mixed_total") - mixed;
    assert!(
        mixed > 2.0 * whole_chunks,
        "{mixed} mixed steps for a prompt that takes {whole_chunks} whole chunks"
    );
    assert!(budget_min < 512.0, "the step budget stayed at {budget_min}");
}

#[test]
fn with_nothing_decoding_a_step_of_prefill_fits_itl_max() {
    // `--itl-max-ms 1`: a step of prefill alone may take what the cost model
    // says fits 0.8 ms, a few tokens at most on any CPU this model runs on
    // (prefill costs ~0.1-10 ms a token), where without the bound the whole
    // prompt, under 512 tokens, is one step (the test above, with 0).
    let srv = Server::start(&["--itl-max-ms", "1", "--parallel", "1"]);
    let body = json!({"prompt": long_prompt(20), "max_tokens": 1, "temperature": 0});
    let steps = srv.metric("sluice_steps_total");
    let r = srv.post("/v1/completions", &body);
    assert_eq!(r.status, 200);
    let prompt_tokens = r.body_json()["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        (200..512).contains(&prompt_tokens),
        "prompt has {prompt_tokens} tokens"
    );
    let steps = srv.metric("sluice_steps_total") - steps;
    assert!(
        steps >= (prompt_tokens / 16) as f64,
        "{steps} steps for {prompt_tokens} prompt tokens alone"
    );
    assert!(srv.metric("sluice_step_budget_tokens") < 64.0);
}

/// Mixed steps and steps that took a prompt whole while a ~400-token prompt
/// is prefilled beside a stream that has sampled `ahead` tokens under a 50 ms
/// target; and the prompt's tokens. Without decoding ahead
/// (`--decode-ahead-ms 0`), which would take the prompt in large chunks
/// where no pause is allowed (`beside_a_stream_a_long_prompt_goes_in_large_...`).
fn prompt_beside_a_stream(itl_max_ms: &str, ahead: usize) -> (f64, f64, u64) {
    let srv = Server::start(&[
        "--itl-target-ms",
        "50",
        "--itl-max-ms",
        itl_max_ms,
        "--parallel",
        "2",
        "--decode-ahead-ms",
        "0",
    ]);
    let body = json!({"prompt": "Once upon a time", "stream": true, "max_tokens": 4000,
                      "ignore_eos": true, "temperature": 0});
    let mut stream = Sse::open(srv.addr, "/v1/completions", &body);
    assert_eq!(stream.status, 200);
    for _ in 0..ahead {
        assert!(stream.next_json().is_some(), "the stream ended early");
    }
    let mixed = srv.metric("sluice_steps_mixed_total");
    let whole = srv.metric("sluice_steps_whole_prompt_total");
    let addr = srv.addr;
    let prompt = json!({"prompt": long_prompt(20), "max_tokens": 1, "temperature": 0});
    let sender = std::thread::spawn(move || post_json(addr, "/v1/completions", &prompt));
    while !sender.is_finished() {
        // Read on, so that the stream never pauses.
        assert!(stream.next_json().is_some(), "the stream ended early");
    }
    let r = sender.join().expect("client");
    assert_eq!(r.status, 200);
    let prompt_tokens = r.body_json()["usage"]["prompt_tokens"].as_u64().unwrap();
    (
        srv.metric("sluice_steps_mixed_total") - mixed,
        srv.metric("sluice_steps_whole_prompt_total") - whole,
        prompt_tokens,
    )
}

#[test]
fn beside_a_stream_ahead_of_its_pace_a_short_prompt_is_prefilled_in_one_step() {
    // A stream that has sampled 600 tokens under a 50 ms target is due its
    // next one 30 s after its first: on a box that decodes a token in 25 ms
    // or less, 15 s or more ahead of its pace. The ~400-token prompt costs a
    // fraction of that, and the pause allowed is a minute, so it is taken
    // whole: one step, beside the stream's decode token.
    let (mixed, whole, tokens) = prompt_beside_a_stream("60000", 600);
    assert!(
        (64..500).contains(&tokens),
        "the prompt has {tokens} tokens"
    );
    assert_eq!((mixed, whole), (1.0, 1.0), "{tokens}-token prompt");
    // With no pause allowed, the same prompt goes in chunks under the target
    // (40 ms a step; no CPU prefills 400 tokens in that).
    let (mixed, whole, _) = prompt_beside_a_stream("0", 600);
    assert_eq!(whole, 0.0);
    assert!(
        mixed >= 2.0,
        "{mixed} mixed steps for a {tokens}-token prompt"
    );
}

/// A ~1,500-token prompt, then once it is being prefilled (2 tokens a step:
/// hundreds of steps) a short one, with `w_max_ms` the prompts' W_max: the
/// prompt tokens prefilled when the short one's answer came, the long
/// prompt's tokens, and the steps counted as having put the long (overdue)
/// prompt first over the short one. `--overdue-stretch 0`: overdue from
/// W_max on, whatever the forecast. Both have a slot of their own, so
/// neither waits at the door, and `--no-shed` keeps an explicit W_max from
/// refusing either. The long prompt streams and is left once the short one
/// is answered: the rest of its prefill (hundreds of steps) is not what is
/// tested.
fn a_short_prompt_beside_a_long_one(w_max_ms: &str) -> (f64, f64, f64) {
    let srv = Server::start(&[
        "--step-tokens",
        "2",
        "--parallel",
        "2",
        "--queue-wait-ms",
        w_max_ms,
        "--overdue-stretch",
        "0",
        "--no-shed",
        "--prefix-cache-mb",
        "0",
    ]);
    let prompt = long_prompt(80);
    let tokens = srv
        .post("/tokenize", &json!({ "prompt": prompt }))
        .body_json()["count"]
        .as_f64()
        .expect("count");
    let before = srv.metric("sluice_prefill_tokens_total");
    let overdue_before = srv.metric("sluice_steps_overdue_first_total");
    let long = json!({"prompt": prompt, "stream": true, "max_tokens": 1, "temperature": 0});
    let long = Sse::open(srv.addr, "/v1/completions", &long);
    assert_eq!(long.status, 200);
    wait_until(
        Duration::from_secs(120),
        "the long prompt's first step",
        || srv.metric("sluice_prefill_tokens_total") > before,
    );
    // About a dozen tokens: several 2-token steps of its own.
    let short = json!({
        "prompt": "Hello there, my friend: how are you doing on this fine day?",
        "max_tokens": 1,
        "temperature": 0
    });
    let r = srv.post("/v1/completions", &short);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let short_tokens = r.body_json()["usage"]["prompt_tokens"].as_f64().unwrap();
    assert!(
        short_tokens > 4.0,
        "the short prompt has {short_tokens} tokens"
    );
    let prefilled = srv.metric("sluice_prefill_tokens_total") - before;
    let overdue_first = srv.metric("sluice_steps_overdue_first_total") - overdue_before;
    assert!(tokens > 1000.0, "the long prompt has {tokens} tokens");
    drop(long);
    (prefilled, tokens, overdue_first)
}

#[test]
fn a_long_prompt_overdue_in_its_slot_goes_first_every_other_step_beside_a_shorter_one() {
    // Shortest first: the short prompt is prefilled in the steps after it
    // arrives, while the long one has hundreds of steps to go (the count is
    // read just after the answer; the engine would have to run on for
    // hundreds of steps meanwhile to reach the long prompt's end), and with
    // W_max 60 s the long one is never overdue.
    let (prefilled, long, overdue_first) = a_short_prompt_beside_a_long_one("60000");
    assert!(
        prefilled < long,
        "{prefilled} tokens prefilled when the short prompt was answered; the long one has {long}"
    );
    assert_eq!(overdue_first, 0.0, "no prompt held its slot past W_max");
    // Past W_max (1 ms: at once) the long prompt goes first on every other
    // step: while the short one is prefilled, in 2-token steps, some steps
    // go to the long one first; the short one still gets the steps between,
    // and is answered long before the long prompt's end.
    let (prefilled, long, overdue_first) = a_short_prompt_beside_a_long_one("1");
    assert!(
        overdue_first >= 1.0,
        "{overdue_first} steps put the overdue prompt before the short one"
    );
    assert!(
        prefilled < long,
        "{prefilled} tokens prefilled when the short prompt was answered; the long one has {long}"
    );
}

#[test]
fn a_request_takes_the_free_slot_that_keeps_the_streams_in_one_pass() {
    // Per sequence, llama.cpp makes one pass over the weights per run of
    // consecutive sequence ids in a llama_decode: streams in slots 0 and 2
    // cost two passes at every step. Slots free up in any order; here 0 and
    // 1 do while 2 runs, and the next request must not take 0.
    let srv = Server::start(&["--parallel", "4", "--short-cells", "0"]);
    type Stream = (
        std::thread::JoinHandle<usize>,
        Arc<AtomicUsize>,
        Arc<AtomicBool>,
    );
    let split = || srv.metric("sluice_passes_split_total");
    let active = || srv.metric("sluice_sequences_active");
    let start = |prompt: &str| -> Stream {
        let stop = Arc::new(AtomicBool::new(false));
        let (handle, received) = background_stream_of(srv.addr, prompt, 2000, Arc::clone(&stop));
        wait_until(Duration::from_secs(120), "the stream to decode", || {
            received.load(Ordering::Relaxed) >= 2
        });
        (handle, received, stop)
    };
    let end = |(handle, _, stop): Stream, left: f64| {
        stop.store(true, Ordering::Relaxed);
        handle.join().expect("background stream");
        wait_until(Duration::from_secs(120), "the stream to end", || {
            active() == left
        });
    };
    let a = start("Alpha: write a story about a lighthouse keeper.");
    let b = start("Bravo: list every country in Europe.");
    let c = start("Charlie: explain how a steam engine works.");
    assert_eq!(active(), 3.0);
    assert_eq!(split(), 0.0, "slots 0, 1 and 2 in one pass");
    end(a, 2.0);
    end(b, 1.0);
    // Beside the stream in slot 2: slot 1 or 3, not 0.
    let d = start("Delta: describe the water cycle in detail.");
    let counts = |s: &Stream| s.1.load(Ordering::Relaxed);
    let (c_before, d_before) = (counts(&c), counts(&d));
    wait_until(Duration::from_secs(120), "both streams to decode", || {
        counts(&c) >= c_before + 16 && counts(&d) >= d_before + 16
    });
    assert_eq!(
        split(),
        0.0,
        "two streams decoding together in two passes a step"
    );
    // Not one pass by a filler in a gap either: slot 0 would leave one.
    assert_eq!(srv.metric("sluice_pass_fillers_total"), 0.0);
    end(c, 1.0);
    end(d, 0.0);
}

/// A stream in the middle slot that ends while the streams beside it run on
/// leaves a gap in their ids: each of their passes then takes a filler token
/// in the missing id's stream, freed after the pass, and stays one pass over
/// the weights; the stream beside it gets the same text as alone.
#[test]
fn a_stream_ending_in_a_middle_slot_leaves_a_filler_not_a_second_pass() {
    let srv = Server::start(&["--parallel", "4", "--short-cells", "0"]);
    let text_of = |v: &Value| v["choices"][0]["text"].as_str().unwrap_or("").to_string();
    let body = json!({"prompt": "Charlie: explain how a steam engine works.",
                      "max_tokens": 300, "ignore_eos": true, "temperature": 0});
    let alone = text_of(&srv.post_ok("/v1/completions", &body));
    // Its cells, parked in slot 0, are put away once the engine is idle: then
    // the streams take slots 0, 1 and 2 in turn.
    wait_until(
        Duration::from_secs(120),
        "the parked sequence saved",
        || srv.metric("sluice_prefix_cache_parked_tokens") == 0.0,
    );
    let split = || srv.metric("sluice_passes_split_total");
    let fillers = || srv.metric("sluice_pass_fillers_total");
    let active = || srv.metric("sluice_sequences_active");
    let start = |prompt: &str| {
        let stop = Arc::new(AtomicBool::new(false));
        let (handle, received) = background_stream_of(srv.addr, prompt, 2000, Arc::clone(&stop));
        wait_until(Duration::from_secs(120), "the stream to decode", || {
            received.load(Ordering::Relaxed) >= 2
        });
        (handle, stop)
    };
    // Slots 0, 1 and 2.
    let (a, stop_a) = start("Alpha: write a story about a lighthouse keeper.");
    let (b, stop_b) = start("Bravo: list every country in Europe.");
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let mut c = Sse::open(srv.addr, "/v1/completions", &stream_body);
    assert_eq!(c.status, 200);
    let mut text = text_of(&c.next_json().expect("the third stream's first token"));
    assert_eq!(active(), 3.0);
    assert_eq!(
        (split(), fillers()),
        (0.0, 0.0),
        "slots 0, 1 and 2 in one pass"
    );
    // Slot 1 ends: slots 0 and 2 decode on (300 tokens take 300 steps).
    stop_b.store(true, Ordering::Relaxed);
    b.join().expect("background stream");
    wait_until(Duration::from_secs(120), "the middle stream to end", || {
        active() == 2.0
    });
    while let Some(v) = c.next_json() {
        text.push_str(&text_of(&v));
        if !v["choices"][0]["finish_reason"].is_null() {
            break;
        }
    }
    assert!(fillers() > 0.0, "no filler in the gap at slot 1");
    assert_eq!(split(), 0.0, "slots 0 and 2 in two passes a step");
    assert_eq!(text, alone, "the stream beside the filler");
    stop_a.store(true, Ordering::Relaxed);
    a.join().expect("background stream");
}

/// With `--decode-ahead-ms`, a long prompt beside a stream goes in large
/// chunks, each alone in its step, once the stream has tokens decoded ahead
/// to send for as long as the chunk's forecast (`engine::ahead`); the reply
/// holds each such token until its time. The stream gets every token, in
/// order: the same text as alone (its decode tokens go in passes of their
/// own either way, which give the same logits), and at least one step was
/// such a chunk. (`--itl-max-ms 0`: the prompt is never taken whole, which
/// a fast CPU would do with a prompt this size. Whether a step may be a
/// large chunk depends on the box's speed only through the decode step
/// against half the 150 ms pace.)
#[test]
fn beside_a_stream_a_long_prompt_goes_in_large_chunks_and_the_stream_loses_no_token() {
    let srv = Server::start(&["--decode-ahead-ms", "5000", "--itl-max-ms", "0"]);
    let n = 160;
    let body = json!({"prompt": "Once upon a time", "max_tokens": n, "ignore_eos": true,
                      "temperature": 0, "stream": true});
    let read = |sse: &mut Sse| {
        let (text, chunks) = collect_stream(sse);
        let tokens = chunks.iter().filter(|c| !delta_text(c).is_empty()).count();
        let finish = chunks.iter().find_map(|c| {
            c["choices"][0]["finish_reason"]
                .as_str()
                .map(str::to_string)
        });
        (text, tokens, finish)
    };
    let mut alone = Sse::open(srv.addr, "/v1/completions", &body);
    assert_eq!(alone.status, 200);
    let (alone_text, alone_tokens, alone_finish) = read(&mut alone);
    assert_eq!(alone_finish.as_deref(), Some("length"));
    assert!(
        alone_tokens > n / 2,
        "{alone_tokens} tokens with text of {n}"
    );

    let ahead_before = srv.metric("sluice_steps_ahead_chunk_total");
    let mut beside = Sse::open(srv.addr, "/v1/completions", &body);
    assert_eq!(beside.status, 200);
    let first = beside.next_json().expect("the stream's first chunk");
    let addr = srv.addr;
    let long = std::thread::spawn(move || {
        let body = json!({"prompt": long_prompt(120), "max_tokens": 1, "temperature": 0});
        post_json(addr, "/v1/completions", &body)
    });
    let (rest, tokens, finish) = read(&mut beside);
    let answer = long.join().expect("the long request");
    assert_eq!(
        answer.status,
        200,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    assert_eq!(
        format!("{}{rest}", delta_text(&first)),
        alone_text,
        "the stream's text beside the long prompt"
    );
    assert_eq!(
        tokens + usize::from(!delta_text(&first).is_empty()),
        alone_tokens
    );
    assert_eq!(finish.as_deref(), Some("length"));
    let ahead = srv.metric("sluice_steps_ahead_chunk_total") - ahead_before;
    assert!(ahead >= 1.0, "no step took a large chunk alone");
}
