//! Drives the real `sluice` binary over real sockets.
//!
//! HTTP goes through `sluice_bench::http`, the load harness's raw-socket client:
//! the tests need to read a stream event by event, hold idle connections and see
//! exactly what the server framed. Here its errors become test failures.

use serde_json::Value;
use sluice_bench::http;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use sluice_bench::http::Response;

/// How long a test waits for the server to come up (model load + context).
const STARTUP_WAIT_S: u64 = 60;
/// Socket timeout: generous, since a 6k-token prefill takes a minute or more here.
const SOCKET_TIMEOUT: Duration = Duration::from_secs(900);
/// The least limit a `wait_until` may give: long enough that only a hang,
/// not a slow box, reaches it.
const WAIT_LIMIT_MIN: Duration = Duration::from_secs(120);

/// A model file under `models/`, which must be there (`fetch` says how).
fn model_file(name: &str, fetch: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join(name);
    assert!(
        p.exists(),
        "{name} is missing: run {fetch} first ({})",
        p.display()
    );
    p
}

pub fn model_path() -> PathBuf {
    model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "models/fetch")
}

/// The second model family the suite runs (`models/fetch gemma3`): Gemma 3
/// 270M, Q4_K_M; a GGUF without a chat template.
pub fn second_model_path() -> PathBuf {
    model_file("gemma-3-270m-q4_k_m.gguf", "models/fetch gemma3")
}

/// The calibration cache the suite's servers share (a test may give its own
/// with `--calibration-cache`, which wins over the environment).
pub fn suite_calibration_cache() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("calibration.json")
}

/// The Python of the test virtualenv (`deploy/install-deps --for-tests`),
/// which has the official OpenAI client.
pub fn test_python() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/test-venv/bin/python");
    assert!(
        p.exists(),
        "the test virtualenv is missing: run deploy/install-deps --for-tests ({})",
        p.display()
    );
    p
}

/// Runs the named checks of `tests/py/<script>` (a script run by
/// `tests/py/checks.py`'s runner) against `srv`, with `args` after the
/// server's URL; fails with their output unless every one ran and passed.
pub fn run_python_checks(srv: &Server, script: &str, args: &[&str], checks: &[&str]) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/py")
        .join(script);
    let out = Command::new(test_python())
        .arg(path)
        .arg(format!("http://{}", srv.addr))
        .args(args)
        .args(checks)
        .output()
        .expect("run python");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}\nserver log:\n{}", srv.log());
    for c in checks {
        assert!(
            text.contains(&format!("ok   check_{c}")),
            "{c} did not run:\n{text}"
        );
    }
}

pub fn binary() -> &'static str {
    env!("CARGO_BIN_EXE_sluice")
}

pub struct Server {
    child: Child,
    pub addr: SocketAddr,
    log: Arc<Mutex<String>>,
    /// The Batch API's directory this server got from the harness (removed
    /// when it is dropped); a test that gives `--data-dir` keeps its own.
    data_dir: PathBuf,
}

/// A fresh directory for one server's Batch API database.
fn fresh_data_dir() -> PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("data-{}-{n}", std::process::id()))
}

impl Server {
    /// Starts `sluice serve` on a free port with the default model and `args`.
    pub fn start(args: &[&str]) -> Server {
        Server::start_with_env(args, &[])
    }

    /// Like `start`, with extra environment variables.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        Server::launch(&[Path::new(binary())], &model_path(), args, env)
    }

    /// Starts `program serve` (`program`: a sluice binary, or a command
    /// that runs one, such as an emulator and its flags) on a free port
    /// with `model`, `args` and extra environment variables.
    pub fn launch(program: &[&Path], model: &Path, args: &[&str], env: &[(&str, &str)]) -> Server {
        let data_dir = fresh_data_dir();
        let mut child = Command::new(program[0])
            .args(&program[1..])
            .arg("serve")
            .arg("--model")
            .arg(model)
            .args(["--port", "0"])
            .args(args)
            // One calibration cache for the suite's servers, not the user's:
            // a server measures the rates once, later ones start from them.
            .env("SLUICE_CALIBRATION_CACHE", suite_calibration_cache())
            // The Batch API's database: one per server, never the user's.
            .env("SLUICE_DATA_DIR", &data_dir)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn sluice");
        let stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::sync_channel::<SocketAddr>(1);
        {
            let log = Arc::clone(&log);
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    // With --log-format json, the line's text is its `msg`.
                    let text = match line.starts_with('{') {
                        true => serde_json::from_str::<Value>(&line)
                            .ok()
                            .and_then(|v| v["msg"].as_str().map(str::to_string))
                            .unwrap_or_else(|| line.clone()),
                        false => line.clone(),
                    };
                    if let Some(addr) = text.strip_prefix("sluice: listening on http://") {
                        let _ = tx.try_send(addr.trim().parse().expect("listen address"));
                    }
                    let mut l = log.lock().unwrap();
                    l.push_str(&line);
                    l.push('\n');
                }
            });
        }
        let Ok(addr) = rx.recv_timeout(Duration::from_secs(STARTUP_WAIT_S)) else {
            let _ = child.kill();
            panic!("sluice did not start; log:\n{}", log.lock().unwrap());
        };
        Server {
            child,
            addr,
            log,
            data_dir,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal (`TERM`, `INT`, ...) with kill(1).
    pub fn signal(&self, name: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.pid().to_string())
            .status()
            .expect("run kill")
            .success();
        assert!(ok, "kill -{name} failed");
    }

    /// Waits for the server to exit; its exit code (`None` if a signal killed it).
    pub fn wait_exit(&mut self, limit: Duration) -> Option<i32> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status.code();
            }
            assert!(
                start.elapsed() < limit,
                "sluice did not exit; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// What the server has written to stderr so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    pub fn metrics(&self) -> String {
        let r = request(self.addr, "GET", "/metrics", None, &[]);
        assert_eq!(r.status, 200);
        String::from_utf8(r.body).expect("metrics are UTF-8")
    }

    /// The value of a metric line, e.g. `sluice_requests_cancelled_total{reason="disconnect"}`.
    pub fn metric(&self, name: &str) -> f64 {
        metric_value(&self.metrics(), name)
    }

    pub fn post(&self, path: &str, body: &Value) -> Response {
        post_json(self.addr, path, body)
    }

    /// A POST that must be answered 200: its JSON body (else the test fails
    /// with the answer and the server's log).
    pub fn post_ok(&self, path: &str, body: &Value) -> Value {
        let r = self.post(path, body);
        assert_eq!(
            r.status,
            200,
            "{}\n{}",
            String::from_utf8_lossy(&r.body),
            self.log()
        );
        r.body_json()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.data_dir);
    }
}

