//! The API over HTTP: the handlers, routes, status codes and JSON (the front
//! door, `door`, reads the connections and refuses what never reaches them).
//!
//! A fixed pool of handler threads (`sluice-http-N`) takes requests from
//! the front door (`door`). A handler parses, caps and validates the body, counts the prompt in
//! tokens, submits a `Job` to admission (`try_send`, never blocking), then writes
//! the answer: one JSON body, or Server-Sent Events flushed per token through the
//! raw socket writer. The pool is sized so that handlers of every running and
//! queued request can be busy streaming and `/health` is still answered.
//!
//! The door runs its own I/O threads: `sluice-accept`, and one per open
//! connection (`sluice-conn`; they read and parse requests and never compute).

pub mod agent;
pub mod batch_input;
pub mod batch_runner;
pub mod batches;
mod embeddings;
pub mod error;
mod fields;
mod guard;
mod hold;
mod intake;
pub mod openai;
mod output;
pub mod prompt;
mod reply;
mod request;
mod retry;

pub use retry::Tarpit;
pub mod sse;
mod status;
mod tokens;
pub mod tools;
pub mod validation;

use crate::admission::{Admission, QueueGauge};
use crate::config::Config;
use crate::door::{self, Door};
use crate::ffi;
use crate::metrics::Metrics;
use crate::ratelimit::RateLimiter;
use crate::stream::Usage;
use crossbeam_channel::bounded;
use error::ApiError;
use prompt::Prompter;
use serde_json::{json, Value};
use std::net::TcpListener;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tiny_http::{Header, Method, Request, Response};
use validation::Api;

/// The engine loop turns at least every 100 ms when idle and once per step when
/// busy; a step is at most `--step-tokens` tokens. Silence this long means wedged.
const LIVENESS_STALE: Duration = Duration::from_secs(120);
/// Connections the kernel holds for accept. At the connection bound each
/// accept closes the longest-waiting connection for room, so a burst of
/// connects can outrun the accept loop for a moment; a full queue drops SYNs,
/// and a dropped client waits a second for its retransmit. Bounded all the
/// same (and capped by `net.core.somaxconn`).
pub const LISTEN_BACKLOG: u32 = 1024;
/// Longest request line or header line; over it, 431.
pub const HEADER_LINE_BYTES_MAX: usize = 8 * 1024;
/// Most header lines; over it, 431.
pub const HEADERS_MAX: usize = 100;
/// Most bytes of header lines in all; over it, 431.
pub const HEADER_BYTES_MAX: usize = 32 * 1024;
/// After a refusal whose request was not read to its end (413, 400), the
/// connection discards what the client still sends for at most this long and
/// this many bytes before it closes, so that the client reads the refusal
/// rather than a reset (nginx's lingering close).
pub const LINGER: Duration = Duration::from_secs(10);
pub const LINGER_BYTES_MAX: usize = 64 << 20;

