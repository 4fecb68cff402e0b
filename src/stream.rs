//! The closed protocol between the engine and the handler thread of one request.
//!
//! Each request gets its own bounded channel of [`Event`]s whose capacity is
//! counted in tokens (one `Token` event per generated token). A stream that ends
//! without `End` or `Error` is visibly incomplete. A failed send tells the engine
//! the client is gone; a full channel tells it the client is slow.
//!
//! Beside the channel, each request has a [`CancelFlag`] the handler sets when it
//! stops waiting (the client left, the socket stalled, the request's time ran
//! out): the engine reads it before every step, so a request stops costing
//! within one step, even while nothing is being sent (a long prefill, a request
//! still in the queue), and a `llama_decode` whose every sequence is cancelled is
//! aborted mid-pass.

use crate::ffi::Token;
use crossbeam_channel::{Sender, TrySendError};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The engine's end of a request's channel, which wakes the handler thread
/// waiting on it after each event it takes.
///
/// The handler does not block in the channel: crossbeam's blocking receive
/// first spins and then yields the CPU a few times before it sleeps, and on a
/// box whose every core runs a compute thread each of those yields lets the
/// handler preempt one again, stalling the other compute threads at their
/// next barrier, once per token per stream. The handler instead sleeps in
/// `std::thread::park_timeout` (a futex, no spinning) after finding the
/// channel empty, and the engine unparks it after each event.
#[derive(Debug, Clone)]
pub struct EventSender {
    tx: Sender<Event>,
    reader: std::thread::Thread,
}

impl EventSender {
    /// `tx`, whose events `reader` waits for by parking.
    pub fn new(tx: Sender<Event>, reader: std::thread::Thread) -> EventSender {
        EventSender { tx, reader }
    }

    /// Sends `event` if the channel has room (never blocks), then wakes the
    /// reader.
    pub fn try_send(&self, event: Event) -> Result<(), TrySendError<Event>> {
        let sent = self.tx.try_send(event);
        if sent.is_ok() {
            self.reader.unpark();
        }
        sent
    }

    /// Whether the channel holds as many events as it takes.
    pub fn is_full(&self) -> bool {
        self.tx.is_full()
    }
}

/// Default capacity of a stream's channel, in tokens. Small on purpose: a slow
/// reader pauses its own sequence instead of making the server buffer its output.
pub const STREAM_BUFFER_TOKENS_DEFAULT: usize = 16;
/// Largest capacity an operator may configure.
pub const STREAM_BUFFER_TOKENS_MAX: usize = 256;

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The request left the queue for a slot: it can no longer be shed, and
    /// its first token comes after its prefill.
    Started,
    /// Log-probabilities of the prompt's tokens (only for `echo` with `logprobs`).
    Prompt {
        logprobs: Vec<TokenLogprob>,
    },
    /// One generated token. `text` is what became final with it: it may be empty
    /// (half a UTF-8 character, or text held back as a possible stop string).
    Token {
        token: Token,
        text: String,
        logprob: Option<TokenLogprob>,
        /// A token decoded ahead of its stream's pace (the engine is about to
        /// prefill a long prompt in one large chunk): a streaming reply sends
        /// it no sooner than this, so the stream keeps its pace through the
        /// chunk instead of pausing for it. `None`: at once.
        not_before: Option<Instant>,
    },
    /// The vector of input `index` of an embedding request.
    Embedding {
        index: usize,
        vector: Vec<f32>,
    },
    End {
        finish: FinishReason,
        usage: Usage,
    },
    Error {
        kind: ErrorKind,
        message: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// End-of-generation token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Of the prompt tokens, those taken from the prefix cache (not prefilled).
    pub cached_tokens: usize,
}

/// Why the engine ended a request with an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// llama.cpp failed to decode a batch holding this request.
    Engine,
    /// Shed at dequeue (503): see [`ShedReason`].
    Shed { reason: ShedReason },
    /// The caller's deadline passed before the request could start.
    DeadlineExceeded,
    /// The server is shutting down: the drain's deadline passed first.
    Shutdown,
}

/// Why a request was shed at dequeue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShedReason {
    /// CoDel: the queue has been standing above its sojourn target for an interval.
    Sojourn,
    /// It waited past the sojourn target, and its forecast prefill would bring
    /// its first token past the queueing budget W_max: it would only be late.
    TtftBudget,
}

impl ShedReason {
    /// The stable error code and metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            ShedReason::Sojourn => "shed_sojourn",
            ShedReason::TtftBudget => "shed_ttft_budget",
        }
    }
}

/// The log-probability of one token, with the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: Token,
    /// The token's text (lossy if it is part of a UTF-8 character).
    pub text: String,
    /// `None` for the first prompt token, which nothing predicts.
    pub logprob: Option<f32>,
    /// Most likely tokens at this position, most likely first.
    pub top: Vec<(Token, String, f32)>,
}

/// Why a request was cancelled before it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum CancelReason {
    /// The client closed its connection, or a write to it failed.
    Disconnect = 1,
    /// The client read nothing for `--stall-timeout-ms`.
    Stall = 2,
    /// The request's time ran out (`--request-timeout-ms`, `X-Request-Timeout`).
    Deadline = 3,
    /// The server is shutting down.
    Shutdown = 4,
    /// A batch line gave way to interactive requests (`http::batch_runner`);
    /// it runs again later.
    Preempted = 5,
}

