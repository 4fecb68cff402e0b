//! `/metrics`: the live gauges of admission, the bounds and the
//! configuration, beside the counters and histograms `metrics` keeps.

use super::{not_ready, AppState};
use crate::priority::Class;

/// The Prometheus text of `/metrics`.
pub(super) fn metrics_text(state: &AppState) -> String {
    let (rates, class_bounds) = state.queue.snapshot();
    let typical = state.queue.typical();
    let bounds = class_bounds[Class::Interactive.index()];
    let classes = |f: &dyn Fn(Class) -> f64| Class::ALL.map(f);
    let class_gauges = [
        (
            "sluice_class_queue_depth",
            "Requests of each class waiting for a slot.",
            classes(&|c| state.queue.queued_requests(c) as f64),
        ),
        (
            "sluice_class_queue_depth_max",
            "Each class's L_max (Little's law on its own W_max, or --queue-depth).",
            classes(&|c| class_bounds[c.index()].queue_depth_max as f64),
        ),
        (
            "sluice_class_queued_prompt_tokens",
            "Prompt tokens of each class waiting for a slot.",
            classes(&|c| state.queue.queued_tokens(c) as f64),
        ),
        (
            "sluice_class_queued_prompt_tokens_max",
            "Each class's budget of waiting prompt tokens.",
            classes(&|c| class_bounds[c.index()].queued_tokens_max as f64),
        ),
        (
            "sluice_class_queue_wait_budget_seconds",
            "Each class's W_max.",
            classes(&|c| state.cfg.queue_wait(c).as_secs_f64()),
        ),
        (
            "sluice_class_slots_max",
            "Slots each class may hold.",
            classes(&|c| match c {
                Class::Interactive => state.cfg.parallel as f64,
                Class::Batch => state.cfg.batch_slots() as f64,
            }),
        ),
    ];
    let gauges = [
        (
            "sluice_compute_threads",
            "Compute threads (engine + ggml workers).",
            state.cfg.cpus.len() as f64,
        ),
        (
            "sluice_parallel_max",
            "Sequences decoded together at most.",
            state.cfg.parallel as f64,
        ),
        (
            "sluice_queue_depth",
            "Requests waiting for a slot, all classes.",
            Class::ALL
                .map(|c| state.queue.queued_requests(c))
                .iter()
                .sum::<usize>() as f64,
        ),
        (
            "sluice_queue_depth_max",
            "Interactive queue bound L_max (Little's law on the live rates, or --queue-depth).",
            bounds.queue_depth_max as f64,
        ),
        (
            "sluice_queue_depth_ceiling",
            "Highest L_max the gate may allow (9, or --queue-depth): the queue's capacity.",
            state.cfg.policy(Class::Interactive).queue_depth_ceiling() as f64,
        ),
        (
            "sluice_queued_prompt_tokens",
            "Prompt tokens waiting for a slot, all classes.",
            Class::ALL
                .map(|c| state.queue.queued_tokens(c))
                .iter()
                .sum::<usize>() as f64,
        ),
        (
            "sluice_queued_prompt_tokens_max",
            "Budget of waiting interactive prompt tokens (mu_prefill x W_max).",
            bounds.queued_tokens_max as f64,
        ),
        (
            "sluice_mu_prefill_tokens_per_second",
            "Prefill rate the admission bounds are derived from (calibrated, refined online).",
            rates.prefill_tok_s,
        ),
        (
            "sluice_mu_decode_tokens_per_second",
            "Aggregate decode rate at --parallel sequences the bounds are derived from (calibrated, refined online).",
            rates.decode_tok_s,
        ),
        (
            "sluice_mu_requests_per_second",
            "Request service rate for the typical request.",
            bounds.mu_req,
        ),
        (
            "sluice_typical_prompt_tokens",
            "Prompt tokens a typical request prefills (learned from completed requests; cached tokens excluded).",
            typical.prompt_tokens as f64,
        ),
        (
            "sluice_typical_generated_tokens",
            "Tokens a typical request generates (learned from completed requests).",
            typical.max_tokens as f64,
        ),
        (
            "sluice_queue_wait_budget_seconds",
            "W_max: the queueing budget for time to first token (interactive).",
            state.cfg.queue_wait.as_secs_f64(),
        ),
        (
            "sluice_itl_target_seconds",
            "Inter-token latency target the step budget is derived from.",
            state.cfg.itl_target.as_secs_f64(),
        ),
        (
            "sluice_kv_cells",
            "KV cells in the context.",
            state.n_ctx as f64,
        ),
        (
            "sluice_ready",
            "1 when /readyz is 200: not draining, and interactive requests start within the sojourn target.",
            f64::from(u8::from(not_ready(state).is_none())),
        ),
        (
            "sluice_http_threads",
            "HTTP handler threads.",
            state.http_threads as f64,
        ),
    ];
    state
        .metrics
        .render(&gauges, &class_gauges, state.limiter.gauges())
}
