//! The engine's events folded into the reply: one loop reads them (`reply`)
//! and a `Sink` says what each becomes, SSE chunks written as they come
//! (`stream: true`) or one JSON body at the end. A request with `n` > 1 is
//! `n` jobs, one per choice; their events are read as they come, each
//! tagged with its choice's index.

use super::error::ApiError;
use super::hold::{Failed, Hold, Next};
use super::openai::Meta;
use super::tools::{self, Answer, AnswerDelta, AnswerStream};
use super::validation::{Api, ValidRequest};
use super::{outcome_of_error, respond_error, respond_json, sse, Outcome};
use crate::admission::QueueGauge;
use crate::ffi;
use crate::metrics::Metrics;
use crate::priority::Class;
use crate::stream::{
    CancelFlag, CancelReason, ErrorKind, Event, FinishReason, TokenLogprob, Usage,
};
use crossbeam_channel::Receiver;
use serde_json::Value;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a handler waiting for the engine checks that its client is still
/// there: well under one engine step on a CPU.
const PEER_PROBE_INTERVAL: Duration = Duration::from_millis(20);

/// A handler's side of one request in the engine: its events (one channel
/// per choice), its deadline, its client's socket, and the flags that tell
/// the engine it gave up.
pub(super) struct Waiter {
    pub(super) rx: Vec<Receiver<Event>>,
    pub(super) t0: Instant,
    pub(super) deadline: Instant,
    pub(super) timeout_ms: u64,
    pub(super) stall_timeout_ms: u64,
    pub(super) probe: Option<std::os::fd::OwnedFd>,
    /// When the client's socket was last probed.
    pub(super) probed_at: std::cell::Cell<Instant>,
    pub(super) cancel: Vec<CancelFlag>,
    pub(super) metrics: Arc<Metrics>,
    /// The request's class and admission's gate: a shed request is told when
    /// to come back.
    pub(super) class: Class,
    pub(super) queue: Arc<QueueGauge>,
    /// `--sse-keep-alive-ms`.
    pub(super) keep_alive: Duration,
    /// Per choice, the events taken from its channel behind a token decoded
    /// ahead and held until its time (streaming only, `hold`).
    held: std::cell::RefCell<Hold>,
}

impl Waiter {
    /// The handler's side of a request whose jobs were admitted at `t0`:
    /// their channels and cancel flags, the client's socket, the deadline.
    pub(super) fn new(
        state: &super::AppState,
        t0: Instant,
        timeout_ms: u64,
        class: Class,
        rx: Vec<Receiver<Event>>,
        cancel: Vec<CancelFlag>,
        probe: Option<std::os::fd::OwnedFd>,
    ) -> Waiter {
        let n = rx.len();
        Waiter {
            rx,
            t0,
            deadline: t0 + Duration::from_millis(timeout_ms),
            timeout_ms,
            stall_timeout_ms: state.cfg.stall_timeout.as_millis() as u64,
            keep_alive: state.cfg.sse_keep_alive,
            probe,
            probed_at: std::cell::Cell::new(t0),
            cancel,
            metrics: Arc::clone(&state.metrics),
            class,
            queue: Arc::clone(&state.queue),
            held: std::cell::RefCell::new(Hold::new(n)),
        }
    }

    /// Streaming: a token decoded ahead of its pace is held until its
    /// `not_before` (a JSON reply waits for the whole answer anyway).
    pub(super) fn set_paced(&mut self, paced: bool) {
        self.held.get_mut().set_paced(paced);
    }

    /// The engine's step count, stamped on a cancel.
    fn step(&self) -> u64 {
        self.metrics.steps.load(Ordering::Relaxed)
    }

    /// Tells the engine to stop every choice (those ended ignore it).
    fn cancel_all(&self, reason: CancelReason) {
        let step = self.step();
        for c in &self.cancel {
            c.cancel(reason, step);
        }
    }

