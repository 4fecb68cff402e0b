//! Admission: the bounded queue between the HTTP handlers and the engine, and the
//! bounds that say no before a request can wait longer than its budget.
//!
//! The bounds are derived, not guessed (Little's law, L = μ · W): with μ_req the
//! request service rate measured on this machine and W_max the operator's
//! queueing budget for time to first token (`--queue-wait-ms`),
//! `L_max = ceil(μ_req · W_max)`, clamped to 1..=9. A second bound is in tokens,
//! because 16 short prompts and 16 8k prompts are not the same load: a request
//! that must wait is admitted only while the prompt tokens already waiting
//! ahead of it are within `μ_prefill · W_max` (their prefill is its queueing
//! delay; its own prompt is its service, and a long prompt behind a short
//! queue is served, not refused).
//!
//! Handlers only ever `try_send`. A gate in front of the channel counts what is
//! queued (requests and prompt tokens, until the engine gives the request a
//! slot) and refuses with 429 + `Retry-After` when either bound would break.
//! Neither rule needs the request's own prompt, so the door applies them
//! before the body is read (`Admission::precheck`); the choices of one
//! request are judged together (`Admission::submit_all`).
//!
//! The bounds are live: the engine refines the rates online from the steps it
//! runs (`engine::cost`) and publishes them here, and the gate re-derives L_max
//! and the token budget from them. A channel's capacity is fixed at creation,
//! so it is sized for the highest L_max the gate may ever allow (9, or the
//! operator's `--queue-depth`); the gate enforces the live one below it.
//!
//! Each priority class (`priority::Class`) has its own queue, gate and bounds,
//! derived from its own W_max (`--queue-wait-ms` for interactive,
//! `--batch-queue-wait-ms` for batch), so a flood of batch work fills only its
//! own queue and is refused there, while interactive requests are still
//! admitted. Which queue the engine serves first is `priority::Picker`'s rule.

mod bounds;

pub use bounds::*;

use crate::embed::EmbedSpec;
use crate::ffi::{SamplingParams, Token};
use crate::metrics::Metrics;
use crate::priority::Class;
use crate::stream::{CancelFlag, CancelReason, Event};
use crossbeam_channel::{bounded, Receiver, Sender, TrySendError};
use std::sync::atomic::{AtomicUsize, Ordering};
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
    /// Keep generating past end-of-generation tokens (until `max_tokens`).
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
    pub events: Sender<Event>,
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

/// What is in the system now, per class (`Class::index`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Load {
    /// In a slot.
    running: [usize; Class::COUNT],
    /// Admitted and waiting for a slot.
    waiting: [usize; Class::COUNT],
    /// Prompt tokens of the ones waiting.
    waiting_tokens: [usize; Class::COUNT],
}

impl Load {
    fn running_total(&self) -> usize {
        self.running.iter().sum()
    }

    /// Requests and prompt tokens that wait ahead of a new request of `class`:
    /// those of its own class and of every class above it.
    fn ahead_of(&self, class: Class) -> (usize, usize) {
        let n = class.index() + 1;
        (
            self.waiting[..n].iter().sum(),
            self.waiting_tokens[..n].iter().sum(),
        )
    }
}

/// The gate's view of the queues, shared with the engine, which reports when a
/// request gets its slot and when it leaves it, and publishes the rates it
/// measures. A request of a class is refused when its class's waiting requests
/// would exceed the slots it could take now plus its L_max, or when it must
/// wait and its class's waiting prompt tokens already exceed their budget.
///
/// The slots a class could take now: for `interactive`, the free ones; for
/// `batch`, the free ones that interactive requests waiting do not take, and no
/// more than batch may hold (`--parallel` minus `--interactive-slots`).
pub struct QueueGauge {
    state: Mutex<State>,
    slots: usize,
    batch_slots: usize,
    policies: [Policy; Class::COUNT],
    /// Readable without the lock (for `/metrics`).
    waiting: [AtomicUsize; Class::COUNT],
    waiting_tokens: [AtomicUsize; Class::COUNT],
}

struct State {
    load: Load,
    rates: Rates,
    mix: Mix,
    bounds: [Bounds; Class::COUNT],
    /// The return time last handed to a refused request of each class.
    promised: [Option<Instant>; Class::COUNT],
}

impl State {
    /// The bounds of each class from the rates and the mix in force.
    fn derive(&mut self, policies: &[Policy; Class::COUNT]) {
        let typical = self.mix.typical();
        self.bounds = policies.map(|p| derive_bounds(self.rates, &Policy { typical, ..p }));
    }
}

