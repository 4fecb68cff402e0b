//! What the engine tells admission, as messages: a request got its slot
//! (`started`, which hands back the `Slot` whose drop says it left it), left
//! the queue without one (`dropped`), completed (`observe_request`: the mix
//! the bounds follow), and what the prefix cache and the running sequences
//! hold (`prefix_*`: what a new prompt could reuse).
//!
//! The engine sends them on one bounded channel with `try_send`: it never
//! waits, and never takes a lock a handler holds. The gate applies them, in
//! the order sent, whenever a handler takes it, before it judges or reports
//! (`QueueGauge::lock`): a report the engine sends before it answers a client
//! is applied before that client's next request is judged. No thread stands
//! between them: on a 2-core box whose cores the compute threads keep busy a
//! hand-off to another thread waits for the scheduler (ARCHITECTURE.md,
//! "Decisions worth knowing").
//!
//! The measured rates are a value, not events (only the latest counts), so
//! they go through the metrics registry (`Metrics::publish_rates`), which the
//! gate reads when it is taken.

use super::*;
use crate::ffi::Token;
use std::sync::atomic::Ordering;

/// One thing the engine tells the gate.
#[derive(Debug)]
pub(super) enum Report {
    /// A request of `class` holding `tokens` of the queue's prompt tokens got
    /// its slot.
    Started { class: Class, tokens: usize },
    /// A running request of `class` left its slot (its `Slot` was dropped).
    Finished { class: Class },
    /// A queued request left without a slot (shed, its deadline passed, its
    /// client gone, the engine stopping).
    Dropped { class: Class, tokens: usize },
    /// A request completed, having prefilled and generated this much.
    Completed { prefilled: usize, generated: usize },
    /// The prefix cache's entries now.
    Cached(Vec<Arc<[Token]>>),
    /// The sequence in `slot` holds `prompt` whole in the KV cache (None: it
    /// ended).
    Running {
        slot: usize,
        prompt: Option<Arc<[Token]>>,
    },
}

/// Reports one request can cause over its life, at most: started and
/// finished (or dropped), completed, its sequence's prompt running then
/// ended, parked then cleared, and the cache's entries after it is kept,
/// restored or evicted for, with room to spare.
const REPORTS_PER_REQUEST_MAX: usize = 16;

/// The reports channel's capacity. Every report comes from a request the gate
/// admitted; at most `requests_max` (the running slots plus what every
/// class's queue holds) are alive at once, and each request's `submit` takes
/// the gate (draining it) before its own reports can start, so what is
/// waiting in the channel comes from requests alive at the last drain.
pub(super) fn reports_capacity(requests_max: usize) -> usize {
    (requests_max + 1) * REPORTS_PER_REQUEST_MAX
}

/// The engine's side of admission: reports, never blocking.
#[derive(Clone)]
pub struct Reporter {
    pub(super) tx: Sender<Report>,
    pub(super) metrics: Arc<Metrics>,
}

impl Reporter {
    fn send(&self, r: Report) {
        if self.tx.try_send(r).is_err() {
            // The capacity covers every report of every request alive: this
            // is a bug, made visible (`sluice_admission_reports_lost_total`).
            self.metrics
                .admission_reports_lost
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A request left its queue for a slot: it holds the slot as long as it
    /// holds the guard.
    pub fn started(&self, class: Class, prompt_tokens: usize) -> Slot {
        self.send(Report::Started {
            class,
            tokens: prompt_tokens,
        });
        Slot {
            reporter: self.clone(),
            class,
        }
    }

    /// A queued request left without a slot: the engine refused it at dequeue
    /// (shed, deadline passed), its client left, or the engine stopped.
    pub fn dropped(&self, class: Class, prompt_tokens: usize) {
        self.send(Report::Dropped {
            class,
            tokens: prompt_tokens,
        });
    }

    /// A request completed, having prefilled `prompt_tokens` and generated
    /// `generated_tokens`: μ_req, and so L_max, follow the work that arrives.
    pub fn observe_request(&self, prompt_tokens: usize, generated_tokens: usize) {
        self.send(Report::Completed {
            prefilled: prompt_tokens,
            generated: generated_tokens,
        });
    }

    /// The engine measured new rates: the bounds follow them.
    pub fn set_rates(&self, rates: Rates) {
        self.metrics
            .publish_rates(rates.prefill_tok_s, rates.decode_tok_s);
    }

    /// The prefix cache's entries changed: these are their tokens now.
    pub fn prefix_cached(&self, tokens: Vec<Arc<[Token]>>) {
        self.send(Report::Cached(tokens));
    }

    /// The sequence in `slot` has its whole prompt in the KV cache.
    pub fn prefix_running(&self, slot: usize, prompt: Arc<[Token]>) {
        self.send(Report::Running {
            slot,
            prompt: Some(prompt),
        });
    }

    /// The sequence in `slot` ended.
    pub fn prefix_ended(&self, slot: usize) {
        self.send(Report::Running { slot, prompt: None });
    }
}

/// A running request's hold on its slot (`Reporter::started`): dropping it
/// (the sequence completed, failed or was cancelled) frees the slot in the
/// gate's count, so the count cannot miss an end.
pub struct Slot {
    reporter: Reporter,
    class: Class,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.reporter.send(Report::Finished { class: self.class });
    }
}
