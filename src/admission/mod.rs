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
//! One thread owns the gate (`gate::Gate`: what is queued and running, the
//! rates, the bounds, the promises made to refused clients); everyone else
//! talks to it in messages on one bounded channel, applied in the order they
//! arrive (`Msg`). Handlers ask it to judge a request (`Admission`): it
//! refuses with 429 + `Retry-After` when either bound would break, or puts
//! the request's jobs on their class's queue to the engine (`try_send`,
//! never blocking). Neither rule needs the request's own prompt, so the door
//! applies them before the body is read (`Admission::precheck`); the choices
//! of one request are judged together (`Admission::submit_all`). The engine
//! reports when a job gets a slot, leaves it (its `Slot` dropped) or leaves
//! its queue unrun (`QueueGauge`). A report sent before the engine answers a
//! client is applied before anything that client sends next, as it was when
//! the gate was a shared lock.
//!
//! The bounds are live: the engine refines the rates online from the steps it
//! runs (`engine::cost`) and sends them here, and the gate re-derives L_max
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
mod gate;
pub mod prefixes;

pub use bounds::*;
use gate::{Gate, Refusal};
use prefixes::PrefixIndex;

use crate::embed::EmbedSpec;
use crate::ffi::{SamplingParams, Token};
use crate::metrics::Metrics;
use crate::priority::Class;
use crate::stream::{CancelFlag, CancelReason, Event};
use crossbeam_channel::{bounded, Receiver, Sender, TrySendError};
use std::sync::atomic::Ordering;
use std::sync::Arc;
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
    /// the job (`Admission::reusable`): admission counted only the rest.
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
    /// When to come back (`gate::Gate::promise_at`), and that in whole seconds
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

/// Messages the admission thread may hold before a sender waits: every
/// handler's one request, every running and queued job's report.
const MESSAGES_MAX: usize = 1024;

/// What the admission thread hears, in the order it arrives: from handlers a
/// check at the door or a request's jobs; from the engine when a job gets a
/// slot, leaves it or leaves its queue unrun, and what it measured; from the
/// status page a question. A report the engine sends before it answers a
/// client is applied before anything that client sends next.
enum Msg {
    Check {
        class: Class,
        reply: Sender<Result<(), Refused>>,
    },
    Submit {
        jobs: Vec<Job>,
        reply: Sender<Result<(), Refused>>,
    },
    Started {
        class: Class,
        prompt_tokens: usize,
    },
    Finished {
        class: Class,
    },
    Dropped {
        class: Class,
        prompt_tokens: usize,
    },
    Rates(Rates),
    Completed {
        prompt_tokens: usize,
        generated_tokens: usize,
    },
    RetryAfter {
        class: Class,
        reply: Sender<u64>,
    },
    Snapshot {
        reply: Sender<GateView>,
    },
    /// The prefix cache's entries changed (engine).
    PrefixCached(Vec<Arc<[Token]>>),
    /// A running sequence's prompt is whole in its cells, or it ended (engine).
    PrefixRunning {
        slot: usize,
        prompt: Arc<[Token]>,
    },
    PrefixEnded {
        slot: usize,
    },
    /// How much of a prompt would be reused if it started now (handler).
    Reusable {
        prompt: Arc<[Token]>,
        reply: Sender<usize>,
    },
}

/// What the gate shows the status page and the engine.
#[derive(Debug, Clone, Copy)]
struct GateView {
    rates: Rates,
    bounds: [Bounds; Class::COUNT],
    typical: Typical,
}

/// Sends `make(reply)` to the admission thread and waits for its answer;
/// `None` if the thread is gone.
fn ask<T>(tx: &Sender<Msg>, make: impl FnOnce(Sender<T>) -> Msg) -> Option<T> {
    let (reply, answer) = bounded(1);
    tx.send(make(reply)).ok()?;
    answer.recv().ok()
}