impl QueueGauge {
    fn new(
        slots: usize,
        batch_slots: usize,
        rates: Rates,
        policies: [Policy; Class::COUNT],
    ) -> QueueGauge {
        assert!(batch_slots >= 1 && batch_slots <= slots);
        QueueGauge {
            state: Mutex::new(State {
                load: Load::default(),
                rates,
                mix: Mix::new(policies[Class::Interactive.index()].typical),
                bounds: policies.map(|p| derive_bounds(rates, &p)),
                promised: [None; Class::COUNT],
            }),
            slots,
            batch_slots,
            policies,
            waiting: Default::default(),
            waiting_tokens: Default::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("queue gauge lock")
    }

    /// When a refused request should come back, as a wait from now.
    ///
    /// Refused requests are given places in a virtual queue served at the
    /// rate capacity frees: each one reserves its own service time
    /// (`own_s`: its prompt at the prefill rate, its `max_tokens` at the
    /// decode rate of the full batch) after the one refused before it, and
    /// the first after a quiet spell comes back when, on average, the
    /// running requests are half done (`slots × own_s / 2`). So a burst's
    /// refused clients return one by one as room opens, not all together
    /// (capacity idle in between) nor all at once (refused again). The
    /// reservations end `PROMISE_HORIZON_S` ahead: clients that never come
    /// back cannot push the others' waits out for good.
    pub fn promise(&self, class: Class, own_s: f64) -> Duration {
        self.promise_at(class, own_s, Instant::now())
    }

    fn promise_at(&self, class: Class, own_s: f64, now: Instant) -> Duration {
        let slots = match class {
            Class::Interactive => self.slots,
            Class::Batch => self.batch_slots,
        } as f64;
        let own = Duration::from_secs_f64(own_s.clamp(0.001, PROMISE_HORIZON_S));
        let first = now + own.mul_f64(slots / 2.0);
        let mut st = self.lock();
        let slot = &mut st.promised[class.index()];
        let t = match *slot {
            Some(p) if p + own > first => p + own,
            _ => first,
        }
        .min(now + Duration::from_secs_f64(PROMISE_HORIZON_S));
        *slot = Some(t);
        t - now
    }

    /// Slots a new request of `class` could take at once.
    fn free_for(&self, l: &Load, class: Class) -> usize {
        let free = self.slots.saturating_sub(l.running_total());
        match class {
            Class::Interactive => free,
            Class::Batch => free
                .saturating_sub(l.waiting[Class::Interactive.index()])
                .min(
                    self.batch_slots
                        .saturating_sub(l.running[Class::Batch.index()]),
                ),
        }
    }

    /// Reserves places for `n` requests of `class` (the choices of one
    /// request: all of them or none) holding `prompt_tokens` together, or says
    /// which bound they break (with what is waiting ahead of them, and the
    /// bounds and rates they were judged by).
    fn reserve(&self, class: Class, n: usize, prompt_tokens: usize) -> Result<(), Refusal> {
        let mut s = self.lock();
        Self::judge(&s, self.free_for(&s.load, class), class, n)?;
        let c = class.index();
        s.load.waiting[c] += n;
        s.load.waiting_tokens[c] += prompt_tokens;
        self.publish(&s.load);
        Ok(())
    }

    /// Whether a request of `class` would be admitted now, without reserving
    /// its place. Its prompt does not matter (`judge`): the door's answer,
    /// before the body is read, is the gate's.
    fn check(&self, class: Class) -> Result<(), Refusal> {
        let s = self.lock();
        Self::judge(&s, self.free_for(&s.load, class), class, 1)
    }

    /// The gate's rule (`reserve`) for `n` requests, given the slots the class
    /// could take now.
    ///
    /// The token budget bounds the prompt tokens *ahead* of a request that
    /// must wait: their prefill is its queueing delay, W_max of it at most.
    /// Its own prompt is its service, not its wait, so a long prompt behind a
    /// short queue is admitted (below capacity it is served, and refusing it
    /// only sends it back later), while one behind more than W_max of prompts
    /// is refused, whatever its own size. So the rule needs no prompt: the
    /// door applies it exactly, before the body is read.
    fn judge(s: &State, free: usize, class: Class, n: usize) -> Result<(), Refusal> {
        let l = s.load;
        let c = class.index();
        let bounds = s.bounds[c];
        let (ahead, ahead_tokens) = l.ahead_of(class);
        let refuse = |bound| Refusal {
            bound,
            waiting: ahead,
            waiting_tokens: ahead_tokens,
            rates: s.rates,
            bounds,
        };
        if l.waiting[c] + n > free + bounds.queue_depth_max {
            return Err(refuse(QueueBound::Requests));
        }
        // Free slots take requests at once: only one that must wait is judged
        // by what waits ahead of it.
        let would_wait = l.waiting[c] + n > free;
        if would_wait && l.waiting_tokens[c] > bounds.queued_tokens_max {
            return Err(refuse(QueueBound::Tokens));
        }
        Ok(())
    }

    /// A request left its queue for a slot: it holds the slot as long as it
    /// holds the guard.
    pub fn started(self: &Arc<Self>, class: Class, prompt_tokens: usize) -> Slot {
        let mut s = self.lock();
        let c = class.index();
        let l = &mut s.load;
        assert!(
            l.waiting[c] > 0 && l.waiting_tokens[c] >= prompt_tokens,
            "start without reserve"
        );
        l.running[c] += 1;
        l.waiting[c] -= 1;
        l.waiting_tokens[c] -= prompt_tokens;
        self.publish(&s.load);
        Slot {
            gauge: Arc::clone(self),
            class,
        }
    }

    /// A running request ended (completed, failed or cancelled) and freed its
    /// slot: its `Slot` was dropped.
    fn finished(&self, class: Class) {
        let mut s = self.lock();
        let l = &mut s.load;
        assert!(l.running[class.index()] > 0, "finish without start");
        l.running[class.index()] -= 1;
        self.publish(&s.load);
    }

    /// A reserved request left without a slot: it never reached the engine, or
    /// the engine refused it at dequeue (shed, deadline passed).
    pub fn dropped(&self, class: Class, prompt_tokens: usize) {
        let mut s = self.lock();
        let c = class.index();
        let l = &mut s.load;
        assert!(l.waiting[c] > 0, "drop without reserve");
        l.waiting[c] -= 1;
        l.waiting_tokens[c] -= prompt_tokens;
        self.publish(&s.load);
    }

    /// The engine measured new rates: the bounds follow them.
    pub fn set_rates(&self, rates: Rates) {
        let mut s = self.lock();
        s.rates = rates;
        s.derive(&self.policies);
    }

    /// A request completed, having prefilled `prompt_tokens` and generated
    /// `generated_tokens`: μ_req, and so L_max, follow the work that arrives.
    pub fn observe_request(&self, prompt_tokens: usize, generated_tokens: usize) {
        let mut s = self.lock();
        s.mix.observe(prompt_tokens, generated_tokens);
        s.derive(&self.policies);
    }

    /// The typical request the bounds are derived from now.
    pub fn typical(&self) -> Typical {
        self.lock().mix.typical()
    }

    /// The rates and each class's bounds in force now.
    pub fn snapshot(&self) -> (Rates, [Bounds; Class::COUNT]) {
        let s = self.lock();
        (s.rates, s.bounds)
    }

    /// Seconds a client of `class` refused now should wait (for 503s sent by
    /// the engine).
    pub fn retry_after_s(&self, class: Class) -> u64 {
        let s = self.lock();
        let (ahead, tokens) = s.load.ahead_of(class);
        retry_after_s(ahead, tokens, s.rates, s.bounds[class.index()])
    }

    fn publish(&self, l: &Load) {
        for c in 0..Class::COUNT {
            self.waiting[c].store(l.waiting[c], Ordering::Relaxed);
            self.waiting_tokens[c].store(l.waiting_tokens[c], Ordering::Relaxed);
        }
    }

    /// Requests of `class` waiting for a slot.
    pub fn queued_requests(&self, class: Class) -> usize {
        self.waiting[class.index()].load(Ordering::Relaxed)
    }

    pub fn queued_tokens(&self, class: Class) -> usize {
        self.waiting_tokens[class.index()].load(Ordering::Relaxed)
    }
}

/// A running request's hold on its slot (`QueueGauge::started`): dropping it
/// (the sequence completed, failed or was cancelled) frees the slot in the
/// gate's count, so the count cannot miss an end.
pub struct Slot {
    gauge: Arc<QueueGauge>,
    class: Class,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.gauge.finished(self.class);
    }
}

