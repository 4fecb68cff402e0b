//! The numbers the status page shows, read at one moment.

use super::Metrics;
use crate::stream::CancelReason;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

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

impl Metrics {
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
                ("slo_ttft", l(&self.rejected_slo_ttft)),
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
}
