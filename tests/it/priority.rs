//! Priority classes, per-client token buckets and API keys: interactive traffic
//! keeps its place when batch traffic floods, one client cannot spend another's
//! share, and the table of clients stays bounded.

use crate::harness::*;
use serde_json::{json, Value};
use sluice_bench::http;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Barrier};
use std::time::Duration;

const BATCH: (&str, &str) = ("X-Priority", "batch");

/// A completions body of `max_tokens` tokens that never stops early.
fn body(prompt: &str, max_tokens: usize, stream: bool) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true,
           "temperature": 0, "stream": stream})
}

/// A JSON POST with extra headers, on a new connection.
fn post(addr: SocketAddr, b: &Value, headers: &[(&str, &str)]) -> Response {
    let mut all = vec![("Content-Type", "application/json")];
    all.extend_from_slice(headers);
    request(
        addr,
        "POST",
        "/v1/completions",
        Some(b.to_string().as_bytes()),
        &all,
    )
}

/// The same, from the loopback address `from` (another client to the server).
fn post_from(addr: SocketAddr, from: Ipv4Addr, b: &Value) -> Response {
    post_from_with(addr, from, b, &[])
}

fn post_from_with(
    addr: SocketAddr,
    from: Ipv4Addr,
    b: &Value,
    headers: &[(&str, &str)],
) -> Response {
    let s = http::connect_from(addr, IpAddr::V4(from), Duration::from_secs(60)).expect("connect");
    let mut all = vec![("Content-Type", "application/json")];
    all.extend_from_slice(headers);
    http::request_on(
        s,
        "POST",
        "/v1/completions",
        Some(b.to_string().as_bytes()),
        &all,
    )
    .expect("request")
}

/// A stream with extra headers; its first token is read before it returns.
fn stream(addr: SocketAddr, b: &Value, headers: &[(&str, &str)]) -> http::Sse {
    let s = http::connect(addr, Duration::from_secs(600)).expect("connect");
    let mut sse = http::Sse::open_with(s, "/v1/completions", b.to_string().as_bytes(), headers)
        .expect("open stream");
    assert_eq!(sse.status, 200);
    assert!(sse.next_json().expect("event").is_some(), "a first token");
    sse
}

fn class_metric(srv: &Server, class: &str, outcome: &str) -> f64 {
    srv.metric(&format!(
        "sluice_class_requests_total{{class=\"{class}\",outcome=\"{outcome}\"}}"
    ))
}

#[test]
fn an_interactive_request_starts_before_batch_requests_queued_ahead_of_it() {
    // One slot, no reservation: the interactive request must win the slot that
    // frees, over three batch requests that queued before it.
    let srv = Server::start(&[
        "--parallel",
        "1",
        "--interactive-slots",
        "0",
        "--queue-depth",
        "3",
        "--no-shed",
    ]);
    let addr = srv.addr;
    let running = stream(addr, &body("Count on.", 4000, true), &[BATCH]);
    let queued: Vec<_> = (0..3)
        .map(|i| {
            let b = body(&format!("Batch job {i}."), 20, false);
            let h = std::thread::spawn(move || post(addr, &b, &[BATCH]));
            wait_until(Duration::from_secs(120), "a batch request queued", || {
                srv.metric("sluice_class_queue_depth{class=\"batch\"}") == (i + 1) as f64
            });
            h
        })
        .collect();
    let full = post(addr, &body("One too many.", 20, false), &[BATCH]);
    assert_eq!(full.status, 429, "the batch queue is full");
    let v = full.body_json();
    assert_eq!(v["error"]["code"], "queue_full");
    assert_eq!(v["error"]["queue"]["class"], "batch");

    // The interactive request is admitted into a full box, and waits.
    let interactive = std::thread::spawn(move || {
        let s = http::connect(addr, Duration::from_secs(600)).expect("connect");
        let mut sse = http::Sse::open_with(
            s,
            "/v1/completions",
            body("Hello.", 30, true).to_string().as_bytes(),
            &[],
        )
        .expect("open");
        let first = sse.next_json().expect("event").is_some();
        (sse.status, first, sse)
    });
    wait_until(
        Duration::from_secs(120),
        "the interactive request queued",
        || srv.metric("sluice_class_queue_depth{class=\"interactive\"}") == 1.0,
    );
    assert_eq!(class_metric(&srv, "batch", "started"), 1.0);
    drop(running); // the slot frees
    let (status, first, mut sse) = interactive.join().expect("client");
    assert_eq!((status, first), (200, true));
    assert_eq!(
        class_metric(&srv, "batch", "started"),
        1.0,
        "no batch request queued ahead of it started before its first token"
    );
    assert_eq!(class_metric(&srv, "interactive", "started"), 1.0);
    while sse.next_json().expect("event").is_some() {}
    for h in queued {
        assert_eq!(h.join().expect("client").status, 200, "batch still runs");
    }
    assert_eq!(class_metric(&srv, "batch", "completed"), 3.0);
    assert_eq!(class_metric(&srv, "interactive", "completed"), 1.0);
}

