//! Measures this machine's service rates on the loaded model: prefill tokens per
//! second, and decode tokens per second at a batch size. Used at start-up (the
//! admission bounds are derived from it) and by `sluice calibrate`.

use super::ffi::{Batch, Context, Model, Token};
use std::time::Instant;

/// Decode steps run untimed first, so that caches and the threadpool are warm.
pub const WARMUP_STEPS: usize = 4;
/// Prompt tokens each sequence holds while its decode steps are timed.
const DECODE_CONTEXT_TOKENS: usize = 32;

/// A prompt of exactly `tokens` tokens (plain English), to time with.
pub fn prompt(model: &Model, tokens: usize) -> Result<Vec<Token>, String> {
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(tokens);
    let mut prompt = model.tokenize(&text, true, false)?;
    prompt.truncate(tokens);
    Ok(prompt)
}

/// What start-up calibration measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Calibration {
    pub prefill_tok_s: f64,
    pub decode_tok_s_batch_1: f64,
    /// Aggregate decode rate with `parallel` sequences in each step.
    pub decode_tok_s_parallel: f64,
    pub parallel: usize,
    pub seconds: f64,
}

/// Start-up calibration: a prompt of `prompt_tokens` prefilled in chunks of the
/// context's `n_batch` (the server's step budget), then `steps` decode steps at
/// batch 1 and at batch `parallel`. About a second on a 2-core box.
pub fn measure(
    ctx: &mut Context,
    prompt: &[Token],
    parallel: usize,
    steps: usize,
) -> Result<Calibration, String> {
    let started = Instant::now();
    let prefill_tok_s = time_prefill(ctx, prompt, 0)?;
    ctx.clear_sequence(0);
    // Decode needs only some context; prefilling the whole prompt into every
    // sequence would cost more than the decode steps timed.
    let context = &prompt[..prompt.len().min(DECODE_CONTEXT_TOKENS)];
    let decode_tok_s_batch_1 = time_decode(ctx, context, 1, steps)?;
    let decode_tok_s_parallel = if parallel > 1 {
        time_decode(ctx, context, parallel, steps)?
    } else {
        decode_tok_s_batch_1
    };
    Ok(Calibration {
        prefill_tok_s,
        decode_tok_s_batch_1,
        decode_tok_s_parallel,
        parallel,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// Prefills `prompt` into sequence `seq` in chunks of `n_batch`; prompt tokens per second.
pub fn time_prefill(ctx: &mut Context, prompt: &[Token], seq: i32) -> Result<f64, String> {
    let mut batch = Batch::new(ctx.n_batch());
    ctx.clear_sequence(seq);
    let started = Instant::now();
    for (c, chunk) in prompt.chunks(ctx.n_batch()).enumerate() {
        batch.clear();
        let base = c * ctx.n_batch();
        for (i, &t) in chunk.iter().enumerate() {
            let pos = base + i;
            batch.push(t, pos as i32, seq, pos + 1 == prompt.len());
        }
        ctx.decode(&batch)
            .map_err(|e| format!("calibration prefill failed: {e:?}"))?;
    }
    Ok(prompt.len() as f64 / started.elapsed().as_secs_f64())
}

/// Prefills `prompt` into `n_seq` sequences, then times `steps` decode steps
/// that each carry one token per sequence. Returns aggregate tokens per second.
/// Leaves the sequences empty.
pub fn time_decode(
    ctx: &mut Context,
    prompt: &[Token],
    n_seq: usize,
    steps: usize,
) -> Result<f64, String> {
    for seq in 0..n_seq {
        time_prefill(ctx, prompt, seq as i32)?;
    }
    let mut batch = Batch::new(ctx.n_batch());
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
            .map_err(|e| format!("calibration decode failed: {e:?}"))?;
        // Read the logits as a server would before sampling.
        let _ = ctx.logits(&batch, n_seq - 1)[0];
    }
    let secs = started.elapsed().as_secs_f64();
    for seq in 0..n_seq {
        ctx.clear_sequence(seq as i32);
    }
    Ok((steps * n_seq) as f64 / secs)
}
