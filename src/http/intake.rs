//! One intake for every endpoint that asks the engine for work (chat,
//! completions, embeddings): the door (draining, who asks, a full queue
//! refused before the body is read), the caller's deadline and class, the
//! body, the client's bucket, admission, and the request's log line. An
//! endpoint adds only what is its own: how it reads its body into jobs and
//! folds the events into an answer.

use super::error::ApiError;
use super::retry::Caller;
use super::{log_request, outcome_of_error, reply, respond_error, AppState, Outcome};
use crate::admission::Job;
use crate::auth;
use crate::priority::Class;
use crate::ratelimit::{ClientId, Limit, RateLimiter};
use crate::stream::{CancelFlag, Event, EventSender};
use crossbeam_channel::Receiver;
use std::io::Read;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tiny_http::Request;

/// A request past the door, until its log line.
pub(super) struct Intake<'a> {
    pub(super) state: &'a AppState,
    _in_flight: InFlight<'a>,
    /// When it arrived: its queue wait, deadline and log time count from here.
    pub(super) t0: Instant,
    path: String,
    /// The log line's fields: id, client, then what the endpoint adds.
    pub(super) tags: String,
    pub(super) client: Client,
    /// The connection's socket, held for probing while this request waits: a
    /// client that leaves is seen even when nothing is being written to it.
    probe: Option<OwnedFd>,
    /// A batch line's request id (`batch_runner`: from port 0, which no
    /// socket's peer has): its jobs' cancel flags go to `Preemption`.
    batch_line: Option<String>,
    /// The gateway's TTFT objective (`SLO_TTFT_HEADER`), once read.
    slo_ttft_ms: Option<u64>,
}

/// What every endpoint reads of a request before its body.
pub(super) struct Ask {
    /// The caller's deadline (`caller_timeout_ms`).
    pub(super) timeout_ms: u64,
    pub(super) class: Class,
}

/// A gateway's time-to-first-token objective for the request, in ms
/// (llm-d's `x-slo-ttft-ms`): one that the forecast says cannot be met is
/// refused at once, before it queues.
pub(super) const SLO_TTFT_HEADER: &str = "x-slo-ttft-ms";
/// The gateway's inference objective (Gateway API Inference Extension): one
/// named in `--batch-objectives` is sheddable, the batch class.
pub(super) const OBJECTIVE_HEADER: &str = "x-gateway-inference-objective";
/// The gateway's fairness id: from a trusted proxy, the client whose bucket
/// is charged instead of the address.
pub(super) const FAIRNESS_HEADER: &str = "x-gateway-inference-fairness-id";
/// Longest fairness id taken (longer ones are cut).
const FAIRNESS_ID_BYTES_MAX: usize = 256;

impl<'a> Intake<'a> {
    /// The door: a draining server, an unknown key, or a queue that would
    /// refuse any request of its class answers here (`None`), before the
    /// body is read, templated or tokenized.
    pub(super) fn open(state: &'a AppState, mut req: Request) -> Option<(Intake<'a>, Request)> {
        let in_flight = InFlight::enter(&state.in_flight);
        let t0 = Instant::now();
        let path = req.url().to_string();
        let tags = format!(" id={}", super::request_id(&req));
        let refuse = |req: Request, tags: &str, e: ApiError| {
            log_request(&path, tags, t0, &outcome_of_error(&e));
            respond_error(req, &e);
        };
        if state.draining.load(Ordering::SeqCst) {
            refuse(req, &tags, ApiError::Draining);
            return None;
        }
        // Who asks comes first: an unknown key costs no parsing or tokenizing.
        let client = match authenticate(state, &req) {
            Ok(c) => c,
            Err(e) => {
                state.metrics.unauthorized.fetch_add(1, Ordering::Relaxed);
                refuse(req, &tags, e);
                return None;
            }
        };
        let probe = req.take_peer_socket();
        // The log names the client (its key's name, never the key; or its
        // address), and the class once it is known.
        let tags = format!("{tags} client={}", client.label);
        if let Err((e, hold)) = at_the_door(state, &mut req, &client) {
            log_request(&path, &tags, t0, &outcome_of_error(&e));
            match hold {
                Some(wait) => state.tarpit.hold(req, e, wait),
                None => respond_error(req, &e),
            }
            return None;
        }
        let batch_line = req
            .remote_addr()
            .is_some_and(|a| a.port() == 0)
            .then(|| super::request_id(&req));
        let intake = Intake {
            state,
            _in_flight: in_flight,
            t0,
            path,
            tags,
            client,
            probe,
            batch_line,
            slo_ttft_ms: None,
        };
        Some((intake, req))
    }