    /// Why the request was cancelled, if it was.
    fn cancel_reason(&self) -> Option<CancelReason> {
        self.cancel.iter().find_map(CancelFlag::reason)
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

    /// Waits for the next event of a choice not `ended` until the request's
    /// deadline, checking that the client is still there, or until `tick`
    /// passes (then `Ok(None)`). Every way of not getting one (timeout, the
    /// client gone, a stall, a stopped engine, an engine refusal) is an
    /// `ApiError`; giving up sets the cancel flags first, so the engine stops
    /// at its next step. A streamed token decoded ahead comes at its
    /// `not_before`, and what its choice sends after it, after it.
    pub(super) fn next_before(
        &self,
        tick: Option<Instant>,
        ended: &[bool],
    ) -> Result<Option<(usize, Event)>, ApiError> {
        loop {
            let now = Instant::now();
            if tick.is_some_and(|t| now >= t) {
                return Ok(None);
            }
            if now >= self.deadline {
                self.cancel_all(CancelReason::Deadline);
                return Err(ApiError::Timeout {
                    limit_ms: self.timeout_ms,
                });
            }
            if self.client_gone() {
                self.cancel_all(CancelReason::Disconnect);
                return Err(ApiError::ClientGone);
            }
            let mut wait = PEER_PROBE_INTERVAL.min(self.deadline - now);
            if let Some(t) = tick {
                wait = wait.min(t - now);
            }
            for i in (0..self.rx.len()).filter(|&i| !ended[i]) {
                match self.next_of(i, now)? {
                    Next::Event(event) => return Ok(Some((i, event))),
                    Next::At(at) => wait = wait.min(at - now),
                    Next::Nothing => {}
                }
            }
            // Until the engine sends one of them an event (it unparks this
            // thread, `EventSender`; read at the top of the loop), or a held
            // token's time. An unpark that came before this park makes it
            // return at once, so none is missed; a stray one only costs
            // another look at the channels.
            std::thread::park_timeout(wait);
        }
    }

    /// Choice `i`'s next event if it is due at `now`, or when its held
    /// token is (`Hold::next_of`); a failure as the client's error.
    fn next_of(&self, i: usize, now: Instant) -> Result<Next, ApiError> {
        self.held
            .borrow_mut()
            .next_of(i, &self.rx[i], now)
            .map_err(|failed| match failed {
                Failed::Error { kind, message } => self.engine_error(kind, message),
                Failed::Closed => self.stopped(),
            })
    }

    /// The error for a channel the engine let go of before its `End`.
    fn stopped(&self) -> ApiError {
        match self.cancel_reason() {
            Some(CancelReason::Stall) => ApiError::Stalled {
                limit_ms: self.stall_timeout_ms,
            },
            Some(CancelReason::Shutdown) => ApiError::ShuttingDown,
            Some(CancelReason::Preempted) => ApiError::Batch {
                status: 503,
                code: "preempted",
                message: "a batch line gave way to interactive requests; it runs again later"
                    .into(),
            },
            _ => ApiError::Engine {
                message: "the engine stopped before the request ended".into(),
            },
        }
    }

    /// A write to the client failed: it left, or (the send timeout) it took
    /// nothing for the stall timeout.
    fn write_failed(&self, e: &std::io::Error) {
        let reason = match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => CancelReason::Stall,
            _ => CancelReason::Disconnect,
        };
        self.cancel_all(reason);
    }
}

impl Waiter {
    /// An engine refusal or failure as the client's error; a shed request is
    /// told when to come back by the gate.
    fn engine_error(&self, kind: ErrorKind, message: String) -> ApiError {
        match kind {
            ErrorKind::Engine => ApiError::Engine { message },
            ErrorKind::Shed { reason } => {
                let retry_after_s = self.queue.retry_after_s(self.class);
                ApiError::Shed {
                    reason,
                    message: format!("{message}; retry after {retry_after_s} s"),
                    retry_after_s,
                }
            }
            ErrorKind::DeadlineExceeded => ApiError::DeadlineExceeded { message },
            ErrorKind::Shutdown => ApiError::ShuttingDown,
        }
    }
}

/// A write to the client failed (the cancel flags are set, `Waiter::write_failed`).
struct WriteFailed;

/// What the events of one request become; `i` is a choice's index.
trait Sink {
    /// A choice's job left the queue: it will not be shed.
    fn started(&mut self) -> Result<(), WriteFailed>;
    /// When to send a keep-alive, if one is due before the next event.
    fn keep_alive_at(&self) -> Option<Instant>;
    fn keep_alive(&mut self) -> Result<(), WriteFailed>;
    /// The prompt's log-probabilities (`echo` with `logprobs`).
    fn prompt(&mut self, i: usize, logprobs: Vec<TokenLogprob>) -> Result<(), WriteFailed>;
    fn token(
        &mut self,
        i: usize,
        text: String,
        logprob: Option<TokenLogprob>,
    ) -> Result<(), WriteFailed>;
    /// Choice `i` is complete.
    fn end_choice(&mut self, i: usize, finish: FinishReason) -> Result<(), WriteFailed>;
    /// Every choice is complete.
    fn end(self: Box<Self>, usage: Usage) -> Result<(), WriteFailed>;
    /// The request failed; what the log says of it, from what was sent so far.
    fn fail(self: Box<Self>, e: &ApiError, so_far: Outcome) -> Outcome;
}

