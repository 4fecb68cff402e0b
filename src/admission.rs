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

use crate::engine::Job;
use crate::http::error::{ApiError, QueueBound};
use crate::metrics::Metrics;
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

/// What the typical request costs: `--typical-prompt-tokens`, `--typical-max-tokens`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Typical {
    pub prompt_tokens: usize,
    pub max_tokens: usize,
}

/// Request service rate: the box is compute-bound, so one typical request costs
/// its prefill time plus its share of decode time, and μ_req is the inverse.
pub fn mu_req(rates: Rates, typical: Typical) -> f64 {
    let seconds = typical.prompt_tokens as f64 / rates.prefill_tok_s
        + typical.max_tokens as f64 / rates.decode_tok_s;
    1.0 / seconds
}

/// `L_max = ceil(μ_req · W_max)` clamped to `1..=cap`, unless the operator set a
/// depth; and the queued-token budget `μ_prefill · W_max`.
pub fn derive_bounds(
    rates: Rates,
    typical: Typical,
    queue_wait: Duration,
    depth: Option<usize>,
    cap: usize,
) -> Bounds {
    assert!(
        rates.prefill_tok_s > 0.0 && rates.decode_tok_s > 0.0,
        "rates must be positive"
    );
    let mu = mu_req(rates, typical);
    let w = queue_wait.as_secs_f64();
    let little = (mu * w).ceil().max(1.0) as usize;
    Bounds {
        mu_req: mu,
        queue_depth_max: depth.unwrap_or(little).clamp(1, cap),
        queued_tokens_max: (rates.prefill_tok_s * w).floor().max(1.0) as usize,
    }
}

/// Seconds until the queued work ahead would be done: requests ÷ μ_req, or
/// tokens ÷ μ_prefill, whichever is longer; at least one second, rounded up.
pub fn retry_after_s(queued: usize, queued_tokens: usize, rates: Rates, bounds: Bounds) -> u64 {
    let by_count = queued as f64 / bounds.mu_req;
    let by_tokens = queued_tokens as f64 / rates.prefill_tok_s;
    (by_count.max(by_tokens).ceil() as u64).max(RETRY_AFTER_S_MIN)
}

/// What is in the system now.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Load {
    /// Admitted and not yet ended: running in a slot, or waiting for one.
    requests: usize,
    /// Of those, the ones in a slot.
    running: usize,
    /// Prompt tokens of the ones waiting.
    waiting_tokens: usize,
}

impl Load {
    fn waiting(&self) -> usize {
        self.requests - self.running
    }
}

/// The gate's view of the queue, shared with the engine, which reports when a
/// request gets its slot and when it leaves it. A request is refused when the
/// requests running plus waiting would exceed the slots (`--parallel`) plus
/// L_max, or when the prompt tokens waiting would exceed their budget.
pub struct QueueGauge {
    load: Mutex<Load>,
    slots: usize,
    pub rates: Rates,
    pub bounds: Bounds,
    /// Readable without the lock (for `/metrics`).
    waiting: AtomicUsize,
    waiting_tokens: AtomicUsize,
}

impl QueueGauge {
    fn new(slots: usize, rates: Rates, bounds: Bounds) -> QueueGauge {
        QueueGauge {
            load: Mutex::new(Load::default()),
            slots,
            rates,
            bounds,
            waiting: AtomicUsize::new(0),
            waiting_tokens: AtomicUsize::new(0),
        }
    }

    /// Reserves a place for a request of `prompt_tokens`, or says which bound it
    /// breaks (with what is waiting). A prompt larger than the whole token budget
    /// is admitted only when nothing waits: otherwise it could never be served.
    fn reserve(&self, prompt_tokens: usize) -> Result<(), (QueueBound, usize, usize)> {
        let mut l = self.load.lock().expect("queue gauge lock");
        if l.requests >= self.slots + self.bounds.queue_depth_max {
            return Err((QueueBound::Requests, l.waiting(), l.waiting_tokens));
        }
        // Free slots take the request at once: only the part that must wait counts.
        let would_wait = l.requests >= self.slots;
        if would_wait
            && l.waiting() > 0
            && l.waiting_tokens + prompt_tokens > self.bounds.queued_tokens_max
        {
            return Err((QueueBound::Tokens, l.waiting(), l.waiting_tokens));
        }
        l.requests += 1;
        l.waiting_tokens += prompt_tokens;
        self.publish(&l);
        Ok(())
    }

