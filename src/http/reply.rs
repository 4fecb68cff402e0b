//! The engine's events folded into the reply: one loop reads them (`reply`)
//! and a `Sink` says what each becomes, SSE chunks written as they come
//! (`stream: true`) or one JSON body at the end.

use super::error::ApiError;
use super::openai::Meta;
use super::tools::{self, CallStream};
use super::validation::{Api, ValidRequest};
use super::{outcome_of_error, respond_error, respond_json, sse, Outcome};
use crate::ffi;
use crate::metrics::Metrics;
use crate::stream::{
    CancelFlag, CancelReason, ErrorKind, Event, FinishReason, TokenLogprob, Usage,
};
use crossbeam_channel::{Receiver, RecvTimeoutError};
use serde_json::Value;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a handler waiting for the engine checks that its client is still
/// there: well under one engine step on a CPU.
const PEER_PROBE_INTERVAL: Duration = Duration::from_millis(20);

/// A handler's side of one request in the engine: its events, its deadline,
/// its client's socket, and the flag that tells the engine it gave up.
pub(super) struct Waiter {
    pub(super) rx: Receiver<Event>,
    pub(super) t0: Instant,
    pub(super) deadline: Instant,
    pub(super) timeout_ms: u64,
    pub(super) stall_timeout_ms: u64,
    pub(super) probe: Option<std::os::fd::OwnedFd>,
    /// When the client's socket was last probed.
    pub(super) probed_at: std::cell::Cell<Instant>,
    pub(super) cancel: CancelFlag,
    pub(super) metrics: Arc<Metrics>,
    /// `--sse-keep-alive-ms`.
    pub(super) keep_alive: Duration,
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
    /// client is still there, or until `tick` passes (then `Ok(None)`). Every
    /// way of not getting one (timeout, the client gone, a stall, a stopped
    /// engine, an engine refusal) is an `ApiError`; giving up sets the cancel
    /// flag first, so the engine stops at its next step.
    fn next_before(&self, tick: Option<Instant>) -> Result<Option<Event>, ApiError> {
        loop {
            let now = Instant::now();
            if tick.is_some_and(|t| now >= t) {
                return Ok(None);
            }
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
            let mut wait = PEER_PROBE_INTERVAL.min(self.deadline - now);
            if let Some(t) = tick {
                wait = wait.min(t - now);
            }
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
                Ok(event) => return Ok(Some(event)),
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

/// A write to the client failed (the cancel flag is set, `Waiter::write_failed`).
struct WriteFailed;

/// What the events of one request become.
trait Sink {
    /// The request left the queue: it will not be shed.
    fn started(&mut self) -> Result<(), WriteFailed>;
    /// When to send a keep-alive, if one is due before the next event.
    fn keep_alive_at(&self) -> Option<Instant>;
    fn keep_alive(&mut self) -> Result<(), WriteFailed>;
    /// The prompt's log-probabilities (`echo` with `logprobs`).
    fn prompt(&mut self, logprobs: Vec<TokenLogprob>) -> Result<(), WriteFailed>;
    fn token(&mut self, text: String, logprob: Option<TokenLogprob>) -> Result<(), WriteFailed>;
    fn end(self: Box<Self>, finish: FinishReason, usage: Usage) -> Result<(), WriteFailed>;
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
    let mut sink: Box<dyn Sink + '_> = if v.stream {
        Box::new(SseSink {
            head: Some(req),
            out: None,
            meta,
            w,
            include_usage: v.include_usage,
            pending_echo: echo_text,
            offset: 0,
            keep_alive: w.keep_alive,
            last_write: None,
            tokens_sent: false,
            call: v.tools.calls().then(CallStream::default),
        })
    } else {
        Box::new(JsonSink {
            req,
            meta,
            with_logprobs: v.top_logprobs.is_some(),
            text: echo_text.unwrap_or_default(),
            logprobs: Vec::new(),
            call: v.tools.calls(),
        })
    };
    let mut outcome = Outcome {
        status: 200,
        usage: Usage::default(),
        first_token: None,
        note: "",
    };
    loop {
        let written = match w.next_before(sink.keep_alive_at()) {
            Err(e) => return sink.fail(&e, outcome),
            Ok(None) => sink.keep_alive(),
            Ok(Some(event)) => match event {
                Event::Started => sink.started(),
                Event::Prompt { logprobs } => sink.prompt(logprobs),
                Event::Token { text, logprob, .. } => {
                    outcome.first_token.get_or_insert_with(|| w.t0.elapsed());
                    // The log's count if the stream ends early (End brings the real usage).
                    outcome.usage.completion_tokens += 1;
                    sink.token(text, logprob)
                }
                Event::End { finish, usage } => {
                    outcome.usage = usage;
                    let written = sink.end(finish, usage);
                    if written.is_err() {
                        outcome.note = w.gone_note();
                    }
                    return outcome;
                }
                // `Waiter::next_before` turns errors into `Err`.
                Event::Error { .. } => Ok(()),
            },
        };
        if written.is_err() {
            // The cancel flag is set: the engine stops at its next step.
            outcome.note = w.gone_note();
            return outcome;
        }
    }
}

impl Waiter {
    /// The log's note for a reply cut short by a failed write.
    fn gone_note(&self) -> &'static str {
        match self.cancel.reason() {
            Some(CancelReason::Stall) => "stream_stalled",
            _ => "client_gone",
        }
    }
}

/// SSE chunks as the events come. The head goes out with the first event, so
/// that a request refused before it ran (shed, or its deadline passed) still
/// gets its own status code.
struct SseSink<'a> {
    head: Option<tiny_http::Request>,
    out: Option<sse::SseWriter>,
    meta: &'a Meta<'a>,
    w: &'a Waiter,
    include_usage: bool,
    /// The prompt's text (`echo`), sent with the first chunk.
    pending_echo: Option<String>,
    /// Characters sent so far (legacy logprobs' text offsets).
    offset: usize,
    /// How often to send `: keep-alive` between the start and the first token.
    keep_alive: Duration,
    /// When the stream last wrote; `None` before its head.
    last_write: Option<Instant>,
    tokens_sent: bool,
    /// The answer is a call: its text becomes `tool_calls` deltas.
    call: Option<CallStream>,
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
                Self::send(self.w, &mut out, self.meta.role_chunk())?;
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