    /// The caller's deadline and class, then the endpoint's own reading of
    /// the body (`read`); the class joins the log line.
    pub(super) fn read<T>(
        &mut self,
        req: &mut Request,
        read: impl FnOnce(&mut Request, &Ask) -> Result<T, ApiError>,
    ) -> Result<(Ask, T), ApiError> {
        let timeout_ms = caller_timeout_ms(req, self.state.cfg.request_timeout_ms)?;
        let class = priority_class(req, &self.state.cfg.batch_objectives)?;
        self.slo_ttft_ms = slo_ttft_ms(req)?;
        let ask = Ask { timeout_ms, class };
        let t = read(req, &ask)?;
        self.tags.push_str(&format!(" class={}", class.as_str()));
        Ok((ask, t))
    }

    /// Answers an invalid request (counted as such).
    pub(super) fn invalid(self, req: Request, e: ApiError) {
        self.state.metrics.invalid.fetch_add(1, Ordering::Relaxed);
        self.fail(req, e);
    }

    /// Answers a refusal, and logs it.
    pub(super) fn fail(self, req: Request, e: ApiError) {
        self.log(&outcome_of_error(&e));
        respond_error(req, &e);
    }

    /// Charges `cost` tokens of work to the client's bucket (nothing without a
    /// limit). All of it is `unused` (given back when the charge drops) until
    /// the caller says how much the request used. A short bucket is the 429,
    /// counted for the class.
    pub(super) fn charge(&self, class: Class, cost: u64) -> Result<Option<Charged<'a>>, ApiError> {
        let Some(limit) = self.client.limit else {
            return Ok(None);
        };
        match self.state.limiter.charge(self.client.id, limit, cost) {
            Ok(()) => Ok(Some(Charged {
                limiter: &self.state.limiter,
                id: self.client.id,
                limit,
                unused: cost,
            })),
            Err(refused) => {
                self.state
                    .metrics
                    .class(class)
                    .rate_limited
                    .fetch_add(1, Ordering::Relaxed);
                Err(ApiError::RateLimited {
                    cost,
                    available: refused.available,
                    burst: limit.burst,
                    rate_tok_s: limit.rate_tok_s,
                    retry_after_s: refused.retry_after_s,
                })
            }
        }
    }

    /// A job's events and cancel flag: the channel is bounded by
    /// `--stream-buffer-tokens`, and its events wake this thread, which
    /// waits for them (`reply::Waiter`).
    pub(super) fn channel(&self) -> (EventSender, Receiver<Event>, CancelFlag) {
        let (tx, rx) = crossbeam_channel::bounded(self.state.cfg.stream_buffer_tokens);
        (
            EventSender::new(tx, std::thread::current()),
            rx,
            CancelFlag::default(),
        )
    }

    /// When a job of this request must have ended.
    pub(super) fn deadline(&self, ask: &Ask) -> Option<Instant> {
        Some(self.t0 + Duration::from_millis(ask.timeout_ms))
    }

    /// Submits the request's jobs: all are admitted or none is. With a
    /// gateway's TTFT objective, first the forecast of the first token: past
    /// the objective, the request is refused now, unqueued.
    pub(super) fn submit(&self, jobs: Vec<Job>) -> Result<(), ApiError> {
        if let (Some(slo_ms), Some(first)) = (self.slo_ttft_ms, jobs.first()) {
            let class = first.class;
            let tokens = jobs.iter().map(Job::queued_tokens).sum();
            let forecast = self.state.admission.first_token_forecast(class, tokens);
            if forecast > Duration::from_millis(slo_ms) {
                self.state
                    .metrics
                    .rejected_slo_ttft
                    .fetch_add(1, Ordering::Relaxed);
                return Err(ApiError::SloUnmeetable {
                    class,
                    slo_ms,
                    forecast_ms: forecast.as_millis() as u64,
                    retry_after_s: self.state.queue.retry_after_s(class),
                });
            }
        }
        self.state
            .admission
            .submit_all(jobs)
            .map_err(ApiError::from)
    }

    /// The handler's side of the admitted jobs (`reply::Waiter`), which
    /// takes the socket to probe.
    pub(super) fn waiter(
        &mut self,
        ask: &Ask,
        rx: Vec<Receiver<Event>>,
        cancel: Vec<CancelFlag>,
    ) -> reply::Waiter {
        let probe = self.probe.take();
        if let (Some(id), Some(api)) = (&self.batch_line, &self.state.batches) {
            api.preemption.attach(id, &cancel);
        }
        reply::Waiter::new(
            self.state,
            self.t0,
            ask.timeout_ms,
            ask.class,
            rx,
            cancel,
            probe,
        )
    }

    /// The request's log line.
    pub(super) fn log(&self, outcome: &Outcome) {
        log_request(&self.path, &self.tags, self.t0, outcome);
    }
}

