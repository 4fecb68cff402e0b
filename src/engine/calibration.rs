//! Measures this machine's service rates on the loaded model: prefill tokens per
//! second, and decode tokens per second at a batch size. Used at start-up (the
//! admission bounds are derived from it) and by `sluice calibrate`.

use crate::ffi::{Batch, Context, KvLayout, Model, Token};
use std::time::Instant;

/// Decode steps run untimed first, so that caches and the threadpool are warm.
pub const WARMUP_STEPS: usize = 4;
/// Prompt tokens each sequence holds while its decode steps are timed. A few
/// are as good as many: llama.cpp pads the cells a pass attends to a multiple
/// of 256, so every decode step timed here reads 256 cells either way, and
/// each token of context costs a prefill before the timing (on a 2-core AMD
/// EPYC Zen 1, 32 tokens in each of 5 sequences took ~1 s of a 5.3 s
/// calibration).
const DECODE_CONTEXT_TOKENS: usize = 8;

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
/// batch 1 and at batch `parallel`. 1-4 s on a 2-core box.
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
/// Below 64 on purpose: ggml's CPU flash attention computes a pass of at
/// least 64 queries in 64-by-64 tiles when K and V are both f16, and each
/// query alone otherwise. On a 2-core AMD EPYC (Zen 1, AVX2; llama-bench,
/// 1,024 deep) flash attention with an f16 cache prefilled 49, 81 and 89
/// tokens a second in passes of 32, 64 and 128 tokens, against 91 without it
/// at each size: a whole prompt costs about the same either way, a chunk
/// beside streams twice as much.
pub const FLASH_ATTN_CHUNK_TOKENS: usize = 32;
/// Tokens of the whole chunk also timed at the deepest depth: a prompt
/// prefilled with nothing decoding beside it goes in chunks of up to
/// `n_batch` (512), where ggml's tiled flash attention kernel does its best,
/// and the pairings rank otherwise than by small chunks. On the 2-core Xeon
/// with an AVX2 build (llama-bench, 1,024 deep), flash attention with an f16
/// cache prefilled 101 tokens a second in passes of 32 against 158 off with K
/// in q8_0, but 188 against 168 in passes of 256, and 186 against 158 in
/// passes of 512. 256 ranks them as 512 does at half the time, and keeps the
/// timing contexts' buffers small.
pub const WHOLE_CHUNK_TOKENS: usize = 256;
// The whole chunk's tokens hold the small chunk's (`time_attention`).
const _: () = assert!(WHOLE_CHUNK_TOKENS >= FLASH_ATTN_CHUNK_TOKENS);
/// Timed rounds of the whole chunk (the pairings taking turns; the fastest
/// counts): each is a second or more on a slow CPU.
const WHOLE_CHUNK_REPS: usize = 2;
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
    /// A prompt token of a `WHOLE_CHUNK_TOKENS` chunk, timed at the deepest
    /// depth only (`None` elsewhere, and in caches written before it was).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub whole_prefill_s_per_token: Option<f64>,
}

