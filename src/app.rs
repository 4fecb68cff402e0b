//! Start-up: parse the command line, load the model, wire the stages together.

use crate::admission::{Admission, Rates};
use crate::calibration_cache::Kept;
use crate::config::{Cli, Command, Config};
use crate::engine::calibration::Calibration;
use crate::engine::cost::CostModel;
use crate::engine::prefix::PrefixCache;
use crate::engine::{self, EngineConfig};
use crate::ffi::{self, Context, ContextParams, FlashAttn, KvLayout, KvType};
use crate::http::prompt::Prompter;
use crate::http::{self, AppState};
use crate::metrics::Metrics;
use crate::notify::Notifier;
use crate::priority::Class;
use crate::ratelimit::RateLimiter;
use crate::startup::{
    attention_candidates, measure_attention, staggered_cells, start_up_calibration,
};
use argh::FromArgs;
use crossbeam_channel::bounded;
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use std::time::{SystemTime, UNIX_EPOCH};

/// KV cells when neither `--ctx` nor the model says otherwise.
const CTX_TOKENS_DEFAULT_MAX: usize = 8192;

pub fn run() -> Result<(), String> {
    let args = crate::config::args_with_env(std::env::args().collect(), |k| std::env::var(k).ok())?;
    let strs: Vec<&str> = args.iter().map(String::as_str).collect();
    let cli = match Cli::from_args(&strs[..1], &strs[1..]) {
        Ok(cli) => cli,
        Err(early) => {
            return match early.status {
                Ok(()) => {
                    println!("{}", early.output);
                    Ok(())
                }
                Err(()) => Err(format!("{}Run 'sluice --help' for more.", early.output)),
            };
        }
    };
    if cli.version {
        print_version();
        return Ok(());
    }
    match cli.command {
        Some(Command::Serve(args)) => serve(Config::from_args(args)?),
        Some(Command::Calibrate(args)) => crate::calibrate::run(args),
        None => Err("no command given; try 'sluice serve' or 'sluice --help'".into()),
    }
}

fn print_version() {
    ffi::backend_init(false);
    println!("sluice {}", env!("CARGO_PKG_VERSION"));
    println!("commit: {}", env!("SLUICE_GIT_COMMIT"));
    println!("built for: target-cpu={}", env!("SLUICE_TARGET_CPU"));
    println!("target features: {}", env!("SLUICE_TARGET_FEATURES"));
    println!("llama.cpp: {}", ffi::system_info());
}

/// Allocations from this size up are the kernel's pages, returned on free
/// (prefix cache entries are ~23 KB a token).
const LARGE_BLOCK_BYTES: usize = 128 * 1024;

