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

/// Prompt tokens in every sequence's cache when flash attention is compared:
/// a short chat's depth, where its cost already shows (on the AVX-512
/// development VM flash attention's 32-token chunk was 3x slower than without
/// it at this depth, 5x at 384).
pub const FLASH_ATTN_DEPTH_TOKENS: usize = 128;
/// The second depth they are compared at: a long conversation's, or a
/// document's. Pairings that tie at a short chat's depth part here: on a
/// 2-core AMD EPYC (AVX2) flash attention with a q8_0 cache tied with it off
/// (K in q8_0) at 128 tokens, but prefilled half as fast 1,500 tokens deep
/// (llama-bench, 4-64-token chunks: 52-56 against 102-105 tok/s), and a
/// 6,279-token prompt beside two streams reached its first token in 352 s
/// against 144 s.
pub const FLASH_ATTN_DEEP_TOKENS: usize = 1024;
/// Tokens of the prefill chunk timed at that depth (a chunk beside streams).
pub const FLASH_ATTN_CHUNK_TOKENS: usize = 32;
/// Timed rounds of each; the fastest counts.
const FLASH_ATTN_REPS: usize = 5;
/// A later candidate is chosen only if it is at least this much faster
/// (`AttentionTiming::score`): a tie goes to the first.
pub const FLASH_ATTN_GAIN_MIN: f64 = 0.05;

/// What a serving step's two passes cost at one depth, per token: a decode
/// token of a step that decodes every sequence, and a prompt token of a
/// chunk.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AttentionTiming {
    pub decode_s_per_token: f64,
    pub prefill_s_per_token: f64,
}

impl AttentionTiming {
    /// Seconds per token of a request that has as many prompt tokens as it
    /// generates (a chat's order of magnitude): what the pairing is judged by.
    pub fn score(&self) -> f64 {
        self.decode_s_per_token + self.prefill_s_per_token
    }

    /// The mean of timings at several depths, each counting alike.
    pub fn mean(timings: &[AttentionTiming]) -> AttentionTiming {
        let n = timings.len().max(1) as f64;
        AttentionTiming {
            decode_s_per_token: timings.iter().map(|t| t.decode_s_per_token).sum::<f64>() / n,
            prefill_s_per_token: timings.iter().map(|t| t.prefill_s_per_token).sum::<f64>() / n,
        }
    }
}

/// One round of a step's two passes at a depth, in seconds: a decode token
/// for every sequence, and a chunk of sequence 0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionRound {
    pub decode_s: f64,
    pub chunk_s: f64,
}

impl AttentionRound {
    /// Per token, with `n_seq` sequences decoding.
    pub fn timing(&self, n_seq: usize) -> AttentionTiming {
        AttentionTiming {
            decode_s_per_token: self.decode_s / n_seq.max(1) as f64,
            prefill_s_per_token: self.chunk_s / FLASH_ATTN_CHUNK_TOKENS as f64,
        }
    }

    /// The fastest of each pass over `rounds`: noise on a shared machine (a
    /// preempted thread, another process) only ever makes a pass slower, so
    /// the fastest is the nearest to what the pass costs.
    pub fn fastest(rounds: &[AttentionRound]) -> AttentionRound {
        rounds.iter().fold(
            AttentionRound {
                decode_s: f64::INFINITY,
                chunk_s: f64::INFINITY,
            },
            |a, r| AttentionRound {
                decode_s: a.decode_s.min(r.decode_s),
                chunk_s: a.chunk_s.min(r.chunk_s),
            },
        )
    }
}

/// Which pairings are timed after the untimed round: those not already
/// twice as slow as the fastest. Timing a lost one again would only delay
/// the measurement; its untimed round is its answer.
pub fn worth_timing(first: &[AttentionTiming]) -> Vec<bool> {
    let best = first
        .iter()
        .map(AttentionTiming::score)
        .fold(f64::INFINITY, f64::min);
    first.iter().map(|t| t.score() <= 2.0 * best).collect()
}

