//! Counters, gauges and latency distributions, exported as Prometheus text.
//!
//! Latencies are Prometheus histograms (`_bucket`, `_sum`, `_count`) over
//! fixed buckets chosen for this workload (`Buckets`): counted with atomics
//! by the engine thread, read by `/metrics` and `/status` without a lock, and
//! summable across replicas and time windows (`histogram_quantile`). The cost
//! model's forecast error, a ratio, stays a summary over an
//! `hdrhistogram::Histogram` behind a mutex.

use crate::priority::Class;
use crate::stream::CancelReason;
use hdrhistogram::Histogram;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

mod histogram;
mod render;
mod snapshot;
pub use histogram::*;

/// What happened to the requests of one priority class.
pub struct ClassCounters {
    /// Admitted to the class's queue.
    pub admitted: AtomicU64,
    /// Refused by the gate: the class's queue was full.
    pub rejected_queue_full: AtomicU64,
    /// Refused by the gate: the class's queued-token budget.
    pub rejected_token_budget: AtomicU64,
    /// Refused because the first token's forecast was past a gateway's TTFT
    /// objective.
    pub rejected_slo_ttft: AtomicU64,
    /// Refused because the client's token bucket was short (before the gate).
    pub rate_limited: AtomicU64,
    /// Shed at dequeue (sojourn or TTFT budget).
    pub shed: AtomicU64,
    /// Dropped at dequeue: the caller's deadline had passed.
    pub dropped_deadline: AtomicU64,
    /// Got a slot.
    pub started: AtomicU64,
    /// Ended with a complete response.
    pub completed: AtomicU64,
}

impl Default for ClassCounters {
    fn default() -> Self {
        ClassCounters {
            admitted: AtomicU64::new(0),
            rejected_queue_full: AtomicU64::new(0),
            rejected_token_budget: AtomicU64::new(0),
            rejected_slo_ttft: AtomicU64::new(0),
            rate_limited: AtomicU64::new(0),
            shed: AtomicU64::new(0),
            dropped_deadline: AtomicU64::new(0),
            started: AtomicU64::new(0),
            completed: AtomicU64::new(0),
        }
    }
}

impl ClassCounters {
    /// Outcome label and count, in the order they are exported.
    fn outcomes(&self) -> [(&'static str, u64); 8] {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        [
            ("admitted", l(&self.admitted)),
            ("rejected_queue_full", l(&self.rejected_queue_full)),
            ("rejected_token_budget", l(&self.rejected_token_budget)),
            ("rate_limited", l(&self.rate_limited)),
            ("shed", l(&self.shed)),
            ("deadline", l(&self.dropped_deadline)),
            ("started", l(&self.started)),
            ("completed", l(&self.completed)),
        ]
    }
}

/// The per-client rate limiter's view, for `/metrics` (no client is named:
/// identities would make one series per client).
#[derive(Debug, Default, Clone, Copy)]
pub struct RateLimitGauges {
    pub clients: usize,
    pub clients_max: usize,
    /// Clients refused at least once in the last `LIMITED_WINDOW`.
    pub clients_limited: usize,
    pub evictions: u64,
}

/// The engine's gauges at one moment (`Metrics::engine_now`).
#[derive(Debug, Clone, Copy)]
pub struct EngineNow {
    pub running: usize,
    pub kv_cells_reserved: usize,
}

