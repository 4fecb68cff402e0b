//! `/metrics`: the live gauges of admission, the bounds and the
//! configuration, beside the counters and histograms `metrics` keeps.

use super::{not_ready, AppState};
use crate::admission::{Bounds, Rates};
use crate::metrics::EngineNow;
use crate::priority::Class;

/// The Prometheus text of `/metrics`.
pub(super) fn metrics_text(state: &AppState) -> String {
    let (rates, class_bounds) = state.queue.snapshot();
    let bounds = class_bounds[Class::Interactive.index()];
    // Read once: sluice's gauges and the gateway protocol's show the same.
    let waiting = Class::ALL
        .map(|c| state.queue.queued_requests(c))
        .iter()
        .sum::<usize>();
    let engine = state.metrics.engine_now();
    let mut gauges = queue_gauges(state, bounds, waiting).to_vec();
    gauges.extend(rate_and_engine_gauges(state, rates, bounds));
    let mut out = state.metrics.render(
        &gauges,
        &class_gauges(state, &class_bounds),
        state.limiter.gauges(),
        engine,
    );
    front_text(state, &mut out);
    batch_text(state, &mut out);
    protocol_text(state, waiting, engine, &mut out);
    out
}

/// The granularity a gateway's prefix scorer should hash prompts in: the
/// shortest prefix sluice reuses from its prefix cache.
const PROTOCOL_BLOCK_TOKENS: usize = 16;

/// The model-server protocol of the Gateway API Inference Extension, under
/// the names of its default engine profile (vLLM's): requests waiting,
/// requests running, KV cache use as a fraction, and the cache's shape.
fn protocol_text(state: &AppState, waiting: usize, engine: EngineNow, out: &mut String) {
    use std::fmt::Write as _;
    let total = state.n_ctx;
    let usage = engine.kv_cells_reserved as f64 / total.max(1) as f64;
    // A label value escapes backslash, quote and newline.
    let model = state
        .cfg
        .model_name
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n");
    for (name, help, v) in [
        (
            "vllm:num_requests_waiting",
            "Requests waiting for a slot, all classes (= sluice_queue_depth).",
            waiting as f64,
        ),
        (
            "vllm:num_requests_running",
            "Requests in the engine (= sluice_sequences_active).",
            engine.running as f64,
        ),
        (
            "vllm:kv_cache_usage_perc",
            "KV cells reserved over the cells requests may reserve, 0 to 1 (= sluice_kv_cells_reserved / sluice_kv_cells).",
            usage,
        ),
    ] {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{model_name=\"{model}\"}} {v}"
        );
    }
    let _ = writeln!(
        out,
        "# HELP vllm:cache_config_info The KV cache's shape: blocks of block_size tokens (the shortest prefix sluice reuses), num_gpu_blocks of them.\n\
         # TYPE vllm:cache_config_info gauge\n\
         vllm:cache_config_info{{block_size=\"{PROTOCOL_BLOCK_TOKENS}\",num_gpu_blocks=\"{}\"}} 1",
        total / PROTOCOL_BLOCK_TOKENS
    );
}

/// The Batch API's store: batches by status, lines by state, files and
/// bytes kept (with `--data-dir off`, none of these).
fn batch_text(state: &AppState, out: &mut String) {
    use std::fmt::Write as _;
    let Some(api) = &state.batches else {
        return;
    };
    let st = api.store.stored();
    let _ = writeln!(
        out,
        "# HELP sluice_batches Batches kept, by status.\n# TYPE sluice_batches gauge"
    );
    for (status, n) in crate::batch::Status::ALL.iter().zip(st.batches) {
        let _ = writeln!(out, "sluice_batches{{status=\"{}\"}} {n}", status.name());
    }
    let _ = writeln!(
        out,
        "# HELP sluice_batch_lines Lines of the batches kept, by state (pending: still to run).\n\
         # TYPE sluice_batch_lines gauge"
    );
    for (s, n) in [
        ("pending", st.lines_pending),
        ("done", st.lines_done),
        ("failed", st.lines_failed),
    ] {
        let _ = writeln!(out, "sluice_batch_lines{{state=\"{s}\"}} {n}");
    }
    let limits = api.store.limits();
    let gauges = [
        (
            "sluice_batch_files",
            "Files kept (uploads and batch results).",
            st.files as f64,
        ),
        (
            "sluice_batch_stored_bytes",
            "Bytes of files kept.",
            st.bytes as f64,
        ),
        (
            "sluice_batch_stored_bytes_max",
            "Most bytes of files kept (--data-bytes-max).",
            limits.stored_bytes_max as f64,
        ),
    ];
    for (name, help, v) in gauges {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
    }
}

