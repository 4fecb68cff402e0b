//! Admission: the queue bounds say no at once, with a signal a client can act on,
//! and every request is accounted for.

use crate::harness::*;
use serde_json::json;
use std::sync::{Arc, Barrier};
use std::time::Duration;

/// Starts a long stream and reads its first token: a slot stays busy until the
/// returned stream is dropped (which cancels it).
fn occupy_a_slot(srv: &Server) -> Sse {
    long_stream(srv.addr)
}

/// A long stream whose first token was read (it waits in the queue until
/// then).
fn long_stream(addr: std::net::SocketAddr) -> Sse {
    let body = json!({"prompt": "Hi", "stream": true, "max_tokens": 4000, "ignore_eos": true, "temperature": 0});
    let mut s = Sse::open(addr, "/v1/completions", &body);
    assert_eq!(s.status, 200);
    assert!(s.next_json().is_some());
    s
}

#[test]
fn a_burst_beyond_running_and_queued_capacity_gets_429_with_retry_after() {
    // Rates given explicitly so that the bounds do not depend on how busy the
    // machine was while calibrating: 2 running + 3 queued.
    // No shedding here: this test is about the count bound alone (the queued
    // requests wait longer than the sojourn target behind 200-token answers).
    let srv = Server::start(&[
        "--parallel",
        "2",
        "--queue-depth",
        "3",
        "--mu-prefill",
        "200",
        "--mu-decode",
        "150",
        "--mu-fixed",
        "--no-shed",
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
                post_json(addr, "/v1/completions", &body)
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
    // Each refusal is given its own return time, so that clients refused
    // together do not come back together.
    let mut waits_ms = std::collections::HashSet::new();
    for r in &refused {
        let wait: u64 = r
            .header("Retry-After")
            .expect("Retry-After")
            .parse()
            .expect("seconds");
        let v = r.body_json();
        assert_eq!(v["error"]["code"], "queue_full", "{v}");
        assert_eq!(v["error"]["queue"]["depth_max"], 3);
        let estimate = v["error"]["queue"]["estimated_wait_s"].as_u64().unwrap();
        assert!(estimate >= 1, "{v}");
        let ms: u64 = r
            .header("retry-after-ms")
            .expect("retry-after-ms (the OpenAI SDKs read it first)")
            .parse()
            .expect("ms");
        assert!(
            ms <= estimate * 1100,
            "{ms} ms for an estimate of {estimate} s"
        );
        assert_eq!(
            wait,
            ms.div_ceil(1000).max(1),
            "Retry-After is never earlier"
        );
        assert_eq!(r.header("x-should-retry"), Some("true"));
        waits_ms.insert(ms);
    }
    // They are given places one after another: the waits are spread out.
    let (lo, hi) = (
        *waits_ms.iter().min().unwrap(),
        *waits_ms.iter().max().unwrap(),
    );
    assert!(
        hi >= 2 * lo,
        "25 refusals, waits {lo}..{hi} ms: {waits_ms:?}"
    );
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
fn the_token_budget_bounds_the_prompts_ahead_so_a_long_prompt_waits_behind_a_short_queue() {
    // Budget = 100 prompt tok/s x 5 s (the default W_max, which sheds
    // nothing) = 500 prompt tokens ahead of a request that must wait.
    let srv = Server::start(&[
        "--parallel",
        "1",
        "--queue-depth",
        "3",
        "--mu-prefill",
        "100",
        "--mu-decode",
        "100",
        "--mu-fixed",
    ]);
    assert_eq!(srv.metric("sluice_queued_prompt_tokens_max"), 500.0);
    // Occupy the only slot, and put a short request in the queue behind it.
    let running = occupy_a_slot(&srv);
    let send = |prompt: String| {
        let addr = srv.addr;
        let body = json!({"prompt": prompt, "max_tokens": 4, "temperature": 0});
        std::thread::spawn(move || post_json(addr, "/v1/completions", &body))
    };
    let short = send("Short one.".into());
    wait_until(
        Duration::from_secs(120),
        "the short request to queue",
        || srv.metric("sluice_queue_depth") == 1.0,
    );
    // A ~600-token prompt, over the whole budget, behind a few tokens: its
    // own prefill is its service, not its wait, so it is admitted.
    let long = send(long_prompt(30));
    wait_until(Duration::from_secs(120), "the long prompt to queue", || {
        srv.metric("sluice_queue_depth") == 2.0
    });
    let queued = srv.metric("sluice_queued_prompt_tokens");
    assert!(queued > 500.0, "{queued} prompt tokens waiting");

    // Room by count (2 of 3), but more than the budget ahead of it: a
    // newcomer is refused at the door, whatever its own size, before its
    // body is read.
    let parsed_before = srv.metric("sluice_requests_rejected_before_parsing_total");
    let r = srv.post(
        "/v1/completions",
        &json!({"prompt": "Tiny.", "max_tokens": 1}),
    );
    assert_eq!(r.status, 429, "{}", String::from_utf8_lossy(&r.body));
    let v = r.body_json();
    assert_eq!(v["error"]["code"], "queue_token_budget", "{v}");
    assert!(r.header("Retry-After").is_some());
    assert_eq!(
        srv.metric("sluice_requests_rejected_before_parsing_total") - parsed_before,
        1.0,
        "refused before parsing"
    );

    drop(running); // the slot frees; both queued requests run
    assert_eq!(short.join().unwrap().status, 200);
    assert_eq!(long.join().unwrap().status, 200);
    assert_eq!(
        srv.metric("sluice_requests_rejected_total{reason=\"token_budget\"}"),
        1.0
    );
    assert_eq!(
        srv.metric("sluice_requests_rejected_total{reason=\"queue_full\"}"),
        0.0
    );
}

#[test]
fn a_request_whose_deadline_passes_in_the_queue_is_never_run() {
    let srv = Server::start(&[
        "--parallel",
        "1",
        "--queue-depth",
        "3",
        "--mu-prefill",
        "200",
        "--mu-decode",
        "150",
        "--mu-fixed",
    ]);
    // Occupy the only slot.
    let running = occupy_a_slot(&srv);
    let prompt_tokens_before = srv.metric("sluice_prompt_tokens_total");
    // Willing to wait half a second; the slot stays busy longer than that.
    let body = json!({"prompt": "This request never runs.", "max_tokens": 8});
    let r = request(
        srv.addr,
        "POST",
        "/v1/completions",
        Some(body.to_string().as_bytes()),
        &[
            ("Content-Type", "application/json"),
            ("X-Request-Timeout", "0.5"),
        ],
    );
    assert_eq!(r.status, 504, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(
        r.header("x-should-retry"),
        Some("false"),
        "its time is gone"
    );
    // The OpenAI Python client's own timeout header is a deadline too.
    let r = request(
        srv.addr,
        "POST",
        "/v1/completions",
        Some(body.to_string().as_bytes()),
        &[
            ("Content-Type", "application/json"),
            ("X-Stainless-Read-Timeout", "0.5"),
        ],
    );
    assert_eq!(r.status, 504, "{}", String::from_utf8_lossy(&r.body));
    // Free the slot: the engine dequeues the expired requests and drops them.
    drop(running);
    wait_until(
        Duration::from_secs(120),
        "the expired requests to be dropped",
        || srv.metric("sluice_requests_dropped_total{reason=\"deadline\"}") == 2.0,
    );
    assert_eq!(
        srv.metric("sluice_prompt_tokens_total"),
        prompt_tokens_before,
        "it prefilled nothing"
    );
    assert_eq!(srv.metric("sluice_requests_completed_total"), 0.0);
    assert_eq!(srv.metric("sluice_queue_depth"), 0.0);
    // A bad deadline header is a 400 naming it.
    let r = request(
        srv.addr,
        "POST",
        "/v1/completions",
        Some(body.to_string().as_bytes()),
        &[
            ("Content-Type", "application/json"),
            ("X-Request-Timeout", "soon"),
        ],
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.body_json()["error"]["param"], "X-Request-Timeout");
}

#[test]
fn under_sustained_overload_readyz_turns_503_and_back_while_livez_stays_200() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    // One slot, four queued, a 1 s budget; a sojourn target of 50 ms over a
    // 100 ms interval, so that four requests of 40 tokens waiting stand above
    // it on any box (40 decode steps each).
    let srv = Server::start(&[
        "--parallel",
        "1",
        "--queue-depth",
        "4",
        "--queue-wait-ms",
        "1000",
        "--shed-target-ms",
        "50",
        "--shed-interval-ms",
        "100",
        "--mu-prefill",
        "200",
        "--mu-decode",
        "150",
        "--mu-fixed",
    ]);
    assert_eq!(request(srv.addr, "GET", "/readyz", None, &[]).status, 200);
    let stop = Arc::new(AtomicBool::new(false));
    let shed = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..6)
        .map(|i| {
            let (stop, shed, addr) = (Arc::clone(&stop), Arc::clone(&shed), srv.addr);
            std::thread::spawn(move || {
                let body = json!({"prompt": format!("Client {i}: count."), "max_tokens": 40, "ignore_eos": true});
                // Bounded: each client stops when told, or after 400 requests.
                for _ in 0..400 {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let r = post_json(addr, "/v1/completions", &body);
                    match r.status {
                        200 => {}
                        503 => {
                            assert!(r.header("Retry-After").is_some());
                            let v = r.body_json();
                            let code = v["error"]["code"].as_str().unwrap_or_default();
                            assert!(
                                code == "shed_sojourn" || code == "shed_ttft_budget",
                                "{v}"
                            );
                            shed.fetch_add(1, Ordering::Relaxed);
                        }
                        // The queue is full: back off a little, as a client should.
                        429 => std::thread::sleep(Duration::from_millis(50)),
                        s => panic!("unexpected status {s}"),
                    }
                }
            })
        })
        .collect();
    let mut saw_not_ready = false;
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    while std::time::Instant::now() < deadline
        && !(saw_not_ready && shed.load(Ordering::Relaxed) > 0)
    {
        assert_eq!(
            request(srv.addr, "GET", "/livez", None, &[]).status,
            200,
            "liveness must not depend on load"
        );
        if request(srv.addr, "GET", "/readyz", None, &[]).status == 503 {
            saw_not_ready = true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().expect("client");
    }
    assert!(
        saw_not_ready,
        "/readyz never turned 503 under sustained overload"
    );
    assert!(shed.load(Ordering::Relaxed) > 0, "nothing was shed");
    assert_eq!(
        srv.metric("sluice_requests_dropped_total{reason=\"shed_sojourn\"}")
            + srv.metric("sluice_requests_dropped_total{reason=\"shed_ttft_budget\"}"),
        shed.load(Ordering::Relaxed) as f64
    );
    // Load stopped: the queue drains and the server is ready again.
    wait_until(
        Duration::from_secs(120),
        "/readyz to turn 200 again",
        || request(srv.addr, "GET", "/readyz", None, &[]).status == 200,
    );
    assert_eq!(request(srv.addr, "GET", "/livez", None, &[]).status, 200);
}

#[test]
fn past_the_sojourn_target_only_requests_that_can_still_meet_w_max_start() {
    // W_max 8 s, so the sojourn target is 4 s. One slot, calibrated rates, and
    // room in the queue for a long prompt and a short one behind it.
    // Rates fixed at 200 and 150 tok/s whatever the box does: the long
    // prompt's forecast is 15 s of prefill, the short one's well under a
    // second, which leaves the short one over 3 s of W_max for a busy box to
    // free the slot in.
    let srv = Server::start(&[
        "--parallel",
        "1",
        "--queue-depth",
        "2",
        "--queue-wait-ms",
        "8000",
        "--queued-tokens-max",
        "10000",
        "--mu-prefill",
        "200",
        "--mu-decode",
        "150",
        "--mu-fixed",
    ]);
    let running = occupy_a_slot(&srv);
    let prompt_tokens_before = srv.metric("sluice_prompt_tokens_total");
    let send = |prompt: String| {
        let addr = srv.addr;
        let body = json!({"prompt": prompt, "max_tokens": 4, "temperature": 0});
        std::thread::spawn(move || post_json(addr, "/v1/completions", &body))
    };
    // About 3,000 prompt tokens: seconds of prefill on a CPU, far past what is
    // left of the budget once it has waited; then a short one.
    let long = send(long_prompt(150));
    wait_until(
        Duration::from_secs(120),
        "the long request to queue",
        || srv.metric("sluice_queue_depth") == 1.0,
    );
    let short = send("Say hi.".into());
    wait_until(
        Duration::from_secs(120),
        "the short request to queue",
        || srv.metric("sluice_queue_depth") == 2.0,
    );
    // Both wait past the sojourn target, then the slot frees.
    std::thread::sleep(Duration::from_millis(4200));
    drop(running);

    let long = long.join().expect("client");
    assert_eq!(long.status, 503, "{}", String::from_utf8_lossy(&long.body));
    let v = long.body_json();
    assert_eq!(v["error"]["code"], "shed_ttft_budget", "{v}");
    assert!(long.header("Retry-After").is_some());
    let short = short.join().expect("client");
    assert_eq!(
        short.status,
        200,
        "{}",
        String::from_utf8_lossy(&short.body)
    );
    assert_eq!(
        srv.metric("sluice_requests_dropped_total{reason=\"shed_ttft_budget\"}"),
        1.0
    );
    assert_eq!(
        srv.metric("sluice_prompt_tokens_total") - prompt_tokens_before,
        short.body_json()["usage"]["prompt_tokens"]
            .as_f64()
            .unwrap(),
        "the long prompt was never prefilled"
    );
}

#[test]
fn the_queue_bound_follows_the_rates_measured_online() {
    // Told the box does 5 tokens/s: mu_req = 1 / (128/5 + 128/5) = 0.02/s, so
    // Little's law gives L_max = 1, raised to the 2 slots (one waiting per
    // slot), and a 25-token budget. Any box runs this model far faster.
    let srv = Server::start(&["--mu-prefill", "5", "--mu-decode", "5", "--parallel", "2"]);
    assert_eq!(srv.metric("sluice_queue_depth_max"), 2.0);
    assert_eq!(srv.metric("sluice_queued_prompt_tokens_max"), 25.0);
    for i in 0..6 {
        let r = srv.post(
            "/v1/completions",
            // Each prompt new from its first token: prefilled whole, not taken
            // from the prefix cache, so that prefill is measured.
            &json!({"prompt": format!("Request {i}.\n{}", long_prompt(20 + i)), "max_tokens": 64, "ignore_eos": true, "temperature": 0}),
        );
        assert_eq!(r.status, 200);
    }
    // Whatever the box's speed: the published rates are no longer the ones it
    // was told (5 tok/s, slower than any box runs this model), and the bounds
    // are derived from what is published.
    let prefill = || srv.metric("sluice_mu_prefill_tokens_per_second");
    let decode = || srv.metric("sluice_mu_decode_tokens_per_second");
    wait_until(
        Duration::from_secs(300),
        "the engine to publish the rates it measured",
        || prefill() > 5.0 && decode() > 5.0,
    );
    let w = srv.metric("sluice_queue_wait_budget_seconds");
    let budget = srv.metric("sluice_queued_prompt_tokens_max");
    assert!(
        (budget - (prefill() * w).floor()).abs() <= 1.0,
        "token budget {budget} = mu_prefill {} x W_max {w}",
        prefill()
    );
    let mu_req = srv.metric("sluice_mu_requests_per_second");
    let depth = srv.metric("sluice_queue_depth_max");
    let little = (mu_req * w).ceil().clamp(2.0, 9.0);
    assert!(
        (depth - little).abs() <= 1.0,
        "L_max {depth} = ceil(mu_req {mu_req} x W_max {w})"
    );
}

#[test]
fn a_closed_loop_within_the_slots_and_the_queue_bound_is_never_refused() {
    // Told the box does 5 tokens/s: Little's law alone gives L_max = 1, and
    // the floor of one waiting request per slot makes it 2. No budget is
    // given (no --queue-wait-ms, no --shed-target-ms), so nothing that got
    // into the queue is shed, however long it waits there. The derived token
    // budget (5 tok/s x W_max) is smaller than one prompt: it judges only a
    // request that would wait behind more than one per slot, so it refuses
    // none of these either.
    let srv = Server::start(&[
        "--parallel",
        "2",
        "--mu-prefill",
        "5",
        "--mu-decode",
        "5",
        "--mu-fixed",
    ]);
    assert_eq!(srv.metric("sluice_queue_depth_max"), 2.0);
    let prompt = |c: usize, i: usize| {
        format!("Client {c}, request {i}: count the sheep in the field, one by one, and say each number out loud, slowly, in words; then count the goats, the cows, the hens and the geese the same way.")
    };
    let budget = srv.metric("sluice_queued_prompt_tokens_max");
    let prompt_tokens = srv
        .post("/tokenize", &json!({"prompt": prompt(0, 0)}))
        .body_json()["count"]
        .as_f64()
        .expect("count");
    assert!(
        prompt_tokens > budget,
        "one prompt ({prompt_tokens} tokens) is over the budget ({budget})"
    );
    // A closed loop of slots + L_max = 4 clients, each sending its next
    // request when the last one is answered: 2 run and 2 wait, each for
    // about a whole answer of 200 tokens, over the 2.5 s sojourn target on
    // most boxes.
    let clients = 4;
    let per_client = 2;
    let peak = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (peak, done) = (Arc::clone(&peak), Arc::clone(&done));
        let addr = srv.addr;
        std::thread::spawn(move || {
            use std::sync::atomic::Ordering;
            while !done.load(Ordering::Relaxed) {
                let r = request(addr, "GET", "/metrics", None, &[]);
                let text = String::from_utf8_lossy(&r.body).into_owned();
                let depth = metric_value(&text, "sluice_queue_depth") as usize;
                peak.fetch_max(depth, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let handles: Vec<_> = (0..clients)
        .map(|c| {
            let addr = srv.addr;
            std::thread::spawn(move || {
                (0..per_client)
                    .map(|i| {
                        let body =
                            json!({"prompt": prompt(c, i), "max_tokens": 200, "ignore_eos": true});
                        let r = post_json(addr, "/v1/completions", &body);
                        (r.status, String::from_utf8_lossy(&r.body).into_owned())
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let results: Vec<(u16, String)> = handles
        .into_iter()
        .flat_map(|h| h.join().expect("client"))
        .collect();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    watcher.join().expect("watcher");
    for (status, body) in &results {
        assert_eq!(*status, 200, "{body}");
    }
    assert_eq!(results.len(), clients * per_client);
    assert_eq!(
        srv.metric("sluice_requests_rejected_total{reason=\"queue_full\"}"),
        0.0
    );
    assert_eq!(
        srv.metric("sluice_requests_rejected_total{reason=\"token_budget\"}"),
        0.0
    );
    assert_eq!(
        srv.metric("sluice_requests_dropped_total{reason=\"shed_sojourn\"}")
            + srv.metric("sluice_requests_dropped_total{reason=\"shed_ttft_budget\"}"),
        0.0
    );
    // (At a turnover a third may wait a moment for the slot just freed.)
    assert!(
        peak.load(std::sync::atomic::Ordering::Relaxed) >= 2,
        "two requests waited at once: the queue was used to its bound"
    );
    assert!(
        srv.log().contains("shedding: none at dequeue"),
        "{}",
        srv.log()
    );
}

/// A server with one slot and one queue place, both taken: the slot by a
/// long stream (dropping it frees the slot), the place by a short request
/// (its answer is the handle's).
fn a_full_queue() -> (Server, Sse, std::thread::JoinHandle<Response>) {
    let srv = Server::start(&[
        "--parallel",
        "1",
        "--queue-depth",
        "1",
        "--mu-prefill",
        "200",
        "--mu-decode",
        "150",
        "--mu-fixed",
        "--no-shed",
    ]);
    let running = occupy_a_slot(&srv);
    let queued = {
        let addr = srv.addr;
        let body = json!({"prompt": "Say hi.", "max_tokens": 2});
        std::thread::spawn(move || post_json(addr, "/v1/completions", &body))
    };
    wait_until(Duration::from_secs(120), "a request to queue", || {
        srv.metric("sluice_queue_depth") == 1.0
    });
    (srv, running, queued)
}

#[test]
fn a_full_queue_refuses_at_the_door_before_reading_or_tokenizing() {
    // One slot, one queued request: the third request finds the queue full.
    let (srv, running, queued) = a_full_queue();
    let tokenized = srv.metric("sluice_prompts_tokenized_total");
    let before_parsing = srv.metric("sluice_requests_rejected_before_parsing_total");
    let n = 20;
    for i in 0..n {
        let body = json!({"prompt": format!("Refused {i}: {}", long_prompt(20)), "max_tokens": 8});
        let path = if i % 2 == 0 {
            "/v1/completions"
        } else {
            "/v1/embeddings"
        };
        let body = if i % 2 == 0 {
            body
        } else {
            json!({"input": format!("Refused too, {i}.")})
        };
        let r = post_json(srv.addr, path, &body);
        assert_eq!(r.status, 429, "{}", String::from_utf8_lossy(&r.body));
        assert!(r.header("Retry-After").is_some());
        assert_eq!(r.body_json()["error"]["code"], "queue_full");
    }
    // A chat with a body that would not even parse is refused the same way:
    // the body was never read.
    let r = request(
        srv.addr,
        "POST",
        "/v1/chat/completions",
        Some(&b"{not json"[..]),
        &[("Content-Type", "application/json")],
    );
    assert_eq!(r.status, 429);
    assert_eq!(
        srv.metric("sluice_prompts_tokenized_total"),
        tokenized,
        "no refused prompt was tokenized"
    );
    assert_eq!(
        srv.metric("sluice_requests_rejected_before_parsing_total") - before_parsing,
        (n + 1) as f64
    );
    drop(running);
    assert_eq!(queued.join().expect("client").status, 200);
    // With room again, a request is read and tokenized as usual.
    let r = srv.post(
        "/v1/completions",
        &json!({"prompt": "Say hi.", "max_tokens": 2}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        srv.metric("sluice_prompts_tokenized_total"),
        tokenized + 1.0
    );
}

#[test]
fn a_client_that_retries_before_its_retry_after_waits_longer_and_costs_no_tokenizing() {
    use std::io::{BufRead, BufReader, Read, Write};
    let (srv, running, queued) = a_full_queue();
    let tokenized = srv.metric("sluice_prompts_tokenized_total");
    // One keep-alive connection, as the SDKs' pools keep theirs: each try
    // is sent as soon as the last answer is read, without waiting.
    let stream = std::net::TcpStream::connect(srv.addr).expect("connect");
    let mut w = stream.try_clone().expect("clone");
    let mut r = BufReader::new(stream);
    let body = json!({"prompt": "Retry me.", "max_tokens": 4}).to_string();
    // The same request again, on the kept connection.
    let send = |w: &mut std::net::TcpStream, extra: &str| {
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{extra}\r\n",
            srv.addr,
            body.len()
        );
        w.write_all(head.as_bytes()).unwrap();
        w.write_all(body.as_bytes()).unwrap();
    };
    let mut try_once = || {
        send(&mut w, "");
        let sent = std::time::Instant::now();
        let (status, headers) = sluice_bench::http::read_head(&mut r).expect("a response");
        let len: usize = headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
            .map(|(_, v)| v.parse().unwrap())
            .expect("content-length");
        let mut buf = vec![0; len];
        r.read_exact(&mut buf).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&buf).unwrap();
        let wait_ms: u64 = headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("retry-after-ms"))
            .map(|(_, v)| v.parse().unwrap())
            .expect("retry-after-ms");
        (status, v, wait_ms, sent.elapsed())
    };
    let (status, v, first_wait, _) = try_once();
    assert_eq!(status, 429, "{v}");
    assert_eq!(v["error"]["code"], "queue_full", "{v}");
    // Back at once: refused with a longer wait, and the answer held back
    // (a lower bound: a slow box only answers later).
    let (status, v, second_wait, took) = try_once();
    assert_eq!(status, 429, "{v}");
    assert_eq!(v["error"]["code"], "retried_too_soon", "{v}");
    assert!(
        second_wait > first_wait,
        "{first_wait} then {second_wait} ms"
    );
    assert!(
        took >= Duration::from_millis(second_wait / 2 - 50),
        "held {took:?}, told {second_wait} ms"
    );
    let (_, v, third_wait, _) = try_once();
    assert_eq!(v["error"]["code"], "retried_too_soon", "{v}");
    assert!(
        third_wait > second_wait,
        "{second_wait} then {third_wait} ms"
    );
    assert_eq!(srv.metric("sluice_requests_retried_early_total"), 2.0);
    assert_eq!(srv.metric("sluice_prompts_tokenized_total"), tokenized);
    // Another request from the same address is judged afresh: refused for
    // the full queue, not for the retrier's haste.
    let r2 = srv.post(
        "/v1/completions",
        &json!({"prompt": "Hi.", "max_tokens": 2}),
    );
    assert_eq!(r2.status, 429);
    assert_eq!(r2.body_json()["error"]["code"], "queue_full");
    drop(running);
    assert_eq!(queued.join().expect("client").status, 200);
    // With room again, even the hasty connection is served at once.
    let (status, _, _, _) = {
        send(&mut w, "Connection: close\r\n");
        let (status, headers) = sluice_bench::http::read_head(&mut r).expect("a response");
        (status, headers, 0, ())
    };
    assert_eq!(status, 200);
    let _ = r.fill_buf();
}

/// `long_stream` on a thread of its own, as it may wait in the queue: the
/// slot it then takes stays busy until the stream is dropped.
fn hold_a_slot_from_the_queue(addr: std::net::SocketAddr) -> std::thread::JoinHandle<Sse> {
    std::thread::spawn(move || long_stream(addr))
}

#[test]
fn once_the_door_refuses_the_queue_holds_only_what_meets_w_max() {
    // Two slots; rates and W_max such that the derived L_max is the slots'
    // floor, 2, and the pressed one 1: a typical request (128 + 128 tokens)
    // takes 12.8 + 64 s, so floor(0.013/s · (120 s − 12.8 s)) = 1. A long
    // W_max, so that the pressed bound outlasts the test on any box; no
    // shedding.
    let srv = Server::start(&[
        "--parallel",
        "2",
        "--mu-prefill",
        "10",
        "--mu-decode",
        "2",
        "--mu-fixed",
        "--queue-wait-ms",
        "120000",
        "--no-shed",
    ]);
    let depth_max = r#"sluice_class_queue_depth_max{class="interactive"}"#;
    let pressed = r#"sluice_class_queue_pressed{class="interactive"}"#;
    // Each a different request: the same body again would be an early retry.
    let refused = |srv: &Server, n: usize| {
        let r = srv.post(
            "/v1/completions",
            &json!({"prompt": format!("Say hi, {n}."), "max_tokens": 2}),
        );
        assert_eq!(r.status, 429, "{}", String::from_utf8_lossy(&r.body));
        r.body_json()["error"]["queue"]["depth_max"].clone()
    };
    let running = [occupy_a_slot(&srv), occupy_a_slot(&srv)];
    let queued = [
        hold_a_slot_from_the_queue(srv.addr),
        hold_a_slot_from_the_queue(srv.addr),
    ];
    wait_until(Duration::from_secs(120), "two requests to queue", || {
        srv.metric("sluice_queue_depth") == 2.0
    });
    // A closed loop of four clients fits: nothing was refused yet.
    assert_eq!((srv.metric(depth_max), srv.metric(pressed)), (2.0, 0.0));
    // A fifth is refused by the slots' floor, and that presses the bound.
    assert_eq!(refused(&srv, 1), 2);
    assert_eq!((srv.metric(depth_max), srv.metric(pressed)), (1.0, 1.0));
    // A slot frees, one waiting request takes it: one waits, and a newcomer,
    // which the floor would have let wait beside it, is refused.
    let [first, second] = running;
    drop(first);
    wait_until(
        Duration::from_secs(120),
        "a queued request to start",
        || srv.metric("sluice_queue_depth") == 1.0,
    );
    assert_eq!(refused(&srv, 2), 1);
    // The other slot frees, the queue empties: one may wait again.
    drop(second);
    wait_until(Duration::from_secs(120), "the queue to empty", || {
        srv.metric("sluice_queue_depth") == 0.0
    });
    let streams: Vec<Sse> = queued
        .into_iter()
        .map(|h| h.join().expect("a queued client"))
        .collect();
    let third = hold_a_slot_from_the_queue(srv.addr);
    wait_until(Duration::from_secs(120), "a request to queue", || {
        srv.metric("sluice_queue_depth") == 1.0
    });
    assert_eq!(srv.metric(pressed), 1.0);
    drop(streams);
    assert_eq!(third.join().expect("the third client").status, 200);
}