pub struct Metrics {
    /// Per priority class (`Class::index`).
    classes: [ClassCounters; Class::COUNT],
    /// Requests refused with 401 (`--api-key-file`).
    pub unauthorized: AtomicU64,
    /// Requests refused with 403: a `Host` or `Origin` not allowed.
    pub forbidden: AtomicU64,
    /// Requests that passed validation and entered the admission queue.
    pub accepted: AtomicU64,
    /// Requests refused because the admission queue was full.
    pub rejected_queue_full: AtomicU64,
    /// Requests refused because their prompt would break the queued-token budget.
    pub rejected_token_budget: AtomicU64,
    /// Refused because the first token's forecast was past a gateway's TTFT
    /// objective.
    pub rejected_slo_ttft: AtomicU64,
    /// Of the queue-full and token-budget refusals, those decided at the door
    /// from the queue's state alone: before the body was read, templated or
    /// tokenized.
    pub rejected_before_parsing: AtomicU64,
    /// Prompts templated and tokenized (completions, chat, embeddings).
    pub prompts_tokenized: AtomicU64,
    /// Reports of the engine's to admission that found their channel full
    /// (`admission::Reporter`; sized so that this stays 0).
    pub admission_reports_lost: AtomicU64,
    /// The engine's measured prefill and decode rates, tokens per second, as
    /// f64 bits (0: none published yet); the gate reads them.
    rates_bits: [AtomicU64; 2],
    /// Requests from clients that came back before their Retry-After.
    pub retried_early: AtomicU64,
    /// Requests refused by validation (4xx).
    pub invalid: AtomicU64,
    /// Requests that ended with a complete response.
    pub completed: AtomicU64,
    /// Admitted requests cancelled before the end, by `CancelReason` (index
    /// `reason as usize - 1`): their sequence stopped and freed its KV cells.
    cancelled: [AtomicU64; CancelReason::ALL.len()],
    /// Tokens sampled for a request whose cancel flag was already set: the cost
    /// of noticing late (at most one per running sequence per step).
    pub tokens_after_cancel: AtomicU64,
    /// Prompt tokens prefilled (counted per chunk, cancelled prompts included).
    pub prefill_tokens: AtomicU64,
    /// Prompt tokens never prefilled because their request was cancelled.
    pub prefill_tokens_abandoned: AtomicU64,
    /// Prompt tokens taken from the prefix cache, or from the first choice of
    /// the same request (`n` > 1), instead of prefilled.
    pub prefix_tokens_reused: AtomicU64,
    /// Tokens of prefix cache entries evicted (for room, or for an id).
    pub prefix_tokens_evicted: AtomicU64,
    /// Finished sequences not kept because their state alone is larger than
    /// the prefix cache's bound (never copied).
    pub prefix_too_large: AtomicU64,
    /// Requests started in the short requests' context (`--short-cells`).
    pub short_context_starts: AtomicU64,
    prefix_entries: AtomicUsize,
    prefix_bytes: AtomicUsize,
    /// Tokens of a finished sequence whose cells wait in the KV cache to be saved.
    prefix_parked_tokens: AtomicUsize,
    /// `llama_decode` passes stopped mid-way because every sequence in them
    /// was cancelled.
    pub decodes_aborted: AtomicU64,
    /// Times the KV cache's pages went back to the kernel (idle, no cells held).
    pub kv_pages_released: AtomicU64,
    /// Engine steps begun between a request's cancel and its KV cells being
    /// freed, summed over cancellations, and the most for one.
    cancel_lag_steps: AtomicU64,
    cancel_lag_steps_max: AtomicU64,
    /// Requests that ended with an engine error.
    pub failed: AtomicU64,
    /// Requests shed at dequeue because the queue stood above its sojourn target.
    pub shed_sojourn: AtomicU64,
    /// Requests shed at dequeue because their first token could no longer come
    /// within W_max.
    pub shed_ttft_budget: AtomicU64,
    /// Requests dropped at dequeue because their caller's deadline had passed.
    pub dropped_deadline: AtomicU64,
    /// The token budget of the last step planned.
    pub step_budget_tokens: AtomicUsize,
    /// CoDel is shedding.
    pub shedding: AtomicBool,
    /// Requests leave the queue above the sojourn target: the server is not ready.
    pub sojourn_above_target: AtomicBool,
    /// Milliseconds since `epoch` at the engine loop's last turn (liveness).
    heartbeat_ms: AtomicU64,
    epoch: Instant,
    pub tokens_generated: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub steps: AtomicU64,
    /// `llama_decode` calls: a step makes one for its decode tokens, one for
    /// its prompt chunks (per-sequence KV) and one for embedding inputs.
    pub passes: AtomicU64,
    /// Passes over the weights beyond one per `passes` because its
    /// sequences' ids were not consecutive (per-sequence KV, llama.cpp makes
    /// one micro-batch per run of consecutive ids).
    pub passes_split: AtomicU64,
    /// Tokens put in the ids missing among a pass's so that its ids are
    /// consecutive (`engine::passes::gap_ids`), each freed after its pass.
    pub pass_fillers: AtomicU64,
    /// Graph computations of `passes` (a pass computes one per llama.cpp
    /// micro-batch) that reused the previous one's compute graph.
    pub graphs_reused: AtomicU64,
    pub step_tokens: AtomicU64,
    /// Steps that held decode tokens and a prefill chunk together.
    pub steps_mixed: AtomicU64,
    /// Steps whose budget was raised to take a short prompt whole beside
    /// streams ahead of their pace (`--itl-max-ms`).
    pub steps_whole_prompt: AtomicU64,
    /// Steps that held one large chunk of a long prompt alone, the streams
    /// carried through it by tokens decoded ahead (`--decode-ahead-ms`).
    pub steps_ahead_chunk: AtomicU64,
    /// Steps whose prefill went first to a prompt overdue in its slot rather
    /// than to a shorter one (`engine::planner`, rule 2).
    pub steps_overdue_first: AtomicU64,
    /// Tokens computed in generation passes, prompt chunks' and decode
    /// tokens' (index `ATTENTION_PREFILL`, `ATTENTION_DECODE`), and the sum
    /// over them of the cells before each in its sequence: what the next
    /// start weighs the attention pairings' timings by (`engine::served`).
    attention_tokens: [AtomicU64; 2],
    attention_depth: [AtomicU64; 2],
    active_sequences: AtomicUsize,
    paused_sequences: AtomicUsize,
    kv_cells_reserved: AtomicUsize,
    pub queue_wait: ClassBuckets,
    pub prefill_done: Buckets,
    pub step_time: Buckets,
    pub ttft: ClassBuckets,
    pub inter_token: ClassBuckets,
    pub request_time: ClassBuckets,
    /// |measured − predicted| / measured of each step's time, in permille.
    step_error: Mutex<Histogram<u64>>,
    /// Measured / predicted step time, in permille.
    step_ratio: Mutex<Histogram<u64>>,
    kv_cells_used: AtomicUsize,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            classes: Default::default(),
            unauthorized: AtomicU64::new(0),
            forbidden: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            rejected_queue_full: AtomicU64::new(0),
            rejected_token_budget: AtomicU64::new(0),
            rejected_slo_ttft: AtomicU64::new(0),
            rejected_before_parsing: AtomicU64::new(0),
            prompts_tokenized: AtomicU64::new(0),
            admission_reports_lost: AtomicU64::new(0),
            rates_bits: Default::default(),
            retried_early: AtomicU64::new(0),
            invalid: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            cancelled: Default::default(),
            tokens_after_cancel: AtomicU64::new(0),
            prefill_tokens: AtomicU64::new(0),
            prefill_tokens_abandoned: AtomicU64::new(0),
            prefix_tokens_reused: AtomicU64::new(0),
            prefix_tokens_evicted: AtomicU64::new(0),
            prefix_too_large: AtomicU64::new(0),
            short_context_starts: AtomicU64::new(0),
            prefix_entries: AtomicUsize::new(0),
            prefix_bytes: AtomicUsize::new(0),
            prefix_parked_tokens: AtomicUsize::new(0),
            decodes_aborted: AtomicU64::new(0),
            kv_pages_released: AtomicU64::new(0),
            cancel_lag_steps: AtomicU64::new(0),
            cancel_lag_steps_max: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            shed_sojourn: AtomicU64::new(0),
            shed_ttft_budget: AtomicU64::new(0),
            dropped_deadline: AtomicU64::new(0),
            step_budget_tokens: AtomicUsize::new(0),
            shedding: AtomicBool::new(false),
            sojourn_above_target: AtomicBool::new(false),
            heartbeat_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            tokens_generated: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            steps: AtomicU64::new(0),
            passes: AtomicU64::new(0),
            passes_split: AtomicU64::new(0),
            pass_fillers: AtomicU64::new(0),
            graphs_reused: AtomicU64::new(0),
            step_tokens: AtomicU64::new(0),
            steps_mixed: AtomicU64::new(0),
            steps_whole_prompt: AtomicU64::new(0),
            steps_ahead_chunk: AtomicU64::new(0),
            steps_overdue_first: AtomicU64::new(0),
            attention_tokens: Default::default(),
            attention_depth: Default::default(),
            active_sequences: AtomicUsize::new(0),
            paused_sequences: AtomicUsize::new(0),
            kv_cells_reserved: AtomicUsize::new(0),
            queue_wait: ClassBuckets::new(QUEUE_WAIT_BUCKETS),
            prefill_done: Buckets::new(TTFT_BUCKETS),
            step_time: Buckets::new(STEP_BUCKETS),
            ttft: ClassBuckets::new(TTFT_BUCKETS),
            inter_token: ClassBuckets::new(ITL_BUCKETS),
            request_time: ClassBuckets::new(REQUEST_BUCKETS),
            step_error: ratio_histogram(),
            step_ratio: ratio_histogram(),
            kv_cells_used: AtomicUsize::new(0),
        }
    }
}

