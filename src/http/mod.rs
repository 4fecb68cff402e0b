//! The HTTP front: the only module that knows about HTTP and JSON.
//!
//! A fixed pool of handler threads (`sluice-http-N`) takes requests from
//! tiny_http. A handler parses, caps and validates the body, counts the prompt in
//! tokens, submits a `Job` to admission (`try_send`, never blocking), then writes
//! the answer: one JSON body, or Server-Sent Events flushed per token through the
//! raw socket writer. The pool is sized so that handlers of every running and
//! queued request can be busy streaming and `/health` is still answered.
//!
//! tiny_http also runs its own I/O threads, one per open connection (they read
//! and parse requests and never compute); they are named `sluice-conn`.

pub mod error;
pub mod openai;
pub mod sse;
pub mod validation;

use crate::admission::{Admission, QueueGauge};
use crate::auth;
use crate::config::Config;
use crate::engine::ffi::{self, SamplingParams};
use crate::engine::prefix::PrefixIndex;
use crate::engine::{GenParams, Job};
use crate::metrics::Metrics;
use crate::priority::Class;
use crate::prompt::Prompter;
use crate::ratelimit::{ClientId, Limit, RateLimiter};
use crate::stream::{CancelFlag, CancelReason, ErrorKind, Event, TokenLogprob, Usage};
use crossbeam_channel::{bounded, Receiver, RecvTimeoutError};
use error::ApiError;
use serde_json::{json, Value};
use std::io::Read;
use std::net::TcpListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tiny_http::{Header, Method, Request, Response, Server};
use validation::{Api, Input, ValidRequest};

/// The engine loop turns at least every 100 ms when idle and once per step when
/// busy; a step is at most `--step-tokens` tokens. Silence this long means wedged.
const LIVENESS_STALE: Duration = Duration::from_secs(120);
/// Longest request line or header line; over it, 431.
pub const HEADER_LINE_BYTES_MAX: usize = 8 * 1024;
/// Most header lines; over it, 431.
pub const HEADERS_MAX: usize = 100;
/// Most bytes of header lines in all; over it, 431.
pub const HEADER_BYTES_MAX: usize = 32 * 1024;
/// How often a handler waiting for the engine checks that its client is still
/// there: well under one engine step on a CPU.
const PEER_PROBE_INTERVAL: Duration = Duration::from_millis(20);

