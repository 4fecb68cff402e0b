//! The closed protocol between the engine and the handler thread of one request.
//!
//! Each request gets its own bounded channel of [`Event`]s whose capacity is
//! counted in tokens (one `Token` event per generated token). A stream that ends
//! without `End` or `Error` is visibly incomplete. A failed send tells the engine
//! the client is gone; a full channel tells it the client is slow.

use crate::engine::ffi::Token;

/// Default capacity of a stream's channel, in tokens. Small on purpose: a slow
/// reader pauses its own sequence instead of making the server buffer its output.
pub const STREAM_BUFFER_TOKENS_DEFAULT: usize = 16;
/// Largest capacity an operator may configure.
pub const STREAM_BUFFER_TOKENS_MAX: usize = 256;

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
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
}

/// Why the engine ended a request with an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// llama.cpp failed to decode a batch holding this request.
    Engine,
    /// Shed at dequeue (503): see [`ShedReason`].
    Shed {
        reason: ShedReason,
        retry_after_s: u64,
    },
    /// The caller's deadline passed before the request could start.
    DeadlineExceeded,
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