fn serve(cfg: Config) -> Result<(), String> {
    crate::log::set_json(cfg.log_format == crate::config::LogFormat::Json);
    ffi::set_current_thread_name("sluice-main");
    // Before any other thread starts, so that all of them inherit the disposition.
    let signals = ffi::catch_stop_signals();
    let notifier = Notifier::from_env();
    ffi::backend_init(cfg.verbose);
    let nofile = ffi::raise_nofile_limit();
    ffi::return_large_blocks_to_the_kernel(LARGE_BLOCK_BYTES);
    notifier.notify(&format!("STATUS=loading {}", cfg.model.display()));
    let model = Arc::new(engine::load_model(&cfg.model, cfg.mmap)?);
    let n_ctx_train = model.n_ctx_train() as usize;
    let n_ctx = cfg.ctx_tokens.unwrap_or_else(|| match n_ctx_train {
        0 => CTX_TOKENS_DEFAULT_MAX,
        n => n.min(CTX_TOKENS_DEFAULT_MAX),
    });
    let prompter = Prompter::new(Arc::clone(&model), cfg.chat_template_file.as_deref())?;
    // llguidance's view of the vocabulary, for structured output.
    let grammars_started = std::time::Instant::now();
    let grammars = crate::grammar::Grammars::new(&model).map(Arc::new);
    let grammars_ms = grammars_started.elapsed().as_millis();
    let (pooling, pooling_source) = embedding_pooling(&model, cfg.pooling);
    let metrics = Arc::new(Metrics::default());

    // The engine thread creates the context: ggml pins the creating thread as its
    // worker 0, and the workers it starts inherit the name the thread has then.
    // It calibrates, reports, and waits for its queue, which is sized from that.
    type Ready = Result<Started, String>;
    let (ready_tx, ready_rx) = bounded::<Ready>(1);
    let (queue_tx, queue_rx) = bounded::<engine::Wiring>(1);
    let engine_cfg = EngineConfig {
        parallel: cfg.parallel,
        n_ctx,
        n_batch: cfg.n_batch(),
        step_tokens: cfg.step_tokens,
        itl_target: cfg.itl_target,
        queue_wait: Class::ALL.map(|c| cfg.queue_wait(c)),
        stall_timeout: cfg.stall_timeout,
        cpus: cfg.cpus.clone(),
        poll: cfg.poll,
        shed: Class::ALL.map(|c| cfg.shed(c)),
        shed_late: cfg.shed_late,
        batch_slots: cfg.batch_slots(),
        batch_kv_cells: cfg.batch_kv_cells(n_ctx),
        batch_every: cfg.batch_every,
        save_s_per_run: None,
        kv_layout: cfg.kv_layout,
    };
    let calibrate = cfg.rates.is_none() || cfg.calibrate_only;
    let (flash_attn, kv_type) = (cfg.flash_attn, cfg.kv_type);
    let kept = Kept::look_up(&cfg, n_ctx);
    let (cached_pairing, cached_calibration) = match kept.as_ref().and_then(|k| k.entry.as_ref()) {
        Some(e) => (
            e.pairing().map(|p| (p, e.attention_measured)),
            e.calibration().filter(|_| calibrate),
        ),
        None => (None, None),
    };
    let measure_now = cfg.calibrate_only;
    let engine_thread = {
        let model = Arc::clone(&model);
        let metrics = Arc::clone(&metrics);
        std::thread::Builder::new()
            .name("sluice-engine".into())
            .spawn(move || {
                ffi::set_current_thread_name("sluice-ggml");
                let per_seq = engine_cfg.kv_layout == KvLayout::PerSequence;
                let mut params = ContextParams {
                    // Per sequence, each stream holds --ctx cells, so that one
                    // request may use them all; admission still reserves at
                    // most --ctx in all (see ARCHITECTURE.md, memory).
                    n_ctx: if per_seq {
                        (staggered_cells(engine_cfg.n_ctx) * engine_cfg.parallel) as u32
                    } else {
                        staggered_cells(engine_cfg.n_ctx) as u32
                    },
                    kv_layout: engine_cfg.kv_layout,
                    n_batch: engine_cfg.n_batch as u32,
                    // Unified: one sequence id past the slots' for parked cells.
                    n_seq_max: engine_cfg.parallel as u32 + u32::from(!per_seq),
                    cpus: engine_cfg.cpus.clone(),
                    poll: engine_cfg.poll,
                    flash_attn: FlashAttn::Off,
                    kv_type: KvType::F16,
                };
                let candidates = attention_candidates(flash_attn, kv_type);
                let (pairing, measured) = match (&candidates[..], cached_pairing) {
                    ([only], _) => (*only, false),
                    _ if measure_now => (
                        measure_attention(&model, &params, engine_cfg.parallel, &candidates),
                        true,
                    ),
                    (_, Some(kept)) => kept,
                    _ => (candidates[0], false),
                };
                (params.flash_attn, params.kv_type) = pairing;
                let ctx = Context::new(Arc::clone(&model), &params);
                ffi::set_current_thread_name("sluice-engine");
                let mut ctx = match ctx {
                    Ok(ctx) => ctx,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let calibration = if let Some(c) = cached_calibration {
                    Some(c)
                } else if calibrate {
                    match start_up_calibration(&model, &mut ctx, &engine_cfg) {
                        Ok(c) => Some(c),
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    }
                } else {
                    None
                };
                // What one request may use: the cells admission reserves in
                // all (llama.cpp's are rounded up; `staggered_cells`).
                let n_ctx = engine_cfg.n_ctx.min(match engine_cfg.kv_layout {
                    KvLayout::Unified => ctx.n_ctx(),
                    KvLayout::PerSequence => ctx.n_ctx_seq(),
                });
                let started = Started {
                    n_ctx,
                    calibration,
                    engine_stop: ctx.abort_handle(),
                    pairing,
                    measured,
                };
                let _ = ready_tx.send(Ok(started));
                let engine_cfg = EngineConfig {
                    save_s_per_run: calibration.and_then(|c| c.save_s_per_run),
                    ..engine_cfg
                };
                if let Ok(wiring) = queue_rx.recv() {
                    engine::run(model, ctx, engine_cfg, metrics, wiring);
                }
            })
            .map_err(|e| format!("cannot start the engine thread: {e}"))?
    };
    notifier.notify(match (cached_calibration.is_some(), calibrate) {
        (true, _) => "STATUS=starting: rates from the calibration cache",
        (false, true) => "STATUS=calibrating: prefill and decode rates",
        (false, false) => "STATUS=starting (rates from --mu-prefill and --mu-decode)",
    });
    let Started {
        n_ctx,
        calibration,
        engine_stop,
        pairing,
        measured,
    } = ready_rx
        .recv()
        .map_err(|_| "the engine thread died while starting".to_string())??;
    let from_cache = cached_calibration.is_some() && calibration == cached_calibration;
    let kept = kept.map(|k| k.report(pairing, measured, calibration.as_ref(), from_cache));
    if cfg.calibrate_only {
        if let Some(c) = calibration {
            crate::say!(
                "sluice: calibrate-only: prefill {:.0} tok/s; decode {:.1} tok/s at batch 1, {:.1} tok/s at batch {}; done",
                c.prefill_tok_s, c.decode_tok_s_batch_1, c.decode_tok_s_parallel, c.parallel
            );
        }
        return Ok(());
    }

    let (rates, cost) = match (cfg.rates, calibration) {
        (Some(r), _) if cfg.rates_fixed => (r, CostModel::from_rates(r, cfg.parallel).frozen()),
        (Some(r), _) => (r, CostModel::from_rates(r, cfg.parallel)),
        (None, Some(c)) => {
            log_calibration(&cfg, &c, from_cache);
            let rates = Rates {
                prefill_tok_s: c.prefill_tok_s,
                decode_tok_s: c.decode_tok_s_parallel,
            };
            let cost = CostModel::from_calibration(
                c.prefill_tok_s,
                c.decode_tok_s_batch_1,
                c.decode_tok_s_parallel,
                c.parallel,
            );
            (rates, cost)
        }
        (None, None) => unreachable!("the engine calibrates when no rates are given"),
    };
    let policies = Class::ALL.map(|c| cfg.policy(c));
    let http_threads = cfg.http_threads()?;
    let max_connections = cfg.max_connections(http_threads, nofile)?;
    let http_queue_depth = cfg
        .http_queue_depth
        .unwrap_or(http_threads * crate::config::HTTP_QUEUE_PER_HANDLER);
    let (admission, jobs, gauge) = Admission::new(
        cfg.parallel,
        cfg.batch_slots(),
        rates,
        policies,
        Arc::clone(&metrics),
    );
    let (_, [bounds, batch_bounds]) = gauge.snapshot();
    crate::say!(
        "sluice: admission: mu = {:.3} requests/s (typical request {} + {} tokens until completed requests say otherwise), W_max = {} ms, L_max = {}{}; queued prompt tokens <= {}{} (mu_prefill {:.0} tok/s x W_max); {}",
        bounds.mu_req,
        cfg.typical.prompt_tokens,
        cfg.typical.max_tokens,
        cfg.queue_wait.as_millis(),
        bounds.queue_depth_max,
        if cfg.queue_depth.is_some() { " (set by --queue-depth)" } else { "" },
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
    let prefix = PrefixCache::new(cfg.prefix_cache_mb << 20);
    let prefix_index = prefix.index();
    match cfg.prefix_cache_mb {
        0 => crate::say!("sluice: prefix cache: off (--prefix-cache-mb 0)"),
        n => crate::say!(
            "sluice: prefix cache: finished sequences' KV state kept in up to {n} MiB of memory (least recently used evicted first) for requests that start with the same tokens"
        ),
    }
    queue_tx
        .send(engine::Wiring {
            jobs,
            queue: Arc::clone(&gauge),
            cost,
            prefix,
        })
        .map_err(|_| "the engine thread died while starting".to_string())?;

    let addr = format!("{}:{}", cfg.host, cfg.port);
    let listener = TcpListener::bind(&addr).map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    let template = prompter.template_source().describe();
    crate::say!(
        "sluice: model {} ({}), context {n_ctx} tokens (trained {n_ctx_train}), chat: {template}",
        cfg.model.display(),
        model.description()
    );
    match &grammars {
        Ok(_) => crate::say!(
            "sluice: structured output (llguidance) over {} tokens, ready in {grammars_ms} ms",
            model.n_vocab()
        ),
        Err(e) => crate::say!("sluice: no structured output for this model: {e}"),
    }
    match pooling {
        Some(p) => crate::say!(
            "sluice: /v1/embeddings: {} pooling ({pooling_source}), {} floats a vector",
            p.name(),
            model.n_embd()
        ),
        None => crate::say!("sluice: /v1/embeddings off: {pooling_source}"),
    }
    let step = match cfg.step_tokens {
        Some(n) => format!("step budget {n} tokens (--step-tokens)"),
        None => format!(
            "step budget derived from a {} ms inter-token target (up to {} tokens)",
            cfg.itl_target.as_millis(),
            cfg.n_batch()
        ),
    };
    crate::say!(
        "sluice: {} compute threads pinned to CPUs {:?}; {} parallel sequences; {step}; {} HTTP handlers, at most {max_connections} connections, {http_queue_depth} requests waiting for a handler",
        cfg.cpus.len(),
        cfg.cpus,
        cfg.parallel,
        http_threads
    );
    let status = format!(
        "STATUS=serving {} on {local}; L_max {}, queued prompt tokens <= {}",
        cfg.model_name, bounds.queue_depth_max, bounds.queued_tokens_max
    );
    let drain_timeout = cfg.drain_timeout;
    let drain_notice = cfg.drain_notice;
    let state = Arc::new(AppState {
        draining: AtomicBool::new(false),
        stopping: AtomicBool::new(false),
        in_flight: AtomicUsize::new(0),
        prompter,
        pooling,
        pooling_source,
        n_embd: model.n_embd(),
        grammars,
        prefix: prefix_index,
        admission,
        queue: gauge,
        metrics,
        n_ctx,
        seq_tokens_max: match n_ctx_train {
            0 => n_ctx,
            t => n_ctx.min(t),
        },
        batch_seq_tokens_max: {
            let seq_max = match n_ctx_train {
                0 => n_ctx,
                t => n_ctx.min(t),
            };
            seq_max.min(cfg.batch_kv_cells(n_ctx))
        },
        limiter: RateLimiter::new(cfg.client_table_max),
        retries: Default::default(),
        tarpit: http::Tarpit::start()?,
        http_threads,
        max_connections,
        http_queue_depth,
        handlers_busy: AtomicUsize::new(0),
        handler_panics: AtomicU64::new(0),
        test_hooks: http::TestHooks::from_env(),
        front: std::sync::OnceLock::new(),
        next_id: AtomicU64::new(1),
        started_unix_s: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        cfg,
    });
    let front = http::start(Arc::clone(&state), listener)?;
    crate::say!("sluice: listening on http://{local}");
    notifier.notify(&format!("READY=1\n{status}"));

    // Until a stop signal: watch the engine, and pet systemd's watchdog only
    // while the engine loop turns (a busy engine turns; a wedged one does not).
    let mut petted = Instant::now();
    let mut accept_errors = AcceptErrors::default();
    while signals.load(Ordering::SeqCst) == 0 {
        std::thread::sleep(MAIN_TICK);
        if engine_thread.is_finished() {
            return Err("the engine stopped".into());
        }
        if !front.is_accepting() {
            return Err("the HTTP server stopped accepting connections".into());
        }
        accept_errors.report(front.accept_errors());
        if let Some(w) = notifier.watchdog {
            if petted.elapsed() >= w / 2 && state.metrics.heartbeat_age() < w / 2 {
                notifier.notify("WATCHDOG=1");
                petted = Instant::now();
            }
        }
    }
    drain(&state, &notifier, &engine_stop, drain_notice, drain_timeout);
    // The rates the engine refined from its steps are the next start's.
    if let (Some(kept), Some(c)) = (kept, calibration) {
        let (rates, _) = state.queue.snapshot();
        kept.keep_refined(&c, rates.prefill_tok_s, rates.decode_tok_s);
    }
    Ok(())
}

/// What the rates the engine starts from are, and where they came from.
fn log_calibration(cfg: &Config, c: &Calibration, from_cache: bool) {
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

/// What the engine thread hands back once its context is made and measured.
struct Started {
    n_ctx: usize,
    calibration: Option<Calibration>,
    engine_stop: Arc<ffi::AbortWatch>,
    pairing: (FlashAttn, KvType),
    /// The pairing was chosen by timing the candidates (now or before).
    measured: bool,
}

/// How often the main thread looks at signals, the engine and the drain.
const MAIN_TICK: Duration = Duration::from_millis(20);
/// At most one log line per this long about failed accepts (the accept loop
/// retries every 50 ms while, say, descriptors are out).
const ACCEPT_ERRORS_LOG_EVERY: Duration = Duration::from_secs(10);

/// Says in the log when accepting connections fails (and is retried), at
/// most once per `ACCEPT_ERRORS_LOG_EVERY`, with how many failed since.
#[derive(Default)]
struct AcceptErrors {
    reported: u64,
    at: Option<Instant>,
}

impl AcceptErrors {
    fn report(&mut self, (count, last): (u64, std::io::Error)) {
        if count == self.reported
            || self
                .at
                .is_some_and(|t| t.elapsed() < ACCEPT_ERRORS_LOG_EVERY)
        {
            return;
        }
        crate::say!(
            "sluice: accepting connections failed {} times (retried every 50 ms; waiting connections stay in the listen queue): {last}",
            count - self.reported
        );
        self.reported = count;
        self.at = Some(Instant::now());
    }
}
/// After the drain's deadline, how long the handlers get to write the cancelled
/// requests' last events.
const DRAIN_GRACE: Duration = Duration::from_secs(2);

/// Graceful drain: not ready at once; for `notice`, new requests are still
/// served (a load balancer's health checks need that long to take this
/// replica out of rotation: what it sends meanwhile is not refused); then no
/// new requests (503 + Retry-After), and the accepted ones (queued and
/// running) finish until `timeout`; then the engine cancels the rest (each
/// client gets an error event and a clean end), and sluice exits.
fn drain(
    state: &AppState,
    notifier: &Notifier,
    engine_stop: &ffi::AbortWatch,
    notice: Duration,
    timeout: Duration,
) {
    state.stopping.store(true, Ordering::SeqCst);
    notifier.notify("STOPPING=1\nSTATUS=draining");
    if !notice.is_zero() {
        crate::say!(
            "sluice: stopping: not ready; new requests are still served for {} ms (--drain-notice-ms)",
            notice.as_millis()
        );
        std::thread::sleep(notice);
    }
    state.draining.store(true, Ordering::SeqCst);
    let n = state.in_flight.load(Ordering::SeqCst);
    crate::say!(
        "sluice: draining: {n} requests in flight may finish within {} ms; new ones get 503 (a second signal exits at once)",
        timeout.as_millis()
    );
    let deadline = Instant::now() + timeout;
    while state.in_flight.load(Ordering::SeqCst) > 0 {
        if Instant::now() >= deadline && !engine_stop.is_shutdown() {
            crate::say!(
                "sluice: drain timeout: cancelling {} requests",
                state.in_flight.load(Ordering::SeqCst)
            );
            engine_stop.shutdown();
        }
        if Instant::now() >= deadline + DRAIN_GRACE {
            break;
        }
        std::thread::sleep(MAIN_TICK);
    }
    crate::say!("sluice: drained; exiting");
}

/// How `/v1/embeddings` pools (`--pooling`, by default the GGUF's
/// `{arch}.pooling_type`), and where that came from or why there is none.
fn embedding_pooling(
    model: &ffi::Model,
    setting: crate::config::PoolingSetting,
) -> (Option<crate::embed::Pooling>, String) {
    use crate::config::PoolingSetting;
    use crate::embed::Pooling;
    match setting {
        PoolingSetting::Fixed(p) => (Some(p), "--pooling".into()),
        PoolingSetting::None => (None, "--pooling none".into()),
        PoolingSetting::Gguf => {
            let arch = model.meta("general.architecture").unwrap_or_default();
            let key = format!("{arch}.pooling_type");
            match model.meta(&key) {
                Some(v) => match Pooling::from_gguf(&v) {
                    Some(p) => (Some(p), format!("the GGUF's {key}")),
                    None => (
                        None,
                        format!("the GGUF's {key} is {v}, which pools no embedding (start sluice with --pooling mean, cls or last to have them anyway)"),
                    ),
                },
                None => (
                    None,
                    format!("the GGUF names no {key} (a generative model); start sluice with --pooling mean, cls or last to have embeddings"),
                ),
            }
        }
    }
}