/// Everything a handler thread needs.
pub struct AppState {
    pub cfg: Config,
    pub prompter: Prompter,
    /// How `/v1/embeddings` pools token states; `None`: it refuses, for the
    /// reason `pooling_source` gives.
    pub pooling: Option<crate::embed::Pooling>,
    /// Where the pooling came from (the GGUF, `--pooling`), or why there is none.
    pub pooling_source: String,
    /// Floats in one embedding.
    pub n_embd: usize,
    /// Structured output over this model's vocabulary, or why there is none.
    pub grammars: Result<Arc<crate::grammar::Grammars>, String>,
    pub admission: Admission,
    /// What is waiting in admission, and the bounds (for `/metrics`), and
    /// what the prefix cache holds: a request is charged (client bucket,
    /// queued-token budget) only for the prompt tokens it will prefill.
    pub queue: Arc<QueueGauge>,
    pub metrics: Arc<Metrics>,
    pub http_threads: usize,
    /// Most open connections (`--max-connections`, or derived).
    pub max_connections: usize,
    /// Requests read whole and waiting for a handler, at most.
    pub http_queue_depth: usize,
    /// Handlers inside a request now.
    pub handlers_busy: AtomicUsize,
    /// Handler panics caught (each answered 500; the handler goes on).
    pub handler_panics: AtomicU64,
    /// What `SLUICE_TEST_HOOKS` turns on, for tests of the front.
    pub test_hooks: TestHooks,
    /// The HTTP front's counters, once it runs.
    pub front: std::sync::OnceLock<Arc<Door>>,
    /// KV cells in the context: no request may need more.
    pub n_ctx: usize,
    /// Most tokens one request may span (prompt + max_tokens): the KV cells,
    /// and no more than the model was trained for.
    pub seq_tokens_max: usize,
    /// The same for a batch request: no more than batch may reserve of the KV cache.
    pub batch_seq_tokens_max: usize,
    /// Per-client token buckets.
    pub limiter: RateLimiter,
    /// The Batch API's store and its runner's wake-up; `None`: off.
    pub batches: Option<batches::BatchApi>,
    /// The return time each client refused for overload was given.
    pub retries: retry::RetryLedger,
    /// Holds the refusals of clients that came back early.
    pub tarpit: retry::Tarpit,
    /// Set on SIGTERM/SIGINT: not ready (new requests are still served during
    /// `--drain-notice-ms`).
    pub stopping: std::sync::atomic::AtomicBool,
    /// Set when the drain notice has passed: no new requests; the accepted ones finish.
    pub draining: std::sync::atomic::AtomicBool,
    /// Completion requests being handled (the drain waits for them).
    pub in_flight: std::sync::atomic::AtomicUsize,
    pub next_id: AtomicU64,
    pub started_unix_s: u64,
}

/// Hooks for tests of the front, off unless `SLUICE_TEST_HOOKS` names them
/// (comma-separated).
#[derive(Clone, Copy, Debug, Default)]
pub struct TestHooks {
    /// `panic`: a request with `X-Sluice-Test-Panic` makes its handler panic
    /// (handlers must survive it).
    pub panic: bool,
    /// `hold`: a request with `X-Sluice-Test-Hold` holds its handler until its
    /// client leaves (to fill the handlers and their queue).
    pub hold: bool,
}

impl TestHooks {
    pub fn from_env() -> TestHooks {
        let v = std::env::var("SLUICE_TEST_HOOKS").unwrap_or_default();
        let on = |name: &str| v.split(',').any(|h| h.trim() == name);
        TestHooks {
            panic: on("panic"),
            hold: on("hold"),
        }
    }
}

/// How long a held request waits for its client to leave, at most.
const TEST_HOLD_MAX: Duration = Duration::from_secs(600);

/// The running HTTP front.
pub struct Front {
    _handlers: Vec<JoinHandle<()>>,
    door: Arc<Door>,
}

impl Front {
    /// False once the door's accept thread has stopped for good (its listener
    /// failed): a process that accepts nothing must exit, so that it is restarted.
    pub fn is_accepting(&self) -> bool {
        self.door.is_accepting()
    }

    /// Accepts that failed and were waited out so far (out of descriptors or
    /// memory, ...), and the last one's error.
    pub fn accept_errors(&self) -> (u64, std::io::Error) {
        let st = self.door.stats();
        (
            st.accept_errors.load(Ordering::Relaxed),
            std::io::Error::from_raw_os_error(st.last_accept_errno.load(Ordering::Relaxed)),
        )
    }
}

