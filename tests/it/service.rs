//! Running as a service: graceful drain on SIGTERM, systemd's notify protocol,
//! settings from the environment.

use crate::harness::*;
use serde_json::json;
use std::os::unix::net::UnixDatagram;
use std::time::Duration;

fn long_stream(srv: &Server, max_tokens: usize) -> Sse {
    let body = json!({"prompt": "Once upon a time", "stream": true, "max_tokens": max_tokens,
                      "ignore_eos": true, "temperature": 0});
    let mut sse = Sse::open(srv.addr, "/v1/completions", &body);
    assert_eq!(sse.status, 200);
    assert!(sse.next_json().is_some());
    sse
}

#[test]
fn on_sigterm_the_running_stream_finishes_new_requests_get_503_and_sluice_exits_0() {
    let mut srv = Server::start(&[]);
    let mut stream = long_stream(&srv, 200);
    srv.signal("TERM");
    wait_until(Duration::from_secs(120), "/readyz to say draining", || {
        request(srv.addr, "GET", "/readyz", None, &[]).status == 503
    });
    let r = srv.post("/v1/completions", &json!({"prompt": "Hi", "max_tokens": 4}));
    assert_eq!(r.status, 503);
    assert_eq!(r.body_json()["error"]["code"], "draining");
    assert!(r.header("Retry-After").is_some());
    assert_eq!(request(srv.addr, "GET", "/livez", None, &[]).status, 200);

    // The accepted stream runs to its end.
    let mut finish = None;
    let mut done = false;
    while let Some(data) = stream.next_data() {
        if data == "[DONE]" {
            done = true;
            break;
        }
        let v: serde_json::Value = serde_json::from_str(&data).expect("JSON event");
        if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    assert_eq!(finish.as_deref(), Some("length"));
    assert!(done, "the stream ended with [DONE]");
    assert_eq!(
        srv.wait_exit(Duration::from_secs(30)),
        Some(0),
        "{}",
        srv.log()
    );
}

#[test]
fn a_drain_that_times_out_cancels_the_rest_with_an_error_event_and_exits_0() {
    let mut srv = Server::start(&["--drain-timeout-ms", "1000"]);
    let mut stream = long_stream(&srv, 4000);
    srv.signal("TERM");
    let mut error = None;
    while let Some(data) = stream.next_data() {
        assert_ne!(
            data, "[DONE]",
            "a cancelled stream does not end with [DONE]"
        );
        let v: serde_json::Value = serde_json::from_str(&data).expect("JSON event");
        if v.get("error").is_some() {
            error = Some(v);
        }
    }
    let error = error.expect("the stream ended with an error event");
    assert_eq!(error["error"]["code"], "shutting_down", "{error}");
    assert_eq!(
        srv.wait_exit(Duration::from_secs(30)),
        Some(0),
        "{}",
        srv.log()
    );
    assert!(
        srv.log().contains("drain timeout: cancelling 1 requests"),
        "{}",
        srv.log()
    );
}

#[test]
fn during_a_drain_a_second_sigterm_changes_nothing_and_sigint_exits_at_once_with_2() {
    let mut srv = Server::start(&[]);
    let mut stream = long_stream(&srv, 4000);
    srv.signal("TERM");
    wait_until(Duration::from_secs(120), "/readyz to say draining", || {
        request(srv.addr, "GET", "/readyz", None, &[]).status == 503
    });
    // A supervisor's own SIGTERM after its stop hook (Kubernetes' after a
    // preStop that started the drain): the drain goes on, tokens still flow.
    srv.signal("TERM");
    assert_eq!(request(srv.addr, "GET", "/livez", None, &[]).status, 200);
    let before = srv.metric("sluice_tokens_generated_total");
    wait_until(
        Duration::from_secs(120),
        "tokens after the second SIGTERM",
        || {
            assert!(stream.next_json().is_some(), "the stream ended");
            srv.metric("sluice_tokens_generated_total") > before
        },
    );
    assert_eq!(request(srv.addr, "GET", "/readyz", None, &[]).status, 503);
    // Ctrl-C (SIGINT) during the drain: out at once.
    srv.signal("INT");
    assert_eq!(
        srv.wait_exit(Duration::from_secs(30)),
        Some(2),
        "{}",
        srv.log()
    );
    assert!(!srv.log().contains("drained; exiting"), "{}", srv.log());
}

#[test]
fn systemd_hears_ready_after_start_up_and_stopping_on_sigterm() {
    let dir = std::env::temp_dir().join(format!("sluice-notify-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("notify.sock");
    let _ = std::fs::remove_file(&path);
    let sock = UnixDatagram::bind(&path).expect("bind the notify socket");
    sock.set_read_timeout(Some(Duration::from_secs(120)))
        .expect("timeout");
    // Without a calibration cache, so that the rates are measured.
    let mut srv = Server::start_with_env(
        &["--calibration-cache", "off"],
        &[("NOTIFY_SOCKET", path.to_str().expect("path"))],
    );
    let mut buf = [0u8; 4096];
    // STATUS lines while loading and calibrating, then READY.
    let mut before = Vec::new();
    let ready = loop {
        let n = sock.recv(&mut buf).expect("a notification");
        let text = String::from_utf8_lossy(&buf[..n]).into_owned();
        if text.lines().any(|l| l == "READY=1") {
            break text;
        }
        before.push(text);
    };
    assert_eq!(before.len(), 2, "{before:?}");
    assert!(before[0].starts_with("STATUS=loading "), "{before:?}");
    assert!(before[1].starts_with("STATUS=calibrating"), "{before:?}");
    assert!(ready.contains("STATUS=serving"), "{ready}");
    // READY comes only once the server answers.
    assert_eq!(request(srv.addr, "GET", "/livez", None, &[]).status, 200);
    srv.signal("TERM");
    let n = sock.recv(&mut buf).expect("a notification");
    let stopping = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(stopping.lines().any(|l| l == "STOPPING=1"), "{stopping}");
    assert_eq!(srv.wait_exit(Duration::from_secs(30)), Some(0));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn every_flag_can_come_from_the_environment_and_the_command_line_wins() {
    let srv = Server::start_with_env(
        &["--queue-depth", "3"],
        &[
            ("SLUICE_PARALLEL", "2"),
            ("SLUICE_QUEUE_DEPTH", "7"),
            ("SLUICE_NO_SHED", "1"),
        ],
    );
    assert_eq!(srv.metric("sluice_parallel_max"), 2.0);
    assert_eq!(srv.metric("sluice_queue_depth_max"), 3.0);
    assert!(srv.log().contains("shedding off"), "{}", srv.log());
}