/// Counts a completion request in flight for as long as it lives.
struct InFlight<'a>(&'a AtomicUsize);

impl<'a> InFlight<'a> {
    fn enter(n: &'a AtomicUsize) -> InFlight<'a> {
        n.fetch_add(1, Ordering::SeqCst);
        InFlight(n)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Work charged to a client's bucket; what is still `unused` when it drops
/// goes back.
pub(super) struct Charged<'a> {
    pub(super) limiter: &'a RateLimiter,
    pub(super) id: ClientId,
    pub(super) limit: Limit,
    pub(super) unused: u64,
}

impl Drop for Charged<'_> {
    fn drop(&mut self) {
        self.limiter.refund(self.id, self.limit, self.unused);
    }
}

/// Who a request comes from, and the bucket it is charged to.
pub(super) struct Client {
    pub(super) id: ClientId,
    pub(super) limit: Option<Limit>,
    /// What the log calls it: its key's name (never the key), or its address.
    pub(super) label: String,
}

/// With `--api-key-file`, the request's key must be known (401 otherwise) and
/// names the client; without, the client is its address, and a key it sends
/// is not checked, so not trusted as an identity.
pub(super) fn authenticate(state: &AppState, req: &Request) -> Result<Client, ApiError> {
    let default = state.cfg.client_limit;
    let Some(keys) = &state.cfg.api_keys else {
        // An IPv4 peer of a dual-stack socket comes as ::ffff:a.b.c.d.
        let peer = req
            .remote_addr()
            .map_or(std::net::IpAddr::from([0, 0, 0, 0]), |a| {
                a.ip().to_canonical()
            });
        let trusted = state.cfg.trusted_proxies.iter().any(|n| n.contains(&peer));
        if let Some(fair) = trusted.then(|| fairness_id(req)).flatten() {
            return Ok(Client {
                id: ClientId::Fairness(fair.0),
                limit: default,
                label: format!("fairness:{}", fair.1),
            });
        }
        let ip = if trusted {
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

/// The gateway's fairness id, hashed, and as the log shows it (printable
/// ASCII, at most 64 characters); `None` without one.
fn fairness_id(req: &Request) -> Option<(u64, String)> {
    use std::hash::{Hash, Hasher};
    let h = req
        .headers()
        .iter()
        .find(|h| h.field.equiv(FAIRNESS_HEADER))?;
    let id = h.value.as_str().trim();
    let id = &id.as_bytes()[..id.len().min(FAIRNESS_ID_BYTES_MAX)];
    if id.is_empty() {
        return None;
    }
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    id.hash(&mut hasher);
    let shown: String = id
        .iter()
        .take(64)
        .map(|&b| if b.is_ascii_graphic() { b as char } else { '?' })
        .collect();
    Some((hasher.finish(), shown))
}

/// The gateway's TTFT objective in ms, if it sent one.
fn slo_ttft_ms(req: &Request) -> Result<Option<u64>, ApiError> {
    let Some(h) = req
        .headers()
        .iter()
        .find(|h| h.field.equiv(SLO_TTFT_HEADER))
    else {
        return Ok(None);
    };
    let text = h.value.as_str().trim();
    match text.parse::<f64>() {
        Ok(ms) if ms.is_finite() && ms > 0.0 => Ok(Some(ms.ceil() as u64)),
        _ => Err(ApiError::invalid(
            SLO_TTFT_HEADER,
            format!("{SLO_TTFT_HEADER} is '{text}'; it must be a positive number of milliseconds"),
        )),
    }
}

/// The request's priority class: the batch class when a gateway's inference
/// objective is one of `batch_objectives` (sheddable), else `X-Priority:
/// interactive | batch`; without either, interactive.
pub(super) fn priority_class(
    req: &Request,
    batch_objectives: &[String],
) -> Result<Class, ApiError> {
    let objective = req
        .headers()
        .iter()
        .find(|h| h.field.equiv(OBJECTIVE_HEADER));
    if objective.is_some_and(|h| {
        batch_objectives
            .iter()
            .any(|o| o == h.value.as_str().trim())
    }) {
        return Ok(Class::Batch);
    }
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

/// Headers that carry the caller's own timeout, in seconds: sluice's, then
/// the OpenAI SDKs' (the Node client's total, the Python client's read
/// timeout, which for a whole JSON answer is its total too). The first one
/// present counts.
const TIMEOUT_HEADERS: [&str; 3] = [
    "X-Request-Timeout",
    "X-Stainless-Timeout",
    "X-Stainless-Read-Timeout",
];

/// The caller's deadline (`TIMEOUT_HEADERS`: a number of seconds), capped by
/// the server's `--request-timeout-ms`; without one, the server's ceiling. In
/// milliseconds.
pub(super) fn caller_timeout_ms(req: &Request, ceiling_ms: u64) -> Result<u64, ApiError> {
    let Some((name, h)) = TIMEOUT_HEADERS.iter().find_map(|name| {
        req.headers()
            .iter()
            .find(|h| h.field.equiv(name))
            .map(|h| (*name, h))
    }) else {
        return Ok(ceiling_ms);
    };
    let text = h.value.as_str().trim();
    match text.parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 => Ok(((s * 1000.0).ceil() as u64).clamp(1, ceiling_ms)),
        _ => Err(ApiError::invalid(
            name,
            format!("{name} is '{text}'; it must be a positive number of seconds"),
        )),
    }
}

/// Before the body is read: a client that came back before its Retry-After
/// is refused with a longer wait, to be held back that long (at most
/// `retry::HOLD_MS_MAX`); and on the queue's state alone, a request of its
/// class that would be refused whatever its prompt is refused now (a bad
/// `X-Priority` is left for validation to answer).
pub(super) fn at_the_door(
    state: &AppState,
    req: &mut Request,
    client: &Client,
) -> Result<(), (ApiError, Option<Duration>)> {
    let now = Instant::now();
    let Ok(class) = priority_class(req, &state.cfg.batch_objectives) else {
        return Ok(());
    };
    let refused = match state.admission.precheck(class) {
        Ok(()) => return Ok(()),
        Err(r) => r,
    };
    // Only a request that would be refused anyway is judged early: one that
    // finds room is served, whoever sent it. A retry is the same body again
    // (read, already whole in memory, and hashed; not parsed).
    let mut body = Vec::new();
    let limit = state.cfg.body_bytes_max as u64 + 1;
    let _ = req.as_reader().take(limit).read_to_end(&mut body);
    let caller = Caller::of(client.id, &body);
    if let Some(wait) = state.retries.early(caller, now) {
        state.metrics.retried_early.fetch_add(1, Ordering::Relaxed);
        let e = ApiError::RetriedEarly {
            wait_ms: wait.as_millis() as u64,
        };
        return Err((e, Some(wait)));
    }
    // A refusal is a promise: the return time is kept, so that coming back
    // earlier is seen.
    let e = ApiError::from(refused);
    if let ApiError::QueueFull(q) = &e {
        let wait = Duration::from_millis(q.retry_after_ms);
        state.retries.promised(caller, wait, now);
    }
    Err((e, None))
}

/// The body of a POST, which must be JSON (`Content-Type: application/json`,
/// with parameters such as charset, else 415: a POST without it, or with
/// text/plain or a form type, is what a web page may send without a CORS
/// preflight), within `--max-body-bytes` (the connection has read it whole).
pub(super) fn json_body(state: &AppState, req: &mut Request) -> Result<Vec<u8>, ApiError> {
    let limit = state.cfg.body_bytes_max;
    if let Some(n) = req.body_length() {
        if n > limit {
            return Err(ApiError::BodyTooLarge {
                limit,
                given: Some(n),
            });
        }
    }
    let ct = req
        .headers()
        .iter()
        .find(|h| h.field.equiv("Content-Type"))
        .map(|h| h.value.as_str().to_ascii_lowercase());
    let json = ct
        .as_deref()
        .is_some_and(|ct| ct.split(';').next().map(str::trim) == Some("application/json"));
    if !json {
        return Err(ApiError::UnsupportedMediaType {
            given: ct.unwrap_or_else(|| "(none)".into()),
        });
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
    Ok(body)
}
