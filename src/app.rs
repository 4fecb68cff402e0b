//! Start-up: parse the command line, load the model, wire the stages together.

use crate::admission::Admission;
use crate::config::{Cli, Command, Config};
use crate::engine::ffi::{self, Context, ContextParams};
use crate::engine::{self, EngineConfig};
use crate::http::{self, AppState};
use crate::metrics::Metrics;
use crate::prompt::{Prompter, Template};
use crossbeam_channel::bounded;
use std::net::TcpListener;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// KV cells when neither `--ctx` nor the model says otherwise.
const CTX_TOKENS_DEFAULT_MAX: usize = 8192;

pub fn run() -> Result<(), String> {
    let cli: Cli = argh::from_env();
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

fn serve(cfg: Config) -> Result<(), String> {
    ffi::set_current_thread_name("sluice-main");
    ffi::backend_init(cfg.verbose);
    ffi::raise_nofile_limit();
    let model = Arc::new(engine::load_model(&cfg.model)?);
    let n_ctx_train = model.n_ctx_train() as usize;
    let n_ctx = cfg.ctx_tokens.unwrap_or_else(|| match n_ctx_train {
        0 => CTX_TOKENS_DEFAULT_MAX,
        n => n.min(CTX_TOKENS_DEFAULT_MAX),
    });
    let prompter = Prompter::new(Arc::clone(&model));
    let metrics = Arc::new(Metrics::default());
    let (admission, jobs) = Admission::new(cfg.queue_depth_max, Arc::clone(&metrics));

    // The engine thread creates the context: ggml pins the creating thread as its
    // worker 0, and the workers it starts inherit the name the thread has then.
    let (ready_tx, ready_rx) = bounded::<Result<usize, String>>(1);
    let engine_cfg = EngineConfig {
        parallel: cfg.parallel,
        n_ctx,
        step_tokens_max: cfg.step_tokens_max,
        cpus: cfg.cpus.clone(),
        poll: cfg.poll,
    };
    let engine_thread = {
        let model = Arc::clone(&model);
        let metrics = Arc::clone(&metrics);
        std::thread::Builder::new()
            .name("sluice-engine".into())
            .spawn(move || {
                ffi::set_current_thread_name("sluice-ggml");
                let params = ContextParams {
                    n_ctx: engine_cfg.n_ctx as u32,
                    n_batch: engine_cfg.step_tokens_max as u32,
                    n_seq_max: engine_cfg.parallel as u32,
                    cpus: engine_cfg.cpus.clone(),
                    poll: engine_cfg.poll,
                };
                let ctx = Context::new(Arc::clone(&model), &params);
                ffi::set_current_thread_name("sluice-engine");
                match ctx {
                    Ok(ctx) => {
                        let _ = ready_tx.send(Ok(ctx.n_ctx()));
                        engine::run(model, ctx, engine_cfg, jobs, metrics);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| format!("cannot start the engine thread: {e}"))?
    };
    let n_ctx = ready_rx
        .recv()
        .map_err(|_| "the engine thread died while starting".to_string())??;

    let addr = format!("{}:{}", cfg.host, cfg.port);
    let listener = TcpListener::bind(&addr).map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    let template = match prompter.template() {
        Template::Model(_) => "the model's chat template",
        Template::ChatMlFallback => {
            "ChatML (fallback: the model's template is missing or not recognised)"
        }
    };
    eprintln!(
        "sluice: model {} ({}), context {n_ctx} tokens (trained {n_ctx_train}), chat: {template}",
        cfg.model.display(),
        model.description()
    );
    eprintln!(
        "sluice: {} compute threads pinned to CPUs {:?}; {} parallel sequences; step budget {} tokens; queue depth {}; {} HTTP handlers",
        cfg.cpus.len(),
        cfg.cpus,
        cfg.parallel,
        cfg.step_tokens_max,
        cfg.queue_depth_max,
        cfg.http_threads
    );
    let state = Arc::new(AppState {
        prompter,
        admission,
        metrics,
        n_ctx,
        next_id: AtomicU64::new(1),
        started_unix_s: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        cfg,
    });
    let _handlers = http::start(state, listener)?;
    eprintln!("sluice: listening on http://{local}");

    engine_thread
        .join()
        .map_err(|_| "the engine thread panicked".to_string())?;
    Err("the engine stopped".into())
}