#[test]
fn with_batch_work_on_every_slot_it_may_use_an_interactive_request_starts_at_once() {
    // Two slots, one kept for interactive requests (the default reservation).
    let srv = Server::start(&["--parallel", "2", "--queue-depth", "2", "--no-shed"]);
    let addr = srv.addr;
    let _running = stream(addr, &body("Count on.", 4000, true), &[BATCH]);
    let queued: Vec<_> = (0..2)
        .map(|i| {
            let b = body(&format!("Batch job {i}."), 20, false);
            std::thread::spawn(move || post(addr, &b, &[BATCH]))
        })
        .collect();
    wait_until(
        Duration::from_secs(120),
        "two batch requests queued",
        || srv.metric("sluice_class_queue_depth{class=\"batch\"}") == 2.0,
    );
    assert_eq!(
        srv.metric("sluice_sequences_active"),
        1.0,
        "batch waits although a slot is free: it is not batch's"
    );
    let r = post(
        addr,
        &body("Hello.", 10, false),
        &[("X-Priority", "interactive")],
    );
    assert_eq!(r.status, 200);
    assert_eq!(class_metric(&srv, "batch", "started"), 1.0);
    assert_eq!(class_metric(&srv, "interactive", "completed"), 1.0);
    drop(_running);
    for h in queued {
        assert_eq!(h.join().expect("client").status, 200);
    }
    let bad = post(
        addr,
        &body("Hello.", 10, false),
        &[("X-Priority", "urgent")],
    );
    assert_eq!(bad.status, 400);
    assert_eq!(bad.body_json()["error"]["param"], "X-Priority");
}

#[test]
fn a_flood_of_batch_requests_is_refused_while_interactive_requests_are_all_admitted() {
    let srv = Server::start(&["--parallel", "2", "--queue-depth", "2", "--no-shed"]);
    let addr = srv.addr;
    let n = 20;
    let barrier = Arc::new(Barrier::new(n));
    let flood: Vec<_> = (0..n)
        .map(|i| {
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                // Long enough that none of the admitted finishes during the burst.
                let b = body(&format!("Batch job {i}: count."), 150, false);
                barrier.wait();
                post(addr, &b, &[BATCH])
            })
        })
        .collect();
    wait_until(Duration::from_secs(120), "the batch queue filled", || {
        srv.metric("sluice_class_queue_depth{class=\"batch\"}") == 2.0
    });
    // Interactive requests, one at a time, while the batch requests run and wait.
    for i in 0..5 {
        let r = post(addr, &body(&format!("Question {i}."), 8, false), &[]);
        assert_eq!(r.status, 200, "interactive request {i}: {}", r.body_json());
    }
    let flood: Vec<Response> = flood
        .into_iter()
        .map(|h| h.join().expect("client"))
        .collect();
    let ok = flood.iter().filter(|r| r.status == 200).count();
    let refused: Vec<&Response> = flood.iter().filter(|r| r.status == 429).collect();
    assert_eq!(ok, 3, "one batch slot + two queued");
    assert_eq!(refused.len(), n - 3);
    for r in refused {
        let v = r.body_json();
        assert_eq!(v["error"]["code"], "queue_full", "{v}");
        assert_eq!(v["error"]["queue"]["class"], "batch");
        assert!(r.header("Retry-After").is_some());
    }
    assert_eq!(
        class_metric(&srv, "batch", "rejected_queue_full"),
        (n - 3) as f64
    );
    assert_eq!(class_metric(&srv, "interactive", "admitted"), 5.0);
    assert_eq!(
        class_metric(&srv, "interactive", "rejected_queue_full"),
        0.0
    );
    assert_eq!(class_metric(&srv, "interactive", "completed"), 5.0);
}

