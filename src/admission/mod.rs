//! Admission: the bounded queue between the HTTP handlers and the engine, and the
//! bounds that say no before a request can wait longer than its budget.
//!
//! The bounds are derived, not guessed (Little's law, L = μ · W): with μ_req the
//! request service rate measured on this machine and W_max the operator's
//! queueing budget for time to first token (`--queue-wait-ms`),
//! `L_max = ceil(μ_req · W_max)`, clamped to 1..=9. A second bound is in tokens,
//! because 16 short prompts and 16 8k prompts are not the same load: a request
//! that must wait behind more than one waiting request per slot is admitted
//! only while the prompt tokens already waiting ahead of it are within
//! `μ_prefill · W_max` (their prefill is its queueing delay; its own prompt is
//! its service, and a long prompt behind a short queue is served, not
//! refused). Up to one per slot waits whatever its prompt, as L_max never
//! falls below one per slot: a closed loop of twice the slots' clients cannot
//! grow the queue, so refusing it would protect no one.
//!
//! Handlers only ever `try_send`. A gate in front of the channel counts what is
//! queued (requests and prompt tokens, until the engine gives the request a
//! slot) and refuses with 429 + `Retry-After` when either bound would break.
//! Neither rule needs the request's own prompt, so the door applies them
//! before the body is read (`Admission::precheck`); the choices of one
//! request are judged together (`Admission::submit_all`).
//!
//! The bounds are live: the engine refines the rates online from the steps it
//! runs (`engine::cost`) and publishes them (through the metrics registry,
//! `Reporter::set_rates`), and the gate re-derives L_max and the token budget
//! from them when it is next taken. A channel's capacity is fixed at creation,
//! so it is sized for the highest L_max the gate may ever allow (9, or the
//! operator's `--queue-depth`); the gate enforces the live one below it.
//!
//! Each priority class (`priority::Class`) has its own queue, gate and bounds,
//! derived from its own W_max (`--queue-wait-ms` for interactive,
//! `--batch-queue-wait-ms` for batch), so a flood of batch work fills only its
//! own queue and is refused there, while interactive requests are still
//! admitted. Which queue the engine serves first is `priority::Picker`'s rule.

mod bounds;
mod gate;
pub mod prefixes;
mod report;

pub use bounds::*;
pub use gate::QueueGauge;
use gate::Refusal;
pub use report::{Reporter, Slot};

use crate::embed::EmbedSpec;
use crate::ffi::{SamplingParams, Token};
use crate::metrics::Metrics;
use crate::priority::Class;
use crate::stream::{CancelFlag, CancelReason, EventSender};
use crossbeam_channel::{bounded, Receiver, Sender, TrySendError};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How a request's sampled tokens shift the next token's logits, as OpenAI
/// and vLLM define them: `logit_bias` adds to a token's logit; presence and
/// frequency penalties subtract, per token already generated, `presence` once
/// and `frequency` per time it was generated; the repetition penalty (vLLM's,
/// from the CTRL paper) divides a positive logit of a token seen in the prompt
/// or the output by it and multiplies a negative one.
#[derive(Debug, Clone, PartialEq)]
pub struct Penalties {
    pub presence: f32,
    pub frequency: f32,
    /// 1 is none.
    pub repetition: f32,
    /// (token, bias) pairs, each token once.
    pub logit_bias: Vec<(Token, f32)>,
}

impl Default for Penalties {
    fn default() -> Penalties {
        Penalties {
            presence: 0.0,
            frequency: 0.0,
            repetition: 1.0,
            logit_bias: Vec::new(),
        }
    }
}

impl Penalties {
    /// Whether they leave every logit as it is (the sampler's fast path).
    pub fn is_none(&self) -> bool {
        self.presence == 0.0
            && self.frequency == 0.0
            && self.repetition == 1.0
            && self.logit_bias.is_empty()
    }
}

/// How far ahead refused requests are given return times, at most (the
/// OpenAI SDKs honour a `retry-after-ms` up to 60 s).
const PROMISE_HORIZON_S: f64 = 60.0;

/// What a request asks the engine to generate.
#[derive(Debug, Clone)]
pub struct GenParams {
    /// Most tokens to generate (0 only with `echo_logprobs`: score the prompt).
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub penalties: Penalties,
    /// Structured output: what the answer may be, token by token.
    pub constraint: Option<crate::grammar::Constraint>,
    pub stop: Vec<String>,
    /// Generate exactly `max_tokens`: end-of-generation tokens are never
    /// sampled (unless a constraint decides where the answer ends).
    pub ignore_eos: bool,
    /// Alternatives per position to report; `None` reports no log-probabilities.
    pub top_logprobs: Option<usize>,
    /// Also report the log-probabilities of the prompt tokens.
    pub echo_logprobs: bool,
}

/// What a job asks of the engine.
pub enum Task {
    /// Generate tokens: a completion's or chat's choice.
    Generate(Box<GenParams>),
    /// Prefill the prompt (its inputs one after another) and pool each
    /// input's token states into a vector; nothing is generated.
    Embed(EmbedSpec),
}