/// Opens the door on `listener` and starts the handler pool.
pub fn start(state: Arc<AppState>, listener: TcpListener) -> Result<Front, String> {
    // Accepted sockets inherit TCP_NODELAY from the listener; without it Nagle's
    // algorithm and delayed ACKs add tens of milliseconds to every token.
    ffi::set_tcp_nodelay(&listener).map_err(|e| format!("cannot set TCP_NODELAY: {e}"))?;
    ffi::set_listen_backlog(&listener, LISTEN_BACKLOG)
        .map_err(|e| format!("cannot set the listen backlog: {e}"))?;
    ffi::set_send_limits(
        &listener,
        state.cfg.stall_timeout,
        state.cfg.send_buffer_bytes,
    )
    .map_err(|e| format!("cannot set SO_SNDTIMEO and SO_SNDBUF: {e}"))?;
    // What a client may send, and how long it may take, is enforced on its
    // connection's thread: a slow, oversized or malformed request never holds
    // a handler, and a connection has one request in flight at most (`door`).
    let limits = door::ConnectionLimits {
        header_timeout: state.cfg.header_timeout,
        body_timeout: state.cfg.client_timeout,
        keep_alive: state.cfg.keep_alive,
        write_timeout: state.cfg.stall_timeout,
        header_line_bytes_max: HEADER_LINE_BYTES_MAX,
        headers_max: HEADERS_MAX,
        header_bytes_max: HEADER_BYTES_MAX,
        body_bytes_max: state.cfg.body_bytes_max,
        uploads: match &state.batches {
            Some(api) => door::Uploads {
                paths: batches::UPLOAD_PATHS,
                bytes_max: api.store.limits().file_bytes_max + batches::UPLOAD_OVERHEAD_BYTES,
                at_once: batches::UPLOADS_AT_ONCE,
            },
            None => door::Uploads::default(),
        },
        max_connections: state.max_connections,
        handlers: state.http_threads,
        queue_depth: state.http_queue_depth,
        linger: LINGER,
        linger_bytes_max: LINGER_BYTES_MAX,
    };
    let door =
        Door::open(listener, limits).map_err(|e| format!("cannot open the front door: {e}"))?;
    let door = Arc::new(door);
    let _ = state.front.set(Arc::clone(&door));

    let n = state.http_threads;
    let mut handles = Vec::with_capacity(n);
    // "Listening" is only said once every handler runs under its own name.
    let (started_tx, started_rx) = bounded::<()>(n);
    for i in 0..n {
        let door = Arc::clone(&door);
        let state = Arc::clone(&state);
        let started = started_tx.clone();
        let handle = std::thread::Builder::new()
            .name(format!("sluice-http-{i}"))
            .spawn(move || {
                let _ = started.send(());
                drop(started);
                while let Some(req) = door.recv() {
                    state.handlers_busy.fetch_add(1, Ordering::SeqCst);
                    // A panic is this request's alone: its `Request` is dropped
                    // while unwinding, which answers 500, and the handler goes on.
                    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        handle(&state, req);
                    }));
                    state.handlers_busy.fetch_sub(1, Ordering::SeqCst);
                    if caught.is_err() {
                        state.handler_panics.fetch_add(1, Ordering::Relaxed);
                        crate::say!(
                            "sluice: a handler panicked; the request got 500, the handler goes on"
                        );
                    }
                }
            })
            .map_err(|e| format!("cannot start handler thread: {e}"))?;
        handles.push(handle);
    }
    drop(started_tx);
    for _ in 0..n {
        started_rx
            .recv()
            .map_err(|_| "a handler thread died while starting".to_string())?;
    }
    Ok(Front {
        _handlers: handles,
        door,
    })
}