type Gauge = (&'static str, &'static str, f64);
type ClassGauge = (&'static str, &'static str, [f64; Class::COUNT]);

/// Each class's queue, bounds, budgets and slots.
fn class_gauges(state: &AppState, class_bounds: &[Bounds; Class::COUNT]) -> [ClassGauge; 8] {
    let classes = |f: &dyn Fn(Class) -> f64| Class::ALL.map(f);
    [
        (
            "sluice_class_queue_pressed",
            "1 while each class's door has refused within its W_max: its queue then holds only what keeps a typical first token within W_max.",
            state.queue.pressed().map(|p| f64::from(u8::from(p))),
        ),
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
            "sluice_class_sojourn_target_seconds",
            "Each class's CoDel sojourn target (0: --no-shed).",
            classes(&|c| state.cfg.shed(c).map_or(0.0, |(t, _)| t.as_secs_f64())),
        ),
        (
            "sluice_class_slots_max",
            "Slots each class may hold.",
            classes(&|c| match c {
                Class::Interactive => state.cfg.parallel as f64,
                Class::Batch => state.cfg.batch_slots() as f64,
            }),
        ),
    ]
}

/// The compute pool and the queue against its bounds.
fn queue_gauges(state: &AppState, bounds: Bounds, waiting: usize) -> [Gauge; 7] {
    [
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
            waiting as f64,
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
    ]
}

/// The rates and the mix the bounds come from, the targets, readiness, the
/// engine's heartbeat and the handler pool.
fn rate_and_engine_gauges(state: &AppState, rates: Rates, bounds: Bounds) -> [Gauge; 13] {
    let typical = state.queue.typical();
    [
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
            "sluice_itl_max_seconds",
            "Longest pause a step may cost the streams to take a short prompt whole (--itl-max-ms).",
            state.cfg.itl_max.as_secs_f64(),
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
            "sluice_sojourn_above_target",
            "1 while interactive requests leave the queue above the sojourn target, or its head has waited past it.",
            f64::from(u8::from(state.metrics.sojourn_above_target.load(std::sync::atomic::Ordering::Relaxed))),
        ),
        (
            "sluice_engine_heartbeat_age_seconds",
            "Since the engine loop last turned (it turns at least every 100 ms when idle; /livez fails after 120 s).",
            state.metrics.heartbeat_age().as_secs_f64(),
        ),
        (
            "sluice_http_threads",
            "HTTP handler threads.",
            state.http_threads as f64,
        ),
    ]
}

