//! Two real replicas behind HAProxy with `deploy/haproxy.cfg`, on loopback:
//! HAProxy acts on sluice's own signals (readiness, 503 before a start), a
//! saturated replica leaves rotation, a draining one loses no request, and a
//! stream that started is never sent twice.
//!
//! HAProxy comes from Debian's package (`deploy/install-deps --for-tests`,
//! run by `make integration`). HAProxy's log (stderr) says when it takes a
//! replica out or puts it back; the tests wait on those states, not on time.

use crate::harness::*;
use serde_json::{json, Value};
use sluice_bench::http;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

struct Haproxy {
    child: Child,
    addr: SocketAddr,
    log: Arc<Mutex<String>>,
    /// Its stats socket (a second configuration file's `global` section).
    stats: std::path::PathBuf,
}

/// A replica's agent-check port, from its start-up line (none without
/// `--agent-port`: HAProxy then finds no agent at the default port, and
/// keeps its weight).
fn agent_port(srv: &Server) -> Option<u16> {
    srv.log()
        .lines()
        .find_map(|l| l.strip_prefix("sluice: HAProxy agent check on "))
        .map(|a| a.trim().parse::<SocketAddr>().unwrap().port())
}

impl Haproxy {
    /// HAProxy with the shipped configuration, in front of `replicas`, each
    /// taking `maxconn` requests in flight.
    fn start(replicas: [&Server; 2], maxconn: usize) -> Haproxy {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let cfg = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/haproxy.cfg");
        let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        let stats = dir.join(format!("haproxy-{port}.sock"));
        let extra = dir.join(format!("haproxy-{port}.cfg"));
        std::fs::write(
            &extra,
            format!("global\n    stats socket {} level admin\n", stats.display()),
        )
        .unwrap();
        let mut cmd = Command::new("haproxy");
        for (i, r) in replicas.iter().enumerate() {
            if let Some(port) = agent_port(r) {
                cmd.env(format!("SLUICE_AGENT_PORT_{}", i + 1), port.to_string());
            }
        }
        let mut child = cmd
            .args(["-f", cfg, "-f"])
            .arg(&extra)
            .arg("-db")
            .env("SLUICE_LB_BIND", addr.to_string())
            .env("SLUICE_REPLICA_1", replicas[0].addr.to_string())
            .env("SLUICE_REPLICA_2", replicas[1].addr.to_string())
            .env("SLUICE_MAXCONN", maxconn.to_string())
            // HAProxy's queue timeout is flow control (2.5 s shipped): on a
            // slow or busy box a request queued behind two running ones may
            // wait longer and get HAProxy's 503, which no test here is about
            // (seen beside a parallel build on a 2-core AMD EPYC).
            .env("SLUICE_QUEUE_MS", "600000")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("haproxy is installed (deploy/install-deps --for-tests)");
        let stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(String::new()));
        {
            let log = Arc::clone(&log);
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    let mut l = log.lock().unwrap();
                    l.push_str(&line);
                    l.push('\n');
                }
            });
        }
        let h = Haproxy {
            child,
            addr,
            log,
            stats,
        };
        wait_until(Duration::from_secs(120), "HAProxy listening", || {
            http::connect(addr, Duration::from_secs(1)).is_ok()
        });
        h
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// A replica's `status` and `weight` in HAProxy's stats (`show stat`).
    fn server(&self, name: &str) -> (String, u32) {
        use std::io::{Read, Write};
        let mut sock = std::os::unix::net::UnixStream::connect(&self.stats).expect("stats socket");
        sock.write_all(b"show stat\n").unwrap();
        let mut text = String::new();
        sock.read_to_string(&mut text).unwrap();
        let mut lines = text.lines();
        let head: Vec<&str> = lines
            .next()
            .unwrap()
            .trim_start_matches("# ")
            .split(',')
            .collect();
        let col = |n: &str| head.iter().position(|h| *h == n).unwrap();
        let row: Vec<&str> = lines
            .map(|l| l.split(',').collect::<Vec<&str>>())
            .find(|r| r.len() > 1 && r[0] == "sluice_replicas" && r[1] == name)
            .unwrap_or_else(|| panic!("{name} not in\n{text}"));
        (
            row[col("status")].to_string(),
            row[col("weight")].parse().unwrap(),
        )
    }

    /// Waits until HAProxy has logged `what` `times` times in all.
    fn wait_for(&self, what: &str, times: usize) {
        wait_until(Duration::from_secs(120), what, || {
            self.log().matches(what).count() >= times
        });
    }

    fn post(&self, b: &Value) -> Response {
        post_json(self.addr, "/v1/completions", b)
    }
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.stats);
    }
}

fn served_by(headers: &[(String, String)]) -> String {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("X-Served-By"))
        .map(|(_, v)| v.clone())
        .unwrap_or_default()
}

fn short(i: usize) -> Value {
    json!({"prompt": format!("Question {i}."), "max_tokens": 8, "ignore_eos": true, "temperature": 0})
}

fn long_stream(max_tokens: usize) -> Value {
    json!({"prompt": "Count on.", "max_tokens": max_tokens, "ignore_eos": true,
           "temperature": 0, "stream": true})
}

