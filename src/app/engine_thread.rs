//! The engine thread's start. It creates the llama context (ggml pins the
//! creating thread as its worker 0, and the workers it starts inherit the
//! name the thread has then), picks the attention pairing, calibrates,
//! reports what it made (`Started`), and waits for its queue, which start-up
//! sizes from that; then it runs the engine until the end.

use crate::calibration_cache::Kept;
use crate::config::{Config, FlashAttnSetting, KvTypeSetting};
use crate::engine::calibration::Calibration;
use crate::engine::contexts::{Contexts, LONE_CELLS};
use crate::engine::served::DepthTiming;
use crate::engine::{self, EngineConfig};
use crate::ffi::{self, Context, ContextParams, FlashAttn, KvLayout, KvType, Model};
use crate::metrics::Metrics;
use crate::priority::Class;
use crate::startup::{
    attention_candidates, measure_attention, staggered_cells, start_up_calibration,
};
use crossbeam_channel::{bounded, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

/// What the engine thread hands back once its context is made and measured.
pub(super) struct Started {
    pub(super) n_ctx: usize,
    pub(super) calibration: Option<Calibration>,
    pub(super) engine_stop: Arc<ffi::AbortWatch>,
    pub(super) pairing: (FlashAttn, KvType),
    /// Tokens llama.cpp computes in one graph pass.
    pub(super) n_ubatch: usize,
    /// The pairing was chosen by timing the candidates (now or before).
    pub(super) measured: bool,
    /// The candidates' timings by depth, when they were timed now.
    pub(super) timings: Vec<Vec<DepthTiming>>,
    /// With a short requests' context: the most cells of a request it
    /// serves, and the cells of each of its streams.
    pub(super) short: Option<(usize, usize)>,
    /// The most cells of a request it serves when nothing else runs, if a
    /// prompt alone is prefilled faster there, and the answer tokens a
    /// prompt token pays for there (`Contexts::lone`).
    pub(super) short_alone: Option<(usize, f64)>,
}

type Ready = Result<Started, String>;

/// What the engine thread is to do before it serves.
pub(super) struct Plan {
    engine_cfg: EngineConfig,
    flash_attn: FlashAttnSetting,
    kv_type: KvTypeSetting,
    /// The pairing the calibration cache kept (or chose anew for the tokens
    /// served, `Entry::serving_pairing`), and whether it was timed.
    cached_pairing: Option<((FlashAttn, KvType), bool)>,
    /// The rates the calibration cache kept, when they are wanted.
    pub(super) cached_calibration: Option<Calibration>,
    /// Rates are measured unless given (or `--calibrate-only` asks).
    pub(super) calibrate: bool,
    /// `--calibrate-only`: time the pairings now, whatever is kept.
    measure_now: bool,
    /// Where the cache's timings say a prompt alone is prefilled faster with
    /// flash attention on and an f16 cache than with the kept pairing: the
    /// answer tokens a prompt token pays for there (`Entry::short_lone_trade`).
    short_alone: Option<f64>,
}

impl Plan {
    pub(super) fn new(cfg: &Config, n_ctx: usize, kept: Option<&Kept>) -> Plan {
        let calibrate = cfg.rates.is_none() || cfg.calibrate_only;
        let (cached_pairing, cached_calibration, short_alone) =
            match kept.and_then(|k| k.entry.as_ref()) {
                Some(e) => {
                    let pairing = e.serving_pairing();
                    (
                        pairing.map(|p| (p, e.attention_measured)),
                        e.calibration().filter(|_| calibrate),
                        pairing.and_then(|p| e.short_lone_trade(p)),
                    )
                }
                None => (None, None, None),
            };
        Plan {
            engine_cfg: engine_config(cfg, n_ctx),
            flash_attn: cfg.flash_attn,
            kv_type: cfg.kv_type,
            cached_pairing,
            cached_calibration,
            calibrate,
            measure_now: cfg.calibrate_only,
            short_alone,
        }
    }
}

fn engine_config(cfg: &Config, n_ctx: usize) -> EngineConfig {
    EngineConfig {
        parallel: cfg.parallel,
        n_ctx,
        n_batch: cfg.n_batch(),
        step_tokens: cfg.step_tokens,
        itl_target: cfg.itl_target,
        itl_max: cfg.itl_max,
        decode_ahead: cfg.decode_ahead,
        overdue_stretch: cfg.overdue_stretch,
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
        short_cells: cfg.short_cells,
    }
}

/// The engine thread, started: what it reports, and where its queue goes.
pub(super) struct EngineThread {
    pub(super) handle: JoinHandle<()>,
    ready: Receiver<Ready>,
    wiring: Sender<engine::Wiring>,
}

impl EngineThread {
    pub(super) fn spawn(
        model: &Arc<Model>,
        metrics: &Arc<Metrics>,
        plan: Plan,
    ) -> Result<EngineThread, String> {
        let (ready_tx, ready) = bounded::<Ready>(1);
        let (wiring, wiring_rx) = bounded::<engine::Wiring>(1);
        let model = Arc::clone(model);
        let metrics = Arc::clone(metrics);
        let handle = std::thread::Builder::new()
            .name("sluice-engine".into())
            .spawn(move || engine_main(model, metrics, plan, ready_tx, wiring_rx))
            .map_err(|e| format!("cannot start the engine thread: {e}"))?;
        Ok(EngineThread {
            handle,
            ready,
            wiring,
        })
    }

    /// Waits for the context and the calibration.
    pub(super) fn started(&self) -> Result<Started, String> {
        self.ready
            .recv()
            .map_err(|_| "the engine thread died while starting".to_string())?
    }

    /// Hands the engine its queue, its cost model and its prefix cache.
    pub(super) fn wire(&self, wiring: engine::Wiring) -> Result<(), String> {
        self.wiring
            .send(wiring)
            .map_err(|_| "the engine thread died while starting".to_string())
    }
}

fn engine_main(
    model: Arc<Model>,
    metrics: Arc<Metrics>,
    plan: Plan,
    ready: Sender<Ready>,
    wiring: Receiver<engine::Wiring>,
) {
    ffi::set_current_thread_name("sluice-ggml");
    let mut params = context_params(&plan.engine_cfg);
    let (pairing, measured, timings) = pick_pairing(&model, &params, &plan);
    (params.flash_attn, params.kv_type) = pairing;
    let ctx = Context::new(Arc::clone(&model), &params);
    ffi::set_current_thread_name("sluice-engine");
    let made = ctx.and_then(|mut ctx| {
        let calibration = calibration(&model, &mut ctx, &plan)?;
        Ok((ctx, calibration))
    });
    let (ctx, calibration) = match made {
        Ok(m) => m,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let mut ctx = short_context(ctx, &params, pairing, &plan);
    let engine_cfg = plan.engine_cfg;
    // What one request may use: the cells admission reserves in all
    // (llama.cpp's are rounded up; `staggered_cells`).
    let short = ctx.short_cells().zip(ctx.short_stream_cells());
    let short_alone = ctx.lone();
    let main = ctx.main();
    let n_ctx = engine_cfg.n_ctx.min(match engine_cfg.kv_layout {
        KvLayout::Unified => main.n_ctx(),
        KvLayout::PerSequence => main.n_ctx_seq(),
    });
    let started = Started {
        n_ctx,
        calibration,
        engine_stop: main.abort_handle(),
        pairing,
        n_ubatch: main.n_ubatch(),
        measured,
        timings,
        short,
        short_alone,
    };
    let _ = ready.send(Ok(started));
    let engine_cfg = EngineConfig {
        save_s_per_run: calibration.and_then(|c| c.save_s_per_run),
        ..engine_cfg
    };
    if let Ok(wiring) = wiring.recv() {
        engine::run(model, ctx, engine_cfg, metrics, wiring);
    }
}

/// The engine's contexts: the main one, and beside it one with flash
/// attention on and an f16 cache for short requests (`engine::contexts`),
/// unless `--short-cells` is 0, the main one has that pairing already, or
/// `--calibrate-only` only measures. Its streams hold `--short-cells`, or,
/// when the calibration cache's timings say a prompt alone is prefilled
/// faster there (`Plan::short_alone`), `LONE_CELLS` for such prompts. A
/// model llama.cpp cannot make that context for is served by the main one
/// alone (said in the log).
fn short_context(
    main: Context,
    params: &ContextParams,
    pairing: (FlashAttn, KvType),
    plan: &Plan,
) -> Contexts {
    let cfg = &plan.engine_cfg;
    let short = (FlashAttn::On, KvType::F16);
    // No request holds more than --ctx cells.
    let cells = cfg.short_cells.min(cfg.n_ctx);
    let per_seq = cfg.kv_layout == KvLayout::PerSequence;
    if cells == 0 || pairing == short || !per_seq || plan.measure_now {
        return Contexts::one(main);
    }
    let stream = match plan.short_alone {
        Some(_) => cells.max(LONE_CELLS).min(cfg.n_ctx),
        None => cells,
    };
    let params = ContextParams {
        n_ctx: (staggered_cells(stream) * cfg.parallel) as u32,
        flash_attn: short.0,
        kv_type: short.1,
        ..params.clone()
    };
    match main.beside(&params) {
        Ok(beside) => Contexts::with_short(main, beside, cfg.parallel, cells, plan.short_alone),
        Err(e) => {
            crate::say!(
                "sluice: no second context for short requests ({e}); every request runs in the main one"
            );
            Contexts::one(main)
        }
    }
}

/// The context's shape; the attention pairing is set once chosen.
fn context_params(engine_cfg: &EngineConfig) -> ContextParams {
    let per_seq = engine_cfg.kv_layout == KvLayout::PerSequence;
    ContextParams {
        // Per sequence, each stream holds --ctx cells, so that one request
        // may use them all; admission still reserves at most --ctx in all
        // (see ARCHITECTURE.md, memory).
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
    }
}

/// The attention/KV type pairing: the only candidate the flags leave, or
/// the candidates timed now (`--calibrate-only`), or the one the cache kept,
/// or the first candidate; whether it was timed, and what was timed now.
fn pick_pairing(
    model: &Arc<Model>,
    params: &ContextParams,
    plan: &Plan,
) -> ((FlashAttn, KvType), bool, Vec<Vec<DepthTiming>>) {
    let candidates = attention_candidates(plan.flash_attn, plan.kv_type);
    match (&candidates[..], plan.cached_pairing) {
        ([only], _) => (*only, false, Vec::new()),
        _ if plan.measure_now => {
            let (chosen, timings) =
                measure_attention(model, params, plan.engine_cfg.parallel, &candidates);
            (chosen, true, timings)
        }
        (_, Some((kept, measured))) => (kept, measured, Vec::new()),
        _ => (candidates[0], false, Vec::new()),
    }
}

/// The rates: the cache's, or measured now, or none (given by flags).
fn calibration(
    model: &Arc<Model>,
    ctx: &mut Context,
    plan: &Plan,
) -> Result<Option<Calibration>, String> {
    if let Some(c) = plan.cached_calibration {
        return Ok(Some(c));
    }
    if !plan.calibrate {
        return Ok(None);
    }
    start_up_calibration(model, ctx, &plan.engine_cfg).map(Some)
}