/// Everything a handler thread needs.
pub struct AppState {
    pub cfg: Config,
    pub prompter: Prompter,
    /// What the prefix cache holds: a request is charged (client bucket,
    /// queued-token budget) only for the prompt tokens it will prefill.
    pub prefix: Arc<PrefixIndex>,
    pub admission: Admission,
    /// What is waiting in admission, and the bounds (for `/metrics`).
    pub queue: Arc<QueueGauge>,
    pub metrics: Arc<Metrics>,
    pub http_threads: usize,
    /// KV cells in the context: no request may need more.
    pub n_ctx: usize,
    /// Most tokens one request may span (prompt + max_tokens): the KV cells,
    /// and no more than the model was trained for.
    pub seq_tokens_max: usize,
    /// The same for a batch request: no more than batch may reserve of the KV cache.
    pub batch_seq_tokens_max: usize,
    /// Per-client token buckets.
    pub limiter: RateLimiter,
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

/// The running HTTP front.
pub struct Front {
    _handlers: Vec<JoinHandle<()>>,
    server: Arc<Server>,
}

impl Front {
    /// False once tiny_http's accept thread has stopped for good (its listener
    /// failed): a process that accepts nothing must exit, so that it is restarted.
    pub fn is_accepting(&self) -> bool {
        self.server.is_accepting()
    }
}

/// Starts tiny_http on `listener` and the handler pool.
pub fn start(state: Arc<AppState>, listener: TcpListener) -> Result<Front, String> {
    // Accepted sockets inherit TCP_NODELAY from the listener; without it Nagle's
    // algorithm and delayed ACKs add tens of milliseconds to every token.
    ffi::set_tcp_nodelay(&listener).map_err(|e| format!("cannot set TCP_NODELAY: {e}"))?;
    ffi::set_send_limits(
        &listener,
        state.cfg.stall_timeout,
        state.cfg.send_buffer_bytes,
    )
    .map_err(|e| format!("cannot set SO_SNDTIMEO and SO_SNDBUF: {e}"))?;
    // tiny_http's threads (accept loop, connection pool) inherit the name of the
    // thread that creates them.
    ffi::set_current_thread_name("sluice-conn");
    // What a client may send is enforced on its connection's thread: a slow or
    // oversized request never holds a handler (tiny_http patched for it).
    let limits = tiny_http::ConnectionLimits {
        read_timeout: Some(state.cfg.client_timeout),
        header_line_bytes_max: HEADER_LINE_BYTES_MAX,
        headers_max: HEADERS_MAX,
        header_bytes_max: HEADER_BYTES_MAX,
        preread_body_bytes_max: state.cfg.body_bytes_max,
    };
    let server = Server::from_listener_with_limits(listener, None, limits);
    ffi::set_current_thread_name("sluice-main");
    let server = Arc::new(server.map_err(|e| format!("cannot start the HTTP server: {e}"))?);

    let n = state.http_threads;
    let mut handles = Vec::with_capacity(n);
    // "Listening" is only said once every handler runs under its own name.
    let (started_tx, started_rx) = bounded::<()>(n);
    for i in 0..n {
        let server = Arc::clone(&server);
        let state = Arc::clone(&state);
        let started = started_tx.clone();
        let handle = std::thread::Builder::new()
            .name(format!("sluice-http-{i}"))
            .spawn(move || {
                let _ = started.send(());
                drop(started);
                while let Ok(req) = server.recv() {
                    handle(&state, req);
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
        server,
    })
}

fn handle(state: &AppState, req: Request) {
    let path = req.url().split('?').next().unwrap_or("").to_string();
    let method = req.method().clone();
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
        (Method::Get, "/v1/models") => {
            if let Err(e) = authenticate(state, &req) {
                state.metrics.unauthorized.fetch_add(1, Ordering::Relaxed);
                respond_error(req, &e);
                return;
            }
            let body = json!({
                "object": "list",
                "data": [{
                    "id": state.cfg.model_name,
                    "object": "model",
                    "created": state.started_unix_s,
                    "owned_by": "sluice",
                    "context_length": state.seq_tokens_max,
                }],
            });
            respond_json(req, 200, &body);
        }
        (Method::Get, "/metrics") => {
            let (rates, class_bounds) = state.queue.snapshot();
            let typical = state.queue.typical();
            let bounds = class_bounds[Class::Interactive.index()];
            let classes = |f: &dyn Fn(Class) -> f64| Class::ALL.map(f);
            let class_gauges = [
                (
                    "sluice_class_queue_depth",
                    "Requests of each class waiting for a slot.",
                    classes(&|c| state.queue.queued_requests(c) as f64),
                ),
                (
                    "sluice_class_queue_depth_max",
                    "Each class's L_max (Little's law on its own W_max, or --queue-depth).",
                    classes(&|c| class_bounds[c.index()].queue_depth_max as f64),
                ),
                (
                    "sluice_class_queued_prompt_tokens",
                    "Prompt tokens of each class waiting for a slot.",
                    classes(&|c| state.queue.queued_tokens(c) as f64),
                ),
                (
                    "sluice_class_queued_prompt_tokens_max",
                    "Each class's budget of waiting prompt tokens.",
                    classes(&|c| class_bounds[c.index()].queued_tokens_max as f64),
                ),
                (
                    "sluice_class_queue_wait_budget_seconds",
                    "Each class's W_max.",
                    classes(&|c| state.cfg.queue_wait(c).as_secs_f64()),
                ),
                (
                    "sluice_class_slots_max",
                    "Slots each class may hold.",
                    classes(&|c| match c {
                        Class::Interactive => state.cfg.parallel as f64,
                        Class::Batch => state.cfg.batch_slots() as f64,
                    }),
                ),
            ];
            let gauges = [
                (
                    "sluice_compute_threads",
                    "Compute threads (engine + ggml workers).",
                    state.cfg.cpus.len() as f64,
                ),
                (
                    "sluice_parallel_max",
                    "Sequences decoded together at most.",
                    state.cfg.parallel as f64,
                ),
                (
                    "sluice_queue_depth",
                    "Requests waiting for a slot, all classes.",
                    Class::ALL
                        .map(|c| state.queue.queued_requests(c))
                        .iter()
                        .sum::<usize>() as f64,
                ),
                (
                    "sluice_queue_depth_max",
                    "Interactive queue bound L_max (Little's law on the live rates, or --queue-depth).",
                    bounds.queue_depth_max as f64,
                ),
                (
                    "sluice_queue_depth_ceiling",
                    "Highest L_max the gate may allow (9, or --queue-depth): the queue's capacity.",
                    state.cfg.policy(Class::Interactive).queue_depth_ceiling() as f64,
                ),
                (
                    "sluice_queued_prompt_tokens",
                    "Prompt tokens waiting for a slot, all classes.",
                    Class::ALL
                        .map(|c| state.queue.queued_tokens(c))
                        .iter()
                        .sum::<usize>() as f64,
                ),
                (
                    "sluice_queued_prompt_tokens_max",
                    "Budget of waiting interactive prompt tokens (mu_prefill x W_max).",
                    bounds.queued_tokens_max as f64,
                ),
                (
                    "sluice_mu_prefill_tokens_per_second",
                    "Prefill rate the admission bounds are derived from (calibrated, refined online).",
                    rates.prefill_tok_s,
                ),
                (
                    "sluice_mu_decode_tokens_per_second",
                    "Aggregate decode rate at --parallel sequences the bounds are derived from (calibrated, refined online).",
                    rates.decode_tok_s,
                ),
                (
                    "sluice_mu_requests_per_second",
                    "Request service rate for the typical request.",
                    bounds.mu_req,
                ),
                (
                    "sluice_typical_prompt_tokens",
                    "Prompt tokens a typical request prefills (learned from completed requests; cached tokens excluded).",
                    typical.prompt_tokens as f64,
                ),
                (
                    "sluice_typical_generated_tokens",
                    "Tokens a typical request generates (learned from completed requests).",
                    typical.max_tokens as f64,
                ),
                (
                    "sluice_queue_wait_budget_seconds",
                    "W_max: the queueing budget for time to first token (interactive).",
                    state.cfg.queue_wait.as_secs_f64(),
                ),
                (
                    "sluice_itl_target_seconds",
                    "Inter-token latency target the step budget is derived from.",
                    state.cfg.itl_target.as_secs_f64(),
                ),
                (
                    "sluice_kv_cells",
                    "KV cells in the context.",
                    state.n_ctx as f64,
                ),
                (
                    "sluice_ready",
                    "1 when /readyz is 200: not draining, and interactive requests start within the sojourn target.",
                    f64::from(u8::from(not_ready(state).is_none())),
                ),
                (
                    "sluice_http_threads",
                    "HTTP handler threads.",
                    state.http_threads as f64,
                ),
            ];
            let body = state
                .metrics
                .render(&gauges, &class_gauges, state.limiter.gauges());
            let resp = Response::from_string(body)
                .with_header(header("Content-Type", "text/plain; version=0.0.4"));
            let _ = req.respond(resp);
        }
        (Method::Post, "/v1/chat/completions") => generate(state, req, Api::Chat),
        (Method::Post, "/v1/completions") => generate(state, req, Api::Completions),
        (
            _,
            "/health"
            | "/livez"
            | "/readyz"
            | "/v1/models"
            | "/metrics"
            | "/v1/chat/completions"
            | "/v1/completions",
        ) => {
            let e = ApiError::MethodNotAllowed {
                method: method.to_string(),
                path,
            };
            respond_error(req, &e);
        }
        _ => respond_error(req, &ApiError::NotFound { path }),
    }
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
    let mut resp = json_response(e.status(), &e.to_json());
    if let Some(s) = e.retry_after_s() {
        resp.add_header(header("Retry-After", &s.to_string()));
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
}

/// Counts a completion request in flight for as long as it lives.
struct InFlight<'a>(&'a std::sync::atomic::AtomicUsize);

impl<'a> InFlight<'a> {
    fn enter(n: &'a std::sync::atomic::AtomicUsize) -> InFlight<'a> {
        n.fetch_add(1, Ordering::SeqCst);
        InFlight(n)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn generate(state: &AppState, mut req: Request, api: Api) {
    let _in_flight = InFlight::enter(&state.in_flight);
    let t0 = Instant::now();
    let tags = String::new();
    let path = req.url().to_string();
    if state.draining.load(Ordering::SeqCst) {
        let e = ApiError::Draining;
        log_request(&path, &tags, t0, &outcome_of_error(&e));
        respond_error(req, &e);
        return;
    }
    // Who asks comes first: an unknown key costs no parsing or tokenizing.
    let client = match authenticate(state, &req) {
        Ok(c) => c,
        Err(e) => {
            state.metrics.unauthorized.fetch_add(1, Ordering::Relaxed);
            log_request(&path, &tags, t0, &outcome_of_error(&e));
            respond_error(req, &e);
            return;
        }
    };
    // The connection's socket, held for probing while this request waits: a
    // client that leaves is seen even when nothing is being written to it.
    let probe = req.take_peer_socket();
    // The log names the client (its key's name, never the key; or its
    // address) and the class once they are known.
    let mut tags = format!(" client={}", client.label);
    let prepared = caller_timeout_ms(&req, state.cfg.request_timeout_ms).and_then(|timeout_ms| {
        let class = priority_class(&req)?;
        let (valid, prompt) = prepare(state, &mut req, api)?;
        let (gen, prompt) = gen_params(state, &valid, class, prompt)?;
        Ok((timeout_ms, class, valid, gen, prompt))
    });
    let (timeout_ms, class, valid, gen, prompt) = match prepared {
        Ok(p) => p,
        Err(e) => {
            state.metrics.invalid.fetch_add(1, Ordering::Relaxed);
            log_request(&path, &tags, t0, &outcome_of_error(&e));
            respond_error(req, &e);
            return;
        }
    };
    tags.push_str(&format!(" class={}", class.as_str()));
    let prompt_tokens = prompt.len();
    // Prompt tokens the prefix cache holds are not prefilled, and not charged
    // (the engine decides again at start; the bucket is settled with what it
    // really reused once the request ends, below).
    let cached_estimate = if gen.echo_logprobs {
        0
    } else {
        state.prefix.reusable(&prompt)
    };
    // The client's bucket pays for the work the request may ask for.
    let cost = (prompt_tokens - cached_estimate + gen.max_tokens) as u64;
    let mut bucket = match client.limit {
        None => None,
        Some(limit) => match state.limiter.charge(client.id, limit, cost) {
            Ok(()) => Some(Charged {
                limiter: &state.limiter,
                id: client.id,
                limit,
                unused: cost,
            }),
            Err(refused) => {
                state
                    .metrics
                    .class(class)
                    .rate_limited
                    .fetch_add(1, Ordering::Relaxed);
                let e = ApiError::RateLimited {
                    cost,
                    available: refused.available,
                    burst: limit.burst,
                    rate_tok_s: limit.rate_tok_s,
                    retry_after_s: refused.retry_after_s,
                };
                log_request(&path, &tags, t0, &outcome_of_error(&e));
                respond_error(req, &e);
                return;
            }
        },
    };
    let max_tokens = gen.max_tokens;
    let id = state.next_id.fetch_add(1, Ordering::Relaxed);
    let (tx, rx) = bounded(state.cfg.stream_buffer_tokens);
    let cancel = CancelFlag::default();
    let job = Job {
        id,
        class,
        prompt,
        gen,
        enqueued_at: t0,
        deadline: Some(t0 + Duration::from_millis(timeout_ms)),
        events: tx,
        cancel: cancel.clone(),
        cached_estimate,
    };
    let prompt_ids_for_echo = match (&valid.input, valid.echo) {
        (Input::Tokens(ids), true) => Some(ids.clone()),
        _ => None,
    };
    if let Err(e) = state.admission.submit(job) {
        // Refused for overload, not for the client's spending: the whole
        // charge goes back (`bucket` drops with all of it unused).
        log_request(&path, &tags, t0, &outcome_of_error(&e));
        respond_error(req, &e);
        return;
    }
    let echo_text = valid
        .echo
        .then(|| match (&valid.input, prompt_ids_for_echo) {
            (Input::Text(t), _) => t.clone(),
            (_, Some(ids)) => state.prompter.detokenize(&ids),
            _ => String::new(),
        });
    let id_str = match api {
        Api::Chat => format!("chatcmpl-{:x}-{id}", state.started_unix_s),
        Api::Completions => format!("cmpl-{:x}-{id}", state.started_unix_s),
    };
    let meta = openai::Meta {
        id: &id_str,
        created: unix_now(),
        model: &state.cfg.model_name,
        api,
    };
    let reply = if valid.stream {
        stream_reply
    } else {
        whole_reply
    };
    let waiter = Waiter {
        rx,
        t0,
        deadline: t0 + Duration::from_millis(timeout_ms),
        timeout_ms,
        stall_timeout_ms: state.cfg.stall_timeout.as_millis() as u64,
        probe,
        probed_at: std::cell::Cell::new(t0),
        cancel,
        metrics: Arc::clone(&state.metrics),
    };
    let mut outcome = reply(req, &meta, &valid, echo_text, &waiter);
    // The prompt was charged and taken; the tokens not generated go back,
    // and so does the difference between the cached tokens expected and
    // those reused, once the engine has said (its End event).
    if let Some(b) = &mut bucket {
        b.unused = max_tokens.saturating_sub(outcome.usage.completion_tokens) as u64;
        if outcome.usage.prompt_tokens > 0 {
            let reused = outcome.usage.cached_tokens;
            b.unused += reused.saturating_sub(cached_estimate) as u64;
            let more = cached_estimate.saturating_sub(reused) as u64;
            state.limiter.debit(b.id, b.limit, more);
        }
    }
    if outcome.usage.prompt_tokens == 0 {
        outcome.usage.prompt_tokens = prompt_tokens;
    }
    log_request(&path, &tags, t0, &outcome);
}

/// Work charged to a client's bucket; what is still `unused` when it drops
/// goes back.
struct Charged<'a> {
    limiter: &'a RateLimiter,
    id: ClientId,
    limit: Limit,
    unused: u64,
}

impl Drop for Charged<'_> {
    fn drop(&mut self) {
        self.limiter.refund(self.id, self.limit, self.unused);
    }
}

/// Who a request comes from, and the bucket it is charged to.
struct Client {
    id: ClientId,
    limit: Option<Limit>,
    /// What the log calls it: its key's name (never the key), or its address.
    label: String,
}

/// With `--api-key-file`, the request's key must be known (401 otherwise) and
/// names the client; without, the client is its address, and a key it sends
/// is not checked, so not trusted as an identity.
fn authenticate(state: &AppState, req: &Request) -> Result<Client, ApiError> {
    let default = state.cfg.client_limit;
    let Some(keys) = &state.cfg.api_keys else {
        let peer = req
            .remote_addr()
            .map_or(std::net::IpAddr::from([0, 0, 0, 0]), |a| a.ip());
        let ip = if state.cfg.trusted_proxies.contains(&peer) {
            forwarded_for(req).unwrap_or(peer)
        } else {
            peer
        };
        return Ok(Client {
            id: ClientId::Addr(ip),
            limit: default,
            label: ip.to_string(),
        });
    };
    let presented = req
        .headers()
        .iter()
        .find(|h| h.field.equiv("Authorization"))
        .and_then(|h| auth::bearer(h.value.as_str()));
    let Some(presented) = presented else {
        return Err(ApiError::Unauthorized { missing: true });
    };
    match keys.find(presented) {
        Some(i) => Ok(Client {
            id: ClientId::Key(i),
            limit: keys.key(i).limit(default),
            label: keys.key(i).name.clone(),
        }),
        None => Err(ApiError::Unauthorized { missing: false }),
    }
}

/// The client's address a trusted proxy appended to `X-Forwarded-For` (its
/// last entry: the ones before it are the client's own claims).
fn forwarded_for(req: &Request) -> Option<std::net::IpAddr> {
    let h = req
        .headers()
        .iter()
        .rev()
        .find(|h| h.field.equiv("X-Forwarded-For"))?;
    h.value.as_str().rsplit(',').next()?.trim().parse().ok()
}

/// The request's priority class: `X-Priority: interactive | batch`; without
/// the header, interactive.
fn priority_class(req: &Request) -> Result<Class, ApiError> {
    let Some(h) = req.headers().iter().find(|h| h.field.equiv("X-Priority")) else {
        return Ok(Class::Interactive);
    };
    let text = h.value.as_str();
    Class::parse(text).ok_or_else(|| {
        ApiError::invalid(
            "X-Priority",
            format!(
                "X-Priority is '{}'; it must be interactive or batch",
                text.trim()
            ),
        )
    })
}

/// The caller's deadline, `X-Request-Timeout: <seconds>` (a number, as
/// OpenAI's clients send it), capped by the server's `--request-timeout-ms`;
/// without the header, the server's ceiling. In milliseconds.
fn caller_timeout_ms(req: &Request, ceiling_ms: u64) -> Result<u64, ApiError> {
    let Some(h) = req
        .headers()
        .iter()
        .find(|h| h.field.equiv("X-Request-Timeout"))
    else {
        return Ok(ceiling_ms);
    };
    let text = h.value.as_str().trim();
    match text.parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 => Ok(((s * 1000.0).ceil() as u64).clamp(1, ceiling_ms)),
        _ => Err(ApiError::invalid(
            "X-Request-Timeout",
            format!("X-Request-Timeout is '{text}'; it must be a positive number of seconds"),
        )),
    }
}

/// Caps, reads and validates the body, and counts the prompt in tokens.
fn prepare(
    state: &AppState,
    req: &mut Request,
    api: Api,
) -> Result<(ValidRequest, Vec<ffi::Token>), ApiError> {
    let limit = state.cfg.body_bytes_max;
    // Decide from Content-Length before reading a byte of the body.
    if let Some(n) = req.body_length() {
        if n > limit {
            return Err(ApiError::BodyTooLarge {
                limit,
                given: Some(n),
            });
        }
    }
    if let Some(ct) = req.headers().iter().find(|h| h.field.equiv("Content-Type")) {
        let ct = ct.value.as_str().to_ascii_lowercase();
        if !ct.starts_with("application/json") {
            return Err(ApiError::UnsupportedMediaType { given: ct });
        }
    }
    let mut body = Vec::new();
    req.as_reader()
        .take(limit as u64 + 1)
        .read_to_end(&mut body)
        .map_err(|e| ApiError::InvalidRequest {
            param: None,
            message: format!("could not read the request body: {e}"),
        })?;
    if body.len() > limit {
        return Err(ApiError::BodyTooLarge { limit, given: None });
    }
    let valid = validation::parse(api, &body)?;
    let prompt = state
        .prompter
        .tokens(&valid.input)
        .map_err(|m| ApiError::invalid("prompt", m))?;
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            "prompt",
            "the prompt is empty (0 tokens)",
        ));
    }
    Ok((valid, prompt))
}