/// Why the gate said no, and what it saw.
#[derive(Debug, Clone, Copy)]
struct Refusal {
    bound: QueueBound,
    waiting: usize,
    waiting_tokens: usize,
    rates: Rates,
    bounds: Bounds,
}

/// Each class's queue, for the engine: receivers indexed by `Class::index`.
pub type Queues = [Receiver<Job>; Class::COUNT];

pub struct Admission {
    tx: [Sender<Job>; Class::COUNT],
    gauge: Arc<QueueGauge>,
    metrics: Arc<Metrics>,
}

impl Admission {
    /// Creates one queue per class; the receivers and the gauge go to the
    /// engine. The gate never lets more of a class wait than the slots plus its
    /// live L_max, and L_max never exceeds its ceiling, so each channel, sized
    /// for the ceiling, never refuses a request the gate admitted.
    pub fn new(
        slots: usize,
        batch_slots: usize,
        rates: Rates,
        policies: [Policy; Class::COUNT],
        metrics: Arc<Metrics>,
    ) -> (Admission, Queues, Arc<QueueGauge>) {
        assert!(slots >= 1);
        let channels = policies.map(|p| {
            let ceiling = p.queue_depth_ceiling();
            assert!(ceiling >= 1);
            bounded(slots + ceiling)
        });
        let [(tx_i, rx_i), (tx_b, rx_b)] = channels;
        let gauge = Arc::new(QueueGauge::new(slots, batch_slots, rates, policies));
        let admission = Admission {
            tx: [tx_i, tx_b],
            gauge: Arc::clone(&gauge),
            metrics,
        };
        (admission, [rx_i, rx_b], gauge)
    }

    /// The door's check, before a request's body is read: refuses it when
    /// the queue's state says a request of `class` would break a bound (the
    /// count, or the prompt tokens ahead of it), as `submit` would after
    /// parsing and tokenizing it: neither rule depends on its prompt.
    /// Reserves nothing: a request that passes is judged again by `submit`
    /// (the queue may have moved, and a request of `n` choices needs `n`
    /// places). The refused client is promised a return time for the
    /// typical request.
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