/// Times a serving step's two passes at one depth in each of `ctxs` (one
/// context a pairing, each shaped as the server's: its sequences, its
/// streams' size): one decode token for each of `n_seq` sequences, each
/// `prompt.len() - FLASH_ATTN_CHUNK_TOKENS` deep, and one
/// `FLASH_ATTN_CHUNK_TOKENS` chunk of sequence 0 at that depth. The shape
/// matters: on an AVX2 build a 4-sequence decode step was 25 % faster with
/// flash attention while one sequence's token was not.
///
/// The contexts take turns round by round, so that a change in the
/// machine's speed while it measures touches every pairing alike. Timed one
/// after the other (each pairing's rounds together, their median counting),
/// three runs on a 2-core AMD EPYC (alternating with three of this way)
/// chose flash attention on with a q8_0 cache twice (off, K in q8_0, was
/// 0.6 % and 4.8 % faster: inside `FLASH_ATTN_GAIN_MIN`) and off once (22 %
/// faster); taking turns, with the fastest counting, the three runs between
/// them chose off, 8-30 % faster.
/// One untimed round each (it builds the graphs), then `FLASH_ATTN_REPS`
/// rounds of those `worth_timing` (`AttentionRound::fastest`). Leaves the
/// sequences empty.
pub fn time_attention(
    ctxs: &mut [Context],
    prompt: &[Token],
    n_seq: usize,
    layout: KvLayout,
) -> Result<Vec<AttentionTiming>, String> {
    assert!(
        prompt.len() > FLASH_ATTN_CHUNK_TOKENS,
        "a prompt deeper than one chunk"
    );
    for ctx in ctxs.iter_mut() {
        prepare_attention(ctx, prompt, n_seq, layout)?;
    }
    let first = ctxs
        .iter_mut()
        .map(|ctx| attention_round(ctx, prompt, n_seq))
        .collect::<Result<Vec<_>, String>>()?;
    let first: Vec<AttentionTiming> = first.iter().map(|r| r.timing(n_seq)).collect();
    let timed = worth_timing(&first);
    let mut rounds: Vec<Vec<AttentionRound>> = vec![Vec::new(); ctxs.len()];
    for _ in 0..FLASH_ATTN_REPS {
        for (i, ctx) in ctxs.iter_mut().enumerate().filter(|(i, _)| timed[*i]) {
            rounds[i].push(attention_round(ctx, prompt, n_seq)?);
        }
    }
    for ctx in ctxs.iter_mut() {
        (0..n_seq as i32).for_each(|seq| ctx.clear_sequence(seq));
    }
    Ok(rounds
        .iter()
        .zip(first)
        .map(|(r, first)| match r.is_empty() {
            true => first,
            false => AttentionRound::fastest(r).timing(n_seq),
        })
        .collect())
}

/// Gives every one of `n_seq` sequences the prompt but its last chunk:
/// prefilled once, copied to the others.
fn prepare_attention(
    ctx: &mut Context,
    prompt: &[Token],
    n_seq: usize,
    layout: KvLayout,
) -> Result<(), String> {
    let depth = prompt.len() - FLASH_ATTN_CHUNK_TOKENS;
    time_prefill(ctx, &prompt[..depth], 0)?;
    let state = (layout == KvLayout::PerSequence && n_seq > 1).then(|| ctx.save_sequence(0));
    for seq in 1..n_seq as i32 {
        let copied = match &state {
            Some(state) => ctx.restore_sequence(seq, state),
            None => {
                ctx.share_cells(0, seq, 0, -1);
                true
            }
        };
        if !copied {
            return Err(
                "flash attention measurement: a sequence's cells could not be copied".into(),
            );
        }
    }
    ctx.pause_threads();
    Ok(())
}

/// One round at the depth `prepare_attention` left: the chunk, then the
/// decode tokens, each pass undone after it. The threads are put to sleep
/// at the end, so that they do not poll beside the next context's round.
fn attention_round(
    ctx: &mut Context,
    prompt: &[Token],
    n_seq: usize,
) -> Result<AttentionRound, String> {
    let depth = prompt.len() - FLASH_ATTN_CHUNK_TOKENS;
    let mut batch = Batch::new(ctx.n_batch());
    let timed = |batch: &Batch, ctx: &mut Context| -> Result<f64, String> {
        let started = Instant::now();
        ctx.decode(batch)
            .map_err(|e| format!("flash attention measurement failed: {e:?}"))?;
        let _ = ctx.logits(batch, batch.len() - 1)[0];
        let s = started.elapsed().as_secs_f64();
        for seq in 0..n_seq as i32 {
            ctx.truncate_sequence(seq, depth as i32);
        }
        Ok(s)
    };
    for (i, &t) in prompt[depth..].iter().enumerate() {
        batch.push(t, (depth + i) as i32, 0, depth + i + 1 == prompt.len());
    }
    let chunk_s = timed(&batch, ctx)?;
    batch.clear();
    for seq in 0..n_seq as i32 {
        batch.push(prompt[depth], depth as i32, seq, true);
    }
    let decode_s = timed(&batch, ctx)?;
    ctx.pause_threads();
    Ok(AttentionRound { decode_s, chunk_s })
}