/// Fits max_tokens to the context and builds the engine's parameters.
fn gen_params(
    state: &AppState,
    v: &ValidRequest,
    class: Class,
    prompt: Vec<ffi::Token>,
) -> Result<(GenParams, Vec<ffi::Token>), ApiError> {
    // A batch request may not take the KV cells kept for interactive ones.
    let (n_ctx, whose) = match class {
        Class::Interactive => (state.seq_tokens_max, ""),
        Class::Batch if state.batch_seq_tokens_max < state.seq_tokens_max => (
            state.batch_seq_tokens_max,
            " of batch requests (the KV cache less the interactive slots' share)",
        ),
        Class::Batch => (state.seq_tokens_max, ""),
    };
    let p = prompt.len();
    let scoring_only = v.echo && v.max_tokens == Some(0);
    let room = n_ctx.saturating_sub(p);
    if room == 0 && !scoring_only || p > n_ctx {
        return Err(ApiError::ContextLength {
            message: format!(
                "prompt has {p} tokens; the context limit{whose} is {n_ctx} tokens, including at least 1 to generate"
            ),
        });
    }
    let max_tokens = match v.max_tokens {
        Some(n) if n > room => {
            return Err(ApiError::ContextLength {
                message: format!(
                    "prompt has {p} tokens and max_tokens is {n}: together {} tokens, over the context limit{whose} of {n_ctx}",
                    p + n
                ),
            })
        }
        Some(n) => n,
        None => state.cfg.max_tokens_default.min(room),
    };
    let seed = v.seed.unwrap_or_else(random_seed);
    Ok((
        GenParams {
            max_tokens,
            sampling: SamplingParams {
                temperature: v.temperature,
                top_k: v.top_k,
                top_p: v.top_p,
                min_p: v.min_p,
                seed,
            },
            stop: v.stop.clone(),
            ignore_eos: v.ignore_eos,
            top_logprobs: v.top_logprobs,
            echo_logprobs: v.echo && v.top_logprobs.is_some(),
        },
        prompt,
    ))
}