fn handle(state: &AppState, mut req: Request) {
    let id = request_id_of(&req);
    req.add_response_header(header("X-Request-Id", &id));
    let path = req.url().split('?').next().unwrap_or("").to_string();
    let method = req.method().clone();
    let Some(mut req) = test_hook(state, req) else {
        return;
    };
    if let Err(e) = guard::admit(state, &mut req) {
        state.metrics.forbidden.fetch_add(1, Ordering::Relaxed);
        log_refusal(&req, &e);
        respond_error(req, &e);
        return;
    }
    match (&method, path.as_str()) {
        // Liveness never depends on load: only a wedged engine makes it fail.
        (Method::Get, "/livez" | "/health") => {
            let age = state.metrics.heartbeat_age();
            if age < LIVENESS_STALE {
                respond_json(req, 200, &json!({"status": "ok"}));
            } else {
                let body =
                    json!({"status": "engine stalled", "heartbeat_age_ms": age.as_millis() as u64});
                respond_json(req, 503, &body);
            }
        }
        // Readiness: not while draining, nor while requests leave the queue
        // past the sojourn target.
        (Method::Get, "/readyz") => match not_ready(state) {
            Some(reason) => {
                let shedding = state.metrics.shedding.load(Ordering::Relaxed);
                let body = json!({"status": "not ready", "reason": reason, "shedding": shedding});
                respond_json(req, 503, &body);
            }
            None => respond_json(req, 200, &json!({"status": "ready"})),
        },
        (Method::Get, p) if p == "/v1/models" || p.starts_with("/v1/models/") => {
            models(state, req, path)
        }
        (Method::Post, "/tokenize" | "/v1/tokenize" | "/detokenize" | "/v1/detokenize") => {
            tokenize_route(state, req, path.ends_with("/tokenize"))
        }
        (Method::Get, "/" | "/index.html") => {
            let resp = Response::from_string(STATUS_PAGE)
                .with_header(header("Content-Type", "text/html; charset=utf-8"))
                .with_header(header("Cache-Control", "no-store"));
            let _ = req.respond(resp);
        }
        (Method::Get, "/status") => respond_json(req, 200, &status::status_json(state)),
        (Method::Get, "/metrics") => {
            let resp = Response::from_string(status::metrics_text(state))
                .with_header(header("Content-Type", "text/plain; version=0.0.4"));
            let _ = req.respond(resp);
        }
        (Method::Post, "/v1/chat/completions") => request::generate(state, req, Api::Chat),
        (Method::Post, "/v1/completions") => request::generate(state, req, Api::Completions),
        (Method::Post, "/v1/embeddings" | "/embeddings") => embeddings::embed(state, req),
        (m, p) if batches::is_route(p) && *m != Method::Options => {
            batches::handle(state, req, &method, &path)
        }
        (Method::Options, p) if ROUTES.contains(&p) => {
            let resp = Response::empty(204).with_header(header("Allow", guard::METHODS));
            let _ = req.respond(resp);
        }
        (_, p) if ROUTES.contains(&p) => {
            let e = ApiError::MethodNotAllowed {
                method: method.to_string(),
                path,
            };
            log_refusal(&req, &e);
            respond_error(req, &e);
        }
        _ => {
            let e = ApiError::NotFound { path };
            log_refusal(&req, &e);
            respond_error(req, &e);
        }
    }
}

