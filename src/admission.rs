//! Admission: the bounded queue between the HTTP handlers and the engine, and the
//! bounds that say no before a request can wait longer than its budget.
//!
//! The bounds are derived, not guessed (Little's law, L = μ · W): with μ_req the
//! request service rate measured on this machine and W_max the operator's
//! queueing budget for time to first token (`--queue-wait-ms`),
//! `L_max = ceil(μ_req · W_max)`, clamped to 1..=9. A second bound is in tokens,
//! because 16 short prompts and 16 8k prompts are not the same load: the prompt
//! tokens waiting may not exceed `μ_prefill · W_max`.
//!
//! Handlers only ever `try_send`. A gate in front of the channel counts what is
//! queued (requests and prompt tokens, until the engine gives the request a
//! slot) and refuses with 429 + `Retry-After` when either bound would break.
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

use crate::engine::Job;
use crate::http::error::{ApiError, QueueBound};
use crate::metrics::Metrics;
use crate::priority::Class;
use crossbeam_channel::{bounded, Receiver, Sender, TrySendError};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The design's ceiling on a derived queue: deeper queues only turn refusals
/// into waits past any useful budget on a CPU box.
pub const QUEUE_DEPTH_SAFE_MAX: usize = 9;
/// Shortest wait a refused client is told to observe.
const RETRY_AFTER_S_MIN: u64 = 1;

/// Service rates of this machine (measured at start-up, or given with `--mu-*`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rates {
    pub prefill_tok_s: f64,
    /// Aggregate decode rate with `--parallel` sequences running.
    pub decode_tok_s: f64,
}

/// The admission bounds derived from the rates and the budget.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bounds {
    /// Requests per second this box serves for the typical request.
    pub mu_req: f64,
    /// Most requests waiting for a slot.
    pub queue_depth_max: usize,
    /// Most prompt tokens waiting for a slot.
    pub queued_tokens_max: usize,
}

/// What the typical request costs: prompt tokens prefilled and tokens
/// generated. Seeded by `--typical-prompt-tokens` and `--typical-max-tokens`,
/// then learned from the requests that complete ([`Mix`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Typical {
    pub prompt_tokens: usize,
    pub max_tokens: usize,
}

/// Weight of one completed request in the learned mix: about the last 1/w
/// requests count.
const MIX_WEIGHT: f64 = 1.0 / 16.0;

/// The request mix as it arrives: running means of the prompt tokens each
/// completed request had prefilled (what the prefix cache did not hold) and of
/// the tokens it generated, starting from the configured typical request.
/// Pure.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mix {
    prompt_tokens: f64,
    generated_tokens: f64,
}

impl Mix {
    pub fn new(seed: Typical) -> Mix {
        Mix {
            prompt_tokens: seed.prompt_tokens as f64,
            generated_tokens: seed.max_tokens as f64,
        }
    }

    pub fn observe(&mut self, prompt_tokens: usize, generated_tokens: usize) {
        self.prompt_tokens += MIX_WEIGHT * (prompt_tokens as f64 - self.prompt_tokens);
        self.generated_tokens += MIX_WEIGHT * (generated_tokens as f64 - self.generated_tokens);
    }

    pub fn typical(&self) -> Typical {
        Typical {
            prompt_tokens: self.prompt_tokens.round() as usize,
            // At least one token: a request that generates nothing still costs a step.
            max_tokens: (self.generated_tokens.round() as usize).max(1),
        }
    }
}

/// Request service rate: the box is compute-bound, so one typical request costs
/// its prefill time plus its share of decode time, and μ_req is the inverse.
pub fn mu_req(rates: Rates, typical: Typical) -> f64 {
    let seconds = typical.prompt_tokens as f64 / rates.prefill_tok_s
        + typical.max_tokens as f64 / rates.decode_tok_s;
    1.0 / seconds
}

