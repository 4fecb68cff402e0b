//! Drives the real `sluice` binary over real sockets.
//!
//! The HTTP client is a few dozen lines over `TcpStream` on purpose: the tests
//! need to read a stream event by event, hold idle connections, and see exactly
//! what the server framed (chunk sizes, headers), which a client library hides.

use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a test waits for the server to come up (model load + context).
const STARTUP_WAIT_S: u64 = 60;
/// Socket read timeout: generous, since a 6k-token prefill takes a minute here.
const READ_TIMEOUT_S: u64 = 600;

pub fn model_path() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "the default model is missing: run models/fetch first ({})",
        p.display()
    );
    p
}

pub fn binary() -> &'static str {
    env!("CARGO_BIN_EXE_sluice")
}

pub struct Server {
    child: Child,
    pub addr: SocketAddr,
    pub log: Arc<Mutex<String>>,
}

impl Server {
    /// Starts `sluice serve` on a free port with the default model and `args`.
    pub fn start(args: &[&str]) -> Server {
        let model = model_path();
        let mut child = Command::new(binary())
            .arg("serve")
            .arg("--model")
            .arg(&model)
            .args(["--port", "0"])
            .args(args)
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
                let mut sent = false;
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    if !sent {
                        if let Some(addr) = line.strip_prefix("sluice: listening on http://") {
                            let _ = tx.send(addr.trim().parse().expect("listen address"));
                            sent = true;
                        }
                    }
                    let mut l = log.lock().unwrap();
                    l.push_str(&line);
                    l.push('\n');
                }
            });
        }
        let addr = match rx.recv_timeout(Duration::from_secs(STARTUP_WAIT_S)) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                panic!("sluice did not start; log:\n{}", log.lock().unwrap());
            }
        };
        Server { child, addr, log }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn metrics(&self) -> String {
        let r = request(self.addr, "GET", "/metrics", None, &[]);
        assert_eq!(r.status, 200);
        String::from_utf8(r.body).expect("metrics are UTF-8")
    }

    /// The value of an unlabelled or labelled metric line, e.g.
    /// `sluice_requests_cancelled_total{reason="disconnect"}`.
    pub fn metric(&self, name: &str) -> f64 {
        metric_value(&self.metrics(), name)
    }

    pub fn post(&self, path: &str, body: &Value) -> Response {
        request(self.addr, "POST", path, Some(body.to_string().as_bytes()), &[("Content-Type", "application/json")])
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
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

#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

pub fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(READ_TIMEOUT_S))).unwrap();
    s.set_nodelay(true).unwrap();
    s
}

fn write_request(s: &mut TcpStream, method: &str, path: &str, body: Option<&[u8]>, headers: &[(&str, &str)]) {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        head.push_str(&format!("Content-Length: {}\r\n", b.len()));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    if let Some(b) = body {
        s.write_all(b).unwrap();
    }
}

pub fn request(addr: SocketAddr, method: &str, path: &str, body: Option<&[u8]>, headers: &[(&str, &str)]) -> Response {
    let mut s = connect(addr);
    write_request(&mut s, method, path, body, headers);
    let mut r = BufReader::new(s);
    let (status, headers) = read_head(&mut r);
    let body = read_body(&mut r, &headers);
    Response { status, headers, body }
}

fn read_head(r: &mut impl BufRead) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    r.read_line(&mut line).expect("status line");
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .unwrap_or_else(|| panic!("bad status line {line:?}"))
        .parse()
        .unwrap();
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line).expect("header line");
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        let (k, v) = l.split_once(':').expect("header");
        headers.push((k.trim().to_string(), v.trim().to_string()));
    }
    (status, headers)
}

fn is_chunked(headers: &[(String, String)]) -> bool {
    headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked"))
}

fn read_body(r: &mut impl BufRead, headers: &[(String, String)]) -> Vec<u8> {
    let mut body = Vec::new();
    if is_chunked(headers) {
        while let Some(chunk) = read_chunk(r) {
            body.extend(chunk);
        }
    } else if let Some((_, n)) = headers.iter().find(|(k, _)| k.eq_ignore_ascii_case("content-length")) {
        body.resize(n.parse().unwrap(), 0);
        r.read_exact(&mut body).unwrap();
    } else {
        r.read_to_end(&mut body).unwrap();
    }
    body
}

/// Reads one chunk of a chunked body; `None` at the final zero-length chunk.
fn read_chunk(r: &mut impl BufRead) -> Option<Vec<u8>> {
    let mut line = String::new();
    r.read_line(&mut line).ok()?;
    let size = usize::from_str_radix(line.trim(), 16).unwrap_or_else(|_| panic!("bad chunk size line {line:?}"));
    let mut data = vec![0; size];
    r.read_exact(&mut data).unwrap();
    let mut crlf = [0; 2];
    r.read_exact(&mut crlf).unwrap();
    assert_eq!(&crlf, b"\r\n", "chunk not followed by CRLF");
    (size > 0).then_some(data)
}

/// A streaming response read event by event.
pub struct Sse {
    reader: BufReader<TcpStream>,
    pub status: u16,
    pending: Vec<u8>,
    finished: bool,
}

impl Sse {
    pub fn open(addr: SocketAddr, path: &str, body: &Value) -> Sse {
        let mut s = connect(addr);
        write_request(&mut s, "POST", path, Some(body.to_string().as_bytes()), &[("Content-Type", "application/json")]);
        let mut reader = BufReader::new(s);
        let (status, headers) = read_head(&mut reader);
        if status == 200 {
            assert!(is_chunked(&headers), "SSE must be chunked: {headers:?}");
        }
        Sse {
            reader,
            status,
            pending: Vec::new(),
            finished: status != 200,
        }
    }

    /// The next event's data (`[DONE]` included); `None` when the body ended.
    pub fn next_data(&mut self) -> Option<String> {
        loop {
            if let Some(end) = self.pending.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = self.pending.drain(..end + 2).collect();
                let text = String::from_utf8(event).expect("SSE event is UTF-8");
                let data = text
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: "))
                    .collect::<Vec<_>>()
                    .join("\n");
                return Some(data);
            }
            if self.finished {
                assert!(self.pending.is_empty(), "trailing bytes in SSE body");
                return None;
            }
            match read_chunk(&mut self.reader) {
                Some(c) => self.pending.extend(c),
                None => self.finished = true,
            }
        }
    }

    /// The next event parsed as JSON; `None` at `[DONE]` or the end.
    pub fn next_json(&mut self) -> Option<Value> {
        let data = self.next_data()?;
        if data == "[DONE]" {
            return None;
        }
        Some(serde_json::from_str(&data).unwrap_or_else(|e| panic!("event is not JSON ({e}): {data}")))
    }

    pub fn into_stream(self) -> TcpStream {
        self.reader.into_inner()
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

/// Waits until `cond` holds, polling; panics with `what` after `limit`.
pub fn wait_until(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A long, varied prompt of about `lines * 20` tokens.
pub fn long_prompt(lines: usize) -> String {
    let animals = ["fox", "cat", "owl", "horse", "otter", "crow", "lynx", "mole"];
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
