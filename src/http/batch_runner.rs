//! Runs batch lines on the capacity interactive traffic leaves: each line
//! is a request built in memory and handed to the same handler code as a
//! request from a socket (`http::handle`), with `X-Priority: batch`, so it
//! goes through the same checks, admission (the batch class: its own
//! queue, never the slots kept for interactive requests), prefix cache and
//! engine, and is logged and counted like any other.
//!
//! `--batch-concurrency` workers (`sluice-batch-N`), each with one line at
//! a time. A line refused for overload (429, 503) is not a result: it goes
//! back to pending and its worker waits the `retry-after-ms` it was told.
//! Any other answer is the line's one result (`Store::record`). Worker 0
//! also moves batches on (cancelled, expired, or with no line left: their
//! output and error files) and removes what outlived the retention.
//!
//! Batch lines take only capacity interactive traffic leaves: a worker
//! starts a line only while no interactive request runs or waits, and the
//! watcher (`sluice-yield`) preempts the lines in flight when one arrives:
//! it sets their cancel flags (`Preemption`, which the intake gives each
//! line's flags to), so the engine frees their slots at its next step (or
//! aborts a pass that served only them), as for a request whose client left;
//! a preempted line is not a result and runs again later (its prompt's KV
//! state is in the prefix cache). So interactive streams share their steps
//! with batch lines only until the watcher has seen them.

use super::AppState;
use crate::batch::{new_id, now_s, Line, Status};
use crate::priority::Class;
use crate::stream::{CancelFlag, CancelReason};
use crossbeam_channel::Receiver;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::Write;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tiny_http::{Completion, HTTPVersion, Header, Method, Request};

/// How long an idle worker waits for a new batch before it looks again.
const IDLE_WAIT: Duration = Duration::from_secs(1);
/// How often expired files and old batches are removed.
const REMOVE_EVERY: Duration = Duration::from_secs(60);
/// Bounds on the wait after an overload refusal.
const RETRY_WAIT_MIN_MS: u64 = 50;
const RETRY_WAIT_MAX_MS: u64 = 10_000;

/// How often the watcher looks for interactive requests, and how long a
/// worker that yields waits before it looks again.
const WATCH_INTERVAL: Duration = Duration::from_millis(5);
const YIELD_WAIT: Duration = Duration::from_millis(20);

/// The lines being run now: `(batch id, line number)`.
type Running = Mutex<Vec<(String, i64)>>;

/// The batch lines in flight, by request id, and their cancel flags: the
/// runner registers a line before handing it to the handlers, the intake
/// attaches the flags of its jobs (`attach`), the watcher cancels them all
/// (`preempt_all`), and the runner learns on `finish` whether it did.
#[derive(Default)]
pub struct Preemption {
    lines: Mutex<HashMap<String, Preemptible>>,
    /// Signalled when a line is registered: the watcher sleeps until then.
    registered: Condvar,
}

#[derive(Default)]
struct Preemptible {
    flags: Vec<CancelFlag>,
    preempted: bool,
}

impl Preemption {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Preemptible>> {
        self.lines.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn register(&self, id: &str) {
        self.lock().insert(id.to_string(), Preemptible::default());
        self.registered.notify_all();
    }

    /// Waits until a line not yet preempted is in flight, at most `limit`.
    fn wait_busy(&self, limit: Duration) -> bool {
        let idle = |m: &mut HashMap<String, Preemptible>| m.values().all(|p| p.preempted);
        let (m, _) = self
            .registered
            .wait_timeout_while(self.lock(), limit, idle)
            .unwrap_or_else(|p| p.into_inner());
        m.values().any(|p| !p.preempted)
    }

    /// Whether the line was preempted; it is forgotten.
    fn finish(&self, id: &str) -> bool {
        self.lock().remove(id).is_some_and(|p| p.preempted)
    }

    /// The cancel flags of the line `id`'s jobs, if `id` is a line in flight;
    /// cancelled at once if it was preempted before they existed.
    pub fn attach(&self, id: &str, flags: &[CancelFlag]) {
        if let Some(p) = self.lock().get_mut(id) {
            if p.preempted {
                flags
                    .iter()
                    .for_each(|f| f.cancel(CancelReason::Preempted, 0));
            }
            p.flags.extend(flags.iter().cloned());
        }
    }

