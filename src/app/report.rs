//! What start-up says in the log: the bounds it derived, who may call and
//! what is shed, the model and what it serves, the threads.

use crate::admission::{QueueGauge, Rates};
use crate::config::Config;
use crate::embed::Pooling;
use crate::engine::calibration::Calibration;
use crate::ffi::{KvLayout, Model};

/// What the rates the engine starts from are, and where they came from.
pub(super) fn calibration(cfg: &Config, c: &Calibration, from_cache: bool) {
    if from_cache {
        crate::say!(
            "sluice: calibration: from the cache: prefill {:.0} tok/s; decode {:.1} tok/s at batch 1, {:.1} tok/s at batch {} (refined online from here)",
            c.prefill_tok_s, c.decode_tok_s_batch_1, c.decode_tok_s_parallel, c.parallel
        );
        return;
    }
    crate::say!(
        "sluice: calibration ({:.1} s): prefill {:.0} tok/s in {}-token chunks; decode {:.1} tok/s at batch 1, {:.1} tok/s at batch {}{}",
        c.seconds, c.prefill_tok_s, cfg.n_batch(), c.decode_tok_s_batch_1, c.decode_tok_s_parallel, c.parallel,
        c.save_s_per_run.map_or(String::new(), |s| match cfg.kv_layout {
            KvLayout::Unified => format!("; saving a sequence's KV state {:.0} us per run of cells", s * 1e6),
            KvLayout::PerSequence => format!("; saving a sequence's KV state {:.1} us per token", s * 1e6),
        })
    );
}

/// `--calibrate-only`: what was measured, and that sluice is done.
pub(super) fn calibrate_only(calibration: Option<Calibration>) {
    if let Some(c) = calibration {
        crate::say!(
            "sluice: calibrate-only: prefill {:.0} tok/s; decode {:.1} tok/s at batch 1, {:.1} tok/s at batch {}; done",
            c.prefill_tok_s, c.decode_tok_s_batch_1, c.decode_tok_s_parallel, c.parallel
        );
    }
}

/// The queue's bounds per class, from the rates.
pub(super) fn admission(cfg: &Config, gauge: &QueueGauge, rates: Rates, n_ctx: usize) {
    let (_, [bounds, batch_bounds]) = gauge.snapshot();
    crate::say!(
        "sluice: admission: mu = {:.3} requests/s (typical request {} + {} tokens until completed requests say otherwise), W_max = {} ms, L_max = {}{}; queued prompt tokens <= {}{} (mu_prefill {:.0} tok/s x W_max); {}",
        bounds.mu_req,
        cfg.typical.prompt_tokens,
        cfg.typical.max_tokens,
        cfg.queue_wait.as_millis(),
        bounds.queue_depth_max,
        if cfg.queue_depth.is_some() {
            " (set by --queue-depth)".to_string()
        } else {
            format!(
                " ({} for W_max after the door refuses one: a typical first token within W_max)",
                bounds.queue_depth_pressed
            )
        },
        bounds.queued_tokens_max,
        if cfg.queued_tokens_max.is_some() { " (set by --queued-tokens-max)" } else { "" },
        rates.prefill_tok_s,
        if cfg.rates_fixed {
            "the rates fixed by --mu-fixed, the mix refined from every completed request"
        } else {
            "refined online from every step and every completed request"
        }
    );
    crate::say!(
        "sluice: priority: batch requests (X-Priority: batch) wait in their own queue: W_max = {} ms, L_max = {}, queued prompt tokens <= {}; they may hold {} of {} slots ({} kept for interactive) and {} KV cells; at least 1 start in {} goes to batch while both wait",
        cfg.batch_queue_wait.as_millis(),
        batch_bounds.queue_depth_max,
        batch_bounds.queued_tokens_max,
        cfg.batch_slots(),
        cfg.parallel,
        cfg.interactive_slots,
        cfg.batch_kv_cells(n_ctx),
        cfg.batch_every
    );
}

