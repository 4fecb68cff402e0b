//! `sluice calibrate`: times bare `llama_decode` steps, with no server, scheduler,
//! sampling or HTTP in the way: the ceiling the server's throughput is compared
//! against. Same context setup as `serve` (unified KV, one pinned threadpool).

use crate::config::{compute_cpus, CalibrateArgs};
use crate::engine::calibration::{time_decode, WARMUP_STEPS};
use crate::ffi::{self, Context, ContextParams};
use std::sync::Arc;

/// Batch sizes (concurrent sequences) timed.
const BATCH_SIZES: [usize; 2] = [1, 4];

pub fn run(args: CalibrateArgs) -> Result<(), String> {
    if args.steps == 0 || args.prompt_tokens == 0 {
        return Err("--steps and --prompt-tokens must be positive".into());
    }
    let cpus = compute_cpus(args.threads)?;
    ffi::backend_init(false);
    let model = Arc::new(crate::engine::load_model(&args.model, false)?);
    let prompt = crate::engine::calibration::prompt(&model, args.prompt_tokens)?;
    let n_seq = *BATCH_SIZES.iter().max().expect("batch sizes");
    let per_seq = prompt.len() + WARMUP_STEPS + args.steps;
    ffi::set_current_thread_name("sluice-ggml");
    let ctx = Context::new(
        Arc::clone(&model),
        &ContextParams {
            n_ctx: (n_seq * per_seq + 256) as u32,
            kv_layout: ffi::KvLayout::PerSequence,
            n_batch: prompt.len().max(n_seq) as u32,
            n_seq_max: n_seq as u32,
            cpus: cpus.clone(),
            poll: args.poll,
            flash_attn: args.flash_attn,
            kv_type: args.kv_type,
        },
    );
    ffi::set_current_thread_name("sluice-calib");
    let mut ctx = ctx?;
    println!(
        "calibrate: {} ({}), {} threads on CPUs {:?}, prompt {} tokens, {} timed steps per batch size",
        args.model.display(),
        model.description(),
        cpus.len(),
        cpus,
        prompt.len(),
        args.steps
    );
    let mut results = Vec::new();
    for &b in &BATCH_SIZES {
        let tok_s = time_decode(&mut ctx, &prompt, b, args.steps)?;
        for seq in 0..b {
            ctx.clear_sequence(seq as i32);
        }
        println!(
            "calibrate: batch {b}: {tok_s:.1} tok/s aggregate, {:.1} tok/s per sequence",
            tok_s / b as f64
        );
        results.push(format!("\"batch_{b}_tok_s\": {tok_s:.2}"));
    }
    println!("{{{}}}", results.join(", "));
    Ok(())
}