    fn busy(&self) -> bool {
        self.lock().values().any(|p| !p.preempted)
    }

    fn preempt_all(&self, step: u64) {
        for p in self.lock().values_mut() {
            p.preempted = true;
            p.flags
                .iter()
                .for_each(|f| f.cancel(CancelReason::Preempted, step));
        }
    }
}

/// Starts the workers and their watcher; they stop once the server drains.
pub fn start(
    state: Arc<AppState>,
    wake: Receiver<()>,
    workers: usize,
) -> Result<Vec<JoinHandle<()>>, String> {
    let running: Arc<Running> = Arc::default();
    let mut threads = (0..workers)
        .map(|i| {
            let (state, wake, running) = (Arc::clone(&state), wake.clone(), Arc::clone(&running));
            std::thread::Builder::new()
                .name(format!("sluice-batch-{i}"))
                .spawn(move || work(&state, &wake, &running, i == 0))
                .map_err(|e| format!("cannot start a batch worker: {e}"))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let watcher = std::thread::Builder::new()
        .name("sluice-yield".into())
        .spawn(move || watch(&state))
        .map_err(|e| format!("cannot start the batch watcher: {e}"))?;
    threads.push(watcher);
    Ok(threads)
}

/// Interactive requests in a slot or waiting for one: batch lines yield.
fn interactive_present(state: &AppState) -> bool {
    state.queue.holds(Class::Interactive) > 0
}

/// Preempts the lines in flight whenever an interactive request is present.
fn watch(state: &AppState) {
    let Some(api) = state.batches.as_ref() else {
        return;
    };
    while !state.stopping.load(Ordering::Relaxed) {
        // Asleep while no line is in flight: an idle box pays no wake-ups.
        if !api.preemption.wait_busy(IDLE_WAIT) {
            continue;
        }
        std::thread::sleep(WATCH_INTERVAL);
        if api.preemption.busy() && interactive_present(state) {
            api.preemption
                .preempt_all(state.metrics.steps.load(Ordering::Relaxed));
        }
    }
}

fn lock(running: &Running) -> std::sync::MutexGuard<'_, Vec<(String, i64)>> {
    running.lock().unwrap_or_else(|p| p.into_inner())
}

fn work(state: &AppState, wake: &Receiver<()>, running: &Running, keeper: bool) {
    let Some(api) = state.batches.as_ref() else {
        return;
    };
    let mut removed_at: Option<Instant> = None;
    while !state.stopping.load(Ordering::Relaxed) {
        if keeper {
            settle(state, running);
            if removed_at.is_none_or(|t| t.elapsed() >= REMOVE_EVERY) {
                let (files, batches) = api.store.remove_expired(now_s());
                if files + batches > 0 {
                    crate::say!("sluice: batch store: removed {files} expired files and {batches} old batches");
                }
                removed_at = Some(Instant::now());
            }
        }
        let claimed = {
            let mut r = lock(running);
            let line = api.store.pending(&r, 1).pop();
            if let Some(l) = &line {
                r.push((l.batch_id.clone(), l.line));
            }
            line
        };
        let Some(line) = claimed else {
            let _ = wake.recv_timeout(IDLE_WAIT);
            continue;
        };
        // Only capacity interactive requests leave (checked once there is
        // a line to run: with no batch work, the workers stay asleep). The
        // line stays claimed while they are present, and only the gate is
        // looked at meanwhile (no query); the keeper still settles batches.
        let mut settled = Instant::now();
        while interactive_present(state) && !state.stopping.load(Ordering::Relaxed) {
            std::thread::sleep(YIELD_WAIT);
            if keeper && settled.elapsed() >= IDLE_WAIT {
                settle(state, running);
                settled = Instant::now();
            }
        }
        if state.stopping.load(Ordering::Relaxed) {
            break;
        }
        let outcome = run(state, &line);
        if let Outcome::Result { ok, text } = &outcome {
            api.store.record(&line.batch_id, line.line, *ok, text);
        }
        lock(running).retain(|(b, n)| !(*b == line.batch_id && *n == line.line));
        match outcome {
            Outcome::Again { wait } => std::thread::sleep(wait),
            // The last line of a batch: the keeper finalizes it at once.
            Outcome::Result { .. } => {
                let _ = api.wake.try_send(());
            }
        }
    }
}

/// Cancelled and expired batches' pending lines fail (those running finish
/// first); batches with no line pending or running get their files and
/// their end.
fn settle(state: &AppState, running: &Running) {
    let Some(api) = state.batches.as_ref() else {
        return;
    };
    let now = now_s();
    for (batch, pending) in api.store.to_settle(now) {
        let ending = match batch.status {
            Status::Cancelling => Some((
                "batch_cancelled",
                "the batch was cancelled before this line ran",
                Status::Cancelled,
            )),
            _ if batch.expires_at <= now => Some((
                "batch_expired",
                "the batch's completion window ended before this line ran",
                Status::Expired,
            )),
            _ => None,
        };
        let busy = |l: &Line| {
            lock(running)
                .iter()
                .any(|(b, n)| *b == l.batch_id && *n == l.line)
        };
        if let Some((code, message, _)) = ending {
            for l in pending.iter().filter(|l| !busy(l)) {
                let text = error_line(&new_id("batch_req_"), l, None, code, message);
                api.store.record(&l.batch_id, l.line, false, &text);
            }
        }
        if pending.iter().any(busy) || (ending.is_none() && !pending.is_empty()) {
            continue;
        }
        let end = ending.map_or(Status::Completed, |(_, _, end)| end);
        match api.store.finalize(&batch.id, end) {
            Ok(()) => crate::say!(
                "sluice: batch {} {}: {} lines",
                batch.id,
                end.name(),
                batch.total
            ),
            Err(e) => crate::say!("sluice: batch {}: cannot finalize: {e:?}", batch.id),
        }
    }
}

enum Outcome {
    /// Refused for overload: run it again after `wait`.
    Again { wait: Duration },
    /// The line's result: a line of the output file (`ok`) or the error file.
    Result { ok: bool, text: String },
}

/// A response written into memory.
#[derive(Clone, Default)]
struct Buffer(Arc<Mutex<Vec<u8>>>);

impl Write for Buffer {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn header(name: &str, value: &str) -> Header {
    Header::from_bytes(name.as_bytes(), value.as_bytes()).expect("a valid header")
}

/// One line through the handlers, as a request from this host (port 0:
/// no socket's peer has it), whose jobs the watcher may preempt.
fn run(state: &AppState, line: &Line) -> Outcome {
    let id = new_id("batch_req_");
    let mut headers = vec![
        header("Host", "localhost"),
        header("Content-Type", "application/json"),
        header("X-Priority", "batch"),
        header("X-Request-Id", &id),
    ];
    if let Some(keys) = &state.cfg.api_keys {
        match keys.by_name(&line.owner) {
            Some(k) => headers.push(header("Authorization", &format!("Bearer {}", k.secret()))),
            None => {
                let message = "the API key that made this batch is no longer in --api-key-file";
                let text = error_line(&id, line, None, "invalid_api_key", message);
                return Outcome::Result { ok: false, text };
            }
        }
    }
    let out = Buffer::default();
    let req = Request::from_parts(
        Method::Post,
        line.endpoint.clone(),
        HTTPVersion(1, 1),
        headers,
        Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0))),
        line.body.as_bytes().to_vec(),
        Box::new(out.clone()),
        Completion::default(),
    );
    let preemption = state.batches.as_ref().map(|api| &api.preemption);
    preemption.inspect(|p| p.register(&id));
    super::handle(state, req);
    if preemption.is_some_and(|p| p.finish(&id)) {
        // Not a result: the line runs again once interactive requests are gone.
        return Outcome::Again {
            wait: Duration::ZERO,
        };
    }
    let bytes = std::mem::take(&mut *out.0.lock().unwrap_or_else(|p| p.into_inner()));
    let Some(resp) = parse_response(&bytes) else {
        let text = error_line(
            &id,
            line,
            None,
            "server_error",
            "the server wrote no response",
        );
        return Outcome::Result { ok: false, text };
    };
    if matches!(resp.status, 429 | 503) && resp.header("x-should-retry") != Some("false") {
        let ms = resp
            .header("retry-after-ms")
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(1000)
            .clamp(RETRY_WAIT_MIN_MS, RETRY_WAIT_MAX_MS);
        return Outcome::Again {
            wait: Duration::from_millis(ms),
        };
    }
    let body: Value = serde_json::from_slice(&resp.body).unwrap_or(Value::Null);
    let response = json!({"status_code": resp.status, "request_id": id, "body": body});
    if resp.status == 200 {
        let text =
            json!({"id": id, "custom_id": line.custom_id, "response": response, "error": null});
        return Outcome::Result {
            ok: true,
            text: text.to_string(),
        };
    }
    let code = body["error"]["code"]
        .as_str()
        .unwrap_or("error")
        .to_string();
    let message = body["error"]["message"].as_str().unwrap_or("").to_string();
    let text = error_line(&id, line, Some(response), &code, &message);
    Outcome::Result { ok: false, text }
}