/// API keys, rate limits, shedding and the prefix cache.
pub(super) fn policies(cfg: &Config) {
    match &cfg.api_keys {
        Some(keys) => crate::say!(
            "sluice: API keys: {} known (--api-key-file); requests without one get 401",
            keys.len()
        ),
        None => crate::say!("sluice: API keys: none required"),
    }
    match cfg.client_limit {
        Some(l) => crate::say!(
            "sluice: rate limit per client (API key, or address): {} tokens of work/s, bucket {} tokens; {} clients kept at most",
            l.rate_tok_s, l.burst, cfg.client_table_max
        ),
        None if cfg.api_keys.is_some() => {
            crate::say!("sluice: rate limit per client: off, except for keys that set one")
        }
        None => crate::say!("sluice: rate limit per client: off"),
    }
    match cfg.shed {
        Some((target, interval)) if cfg.shed_late => crate::say!(
            "sluice: shedding: sojourn target {} ms over {} ms intervals (CoDel); past the target, a request starts only if its first token can come within W_max",
            target.as_millis(),
            interval.as_millis()
        ),
        Some((target, _)) => crate::say!(
            "sluice: shedding: none at dequeue (no --queue-wait-ms or --shed-target-ms given): an admitted request is served unless its own deadline passes; not ready while requests wait over {} ms",
            target.as_millis()
        ),
        None => crate::say!("sluice: shedding off (--no-shed)"),
    }
    match cfg.prefix_cache_mb {
        0 => crate::say!("sluice: prefix cache: off (--prefix-cache-mb 0)"),
        n => crate::say!(
            "sluice: prefix cache: finished sequences' KV state kept in up to {n} MiB of memory (least recently used evicted first) for requests that start with the same tokens"
        ),
    }
}

/// The short requests' context, if there is one: the most cells of a
/// request it serves, its streams' cells, and those of a request it serves
/// when nothing else runs, and the answer tokens a prompt token pays for
/// there (`Started::short_alone`).
pub(super) fn short_context(short: Option<(usize, usize)>, alone: Option<(usize, f64)>) {
    if let Some((most, stream)) = short {
        let alone = alone.map_or(String::new(), |(c, trade)| {
            let pays = match trade.is_finite() {
                true => format!(", its answer at most {trade:.2} tokens a prompt token (a prompt token's faster prefill there against an answer token's dearer decoding)"),
                false => String::new(),
            };
            format!(", and with nothing else running those of at most {c} cells (the calibration cache's timings: a prompt alone is prefilled faster there){pays}")
        });
        crate::say!(
            "sluice: requests of at most {most} cells (prompt + max_tokens) run in a second context, flash attention on, f16 cache, {stream} cells a sequence (--short-cells){alone}"
        );
    }
}

/// The model, its context, its template, structured output and embeddings.
pub(super) fn model(cfg: &Config, loaded: &super::Loaded, n_ctx: usize) {
    let model: &Model = &loaded.model;
    crate::say!(
        "sluice: model {} ({}), context {n_ctx} tokens (trained {}), chat: {}",
        cfg.model.display(),
        model.description(),
        loaded.n_ctx_train,
        loaded.prompter.template_source().describe()
    );
    match &loaded.grammars {
        Ok(_) => crate::say!(
            "sluice: structured output (llguidance) over {} tokens, ready in {} ms",
            model.n_vocab(),
            loaded.grammars_ms
        ),
        Err(e) => crate::say!("sluice: no structured output for this model: {e}"),
    }
    let pooling: Option<Pooling> = loaded.pooling;
    match pooling {
        Some(p) => crate::say!(
            "sluice: /v1/embeddings: {} pooling ({}), {} floats a vector",
            p.name(),
            loaded.pooling_source,
            model.n_embd()
        ),
        None => crate::say!("sluice: /v1/embeddings off: {}", loaded.pooling_source),
    }
}

/// Compute threads, sequences, the step budget (and llama.cpp's pass size),
/// the HTTP front's sizes.
pub(super) fn threads(cfg: &Config, front: &super::FrontSize, n_ubatch: usize) {
    let step = match cfg.step_tokens {
        Some(n) => format!("step budget {n} tokens (--step-tokens)"),
        None => format!(
            "step budget derived from a {} ms inter-token target (up to {} tokens; a short prompt whole while the streams are ahead of that pace, pausing them up to {} ms)",
            cfg.itl_target.as_millis(),
            cfg.n_batch(),
            cfg.itl_max.as_millis()
        ),
    };
    let step = format!("{step}, computed in passes of at most {n_ubatch} tokens");
    crate::say!(
        "sluice: {} compute threads pinned to CPUs {:?}; {} parallel sequences; {step}; {} HTTP handlers, at most {} connections, {} requests waiting for a handler",
        cfg.cpus.len(),
        cfg.cpus,
        cfg.parallel,
        front.http_threads,
        front.max_connections,
        front.http_queue_depth
    );
}