fn random_seed() -> u32 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    nanos ^ (COUNTER.fetch_add(0x9E37_79B9, Ordering::Relaxed) as u32)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn outcome_of_error(e: &ApiError) -> Outcome {
    Outcome {
        status: e.status(),
        usage: Usage::default(),
        first_token: None,
        note: e.code(),
    }
}

/// One line per completion request: path, status, then `tags` (client and
/// class, once known), tokens, times and the error code.
fn log_request(path: &str, tags: &str, t0: Instant, o: &Outcome) {
    let ttft = o
        .first_token
        .map_or("-".to_string(), |d| format!("{}", d.as_millis()));
    eprintln!(
        "sluice: POST {path} {}{tags} prompt={} completion={} ttft_ms={ttft} total_ms={} {}",
        o.status,
        o.usage.prompt_tokens,
        o.usage.completion_tokens,
        t0.elapsed().as_millis(),
        o.note
    );
}

/// A handler's side of one request in the engine: its events, its deadline,
/// its client's socket, and the flag that tells the engine it gave up.
struct Waiter {
    rx: Receiver<Event>,
    t0: Instant,
    deadline: Instant,
    timeout_ms: u64,
    stall_timeout_ms: u64,
    probe: Option<std::os::fd::OwnedFd>,
    /// When the client's socket was last probed.
    probed_at: std::cell::Cell<Instant>,
    cancel: CancelFlag,
    metrics: Arc<Metrics>,
}