/// A validated, tokenized request: what the queue holds and the engine runs.
pub struct Job {
    pub id: u64,
    /// The request's `X-Request-Id`, for the engine's log lines about it.
    pub request_id: std::sync::Arc<str>,
    pub class: Class,
    pub prompt: Vec<Token>,
    pub task: Task,
    pub enqueued_at: Instant,
    /// The caller's deadline (`X-Request-Timeout`, capped by the server's
    /// ceiling): past it, the job is dropped before it costs a single FLOP.
    pub deadline: Option<Instant>,
    pub events: EventSender,
    /// Set by the handler when it stops waiting for this job.
    pub cancel: CancelFlag,
    /// Prompt tokens the handler found in the prefix cache when it admitted
    /// the job (`PrefixIndex::reusable`): admission counted only the rest.
    pub cached_estimate: usize,
    /// A choice after the first of a request with `n` > 1: the id of the
    /// first choice's job, whose prompt cells it takes instead of
    /// prefilling the same prompt again.
    pub prompt_of: Option<u64>,
}

impl Job {
    /// KV cells the job may occupy at most (cells it shares with another
    /// running sequence included): an embedding request's inputs run one at
    /// a time.
    pub fn kv_cells(&self) -> usize {
        match &self.task {
            Task::Embed(spec) => spec.longest(),
            Task::Generate(gen) => self.prompt.len() + gen.max_tokens,
        }
    }

    /// An embedding job's inputs.
    pub fn embed(&self) -> Option<&EmbedSpec> {
        match &self.task {
            Task::Embed(spec) => Some(spec),
            Task::Generate(_) => None,
        }
    }

    fn gen(&self) -> Option<&GenParams> {
        match &self.task {
            Task::Generate(gen) => Some(gen),
            Task::Embed(_) => None,
        }
    }

    /// Most tokens to generate (an embedding job's: none).
    pub fn max_tokens(&self) -> usize {
        self.gen().map_or(0, |g| g.max_tokens)
    }

    /// Whether the prompt's log-probabilities are asked for.
    pub fn echo_logprobs(&self) -> bool {
        self.gen().is_some_and(|g| g.echo_logprobs)
    }

    /// Alternatives per position to report, if log-probabilities are asked for.
    pub fn top_logprobs(&self) -> Option<usize> {
        self.gen().and_then(|g| g.top_logprobs)
    }

    /// Keep generating past end-of-generation tokens.
    pub fn ignore_eos(&self) -> bool {
        self.gen().is_some_and(|g| g.ignore_eos)
    }

    /// Prompt tokens admission counts for the job while it waits: the ones it
    /// was expected to prefill.
    pub fn queued_tokens(&self) -> usize {
        self.prompt.len().saturating_sub(self.cached_estimate)
    }
}

/// Which admission bound a refused request would have broken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueBound {
    /// The number of waiting requests.
    Requests,
    /// The prompt tokens waiting.
    Tokens,
}

/// A request the gate refused, and what it saw: what waits ahead of it, the
/// bound it would break, and how long until that work is done.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueFull {
    pub bound: QueueBound,
    pub class: Class,
    pub queued: usize,
    pub queue_depth_max: usize,
    pub queued_tokens: usize,
    pub queued_tokens_max: usize,
    /// When to come back (`QueueGauge::promise`), and that in whole seconds
    /// (at least 1), rounded up.
    pub retry_after_ms: u64,
    pub retry_after_s: u64,
}

/// Why `Admission::submit` said no (`http::error` gives each its status).
#[derive(Debug, Clone, PartialEq)]
pub enum Refused {
    /// Admitting the request would break a queue bound.
    QueueFull(QueueFull),
    /// The engine has stopped taking jobs.
    EngineStopped,
}

/// Each class's queue, for the engine: receivers indexed by `Class::index`.
pub type Queues = [Receiver<Job>; Class::COUNT];

pub struct Admission {
    tx: [Sender<Job>; Class::COUNT],
    gauge: Arc<QueueGauge>,
    metrics: Arc<Metrics>,
}

impl Admission {
    /// Creates one queue per class; the receivers and the reporter go to the
    /// engine, the gauge to the handlers (and `/metrics`). The gate never lets more of a class wait than the slots plus its
    /// live L_max, and L_max never exceeds its ceiling, so each channel, sized
    /// for the ceiling, never refuses a request the gate admitted.
    pub fn new(
        slots: usize,
        batch_slots: usize,
        rates: Rates,
        policies: [Policy; Class::COUNT],
        metrics: Arc<Metrics>,
    ) -> (Admission, Queues, Arc<QueueGauge>, Reporter) {
        assert!(slots >= 1);
        let capacities = policies.map(|p| {
            let ceiling = p.queue_depth_ceiling();
            assert!(ceiling >= 1);
            slots + ceiling
        });
        let [(tx_i, rx_i), (tx_b, rx_b)] = capacities.map(bounded);
        let alive_max = slots + capacities.iter().sum::<usize>();
        let (reports_tx, reports_rx) = bounded(report::reports_capacity(alive_max));
        let gauge = Arc::new(QueueGauge::new(
            slots,
            batch_slots,
            rates,
            policies,
            reports_rx,
            Arc::clone(&metrics),
        ));
        let reporter = Reporter {
            tx: reports_tx,
            metrics: Arc::clone(&metrics),
        };
        let admission = Admission {
            tx: [tx_i, tx_b],
            gauge: Arc::clone(&gauge),
            metrics,
        };
        (admission, [rx_i, rx_b], gauge, reporter)
    }