impl CancelReason {
    /// The metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            CancelReason::Disconnect => "disconnect",
            CancelReason::Stall => "stall",
            CancelReason::Deadline => "deadline",
            CancelReason::Shutdown => "shutdown",
            CancelReason::Preempted => "preempted",
        }
    }

    pub const ALL: [CancelReason; 5] = [
        CancelReason::Disconnect,
        CancelReason::Stall,
        CancelReason::Deadline,
        CancelReason::Shutdown,
        CancelReason::Preempted,
    ];

    fn from_u8(v: u8) -> Option<CancelReason> {
        CancelReason::ALL.into_iter().find(|r| *r as u8 == v)
    }
}

/// Set once, by whoever first gives up on the request; read by the engine
/// before each step (and by the abort callback during one).
#[derive(Debug, Clone, Default)]
pub struct CancelFlag {
    reason: Arc<AtomicU8>,
    /// The engine's step count when the flag was set: how many steps the
    /// engine took to act on it is the difference at the time it does.
    at_step: Arc<AtomicU64>,
}

impl CancelFlag {
    /// Cancels with `reason` at the engine's step count `step`, unless already
    /// cancelled (the first reason stays).
    pub fn cancel(&self, reason: CancelReason, step: u64) {
        if self
            .reason
            .compare_exchange(0, reason as u8, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.at_step.store(step, Ordering::Release);
        }
    }

    pub fn reason(&self) -> Option<CancelReason> {
        CancelReason::from_u8(self.reason.load(Ordering::Acquire))
    }

    /// The engine's step count when it was cancelled.
    pub fn at_step(&self) -> u64 {
        self.at_step.load(Ordering::Acquire)
    }

    /// The raw flag, for the abort callback (non-zero once cancelled).
    pub fn raw(&self) -> &Arc<AtomicU8> {
        &self.reason
    }
}

/// A sequence's pause: it pauses when its stream's buffer is full (the reader
/// is slow), resumes when the reader takes an event, and is stalled once it has
/// been paused for longer than the stall timeout without a break.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pause {
    since: Option<Instant>,
}

impl Pause {
    /// The buffer was full at `now`: the pause starts (or goes on).
    pub fn full(&mut self, now: Instant) {
        self.since.get_or_insert(now);
    }

    /// The reader took what was held: the sequence runs again.
    pub fn drained(&mut self) {
        self.since = None;
    }

    pub fn is_paused(&self) -> bool {
        self.since.is_some()
    }

    /// Paused for longer than `timeout` at `now`.
    pub fn stalled(&self, now: Instant, timeout: Duration) -> bool {
        self.since
            .is_some_and(|t| now.saturating_duration_since(t) > timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_wakes_the_reader_parked_for_it() {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let events = EventSender::new(tx, std::thread::current());
        // Spend any unpark this thread already holds.
        std::thread::park_timeout(Duration::ZERO);
        let sender = std::thread::spawn(move || {
            let first = events.try_send(Event::Started);
            (first, events.try_send(Event::Started))
        });
        // Without the sender's unpark, the park lasts the whole minute.
        let limit = Duration::from_secs(60);
        let t0 = Instant::now();
        while rx.is_empty() && t0.elapsed() < limit {
            std::thread::park_timeout(limit);
        }
        assert!(t0.elapsed() < limit, "the reader was not woken");
        let (first, second) = sender.join().expect("sender thread");
        assert!(first.is_ok());
        assert!(
            matches!(second, Err(TrySendError::Full(Event::Started))),
            "a full channel refuses, as crossbeam's"
        );
        assert_eq!(rx.try_recv(), Ok(Event::Started));
    }

    #[test]
    fn the_first_cancel_reason_stays() {
        let f = CancelFlag::default();
        assert_eq!(f.reason(), None);
        let g = f.clone();
        g.cancel(CancelReason::Stall, 7);
        f.cancel(CancelReason::Disconnect, 9);
        assert_eq!(f.reason(), Some(CancelReason::Stall));
        assert_eq!(f.at_step(), 7);
        assert_ne!(f.raw().load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_pause_stalls_only_when_unbroken_for_the_timeout() {
        let t0 = Instant::now();
        let s = |ms| t0 + Duration::from_millis(ms);
        let timeout = Duration::from_millis(1000);
        let mut p = Pause::default();
        assert!(!p.is_paused() && !p.stalled(s(5000), timeout));
        p.full(s(0));
        p.full(s(600)); // still full: the pause started at 0
        assert!(p.is_paused());
        assert!(!p.stalled(s(1000), timeout));
        assert!(p.stalled(s(1001), timeout));
        p.drained(); // the reader took an event: resume, and the clock restarts
        assert!(!p.is_paused() && !p.stalled(s(1500), timeout));
        p.full(s(1500));
        assert!(!p.stalled(s(2400), timeout));
        assert!(p.stalled(s(2600), timeout));
    }
}