    fn send_call(&mut self, deltas: Vec<tools::CallDelta>) -> Result<(), WriteFailed> {
        let w = self.w;
        self.out()?;
        for d in &deltas {
            let value = self.meta.tool_chunk(&call_id(self.meta.id), d);
            Self::send(w, self.out()?, value)?;
        }
        Ok(())
    }

    fn chunk(&mut self, text: &str, logprobs: &[&TokenLogprob]) -> Result<(), WriteFailed> {
        let value = self.meta.text_chunk(text, logprobs, self.offset);
        self.offset += text.chars().count();
        let w = self.w;
        Self::send(w, self.out()?, value)
    }
}

impl Sink for SseSink<'_> {
    /// The head (and a chat's role chunk) goes out now: a stream that can no
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

    fn prompt(&mut self, logprobs: Vec<TokenLogprob>) -> Result<(), WriteFailed> {
        let text = self.pending_echo.take().unwrap_or_default();
        let entries: Vec<&TokenLogprob> = logprobs.iter().collect();
        self.chunk(&text, &entries)
    }

    fn token(&mut self, text: String, logprob: Option<TokenLogprob>) -> Result<(), WriteFailed> {
        self.tokens_sent = true;
        let mut text = text;
        if let Some(echo) = self.pending_echo.take() {
            self.offset += echo.chars().count();
            text.insert_str(0, &echo);
        }
        if let Some(call) = &mut self.call {
            let deltas = call.push(&text);
            return self.send_call(deltas);
        }
        let entries: Vec<&TokenLogprob> = logprob.iter().collect();
        if text.is_empty() && entries.is_empty() {
            // Nothing to say yet, but the stream starts.
            return self.out().map(|_| ());
        }
        self.chunk(&text, &entries)
    }

    fn end(mut self: Box<Self>, finish: FinishReason, usage: Usage) -> Result<(), WriteFailed> {
        let w = self.w;
        if let Some(echo) = self.pending_echo.take() {
            let value = self.meta.text_chunk(&echo, &[], 0);
            Self::send(w, self.out()?, value)?;
        }
        let finish = match self.call.take() {
            Some(mut call) => {
                let deltas = call.finish(finish == FinishReason::Stop);
                self.send_call(deltas)?;
                self.meta.tool_finish_chunk(finish)
            }
            None => self.meta.finish_chunk(finish),
        };
        Self::send(w, self.out()?, finish)?;
        if self.include_usage {
            let value = self.meta.usage_chunk(usage);
            Self::send(w, self.out()?, value)?;
        }
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

/// One JSON body at the end: text and log-probabilities gathered.
struct JsonSink<'a> {
    req: tiny_http::Request,
    meta: &'a Meta<'a>,
    with_logprobs: bool,
    text: String,
    logprobs: Vec<TokenLogprob>,
    /// The answer is a call: its text becomes `tool_calls`.
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

    fn prompt(&mut self, logprobs: Vec<TokenLogprob>) -> Result<(), WriteFailed> {
        self.logprobs.extend(logprobs);
        Ok(())
    }

    fn token(&mut self, text: String, logprob: Option<TokenLogprob>) -> Result<(), WriteFailed> {
        self.text.push_str(&text);
        self.logprobs.extend(logprob);
        Ok(())
    }

    fn end(self: Box<Self>, finish: FinishReason, usage: Usage) -> Result<(), WriteFailed> {
        if self.call {
            let (name, args) = tools::parse_call(&self.text).unwrap_or_default();
            let body = self
                .meta
                .tool_response(&call_id(self.meta.id), &name, &args, finish, usage);
            respond_json(self.req, 200, &body);
            return Ok(());
        }
        let entries: Vec<&TokenLogprob> = self.logprobs.iter().collect();
        let lp = self.with_logprobs.then_some(entries.as_slice());
        respond_json(
            self.req,
            200,
            &self.meta.response(&self.text, lp, finish, usage),
        );
        Ok(())
    }

    fn fail(self: Box<Self>, e: &ApiError, _so_far: Outcome) -> Outcome {
        respond_error(self.req, e);
        outcome_of_error(e)
    }
}

/// A call's id, from its response's (one call per answer).
fn call_id(response_id: &str) -> String {
    let unique = response_id.strip_prefix("chatcmpl-").unwrap_or(response_id);
    format!("call_{unique}")
}