    /// The door's check, before a request's body is read: refuses it when
    /// the queue's state says a request of `class` would break a bound (the
    /// count, or the prompt tokens ahead of it), as `submit` would after
    /// parsing and tokenizing it: neither rule depends on its prompt.
    /// Reserves nothing: a request that passes is judged again by `submit`
    /// (the queue may have moved, and a request of `n` choices needs `n`
    /// places). The refused client is promised a return time for the
    /// typical request.
    /// When a request of `class` with `prompt_tokens` to prefill would get
    /// its first token if it came now (`QueueGauge::first_token_forecast`).
    pub fn first_token_forecast(&self, class: Class, prompt_tokens: usize) -> Duration {
        self.gauge.first_token_forecast(class, prompt_tokens)
    }

    pub fn precheck(&self, class: Class) -> Result<(), Refused> {
        let r = match self.gauge.check(class) {
            Ok(()) => return Ok(()),
            Err(r) => r,
        };
        self.metrics
            .rejected_before_parsing
            .fetch_add(1, Ordering::Relaxed);
        let typical = self.gauge.typical();
        // Its own prompt is not known (it was not read): its return time is
        // a typical request's.
        Err(self.refused(class, r, typical.prompt_tokens, typical.max_tokens))
    }

    /// Counts a refusal of the gate and promises the client a return time.
    fn refused(&self, class: Class, r: Refusal, tokens: usize, max_tokens: usize) -> Refused {
        let counters = self.metrics.class(class);
        let (counter, by_class) = match r.bound {
            QueueBound::Requests => (
                &self.metrics.rejected_queue_full,
                &counters.rejected_queue_full,
            ),
            QueueBound::Tokens => (
                &self.metrics.rejected_token_budget,
                &counters.rejected_token_budget,
            ),
        };
        counter.fetch_add(1, Ordering::Relaxed);
        by_class.fetch_add(1, Ordering::Relaxed);
        let own_s =
            tokens as f64 / r.rates.prefill_tok_s + max_tokens as f64 / r.rates.decode_tok_s;
        let wait = self.gauge.promise(class, own_s);
        let retry_after_ms = wait.as_millis() as u64;
        Refused::QueueFull(QueueFull {
            bound: r.bound,
            class,
            queued: r.waiting,
            queue_depth_max: r.bounds.queue_depth_max,
            queued_tokens: r.waiting_tokens,
            queued_tokens_max: r.bounds.queued_tokens_max,
            retry_after_ms,
            retry_after_s: retry_after_ms.div_ceil(1000).max(RETRY_AFTER_S_MIN),
        })
    }

    pub fn submit(&self, job: Job) -> Result<(), Refused> {
        self.submit_all(vec![job])
    }

    /// Submits the jobs of one request (its choices, all of one class): all
    /// of them are admitted or none is, judged together, so a refused
    /// request leaves nothing behind in the queue.
    pub fn submit_all(&self, jobs: Vec<Job>) -> Result<(), Refused> {
        let Some(first) = jobs.first() else {
            return Ok(());
        };
        let class = first.class;
        debug_assert!(jobs.iter().all(|j| j.class == class));
        // Prompt tokens found in the prefix cache are not prefilled: they do
        // not count against the queued-token budget.
        let tokens: usize = jobs.iter().map(Job::queued_tokens).sum();
        let max_tokens: usize = jobs.iter().map(Job::max_tokens).sum();
        let counters = self.metrics.class(class);
        if let Err(r) = self.gauge.reserve(class, jobs.len(), tokens) {
            return Err(self.refused(class, r, tokens, max_tokens));
        }
        let mut sent: Vec<CancelFlag> = Vec::with_capacity(jobs.len());
        let mut jobs = jobs.into_iter();
        for job in jobs.by_ref() {
            let tokens = job.queued_tokens();
            let cancel = job.cancel.clone();
            match self.tx[class.index()].try_send(job) {
                Ok(()) => {
                    self.metrics.accepted.fetch_add(1, Ordering::Relaxed);
                    counters.admitted.fetch_add(1, Ordering::Relaxed);
                    sent.push(cancel);
                }
                // The gate keeps the channel below its capacity, so only a
                // stopped engine gets here: the places not taken go back,
                // and the choices already sent never run.
                Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                    self.gauge.dropped(class, tokens);
                    for rest in jobs {
                        self.gauge.dropped(class, rest.queued_tokens());
                    }
                    for c in &sent {
                        c.cancel(CancelReason::Disconnect, 0);
                    }
                    return Err(Refused::EngineStopped);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
