//! A completion request turned into a `Job`: who asks (API key, address),
//! its class and deadline, the body validated, the prompt templated and
//! tokenized, the client's bucket charged; then submitted to admission, and
//! the reply folded from the engine's events (`reply`).

use super::error::ApiError;
use super::retry::Caller;
use super::validation::{self, Api, Format, Input, ValidRequest};
use super::{log_request, openai, outcome_of_error, reply, respond_error, AppState};
use crate::admission::{GenParams, Job};
use crate::auth;
use crate::ffi::{SamplingParams, Token};
use crate::priority::Class;
use crate::ratelimit::{ClientId, Limit, RateLimiter};
use crate::stream::CancelFlag;
use crossbeam_channel::bounded;
use std::io::Read;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tiny_http::Request;

/// Counts a completion request in flight for as long as it lives.
pub(super) struct InFlight<'a>(&'a AtomicUsize);

impl<'a> InFlight<'a> {
    pub(super) fn enter(n: &'a AtomicUsize) -> InFlight<'a> {
        n.fetch_add(1, Ordering::SeqCst);
        InFlight(n)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

pub(super) fn generate(state: &AppState, mut req: Request, api: Api) {
    let _in_flight = InFlight::enter(&state.in_flight);
    let t0 = Instant::now();
    let tags = format!(" id={}", super::request_id(&req));
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
    let mut tags = format!(" id={} client={}", super::request_id(&req), client.label);
    // A full queue refuses at the door: no body read, no template, no tokens.
    if let Err((e, hold)) = at_the_door(state, &mut req, &client) {
        log_request(&path, &tags, t0, &outcome_of_error(&e));
        match hold {
            Some(wait) => state.tarpit.hold(req, e, wait),
            None => respond_error(req, &e),
        }
        return;
    }
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
    // The client's bucket pays for the work the request may ask for: each
    // choice is a sequence of its own.
    let n = valid.n;
    let cost = (n * (prompt_tokens - cached_estimate + gen.max_tokens)) as u64;
    let mut bucket = match charge(state, &client, class, cost) {
        Ok(b) => b,
        Err(e) => {
            log_request(&path, &tags, t0, &outcome_of_error(&e));
            respond_error(req, &e);
            return;
        }
    };
    let max_tokens = gen.max_tokens;
    let id = state.next_id.fetch_add(1, Ordering::Relaxed);
    let prompt_ids_for_echo = match (&valid.input, valid.echo) {
        (Input::Tokens(ids), true) => Some(ids.clone()),
        _ => None,
    };
    // One job per choice, each with its own events and cancel flag; a
    // choice after the first samples with the next seed.
    let echo_logprobs = gen.echo_logprobs;
    let request_id: Arc<str> = super::request_id(&req).into();
    let mut rxs = Vec::with_capacity(n);
    let mut cancels: Vec<CancelFlag> = Vec::with_capacity(n);
    let mut jobs = Vec::with_capacity(n);
    for i in 0..n {
        let (tx, rx) = bounded(state.cfg.stream_buffer_tokens);
        let cancel = CancelFlag::default();
        let mut gen = gen.clone();
        gen.sampling.seed = gen.sampling.seed.wrapping_add(i as u32);
        let job = Job {
            id: if i == 0 {
                id
            } else {
                state.next_id.fetch_add(1, Ordering::Relaxed)
            },
            request_id: Arc::clone(&request_id),
            class,
            prompt: prompt.clone(),
            gen,
            enqueued_at: t0,
            deadline: Some(t0 + Duration::from_millis(timeout_ms)),
            events: tx,
            cancel: cancel.clone(),
            // A later choice takes the first one's prompt cells: admission
            // counts the one token it prefills.
            cached_estimate: match i {
                0 => cached_estimate,
                _ if echo_logprobs => cached_estimate,
                _ => cached_estimate.max(prompt_tokens - 1),
            },
            embed: None,
            // The prompt's log-probabilities need a prefill of each.
            prompt_of: (i > 0 && !echo_logprobs).then_some(id),
        };
        jobs.push(job);
        rxs.push(rx);
        cancels.push(cancel);
    }
    // All of them or none: a refused request leaves nothing in the queue.
    if let Err(refused) = state.admission.submit_all(jobs) {
        let e = ApiError::from(refused);
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
        include_usage: valid.include_usage,
    };
    let waiter = reply::Waiter::new(state, t0, timeout_ms, rxs, cancels, probe);
    let mut outcome = reply::reply(req, &meta, &valid, echo_text, &waiter);
    // The prompt was charged and taken; the tokens not generated go back,
    // and so does the difference between the cached tokens expected and
    // those reused, once the engine has said (its End event).
    if let Some(b) = &mut bucket {
        b.unused = (n * max_tokens).saturating_sub(outcome.usage.completion_tokens) as u64;
        if outcome.usage.prompt_tokens > 0 {
            let reused = outcome.cached_all;
            let expected = n * cached_estimate;
            b.unused += reused.saturating_sub(expected) as u64;
            let more = expected.saturating_sub(reused) as u64;
            state.limiter.debit(b.id, b.limit, more);
        }
    }
    if outcome.usage.prompt_tokens == 0 {
        outcome.usage.prompt_tokens = prompt_tokens;
    }
    log_request(&path, &tags, t0, &outcome);
}

/// Charges `cost` tokens of work to the client's bucket (nothing without a
/// limit). All of it is `unused` (given back when the charge drops) until
/// the caller says how much the request used. A short bucket is the 429,
/// counted for the class.
pub(super) fn charge<'a>(
    state: &'a AppState,
    client: &Client,
    class: Class,
    cost: u64,
) -> Result<Option<Charged<'a>>, ApiError> {
    let Some(limit) = client.limit else {
        return Ok(None);
    };
    match state.limiter.charge(client.id, limit, cost) {
        Ok(()) => Ok(Some(Charged {
            limiter: &state.limiter,
            id: client.id,
            limit,
            unused: cost,
        })),
        Err(refused) => {
            state
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
pub(super) fn priority_class(req: &Request) -> Result<Class, ApiError> {
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
    let Ok(class) = priority_class(req) else {
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

/// Caps, reads and validates the body, and counts the prompt in tokens.
fn prepare(
    state: &AppState,
    req: &mut Request,
    api: Api,
) -> Result<(ValidRequest, Vec<Token>), ApiError> {
    let body = json_body(state, req)?;
    let valid = validation::parse(api, &body)?;
    let prompt = state
        .prompter
        .tokens(&valid.input, &valid.tools)
        .map_err(|m| ApiError::invalid(valid.input.param(), m))?;
    state
        .metrics
        .prompts_tokenized
        .fetch_add(1, Ordering::Relaxed);
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            "prompt",
            "the prompt is empty (0 tokens)",
        ));
    }
    Ok((valid, prompt))
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

/// Fits max_tokens to the context and builds the engine's parameters.
fn gen_params(
    state: &AppState,
    v: &ValidRequest,
    class: Class,
    prompt: Vec<Token>,
) -> Result<(GenParams, Vec<Token>), ApiError> {
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
    let n_vocab = state.prompter.n_vocab();
    if let Some(&(bad, _)) = v
        .penalties
        .logit_bias
        .iter()
        .find(|&&(t, _)| t as usize >= n_vocab)
    {
        return Err(ApiError::invalid(
            "logit_bias",
            format!("'logit_bias' names token {bad}, outside the vocabulary of {n_vocab} tokens"),
        ));
    }
    let grammars = || {
        state.grammars.as_ref().map_err(|e| {
            ApiError::invalid(
                "response_format",
                format!("structured output is not available for this model: {e}"),
            )
        })
    };
    let constraint = match &v.format {
        Format::Text if v.tools.calls() => Some(
            grammars()?
                .json_schema(&v.tools.call_schema(), v.tools.strict())
                .map_err(|e| {
                    ApiError::invalid(
                        "tools",
                        format!("a function's parameters cannot be enforced: {e}"),
                    )
                })?,
        ),
        Format::Text => None,
        _ if v.tools.calls() => {
            return Err(ApiError::invalid(
                "response_format",
                "an answer held to the tools' call format (tool_choice other than \"none\") cannot also follow response_format; send one of them",
            ))
        }
        format => {
            let grammars = grammars()?;
            Some(match format {
                Format::JsonSchema { schema, strict } => {
                    grammars.json_schema(schema, *strict).map_err(|e| {
                        ApiError::invalid(
                            "response_format.json_schema.schema",
                            format!("the schema cannot be enforced: {e}"),
                        )
                    })?
                }
                _ => grammars.json_object(),
            })
        }
    };
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
            penalties: v.penalties.clone(),
            constraint,
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