/// The engine's and the status page's side of admission: reports sent to
/// the admission thread, and questions it answers. The queue's depth is read
/// from the metrics, where the admission thread publishes it.
pub struct QueueGauge {
    tx: Sender<Msg>,
    metrics: Arc<Metrics>,
    /// Answers while the admission thread is gone (it ends only with the
    /// process): the rates and bounds it started with.
    fallback: GateView,
}

impl QueueGauge {
    /// A request left its queue for a slot: it holds the slot as long as it
    /// holds the guard.
    pub fn started(&self, class: Class, prompt_tokens: usize) -> Slot {
        let _ = self.tx.send(Msg::Started {
            class,
            prompt_tokens,
        });
        Slot {
            tx: self.tx.clone(),
            class,
        }
    }

    /// A reserved request left without a slot: the engine refused it at
    /// dequeue (shed, deadline passed) or its client left while it waited.
    pub fn dropped(&self, class: Class, prompt_tokens: usize) {
        let _ = self.tx.send(Msg::Dropped {
            class,
            prompt_tokens,
        });
    }

    /// The engine measured new rates: the bounds follow them.
    pub fn set_rates(&self, rates: Rates) {
        let _ = self.tx.send(Msg::Rates(rates));
    }

    /// A request completed, having prefilled `prompt_tokens` and generated
    /// `generated_tokens`: μ_req, and so L_max, follow the work that arrives.
    pub fn observe_request(&self, prompt_tokens: usize, generated_tokens: usize) {
        let _ = self.tx.send(Msg::Completed {
            prompt_tokens,
            generated_tokens,
        });
    }

    /// The prefix cache's entries are now these.
    pub fn prefix_cached(&self, tokens: Vec<Arc<[Token]>>) {
        let _ = self.tx.send(Msg::PrefixCached(tokens));
    }

    /// The sequence in `slot` has its whole `prompt` in its cells (others may
    /// share them in place).
    pub fn prefix_running(&self, slot: usize, prompt: Arc<[Token]>) {
        let _ = self.tx.send(Msg::PrefixRunning { slot, prompt });
    }

    /// The sequence in `slot` no longer holds its prompt's cells.
    pub fn prefix_ended(&self, slot: usize) {
        let _ = self.tx.send(Msg::PrefixEnded { slot });
    }

    fn view(&self) -> GateView {
        ask(&self.tx, |reply| Msg::Snapshot { reply }).unwrap_or(self.fallback)
    }

    /// The typical request the bounds are derived from now.
    pub fn typical(&self) -> Typical {
        self.view().typical
    }

    /// The rates and each class's bounds in force now.
    pub fn snapshot(&self) -> (Rates, [Bounds; Class::COUNT]) {
        let v = self.view();
        (v.rates, v.bounds)
    }

    /// Seconds a client of `class` refused now should wait (for 503s sent by
    /// the engine).
    pub fn retry_after_s(&self, class: Class) -> u64 {
        ask(&self.tx, |reply| Msg::RetryAfter { class, reply }).unwrap_or(RETRY_AFTER_S_MIN)
    }

    /// Requests of `class` waiting for a slot.
    pub fn queued_requests(&self, class: Class) -> usize {
        self.metrics.queued_requests[class.index()].load(Ordering::Relaxed)
    }

    /// Prompt tokens of `class` waiting for a slot.
    pub fn queued_tokens(&self, class: Class) -> usize {
        self.metrics.queued_tokens[class.index()].load(Ordering::Relaxed)
    }
}

/// A running request's hold on its slot (`QueueGauge::started`): dropping it
/// (the sequence completed, failed or was cancelled) frees the slot in the
/// gate's count, so the count cannot miss an end.
pub struct Slot {
    tx: Sender<Msg>,
    class: Class,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let _ = self.tx.send(Msg::Finished { class: self.class });
    }
}

/// The handlers' side of admission.
pub struct Admission {
    tx: Sender<Msg>,
    thread: std::thread::JoinHandle<()>,
}

