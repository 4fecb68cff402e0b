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
    let mut out = state
        .metrics
        .render(&gauges, &class_gauges, state.limiter.gauges());
    front_text(state, &mut out);
    out
}

/// The HTTP front: connections against their bound, the handlers, and what
/// the connections refused before any handler saw a request.
fn front_text(state: &AppState, out: &mut String) {
    use std::fmt::Write as _;
    use std::sync::atomic::Ordering::Relaxed;
    let Some(server) = state.front.get() else {
        return;
    };
    let st = server.stats();
    let gauges = [
        (
            "sluice_http_connections",
            "Open HTTP connections.",
            st.open.load(Relaxed) as f64,
        ),
        (
            "sluice_http_connections_max",
            "Most open HTTP connections (--max-connections).",
            state.max_connections as f64,
        ),
        (
            "sluice_http_handlers_busy",
            "HTTP handler threads inside a request now (besides the one answering this scrape).",
            // Besides the one answering this scrape.
            state.handlers_busy.load(Relaxed).saturating_sub(1) as f64,
        ),
        (
            "sluice_http_queue_depth",
            "Requests read whole and waiting for a handler.",
            server.queued() as f64,
        ),
        (
            "sluice_http_queue_depth_max",
            "Most requests waiting for a handler (--http-queue-depth).",
            state.http_queue_depth as f64,
        ),
    ];
    for (name, help, v) in gauges {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
    }
    let _ = writeln!(
        out,
        "# HELP sluice_http_refused_total Connections and requests the HTTP front refused or cut off before a handler saw them, by reason.\n\
         # TYPE sluice_http_refused_total counter"
    );
    for (reason, n) in [
        ("connections_full", &st.refused_connections),
        ("handler_queue_full", &st.refused_queue_full),
        ("timed_out", &st.timed_out),
        ("malformed", &st.malformed),
        ("body_too_large", &st.too_large),
    ] {
        let _ = writeln!(
            out,
            "sluice_http_refused_total{{reason=\"{reason}\"}} {}",
            n.load(Relaxed)
        );
    }
    for (name, help, n) in [
        (
            "sluice_http_connections_evicted_total",
            "Connections closed to make room at the bound: the one waiting longest on its client.",
            st.evicted.load(Relaxed),
        ),
        (
            "sluice_http_write_failures_total",
            "Responses whose writing failed: the client left, or read nothing within the write deadline.",
            st.write_failed.load(Relaxed),
        ),
        (
            "sluice_http_handler_panics_total",
            "Handler panics caught; each request got 500 and its handler went on.",
            state.handler_panics.load(Relaxed),
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {n}");
    }
}