/// The HTTP front: connections against their bound, the handlers, and what
/// the connections refused before any handler saw a request.
fn front_text(state: &AppState, out: &mut String) {
    use std::fmt::Write as _;
    use std::sync::atomic::Ordering::Relaxed;
    let Some(door) = state.front.get() else {
        return;
    };
    let st = door.stats();
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
            door.queued() as f64,
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
            "sluice_http_accept_errors_total",
            "Accepts that failed and were retried (out of file descriptors or memory, a connection reset before it was accepted).",
            st.accept_errors.load(Relaxed),
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

/// `GET /status`: what the status page (`GET /`) draws, as JSON: counters
/// (the page turns them into rates), the queues against their bounds, KV use,
/// streams, and the latency histograms' cumulative bucket counts (the page
/// takes quantiles over its last seconds from their differences).
pub(super) fn status_json(state: &AppState) -> serde_json::Value {
    use serde_json::{json, Map, Value};
    use std::sync::atomic::Ordering::Relaxed;
    let m = state.metrics.snapshot();
    let (_, class_bounds) = state.queue.snapshot();
    let mut queues = Map::new();
    for c in Class::ALL {
        queues.insert(
            c.as_str().into(),
            json!({
                "depth": state.queue.queued_requests(c),
                "bound": class_bounds[c.index()].queue_depth_max,
                "queued_tokens": state.queue.queued_tokens(c),
                "queued_tokens_max": class_bounds[c.index()].queued_tokens_max,
                "sojourn_target_s": state.cfg.shed(c).map_or(0.0, |(t, _)| t.as_secs_f64()),
                "wait_budget_s": state.cfg.queue_wait(c).as_secs_f64(),
            }),
        );
    }
    let histogram = |b: &crate::metrics::Buckets| {
        let (counts, sum) = b.snapshot();
        json!({"bounds": b.bounds(), "counts": counts, "sum": sum})
    };
    let interactive = Class::Interactive;
    let pairs = |v: &[(&str, u64)]| -> Value {
        Value::Object(
            v.iter()
                .map(|(k, n)| ((*k).to_string(), json!(n)))
                .collect(),
        )
    };
    let front = state.front.get().map(|door| {
        let st = door.stats();
        json!({
            "connections": st.open.load(Relaxed),
            "connections_max": state.max_connections,
            "refused": st.refused_connections.load(Relaxed) + st.refused_queue_full.load(Relaxed)
                + st.timed_out.load(Relaxed) + st.malformed.load(Relaxed) + st.too_large.load(Relaxed),
        })
    });
    json!({
        "model": state.cfg.model_name,
        "uptime_s": state.metrics.uptime().as_secs_f64(),
        "ready": not_ready(state).is_none(),
        "not_ready_because": not_ready(state),
        "shedding": m.shedding,
        "sojourn_above_target": m.sojourn_above_target,
        "engine_heartbeat_age_s": m.heartbeat_age.as_secs_f64(),
        "queues": queues,
        "requests": {
            "accepted": m.accepted,
            "completed": m.completed,
            "failed": m.failed,
            "refused": pairs(&m.refused),
            "cancelled": pairs(&m.cancelled),
        },
        "tokens": {
            "generated": m.tokens_generated,
            "prefilled": m.prefill_tokens,
            "reused": m.tokens_reused,
        },
        "streams": {"running": m.running, "paused": m.paused, "slots": state.cfg.parallel},
        "kv": {"cells": state.n_ctx, "used": m.kv_cells_used, "reserved": m.kv_cells_reserved},
        "step_budget_tokens": m.step_budget_tokens,
        "itl_target_s": state.cfg.itl_target.as_secs_f64(),
        "itl_max_s": state.cfg.itl_max.as_secs_f64(),
        "front": front,
        "batch": batch_status(state),
        "histograms": {
            "ttft": histogram(state.metrics.ttft.class(interactive)),
            "itl": histogram(state.metrics.inter_token.class(interactive)),
            "queue_wait": histogram(state.metrics.queue_wait.class(interactive)),
        },
    })
}

/// The Batch API's store for `/status`: batches by status, lines by state,
/// bytes kept; `null` with `--data-dir off`.
fn batch_status(state: &AppState) -> serde_json::Value {
    let Some(api) = &state.batches else {
        return serde_json::Value::Null;
    };
    let st = api.store.stored();
    let batches: serde_json::Map<String, serde_json::Value> = crate::batch::Status::ALL
        .iter()
        .zip(st.batches)
        .map(|(s, n)| (s.name().to_string(), n.into()))
        .collect();
    serde_json::json!({
        "batches": batches,
        "lines": {"pending": st.lines_pending, "done": st.lines_done, "failed": st.lines_failed},
        "files": st.files,
        "stored_bytes": st.bytes,
        "stored_bytes_max": api.store.limits().stored_bytes_max,
    })
}