impl Admission {
    /// Starts the admission thread, which owns the gate, and creates one
    /// queue per class; the receivers and the `QueueGauge` go to the engine.
    /// The gate never lets more of a class wait than the slots plus its live
    /// L_max, and L_max never exceeds its ceiling, so each channel, sized
    /// for the ceiling, never refuses a request the gate admitted.
    pub fn new(
        slots: usize,
        batch_slots: usize,
        rates: Rates,
        policies: [Policy; Class::COUNT],
        metrics: Arc<Metrics>,
    ) -> Result<(Admission, Queues, Arc<QueueGauge>), String> {
        assert!(slots >= 1);
        let channels = policies.map(|p| {
            let ceiling = p.queue_depth_ceiling();
            assert!(ceiling >= 1);
            bounded(slots + ceiling)
        });
        let [(tx_i, rx_i), (tx_b, rx_b)] = channels;
        let gate = Gate::new(slots, batch_slots, rates, policies);
        let (rates, bounds) = gate.snapshot();
        let fallback = GateView {
            rates,
            bounds,
            typical: gate.typical(),
        };
        let (tx, rx) = bounded(MESSAGES_MAX);
        let owner = Owner {
            gate,
            prefixes: PrefixIndex::default(),
            jobs: [tx_i, tx_b],
            metrics: Arc::clone(&metrics),
        };
        let thread = std::thread::Builder::new()
            .name("sluice-admit".into())
            .spawn(move || owner.run(rx))
            .map_err(|e| format!("cannot start the admission thread: {e}"))?;
        let gauge = QueueGauge {
            tx: tx.clone(),
            metrics,
            fallback,
        };
        Ok((Admission { tx, thread }, [rx_i, rx_b], Arc::new(gauge)))
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
        ask(&self.tx, |reply| Msg::Check { class, reply }).unwrap_or(Err(Refused::EngineStopped))
    }

    pub fn submit(&self, job: Job) -> Result<(), Refused> {
        self.submit_all(vec![job])
    }

    /// Whether the admission thread still runs (it ends only with the
    /// process, or if it panicked: then every request would be refused).
    pub fn is_running(&self) -> bool {
        !self.thread.is_finished()
    }

    /// Prompt tokens of `prompt` the prefix cache (or a running sequence)
    /// would give it if it started now: an estimate (the engine decides at
    /// start), for the charge and the queued-token budget.
    pub fn reusable(&self, prompt: &[Token]) -> usize {
        let prompt: Arc<[Token]> = prompt.into();
        ask(&self.tx, |reply| Msg::Reusable { prompt, reply }).unwrap_or(0)
    }

    /// Submits the jobs of one request (its choices, all of one class): all
    /// of them are admitted or none is, judged together, so a refused
    /// request leaves nothing behind in the queue.
    pub fn submit_all(&self, jobs: Vec<Job>) -> Result<(), Refused> {
        if jobs.is_empty() {
            return Ok(());
        }
        ask(&self.tx, |reply| Msg::Submit { jobs, reply }).unwrap_or(Err(Refused::EngineStopped))
    }
}

/// The admission thread: the one owner of the gate.
struct Owner {
    gate: Gate,
    prefixes: PrefixIndex,
    jobs: [Sender<Job>; Class::COUNT],
    metrics: Arc<Metrics>,
}

impl Owner {
    fn run(mut self, rx: Receiver<Msg>) {
        for msg in rx {
            self.handle(msg);
        }
    }

    /// The queue's depth, for `/metrics` and the status page (before a
    /// reply, so that whoever was answered reads what it caused).
    fn publish(&self) {
        for c in Class::ALL {
            let i = c.index();
            let m = &self.metrics;
            m.queued_requests[i].store(self.gate.queued_requests(c), Ordering::Relaxed);
            m.queued_tokens[i].store(self.gate.queued_tokens(c), Ordering::Relaxed);
        }
    }

