//! `sluice calibrate`: times bare `llama_decode` steps, with no server, scheduler,
//! sampling or HTTP in the way: the ceiling the server's throughput is compared
//! against. Same context setup as `serve` (unified KV, one pinned threadpool).

use crate::config::{compute_cpus, CalibrateArgs};
use crate::engine::ffi::{self, Batch, Context, ContextParams};
use std::sync::Arc;
use std::time::Instant;

/// Batch sizes (concurrent sequences) timed.
const BATCH_SIZES: [usize; 2] = [1, 4];
/// Steps run untimed first, so that caches and the threadpool are warm.
const WARMUP_STEPS: usize = 8;

pub fn run(args: CalibrateArgs) -> Result<(), String> {
    if args.steps == 0 || args.prompt_tokens == 0 {
        return Err("--steps and --prompt-tokens must be positive".into());
    }
    let cpus = compute_cpus(args.threads)?;
    ffi::backend_init(false);
    let model = Arc::new(crate::engine::load_model(&args.model)?);
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(args.prompt_tokens);
    let mut prompt = model.tokenize(&text, true, false)?;
    prompt.truncate(args.prompt_tokens);
    let n_seq = *BATCH_SIZES.iter().max().expect("batch sizes");
    let per_seq = prompt.len() + WARMUP_STEPS + args.steps;
    ffi::set_current_thread_name("sluice-ggml");
    let ctx = Context::new(
        Arc::clone(&model),
        &ContextParams {
            n_ctx: (n_seq * per_seq + 256) as u32,
            n_batch: prompt.len().max(n_seq) as u32,
            n_seq_max: n_seq as u32,
            cpus: cpus.clone(),
            poll: args.poll,
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
        println!(
            "calibrate: batch {b}: {tok_s:.1} tok/s aggregate, {:.1} tok/s per sequence",
            tok_s / b as f64
        );
        results.push(format!("\"batch_{b}_tok_s\": {tok_s:.2}"));
    }
    println!("{{{}}}", results.join(", "));
    Ok(())
}

/// Prefills `prompt` into `n_seq` sequences, then times `steps` decode steps
/// that each carry one token per sequence. Returns aggregate tokens per second.
fn time_decode(
    ctx: &mut Context,
    prompt: &[ffi::Token],
    n_seq: usize,
    steps: usize,
) -> Result<f64, String> {
    let mut batch = Batch::new(ctx.n_batch());
    for seq in 0..n_seq {
        ctx.clear_sequence(seq as i32);
        batch.clear();
        for (pos, &t) in prompt.iter().enumerate() {
            batch.push(t, pos as i32, seq as i32, pos + 1 == prompt.len());
        }
        ctx.decode(&batch)
            .map_err(|e| format!("prefill failed: {e:?}"))?;
    }
    let token = prompt[prompt.len() - 1];
    let mut started = Instant::now();
    for (step, pos) in (0..WARMUP_STEPS + steps).zip(prompt.len()..) {
        if step == WARMUP_STEPS {
            started = Instant::now();
        }
        batch.clear();
        for seq in 0..n_seq {
            batch.push(token, pos as i32, seq as i32, true);
        }
        ctx.decode(&batch)
            .map_err(|e| format!("decode failed: {e:?}"))?;
        // Read the logits as a server would before sampling.
        let _ = ctx.logits(&batch, n_seq - 1)[0];
    }
    let secs = started.elapsed().as_secs_f64();
    for seq in 0..n_seq {
        ctx.clear_sequence(seq as i32);
    }
    Ok((steps * n_seq) as f64 / secs)
}
