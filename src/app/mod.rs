//! Start-up: parse the command line, load the model, start the engine
//! thread (`engine_thread`), size the queue and the front from what it
//! measured, wire the stages together and watch them until a stop; what it
//! says in the log on the way is `report`.

use crate::admission::{Admission, QueueGauge, Rates};
use crate::calibration_cache::Kept;
use crate::config::{Cli, Command, Config};
use crate::embed::Pooling;
use crate::engine;
use crate::engine::calibration::Calibration;
use crate::engine::cost::CostModel;
use crate::engine::prefix::PrefixCache;
use crate::engine::served::Served;
use crate::ffi::{self, Model};
use crate::grammar::Grammars;
use crate::http::prompt::Prompter;
use crate::http::{self, AppState};
use crate::metrics::Metrics;
use crate::notify::Notifier;
use crate::priority::Class;
use crate::ratelimit::RateLimiter;
use argh::FromArgs;
use engine_thread::{EngineThread, Plan};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use std::time::{SystemTime, UNIX_EPOCH};

mod engine_thread;
mod memory;
mod report;

/// KV cells when neither `--ctx` nor the model says otherwise.
const CTX_TOKENS_DEFAULT_MAX: usize = 8192;

pub fn run() -> Result<(), String> {
    // Before anything else: code built for instructions this CPU lacks may
    // fault anywhere after this point.
    let missing = crate::cpu::missing();
    if !missing.is_empty() {
        return Err(crate::cpu::refusal(&missing, env!("SLUICE_TARGET_CPU")));
    }
    let args = crate::config::args_with_env(std::env::args().collect(), |k| std::env::var(k).ok())?;
    let strs: Vec<&str> = args.iter().map(String::as_str).collect();
    let cli = match Cli::from_args(&strs[..1], &strs[1..]) {
        Ok(cli) => cli,
        Err(early) => {
            return match early.status {
                Ok(()) => {
                    print_out(&format!("{}\n", early.output));
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
    print_out(&format!(
        "sluice {}\ncommit: {}\nbuilt for: target-cpu={}\ntarget features: {}\nllama.cpp: {}\n",
        env!("CARGO_PKG_VERSION"),
        env!("SLUICE_GIT_COMMIT"),
        env!("SLUICE_TARGET_CPU"),
        env!("SLUICE_TARGET_FEATURES"),
        ffi::system_info()
    ));
}

/// Writes `text` to stdout; a reader that closed the pipe early (`sluice
/// --version | head -1`) took what it wanted, so a failed write is not an
/// error (`println!` panics on it).
fn print_out(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
}

/// Allocations from this size up are the kernel's pages, returned on free
/// (prefix cache entries are ~23 KB a token).
const LARGE_BLOCK_BYTES: usize = 128 * 1024;

/// What start-up loads before the engine starts: the model and what the
/// handlers need of it.
pub(super) struct Loaded {
    model: Arc<Model>,
    n_ctx_train: usize,
    /// The context asked for: `--ctx`, else the model's, at most 8,192.
    n_ctx: usize,
    prompter: Prompter,
    grammars: Result<Arc<Grammars>, String>,
    grammars_ms: u128,
    pooling: Option<Pooling>,
    pooling_source: String,
}

fn load(cfg: &Config, notifier: &Notifier) -> Result<Loaded, String> {
    notifier.notify(&format!("STATUS=loading {}", cfg.model.display()));
    let model = Arc::new(engine::load_model(&cfg.model, cfg.mmap)?);
    let n_ctx_train = model.n_ctx_train() as usize;
    let n_ctx = cfg.ctx_tokens.unwrap_or_else(|| match n_ctx_train {
        0 => CTX_TOKENS_DEFAULT_MAX,
        n => n.min(CTX_TOKENS_DEFAULT_MAX),
    });
    let prompter = Prompter::new(Arc::clone(&model), cfg.chat_template_file.as_deref())?;
    // llguidance's view of the vocabulary, for structured output.
    let grammars_started = Instant::now();
    let grammars = Grammars::new(&model).map(Arc::new);
    let grammars_ms = grammars_started.elapsed().as_millis();
    let (pooling, pooling_source) = embedding_pooling(&model, cfg.pooling);
    Ok(Loaded {
        model,
        n_ctx_train,
        n_ctx,
        prompter,
        grammars,
        grammars_ms,
        pooling,
        pooling_source,
    })
}

/// The HTTP front's sizes: handler threads, connections, waiting requests.
pub(super) struct FrontSize {
    http_threads: usize,
    max_connections: usize,
    http_queue_depth: usize,
}

impl FrontSize {
    fn of(cfg: &Config, nofile: u64) -> Result<FrontSize, String> {
        let http_threads = cfg.http_threads()?;
        Ok(FrontSize {
            http_threads,
            max_connections: cfg.max_connections(http_threads, nofile)?,
            http_queue_depth: cfg
                .http_queue_depth
                .unwrap_or(http_threads * crate::config::HTTP_QUEUE_PER_HANDLER),
        })
    }
}

fn serve(cfg: Config) -> Result<(), String> {
    let (signals, notifier, nofile) = set_up_process(&cfg);
    let loaded = load(&cfg, &notifier)?;
    let metrics = Arc::new(Metrics::default());
    let kept = Kept::look_up(&cfg, loaded.n_ctx);
    let plan = Plan::new(&cfg, loaded.n_ctx, kept.as_ref());
    let (cached_calibration, calibrate) = (plan.cached_calibration, plan.calibrate);
    let engine = EngineThread::spawn(&loaded.model, &metrics, plan)?;
    notifier.notify(match (cached_calibration.is_some(), calibrate) {
        (true, _) => "STATUS=starting: rates from the calibration cache",
        (false, true) => "STATUS=calibrating: prefill and decode rates",
        (false, false) => "STATUS=starting (rates from --mu-prefill and --mu-decode)",
    });
    let started = engine.started()?;
    let (n_ctx, calibration) = (started.n_ctx, started.calibration);
    let from_cache = cached_calibration.is_some() && calibration == cached_calibration;
    let kept = kept.map(|k| {
        k.report(
            started.pairing,
            started.measured,
            calibration.as_ref(),
            from_cache,
            &started.timings,
        )
    });
    if cfg.calibrate_only {
        report::calibrate_only(calibration);
        return Ok(());
    }
    let (rates, cost) = rates_and_cost(&cfg, calibration, from_cache);
    let front_size = FrontSize::of(&cfg, nofile)?;
    let serving = queues(&cfg, &engine, rates, cost, &metrics, n_ctx)?;
    let addr = format!("{}:{}", cfg.host, cfg.port);
    let listener = TcpListener::bind(&addr).map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    report::model(&cfg, &loaded, n_ctx);
    report::threads(&cfg, &front_size, started.n_ubatch);
    report::short_context(started.short, started.short_alone);
    let stream_cells = crate::startup::staggered_cells(loaded.n_ctx);
    let kv_cells = match cfg.kv_layout {
        ffi::KvLayout::PerSequence => stream_cells * cfg.parallel,
        ffi::KvLayout::Unified => stream_cells,
    };
    // The short requests' context's cells are f16, the widest type: the
    // bound counts every cell at that width then.
    let (kv_type, kv_cells) = match started.short {
        Some((_, stream)) => (ffi::KvType::F16, kv_cells + stream * cfg.parallel),
        None => (started.pairing.1, kv_cells),
    };
    let memory = memory::bound(&loaded.model, kv_type, kv_cells, cfg.prefix_cache_mb);
    for line in memory.lines() {
        crate::say!("{line}");
    }
    let (_, [bounds, _]) = serving.gauge.snapshot();
    let status = format!(
        "STATUS=serving {} on {local}; L_max {}, queued prompt tokens <= {}",
        cfg.model_name, bounds.queue_depth_max, bounds.queued_tokens_max
    );
    let (drain_notice, drain_timeout) = (cfg.drain_notice, cfg.drain_timeout);
    let (batches, batch_wake) = batch_store(&cfg)?.unzip();
    let state = Arc::new(app_state(cfg, loaded, serving, front_size, batches)?);
    let front = http::start(Arc::clone(&state), listener)?;
    if let (Some(wake), Some(b)) = (batch_wake, &state.cfg.batch) {
        http::batch_runner::start(Arc::clone(&state), wake, b.concurrency)?;
    }
    if let Some(port) = state.cfg.agent_port {
        let addr = format!("{}:{port}", state.cfg.host);
        let agent = TcpListener::bind(&addr)
            .map_err(|e| format!("cannot listen for the agent check on {addr}: {e}"))?;
        let local = agent.local_addr().map_err(|e| e.to_string())?;
        http::agent::start(Arc::clone(&state), agent)?;
        crate::say!("sluice: HAProxy agent check on {local}");
    }
    crate::say!("sluice: listening on http://{local}");
    notifier.notify(&format!("READY=1\n{status}"));
    supervise(signals, &engine.handle, &front, &notifier, &state)?;
    drain(
        &state,
        &notifier,
        &started.engine_stop,
        drain_notice,
        drain_timeout,
    );
    // The rates the engine refined from its steps are the next start's.
    if let (Some(kept), Some(c)) = (kept, calibration) {
        let (rates, _) = state.queue.snapshot();
        let [prefill, decode] = metrics.attention_counts();
        kept.keep_refined(
            &c,
            rates.prefill_tok_s,
            rates.decode_tok_s,
            Served::from_counts(prefill, decode),
        );
    }
    Ok(())
}

/// The process, before any other thread starts (so that all of them
/// inherit the signal disposition and the thread name's prefix): the log's
/// format, stop signals, systemd's notify socket, llama.cpp's backend, the
/// open-files limit, large allocations given back to the kernel.
fn set_up_process(cfg: &Config) -> (&'static AtomicU32, Notifier, u64) {
    crate::log::set_json(cfg.log_format == crate::config::LogFormat::Json);
    ffi::set_current_thread_name("sluice-main");
    let signals = ffi::catch_stop_signals();
    let notifier = Notifier::from_env();
    ffi::backend_init(cfg.verbose);
    let nofile = ffi::raise_nofile_limit();
    ffi::return_large_blocks_to_the_kernel(LARGE_BLOCK_BYTES);
    (signals, notifier, nofile)
}

/// Admission's queues and bounds from the rates, the prefix cache, and the
/// engine wired to both.
fn queues(
    cfg: &Config,
    engine: &EngineThread,
    rates: Rates,
    cost: CostModel,
    metrics: &Arc<Metrics>,
    n_ctx: usize,
) -> Result<Serving, String> {
    let policies = Class::ALL.map(|c| cfg.policy(c));
    let (admission, jobs, gauge, reporter) = Admission::new(
        cfg.parallel,
        cfg.batch_slots(),
        rates,
        policies,
        Arc::clone(metrics),
    );
    report::admission(cfg, &gauge, rates, n_ctx);
    report::policies(cfg);
    let prefix = PrefixCache::new(cfg.prefix_cache_mb << 20);
    engine.wire(engine::Wiring {
        jobs,
        queue: reporter,
        cost,
        prefix,
    })?;
    Ok(Serving {
        admission,
        gauge,
        metrics: Arc::clone(metrics),
        n_ctx,
    })
}

/// The rates admission starts from and the engine's cost model: given by
/// flags (frozen with `--mu-fixed`), or calibrated.
fn rates_and_cost(
    cfg: &Config,
    calibration: Option<Calibration>,
    from_cache: bool,
) -> (Rates, CostModel) {
    match (cfg.rates, calibration) {
        (Some(r), _) if cfg.rates_fixed => (r, CostModel::from_rates(r, cfg.parallel).frozen()),
        (Some(r), _) => (r, CostModel::from_rates(r, cfg.parallel)),
        (None, Some(c)) => {
            report::calibration(cfg, &c, from_cache);
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
    }
}

/// What the handlers share with the engine side.
struct Serving {
    admission: Admission,
    gauge: Arc<QueueGauge>,
    metrics: Arc<Metrics>,
    /// The cells one request may use (the engine's, from its context).
    n_ctx: usize,
}

/// The Batch API's database, opened (or made) under `--data-dir`, and the
/// channel that wakes its runner; `None` with `--data-dir off`.
fn batch_store(
    cfg: &Config,
) -> Result<Option<(http::batches::BatchApi, crossbeam_channel::Receiver<()>)>, String> {
    let Some(b) = &cfg.batch else {
        crate::say!("sluice: batch API: off (--data-dir off, or no home directory)");
        return Ok(None);
    };
    let store = crate::batch::Store::open(&b.dir, b.limits)?;
    let held = store.stored();
    crate::say!(
        "sluice: batch API: {} ({} batches not ended, {} lines pending; {} lines at once)",
        store.path().display(),
        held.batches[..2].iter().sum::<u64>() + held.batches[4],
        held.lines_pending,
        b.concurrency
    );
    let (wake, rx) = crossbeam_channel::bounded(1);
    let store = Arc::new(store);
    let api = http::batches::BatchApi {
        store,
        wake,
        preemption: Default::default(),
    };
    Ok(Some((api, rx)))
}

/// The state every handler reads.
fn app_state(
    cfg: Config,
    loaded: Loaded,
    serving: Serving,
    front: FrontSize,
    batches: Option<http::batches::BatchApi>,
) -> Result<AppState, String> {
    let n_ctx = serving.n_ctx;
    let seq_tokens_max = match loaded.n_ctx_train {
        0 => n_ctx,
        t => n_ctx.min(t),
    };
    Ok(AppState {
        draining: AtomicBool::new(false),
        stopping: AtomicBool::new(false),
        in_flight: AtomicUsize::new(0),
        n_embd: loaded.model.n_embd(),
        prompter: loaded.prompter,
        pooling: loaded.pooling,
        pooling_source: loaded.pooling_source,
        grammars: loaded.grammars,
        admission: serving.admission,
        queue: serving.gauge,
        metrics: serving.metrics,
        n_ctx,
        seq_tokens_max,
        batch_seq_tokens_max: seq_tokens_max.min(cfg.batch_kv_cells(n_ctx)),
        limiter: RateLimiter::new(cfg.client_table_max),
        batches,
        retries: Default::default(),
        tarpit: http::Tarpit::start()?,
        http_threads: front.http_threads,
        max_connections: front.max_connections,
        http_queue_depth: front.http_queue_depth,
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
    })
}

/// Until a stop signal: watch the engine and the front, and pet systemd's
/// watchdog only while the engine loop turns (a busy engine turns; a
/// wedged one does not).
fn supervise(
    signals: &AtomicU32,
    engine: &std::thread::JoinHandle<()>,
    front: &http::Front,
    notifier: &Notifier,
    state: &AppState,
) -> Result<(), String> {
    let mut petted = Instant::now();
    let mut accept_errors = AcceptErrors::default();
    while signals.load(Ordering::SeqCst) == 0 {
        std::thread::sleep(MAIN_TICK);
        if engine.is_finished() {
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
    Ok(())
}

/// How often the main thread looks at signals, the engine and the drain: a
/// stop signal is acted on within this. Each look is a wake-up of an idle
/// process; at 20 ms they were half of an idle sluice's CPU (0.2 % of a core
/// on a 2-core AMD EPYC VM, where a timer wake-up costs ~40 us).
const MAIN_TICK: Duration = Duration::from_millis(100);
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
        "sluice: draining: {n} requests in flight may finish within {} ms; new ones get 503 (SIGINT, Ctrl-C, again exits at once)",
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