impl Waiter {
    /// The engine's step count, stamped on a cancel.
    fn step(&self) -> u64 {
        self.metrics.steps.load(Ordering::Relaxed)
    }

    /// Whether the client closed its connection: probed at most every
    /// `PEER_PROBE_INTERVAL`, whether or not events keep coming.
    fn client_gone(&self) -> bool {
        let now = Instant::now();
        if now.duration_since(self.probed_at.get()) < PEER_PROBE_INTERVAL {
            return false;
        }
        self.probed_at.set(now);
        self.probe.as_ref().is_some_and(ffi::peer_closed)
    }

    /// Waits for the next event until the request's deadline, checking that the
    /// client is still there. Every way of not getting one (timeout, the client
    /// gone, a stall, a stopped engine, an engine refusal) is an `ApiError`;
    /// giving up sets the cancel flag first, so the engine stops at its next step.
    fn next(&self) -> Result<Event, ApiError> {
        loop {
            let now = Instant::now();
            if now >= self.deadline {
                self.cancel.cancel(CancelReason::Deadline, self.step());
                return Err(ApiError::Timeout {
                    limit_ms: self.timeout_ms,
                });
            }
            if self.client_gone() {
                self.cancel.cancel(CancelReason::Disconnect, self.step());
                return Err(ApiError::ClientGone);
            }
            let wait = PEER_PROBE_INTERVAL.min(self.deadline - now);
            match self.rx.recv_timeout(wait) {
                Ok(Event::Error { kind, message }) => {
                    return Err(match kind {
                        ErrorKind::Engine => ApiError::Engine { message },
                        ErrorKind::Shed {
                            reason,
                            retry_after_s,
                        } => ApiError::Shed {
                            reason,
                            message,
                            retry_after_s,
                        },
                        ErrorKind::DeadlineExceeded => ApiError::DeadlineExceeded { message },
                        ErrorKind::Shutdown => ApiError::ShuttingDown,
                    })
                }
                Ok(event) => return Ok(event),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(match self.cancel.reason() {
                        Some(CancelReason::Stall) => ApiError::Stalled {
                            limit_ms: self.stall_timeout_ms,
                        },
                        Some(CancelReason::Shutdown) => ApiError::ShuttingDown,
                        _ => ApiError::Engine {
                            message: "the engine stopped before the request ended".into(),
                        },
                    })
                }
            }
        }
    }

    /// A write to the client failed: it left, or (the send timeout) it took
    /// nothing for the stall timeout.
    fn write_failed(&self, e: &std::io::Error) {
        let reason = match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => CancelReason::Stall,
            _ => CancelReason::Disconnect,
        };
        self.cancel.cancel(reason, self.step());
    }
}