/// A stream through `addr`, its head read (the first token has come).
fn open_stream(addr: SocketAddr, b: &Value) -> http::Sse {
    let mut s = http::Sse::open(
        addr,
        "/v1/completions",
        b.to_string().as_bytes(),
        Duration::from_secs(600),
    )
    .expect("open stream");
    assert_eq!(s.status, 200);
    assert!(s.next_json().expect("event").is_some());
    s
}

/// Replicas as `deploy/haproxy.cfg` expects them: one queue place of slack
/// (HAProxy holds the queue, with maxconn = --parallel), and a drain notice
/// longer than HAProxy's checks take to see it.
const REPLICA: [&str; 6] = [
    "--parallel",
    "2",
    "--queue-depth",
    "1",
    "--drain-notice-ms",
    "1000",
];
const MAXCONN: usize = 2;

#[test]
fn a_saturated_replica_leaves_rotation_and_the_other_serves() {
    let r1 = Server::start(&REPLICA);
    let r2 = Server::start(&REPLICA);
    let lb = Haproxy::start([&r1, &r2], MAXCONN);

    // Replica 1 is saturated by traffic that does not pass HAProxy: two
    // running streams and a queued one fill its slots and its queue.
    let running = [
        open_stream(r1.addr, &long_stream(4000)),
        open_stream(r1.addr, &long_stream(4000)),
    ];
    let queued = std::thread::spawn({
        let addr = r1.addr;
        move || {
            let s = http::Sse::open(
                addr,
                "/v1/completions",
                long_stream(4000).to_string().as_bytes(),
                Duration::from_secs(600),
            );
            s.map(|s| s.status)
        }
    });
    wait_until(Duration::from_secs(120), "replica 1's queue full", || {
        r1.metric("sluice_queue_depth") == 1.0
    });
    // Its queued request waits past the sojourn target: not ready.
    wait_until(Duration::from_secs(120), "replica 1 not ready", || {
        let r = request(r1.addr, "GET", "/readyz", None, &[]);
        r.status == 503 && r.body_json()["reason"] == "queue sojourn above target"
    });
    lb.wait_for("replica1 is DOWN", 1);

    for i in 0..4 {
        let r = lb.post(&short(i));
        assert_eq!(r.status, 200, "{}", r.body_json());
        assert_eq!(r.header("X-Served-By"), Some("replica2"));
    }
    assert_eq!(
        r1.metric("sluice_requests_rejected_total{reason=\"queue_full\"}"),
        0.0
    );

    // Freed, it comes back.
    drop(running);
    lb.wait_for("replica1 is UP", 1);
    drop(queued);
}

#[test]
fn a_draining_replica_loses_no_request_and_a_started_stream_is_not_sent_twice() {
    let mut r1 = Server::start(&REPLICA);
    let mut r2 = Server::start(&REPLICA);
    let lb = Haproxy::start([&r1, &r2], MAXCONN);

    // A stream through HAProxy; the replica serving it is then stopped.
    let mut stream = open_stream(lb.addr, &long_stream(150));
    let victim_name = served_by(&stream.headers);
    let (victim, other) = match victim_name.as_str() {
        "replica1" => (&mut r1, &mut r2),
        "replica2" => (&mut r2, &mut r1),
        v => panic!("served by '{v}'"),
    };
    victim.signal("TERM");
    wait_until(Duration::from_secs(120), "the replica not ready", || {
        let r = request(victim.addr, "GET", "/readyz", None, &[]);
        r.status == 503 && r.body_json()["reason"] == "draining"
    });

    // During the drain every request through HAProxy is answered: by the
    // draining replica while HAProxy still sends to it (it serves during its
    // drain notice), by the other, or by the other after the draining one said
    // 503. Four at once, then four one at a time.
    let addr = lb.addr;
    let burst: Vec<_> = (0..4)
        .map(|i| std::thread::spawn(move || post_json(addr, "/v1/completions", &short(i))))
        .collect();
    let mut answers: Vec<Response> = burst
        .into_iter()
        .map(|h| h.join().expect("client"))
        .collect();
    answers.extend((4..8).map(|i| lb.post(&short(i))));
    for (i, r) in answers.iter().enumerate() {
        assert_eq!(
            r.status,
            200,
            "request {i} during the drain: {}",
            r.body_json()
        );
    }
    let by = |name: &str| {
        answers
            .iter()
            .filter(|r| r.header("X-Served-By") == Some(name))
            .count()
    };
    let (on_victim, on_other) = (by(&victim_name), answers.len() - by(&victim_name));
    // The stream ends normally where it started: all its tokens (an event
    // may carry several, or none while a character is incomplete), then
    // finish_reason "length" and [DONE].
    let mut events = 1;
    let mut done = false;
    let mut finish = None;
    while let Some(data) = stream.next_data().expect("well-formed stream") {
        if data == "[DONE]" {
            done = true;
            break;
        }
        let v: Value = serde_json::from_str(&data).expect("JSON event");
        assert!(v.get("error").is_none(), "{v}");
        if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
        events += 1;
    }
    assert!(
        done && finish.as_deref() == Some("length"),
        "{events} events, finish_reason {finish:?}, [DONE] {done}"
    );
    assert_eq!(victim.wait_exit(Duration::from_secs(60)), Some(0));
    lb.wait_for(&format!("{victim_name} is DOWN"), 1);

    // Nothing was run twice: each replica completed exactly what it answered
    // (the stream included), whatever it refused before HAProxy moved on.
    let completed = |log: String| log.matches("POST /v1/completions 200").count();
    assert_eq!(
        completed(victim.log()),
        on_victim + 1,
        "the stream ran once"
    );
    assert_eq!(completed(other.log()), on_other);
    let r = lb.post(&short(99));
    assert_eq!(r.status, 200);
}

