//! Streaming flow control: a slow reader costs only its own stream, a client
//! that leaves stops costing at once.

use crate::harness::*;
use serde_json::json;
use sluice_bench::http;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Events a finished or paused sequence may hold in the engine beside its
/// stream's buffer (the engine's outbox: a last token, held text, the end).
const ENGINE_OUTBOX_EVENTS: usize = 3;

#[test]
fn a_client_that_hangs_up_mid_stream_is_cancelled_within_a_step() {
    let srv = Server::start(&["--parallel", "2"]);
    let generated = srv.metric("sluice_tokens_generated_total");
    let body = json!({"prompt": "Once upon a time", "stream": true, "max_tokens": 1000,
                      "ignore_eos": true, "temperature": 0});
    let mut sse = Sse::open(srv.addr, "/v1/completions", &body);
    assert_eq!(sse.status, 200);
    assert!(sse.next_json().is_some());
    assert!(sse.next_json().is_some());
    drop(sse); // closes the socket after 2 tokens

    wait_until(
        Duration::from_secs(120),
        "the disconnect to be counted",
        || srv.metric("sluice_requests_cancelled_total{reason=\"disconnect\"}") == 1.0,
    );
    let generated = srv.metric("sluice_tokens_generated_total") - generated;
    // Read 2; at most a stream buffer (16) and the engine's outbox more were
    // generated while the client's close reached sluice.
    assert!(
        generated <= (2 + 16 + ENGINE_OUTBOX_EVENTS) as f64,
        "{generated} tokens generated for a client that read 2 of 1000"
    );
    assert!(
        srv.metric("sluice_tokens_after_cancel_total") <= 1.0,
        "more than one token was sampled after the cancel"
    );
    // The step under way when the client's close was seen may finish; no other starts.
    assert!(srv.metric("sluice_cancel_lag_steps_max") <= 1.0);
    wait_until(Duration::from_secs(120), "the KV cells to return", || {
        srv.metric("sluice_kv_cells_reserved") == 0.0 && srv.metric("sluice_kv_cells_used") == 0.0
    });
    assert_eq!(srv.metric("sluice_requests_completed_total"), 0.0);
}

#[test]
fn a_non_streaming_request_whose_client_leaves_is_cancelled() {
    let srv = Server::start(&["--parallel", "2"]);
    let body = json!({"prompt": "Once upon a time", "max_tokens": 4000,
                      "ignore_eos": true, "temperature": 0});
    let s = send_json(srv.addr, "/v1/completions", &body);
    wait_until(Duration::from_secs(120), "generation to start", || {
        srv.metric("sluice_tokens_generated_total") > 0.0
    });
    drop(s);
    wait_until(
        Duration::from_secs(120),
        "the disconnect to be counted",
        || srv.metric("sluice_requests_cancelled_total{reason=\"disconnect\"}") == 1.0,
    );
    assert!(srv.metric("sluice_tokens_generated_total") < 4000.0);
    wait_until(Duration::from_secs(120), "the KV cells to return", || {
        srv.metric("sluice_kv_cells_reserved") == 0.0
    });
}

#[test]
fn a_client_that_leaves_during_a_long_prefill_stops_it_before_it_finishes() {
    let srv = Server::start(&[]);
    let prompt = long_prompt(300);
    let body = json!({"prompt": prompt, "stream": true, "max_tokens": 8, "temperature": 0});
    let s = send_json(srv.addr, "/v1/completions", &body);
    // The prefill is under way once the engine has prefilled a chunk of it.
    wait_until(Duration::from_secs(120), "the prefill to start", || {
        srv.metric("sluice_prefill_tokens_total") > 0.0
    });
    drop(s);
    wait_until(
        Duration::from_secs(120),
        "the disconnect to be counted",
        || srv.metric("sluice_requests_cancelled_total{reason=\"disconnect\"}") == 1.0,
    );
    let prefilled = srv.metric("sluice_prefill_tokens_total");
    let abandoned = srv.metric("sluice_prefill_tokens_abandoned_total");
    assert!(
        abandoned > 0.0,
        "the whole prompt was prefilled ({prefilled} tokens)"
    );
    assert!(
        prefilled + abandoned > 5_500.0,
        "prefilled {prefilled} + abandoned {abandoned} should be the ~6,000-token prompt"
    );
    assert_eq!(
        srv.metric("sluice_prompt_tokens_total"),
        0.0,
        "no prefill completed"
    );
    assert!(srv.metric("sluice_cancel_lag_steps_max") <= 1.0);
    assert_eq!(srv.metric("sluice_tokens_generated_total"), 0.0);
    wait_until(Duration::from_secs(120), "the KV cells to return", || {
        srv.metric("sluice_kv_cells_used") == 0.0 && srv.metric("sluice_kv_cells_reserved") == 0.0
    });
    // A pass stopped because its client left is counted, not logged as
    // llama.cpp's error: the operator's log would read every departure
    // mid-prefill as a failure.
    let log = srv.log();
    for line in [
        "graph_compute_async failed",
        "failed to compute graph",
        "removing memory module entries",
        "failed to decode",
    ] {
        assert!(!log.contains(line), "{log}");
    }
}

