//! Admission: the queue bounds say no at once, with a signal a client can act on,
//! and every request is accounted for.

use crate::harness::*;
use serde_json::json;
use std::sync::{Arc, Barrier};
use std::time::Duration;

#[test]
fn a_burst_beyond_running_and_queued_capacity_gets_429_with_retry_after() {
    // Rates given explicitly so that the bounds do not depend on how busy the
    // machine was while calibrating: 2 running + 3 queued.
    let srv = Server::start(&[
        "--parallel",
        "2",
        "--queue-depth",
        "3",
        "--mu-prefill",
        "200",
        "--mu-decode",
        "150",
    ]);
    let n = 30;
    let barrier = Arc::new(Barrier::new(n));
    let addr = srv.addr;
    let handles: Vec<_> = (0..n)
        .map(|i| {
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                // Long enough that no admitted request finishes during the burst.
                let body = json!({"prompt": format!("Request {i}: count to a thousand."), "max_tokens": 200,
                                  "ignore_eos": true, "temperature": 0});
                barrier.wait();
                request(addr, "POST", "/v1/completions", Some(body.to_string().as_bytes()), &[("Content-Type", "application/json")])
            })
        })
        .collect();
    let responses: Vec<Response> = handles
        .into_iter()
        .map(|h| h.join().expect("client"))
        .collect();

    let ok: Vec<&Response> = responses.iter().filter(|r| r.status == 200).collect();
    let refused: Vec<&Response> = responses.iter().filter(|r| r.status == 429).collect();
    assert_eq!(ok.len() + refused.len(), n, "only 200 and 429 expected");
    assert_eq!(ok.len(), 5, "exactly running (2) + queued (3) are admitted");
    for r in &refused {
        let wait: u64 = r
            .header("Retry-After")
            .expect("Retry-After")
            .parse()
            .expect("seconds");
        assert!(wait >= 1);
        let v = r.body_json();
        assert_eq!(v["error"]["code"], "queue_full", "{v}");
        assert_eq!(v["error"]["queue"]["depth_max"], 3);
        assert_eq!(v["error"]["queue"]["estimated_wait_s"], wait);
    }
    for r in &ok {
        assert_eq!(r.body_json()["usage"]["completion_tokens"], 200);
    }
    assert_eq!(srv.metric("sluice_requests_accepted_total"), 5.0);
    assert_eq!(
        srv.metric("sluice_requests_rejected_total{reason=\"queue_full\"}"),
        25.0
    );
    assert_eq!(srv.metric("sluice_requests_completed_total"), 5.0);
    assert_eq!(srv.metric("sluice_queue_depth"), 0.0);
}

#[test]
fn a_prompt_over_the_queued_token_budget_is_refused_while_a_short_one_is_admitted() {
    // Budget = 100 prompt tok/s x 5 s = 500 queued prompt tokens.
    let srv = Server::start(&[
        "--parallel",
        "1",
        "--queue-depth",
        "3",
        "--mu-prefill",
        "100",
        "--mu-decode",
        "100",
        "--queue-wait-ms",
        "5000",
    ]);
    assert_eq!(srv.metric("sluice_queued_prompt_tokens_max"), 500.0);
    // Occupy the only slot, and put a short request in the queue behind it.
    let mut running = Sse::open(
        srv.addr,
        "/v1/completions",
        &json!({"prompt": "Hi", "stream": true, "max_tokens": 4000, "ignore_eos": true, "temperature": 0}),
    );
    assert_eq!(running.status, 200);
    assert!(running.next_json().is_some());
    let short = |tag: &str| {
        let addr = srv.addr;
        let body = json!({"prompt": format!("Short {tag}."), "max_tokens": 4, "temperature": 0});
        std::thread::spawn(move || {
            request(
                addr,
                "POST",
                "/v1/completions",
                Some(body.to_string().as_bytes()),
                &[("Content-Type", "application/json")],
            )
        })
    };
    let first = short("one");
    wait_until(
        Duration::from_secs(30),
        "the short request to queue",
        || srv.metric("sluice_queue_depth") == 1.0,
    );

    // Room by count (1 of 3), but ~600 prompt tokens would break the budget.
    let big = srv.post(
        "/v1/completions",
        &json!({"prompt": long_prompt(30), "max_tokens": 4}),
    );
    assert_eq!(big.status, 429);
    let v = big.body_json();
    assert_eq!(v["error"]["code"], "queue_token_budget", "{v}");
    assert!(big.header("Retry-After").is_some());
    // A short one still fits.
    let second = short("two");
    wait_until(
        Duration::from_secs(30),
        "the second short request to queue",
        || srv.metric("sluice_queue_depth") == 2.0,
    );

    drop(running); // the slot frees; both queued requests run
    assert_eq!(first.join().unwrap().status, 200);
    assert_eq!(second.join().unwrap().status, 200);
    assert_eq!(
        srv.metric("sluice_requests_rejected_total{reason=\"token_budget\"}"),
        1.0
    );
    assert_eq!(
        srv.metric("sluice_requests_rejected_total{reason=\"queue_full\"}"),
        0.0
    );
}
