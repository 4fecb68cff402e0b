//! `/metrics` of the counters `Metrics` keeps: Prometheus text exposition
//! format, written by hand (declaration, help and value of each metric).

use super::*;

const QUANTILES: [f64; 4] = [0.5, 0.9, 0.99, 1.0];

fn counter(out: &mut String, name: &str, help: &str, v: u64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
    );
}

fn gauge(out: &mut String, name: &str, help: &str, v: f64) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
}

fn l(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

fn g(a: &AtomicUsize) -> f64 {
    a.load(Ordering::Relaxed) as f64
}

impl Metrics {
    /// Prometheus text exposition format.
    pub fn render(
        &self,
        static_gauges: &[(&str, &str, f64)],
        class_gauges: &[(&str, &str, [f64; Class::COUNT])],
        limiter: RateLimitGauges,
        engine: EngineNow,
    ) -> String {
        let mut out = String::new();
        self.render_requests(&mut out);
        self.render_prefill_and_cache(&mut out);
        self.render_passes(&mut out);
        self.render_engine(&mut out, engine);
        self.render_classes(&mut out, static_gauges, class_gauges, limiter);
        self.render_latencies(&mut out);
        out
    }

    /// Admissions, refusals, completions and cancellations.
    fn render_requests(&self, out: &mut String) {
        counter(
            out,
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
             sluice_requests_rejected_total{{reason=\"forbidden\"}} {}\n\
             sluice_requests_rejected_total{{reason=\"slo_ttft\"}} {}",
            l(&self.rejected_queue_full),
            l(&self.rejected_token_budget),
            l(&self.invalid),
            self.classes.iter().map(|c| l(&c.rate_limited)).sum::<u64>(),
            l(&self.unauthorized),
            l(&self.forbidden),
            l(&self.rejected_slo_ttft)
        );
        counter(
            out,
            "sluice_requests_rejected_before_parsing_total",
            "Queue-full and token-budget refusals decided from the queue's state before the body was read or tokenized.",
            l(&self.rejected_before_parsing),
        );
        counter(
            out,
            "sluice_admission_reports_lost_total",
            "Reports of the engine's to admission dropped because their channel was full (sized so that this stays 0).",
            l(&self.admission_reports_lost),
        );
        counter(
            out,
            "sluice_requests_retried_early_total",
            "Requests from clients that came back before their Retry-After: refused with a longer wait, held back before the answer.",
            l(&self.retried_early),
        );
        counter(
            out,
            "sluice_prompts_tokenized_total",
            "Request prompts templated and tokenized.",
            l(&self.prompts_tokenized),
        );
        counter(
            out,
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
            out,
            "sluice_tokens_after_cancel_total",
            "Tokens sampled for requests already cancelled (at most one per running sequence per step).",
            l(&self.tokens_after_cancel),
        );
    }

    /// Prefill, the prefix cache, cancellation lag and the KV pages.
    fn render_prefill_and_cache(&self, out: &mut String) {
        counter(
            out,
            "sluice_prefill_tokens_total",
            "Prompt tokens prefilled, chunk by chunk (cancelled prompts included).",
            l(&self.prefill_tokens),
        );
        for (name, help, values) in [
            (
                "sluice_attention_tokens_total",
                "Tokens computed in the main context's generation passes (not the short requests' context, --short-cells: these counts choose the main context's attention pairing at the next start), by kind: prompt chunks' or decode tokens.",
                &self.attention_tokens,
            ),
            (
                "sluice_attention_depth_cells_total",
                "The cells before each of those tokens in its sequence, summed (over the tokens: the mean depth attention read).",
                &self.attention_depth,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for (kind, i) in [("prefill", ATTENTION_PREFILL), ("decode", ATTENTION_DECODE)] {
                let _ = writeln!(out, "{name}{{kind=\"{kind}\"}} {}", l(&values[i]));
            }
        }
        counter(
            out,
            "sluice_prefill_tokens_abandoned_total",
            "Prompt tokens never prefilled because their request was cancelled.",
            l(&self.prefill_tokens_abandoned),
        );
        counter(
            out,
            "sluice_prefix_cache_tokens_reused_total",
            "Prompt tokens taken from the prefix cache, or from the first choice of the same request, instead of prefilled.",
            l(&self.prefix_tokens_reused),
        );
        counter(
            out,
            "sluice_prefix_cache_tokens_evicted_total",
            "Tokens of prefix cache entries evicted for room (least recently used first).",
            l(&self.prefix_tokens_evicted),
        );
        counter(
            out,
            "sluice_prefix_cache_too_large_total",
            "Finished sequences not kept because their KV state alone is larger than --prefix-cache-mb (never copied out).",
            l(&self.prefix_too_large),
        );
        counter(
            out,
            "sluice_short_context_requests_total",
            "Requests started in the second context (flash attention on, f16 cache) for requests whose prompt and max_tokens fit --short-cells; the others run in the main context.",
            l(&self.short_context_starts),
        );
        gauge(
            out,
            "sluice_prefix_cache_entries",
            "Finished sequences whose KV state is kept for reuse.",
            self.prefix_entries.load(Ordering::Relaxed) as f64,
        );
        gauge(
            out,
            "sluice_prefix_cache_bytes",
            "Bytes of KV state the prefix cache entries hold, in host memory (at most --prefix-cache-mb).",
            self.prefix_bytes.load(Ordering::Relaxed) as f64,
        );
        gauge(
            out,
            "sluice_prefix_cache_parked_tokens",
            "Tokens of a finished sequence whose cells stay in the KV cache until no stream waits, then are saved (a running request may share them meanwhile).",
            self.prefix_parked_tokens.load(Ordering::Relaxed) as f64,
        );
        counter(
            out,
            "sluice_cancel_lag_steps_total",
            "Engine steps begun between a cancel and the KV cells being freed, summed over cancellations.",
            l(&self.cancel_lag_steps),
        );
        gauge(
            out,
            "sluice_cancel_lag_steps_max",
            "Most engine steps begun between one cancel and its KV cells being freed.",
            l(&self.cancel_lag_steps_max) as f64,
        );
        counter(
            out,
            "sluice_kv_pages_released_total",
            "Times the engine, idle with no KV cells held, gave the KV cache's pages back to the kernel.",
            l(&self.kv_pages_released),
        );
    }

    /// The engine's llama_decode passes: aborted, made, graphs reused.
    fn render_passes(&self, out: &mut String) {
        counter(
            out,
            "sluice_decodes_aborted_total",
            "Engine steps stopped mid-pass because every sequence in them was cancelled.",
            l(&self.decodes_aborted),
        );
        counter(
            out,
            "sluice_passes_total",
            "llama_decode calls: per step, one for its decode tokens (with any one-token prompt chunk no deeper than they), one for its prompt chunks (per-sequence KV), one for embedding inputs.",
            l(&self.passes),
        );
        counter(
            out,
            "sluice_passes_split_total",
            "Passes over the weights beyond one per llama_decode call, because its sequences' ids were not consecutive (per-sequence KV: llama.cpp makes one micro-batch per run of consecutive ids; a request takes the free slot that keeps them consecutive).",
            l(&self.passes_split),
        );
        counter(
            out,
            "sluice_pass_fillers_total",
            "Tokens put in the sequence ids missing among a pass's (a stream that ended in a middle slot), so that llama.cpp makes one pass over the weights, not one per run of consecutive ids; each cell is freed after its pass and nothing reads its output.",
            l(&self.pass_fillers),
        );
        counter(
            out,
            "sluice_graphs_reused_total",
            "Graph computations of the llama_decode passes (one per micro-batch) that reused the previous one's compute graph instead of building it again (same tokens, sequences, outputs and attention span).",
            l(&self.graphs_reused),
        );
    }

    /// Failures, drops, shedding, tokens and the engine's steps and gauges.
    fn render_engine(&self, out: &mut String, engine: EngineNow) {
        counter(
            out,
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
            out,
            "sluice_shedding",
            "1 while the queue stands above its sojourn target and requests are shed.",
            f64::from(u8::from(self.shedding.load(Ordering::Relaxed))),
        );
        counter(
            out,
            "sluice_tokens_generated_total",
            "Tokens sampled.",
            l(&self.tokens_generated),
        );
        counter(
            out,
            "sluice_prompt_tokens_total",
            "Prompt tokens of requests whose first token was sampled (prefilled or taken from the prefix cache).",
            l(&self.prompt_tokens),
        );
        self.render_steps(out);
        gauge(
            out,
            "sluice_sequences_active",
            "Sequences in the engine.",
            engine.running as f64,
        );
        gauge(
            out,
            "sluice_sequences_paused",
            "Sequences paused because their reader is slow.",
            g(&self.paused_sequences),
        );
        gauge(
            out,
            "sluice_kv_cells_used",
            "KV cells holding tokens of running sequences.",
            g(&self.kv_cells_used),
        );
        gauge(
            out,
            "sluice_kv_cells_reserved",
            "KV cells reserved for admitted sequences (prompt + max_tokens).",
            engine.kv_cells_reserved as f64,
        );
    }

    /// The engine's steps: how many, their tokens, the kinds the planner
    /// made, the last budget.
    fn render_steps(&self, out: &mut String) {
        counter(
            out,
            "sluice_steps_total",
            "Engine steps: the tokens of one plan, in one to three llama_decode calls.",
            l(&self.steps),
        );
        counter(
            out,
            "sluice_step_tokens_total",
            "Tokens decoded across all steps.",
            l(&self.step_tokens),
        );
        counter(
            out,
            "sluice_steps_mixed_total",
            "Steps that carried decode tokens and a prefill chunk together.",
            l(&self.steps_mixed),
        );
        counter(
            out,
            "sluice_steps_whole_prompt_total",
            "Steps that took a short prompt whole beyond the ITL target, the streams being ahead of its pace (--itl-max-ms).",
            l(&self.steps_whole_prompt),
        );
        counter(
            out,
            "sluice_steps_ahead_chunk_total",
            "Steps that took one large chunk of a long prompt alone, the streams sending tokens decoded ahead meanwhile (--decode-ahead-ms).",
            l(&self.steps_ahead_chunk),
        );
        counter(
            out,
            "sluice_steps_overdue_first_total",
            "Steps whose prefill went first to a prompt that had held its slot past its class's W_max, not to a shorter one (every other step while one is overdue).",
            l(&self.steps_overdue_first),
        );
        gauge(
            out,
            "sluice_step_budget_tokens",
            "Token budget of the last step planned (derived from the ITL target, or --step-tokens).",
            g(&self.step_budget_tokens),
        );
    }

    /// The gauges the caller passes (static, per class, the rate limiter)
    /// and the per-class outcomes.
    fn render_classes(
        &self,
        out: &mut String,
        static_gauges: &[(&str, &str, f64)],
        class_gauges: &[(&str, &str, [f64; Class::COUNT])],
        limiter: RateLimitGauges,
    ) {
        for (name, help, v) in static_gauges {
            gauge(out, name, help, *v);
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
            out,
            "sluice_unauthorized_total",
            "Requests refused with 401: no API key, or an unknown one.",
            l(&self.unauthorized),
        );
        gauge(
            out,
            "sluice_rate_limit_clients",
            "Clients with a token bucket (bounded by --client-table-max).",
            limiter.clients as f64,
        );
        gauge(
            out,
            "sluice_rate_limit_clients_max",
            "Most token buckets kept (--client-table-max).",
            limiter.clients_max as f64,
        );
        gauge(
            out,
            "sluice_rate_limited_clients",
            "Clients refused by their token bucket in the last minute (a count; clients are not labels).",
            limiter.clients_limited as f64,
        );
        counter(
            out,
            "sluice_rate_limit_evictions_total",
            "Token buckets dropped to keep the table within its bound.",
            limiter.evictions,
        );
    }

    /// The latency distributions: histograms per class, histograms, summaries.
    fn render_latencies(&self, out: &mut String) {
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
            h.render(out, name, help);
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
            h.render(out, name, "");
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
            summary(out, name, help, h, 1e3);
        }
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
