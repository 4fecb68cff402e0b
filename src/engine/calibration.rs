//! Measures this machine's service rates on the loaded model: prefill tokens per
//! second, and decode tokens per second at a batch size. Used at start-up (the
//! admission bounds are derived from it) and by `sluice calibrate`.

use crate::ffi::{Batch, Context, KvLayout, Model, Token};
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
    /// Seconds to save a sequence's KV state per save unit: per run of
    /// consecutive cells (unified; measured on a sequence decoded beside
    /// `parallel - 1` others, each decode step leaving it one cell between
    /// theirs), or per token (per sequence); `None` with one sequence.
    pub save_s_per_run: Option<f64>,
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
    layout: KvLayout,
) -> Result<Calibration, String> {
    let started = Instant::now();
    let prefill_tok_s = time_prefill(ctx, prompt, 0)?;
    ctx.clear_sequence(0);
    // Decode needs only some context; prefilling the whole prompt into every
    // sequence would cost more than the decode steps timed.
    let context = &prompt[..prompt.len().min(DECODE_CONTEXT_TOKENS)];
    let decode_tok_s_batch_1 = time_decode(ctx, context, 1, steps)?;
    ctx.clear_sequence(0);
    let (decode_tok_s_parallel, save_s_per_run) = if parallel > 1 {
        let rate = time_decode(ctx, context, parallel, steps)?;
        // Sequence 0 now holds its prompt and one cell per decode step. In a
        // unified cache each of those is between the other sequences' cells:
        // one run per step. Per sequence, its stream holds its cells alone,
        // and the copy costs by the cell.
        let runs = match layout {
            KvLayout::Unified => 1 + WARMUP_STEPS + steps,
            KvLayout::PerSequence => (ctx.sequence_pos_max(0) + 1).max(1) as usize,
        };
        let started = Instant::now();
        let state = ctx.save_sequence(0);
        let s = started.elapsed().as_secs_f64();
        std::hint::black_box(state);
        for seq in 0..parallel {
            ctx.clear_sequence(seq as i32);
        }
        (rate, Some(s / runs as f64))
    } else {
        (decode_tok_s_batch_1, None)
    };
    Ok(Calibration {
        prefill_tok_s,
        decode_tok_s_batch_1,
        decode_tok_s_parallel,
        parallel,
        save_s_per_run,
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
/// Leaves the sequences as they are (the caller clears them).
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
    Ok((steps * n_seq) as f64 / secs)
}

/// Prompt tokens in the cache when flash attention is compared at start-up: a
/// chat's depth, where its cost for decode already shows.
pub const FLASH_ATTN_DEPTH_TOKENS: usize = 384;
/// Tokens of the prefill chunk timed at that depth (a chunk beside streams).
pub const FLASH_ATTN_CHUNK_TOKENS: usize = 32;
/// Timed repetitions of each; the median counts.
const FLASH_ATTN_REPS: usize = 3;
/// Flash attention is chosen only if a mixed step is at least this much
/// faster with it: a tie goes to the path without it, which decodes faster
/// at depth on the CPUs measured so far.
pub const FLASH_ATTN_GAIN_MIN: f64 = 0.05;

/// A mixed step's two parts at `FLASH_ATTN_DEPTH_TOKENS`, in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionTiming {
    pub decode_s: f64,
    pub chunk_s: f64,
}

impl AttentionTiming {
    pub fn step_s(&self) -> f64 {
        self.decode_s + self.chunk_s
    }
}

/// Times one decode token and one `FLASH_ATTN_CHUNK_TOKENS` chunk of sequence 0
/// at a depth of `prompt.len() - FLASH_ATTN_CHUNK_TOKENS` tokens (medians of
/// `FLASH_ATTN_REPS`, after one untimed round). If the untimed round's step
/// already takes longer than `give_up_s`, that round is the answer: it has
/// lost, and timing it again would only delay start-up (flash attention's
/// small chunks at depth took 316 ms here, against 56 ms without). Leaves the
/// sequence empty.
pub fn time_attention(
    ctx: &mut Context,
    prompt: &[Token],
    give_up_s: f64,
) -> Result<AttentionTiming, String> {
    assert!(
        prompt.len() > FLASH_ATTN_CHUNK_TOKENS,
        "a prompt deeper than one chunk"
    );
    let depth = prompt.len() - FLASH_ATTN_CHUNK_TOKENS;
    time_prefill(ctx, &prompt[..depth], 0)?;
    let mut batch = Batch::new(ctx.n_batch());
    let (mut chunk, mut decode) = (Vec::new(), Vec::new());
    let timed = |batch: &Batch, ctx: &mut Context| -> Result<f64, String> {
        let started = Instant::now();
        ctx.decode(batch)
            .map_err(|e| format!("flash attention measurement failed: {e:?}"))?;
        let _ = ctx.logits(batch, batch.len() - 1)[0];
        let s = started.elapsed().as_secs_f64();
        ctx.truncate_sequence(0, depth as i32);
        Ok(s)
    };
    for rep in 0..=FLASH_ATTN_REPS {
        batch.clear();
        for (i, &t) in prompt[depth..].iter().enumerate() {
            batch.push(t, (depth + i) as i32, 0, depth + i + 1 == prompt.len());
        }
        let c = timed(&batch, ctx)?;
        batch.clear();
        batch.push(prompt[depth], depth as i32, 0, true);
        let d = timed(&batch, ctx)?;
        if rep == 0 && c + d > give_up_s {
            ctx.clear_sequence(0);
            return Ok(AttentionTiming {
                decode_s: d,
                chunk_s: c,
            });
        }
        if rep > 0 {
            chunk.push(c);
            decode.push(d);
        }
    }
    ctx.clear_sequence(0);
    Ok(AttentionTiming {
        decode_s: median(&mut decode),
        chunk_s: median(&mut chunk),
    })
}

/// With timings `off` and `on`: flash attention only if a mixed step is at
/// least `FLASH_ATTN_GAIN_MIN` faster with it.
pub fn flash_attn_wins(off: &AttentionTiming, on: &AttentionTiming) -> bool {
    on.step_s() < off.step_s() * (1.0 - FLASH_ATTN_GAIN_MIN)
}

/// Which of several timed settings to take: the first, unless a later one's
/// step is `FLASH_ATTN_GAIN_MIN` faster than the choice so far.
pub fn attention_choice(timings: &[AttentionTiming]) -> usize {
    (1..timings.len()).fold(0, |chosen, i| {
        if flash_attn_wins(&timings[chosen], &timings[i]) {
            i
        } else {
            chosen
        }
    })
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flash_attention_must_win_by_a_margin() {
        let off = AttentionTiming {
            decode_s: 0.010,
            chunk_s: 0.030,
        };
        let slightly = AttentionTiming {
            decode_s: 0.012,
            chunk_s: 0.027,
        };
        let clearly = AttentionTiming {
            decode_s: 0.008,
            chunk_s: 0.025,
        };
        assert!(!flash_attn_wins(&off, &off), "a tie stays off");
        assert!(
            !flash_attn_wins(&off, &slightly),
            "39 vs 40 ms: within the margin"
        );
        assert!(flash_attn_wins(&off, &clearly), "33 vs 40 ms");
    }

    #[test]
    fn a_later_setting_is_chosen_only_when_it_beats_the_choice_so_far_by_the_margin() {
        let t = |ms: f64| AttentionTiming {
            decode_s: 0.0,
            chunk_s: ms / 1e3,
        };
        assert_eq!(attention_choice(&[t(40.0)]), 0);
        assert_eq!(attention_choice(&[t(40.0), t(39.0), t(38.5)]), 0);
        assert_eq!(attention_choice(&[t(40.0), t(33.0), t(32.0)]), 1);
        assert_eq!(attention_choice(&[t(40.0), t(33.0), t(30.0)]), 2);
        assert_eq!(attention_choice(&[t(40.0), t(90.0), t(30.0)]), 2);
    }
}