#[test]
fn a_slow_reader_pauses_its_own_sequence_and_is_cancelled_after_the_stall_timeout() {
    let buffer_tokens = 4;
    let send_buffer = 4096;
    let srv = Server::start(&[
        "--parallel",
        "2",
        "--stream-buffer-tokens",
        &buffer_tokens.to_string(),
        "--send-buffer-bytes",
        &send_buffer.to_string(),
        "--stall-timeout-ms",
        "3000",
    ]);
    // A client with a tiny receive buffer that reads 8 bytes a second: a
    // token's event is ~200 bytes, so it takes one about every 25 s.
    let mut slow =
        http::connect_with_rcvbuf(srv.addr, Duration::from_secs(120), 1024).expect("connect");
    let rcvbuf = http::recv_buffer_bytes(&slow).expect("SO_RCVBUF");
    let body = json!({"prompt": "Tell me a very long story.", "stream": true, "max_tokens": 2000,
                      "ignore_eos": true, "temperature": 0});
    http::write_request(
        &mut slow,
        "POST",
        "/v1/completions",
        Some(body.to_string().as_bytes()),
        &[("Content-Type", "application/json")],
    )
    .expect("send");
    slow.flush().expect("flush");
    let generated_before = srv.metric("sluice_tokens_generated_total");
    let stop = Arc::new(AtomicBool::new(false));
    let reader = std::thread::spawn({
        let stop = Arc::clone(&stop);
        move || {
            let mut bytes = Vec::new();
            let mut buf = [0u8; 8];
            let started = Instant::now();
            // Until told, or the server closes, at most 2 minutes.
            while !stop.load(Ordering::Relaxed) && started.elapsed() < Duration::from_secs(120) {
                match slow.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => bytes.extend_from_slice(&buf[..n]),
                }
                std::thread::sleep(Duration::from_secs(1));
            }
            bytes
        }
    });

    wait_until(Duration::from_secs(120), "the slow stream to pause", || {
        srv.metric("sluice_sequences_paused") == 1.0
    });
    // Meanwhile a normal stream runs to its end.
    let normal = json!({"prompt": "Count to ten.", "stream": true, "max_tokens": 64,
                        "ignore_eos": true, "temperature": 0});
    let r = post_json(srv.addr, "/v1/completions", &normal);
    assert_eq!(r.status, 200);
    let normal_text = String::from_utf8_lossy(&r.body).into_owned();
    assert!(
        normal_text.contains("\"finish_reason\":\"length\"")
            && normal_text.ends_with("data: [DONE]\n\n"),
        "the normal stream completed: {normal_text}"
    );
    // Its events are the size of the slow stream's (same model, same shape).
    let event_bytes = normal_text.len() / normal_text.matches("data: ").count();

    wait_until(
        Duration::from_secs(120),
        "the stall to be cancelled",
        || srv.metric("sluice_requests_cancelled_total{reason=\"stall\"}") == 1.0,
    );
    let slow_generated = srv.metric("sluice_tokens_generated_total") - generated_before - 64.0;
    wait_until(Duration::from_secs(120), "the KV cells to return", || {
        srv.metric("sluice_kv_cells_reserved") == 0.0
    });
    assert_eq!(srv.metric("sluice_sequences_paused"), 0.0);

    stop.store(true, Ordering::Relaxed);
    // What the server generated for the slow client: what it read, plus what
    // fits in the stream's buffer, the engine's outbox, the event its handler
    // holds, and the kernel's buffers between them (send, doubled by Linux, and
    // the client's receive buffer), counted in events of the normal stream's size.
    let bytes = reader.join().expect("reader");
    let events_read = String::from_utf8_lossy(&bytes).matches("data: ").count();
    let kernel_events = (2 * send_buffer + rcvbuf).div_ceil(event_bytes);
    let bound = events_read + buffer_tokens + ENGINE_OUTBOX_EVENTS + 1 + kernel_events;
    assert!(
        slow_generated <= bound as f64,
        "{slow_generated} tokens generated for a client that read {events_read} events (bound {bound}: \
         buffer {buffer_tokens}, kernel {kernel_events} events of {event_bytes} bytes)"
    );
    assert!(slow_generated < 2000.0);
}

#[test]
fn a_stream_that_left_the_queue_gets_its_head_and_keep_alives_until_its_first_token() {
    // A ~750-token prompt takes far longer than 10 ms to prefill on any CPU
    // (some 200 GFLOP; 2 cores of AMX at their peak need 0.1 s).
    let srv = Server::start(&["--sse-keep-alive-ms", "10"]);
    let body = json!({"messages": [{"role": "user", "content": long_prompt(40)}],
                      "stream": true, "max_tokens": 4, "temperature": 0});
    let mut sse = Sse::open(srv.addr, "/v1/chat/completions", &body);
    assert_eq!(sse.status, 200);
    // The role chunk comes with the head, as soon as the request has a slot.
    let role = sse.next_json().expect("the role chunk");
    assert_eq!(role["choices"][0]["delta"]["role"], "assistant", "{role}");
    assert_eq!(sse.comments(), 0);
    // Then comments, until the first token's chunk.
    let first = loop {
        let v = sse.next_json().expect("a token before the end");
        if !delta_text(&v).is_empty() || v["choices"][0]["finish_reason"].is_string() {
            break v;
        }
    };
    let before_first = sse.comments();
    assert!(
        before_first >= 1,
        "no keep-alive during the prefill: {first}"
    );
    // None once tokens flow.
    collect_stream(&mut sse);
    assert_eq!(
        sse.comments(),
        before_first,
        "keep-alives stop at the first token"
    );
    // A stream still in the queue is not started: it may yet be refused with
    // its own status (covered by the admission tests' 503s and 504s).
}