#[test]
fn a_client_over_its_bucket_gets_429_while_another_client_is_served() {
    // 1 token of work per second, 300 in the bucket.
    let srv = Server::start(&["--client-rate", "1", "--client-burst", "300"]);
    let a = Ipv4Addr::new(127, 0, 0, 1);
    let b = Ipv4Addr::new(127, 0, 0, 2);
    let r = post_from(srv.addr, a, &body("Tell me a story.", 250, false));
    assert_eq!(r.status, 200, "the first request fits the bucket");
    assert_eq!(r.body_json()["usage"]["completion_tokens"], 250);

    let again = post_from(srv.addr, a, &body("Tell me a story.", 250, false));
    assert_eq!(again.status, 429);
    let v = again.body_json();
    assert_eq!(v["error"]["code"], "rate_limit_exceeded", "{v}");
    assert_eq!(v["error"]["type"], "rate_limit_error");
    let wait_ms: u64 = again
        .header("retry-after-ms")
        .expect("retry-after-ms")
        .parse()
        .expect("ms");
    let wait = v["error"]["rate_limit"]["retry_after_s"].as_u64().unwrap();
    assert!(
        (wait * 500..=wait * 1500).contains(&wait_ms),
        "{wait_ms} ms, {v}"
    );
    let cost = v["error"]["rate_limit"]["cost_tokens"].as_u64().unwrap();
    let available = v["error"]["rate_limit"]["available_tokens"]
        .as_u64()
        .unwrap();
    assert!(cost > 250 && available < cost, "{v}");
    assert_eq!(
        wait,
        cost - available,
        "the refill time of what is missing, at 1 token/s (rounded up)"
    );
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("not server overload"));

    let other = post_from(srv.addr, b, &body("Tell me a story.", 250, false));
    assert_eq!(other.status, 200, "another client has its own bucket");

    let never = post_from(srv.addr, b, &body("Tell me a story.", 400, false));
    assert_eq!(never.status, 429, "more than the bucket ever holds");
    assert_eq!(never.body_json()["error"]["code"], "rate_limit_exceeded");
    assert!(never.header("Retry-After").is_none(), "no wait helps");
    assert_eq!(
        never.header("x-should-retry"),
        Some("false"),
        "no retry helps"
    );

    assert_eq!(class_metric(&srv, "interactive", "rate_limited"), 2.0);
    assert_eq!(srv.metric("sluice_rate_limited_clients"), 2.0);
    assert_eq!(
        srv.metric("sluice_requests_rejected_total{reason=\"queue_full\"}"),
        0.0,
        "counted apart from overload"
    );
}

#[test]
fn ten_thousand_client_addresses_do_not_grow_the_bucket_table_past_its_bound() {
    let srv = Server::start(&[
        "--parallel",
        "1",
        "--queue-depth",
        "2",
        "--no-shed",
        "--client-rate",
        "1",
        "--client-burst",
        "6000",
        "--client-table-max",
        "100",
    ]);
    let addr = srv.addr;
    // 127.0.0.1 takes the slot and a queue place: it owes about 4,000 tokens
    // of work. One queue place stays free, so that the others pass the door
    // (a full queue refuses before any bucket is touched); each asks for two
    // choices, which need two places together, so each is refused by the
    // gate after its bucket was charged. (The queued request asks one token:
    // it runs when the stream is dropped at the end.)
    let _running = stream(addr, &body("Count on.", 4000, true), &[]);
    let filler = std::thread::spawn(move || post(addr, &body("Wait.", 1, false), &[]));
    wait_until(Duration::from_secs(120), "the queue filled", || {
        srv.metric("sluice_queue_depth") == 1.0
    });
    // 10,000 other clients: each is charged, refused by the queue bound, and
    // refunded; each takes a place in the table while it is asked.
    let long = "Hi there. ".repeat(20);
    let threads = 4;
    let per = 2500;
    let clients: Vec<_> = (0..threads)
        .map(|t| {
            let long = long.clone();
            std::thread::spawn(move || {
                for i in 0..per {
                    let n = (t * per + i) as u32;
                    let from = Ipv4Addr::from(0x7f01_0001 + n);
                    let mut b = body(&long, 1, false);
                    b["n"] = json!(2);
                    let r = post_from(addr, from, &b);
                    assert_eq!(r.status, 429, "{}", String::from_utf8_lossy(&r.body));
                    assert_eq!(r.body_json()["error"]["code"], "queue_full");
                }
            })
        })
        .collect();
    for c in clients {
        c.join().expect("clients");
    }
    assert_eq!(srv.metric("sluice_rate_limit_clients_max"), 100.0);
    let kept = srv.metric("sluice_rate_limit_clients");
    assert!((2.0..=100.0).contains(&kept), "{kept} buckets");
    assert!(srv.metric("sluice_rate_limit_evictions_total") >= 9_900.0);
    // The client in debt kept its bucket: buckets that had refilled went first.
    let r = post(addr, &body("More.", 3000, false), &[]);
    assert_eq!(r.status, 429);
    assert_eq!(
        r.body_json()["error"]["code"],
        "rate_limit_exceeded",
        "its debt was not forgotten"
    );
    drop(_running);
    let _ = filler.join();
}