/// Folds the events of one request into its reply; returns what the log says.
pub(super) fn reply(
    req: tiny_http::Request,
    meta: &Meta,
    v: &ValidRequest,
    echo_text: Option<String>,
    w: &Waiter,
) -> Outcome {
    let n = w.rx.len();
    let mut sink: Box<dyn Sink + '_> = if v.stream {
        Box::new(SseSink {
            head: Some(req),
            out: None,
            meta,
            w,
            include_usage: v.include_usage,
            choices: (0..n)
                .map(|_| SseChoice {
                    pending_echo: echo_text.clone(),
                    offset: 0,
                    answer: v
                        .tools
                        .calls()
                        .then(|| AnswerStream::new(v.tools.is_auto())),
                })
                .collect(),
            keep_alive: w.keep_alive,
            last_write: None,
            tokens_sent: false,
        })
    } else {
        Box::new(JsonSink {
            req,
            meta,
            with_logprobs: v.top_logprobs.is_some(),
            text: vec![echo_text.unwrap_or_default(); n],
            logprobs: vec![Vec::new(); n],
            finish: vec![FinishReason::Stop; n],
            call: v.tools.calls(),
        })
    };
    let mut outcome = Outcome {
        status: 200,
        usage: Usage::default(),
        first_token: None,
        note: "",
        cached_all: 0,
    };
    let mut ended = vec![false; n];
    // The choices' usage: the prompt once (the first to end says it), their
    // completions summed.
    let mut total: Option<Usage> = None;
    loop {
        let written = match w.next_before(sink.keep_alive_at(), &ended) {
            Err(e) => {
                // The other choices stop too.
                w.cancel_all(CancelReason::Disconnect);
                return sink.fail(&e, outcome);
            }
            Ok(None) => sink.keep_alive(),
            Ok(Some((i, event))) => match event {
                Event::Started => sink.started(),
                Event::Prompt { logprobs } => sink.prompt(i, logprobs),
                Event::Token { text, logprob, .. } => {
                    outcome.first_token.get_or_insert_with(|| w.t0.elapsed());
                    // The log's count if the stream ends early (End brings the real usage).
                    outcome.usage.completion_tokens += 1;
                    sink.token(i, text, logprob)
                }
                Event::End { finish, usage } => {
                    ended[i] = true;
                    outcome.cached_all += usage.cached_tokens;
                    let t = total.get_or_insert(Usage {
                        completion_tokens: 0,
                        ..usage
                    });
                    t.completion_tokens += usage.completion_tokens;
                    let written = sink.end_choice(i, finish);
                    if written.is_ok() && ended.iter().all(|&e| e) {
                        let usage = total.expect("a choice ended");
                        outcome.usage = usage;
                        if sink.end(usage).is_err() {
                            outcome.note = w.gone_note();
                        }
                        return outcome;
                    }
                    written
                }
                // `Waiter::next_before` turns errors into `Err`; a completion
                // has no embeddings.
                Event::Error { .. } | Event::Embedding { .. } => Ok(()),
            },
        };
        if written.is_err() {
            // The cancel flags are set: the engine stops at its next step.
            outcome.note = w.gone_note();
            return outcome;
        }
    }
}

impl Waiter {
    /// The log's note for a reply cut short by a failed write.
    fn gone_note(&self) -> &'static str {
        match self.cancel_reason() {
            Some(CancelReason::Stall) => "stream_stalled",
            _ => "client_gone",
        }
    }
}

/// SSE chunks as the events come. The head goes out when the first choice
/// leaves the queue (or with its first event), so that a request refused
/// before it ran (shed, or its deadline passed) still gets its own status.
struct SseSink<'a> {
    head: Option<tiny_http::Request>,
    out: Option<sse::SseWriter>,
    meta: &'a Meta<'a>,
    w: &'a Waiter,
    include_usage: bool,
    choices: Vec<SseChoice>,
    /// How often to send `: keep-alive` between the start and the first token.
    keep_alive: Duration,
    /// When the stream last wrote; `None` before its head.
    last_write: Option<Instant>,
    tokens_sent: bool,
}

