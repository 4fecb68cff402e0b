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

const QUANTILES: [f64; 4] = [0.5, 0.9, 0.99, 1.0];

/// Bucket bounds in seconds. Time to first token and prefill: from a short
/// chat on an idle box (~0.1 s) to a 6k-token prompt behind others (~40 s)
/// and the request timeout's range.
pub const TTFT_BUCKETS: &[f64] = &[
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
];
/// Between two tokens: around the 150 ms ITL target, finer below it.
pub const ITL_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
];
/// Queue wait: the sojourn targets (tens of ms) to W_max (seconds).
pub const QUEUE_WAIT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
/// A whole request: a few tokens to a few thousand.
pub const REQUEST_BUCKETS: &[f64] = &[
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
];
/// One engine step: a decode pass (~10 ms) to a full prefill chunk.
pub const STEP_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
];

/// A Prometheus histogram: observations counted in fixed buckets (upper
/// bounds in seconds, increasing; one more for +Inf), their sum and count.
pub struct Buckets {
    bounds: &'static [f64],
    /// Observations in each bucket alone (not cumulative), +Inf last.
    counts: Vec<AtomicU64>,
    sum_us: AtomicU64,
}

impl Buckets {
    pub fn new(bounds: &'static [f64]) -> Buckets {
        debug_assert!(bounds.windows(2).all(|w| w[0] < w[1]), "increasing bounds");
        Buckets {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_us: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let i = self.bounds.partition_point(|&b| b < s);
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_us
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    /// Cumulative counts per bound (+Inf last: the count), and the sum in
    /// seconds.
    pub fn snapshot(&self) -> (Vec<u64>, f64) {
        let mut total = 0;
        let cumulative = self
            .counts
            .iter()
            .map(|c| {
                total += c.load(Ordering::Relaxed);
                total
            })
            .collect();
        (cumulative, self.sum_us.load(Ordering::Relaxed) as f64 / 1e6)
    }

    pub fn bounds(&self) -> &'static [f64] {
        self.bounds
    }

    /// The `_bucket`, `_sum` and `_count` lines, with `labels` (e.g.
    /// `class="batch"`, or empty) on each.
    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let (cumulative, sum) = self.snapshot();
        let sep = if labels.is_empty() { "" } else { "," };
        for (i, c) in cumulative.iter().enumerate() {
            let le = match self.bounds.get(i) {
                Some(b) => format!("{b}"),
                None => "+Inf".to_string(),
            };
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{le}\"}} {c}");
        }
        let count = cumulative.last().copied().unwrap_or(0);
        let braces = |l: &str| match l.is_empty() {
            true => String::new(),
            false => format!("{{{l}}}"),
        };
        let _ = writeln!(out, "{name}_sum{} {sum}", braces(labels));
        let _ = writeln!(out, "{name}_count{} {count}", braces(labels));
    }
}

/// A histogram per priority class.
pub struct ClassBuckets([Buckets; Class::COUNT]);

impl ClassBuckets {
    fn new(bounds: &'static [f64]) -> ClassBuckets {
        ClassBuckets(Class::ALL.map(|_| Buckets::new(bounds)))
    }

    pub fn class(&self, c: Class) -> &Buckets {
        &self.0[c.index()]
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for c in Class::ALL {
            self.class(c)
                .render(out, name, &format!("class=\"{}\"", c.as_str()));
        }
    }
}