pub fn metric_value(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("metric {name} not found in:\n{text}"))
        .trim()
        .parse()
        .expect("metric value")
}

/// A response body that must be JSON.
pub trait BodyJson {
    fn body_json(&self) -> Value;
}

impl BodyJson for Response {
    fn body_json(&self) -> Value {
        self.json().unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }
}

pub fn connect(addr: SocketAddr) -> TcpStream {
    http::connect(addr, SOCKET_TIMEOUT).expect("connect")
}

/// Sends a JSON POST on a new connection and returns it with the response unread.
pub fn send_json(addr: SocketAddr, path: &str, body: &Value) -> TcpStream {
    let mut s = connect(addr);
    http::write_request(
        &mut s,
        "POST",
        path,
        Some(body.to_string().as_bytes()),
        &[("Content-Type", "application/json")],
    )
    .expect("send");
    s
}

/// A JSON POST on a new connection; the whole response. (`Server::post` for
/// threads that cannot borrow the server.)
pub fn post_json(addr: SocketAddr, path: &str, body: &Value) -> Response {
    request(
        addr,
        "POST",
        path,
        Some(body.to_string().as_bytes()),
        &[("Content-Type", "application/json")],
    )
}

pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    headers: &[(&str, &str)],
) -> Response {
    http::request(addr, method, path, body, headers, SOCKET_TIMEOUT)
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// A streaming response read event by event; protocol errors fail the test.
pub struct Sse {
    inner: http::Sse,
    pub status: u16,
}

impl Sse {
    pub fn open(addr: SocketAddr, path: &str, body: &Value) -> Sse {
        let inner = http::Sse::open(addr, path, body.to_string().as_bytes(), SOCKET_TIMEOUT)
            .expect("open stream");
        let status = inner.status;
        if status == 200 {
            assert!(
                http::is_chunked(&inner.headers),
                "SSE must be chunked: {:?}",
                inner.headers
            );
        }
        Sse { inner, status }
    }

    /// The next event's data (`[DONE]` included); `None` when the body ended.
    pub fn next_data(&mut self) -> Option<String> {
        self.inner.next_data().expect("well-formed event stream")
    }

    /// Comment-only events (`: keep-alive`) read so far.
    pub fn comments(&self) -> usize {
        self.inner.comments()
    }

    /// The next event parsed as JSON; `None` at `[DONE]` or the end.
    pub fn next_json(&mut self) -> Option<Value> {
        self.inner.next_json().expect("well-formed JSON event")
    }
}

/// Text delta of a chat or completions chunk.
pub fn delta_text(chunk: &Value) -> String {
    let c = &chunk["choices"][0];
    c["delta"]["content"]
        .as_str()
        .or_else(|| c["text"].as_str())
        .unwrap_or("")
        .to_string()
}

/// Reads a stream to its end; returns the concatenated text and every chunk.
pub fn collect_stream(sse: &mut Sse) -> (String, Vec<Value>) {
    let mut text = String::new();
    let mut chunks = Vec::new();
    while let Some(v) = sse.next_json() {
        text.push_str(&delta_text(&v));
        chunks.push(v);
    }
    (text, chunks)
}

/// Resident memory of a process, in kB (`VmRSS` in /proc).
pub fn rss_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// Waits until `cond` holds, polling; panics with `what` after `limit`.
///
/// The limit is a fail-safe against a hang, not a deadline: a busy or slow
/// box only makes the state come later, so callers give at least 2 minutes
/// (every state waited for comes within seconds on an idle 2-core box).
pub fn wait_until(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    assert!(
        limit >= WAIT_LIMIT_MIN,
        "wait_until({what}): a limit under {WAIT_LIMIT_MIN:?} is a deadline a slow box could miss"
    );
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A long, varied prompt of about `lines * 20` tokens.
pub fn long_prompt(lines: usize) -> String {
    let animals = [
        "fox", "cat", "owl", "horse", "otter", "crow", "lynx", "mole",
    ];
    let colors = ["red", "blue", "green", "amber", "grey", "violet"];
    (0..lines)
        .map(|i| {
            format!(
                "Line {i}: the {} jumped over the {} fence near house {}.",
                animals[i % 8],
                colors[i % 6],
                i * 7 % 101
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}