/// `Metrics::attention_tokens`' kinds.
const ATTENTION_PREFILL: usize = 0;
const ATTENTION_DECODE: usize = 1;

/// Ratios in permille, up to a thousandfold.
const RATIO_PERMILLE_MAX: u64 = 1_000_000;

fn ratio_histogram() -> Mutex<Histogram<u64>> {
    Mutex::new(
        Histogram::new_with_bounds(1, RATIO_PERMILLE_MAX, 3).expect("valid histogram bounds"),
    )
}

fn record_permille(h: &Mutex<Histogram<u64>>, ratio: f64) {
    if !ratio.is_finite() {
        return;
    }
    let permille = ((ratio * 1000.0).round().max(0.0) as u64).clamp(1, RATIO_PERMILLE_MAX);
    if let Ok(mut h) = h.lock() {
        h.saturating_record(permille);
    }
}

impl Metrics {
    pub fn class(&self, class: Class) -> &ClassCounters {
        &self.classes[class.index()]
    }

    pub fn count_cancel(&self, reason: CancelReason) {
        self.cancelled[reason as usize - 1].fetch_add(1, Ordering::Relaxed);
    }

    /// A cancelled request's KV cells were freed `steps` steps after its cancel.
    pub fn record_cancel_lag(&self, steps: u64) {
        self.cancel_lag_steps.fetch_add(steps, Ordering::Relaxed);
        self.cancel_lag_steps_max
            .fetch_max(steps, Ordering::Relaxed);
    }