    fn handle(&mut self, msg: Msg) {
        // A reply's receiver may be gone (its handler panicked): no matter.
        match msg {
            Msg::Check { class, reply } => {
                let _ = reply.send(self.precheck(class));
            }
            Msg::Submit { jobs, reply } => {
                let r = self.submit_all(jobs);
                self.publish();
                let _ = reply.send(r);
            }
            Msg::Started {
                class,
                prompt_tokens,
            } => {
                self.gate.started(class, prompt_tokens);
                self.publish();
            }
            Msg::Finished { class } => self.gate.finished(class),
            Msg::Dropped {
                class,
                prompt_tokens,
            } => {
                self.gate.dropped(class, prompt_tokens);
                self.publish();
            }
            Msg::Rates(rates) => self.gate.set_rates(rates),
            Msg::Completed {
                prompt_tokens,
                generated_tokens,
            } => self.gate.observe_request(prompt_tokens, generated_tokens),
            Msg::RetryAfter { class, reply } => {
                let _ = reply.send(self.gate.retry_after_s(class));
            }
            Msg::PrefixCached(tokens) => self.prefixes.set_cached(tokens),
            Msg::PrefixRunning { slot, prompt } => self.prefixes.set_running(slot, prompt),
            Msg::PrefixEnded { slot } => self.prefixes.clear_running(slot),
            Msg::Reusable { prompt, reply } => {
                let _ = reply.send(self.prefixes.reusable(&prompt));
            }
            Msg::Snapshot { reply } => {
                let (rates, bounds) = self.gate.snapshot();
                let typical = self.gate.typical();
                let _ = reply.send(GateView {
                    rates,
                    bounds,
                    typical,
                });
            }
        }
    }

    /// `Admission::precheck`, judged.
    fn precheck(&mut self, class: Class) -> Result<(), Refused> {
        let r = match self.gate.check(class) {
            Ok(()) => return Ok(()),
            Err(r) => r,
        };
        self.metrics
            .rejected_before_parsing
            .fetch_add(1, Ordering::Relaxed);
        let typical = self.gate.typical();
        // Its own prompt is not known (it was not read): its return time is
        // a typical request's.
        Err(self.refused(class, r, typical.prompt_tokens, typical.max_tokens))
    }

    /// Counts a refusal of the gate and promises the client a return time.
    fn refused(&mut self, class: Class, r: Refusal, tokens: usize, max_tokens: usize) -> Refused {
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
        let wait = self.gate.promise_at(class, own_s, Instant::now());
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

    /// `Admission::submit_all`, judged; the admitted jobs go to their
    /// class's queue (`try_send`: the gate keeps it below its capacity).
    fn submit_all(&mut self, jobs: Vec<Job>) -> Result<(), Refused> {
        let class = jobs[0].class;
        debug_assert!(jobs.iter().all(|j| j.class == class));
        // Prompt tokens found in the prefix cache are not prefilled: they do
        // not count against the queued-token budget.
        let tokens: usize = jobs.iter().map(Job::queued_tokens).sum();
        let max_tokens: usize = jobs.iter().map(Job::max_tokens).sum();
        if let Err(r) = self.gate.reserve(class, jobs.len(), tokens) {
            return Err(self.refused(class, r, tokens, max_tokens));
        }
        let counters = self.metrics.class(class);
        let mut sent: Vec<CancelFlag> = Vec::with_capacity(jobs.len());
        let mut jobs = jobs.into_iter();
        for job in jobs.by_ref() {
            let tokens = job.queued_tokens();
            let cancel = job.cancel.clone();
            match self.jobs[class.index()].try_send(job) {
                Ok(()) => {
                    self.metrics.accepted.fetch_add(1, Ordering::Relaxed);
                    counters.admitted.fetch_add(1, Ordering::Relaxed);
                    sent.push(cancel);
                }
                // The gate keeps the channel below its capacity, so only a
                // stopped engine gets here: the places not taken go back,
                // and the choices already sent never run.
                Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                    self.gate.dropped(class, tokens);
                    for rest in jobs {
                        self.gate.dropped(class, rest.queued_tokens());
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