/// How the bounds are derived from the rates: the budget, the typical request,
/// and what the operator fixed by hand.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Policy {
    pub typical: Typical,
    /// W_max (`--queue-wait-ms`).
    pub queue_wait: Duration,
    /// `--queue-depth`: a fixed L_max instead of the derived one (already checked
    /// against 9, or against the unsafe ceiling with `--queue-depth-unsafe`).
    pub queue_depth: Option<usize>,
    /// `--queued-tokens-max`: a fixed token budget instead of `μ_prefill · W_max`.
    pub queued_tokens_max: Option<usize>,
}

impl Policy {
    /// The highest L_max the gate may ever allow: the channel's capacity beyond
    /// the slots, and the number of handlers that may wait on it.
    pub fn queue_depth_ceiling(&self) -> usize {
        self.queue_depth.unwrap_or(QUEUE_DEPTH_SAFE_MAX)
    }
}

/// `L_max = ceil(μ_req · W_max)` clamped to `1..=9`, unless the operator set a
/// depth; and the queued-token budget `μ_prefill · W_max`, unless the operator
/// set one.
pub fn derive_bounds(rates: Rates, policy: &Policy) -> Bounds {
    assert!(
        rates.prefill_tok_s > 0.0 && rates.decode_tok_s > 0.0,
        "rates must be positive"
    );
    let mu = mu_req(rates, policy.typical);
    let w = policy.queue_wait.as_secs_f64();
    let little = (mu * w).ceil().clamp(1.0, QUEUE_DEPTH_SAFE_MAX as f64) as usize;
    let tokens = (rates.prefill_tok_s * w).floor().max(1.0) as usize;
    Bounds {
        mu_req: mu,
        queue_depth_max: policy.queue_depth.unwrap_or(little),
        queued_tokens_max: policy.queued_tokens_max.unwrap_or(tokens),
    }
}