/// A line of a batch's error file.
fn error_line(id: &str, line: &Line, response: Option<Value>, code: &str, message: &str) -> String {
    json!({
        "id": id,
        "custom_id": line.custom_id,
        "response": response,
        "error": {"code": code, "message": message},
    })
    .to_string()
}

struct Parsed {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Parsed {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// An HTTP/1.1 response as tiny_http writes it: status line, headers, and a
/// body of `Content-Length` bytes or in chunks.
fn parse_response(bytes: &[u8]) -> Option<Parsed> {
    let end = bytes.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&bytes[..end]).ok()?;
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut p = Parsed {
        status,
        headers,
        body: Vec::new(),
    };
    let rest = &bytes[end + 4..];
    if p.header("transfer-encoding")
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"))
    {
        p.body = dechunk(rest)?;
    } else {
        let n = p
            .header("content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(rest.len());
        p.body = rest.get(..n)?.to_vec();
    }
    Some(p)
}

fn dechunk(mut rest: &[u8]) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let eol = rest.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&rest[..eol]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        rest = &rest[eol + 2..];
        if size == 0 {
            return Some(body);
        }
        body.extend_from_slice(rest.get(..size)?);
        rest = rest.get(size + 2..)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_preempted_line_has_its_flags_cancelled_even_those_attached_later() {
        let p = Preemption::default();
        assert!(!p.wait_busy(Duration::from_millis(1)), "nothing in flight");
        p.register("a");
        assert!(p.wait_busy(Duration::from_secs(600)), "a line in flight");
        p.register("b");
        let early = CancelFlag::default();
        p.attach("a", std::slice::from_ref(&early));
        p.attach("stranger", &[CancelFlag::default()]);
        assert!(p.busy());
        p.preempt_all(7);
        assert_eq!(early.reason(), Some(CancelReason::Preempted));
        assert_eq!(early.at_step(), 7);
        assert!(!p.busy(), "nothing left to preempt");
        let late = CancelFlag::default();
        p.attach("b", std::slice::from_ref(&late));
        assert_eq!(
            late.reason(),
            Some(CancelReason::Preempted),
            "cancelled on attach"
        );
        assert!(p.finish("a") && p.finish("b"));
        assert!(!p.finish("a"), "forgotten once finished");
        p.register("c");
        assert!(!p.finish("c"), "not preempted");
    }

    #[test]
    fn responses_are_read_whole_with_either_framing() {
        let plain = b"HTTP/1.1 429 Too Many Requests\r\nretry-after-ms: 1200\r\nContent-Length: 2\r\n\r\n{}";
        let p = parse_response(plain).unwrap();
        assert_eq!(
            (p.status, p.header("Retry-After-Ms"), p.body.as_slice()),
            (429, Some("1200"), &b"{}"[..])
        );
        let chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        assert_eq!(parse_response(chunked).unwrap().body, b"abcde");
        assert!(parse_response(b"HTTP/1.1 200 OK\r\n").is_none());
    }
}