/// One choice's part of a stream.
struct SseChoice {
    /// The prompt's text (`echo`), sent with the first chunk.
    pending_echo: Option<String>,
    /// Characters sent so far (legacy logprobs' text offsets).
    offset: usize,
    /// The answer is a call (or, `auto`, a call or a text response): its
    /// text becomes `tool_calls` deltas or text.
    answer: Option<AnswerStream>,
}

impl SseSink<'_> {
    fn out(&mut self) -> Result<&mut sse::SseWriter, WriteFailed> {
        if let Some(req) = self.head.take() {
            let completion = req.completion();
            let extra = req.response_headers().to_vec();
            let out = sse::SseWriter::start(req.into_writer(), &extra, Some(completion));
            let mut out = out.map_err(|e| {
                self.w.write_failed(&e);
                WriteFailed
            })?;
            if self.meta.api == Api::Chat {
                for i in 0..self.choices.len() {
                    Self::send(self.w, &mut out, self.meta.role_chunk(i))?;
                }
            }
            self.out = Some(out);
        }
        self.last_write = Some(Instant::now());
        Ok(self.out.as_mut().expect("the stream is started"))
    }

    fn send(w: &Waiter, out: &mut sse::SseWriter, value: Value) -> Result<(), WriteFailed> {
        out.event(&value.to_string()).map_err(|e| {
            w.write_failed(&e);
            WriteFailed
        })
    }

    fn send_answer(&mut self, i: usize, deltas: Vec<AnswerDelta>) -> Result<(), WriteFailed> {
        let w = self.w;
        self.out()?;
        for d in &deltas {
            match d {
                AnswerDelta::Call(d) => {
                    let value = self.meta.tool_chunk(i, &call_id(self.meta.id, i), d);
                    Self::send(w, self.out()?, value)?;
                }
                AnswerDelta::Text(t) => self.chunk(i, t, &[])?,
            }
        }
        Ok(())
    }

    fn chunk(
        &mut self,
        i: usize,
        text: &str,
        logprobs: &[&TokenLogprob],
    ) -> Result<(), WriteFailed> {
        let c = &mut self.choices[i];
        let value = self.meta.text_chunk(i, text, logprobs, c.offset);
        c.offset += text.chars().count();
        let w = self.w;
        Self::send(w, self.out()?, value)
    }
}

impl Sink for SseSink<'_> {
    /// The head (and a chat's role chunks) goes out now: a stream that can no
    /// longer be refused has its status, and bytes flow from here on.
    fn started(&mut self) -> Result<(), WriteFailed> {
        self.out().map(|_| ())
    }

    fn keep_alive_at(&self) -> Option<Instant> {
        match self.last_write {
            Some(t) if !self.tokens_sent => Some(t + self.keep_alive),
            _ => None,
        }
    }

    fn keep_alive(&mut self) -> Result<(), WriteFailed> {
        let w = self.w;
        self.out()?.keep_alive().map_err(|e| {
            w.write_failed(&e);
            WriteFailed
        })
    }

    fn prompt(&mut self, i: usize, logprobs: Vec<TokenLogprob>) -> Result<(), WriteFailed> {
        let text = self.choices[i].pending_echo.take().unwrap_or_default();
        let entries: Vec<&TokenLogprob> = logprobs.iter().collect();
        self.chunk(i, &text, &entries)
    }

    fn token(
        &mut self,
        i: usize,
        text: String,
        logprob: Option<TokenLogprob>,
    ) -> Result<(), WriteFailed> {
        self.tokens_sent = true;
        let mut text = text;
        let c = &mut self.choices[i];
        if let Some(echo) = c.pending_echo.take() {
            c.offset += echo.chars().count();
            text.insert_str(0, &echo);
        }
        if let Some(answer) = &mut c.answer {
            let deltas = answer.push(&text);
            return self.send_answer(i, deltas);
        }
        let entries: Vec<&TokenLogprob> = logprob.iter().collect();
        if text.is_empty() && entries.is_empty() {
            // Nothing to say yet, but the stream starts.
            return self.out().map(|_| ());
        }
        self.chunk(i, &text, &entries)
    }

    fn end_choice(&mut self, i: usize, finish: FinishReason) -> Result<(), WriteFailed> {
        let w = self.w;
        if let Some(echo) = self.choices[i].pending_echo.take() {
            let value = self.meta.text_chunk(i, &echo, &[], 0);
            Self::send(w, self.out()?, value)?;
        }
        let finish = match self.choices[i].answer.take() {
            Some(mut answer) => {
                let deltas = answer.finish(finish == FinishReason::Stop);
                self.send_answer(i, deltas)?;
                match answer.is_call() {
                    true => self.meta.tool_finish_chunk(i, finish),
                    false => self.meta.finish_chunk(i, finish),
                }
            }
            None => self.meta.finish_chunk(i, finish),
        };
        Self::send(w, self.out()?, finish)
    }

    fn end(mut self: Box<Self>, usage: Usage) -> Result<(), WriteFailed> {
        let w = self.w;
        if self.include_usage {
            let value = self.meta.usage_chunk(usage);
            Self::send(w, self.out()?, value)?;
        }
        self.out()?;
        let out = self.out.take().expect("the stream is started");
        out.done().map_err(|e| {
            w.write_failed(&e);
            WriteFailed
        })
    }

    fn fail(mut self: Box<Self>, e: &ApiError, so_far: Outcome) -> Outcome {
        match (self.head.take(), self.out.take()) {
            // Nothing sent yet: the error has its own status.
            (Some(req), _) => {
                respond_error(req, e);
                outcome_of_error(e)
            }
            // Mid-stream: an error event, then the stream ends.
            (None, Some(mut out)) => {
                let _ = Self::send(self.w, &mut out, e.to_json());
                let _ = out.end();
                Outcome {
                    note: e.code(),
                    ..so_far
                }
            }
            (None, None) => so_far,
        }
    }
}