/// What happened to the requests of one priority class.
pub struct ClassCounters {
    /// Admitted to the class's queue.
    pub admitted: AtomicU64,
    /// Refused by the gate: the class's queue was full.
    pub rejected_queue_full: AtomicU64,
    /// Refused by the gate: the class's queued-token budget.
    pub rejected_token_budget: AtomicU64,
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

/// Counters and gauges at one moment (`Metrics::snapshot`).
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub accepted: u64,
    pub completed: u64,
    pub failed: u64,
    pub tokens_generated: u64,
    pub prefill_tokens: u64,
    pub tokens_reused: u64,
    /// Refused before admission, or dropped at dequeue, by reason.
    pub refused: Vec<(&'static str, u64)>,
    pub cancelled: Vec<(&'static str, u64)>,
    pub running: usize,
    pub paused: usize,
    pub kv_cells_used: usize,
    pub kv_cells_reserved: usize,
    pub step_budget_tokens: usize,
    pub shedding: bool,
    pub sojourn_above_target: bool,
    pub heartbeat_age: Duration,
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
    /// Requests refused by validation (4xx).
    pub invalid: AtomicU64,
    /// Requests that ended with a complete response.
    pub completed: AtomicU64,
    /// Admitted requests cancelled before the end, by `CancelReason` (index
    /// `reason as usize - 1`): their sequence stopped and freed its KV cells.
    cancelled: [AtomicU64; 4],
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
    pub step_tokens: AtomicU64,
    /// Steps that held decode tokens and a prefill chunk together.
    pub steps_mixed: AtomicU64,
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
            invalid: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            cancelled: Default::default(),
            tokens_after_cancel: AtomicU64::new(0),
            prefill_tokens: AtomicU64::new(0),
            prefill_tokens_abandoned: AtomicU64::new(0),
            prefix_tokens_reused: AtomicU64::new(0),
            prefix_tokens_evicted: AtomicU64::new(0),
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
            step_tokens: AtomicU64::new(0),
            steps_mixed: AtomicU64::new(0),
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

    pub fn record_step(&self, tokens: usize, decode_tokens: usize, d: Duration) {
        self.steps.fetch_add(1, Ordering::Relaxed);
        self.step_tokens.fetch_add(tokens as u64, Ordering::Relaxed);
        if decode_tokens > 0 && tokens > decode_tokens {
            self.steps_mixed.fetch_add(1, Ordering::Relaxed);
        }
        self.step_time.observe(d);
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

    /// What the status page shows, as plain numbers (`http::status` makes
    /// them JSON).
    pub fn snapshot(&self) -> Snapshot {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let g = |a: &AtomicUsize| a.load(Ordering::Relaxed);
        Snapshot {
            accepted: l(&self.accepted),
            completed: l(&self.completed),
            failed: l(&self.failed),
            tokens_generated: l(&self.tokens_generated),
            prefill_tokens: l(&self.prefill_tokens),
            tokens_reused: l(&self.prefix_tokens_reused),
            refused: vec![
                ("queue_full", l(&self.rejected_queue_full)),
                ("token_budget", l(&self.rejected_token_budget)),
                (
                    "rate_limited",
                    self.classes.iter().map(|c| l(&c.rate_limited)).sum(),
                ),
                ("invalid", l(&self.invalid)),
                ("unauthorized", l(&self.unauthorized)),
                ("forbidden", l(&self.forbidden)),
                ("shed_sojourn", l(&self.shed_sojourn)),
                ("shed_ttft_budget", l(&self.shed_ttft_budget)),
                ("deadline", l(&self.dropped_deadline)),
            ],
            cancelled: CancelReason::ALL
                .iter()
                .map(|&r| (r.as_str(), l(&self.cancelled[r as usize - 1])))
                .collect(),
            running: g(&self.active_sequences),
            paused: g(&self.paused_sequences),
            kv_cells_used: g(&self.kv_cells_used),
            kv_cells_reserved: g(&self.kv_cells_reserved),
            step_budget_tokens: self.step_budget_tokens.load(Ordering::Relaxed),
            shedding: self.shedding.load(Ordering::Relaxed),
            sojourn_above_target: self.sojourn_above_target.load(Ordering::Relaxed),
            heartbeat_age: self.heartbeat_age(),
        }
    }

    /// Prometheus text exposition format.
    pub fn render(
        &self,
        static_gauges: &[(&str, &str, f64)],
        class_gauges: &[(&str, &str, [f64; Class::COUNT])],
        limiter: RateLimitGauges,
    ) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        counter(
            &mut out,
            "sluice_requests_accepted_total",
            "Requests admitted to the queue.",
            l(&self.accepted),
        );
        let _ = writeln!(
            out,
            "# HELP sluice_requests_rejected_total Requests refused before admission, by reason.\n\
             # TYPE sluice_requests_rejected_total counter\n\
             sluice_requests_rejected_total{{reason=\"queue_full\"}} {}\n\
             sluice_requests_rejected_total{{reason=\"token_budget\"}} {}\n\
             sluice_requests_rejected_total{{reason=\"invalid\"}} {}\n\
             sluice_requests_rejected_total{{reason=\"rate_limited\"}} {}\n\
             sluice_requests_rejected_total{{reason=\"unauthorized\"}} {}\n\
             sluice_requests_rejected_total{{reason=\"forbidden\"}} {}",
            l(&self.rejected_queue_full),
            l(&self.rejected_token_budget),
            l(&self.invalid),
            self.classes.iter().map(|c| l(&c.rate_limited)).sum::<u64>(),
            l(&self.unauthorized),
            l(&self.forbidden)
        );
        counter(
            &mut out,
            "sluice_requests_completed_total",
            "Requests that ended with a complete response.",
            l(&self.completed),
        );
        let _ = writeln!(
            out,
            "# HELP sluice_requests_cancelled_total Admitted requests cancelled before completion, by reason.\n\
             # TYPE sluice_requests_cancelled_total counter"
        );
        for r in CancelReason::ALL {
            let _ = writeln!(
                out,
                "sluice_requests_cancelled_total{{reason=\"{}\"}} {}",
                r.as_str(),
                l(&self.cancelled[r as usize - 1])
            );
        }
        counter(
            &mut out,
            "sluice_tokens_after_cancel_total",
            "Tokens sampled for requests already cancelled (at most one per running sequence per step).",
            l(&self.tokens_after_cancel),
        );
        counter(
            &mut out,
            "sluice_prefill_tokens_total",
            "Prompt tokens prefilled, chunk by chunk (cancelled prompts included).",
            l(&self.prefill_tokens),
        );
        counter(
            &mut out,
            "sluice_prefill_tokens_abandoned_total",
            "Prompt tokens never prefilled because their request was cancelled.",
            l(&self.prefill_tokens_abandoned),
        );
        counter(
            &mut out,
            "sluice_prefix_cache_tokens_reused_total",
            "Prompt tokens taken from the prefix cache, or from the first choice of the same request, instead of prefilled.",
            l(&self.prefix_tokens_reused),
        );
        counter(
            &mut out,
            "sluice_prefix_cache_tokens_evicted_total",
            "Tokens of prefix cache entries evicted for room (least recently used first).",
            l(&self.prefix_tokens_evicted),
        );
        gauge(
            &mut out,
            "sluice_prefix_cache_entries",
            "Finished sequences whose KV state is kept for reuse.",
            self.prefix_entries.load(Ordering::Relaxed) as f64,
        );
        gauge(
            &mut out,
            "sluice_prefix_cache_bytes",
            "Bytes of KV state the prefix cache entries hold, in host memory (at most --prefix-cache-mb).",
            self.prefix_bytes.load(Ordering::Relaxed) as f64,
        );
        gauge(
            &mut out,
            "sluice_prefix_cache_parked_tokens",
            "Tokens of a finished sequence whose cells stay in the KV cache until no stream waits, then are saved (a running request may share them meanwhile).",
            self.prefix_parked_tokens.load(Ordering::Relaxed) as f64,
        );
        counter(
            &mut out,
            "sluice_cancel_lag_steps_total",
            "Engine steps begun between a cancel and the KV cells being freed, summed over cancellations.",
            l(&self.cancel_lag_steps),
        );
        gauge(
            &mut out,
            "sluice_cancel_lag_steps_max",
            "Most engine steps begun between one cancel and its KV cells being freed.",
            l(&self.cancel_lag_steps_max) as f64,
        );
        counter(
            &mut out,
            "sluice_kv_pages_released_total",
            "Times the engine, idle with no KV cells held, gave the KV cache's pages back to the kernel.",
            l(&self.kv_pages_released),
        );
        counter(
            &mut out,
            "sluice_decodes_aborted_total",
            "Engine steps stopped mid-pass because every sequence in them was cancelled.",
            l(&self.decodes_aborted),
        );
        counter(
            &mut out,
            "sluice_requests_failed_total",
            "Admitted requests that ended with an engine error.",
            l(&self.failed),
        );
        let _ = writeln!(
            out,
            "# HELP sluice_requests_dropped_total Admitted requests that left the queue without running, by reason.\n\
             # TYPE sluice_requests_dropped_total counter\n\
             sluice_requests_dropped_total{{reason=\"shed_sojourn\"}} {}\n\
             sluice_requests_dropped_total{{reason=\"shed_ttft_budget\"}} {}\n\
             sluice_requests_dropped_total{{reason=\"deadline\"}} {}",
            l(&self.shed_sojourn),
            l(&self.shed_ttft_budget),
            l(&self.dropped_deadline)
        );
        gauge(
            &mut out,
            "sluice_shedding",
            "1 while the queue stands above its sojourn target and requests are shed.",
            f64::from(u8::from(self.shedding.load(Ordering::Relaxed))),
        );
        counter(
            &mut out,
            "sluice_tokens_generated_total",
            "Tokens sampled.",
            l(&self.tokens_generated),
        );
        counter(
            &mut out,
            "sluice_prompt_tokens_total",
            "Prompt tokens of requests whose first token was sampled (prefilled or taken from the prefix cache).",
            l(&self.prompt_tokens),
        );
        counter(
            &mut out,
            "sluice_steps_total",
            "Engine steps (llama_decode calls).",
            l(&self.steps),
        );
        counter(
            &mut out,
            "sluice_step_tokens_total",
            "Tokens decoded across all steps.",
            l(&self.step_tokens),
        );
        counter(
            &mut out,
            "sluice_steps_mixed_total",
            "Steps that carried decode tokens and a prefill chunk together.",
            l(&self.steps_mixed),
        );
        let g = |a: &AtomicUsize| a.load(Ordering::Relaxed) as f64;
        gauge(
            &mut out,
            "sluice_step_budget_tokens",
            "Token budget of the last step planned (derived from the ITL target, or --step-tokens).",
            g(&self.step_budget_tokens),
        );
        gauge(
            &mut out,
            "sluice_sequences_active",
            "Sequences in the engine.",
            g(&self.active_sequences),
        );
        gauge(
            &mut out,
            "sluice_sequences_paused",
            "Sequences paused because their reader is slow.",
            g(&self.paused_sequences),
        );
        gauge(
            &mut out,
            "sluice_kv_cells_used",
            "KV cells holding tokens of running sequences.",
            g(&self.kv_cells_used),
        );
        gauge(
            &mut out,
            "sluice_kv_cells_reserved",
            "KV cells reserved for admitted sequences (prompt + max_tokens).",
            g(&self.kv_cells_reserved),
        );
        for (name, help, v) in static_gauges {
            gauge(&mut out, name, help, *v);
        }
        let _ = writeln!(
            out,
            "# HELP sluice_class_requests_total Requests of each priority class, by outcome.\n\
             # TYPE sluice_class_requests_total counter"
        );
        for c in Class::ALL {
            for (outcome, v) in self.class(c).outcomes() {
                let _ = writeln!(
                    out,
                    "sluice_class_requests_total{{class=\"{}\",outcome=\"{outcome}\"}} {v}",
                    c.as_str()
                );
            }
        }
        for (name, help, values) in class_gauges {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            for c in Class::ALL {
                let v = values[c.index()];
                let _ = writeln!(out, "{name}{{class=\"{}\"}} {v}", c.as_str());
            }
        }
        counter(
            &mut out,
            "sluice_unauthorized_total",
            "Requests refused with 401: no API key, or an unknown one.",
            l(&self.unauthorized),
        );
        gauge(
            &mut out,
            "sluice_rate_limit_clients",
            "Clients with a token bucket (bounded by --client-table-max).",
            limiter.clients as f64,
        );
        gauge(
            &mut out,
            "sluice_rate_limit_clients_max",
            "Most token buckets kept (--client-table-max).",
            limiter.clients_max as f64,
        );
        gauge(
            &mut out,
            "sluice_rate_limited_clients",
            "Clients refused by their token bucket in the last minute (a count; clients are not labels).",
            limiter.clients_limited as f64,
        );
        counter(
            &mut out,
            "sluice_rate_limit_evictions_total",
            "Token buckets dropped to keep the table within its bound.",
            limiter.evictions,
        );
        for (name, help, h) in [
            (
                "sluice_queue_wait_seconds",
                "Time from arrival to a slot, per priority class.",
                &self.queue_wait,
            ),
            (
                "sluice_time_to_first_token_seconds",
                "From arrival to the first sampled token, per priority class.",
                &self.ttft,
            ),
            (
                "sluice_inter_token_seconds",
                "Between two sampled tokens of one request, per priority class.",
                &self.inter_token,
            ),
            (
                "sluice_request_seconds",
                "From arrival to the end of a completed request, per priority class.",
                &self.request_time,
            ),
        ] {
            h.render(&mut out, name, help);
        }
        for (name, help, h) in [
            (
                "sluice_prefill_done_seconds",
                "Time from arrival to the end of prefill.",
                &self.prefill_done,
            ),
            (
                "sluice_step_seconds",
                "Time of one engine step.",
                &self.step_time,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
            h.render(&mut out, name, "");
        }
        for (name, help, h) in [
            (
                "sluice_step_forecast_error_ratio",
                "|measured - predicted| / measured time of an engine step (the cost model's error).",
                &self.step_error,
            ),
            (
                "sluice_step_measured_over_predicted_ratio",
                "Measured / predicted time of an engine step (above 1: the model is optimistic).",
                &self.step_ratio,
            ),
        ] {
            summary(&mut out, name, help, h, 1e3);
        }
        out
    }
}

/// One histogram as a Prometheus summary, its values divided by `scale`.
fn summary(out: &mut String, name: &str, help: &str, h: &Mutex<Histogram<u64>>, scale: f64) {
    let Ok(h) = h.lock() else { return };
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} summary");
    for q in QUANTILES {
        let v = h.value_at_quantile(q) as f64 / scale;
        let _ = writeln!(out, "{name}{{quantile=\"{q}\"}} {v}");
    }
    let _ = writeln!(out, "{name}_count {}", h.len());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_histogram_counts_each_observation_in_its_bucket_cumulatively() {
        let h = Buckets::new(&[0.1, 1.0]);
        for ms in [50, 100, 150, 2_000] {
            h.observe(Duration::from_millis(ms));
        }
        // le=0.1 holds 50 and 100 ms (a bound is inclusive), le=1 adds 150.
        let (cumulative, sum) = h.snapshot();
        assert_eq!(cumulative, vec![2, 3, 4]);
        assert!((sum - 2.3).abs() < 1e-9);
        let mut out = String::new();
        h.render(&mut out, "x_seconds", "class=\"batch\"");
        assert_eq!(
            out,
            "x_seconds_bucket{class=\"batch\",le=\"0.1\"} 2\n\
             x_seconds_bucket{class=\"batch\",le=\"1\"} 3\n\
             x_seconds_bucket{class=\"batch\",le=\"+Inf\"} 4\n\
             x_seconds_sum{class=\"batch\"} 2.3\n\
             x_seconds_count{class=\"batch\"} 4\n"
        );
        let mut bare = String::new();
        Buckets::new(&[1.0]).render(&mut bare, "y", "");
        assert_eq!(
            bare,
            "y_bucket{le=\"1\"} 0\ny_bucket{le=\"+Inf\"} 0\ny_sum 0\ny_count 0\n"
        );
    }

    #[test]
    fn every_latency_histogram_has_increasing_bounds() {
        for b in [
            TTFT_BUCKETS,
            ITL_BUCKETS,
            QUEUE_WAIT_BUCKETS,
            REQUEST_BUCKETS,
            STEP_BUCKETS,
        ] {
            assert!(b.windows(2).all(|w| w[0] < w[1]), "{b:?}");
        }
    }
}