    /// A request left the queue for a slot.
    pub fn started(&self, prompt_tokens: usize) {
        let mut l = self.load.lock().expect("queue gauge lock");
        assert!(
            l.waiting() > 0 && l.waiting_tokens >= prompt_tokens,
            "start without reserve"
        );
        l.running += 1;
        l.waiting_tokens -= prompt_tokens;
        self.publish(&l);
    }

    /// A running request ended (completed, failed or cancelled) and freed its slot.
    pub fn finished(&self) {
        let mut l = self.load.lock().expect("queue gauge lock");
        assert!(l.running > 0, "finish without start");
        l.running -= 1;
        l.requests -= 1;
        self.publish(&l);
    }

    /// A reserved request left without a slot: it never reached the engine, or
    /// the engine refused it at dequeue (shed, deadline passed).
    pub fn dropped(&self, prompt_tokens: usize) {
        let mut l = self.load.lock().expect("queue gauge lock");
        l.requests -= 1;
        l.waiting_tokens -= prompt_tokens;
        self.publish(&l);
    }

    fn publish(&self, l: &Load) {
        self.waiting.store(l.waiting(), Ordering::Relaxed);
        self.waiting_tokens
            .store(l.waiting_tokens, Ordering::Relaxed);
    }

    /// Requests waiting for a slot.
    pub fn queued_requests(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    pub fn queued_tokens(&self) -> usize {
        self.waiting_tokens.load(Ordering::Relaxed)
    }
}

pub struct Admission {
    tx: Sender<Job>,
    gauge: Arc<QueueGauge>,
    metrics: Arc<Metrics>,
}

impl Admission {
    /// Creates the queue; the receiver and the gauge go to the engine. The gate
    /// never lets more than `slots + L_max` requests in, so the channel, sized
    /// for that, never refuses a request the gate admitted.
    pub fn new(
        slots: usize,
        rates: Rates,
        bounds: Bounds,
        metrics: Arc<Metrics>,
    ) -> (Admission, Receiver<Job>, Arc<QueueGauge>) {
        assert!(bounds.queue_depth_max >= 1 && slots >= 1);
        let (tx, rx) = bounded(slots + bounds.queue_depth_max);
        let gauge = Arc::new(QueueGauge::new(slots, rates, bounds));
        let admission = Admission {
            tx,
            gauge: Arc::clone(&gauge),
            metrics,
        };
        (admission, rx, gauge)
    }

    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        let tokens = job.prompt.len();
        if let Err((bound, waiting, waiting_tokens)) = self.gauge.reserve(tokens) {
            let counter = match bound {
                QueueBound::Requests => &self.metrics.rejected_queue_full,
                QueueBound::Tokens => &self.metrics.rejected_token_budget,
            };
            counter.fetch_add(1, Ordering::Relaxed);
            let g = &self.gauge;
            let wait = retry_after_s(waiting, waiting_tokens, g.rates, g.bounds);
            return Err(ApiError::QueueFull {
                bound,
                queued: waiting,
                queue_depth_max: g.bounds.queue_depth_max,
                queued_tokens: waiting_tokens,
                queued_tokens_max: g.bounds.queued_tokens_max,
                prompt_tokens: tokens,
                retry_after_s: wait,
            });
        }
        match self.tx.try_send(job) {
            Ok(()) => {
                self.metrics.accepted.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            // The gate keeps the channel below its capacity, so only a stopped
            // engine gets here.
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.gauge.dropped(tokens);
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

    #[test]
    fn mu_req_is_the_inverse_of_a_typical_request_time() {
        // 100 / 200 + 150 / 150 = 1.5 s per request.
        assert!((mu_req(RATES, TYPICAL) - 1.0 / 1.5).abs() < 1e-9);
    }

    #[test]
    fn queue_depth_follows_littles_law_and_is_clamped() {
        let b = derive_bounds(
            RATES,
            TYPICAL,
            Duration::from_secs(5),
            None,
            QUEUE_DEPTH_SAFE_MAX,
        );
        assert_eq!(b.queue_depth_max, 4, "ceil(0.667 * 5) = 4");
        assert_eq!(b.queued_tokens_max, 1000, "200 tok/s * 5 s");
        let b = derive_bounds(
            RATES,
            TYPICAL,
            Duration::from_millis(100),
            None,
            QUEUE_DEPTH_SAFE_MAX,
        );
        assert_eq!(b.queue_depth_max, 1, "never below one");
        let fast = Rates {
            prefill_tok_s: 5000.0,
            decode_tok_s: 3000.0,
        };
        let b = derive_bounds(
            fast,
            TYPICAL,
            Duration::from_secs(5),
            None,
            QUEUE_DEPTH_SAFE_MAX,
        );
        assert_eq!(b.queue_depth_max, 9, "clamped to the safe ceiling");
        let b = derive_bounds(fast, TYPICAL, Duration::from_secs(5), None, 1000);
        assert_eq!(
            b.queue_depth_max, 72,
            "ceil(14.29 * 5) with an unsafe ceiling"
        );
        let b = derive_bounds(
            RATES,
            TYPICAL,
            Duration::from_secs(5),
            Some(3),
            QUEUE_DEPTH_SAFE_MAX,
        );
        assert_eq!(b.queue_depth_max, 3, "the operator's depth wins");
        let b = derive_bounds(
            RATES,
            TYPICAL,
            Duration::from_secs(5),
            Some(50),
            QUEUE_DEPTH_SAFE_MAX,
        );
        assert_eq!(b.queue_depth_max, 9, "but not above the ceiling");
    }

    #[test]
    fn retry_after_covers_the_longer_of_count_and_token_work() {
        let b = derive_bounds(
            RATES,
            TYPICAL,
            Duration::from_secs(5),
            None,
            QUEUE_DEPTH_SAFE_MAX,
        );
        assert_eq!(retry_after_s(0, 0, RATES, b), 1, "at least one second");
        assert_eq!(retry_after_s(4, 0, RATES, b), 6, "4 requests at 0.667/s");
        assert_eq!(
            retry_after_s(1, 1000, RATES, b),
            5,
            "1000 tokens at 200 tok/s"
        );
    }

    fn gauge(slots: usize, depth: usize, tokens: usize) -> QueueGauge {
        let bounds = Bounds {
            mu_req: 1.0,
            queue_depth_max: depth,
            queued_tokens_max: tokens,
        };
        QueueGauge::new(slots, RATES, bounds)
    }

    #[test]
    fn free_slots_and_the_queue_are_both_capacity() {
        let g = gauge(2, 3, 1000);
        for _ in 0..5 {
            assert!(g.reserve(10).is_ok());
        }
        assert_eq!(
            g.reserve(10).unwrap_err().0,
            QueueBound::Requests,
            "2 slots + 3 queued"
        );
        g.started(10);
        g.started(10);
        assert_eq!(g.queued_requests(), 3);
        g.finished();
        assert!(g.reserve(10).is_ok(), "a finished request frees its place");
    }

    #[test]
    fn the_token_budget_counts_only_prompts_that_must_wait() {
        let g = gauge(1, 3, 1000);
        assert!(
            g.reserve(5000).is_ok(),
            "a free slot takes any prompt that fits the context"
        );
        g.started(5000);
        assert!(g.reserve(600).is_ok());
        assert_eq!(
            g.reserve(500).unwrap_err().0,
            QueueBound::Tokens,
            "600 + 500 > 1000"
        );
        assert!(g.reserve(400).is_ok(), "a short one still fits");
        assert_eq!(g.queued_tokens(), 1000);
        assert!(g.reserve(0).is_ok(), "a third may wait");
        assert_eq!(
            g.reserve(0).unwrap_err().0,
            QueueBound::Requests,
            "1 running + 3 waiting"
        );
    }

    #[test]
    fn a_prompt_over_the_whole_budget_waits_only_in_an_empty_queue() {
        let g = gauge(1, 3, 1000);
        assert!(g.reserve(10).is_ok());
        g.started(10);
        assert!(g.reserve(6000).is_ok(), "nothing waits: it may");
        assert_eq!(g.reserve(10).unwrap_err().0, QueueBound::Tokens);
        g.finished(); // the first request ends
        g.started(6000); // the long one gets the slot
        assert!(g.reserve(6000).is_ok(), "the queue is empty again");
    }
}