impl AttentionTiming {
    /// Seconds per token of a request that has as many prompt tokens as it
    /// generates (a chat's order of magnitude): what `worth_timing` compares.
    pub fn score(&self) -> f64 {
        self.decode_s_per_token + self.prefill_s_per_token
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
            whole_prefill_s_per_token: None,
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

/// Times a serving step's two passes at `depth` in each of `ctxs` (one
/// context a pairing, each shaped as the server's: its sequences, its
/// streams' size): one decode token for each of `n_seq` sequences, each
/// `depth` deep, and one `FLASH_ATTN_CHUNK_TOKENS` chunk of sequence 0 at that
/// depth; with `whole`, also a `WHOLE_CHUNK_TOKENS` chunk of it there (a
/// prompt prefilled alone). `prompt` holds `depth` tokens and at least the
/// chunks'. The shape matters: on an AVX2 build a 4-sequence decode step was
/// 25 % faster with flash attention while one sequence's token was not.
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
/// rounds of those `worth_timing` (`AttentionRound::fastest`), and then
/// `WHOLE_CHUNK_REPS` of the whole chunk. Leaves the sequences empty.
pub fn time_attention(
    ctxs: &mut [Context],
    prompt: &[Token],
    depth: usize,
    n_seq: usize,
    layout: KvLayout,
    whole: bool,
) -> Result<Vec<AttentionTiming>, String> {
    let (tail, whole_reps) = match whole {
        true => (WHOLE_CHUNK_TOKENS, WHOLE_CHUNK_REPS),
        false => (FLASH_ATTN_CHUNK_TOKENS, 0),
    };
    assert!(
        prompt.len() >= depth + tail,
        "a prompt deeper than the chunks"
    );
    for ctx in ctxs.iter_mut() {
        prepare_attention(ctx, &prompt[..depth], n_seq, layout)?;
    }
    let chunk = &prompt[depth..depth + FLASH_ATTN_CHUNK_TOKENS];
    let first = ctxs
        .iter_mut()
        .map(|ctx| attention_round(ctx, depth, chunk, n_seq))
        .collect::<Result<Vec<_>, String>>()?;
    let first: Vec<AttentionTiming> = first.iter().map(|r| r.timing(n_seq)).collect();
    let timed = worth_timing(&first);
    let mut rounds: Vec<Vec<AttentionRound>> = vec![Vec::new(); ctxs.len()];
    for _ in 0..FLASH_ATTN_REPS {
        for (i, ctx) in ctxs.iter_mut().enumerate().filter(|(i, _)| timed[*i]) {
            rounds[i].push(attention_round(ctx, depth, chunk, n_seq)?);
        }
    }
    let mut wholes = vec![f64::INFINITY; ctxs.len()];
    let whole_chunk = &prompt[depth..depth + tail];
    for _ in 0..whole_reps {
        for (i, ctx) in ctxs.iter_mut().enumerate().filter(|(i, _)| timed[*i]) {
            wholes[i] = wholes[i].min(chunk_seconds(ctx, depth, whole_chunk)?);
            ctx.pause_threads();
        }
    }
    for ctx in ctxs.iter_mut() {
        (0..n_seq as i32).for_each(|seq| ctx.clear_sequence(seq));
    }
    Ok(rounds
        .iter()
        .zip(first)
        .zip(wholes)
        .map(|((r, first), whole_s)| {
            let timing = match r.is_empty() {
                true => first,
                false => AttentionRound::fastest(r).timing(n_seq),
            };
            AttentionTiming {
                whole_prefill_s_per_token: whole_s
                    .is_finite()
                    .then(|| whole_s / whole_chunk.len() as f64),
                ..timing
            }
        })
        .collect())
}

/// Gives every one of `n_seq` sequences `prompt`: prefilled once, copied to
/// the others.
fn prepare_attention(
    ctx: &mut Context,
    prompt: &[Token],
    n_seq: usize,
    layout: KvLayout,
) -> Result<(), String> {
    time_prefill(ctx, prompt, 0)?;
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

/// Seconds of one pass at `depth` (`prepare_attention`'s), undone after it
/// in the first `n_seq` sequences: `batch`'s tokens, reading the last one's
/// logits.
fn pass_seconds(
    ctx: &mut Context,
    batch: &Batch,
    depth: usize,
    n_seq: usize,
) -> Result<f64, String> {
    let started = Instant::now();
    ctx.decode(batch)
        .map_err(|e| format!("flash attention measurement failed: {e:?}"))?;
    let _ = ctx.logits(batch, batch.len() - 1)[0];
    let s = started.elapsed().as_secs_f64();
    for seq in 0..n_seq as i32 {
        ctx.truncate_sequence(seq, depth as i32);
    }
    Ok(s)
}

/// Seconds of a pass that prefills `chunk` into sequence 0 at `depth`.
fn chunk_seconds(ctx: &mut Context, depth: usize, chunk: &[Token]) -> Result<f64, String> {
    let mut batch = Batch::new(ctx.n_batch());
    for (i, &t) in chunk.iter().enumerate() {
        batch.push(t, (depth + i) as i32, 0, i + 1 == chunk.len());
    }
    pass_seconds(ctx, &batch, depth, 1)
}

/// One round at `depth` (`prepare_attention`'s): `chunk`, then the decode
/// tokens, each pass undone after it. The threads are put to sleep at the
/// end, so that they do not poll beside the next context's round.
fn attention_round(
    ctx: &mut Context,
    depth: usize,
    chunk: &[Token],
    n_seq: usize,
) -> Result<AttentionRound, String> {
    let chunk_s = chunk_seconds(ctx, depth, chunk)?;
    let mut batch = Batch::new(ctx.n_batch());
    for seq in 0..n_seq as i32 {
        batch.push(chunk[0], depth as i32, seq, true);
    }
    let decode_s = pass_seconds(ctx, &batch, depth, n_seq)?;
    ctx.pause_threads();
    Ok(AttentionRound { decode_s, chunk_s })
}

/// For each pairing, its worst timing against the best of all: the largest,
/// over the depths and the two passes (a decode token, a prompt token), of
/// its seconds over the fewest any pairing took there. 1.0 for a pairing
/// that is the fastest at everything. `by_depth` holds each pairing's
/// timings, depth by depth, the same depths for all.
pub fn worst_ratios(by_depth: &[Vec<AttentionTiming>]) -> Vec<f64> {
    let depths = by_depth.iter().map(Vec::len).min().unwrap_or(0);
    let passes: [fn(&AttentionTiming) -> f64; 2] =
        [|t| t.decode_s_per_token, |t| t.prefill_s_per_token];
    let fastest = |d: usize, pass: fn(&AttentionTiming) -> f64| {
        by_depth
            .iter()
            .map(|t| pass(&t[d]))
            .fold(f64::INFINITY, f64::min)
    };
    by_depth
        .iter()
        .map(|t| {
            (0..depths)
                .flat_map(|d| passes.iter().map(move |&pass| (d, pass)))
                .map(|(d, pass)| pass(&t[d]) / fastest(d, pass))
                .fold(1.0, f64::max)
        })
        .collect()
}

/// Which of several timed pairings to take: the one whose worst timing
/// against the best is the least (`worst_ratios`), if that worst is at least
/// `FLASH_ATTN_GAIN_MIN` below the first candidate's; else the first.
///
/// Not a mean: `--calibrate-only` cannot know what the server will be
/// asked, and a pairing a little faster at one kind of token may be twice as
/// slow at another. On a 2-core AMD EPYC (Zen 4, 2026-12-05) flash
/// attention on with a q8_0 cache decoded 4 sequences 128 tokens deep 10 %
/// faster than off with K in q8_0, prefilled 1,024 deep 1.38x slower, and
/// came within the margin of it by the mean of the four timings; chosen so, a
/// 1,550-token prompt alone reached its first token in 9.4 s against 6.9 s.
/// The tokens served later weigh the timings as the server's own traffic
/// does (`served::choice_for`).
pub fn attention_choice(by_depth: &[Vec<AttentionTiming>]) -> usize {
    let worst = worst_ratios(by_depth);
    let best = (0..worst.len())
        .min_by(|&a, &b| worst[a].total_cmp(&worst[b]))
        .unwrap_or(0);
    match worst.first() {
        Some(&first) if worst[best] < first * (1.0 - FLASH_ATTN_GAIN_MIN) => best,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Timings as `--calibrate-only` logs them: decode/prefill ms a token at
    /// 128 tokens deep, then at 1,024.
    fn logged(ms: [f64; 4]) -> Vec<AttentionTiming> {
        let t = |decode_ms: f64, prefill_ms: f64| AttentionTiming {
            decode_s_per_token: decode_ms / 1e3,
            prefill_s_per_token: prefill_ms / 1e3,
            whole_prefill_s_per_token: None,
        };
        vec![t(ms[0], ms[1]), t(ms[2], ms[3])]
    }

    #[test]
    fn a_pairing_is_judged_by_its_worst_timing_against_the_best() {
        let by_depth = [logged([5.0, 4.0, 10.0, 8.0]), logged([6.0, 4.0, 10.0, 4.0])];
        let w = worst_ratios(&by_depth);
        assert!((w[0] - 2.0).abs() < 1e-12, "prefill 1,024 deep: 8 vs 4 ms");
        assert!((w[1] - 1.2).abs() < 1e-12, "decode 128 deep: 6 vs 5 ms");
        assert_eq!(worst_ratios(&[logged([5.0, 4.0, 10.0, 8.0])]), [1.0]);
        assert!(worst_ratios(&[]).is_empty());
    }

    #[test]
    fn the_2_core_epycs_timings_choose_flash_attention_off_with_k_in_q8_0() {
        // In candidate order: off/q8_0/f16, off/f16, on/q8_0, on/f16.
        // Zen 4, native build (bench/results/2026-12-05-zen4-g): on/q8_0
        // decodes 10 % faster 128 deep and prefills 1.38x slower 1,024 deep;
        // by the mean of the four it was within 5 % of off/q8_0/f16.
        let native = [
            logged([6.98, 3.77, 10.74, 5.30]),
            logged([7.18, 3.90, 12.45, 5.89]),
            logged([6.27, 3.84, 10.63, 7.32]),
            logged([6.41, 3.70, 12.31, 6.55]),
        ];
        assert_eq!(attention_choice(&native), 0);
        // Zen 4, AVX2 build (bench/results/2026-12-05-zen4-e): on/q8_0
        // decodes 18 % faster 128 deep, prefills 1.48x slower 1,024 deep.
        let avx2 = [
            logged([7.22, 3.72, 8.84, 4.41]),
            logged([7.67, 3.82, 12.12, 4.95]),
            logged([5.93, 3.68, 8.68, 6.51]),
            logged([6.49, 3.77, 12.06, 7.78]),
        ];
        assert_eq!(attention_choice(&avx2), 0);
        // Whichever comes first.
        let mut first_on = native.clone();
        first_on.swap(0, 2);
        assert_eq!(attention_choice(&first_on), 2);
    }

    #[test]
    fn another_pairing_is_taken_only_when_its_worst_is_clearly_less_bad() {
        let first = logged([6.0, 4.0, 10.0, 6.0]);
        // Faster at everything: its worst is 1.0, the first's 1.2.
        let faster = logged([5.0, 4.0, 10.0, 5.0]);
        assert_eq!(attention_choice(&[first.clone(), faster.clone()]), 1);
        // 1.2 against the first's 1.2: no better.
        let other = logged([5.0, 4.8, 10.0, 5.0]);
        assert_eq!(attention_choice(&[first.clone(), other]), 0);
        // Within the margin: 1.04 against 1.08 (the first's 5.4 vs 5.0).
        let close = logged([6.24, 4.0, 10.0, 5.0]);
        let first = logged([6.0, 4.0, 10.0, 5.4]);
        assert_eq!(attention_choice(&[first.clone(), close]), 0);
        // A tie, and the first pairing alone, stay with the first.
        assert_eq!(attention_choice(&[first.clone(), first.clone()]), 0);
        assert_eq!(attention_choice(&[first]), 0);
        assert_eq!(attention_choice(&[]), 0);
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
            whole_prefill_s_per_token: None,
        };
        assert_eq!(
            worth_timing(&[t(20.0), t(18.0), t(36.0), t(36.1)]),
            [true, true, true, false]
        );
        assert_eq!(worth_timing(&[t(5.0)]), [true]);
    }
}