#[test]
fn with_an_api_key_file_a_missing_or_wrong_key_gets_401_and_a_right_one_200() {
    let dir = std::env::temp_dir().join(format!("sluice-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("keys");
    let alice = "sk-alice-5f0c2b9e7d1a4c3b8e6f";
    let tiny = "sk-tiny-0a1b2c3d4e5f6a7b8c9d";
    std::fs::write(
        &file,
        format!("# test keys\nalice {alice}\ntiny {tiny} rate=1 burst=50\n"),
    )
    .expect("write keys");
    let srv = Server::start(&["--api-key-file", file.to_str().unwrap()]);
    let hello = body("Hello.", 5, false);

    let none = post(srv.addr, &hello, &[]);
    assert_eq!(none.status, 401);
    assert_eq!(none.body_json()["error"]["code"], "invalid_api_key");
    assert!(none.header("WWW-Authenticate").is_some());
    let wrong = format!("Bearer {}x", &alice[..alice.len() - 1]);
    let r = post(srv.addr, &hello, &[("Authorization", &wrong)]);
    assert_eq!(r.status, 401, "one byte off");
    let r = post(srv.addr, &hello, &[("Authorization", "Bearer sk-alice")]);
    assert_eq!(r.status, 401, "a prefix");
    let right = format!("Bearer {alice}");
    let r = post(srv.addr, &hello, &[("Authorization", &right)]);
    assert_eq!(r.status, 200, "{}", r.body_json());

    let models = request(srv.addr, "GET", "/v1/models", None, &[]);
    assert_eq!(models.status, 401);
    let models = request(
        srv.addr,
        "GET",
        "/v1/models",
        None,
        &[("Authorization", &right)],
    );
    assert_eq!(models.status, 200);
    let ready = request(srv.addr, "GET", "/readyz", None, &[]);
    assert_eq!(ready.status, 200, "health checks need no key");

    // A key's own limit: 50 tokens of work.
    let small = format!("Bearer {tiny}");
    let r = post(
        srv.addr,
        &body("Hello.", 60, false),
        &[("Authorization", &small)],
    );
    assert_eq!(r.status, 429);
    assert_eq!(r.body_json()["error"]["code"], "rate_limit_exceeded");
    let r = post(srv.addr, &hello, &[("Authorization", &small)]);
    assert_eq!(r.status, 200);

    assert_eq!(srv.metric("sluice_unauthorized_total"), 4.0);
    let log = srv.log();
    assert!(
        !log.contains(alice) && !log.contains(tiny),
        "keys are never logged"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_batch_request_waiting_for_kv_cells_does_not_hold_up_interactive_ones() {
    // 3 slots, 2 for batch, which may reserve 8192 - 8192/3 = 5462 KV cells.
    // With --batch-every 1 the picker offers every free slot to a waiting batch
    // request first; the second batch request does not fit the batch share
    // (5,300 + 300 cells and two prompts' are over it; the second asks few
    // tokens, since it runs to its end once the first is dropped).
    let srv = Server::start(&["--parallel", "3", "--batch-every", "1", "--no-shed"]);
    let addr = srv.addr;
    let _running = stream(addr, &body("Count on.", 5300, true), &[BATCH]);
    let blocked = std::thread::spawn(move || post(addr, &body("Count on.", 300, false), &[BATCH]));
    wait_until(
        Duration::from_secs(120),
        "the second batch request queued",
        || srv.metric("sluice_class_queue_depth{class=\"batch\"}") == 1.0,
    );
    assert!(srv.metric("sluice_kv_cells_reserved") >= 5300.0);
    for i in 0..2 {
        let r = post(addr, &body(&format!("Question {i}."), 8, false), &[]);
        assert_eq!(r.status, 200);
    }
    assert_eq!(
        class_metric(&srv, "batch", "started"),
        1.0,
        "the batch request still waits for KV cells"
    );
    assert_eq!(class_metric(&srv, "interactive", "completed"), 2.0);
    drop(_running);
    assert_eq!(blocked.join().expect("client").status, 200);
}

#[test]
fn behind_a_trusted_proxy_the_forwarded_address_is_the_client() {
    let srv = Server::start(&[
        "--client-rate",
        "1",
        "--client-burst",
        "100",
        "--trusted-proxies",
        "127.0.0.1",
    ]);
    let proxy = Ipv4Addr::new(127, 0, 0, 1);
    let b = body("Hi", 80, false);
    let from = |peer, xff| post_from_with(srv.addr, peer, &b, &[("X-Forwarded-For", xff)]);
    assert_eq!(from(proxy, "10.0.0.1").status, 200);
    let r = from(proxy, "10.0.0.1");
    assert_eq!(r.status, 429, "the same forwarded client");
    assert_eq!(r.body_json()["error"]["code"], "rate_limit_exceeded");
    assert_eq!(
        from(proxy, "10.0.0.2").status,
        200,
        "another forwarded client"
    );
    assert_eq!(
        from(proxy, "6.6.6.6, 10.0.0.2").status,
        429,
        "the proxy's entry is the last one; the client's own claims do not count"
    );
    assert_eq!(
        from(Ipv4Addr::new(127, 0, 0, 2), "10.0.0.2").status,
        200,
        "an untrusted peer's X-Forwarded-For is ignored: it is its own client"
    );
}