/// The test hooks (`SLUICE_TEST_HOOKS`): a handler that panics, or holds
/// its request until the client leaves. `None` when a hook answered.
fn test_hook(state: &AppState, mut req: Request) -> Option<Request> {
    let has = |name: &'static str| req.headers().iter().any(|h| h.field.equiv(name));
    if state.test_hooks.panic && has("X-Sluice-Test-Panic") {
        panic!("X-Sluice-Test-Panic (SLUICE_TEST_HOOKS=panic)");
    }
    if state.test_hooks.hold && has("X-Sluice-Test-Hold") {
        crate::say!("sluice: test hook: a handler holds a request until its client leaves");
        let t0 = Instant::now();
        if let Some(probe) = req.take_peer_socket() {
            while !ffi::peer_closed(&probe) && t0.elapsed() < TEST_HOLD_MAX {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        respond_json(
            req,
            200,
            &json!({"held_ms": t0.elapsed().as_millis() as u64}),
        );
        return None;
    }
    Some(req)
}

/// `GET /v1/models` and `GET /v1/models/{name}`: the one model served.
fn models(state: &AppState, req: Request, path: String) {
    if let Err(e) = intake::authenticate(state, &req) {
        state.metrics.unauthorized.fetch_add(1, Ordering::Relaxed);
        respond_error(req, &e);
        return;
    }
    match path.strip_prefix("/v1/models/") {
        None => {
            let body = json!({"object": "list", "data": [model_object(state)]});
            respond_json(req, 200, &body);
        }
        Some(name) if name == state.cfg.model_name => respond_json(req, 200, &model_object(state)),
        Some(_) => {
            let e = ApiError::NotFound { path };
            log_refusal(&req, &e);
            respond_error(req, &e);
        }
    }
}

/// `POST /tokenize` and `/detokenize` (also under `/v1/`).
fn tokenize_route(state: &AppState, mut req: Request, tokenize: bool) {
    let answer = intake::authenticate(state, &req)
        .inspect_err(|_| {
            state.metrics.unauthorized.fetch_add(1, Ordering::Relaxed);
        })
        .and_then(|_| intake::json_body(state, &mut req))
        .and_then(|body| {
            if tokenize {
                tokens::tokenize(state, &body)
            } else {
                tokens::detokenize(state, &body)
            }
        });
    match answer {
        Ok(v) => respond_json(req, 200, &v),
        Err(e) => respond_error(req, &e),
    }
}

/// The status page (`GET /`): one self-contained page, no CDN; it draws
/// `GET /status` every second.
const STATUS_PAGE: &str = include_str!("status.html");

/// Every path the server answers (besides `/v1/models/{id}`).
const ROUTES: [&str; 18] = [
    "/",
    "/v1/files",
    "/v1/batches",
    "/index.html",
    "/status",
    "/health",
    "/livez",
    "/readyz",
    "/v1/models",
    "/metrics",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/embeddings",
    "/tokenize",
    "/v1/tokenize",
    "/detokenize",
    "/v1/detokenize",
];

/// The served model, as `/v1/models` lists it.
fn model_object(state: &AppState) -> Value {
    json!({
        "id": state.cfg.model_name,
        "object": "model",
        "created": state.started_unix_s,
        "owned_by": "sluice",
        "context_length": state.seq_tokens_max,
    })
}

/// One line for a request refused before routing or routed nowhere (403,
/// 404, 405): the path, cut to a readable length, and the error code.
fn log_refusal(req: &Request, e: &ApiError) {
    let url = req.url();
    let method = req.method();
    let shown: String = url.chars().take(120).collect();
    let cut = if shown.len() < url.len() { "..." } else { "" };
    let id = request_id(req);
    let text = format!(
        "sluice: {method} {shown}{cut} {} {} id={id}",
        e.status(),
        e.code()
    );
    let mut f = serde_json::Map::new();
    f.insert("method".into(), method.to_string().into());
    f.insert("path".into(), format!("{shown}{cut}").into());
    f.insert("status".into(), e.status().into());
    f.insert("id".into(), id.into());
    f.insert("note".into(), e.code().into());
    crate::log::request(&text, f);
}

/// Why this replica should get no new requests now, if it should not: it is
/// draining, or interactive requests wait past the sojourn target (the head
/// of the queue now, or those that left it lately). A full queue alone is not
/// a reason: behind a load balancer that keeps each replica at its capacity
/// (HAProxy's maxconn), a full queue is the normal state of a busy replica.
fn not_ready(state: &AppState) -> Option<&'static str> {
    if state.stopping.load(Ordering::Relaxed) {
        Some("draining")
    } else if state.metrics.sojourn_above_target.load(Ordering::Relaxed) {
        Some("queue sojourn above target")
    } else {
        None
    }
}

fn header(name: &str, value: &str) -> Header {
    Header::from_bytes(name.as_bytes(), value.as_bytes()).expect("static header is valid")
}

fn json_response(status: u16, body: &Value) -> Response<std::io::Cursor<Vec<u8>>> {
    Response::from_string(body.to_string())
        .with_status_code(status)
        .with_header(header("Content-Type", "application/json"))
}

fn respond_json(req: Request, status: u16, body: &Value) {
    let _ = req.respond(json_response(status, body));
}

fn respond_error(req: Request, e: &ApiError) {
    let mut body = e.to_json();
    let id = request_id(&req);
    if !id.is_empty() {
        body["error"]["request_id"] = Value::String(id);
    }
    let mut resp = json_response(e.status(), &body);
    if let Some(ms) = e.wait_ms(fastrand::f64()) {
        // The OpenAI SDKs read retry-after-ms first; both are spread.
        resp.add_header(header(
            "Retry-After",
            &door::refusal::retry_after_header_s(ms).to_string(),
        ));
        resp.add_header(header("retry-after-ms", &ms.to_string()));
    }
    if let Some(retry) = e.should_retry() {
        resp.add_header(header(
            "x-should-retry",
            if retry { "true" } else { "false" },
        ));
    }
    if e.status() == 401 {
        resp.add_header(header("WWW-Authenticate", "Bearer"));
    }
    let _ = req.respond(resp);
}

/// What one request log line says.
struct Outcome {
    status: u16,
    usage: Usage,
    first_token: Option<Duration>,
    note: &'static str,
    /// Prompt tokens the choices reused, summed (`usage` counts the prompt
    /// once); what the client's bucket is settled with.
    cached_all: usize,
}

fn outcome_of_error(e: &ApiError) -> Outcome {
    Outcome {
        status: e.status(),
        usage: Usage::default(),
        first_token: None,
        note: e.code(),
        cached_all: 0,
    }
}

/// One line per completion request: path, status, then `tags` (client and
/// class, once known), tokens, times and the error code.
/// With `--log-format json` the same line's fields are the object's keys
/// (`tags` are ` key=value` pairs).
fn log_request(path: &str, tags: &str, t0: Instant, o: &Outcome) {
    let ttft = o
        .first_token
        .map_or("-".to_string(), |d| format!("{}", d.as_millis()));
    let total_ms = t0.elapsed().as_millis() as u64;
    let text = format!(
        "sluice: POST {path} {}{tags} prompt={} completion={} ttft_ms={ttft} total_ms={total_ms} {}",
        o.status, o.usage.prompt_tokens, o.usage.completion_tokens, o.note
    );
    let mut f = serde_json::Map::new();
    f.insert("method".into(), "POST".into());
    f.insert("path".into(), path.into());
    f.insert("status".into(), o.status.into());
    for (k, v) in tags.split_whitespace().filter_map(|t| t.split_once('=')) {
        f.insert(k.into(), v.into());
    }
    f.insert("prompt_tokens".into(), o.usage.prompt_tokens.into());
    f.insert("completion_tokens".into(), o.usage.completion_tokens.into());
    f.insert(
        "ttft_ms".into(),
        o.first_token.map(|d| d.as_millis() as u64).into(),
    );
    f.insert("total_ms".into(), total_ms.into());
    if !o.note.is_empty() {
        f.insert("note".into(), o.note.into());
    }
    crate::log::request(&text, f);
}

/// `X-Request-Id`: the client's, when it is 1 to `REQUEST_ID_BYTES_MAX`
/// bytes of letters, digits and `-_.:/+=@` (anything else could forge log
/// lines or headers); otherwise one made here (16 hex digits).
fn request_id_of(req: &Request) -> String {
    let given = req
        .headers()
        .iter()
        .find(|h| h.field.equiv("X-Request-Id"))
        .map(|h| h.value.as_str());
    match given {
        Some(id) if valid_request_id(id) => id.to_string(),
        _ => format!("{:016x}", fastrand::u64(..)),
    }
}

/// Longest `X-Request-Id` taken from a client.
pub const REQUEST_ID_BYTES_MAX: usize = 128;

fn valid_request_id(id: &str) -> bool {
    (1..=REQUEST_ID_BYTES_MAX).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:/+=@".contains(&b))
}

/// The request's id (set by `handle` as a response header).
fn request_id(req: &Request) -> String {
    req.response_headers()
        .iter()
        .find(|h| h.field.equiv("X-Request-Id"))
        .map_or_else(String::new, |h| h.value.as_str().to_string())
}