fn stream_reply(
    req: Request,
    meta: &openai::Meta,
    v: &ValidRequest,
    echo_text: Option<String>,
    w: &Waiter,
) -> Outcome {
    let t0 = w.t0;
    // The head goes out with the first event, so that a request refused before
    // it ran (shed, or its deadline passed) still gets its own status code.
    let first = match w.next() {
        Ok(e) => e,
        Err(e) => {
            respond_error(req, &e);
            return outcome_of_error(&e);
        }
    };
    let mut outcome = Outcome {
        status: 200,
        usage: Usage::default(),
        first_token: None,
        note: "",
    };
    let mut out = match sse::SseWriter::start(req.into_writer()) {
        Ok(out) => out,
        Err(e) => {
            w.write_failed(&e);
            outcome.note = "client_gone";
            return outcome;
        }
    };
    let mut offset = 0;
    let write = |out: &mut sse::SseWriter, value: Value| match out.event(&value.to_string()) {
        Ok(()) => true,
        Err(e) => {
            w.write_failed(&e);
            false
        }
    };
    if meta.api == Api::Chat && !write(&mut out, meta.role_chunk()) {
        outcome.note = "client_gone";
        return outcome;
    }
    let mut pending_echo = echo_text;
    let mut pending_event = Some(first);
    loop {
        let event = match pending_event.take().map_or_else(|| w.next(), Ok) {
            Ok(e) => e,
            Err(e) => {
                let _ = write(&mut out, e.to_json());
                let _ = out.end();
                outcome.note = e.code();
                return outcome;
            }
        };
        let ok = match event {
            Event::Prompt { logprobs } => {
                let text = pending_echo.take().unwrap_or_default();
                let entries: Vec<&TokenLogprob> = logprobs.iter().collect();
                let ok = write(&mut out, meta.text_chunk(&text, &entries, offset));
                offset += text.chars().count();
                ok
            }
            Event::Token { text, logprob, .. } => {
                outcome.first_token.get_or_insert_with(|| t0.elapsed());
                // The log's count if the stream ends early (End brings the real usage).
                outcome.usage.completion_tokens += 1;
                let mut text = text;
                if let Some(echo) = pending_echo.take() {
                    offset += echo.chars().count();
                    text.insert_str(0, &echo);
                }
                let entries: Vec<&TokenLogprob> = logprob.iter().collect();
                if text.is_empty() && entries.is_empty() {
                    true
                } else {
                    let ok = write(&mut out, meta.text_chunk(&text, &entries, offset));
                    offset += text.chars().count();
                    ok
                }
            }
            Event::End { finish, usage } => {
                outcome.usage = usage;
                if let Some(echo) = pending_echo.take() {
                    let _ = write(&mut out, meta.text_chunk(&echo, &[], 0));
                }
                let mut ok = write(&mut out, meta.finish_chunk(finish));
                if ok && v.include_usage {
                    ok = write(&mut out, meta.usage_chunk(usage));
                }
                let ok = ok
                    && match out.done() {
                        Ok(()) => true,
                        Err(e) => {
                            w.write_failed(&e);
                            false
                        }
                    };
                if !ok {
                    outcome.note = "client_gone";
                }
                return outcome;
            }
            // `next_event` turns errors into `Err`.
            Event::Error { .. } => false,
        };
        if !ok {
            // The cancel flag is set: the engine stops at its next step.
            outcome.note = match w.cancel.reason() {
                Some(CancelReason::Stall) => "stream_stalled",
                _ => "client_gone",
            };
            return outcome;
        }
    }
}