/// Whether `later` is at least `FLASH_ATTN_GAIN_MIN` faster than `chosen`.
pub fn beats(chosen: &AttentionTiming, later: &AttentionTiming) -> bool {
    later.score() < chosen.score() * (1.0 - FLASH_ATTN_GAIN_MIN)
}

/// Which of several timed settings to take: the first, unless a later one
/// `beats` the choice so far.
pub fn attention_choice(timings: &[AttentionTiming]) -> usize {
    (1..timings.len()).fold(0, |chosen, i| {
        if beats(&timings[chosen], &timings[i]) {
            i
        } else {
            chosen
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_later_setting_must_win_by_a_margin() {
        let t = |decode_ms: f64, prefill_ms: f64| AttentionTiming {
            decode_s_per_token: decode_ms / 1e3,
            prefill_s_per_token: prefill_ms / 1e3,
        };
        let first = t(7.0, 4.0);
        assert!(!beats(&first, &first), "a tie stays with the first");
        assert!(
            !beats(&first, &t(6.0, 4.6)),
            "10.6 vs 11 ms a token: within the margin"
        );
        assert!(
            beats(&first, &t(6.5, 3.9)),
            "10.4 vs 11 ms a token (the AVX2 build: flash attention with a q8_0 cache)"
        );
        assert!(
            !beats(&first, &t(3.0, 8.5)),
            "faster decode does not make up for a prompt twice as slow"
        );
    }

    #[test]
    fn the_depths_count_alike() {
        let t = |decode_ms: f64, prefill_ms: f64| AttentionTiming {
            decode_s_per_token: decode_ms / 1e3,
            prefill_s_per_token: prefill_ms / 1e3,
        };
        // The EPYC's pairings: a tie at a short chat's depth, flash
        // attention twice as dear deep in a context.
        let on = AttentionTiming::mean(&[t(8.1, 6.1), t(12.0, 18.0)]);
        let off = AttentionTiming::mean(&[t(8.5, 5.7), t(10.0, 9.0)]);
        assert!((on.score() - 0.0221).abs() < 1e-9);
        assert!(beats(&on, &off), "deep contexts decide a tie");
        assert_eq!(AttentionTiming::mean(&[t(3.0, 4.0)]), t(3.0, 4.0));
    }

    #[test]
    fn the_fastest_of_each_pass_counts() {
        let r = |decode_ms: f64, chunk_ms: f64| AttentionRound {
            decode_s: decode_ms / 1e3,
            chunk_s: chunk_ms / 1e3,
        };
        // A preempted decode in one round, a slow chunk in another: neither
        // counts, and the two passes need not come from the same round.
        let rounds = [r(40.0, 160.0), r(95.0, 150.0), r(41.0, 320.0)];
        assert_eq!(AttentionRound::fastest(&rounds), r(40.0, 150.0));
        let t = AttentionRound::fastest(&rounds).timing(4);
        assert!((t.decode_s_per_token - 0.010).abs() < 1e-12);
        assert!((t.prefill_s_per_token - 0.150 / FLASH_ATTN_CHUNK_TOKENS as f64).abs() < 1e-12);
    }

    #[test]
    fn a_pairing_already_twice_as_slow_is_not_timed_again() {
        let t = |ms: f64| AttentionTiming {
            decode_s_per_token: ms / 2e3,
            prefill_s_per_token: ms / 2e3,
        };
        assert_eq!(
            worth_timing(&[t(20.0), t(18.0), t(36.0), t(36.1)]),
            [true, true, true, false]
        );
        assert_eq!(worth_timing(&[t(5.0)]), [true]);
    }

    #[test]
    fn a_later_setting_is_chosen_only_when_it_beats_the_choice_so_far_by_the_margin() {
        let t = |ms: f64| AttentionTiming {
            decode_s_per_token: 0.0,
            prefill_s_per_token: ms / 1e3,
        };
        assert_eq!(attention_choice(&[t(40.0)]), 0);
        assert_eq!(attention_choice(&[t(40.0), t(39.0), t(38.5)]), 0);
        assert_eq!(attention_choice(&[t(40.0), t(33.0), t(32.0)]), 1);
        assert_eq!(attention_choice(&[t(40.0), t(33.0), t(30.0)]), 2);
        assert_eq!(attention_choice(&[t(40.0), t(90.0), t(30.0)]), 2);
    }
}