/// Seconds until the queued work ahead would be done: requests ÷ μ_req, or
/// tokens ÷ μ_prefill, whichever is longer; at least one second, rounded up.
pub fn retry_after_s(queued: usize, queued_tokens: usize, rates: Rates, bounds: Bounds) -> u64 {
    let by_count = queued as f64 / bounds.mu_req;
    let by_tokens = queued_tokens as f64 / rates.prefill_tok_s;
    (by_count.max(by_tokens).ceil() as u64).max(RETRY_AFTER_S_MIN)
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
/// would exceed the slots it could take now plus its L_max, or when its class's
/// waiting prompt tokens would exceed their budget.
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

    /// Reserves a place for a request of `class` and `prompt_tokens`, or says
    /// which bound it breaks (with what is waiting ahead of it, and the bounds
    /// and rates it was judged by). A prompt larger than the whole token budget
    /// is admitted only when nothing of its class waits: otherwise it could
    /// never be served.
    fn reserve(&self, class: Class, prompt_tokens: usize) -> Result<(), Refusal> {
        let mut s = self.lock();
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
        let free = self.free_for(&l, class);
        if l.waiting[c] >= free + bounds.queue_depth_max {
            return Err(refuse(QueueBound::Requests));
        }
        // Free slots take the request at once: only the part that must wait counts.
        let would_wait = l.waiting[c] >= free;
        if would_wait
            && l.waiting[c] > 0
            && l.waiting_tokens[c] + prompt_tokens > bounds.queued_tokens_max
        {
            return Err(refuse(QueueBound::Tokens));
        }
        s.load.waiting[c] += 1;
        s.load.waiting_tokens[c] += prompt_tokens;
        self.publish(&s.load);
        Ok(())
    }

    /// A request left its queue for a slot.
    pub fn started(&self, class: Class, prompt_tokens: usize) {
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
    }

    /// A running request ended (completed, failed or cancelled) and freed its slot.
    pub fn finished(&self, class: Class) {
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

    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        // Prompt tokens found in the prefix cache are not prefilled: they do
        // not count against the queued-token budget.
        let tokens = job.queued_tokens();
        let class = job.class;
        let counters = self.metrics.class(class);
        if let Err(r) = self.gauge.reserve(class, tokens) {
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
            let wait = retry_after_s(r.waiting, r.waiting_tokens, r.rates, r.bounds);
            return Err(ApiError::QueueFull {
                bound: r.bound,
                class,
                queued: r.waiting,
                queue_depth_max: r.bounds.queue_depth_max,
                queued_tokens: r.waiting_tokens,
                queued_tokens_max: r.bounds.queued_tokens_max,
                prompt_tokens: tokens,
                retry_after_s: wait,
            });
        }
        match self.tx[class.index()].try_send(job) {
            Ok(()) => {
                self.metrics.accepted.fetch_add(1, Ordering::Relaxed);
                counters.admitted.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            // The gate keeps the channel below its capacity, so only a stopped
            // engine gets here.
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.gauge.dropped(class, tokens);
                Err(ApiError::Engine {
                    message: "the engine is not taking requests".into(),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RATES: Rates = Rates {
        prefill_tok_s: 200.0,
        decode_tok_s: 150.0,
    };
    const TYPICAL: Typical = Typical {
        prompt_tokens: 100,
        max_tokens: 150,
    };

    fn policy(wait_ms: u64, depth: Option<usize>) -> Policy {
        Policy {
            typical: TYPICAL,
            queue_wait: Duration::from_millis(wait_ms),
            queue_depth: depth,
            queued_tokens_max: None,
        }
    }

    #[test]
    fn mu_req_is_the_inverse_of_a_typical_request_time() {
        // 100 / 200 + 150 / 150 = 1.5 s per request.
        assert!((mu_req(RATES, TYPICAL) - 1.0 / 1.5).abs() < 1e-9);
    }

    #[test]
    fn queue_depth_follows_littles_law_and_is_clamped() {
        let b = derive_bounds(RATES, &policy(5000, None));
        assert_eq!(b.queue_depth_max, 4, "ceil(0.667 * 5) = 4");
        assert_eq!(b.queued_tokens_max, 1000, "200 tok/s * 5 s");
        let b = derive_bounds(RATES, &policy(100, None));
        assert_eq!(b.queue_depth_max, 1, "never below one");
        let fast = Rates {
            prefill_tok_s: 5000.0,
            decode_tok_s: 3000.0,
        };
        let b = derive_bounds(fast, &policy(5000, None));
        assert_eq!(
            b.queue_depth_max, 9,
            "ceil(14.29 * 5) clamped to the safe ceiling"
        );
        let b = derive_bounds(RATES, &policy(5000, Some(3)));
        assert_eq!(b.queue_depth_max, 3, "the operator's depth wins");
        let b = derive_bounds(fast, &policy(5000, Some(50)));
        assert_eq!(
            b.queue_depth_max, 50,
            "config checked it against the unsafe ceiling"
        );
        let p = Policy {
            queued_tokens_max: Some(123),
            ..policy(5000, None)
        };
        assert_eq!(derive_bounds(RATES, &p).queued_tokens_max, 123);
    }

    #[test]
    fn the_channel_is_sized_for_the_highest_bound_the_gate_may_allow() {
        assert_eq!(policy(5000, None).queue_depth_ceiling(), 9);
        assert_eq!(policy(5000, Some(3)).queue_depth_ceiling(), 3);
        assert_eq!(policy(5000, Some(1000)).queue_depth_ceiling(), 1000);
    }

    #[test]
    fn retry_after_covers_the_longer_of_count_and_token_work() {
        let b = derive_bounds(RATES, &policy(5000, None));
        assert_eq!(retry_after_s(0, 0, RATES, b), 1, "at least one second");
        assert_eq!(retry_after_s(4, 0, RATES, b), 6, "4 requests at 0.667/s");
        assert_eq!(
            retry_after_s(1, 1000, RATES, b),
            5,
            "1000 tokens at 200 tok/s"
        );
    }

    fn gauge(slots: usize, depth: usize, tokens: usize) -> QueueGauge {
        let p = Policy {
            queued_tokens_max: Some(tokens),
            ..policy(5000, Some(depth))
        };
        QueueGauge::new(slots, slots, RATES, [p, p])
    }

    const I: Class = Class::Interactive;
    const B: Class = Class::Batch;

    #[test]
    fn free_slots_and_the_queue_are_both_capacity() {
        let g = gauge(2, 3, 1000);
        for _ in 0..5 {
            assert!(g.reserve(I, 10).is_ok());
        }
        assert_eq!(
            g.reserve(I, 10).unwrap_err().bound,
            QueueBound::Requests,
            "2 slots + 3 queued"
        );
        g.started(I, 10);
        g.started(I, 10);
        assert_eq!(g.queued_requests(I), 3);
        g.finished(I);
        assert!(
            g.reserve(I, 10).is_ok(),
            "a finished request frees its place"
        );
    }

    #[test]
    fn the_token_budget_counts_only_prompts_that_must_wait() {
        let g = gauge(1, 3, 1000);
        assert!(
            g.reserve(I, 5000).is_ok(),
            "a free slot takes any prompt that fits the context"
        );
        g.started(I, 5000);
        assert!(g.reserve(I, 600).is_ok());
        assert_eq!(
            g.reserve(I, 500).unwrap_err().bound,
            QueueBound::Tokens,
            "600 + 500 > 1000"
        );
        assert!(g.reserve(I, 400).is_ok(), "a short one still fits");
        assert_eq!(g.queued_tokens(I), 1000);
        assert!(g.reserve(I, 0).is_ok(), "a third may wait");
        assert_eq!(
            g.reserve(I, 0).unwrap_err().bound,
            QueueBound::Requests,
            "1 running + 3 waiting"
        );
    }

    #[test]
    fn a_prompt_over_the_whole_budget_waits_only_in_an_empty_queue() {
        let g = gauge(1, 3, 1000);
        assert!(g.reserve(I, 10).is_ok());
        g.started(I, 10);
        assert!(g.reserve(I, 6000).is_ok(), "nothing waits: it may");
        assert_eq!(g.reserve(I, 10).unwrap_err().bound, QueueBound::Tokens);
        g.finished(I); // the first request ends
        g.started(I, 6000); // the long one gets the slot
        assert!(g.reserve(I, 6000).is_ok(), "the queue is empty again");
    }

    #[test]
    fn the_live_bound_follows_the_measured_rates() {
        // Derived bounds: 1 slot, L_max = ceil(0.667 * 5) = 4.
        let g = QueueGauge::new(1, 1, RATES, [policy(5000, None); 2]);
        assert_eq!(g.snapshot().1[0].queue_depth_max, 4);
        for _ in 0..5 {
            assert!(g.reserve(I, 10).is_ok());
        }
        // The box got four times slower: L_max = ceil(0.167 * 5) = 1.
        g.set_rates(Rates {
            prefill_tok_s: 50.0,
            decode_tok_s: 37.5,
        });
        let b = g.snapshot().1[0];
        assert_eq!(b.queue_depth_max, 1);
        assert_eq!(b.queued_tokens_max, 250);
        let r = g.reserve(I, 10).unwrap_err();
        assert_eq!(r.bound, QueueBound::Requests, "5 in, 1 + 1 allowed");
        assert_eq!(r.bounds.queue_depth_max, 1, "judged by the live bound");
        // And faster than ever: clamped to 9, never above the channel's ceiling.
        g.set_rates(Rates {
            prefill_tok_s: 5000.0,
            decode_tok_s: 3000.0,
        });
        assert_eq!(g.snapshot().1[0].queue_depth_max, 9);
        for _ in 0..5 {
            assert!(g.reserve(I, 10).is_ok());
        }
        assert_eq!(
            g.reserve(I, 10).unwrap_err().bound,
            QueueBound::Requests,
            "1 + 9"
        );
    }

    #[test]
    fn the_bound_follows_the_mix_of_requests_that_complete() {
        // Seeded with 100 + 150 tokens: 1.5 s per request, L_max = ceil(0.667 * 5) = 4.
        let g = QueueGauge::new(1, 1, RATES, [policy(5000, None); 2]);
        assert_eq!(g.snapshot().1[0].queue_depth_max, 4);
        // Requests of 40 prefilled + 30 generated tokens: 0.4 s each, L_max 13 -> 9.
        for _ in 0..200 {
            g.observe_request(40, 30);
        }
        assert_eq!(
            g.typical(),
            Typical {
                prompt_tokens: 40,
                max_tokens: 30
            }
        );
        assert_eq!(g.snapshot().1[0].queue_depth_max, 9);
        // Then long answers: 0 + 600 tokens, 4 s each: L_max 2.
        for _ in 0..200 {
            g.observe_request(0, 600);
        }
        assert_eq!(g.snapshot().1[0].queue_depth_max, 2);
        // The operator's depth is never overridden.
        let g = QueueGauge::new(1, 1, RATES, [policy(5000, Some(3)); 2]);
        g.observe_request(1, 1);
        assert_eq!(g.snapshot().1[0].queue_depth_max, 3);
    }

    #[test]
    fn one_request_moves_the_mix_by_a_sixteenth() {
        let mut m = Mix::new(Typical {
            prompt_tokens: 160,
            max_tokens: 160,
        });
        m.observe(0, 0);
        assert_eq!(
            m.typical(),
            Typical {
                prompt_tokens: 150,
                max_tokens: 150
            }
        );
    }

    #[test]
    fn each_class_has_its_own_queue_and_batch_leaves_the_reserved_slots_free() {
        // 3 slots, batch may hold 2 of them; L_max 2 for each class.
        let p = policy(5000, Some(2));
        let g = QueueGauge::new(3, 2, RATES, [p, p]);
        for _ in 0..4 {
            assert!(g.reserve(B, 10).is_ok(), "2 batch slots + 2 waiting");
        }
        assert_eq!(g.reserve(B, 10).unwrap_err().bound, QueueBound::Requests);
        g.started(B, 10);
        g.started(B, 10);
        assert_eq!(
            g.reserve(B, 10).unwrap_err().bound,
            QueueBound::Requests,
            "the third slot is not batch's"
        );
        for _ in 0..3 {
            assert!(g.reserve(I, 10).is_ok(), "1 free slot + 2 waiting");
        }
        let r = g.reserve(I, 10).unwrap_err();
        assert_eq!(r.bound, QueueBound::Requests);
        assert_eq!(r.waiting, 3, "batch waiting is not ahead of interactive");
        assert_eq!(g.queued_requests(I), 3);
        assert_eq!(g.queued_requests(B), 2);
        assert_eq!(g.retry_after_s(B), 8, "5 ahead of batch at 0.667/s");
    }

    #[test]
    fn interactive_requests_waiting_take_the_free_slots_before_batch() {
        let p = policy(5000, Some(1));
        let g = QueueGauge::new(2, 2, RATES, [p, p]);
        assert!(g.reserve(I, 10).is_ok());
        assert!(g.reserve(I, 10).is_ok());
        assert!(
            g.reserve(B, 10).is_ok(),
            "no free slot left for it: it waits"
        );
        assert_eq!(
            g.reserve(B, 10).unwrap_err().bound,
            QueueBound::Requests,
            "L_max 1 for batch"
        );
        g.dropped(B, 10);
        g.started(I, 10);
        g.finished(I);
        g.started(I, 10);
        g.finished(I);
        assert!(g.reserve(B, 10).is_ok());
        assert!(g.reserve(B, 10).is_ok());
        assert!(g.reserve(B, 10).is_ok(), "2 free slots + 1 waiting");
    }
}