fn whole_reply(
    req: Request,
    meta: &openai::Meta,
    v: &ValidRequest,
    echo_text: Option<String>,
    w: &Waiter,
) -> Outcome {
    let t0 = w.t0;
    let mut text = echo_text.unwrap_or_default();
    let mut logprobs: Vec<TokenLogprob> = Vec::new();
    let mut first_token = None;
    loop {
        let event = match w.next() {
            Ok(e) => e,
            Err(e) => {
                respond_error(req, &e);
                return outcome_of_error(&e);
            }
        };
        match event {
            Event::Prompt { logprobs: prompt } => logprobs.extend(prompt),
            Event::Token {
                text: t, logprob, ..
            } => {
                first_token.get_or_insert_with(|| t0.elapsed());
                text.push_str(&t);
                logprobs.extend(logprob);
            }
            Event::End { finish, usage } => {
                let entries: Vec<&TokenLogprob> = logprobs.iter().collect();
                let lp = v.top_logprobs.map(|_| entries.as_slice());
                respond_json(req, 200, &meta.response(&text, lp, finish, usage));
                return Outcome {
                    status: 200,
                    usage,
                    first_token,
                    note: "",
                };
            }
            // `next_event` turns errors into `Err`.
            Event::Error { .. } => {}
        }
    }
}