#[test]
fn a_stream_cut_by_its_replica_is_not_retried() {
    // A drain deadline that a 4,000-token stream cannot meet.
    let args = [
        "--parallel",
        "1",
        "--queue-depth",
        "1",
        "--drain-timeout-ms",
        "500",
    ];
    let mut r1 = Server::start(&args);
    let mut r2 = Server::start(&args);
    let lb = Haproxy::start([&r1, &r2], MAXCONN);
    let mut stream = open_stream(lb.addr, &long_stream(4000));
    let victim = served_by(&stream.headers);
    let (victim, other) = if victim == "replica1" {
        (&mut r1, &mut r2)
    } else {
        (&mut r2, &mut r1)
    };
    victim.signal("TERM");
    // The drain's deadline passes: the stream ends with an error event.
    let mut error = None;
    while let Some(v) = stream.next_json().expect("well-formed stream") {
        if let Some(e) = v.get("error") {
            error = Some(e["code"].clone());
            break;
        }
    }
    assert_eq!(error, Some(json!("shutting_down")));
    assert_eq!(victim.wait_exit(Duration::from_secs(60)), Some(0));
    assert_eq!(
        other.metric("sluice_requests_accepted_total"),
        0.0,
        "HAProxy did not send the cut stream again"
    );
}

/// Replicas with an agent: four slots, one queue place.
const AGENT_REPLICA: [&str; 8] = [
    "--parallel",
    "4",
    "--queue-depth",
    "1",
    // Replica 2 is stopped and then asked what it accepted: it must still
    // be up, in its notice, however long the requests between take.
    "--drain-notice-ms",
    "600000",
    "--agent-port",
    "0",
];

/// How many of `n` short requests, one after another through HAProxy,
/// replica 1 answered.
fn served_by_replica1(lb: &Haproxy, n: usize) -> usize {
    (0..n)
        .filter(|&i| {
            let r = lb.post(&json!({"prompt": format!("Probe {i}."), "max_tokens": 2}));
            assert_eq!(r.status, 200, "{}", r.body_json());
            r.header("X-Served-By") == Some("replica1")
        })
        .count()
}

#[test]
fn haproxy_weights_follow_each_replicas_headroom_and_a_draining_one_gets_nothing() {
    let r1 = Server::start(&AGENT_REPLICA);
    let r2 = Server::start(&AGENT_REPLICA);
    let lb = Haproxy::start([&r1, &r2], 4);
    wait_until(Duration::from_secs(120), "both at full weight", || {
        lb.server("replica1") == ("UP".into(), 100) && lb.server("replica2") == ("UP".into(), 100)
    });
    let idle = served_by_replica1(&lb, 30);

    // Replica 1 kept busy from outside HAProxy: three of its four slots and
    // most of its KV cells (the agent says 8 %: 2 of 5 places, 677 of 8,192
    // cells left).
    // Read as they come (a stream nobody reads is paused, then cut off),
    // until `stop`.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let busy: Vec<_> = (0..3)
        .map(|_| {
            let mut s = open_stream(r1.addr, &long_stream(2500));
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if s.next_data().ok().flatten().is_none() {
                        break;
                    }
                }
            })
        })
        .collect();
    wait_until(Duration::from_secs(120), "replica 1's weight down", || {
        let (status, weight) = lb.server("replica1");
        status == "UP" && weight <= 40
    });
    let loaded = served_by_replica1(&lb, 30);
    assert!(
        idle >= 12 && loaded <= 11 && loaded < idle,
        "replica 1 served {idle} of 30 idle, {loaded} of 30 with three streams"
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in busy {
        t.join().unwrap();
    }

    // Replica 2 stops: its agent says drain and its /readyz 503 at the same
    // moment; once HAProxy has it out of rotation (DRAIN or DOWN, whichever
    // check saw it first), it sends it nothing new.
    wait_until(
        Duration::from_secs(120),
        "replica 1 back to full weight",
        || lb.server("replica1").1 == 100,
    );
    let before = r2.metric("sluice_requests_accepted_total");
    r2.signal("TERM");
    wait_until(
        Duration::from_secs(120),
        "replica 2 out of rotation in HAProxy",
        || !lb.server("replica2").0.starts_with("UP"),
    );
    assert_eq!(served_by_replica1(&lb, 10), 10);
    assert_eq!(r2.metric("sluice_requests_accepted_total"), before);
}