/// One JSON body at the end: each choice's text and log-probabilities gathered.
struct JsonSink<'a> {
    req: tiny_http::Request,
    meta: &'a Meta<'a>,
    with_logprobs: bool,
    text: Vec<String>,
    logprobs: Vec<Vec<TokenLogprob>>,
    finish: Vec<FinishReason>,
    /// The answer is a call (or, `auto`, a call or a text response): its
    /// text becomes `tool_calls` or text.
    call: bool,
}

impl Sink for JsonSink<'_> {
    /// A JSON answer has one status, sent with its body: nothing to say early.
    fn started(&mut self) -> Result<(), WriteFailed> {
        Ok(())
    }

    fn keep_alive_at(&self) -> Option<Instant> {
        None
    }

    fn keep_alive(&mut self) -> Result<(), WriteFailed> {
        Ok(())
    }

    fn prompt(&mut self, i: usize, logprobs: Vec<TokenLogprob>) -> Result<(), WriteFailed> {
        self.logprobs[i].extend(logprobs);
        Ok(())
    }

    fn token(
        &mut self,
        i: usize,
        text: String,
        logprob: Option<TokenLogprob>,
    ) -> Result<(), WriteFailed> {
        self.text[i].push_str(&text);
        self.logprobs[i].extend(logprob);
        Ok(())
    }

    fn end_choice(&mut self, i: usize, finish: FinishReason) -> Result<(), WriteFailed> {
        self.finish[i] = finish;
        Ok(())
    }

    fn end(self: Box<Self>, usage: Usage) -> Result<(), WriteFailed> {
        let choices: Vec<Value> = (0..self.text.len())
            .map(|i| {
                let answer = self.call.then(|| tools::parse_answer(&self.text[i]));
                if let Some(Answer::Call(name, args)) = answer {
                    self.meta.tool_choice(
                        i,
                        &call_id(self.meta.id, i),
                        &name,
                        &args,
                        self.finish[i],
                    )
                } else if let Some(Answer::Text(text)) = answer {
                    self.meta.text_choice(i, &text, None, self.finish[i])
                } else {
                    let entries: Vec<&TokenLogprob> = self.logprobs[i].iter().collect();
                    let lp = self.with_logprobs.then_some(entries.as_slice());
                    self.meta.text_choice(i, &self.text[i], lp, self.finish[i])
                }
            })
            .collect();
        respond_json(self.req, 200, &self.meta.response(choices, usage));
        Ok(())
    }

    fn fail(self: Box<Self>, e: &ApiError, _so_far: Outcome) -> Outcome {
        respond_error(self.req, e);
        outcome_of_error(e)
    }
}

/// A call's id, from its response's and its choice's index.
fn call_id(response_id: &str, i: usize) -> String {
    let unique = response_id.strip_prefix("chatcmpl-").unwrap_or(response_id);
    match i {
        0 => format!("call_{unique}"),
        _ => format!("call_{unique}-{i}"),
    }
}