    /// The engine loop turned: it is alive.
    /// The engine's measured rates, tokens per second (prefill, decode).
    pub fn publish_rates(&self, prefill_tok_s: f64, decode_tok_s: f64) {
        self.rates_bits[0].store(prefill_tok_s.to_bits(), Ordering::Relaxed);
        self.rates_bits[1].store(decode_tok_s.to_bits(), Ordering::Relaxed);
    }

    /// The rates the engine published last, if it has.
    pub fn rates(&self) -> Option<(f64, f64)> {
        let [p, d] = self
            .rates_bits
            .each_ref()
            .map(|b| b.load(Ordering::Relaxed));
        (p != 0 && d != 0).then(|| (f64::from_bits(p), f64::from_bits(d)))
    }

    pub fn beat(&self) {
        let ms = self.epoch.elapsed().as_millis() as u64;
        self.heartbeat_ms.store(ms, Ordering::Relaxed);
    }

    /// Since the metrics were made (start-up).
    pub fn uptime(&self) -> Duration {
        self.epoch.elapsed()
    }

    /// Time since the engine loop last turned.
    pub fn heartbeat_age(&self) -> Duration {
        let last = Duration::from_millis(self.heartbeat_ms.load(Ordering::Relaxed));
        self.epoch.elapsed().saturating_sub(last)
    }

    pub fn record_queue_wait(&self, class: Class, d: Duration) {
        self.queue_wait.class(class).observe(d);
    }

