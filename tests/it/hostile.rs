//! Hostile and broken clients: each gets a clear answer, or is cut off, and
//! none keeps the server from serving everyone else.

use crate::harness::*;
use serde_json::json;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// Sends raw bytes on a new connection and reads the response's status code
/// (0 if the server closed without one).
fn raw_status(srv: &Server, bytes: &[u8]) -> u16 {
    let mut s = connect(srv.addr);
    let _ = s.write_all(bytes);
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&head);
    text.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

fn normal_request_completes(srv: &Server) {
    let r = srv.post(
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}

#[test]
fn a_16_mib_body_is_refused_from_its_content_length_without_the_memory() {
    let srv = Server::start(&[]);
    let before = rss_kb(srv.pid());
    let size = 16 << 20;
    let mut s = connect(srv.addr);
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
    );
    s.write_all(head.as_bytes()).expect("head");
    // Send the body too, as a client would; the answer comes from the header.
    let mut writer = s.try_clone().expect("clone");
    let sender = std::thread::spawn(move || {
        let chunk = vec![b'x'; 64 * 1024];
        for _ in 0..(size / chunk.len()) {
            if writer.write_all(&chunk).is_err() {
                break;
            }
        }
    });
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = s.read(&mut buf).expect("response");
        assert!(n > 0, "closed without a response");
        head.extend_from_slice(&buf[..n]);
    }
    assert!(
        String::from_utf8_lossy(&head).starts_with("HTTP/1.1 413"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    drop(s);
    let _ = sender.join();
    let grown_kb = rss_kb(srv.pid()).saturating_sub(before);
    assert!(
        grown_kb < 8 * 1024,
        "RSS grew by {grown_kb} kB for a refused 16 MiB body"
    );
    normal_request_completes(&srv);
}

#[test]
fn a_chunked_body_over_the_cap_is_cut_off_with_413() {
    let srv = Server::start(&["--max-body-bytes", "4096"]);
    let mut req = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n".to_vec();
    for _ in 0..4 {
        req.extend_from_slice(b"800\r\n");
        req.extend_from_slice(&[b' '; 0x800]);
        req.extend_from_slice(b"\r\n");
    }
    req.extend_from_slice(b"0\r\n\r\n");
    assert_eq!(raw_status(&srv, &req), 413);
    normal_request_completes(&srv);
}

#[test]
fn headers_too_long_or_too_many_get_431() {
    let srv = Server::start(&[]);
    let long = format!(
        "GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: {}\r\n\r\n",
        "a".repeat(16 * 1024)
    );
    assert_eq!(raw_status(&srv, long.as_bytes()), 431);
    let mut many = String::from("GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\n");
    for i in 0..200 {
        many.push_str(&format!("X-H{i}: v\r\n"));
    }
    many.push_str("\r\n");
    assert_eq!(raw_status(&srv, many.as_bytes()), 431);
    normal_request_completes(&srv);
}

#[test]
fn a_thousand_idle_connections_do_not_stop_service() {
    let srv = Server::start(&[]);
    let idle: Vec<TcpStream> = (0..1000).map(|_| connect(srv.addr)).collect();
    // Half of them have even started a request and stopped.
    for s in idle.iter().step_by(2) {
        let mut s = s;
        s.write_all(b"POST /v1/completions HTTP/1.1\r\n")
            .expect("partial request");
    }
    normal_request_completes(&srv);
    assert_eq!(request(srv.addr, "GET", "/livez", None, &[]).status, 200);
    drop(idle);
}

#[test]
fn slow_senders_hold_no_handler_and_are_cut_off() {
    // 1 slot + 1 queued per class + 4 spare = 7 handlers; 10 slow clients would
    // hold them all if a handler read their bodies.
    let srv = Server::start(&[
        "--parallel",
        "1",
        "--queue-depth",
        "1",
        "--client-timeout-ms",
        "3000",
        "--header-timeout-ms",
        "3000",
    ]);
    assert_eq!(srv.metric("sluice_http_threads"), 7.0);
    let mut slow: Vec<TcpStream> = (0..10)
        .map(|i| {
            let mut s = connect(srv.addr);
            if i % 2 == 0 {
                // Headers a byte at a time (slowloris): here, only the start.
                s.write_all(b"POST /v1/comp").expect("write");
            } else {
                // Complete headers, then a body that never comes.
                s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\"")
                    .expect("write");
            }
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    normal_request_completes(&srv);
    normal_request_completes(&srv);
    // They are cut off by their deadlines: a head or a body that stalls gets
    // 408, and the connection is closed.
    let mut statuses = Vec::new();
    for s in slow.iter_mut() {
        // A fail-safe: the 408 shows the deadline cut it off.
        s.set_read_timeout(Some(Duration::from_secs(600)))
            .expect("timeout");
        let mut buf = Vec::new();
        let _ = s.read_to_end(&mut buf);
        let text = String::from_utf8_lossy(&buf).into_owned();
        statuses.push(
            text.split_whitespace()
                .nth(1)
                .unwrap_or("closed")
                .to_string(),
        );
    }
    for (i, st) in statuses.iter().enumerate() {
        let what = if i % 2 == 1 { "body" } else { "headers" };
        assert_eq!(st, "408", "slow {what} {i}: {statuses:?}");
    }
    normal_request_completes(&srv);
}

#[test]
fn absurd_values_and_unknown_fields_get_a_4xx_naming_them() {
    let srv = Server::start(&[]);
    let stops: Vec<String> = (0..1000).map(|i| format!("stop{i}")).collect();
    for (body, status) in [
        (r#"{"prompt":"x","max_tokens":1e30}"#.to_string(), 400),
        (
            r#"{"prompt":"x","max_tokens":184467440737095516150}"#.to_string(),
            400,
        ),
        (r#"{"prompt":"x","temperature":NaN}"#.to_string(), 400),
        (r#"{"prompt":"x","temperature":1e400}"#.to_string(), 400),
        (r#"{"prompt":"x","top_p":-1}"#.to_string(), 400),
        (json!({"prompt": "x", "stop": stops}).to_string(), 400),
        (
            r#"{"prompt":"x","max_tokens":2,"frobnicate":{"deeply":[1,2,{"a":null}]}}"#.to_string(),
            400,
        ),
        (
            r#"{"prompt":"x","max_tokens":2,"frequency_penalty":2.5}"#.to_string(),
            400,
        ),
        (
            r#"{"prompt":"x","max_tokens":2,"logit_bias":{"99999999":1}}"#.to_string(),
            400,
        ),
        (
            r#"{"prompt":"x","max_tokens":2,"suffix":"y"}"#.to_string(),
            400,
        ),
        (
            r#"{"prompt":"x","max_tokens":2,"frequency_penalty":0,"user":"u"}"#.to_string(),
            200,
        ),
    ] {
        let r = request(
            srv.addr,
            "POST",
            "/v1/completions",
            Some(body.as_bytes()),
            &[("Content-Type", "application/json")],
        );
        assert_eq!(
            r.status,
            status,
            "{body}: {}",
            String::from_utf8_lossy(&r.body)
        );
        if status == 400 {
            assert!(r.body_json()["error"]["message"].is_string());
        }
    }
    normal_request_completes(&srv);
}

#[test]
fn running_out_of_file_descriptors_does_not_stop_accepting_for_good() {
    // sluice sizes its connection bound to its descriptor limit at start-up,
    // so the limit is lowered under the running server (prlimit --pid): to
    // a few descriptors beyond those it holds, fewer than the connections
    // below need. Its accepts then fail with EMFILE, not its bound.
    let srv = Server::start(&[]);
    let pid = srv.pid().to_string();
    let open_fds = || {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .expect("/proc fd")
            .count()
    };
    let limit = open_fds() + 8;
    let set_limit = |n: usize| {
        let ok = std::process::Command::new("prlimit")
            .args(["--pid", &pid, &format!("--nofile={n}:{n}")])
            .status()
            .expect("run prlimit")
            .success();
        assert!(ok, "prlimit --pid {pid} --nofile={n}");
    };
    set_limit(limit);
    let conns: Vec<TcpStream> = (0..32).map(|_| connect(srv.addr)).collect();
    // The connections the server could not take wait in the listen queue
    // while its accept loop retries: it says so in its log.
    wait_until(Duration::from_secs(600), "the server to log EMFILE", || {
        srv.log().contains("Too many open files")
    });
    drop(conns);
    // Once descriptors are free again, it serves as before; its metrics
    // counted the failed accepts. (A connect alone proves nothing: the
    // kernel completes it from the listen queue. And while the connections
    // dropped above still wait in that queue, each is accepted, reads its
    // end and closes, holding descriptors for a moment: a request may find
    // none free and be reset. So: until a request is answered.)
    let body = json!({"prompt": "Hello", "max_tokens": 4, "temperature": 0}).to_string();
    let mut answered = None;
    wait_until(
        Duration::from_secs(600),
        "a request to be answered again",
        || {
            answered = sluice_bench::http::request(
                srv.addr,
                "POST",
                "/v1/completions",
                Some(body.as_bytes()),
                &[("Content-Type", "application/json")],
                Duration::from_secs(600),
            )
            .ok();
            answered.is_some()
        },
    );
    let r = answered.expect("answered");
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert!(srv.metric("sluice_http_accept_errors_total") >= 1.0);
}
