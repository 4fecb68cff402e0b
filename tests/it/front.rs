//! The front door says no too: a bound on connections, deadlines a trickling
//! client cannot stretch, one request in flight per connection, strict
//! framing with lingering closes, handlers that survive a panic, and only the
//! callers it should serve (Host, Origin, Content-Type).

use crate::harness::*;
use serde_json::json;
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn chat_completes(addr: SocketAddr) {
    let r = post_json(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}

/// Writes `bytes` on a new connection, then reads until the server closes it.
fn exchange(addr: SocketAddr, bytes: &[u8]) -> String {
    let mut s = connect(addr);
    s.write_all(bytes).expect("send");
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => break,
            Err(e) => panic!("reading the answer: {e}"),
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Status codes of the responses in `text`, in order.
fn statuses(text: &str) -> Vec<u16> {
    text.match_indices("HTTP/1.1 ")
        .filter_map(|(i, _)| text[i + 9..].get(..3)?.parse().ok())
        .collect()
}

fn threads_of(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("/proc task")
        .count()
}

#[test]
fn a_pipelining_client_that_never_reads_holds_only_its_own_connection() {
    let srv = Server::start(&["--stall-timeout-ms", "1000"]);
    // 200 requests for an 8,000-byte path, pipelined, never read: the 404s
    // name the path, so their answers fill both sides' socket buffers.
    let mut pipeliner = connect(srv.addr);
    let one = format!(
        "GET /{} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        "a".repeat(8000)
    );
    pipeliner
        .write_all(one.repeat(200).as_bytes())
        .expect("pipeline");
    // Meanwhile everyone else is served.
    assert_eq!(request(srv.addr, "GET", "/livez", None, &[]).status, 200);
    chat_completes(srv.addr);
    // The server gives up on the pipeliner's connection (its answer is not
    // read within the write deadline) and closes it; no handler stays on it.
    wait_until(
        Duration::from_secs(120),
        "the pipeliner's connection to be closed",
        || {
            srv.metric("sluice_http_write_failures_total") >= 1.0
                && srv.metric("sluice_http_connections") <= 1.0
                && srv.metric("sluice_http_handlers_busy") == 0.0
        },
    );
    // Only a few of its 200 requests were ever answered: one at a time.
    let answered = srv.log().matches("GET /aaaa").count();
    assert!(
        answered < 200,
        "{answered} of the pipelined requests were handled"
    );
    // Its connection is closed: reading finds the end of it.
    pipeliner
        .set_read_timeout(Some(Duration::from_secs(600)))
        .expect("timeout");
    let mut sink = Vec::new();
    let ended = match pipeliner.read_to_end(&mut sink) {
        Ok(_) => true,
        Err(e) => e.kind() == ErrorKind::ConnectionReset,
    };
    assert!(ended, "the pipeliner's connection is closed");
    chat_completes(srv.addr);
}

/// The soft limit on this process's open files raised to the hard one (with
/// prlimit(1) on our own pid: no unsafe code); returns it.
fn raise_own_nofile() -> usize {
    let pid = std::process::id().to_string();
    let out = Command::new("prlimit")
        .args([
            "--pid",
            &pid,
            "--nofile",
            "--raw",
            "--noheadings",
            "-o",
            "HARD",
        ])
        .output()
        .expect("prlimit");
    let hard = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let ok = Command::new("prlimit")
        .args(["--pid", &pid, &format!("--nofile={hard}:{hard}")])
        .status()
        .expect("prlimit");
    assert!(ok.success(), "raise the open-files limit to {hard}");
    hard.parse().unwrap_or(1024)
}

/// The accept queue of the socket listening on `port`, as the kernel holds
/// it (`ss`: a listening socket's Send-Q is its backlog).
fn listen_backlog(port: u16) -> u32 {
    let out = Command::new("ss")
        .args(["-ltnH", &format!("sport = :{port}")])
        .output()
        .expect("run ss (iproute2)");
    let text = String::from_utf8_lossy(&out.stdout);
    let fields: Vec<&str> = text.split_whitespace().collect();
    assert_eq!(fields.first(), Some(&"LISTEN"), "ss: {text}");
    fields[2].parse().expect("Send-Q")
}

#[test]
fn ten_thousand_trickling_connections_stay_within_the_bound() {
    let nofile = raise_own_nofile();
    let n = 10_000.min(nofile.saturating_sub(200));
    assert!(n >= 2_000, "this box allows only {nofile} open files");
    const BOUND: usize = 256;
    let srv = Server::start(&["--max-connections", "256", "--header-timeout-ms", "5000"]);
    chat_completes(srv.addr);
    // A flood of connects waits in the kernel's queue for the accept loop
    // instead of having its SYNs dropped (each a second's retransmit): the
    // queue is 1,024 deep, not the 128 Rust's `bind` asks for.
    let somaxconn: u32 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .expect("somaxconn")
        .trim()
        .parse()
        .expect("somaxconn is a number");
    assert_eq!(listen_backlog(srv.addr.port()), 1024.min(somaxconn));
    let pid = srv.pid();
    let threads_before = threads_of(pid);
    let rss_before = rss_kb(pid);
    let mut threads_max = threads_before;
    let mut rss_max = rss_before;
    let sample = |threads_max: &mut usize, rss_max: &mut u64| {
        *threads_max = (*threads_max).max(threads_of(pid));
        *rss_max = (*rss_max).max(rss_kb(pid));
    };
    // Each connection sends its first header byte, then one more each round.
    let mut conns: Vec<Option<TcpStream>> = Vec::with_capacity(n);
    for i in 0..n {
        let mut s = connect(srv.addr);
        let _ = s.write_all(b"G");
        s.set_nonblocking(true).expect("nonblocking");
        conns.push(Some(s));
        if i % 250 == 0 {
            sample(&mut threads_max, &mut rss_max);
        }
    }
    // Service goes on: a new connection takes the place of the trickler that
    // has waited longest.
    chat_completes(srv.addr);
    sample(&mut threads_max, &mut rss_max);
    let head = b"ET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ";
    let mut answers = [0usize; 3]; // 408, 503, closed without an answer
    let mut round = 0;
    let mut buf = [0u8; 512];
    let started = Instant::now();
    while conns.iter().any(Option::is_some) {
        assert!(
            started.elapsed() < Duration::from_secs(900),
            "tricklers still open after 900 s"
        );
        for slot in conns.iter_mut() {
            let Some(s) = slot.as_mut() else { continue };
            let byte = head.get(round).copied().unwrap_or(b'x');
            let _ = s.write(&[byte]);
            let mut got = Vec::new();
            let closed = loop {
                match s.read(&mut buf) {
                    Ok(0) => break true,
                    Ok(k) => got.extend_from_slice(&buf[..k]),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break false,
                    Err(_) => break true,
                }
            };
            if closed {
                let text = String::from_utf8_lossy(&got);
                match statuses(&text).first() {
                    Some(408) => answers[0] += 1,
                    Some(503) => answers[1] += 1,
                    None => answers[2] += 1,
                    Some(other) => panic!("a trickler got {other}: {text}"),
                }
                *slot = None;
            }
        }
        round += 1;
        sample(&mut threads_max, &mut rss_max);
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "{n} tricklers: {} got 408, {} got 503, {} closed without an answer; threads {threads_before} -> at most {threads_max}; RSS {rss_before} -> at most {rss_max} kB",
        answers[0], answers[1], answers[2]
    );
    // Threads: the bound, plus the pool's few idle ones.
    assert!(
        threads_max <= threads_before + BOUND + 8,
        "{threads_max} threads (from {threads_before}) for a bound of {BOUND}"
    );
    let grown_mb = rss_max.saturating_sub(rss_before) / 1024;
    assert!(
        grown_mb < 64,
        "RSS grew by {grown_mb} MB for {BOUND} connections"
    );
    // Every trickler was closed: for room at the bound, refused there, or by
    // the header deadline.
    let evicted = srv.metric("sluice_http_connections_evicted_total");
    let refused = srv.metric("sluice_http_refused_total{reason=\"connections_full\"}");
    let timed_out = srv.metric("sluice_http_refused_total{reason=\"timed_out\"}");
    assert!(
        evicted + refused + timed_out >= n as f64,
        "{evicted} evicted + {refused} refused + {timed_out} timed out of {n}"
    );
    assert!(evicted + refused >= (n - BOUND) as f64 - timed_out);
    assert!(timed_out >= 1.0);
    chat_completes(srv.addr);
}

#[test]
fn a_16_mib_body_sent_in_one_write_then_read_gets_its_413() {
    let srv = Server::start(&[]);
    let size = 16 << 20;
    let mut bytes = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
    )
    .into_bytes();
    bytes.resize(bytes.len() + size, b'x');
    let text = exchange(srv.addr, &bytes);
    assert_eq!(statuses(&text), vec![413], "{text}");
    assert!(text.contains("Connection: close"), "{text}");
    assert!(text.contains("body_too_large"), "{text}");
    chat_completes(srv.addr);
}

#[test]
fn malformed_framing_gets_one_answer_and_a_closed_connection() {
    let srv = Server::start(&["--max-body-bytes", "1024"]);
    let post =
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n";
    let hidden = "POST /v1/completions?hidden=1 HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 33\r\n\r\n{\"prompt\":\"hidden\",\"max_tokens\":1}";
    let mut over_cap = hidden.to_string();
    over_cap.push_str(&" ".repeat(2000));
    let cases: Vec<(&str, String, u16)> = vec![
        (
            "duplicate CL",
            format!("{post}Content-Length: 2\r\nContent-Length: 2\r\n\r\n{{}}"),
            400,
        ),
        ("CL +5", format!("{post}Content-Length: +2\r\n\r\n{{}}"), 400),
        (
            "CL overflow",
            format!("{post}Content-Length: 184467440737095516160\r\n\r\n{{}}"),
            400,
        ),
        (
            "TE gzip",
            format!("{post}Transfer-Encoding: gzip\r\n\r\n2\r\n{{}}\r\n0\r\n\r\n"),
            400,
        ),
        (
            "TE and CL",
            format!("{post}Transfer-Encoding: chunked\r\nContent-Length: 7\r\n\r\n2\r\n{{}}\r\n0\r\n\r\n"),
            400,
        ),
        (
            "bare LF",
            "GET /livez HTTP/1.1\nHost: 127.0.0.1\n\n".to_string(),
            400,
        ),
        (
            "chunk size overflow",
            format!("{post}Transfer-Encoding: chunked\r\n\r\nfffffffffffffffffff\r\n{{}}\r\n0\r\n\r\n"),
            400,
        ),
        (
            "a request hidden in an over-cap body",
            format!("{post}Content-Length: {}\r\n\r\n{over_cap}", over_cap.len()),
            413,
        ),
    ];
    for (i, (name, bytes, status)) in cases.iter().enumerate() {
        // A valid request right behind it: never read, since the connection
        // is closed after the refusal.
        let behind = format!("GET /after-{i} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
        let text = exchange(srv.addr, format!("{bytes}{behind}").as_bytes());
        assert_eq!(statuses(&text), vec![*status], "{name}: {text}");
        assert!(text.contains("Connection: close"), "{name}: {text}");
    }
    // The log names every request a handler served; a control request shows
    // that it would name these.
    let text = exchange(
        srv.addr,
        b"GET /after-control HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(statuses(&text), vec![404]);
    wait_until(
        Duration::from_secs(120),
        "the control request's log line",
        || srv.log().contains("/after-control"),
    );
    let log = srv.log();
    for i in 0..cases.len() {
        assert!(
            !log.contains(&format!("/after-{i} ")),
            "request {i} behind a refusal was served:\n{log}"
        );
    }
    assert!(
        !log.contains("hidden"),
        "the hidden request was served:\n{log}"
    );
    assert_eq!(srv.metric("sluice_requests_accepted_total"), 0.0);
    assert_eq!(
        srv.metric("sluice_http_refused_total{reason=\"malformed\"}"),
        7.0
    );
    assert_eq!(
        srv.metric("sluice_http_refused_total{reason=\"body_too_large\"}"),
        1.0
    );
    chat_completes(srv.addr);
}

#[test]
fn a_handler_panic_is_answered_500_counted_and_the_handlers_go_on() {
    let srv = Server::start_with_env(&[], &[("SLUICE_TEST_HOOKS", "panic")]);
    let handlers = srv.metric("sluice_http_threads") as usize;
    // More panics than there are handlers: each handler must outlive its own.
    for _ in 0..handlers + 4 {
        let r = request(
            srv.addr,
            "GET",
            "/livez",
            None,
            &[("X-Sluice-Test-Panic", "1")],
        );
        assert_eq!(r.status, 500);
    }
    // The 500 goes out while the panic unwinds, before its handler counts
    // it: the count may trail the last answer for a moment.
    wait_until(Duration::from_secs(120), "every panic counted", || {
        srv.metric("sluice_http_handler_panics_total") >= (handlers + 4) as f64
    });
    assert_eq!(
        srv.metric("sluice_http_handler_panics_total"),
        (handlers + 4) as f64
    );
    for _ in 0..100 {
        assert_eq!(request(srv.addr, "GET", "/livez", None, &[]).status, 200);
    }
    chat_completes(srv.addr);
    // (The chat's handler may still be logging after its answer went out.)
    wait_until(Duration::from_secs(120), "no handler busy", || {
        srv.metric("sluice_http_handlers_busy") == 0.0
    });
}

#[test]
fn logging_to_a_closed_stderr_stops_no_handler() {
    let mut child = Command::new(binary())
        .args(["serve", "--port", "0", "--model"])
        .arg(model_path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn sluice");
    let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
    let addr: SocketAddr = loop {
        let line = lines
            .next()
            .expect("sluice said where it listens")
            .expect("log");
        if let Some(a) = line.strip_prefix("sluice: listening on http://") {
            break a.trim().parse().expect("address");
        }
    };
    // Nobody reads its stderr any more: every log line now fails to write.
    drop(lines);
    for i in 0..100 {
        let path = format!("/logged-{i}");
        assert_eq!(request(addr, "GET", &path, None, &[]).status, 404);
    }
    chat_completes(addr);
    assert_eq!(request(addr, "GET", "/livez", None, &[]).status, 200);
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn only_allowed_hosts_and_origins_are_served() {
    let srv = Server::start(&["--allowed-origins", "http://app.example:3000"]);
    let body = r#"{"prompt":"Hello","max_tokens":2}"#;
    let post = |extra: &str| {
        format!(
            "POST /v1/completions HTTP/1.1\r\n{extra}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    };
    let cases = [
        (
            "a rebinding Host",
            post("Host: attacker.example:8080\r\nContent-Type: application/json\r\n"),
            403,
            "forbidden_host",
        ),
        (
            "a foreign Origin",
            post("Host: 127.0.0.1\r\nOrigin: http://evil.example\r\nContent-Type: application/json\r\n"),
            403,
            "forbidden_origin",
        ),
        (
            "a foreign Origin, no Content-Type (no preflight needed)",
            post("Host: 127.0.0.1\r\nOrigin: http://evil.example\r\n"),
            403,
            "forbidden_origin",
        ),
        (
            "text/plain",
            post("Host: 127.0.0.1\r\nContent-Type: text/plain\r\n"),
            415,
            "unsupported_media_type",
        ),
        (
            "no Content-Type",
            post("Host: 127.0.0.1\r\n"),
            415,
            "unsupported_media_type",
        ),
    ];
    for (name, bytes, status, code) in &cases {
        let text = exchange(srv.addr, bytes.as_bytes());
        assert_eq!(statuses(&text), vec![*status], "{name}: {text}");
        assert!(text.contains(code), "{name}: {text}");
        assert!(
            !text.contains("Access-Control-Allow-Origin"),
            "{name}: {text}"
        );
    }
    // None of them generated anything, and each is in the log.
    assert_eq!(srv.metric("sluice_requests_accepted_total"), 0.0);
    assert_eq!(srv.metric("sluice_prompt_tokens_total"), 0.0);
    assert_eq!(
        srv.metric("sluice_requests_rejected_total{reason=\"forbidden\"}"),
        3.0
    );
    wait_until(Duration::from_secs(120), "the refusals' log lines", || {
        let log = srv.log();
        log.matches(" 403 forbidden_").count() == 3 && log.matches(" 415 ").count() == 2
    });

    // The allowed origin: its preflight, then its request, with CORS headers.
    let preflight = exchange(
        srv.addr,
        b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://app.example:3000\r\n\
          Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: content-type, authorization\r\n\
          Connection: close\r\n\r\n",
    );
    assert_eq!(statuses(&preflight), vec![204], "{preflight}");
    for h in [
        "Access-Control-Allow-Origin: http://app.example:3000",
        "Access-Control-Allow-Methods: GET, POST, DELETE, OPTIONS",
        "Access-Control-Allow-Headers: content-type, authorization",
        "Vary: Origin",
    ] {
        assert!(preflight.contains(h), "{h}: {preflight}");
    }
    let allowed =
        "Host: 127.0.0.1\r\nOrigin: http://app.example:3000\r\nContent-Type: application/json\r\n";
    let text = exchange(srv.addr, post(allowed).as_bytes());
    assert_eq!(statuses(&text), vec![200], "{text}");
    assert!(
        text.contains("Access-Control-Allow-Origin: http://app.example:3000"),
        "{text}"
    );
    let stream_body = r#"{"prompt":"Hello","max_tokens":2,"stream":true}"#;
    let text = exchange(
        srv.addr,
        format!(
            "POST /v1/completions HTTP/1.1\r\n{allowed}Content-Length: {}\r\nConnection: close\r\n\r\n{stream_body}",
            stream_body.len()
        )
        .as_bytes(),
    );
    assert_eq!(statuses(&text), vec![200], "{text}");
    assert!(
        text.contains("Access-Control-Allow-Origin: http://app.example:3000"),
        "{text}"
    );
    assert!(text.contains("data: [DONE]"), "{text}");
    // The server's own origin (a page it served) needs no CORS, and
    // localhost is always a name it answers to.
    let own =
        post("Host: localhost\r\nOrigin: http://localhost\r\nContent-Type: application/json\r\n");
    let text = exchange(srv.addr, own.as_bytes());
    assert_eq!(statuses(&text), vec![200], "{text}");
    assert!(!text.contains("Access-Control-Allow-Origin"), "{text}");
}

#[test]
fn a_kept_alive_connection_carries_request_after_request() {
    let srv = Server::start(&[]);
    let mut s = connect(srv.addr);
    let body = r#"{"prompt":"Hello","max_tokens":2}"#;
    let one = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let stream_body = r#"{"prompt":"Hello","max_tokens":2,"stream":true}"#;
    let streamed = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{stream_body}",
        stream_body.len()
    );
    // Pipelined: a plain answer, a stream, a plain answer, then close.
    let last = "GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    s.write_all(format!("{one}{streamed}{one}{last}").as_bytes())
        .expect("send");
    let mut all = Vec::new();
    s.read_to_end(&mut all).expect("answers");
    let text = String::from_utf8_lossy(&all);
    assert_eq!(statuses(&text), vec![200, 200, 200, 200], "{text}");
    assert_eq!(text.matches("data: [DONE]").count(), 1, "{text}");
    // Only the scrape's own connection is left.
    wait_until(Duration::from_secs(120), "the connection to close", || {
        srv.metric("sluice_http_connections") == 1.0
    });
}

/// Sends a request that holds its handler until this connection closes.
fn hold(addr: SocketAddr) -> TcpStream {
    let mut s = connect(addr);
    s.write_all(b"GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Sluice-Test-Hold: 1\r\n\r\n")
        .expect("send");
    s
}

#[test]
fn a_full_handler_queue_answers_503_from_the_connection_at_once() {
    // 1 slot + 1 queued per class + 1 for /health: 4 handlers, the fewest.
    let srv = Server::start_with_env(
        &[
            "--parallel",
            "1",
            "--queue-depth",
            "1",
            "--http-threads",
            "4",
            "--http-queue-depth",
            "1",
        ],
        &[("SLUICE_TEST_HOOKS", "hold")],
    );
    // Every handler held (each says so in the log; nothing could scrape).
    let held: Vec<TcpStream> = (0..4).map(|_| hold(srv.addr)).collect();
    wait_until(Duration::from_secs(120), "four handlers held", || {
        srv.log().matches("a handler holds a request").count() == 4
    });
    // Two more: one fits the queue, the other gets 503 from its connection
    // at once (which is which is up to their connections' threads).
    let mut two: Vec<TcpStream> = (0..2)
        .map(|_| {
            let mut s = connect(srv.addr);
            s.write_all(b"GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                .expect("send");
            s
        })
        .collect();
    let mut first_answered = None;
    wait_until(Duration::from_secs(120), "one of the two answered", || {
        first_answered = two.iter().position(has_answer);
        first_answered.is_some()
    });
    let mut refused_conn = two.remove(first_answered.expect("answered"));
    let mut queued = two.pop().expect("the other");
    let mut refused = String::new();
    refused_conn.read_to_string(&mut refused).expect("refusal");
    assert_eq!(statuses(&refused), vec![503], "{refused}");
    assert!(
        !has_answer(&queued),
        "the queued request waits for a handler"
    );
    assert!(refused.contains("server_busy"), "{refused}");
    assert!(
        refused.contains(r#""type":"overloaded_error""#),
        "{refused}"
    );
    assert_spread_wait(&refused);
    // The held requests end when their clients leave; the queued one is served.
    drop(held);
    let mut answer = String::new();
    queued.read_to_string(&mut answer).expect("queued answer");
    assert_eq!(statuses(&answer), vec![200], "{answer}");
    assert!(srv.metric("sluice_http_refused_total{reason=\"handler_queue_full\"}") >= 1.0);
    wait_until(Duration::from_secs(120), "the handlers free", || {
        srv.metric("sluice_http_handlers_busy") == 0.0
    });
}

/// Whether bytes of an answer wait to be read on `s`.
fn has_answer(s: &TcpStream) -> bool {
    s.set_nonblocking(true).expect("nonblocking");
    let mut buf = [0u8; 1];
    let got = matches!(s.peek(&mut buf), Ok(n) if n > 0);
    s.set_nonblocking(false).expect("blocking");
    got
}

/// What became of a connection that sent nothing, read without waiting.
#[derive(Debug, PartialEq)]
enum Fate {
    Open,
    /// Closed by the server; with an answer (a refusal) or without one.
    Closed {
        answered: bool,
    },
}

fn fate(s: &mut TcpStream) -> Fate {
    s.set_nonblocking(true).expect("nonblocking");
    let mut answered = false;
    let mut buf = [0u8; 4096];
    let f = loop {
        match s.read(&mut buf) {
            Ok(0) => break Fate::Closed { answered },
            Ok(_) => answered = true,
            Err(e) if e.kind() == ErrorKind::WouldBlock => break Fate::Open,
            Err(_) => break Fate::Closed { answered },
        }
    };
    s.set_nonblocking(false).expect("blocking");
    f
}

#[test]
fn at_the_connection_bound_with_none_waiting_a_new_connection_gets_503() {
    let srv = Server::start_with_env(
        &["--max-connections", "3", "--header-timeout-ms", "600000"],
        &[("SLUICE_TEST_HOOKS", "hold")],
    );
    let livez = b"GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    // Two connections whose requests are in handlers' hands (so not waiting
    // on their client, never closed for room) and one that sends nothing.
    let held: Vec<TcpStream> = (0..2).map(|_| hold(srv.addr)).collect();
    wait_until(Duration::from_secs(120), "two handlers held", || {
        srv.metric("sluice_http_handlers_busy") == 2.0
    });
    // A new connection takes the silent one's place: it is closed for room.
    // (A connection whose thread is still ending when another arrives may
    // count for a moment: a 503 then, and the test tries again.)
    let mut idle = connect(srv.addr);
    // Every 503 this test sees is one the server counted.
    let mut refusals_seen = 0u32;
    wait_until(
        Duration::from_secs(120),
        "the silent connection closed",
        || {
            let text = exchange(srv.addr, livez);
            let first = statuses(&text).first().copied();
            assert!(matches!(first, Some(200 | 503)), "{text}");
            refusals_seen += u32::from(first == Some(503));
            match fate(&mut idle) {
                Fate::Open => false,
                Fate::Closed { answered: false } => true,
                Fate::Closed { answered: true } => {
                    idle = connect(srv.addr); // refused itself: once more
                    false
                }
            }
        },
    );
    assert!(srv.metric("sluice_http_connections_evicted_total") >= 1.0);
    // With a third request held, no connection waits on its client: a new
    // one is refused at once, with a 503 written by the accept thread.
    let mut third = hold(srv.addr);
    let mut text = String::new();
    wait_until(Duration::from_secs(120), "a new connection refused", || {
        if fate(&mut third) != Fate::Open {
            // Closed for room before its request reached a handler.
            third = hold(srv.addr);
        }
        // (The refusal may also be lost to a reset, if the request arrives
        // after the accept thread looked for it: then try again.)
        text = exchange(srv.addr, livez);
        let refused = statuses(&text).first() == Some(&503);
        refusals_seen += u32::from(refused);
        refused
    });
    assert_eq!(statuses(&text), vec![503], "{text}");
    assert!(text.contains("too_many_connections"), "{text}");
    // Typed as the handlers type an overload refusal.
    assert!(text.contains(r#""type":"overloaded_error""#), "{text}");
    assert_spread_wait(&text);
    drop(third);
    drop(held);
    wait_until(Duration::from_secs(120), "service again", || {
        statuses(&exchange(srv.addr, livez)).first() == Some(&200)
    });
    let counted = srv.metric("sluice_http_refused_total{reason=\"connections_full\"}");
    assert!(
        counted >= f64::from(refusals_seen),
        "{counted} < {refusals_seen}"
    );
}

/// A front refusal's wait: about a second, spread over 0.5-1.5 s, and a
/// `Retry-After` never earlier than its `retry-after-ms`.
fn assert_spread_wait(text: &str) {
    let field = |name: &str| -> u64 {
        let at = text.find(name).unwrap_or_else(|| panic!("{name}: {text}"));
        let rest = &text[at + name.len()..];
        rest[..rest.find('\r').unwrap()].trim().parse().unwrap()
    };
    let ms = field("retry-after-ms:");
    assert!((500..1500).contains(&ms), "{text}");
    assert_eq!(field("Retry-After:"), ms.div_ceil(1000), "{text}");
}