    pub fn record_prefill_done(&self, prompt_tokens: usize, since_enqueue: Duration) {
        self.prompt_tokens
            .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        self.prefill_done.observe(since_enqueue);
    }

    /// A token was sampled: the first of its request (time since it arrived),
    /// or the gap since the request's previous token.
    pub fn record_token(
        &self,
        class: Class,
        first_since_arrival: Option<Duration>,
        gap: Option<Duration>,
    ) {
        if let Some(d) = first_since_arrival {
            self.ttft.class(class).observe(d);
        }
        if let Some(d) = gap {
            self.inter_token.class(class).observe(d);
        }
    }

    /// A request completed, this long after it arrived.
    pub fn record_request_time(&self, class: Class, d: Duration) {
        self.request_time.class(class).observe(d);
    }

    /// A step whose first pass ran: counted before any of its tokens goes
    /// out, so a client that reads the metrics after its answer finds the
    /// step that made it. `mixed`: it held decode tokens and a prompt chunk.
    pub fn count_step(&self, mixed: bool) {
        self.steps.fetch_add(1, Ordering::Relaxed);
        if mixed {
            self.steps_mixed.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A counted step's tokens and time, once it ran.
    pub fn record_step(&self, tokens: usize, d: Duration) {
        self.step_tokens.fetch_add(tokens as u64, Ordering::Relaxed);
        self.step_time.observe(d);
    }

    /// One pass's tokens, by kind: `(tokens, the sum of their depths)` of
    /// its prompt chunks and of its decode tokens.
    pub fn record_attention(&self, prefill: (u64, u64), decode: (u64, u64)) {
        for (i, (n, depth)) in [(ATTENTION_PREFILL, prefill), (ATTENTION_DECODE, decode)] {
            self.attention_tokens[i].fetch_add(n, Ordering::Relaxed);
            self.attention_depth[i].fetch_add(depth, Ordering::Relaxed);
        }
    }

    /// What `record_attention` counted since the start: prompt chunks' and
    /// decode tokens' `(tokens, the sum of their depths)`.
    pub fn attention_counts(&self) -> [(u64, u64); 2] {
        [ATTENTION_PREFILL, ATTENTION_DECODE].map(|i| {
            (
                self.attention_tokens[i].load(Ordering::Relaxed),
                self.attention_depth[i].load(Ordering::Relaxed),
            )
        })
    }

    /// How far the cost model's forecast of a step was from its measured time.
    pub fn record_step_forecast(&self, predicted_s: f64, measured_s: f64) {
        if predicted_s > 0.0 && measured_s > 0.0 {
            record_permille(
                &self.step_error,
                (measured_s - predicted_s).abs() / measured_s,
            );
            record_permille(&self.step_ratio, measured_s / predicted_s);
        }
    }

    /// The engine's sequences and reserved cells, read once, for one
    /// rendering of `/metrics` (sluice's gauges and the gateway protocol's
    /// then agree).
    pub fn engine_now(&self) -> EngineNow {
        EngineNow {
            running: self.active_sequences.load(Ordering::Relaxed),
            kv_cells_reserved: self.kv_cells_reserved.load(Ordering::Relaxed),
        }
    }

    pub fn set_engine_gauges(
        &self,
        active: usize,
        paused: usize,
        kv_cells_reserved: usize,
        kv_cells_used: usize,
    ) {
        self.kv_cells_used.store(kv_cells_used, Ordering::Relaxed);
        self.active_sequences.store(active, Ordering::Relaxed);
        self.paused_sequences.store(paused, Ordering::Relaxed);
        self.kv_cells_reserved
            .store(kv_cells_reserved, Ordering::Relaxed);
    }

    /// What the prefix cache holds: entries, and the bytes of their states.
    pub fn set_prefix_gauges(&self, entries: usize, bytes: usize, parked_tokens: usize) {
        self.prefix_parked_tokens
            .store(parked_tokens, Ordering::Relaxed);
        self.prefix_entries.store(entries, Ordering::Relaxed);
        self.prefix_bytes.store(bytes, Ordering::Relaxed);
    }
}
