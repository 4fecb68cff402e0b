//! The engine's llama contexts: the main one, with the attention pairing
//! chosen for this machine, and optionally a second one on the same model
//! and threadpool for short requests (`--short-cells`), with flash attention
//! on and an f16 cache.
//!
//! Why two: on a CPU whose kernels favour neither pairing outright (the
//! 2-core AVX2 Zen 1 of bench/results/2026-12-06-zen1/), flash attention
//! with an f16 cache decodes a shallow stream 13-18 % faster (one fused op
//! per layer where the other pairing runs five, and masked cells skipped),
//! and takes a whole prompt as fast; but a small prompt chunk deep in a long
//! prompt, what the ITL target cuts one into beside streams, costs it 2-3x
//! (ggml's tiled kernel needs 64 queries a pass). One pairing cannot serve
//! both chats and a long prompt beside them at the peer's speed; a request
//! whose prompt and answer fit `short_cells` is served by the second
//! context, every other one by the main, with two exceptions (`place`): a
//! request that starts with nothing else running goes to the second one
//! whatever its length where `--calibrate-only` timed whole chunks faster
//! there (its prompt is prefilled in whole chunks) and its prompt pays for
//! its answer's decoding there (`goes_alone`), and one whose prompt
//! would be cut into small chunks deep beside streams there goes to the
//! main one. Each sequence id has a *home*: the
//! context its cells are in. Sequences of one pass share a home (a pass is
//! one `llama_decode`), so a step whose decoding streams live in both makes
//! one more pass over the weights.

use crate::ffi::{AbortWatch, Batch, Context, DecodeError};
use std::sync::atomic::AtomicU8;
use std::sync::Arc;

/// The main context's home.
pub const MAIN: usize = 0;
/// The short requests' context's home.
pub const SHORT: usize = 1;

/// Prompt tokens to prefill (those not reused from the short requests'
/// context's prefix cache) of a request that joins streams running there.
/// Beside streams a prompt goes in small chunks under the ITL target, and
/// there flash attention with an f16 cache costs more the deeper the chunk:
/// on the 2-core Xeon with an AVX2 build (llama-bench, 32-token passes) it
/// prefilled 248 tokens a second at the start of a sequence against 237 off
/// with K in q8_0, 174 against 207 from 256 deep, 130 against 190 from 512,
/// and 100 against 172 from 896. A prompt of up to this many breaks even.
pub const SHORT_CHUNKED_PROMPT_MAX: usize = 256;

/// Cells of the short requests' context's streams when a prompt alone is
/// prefilled faster there (`Fit::alone`), unless `--short-cells` is more: a
/// document pasted into a chat (the side-by-side's long prompts are
/// 500-2,000 tokens). Each cell is f16 and resident only once written, but
/// the memory bound said at start counts them all.
pub const LONE_CELLS: usize = 4096;

/// What `place` needs of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fit {
    /// Its prompt and answer fit `--short-cells`.
    pub short: bool,
    /// It fits the short requests' context's streams, a prompt alone is
    /// prefilled faster there, and its prompt pays for its answer there
    /// (`Contexts::goes_alone`).
    pub alone: bool,
    /// Its prompt tokens to prefill are at most `SHORT_CHUNKED_PROMPT_MAX`.
    pub shallow: bool,
}

/// Where a request runs, given what runs now (`running`, by home):
/// - nothing: the short requests' context if it fits there (`short`), or if
///   its prompt, prefilled alone in whole chunks, goes faster there
///   (`alone`: on the 2-core Xeon with an AVX2 build, a 1,024-deep
///   512-token chunk at 186 tokens a second against 158);
/// - sequences in the main context only: the main one, since a step whose
///   decode tokens are in both contexts makes one more pass over the
///   weights (on the Zen 1, a decode pass of a few tokens is ~15 ms; what
///   the pairing saves a short request is 13-18 % of its own);
/// - sequences in the short one: there if it fits and its prompt is
///   `shallow` (its chunks beside the streams stay cheap there), else the
///   main one.
pub fn place(fit: Fit, running: [bool; 2]) -> usize {
    match running {
        [false, false] if fit.short || fit.alone => SHORT,
        [false, false] | [true, false] => MAIN,
        _ if fit.short && fit.shallow => SHORT,
        _ => MAIN,
    }
}

pub struct Contexts {
    /// `[main]`, or `[main, short]`.
    ctxs: Vec<Context>,
    /// Each sequence id's context.
    home: Vec<usize>,
    /// The context of the last `decode_watching`, whose outputs are read.
    last: usize,
    /// Most cells of a request served by the short requests' context.
    short_cells: usize,
    /// Where a prompt alone is prefilled faster there: the most cells of a
    /// request it serves when nothing else runs (its streams'), and the
    /// answer tokens one prompt token pays for there (`served::lone_trade`).
    lone: Option<(usize, f64)>,
}

impl Contexts {
    /// One context for every request.
    pub fn one(main: Context) -> Contexts {
        Contexts {
            ctxs: vec![main],
            home: Vec::new(),
            last: MAIN,
            short_cells: 0,
            lone: None,
        }
    }

    /// `main`, and `short` for the requests of at most `short_cells` cells
    /// (its streams hold at least that many), and, with `alone` (the answer
    /// tokens a prompt token pays for there), for a request its streams
    /// hold that starts with nothing else running and whose prompt pays for
    /// its answer; `n_seq` sequence ids, each at home in `main` until placed.
    pub fn with_short(
        main: Context,
        short: Context,
        n_seq: usize,
        short_cells: usize,
        alone: Option<f64>,
    ) -> Contexts {
        let stream = short.n_ctx_seq();
        assert!(stream >= short_cells, "short streams hold short requests");
        Contexts {
            ctxs: vec![main, short],
            home: vec![MAIN; n_seq],
            last: MAIN,
            short_cells,
            lone: alone.map(|trade| (stream, trade)),
        }
    }

    /// Most cells of a request served by the short requests' context, if
    /// there is one.
    pub fn short_cells(&self) -> Option<usize> {
        (self.ctxs.len() > SHORT).then_some(self.short_cells)
    }

    /// Where a prompt alone is prefilled faster in the short requests'
    /// context: the most cells of a request it serves when nothing else
    /// runs, and the answer tokens one prompt token pays for there.
    pub fn lone(&self) -> Option<(usize, f64)> {
        self.lone
    }

    /// Whether a request that starts alone goes to the short requests'
    /// context (`Fit::alone`): a prompt alone is prefilled faster there, its
    /// `cells` (prompt + answer) fit the streams there, and its `prompt`
    /// tokens' gain pays for its answer tokens' dearer decoding there
    /// (`served::lone_trade`; a short prompt with a long answer, one of the
    /// side-by-side's head-of-line streams, would only lose).
    pub fn goes_alone(&self, cells: usize, prompt: usize) -> bool {
        let answer = cells.saturating_sub(prompt);
        self.lone
            .is_some_and(|(most, trade)| cells <= most && prompt as f64 * trade >= answer as f64)
    }

    /// Cells each stream of the short requests' context holds, if there is
    /// one.
    pub fn short_stream_cells(&self) -> Option<usize> {
        self.ctxs.get(SHORT).map(Context::n_ctx_seq)
    }

    /// The context sequence `seq`'s cells are in.
    pub fn home(&self, seq: usize) -> usize {
        self.home.get(seq).copied().unwrap_or(MAIN)
    }

    /// Moves sequence `seq` to context `home`, freeing whatever it held in
    /// the other.
    pub fn set_home(&mut self, seq: usize, home: usize) {
        assert!(home < self.ctxs.len(), "no context {home}");
        let old = self.home(seq);
        if old != home {
            self.ctxs[old].clear_sequence(seq as i32);
            self.home[seq] = home;
        }
    }

    fn of(&mut self, seq: i32) -> &mut Context {
        let home = self.home(seq as usize);
        &mut self.ctxs[home]
    }

    /// The main context (start-up, calibration).
    pub fn main(&mut self) -> &mut Context {
        &mut self.ctxs[MAIN]
    }

    /// The context the last pass ran in, whose logits are read.
    pub fn last(&mut self) -> &mut Context {
        &mut self.ctxs[self.last]
    }

    pub fn n_batch(&self) -> usize {
        self.ctxs[MAIN].n_batch()
    }

    pub fn abort_handle(&self) -> Arc<AbortWatch> {
        self.ctxs[MAIN].abort_handle()
    }

    /// Decodes `batch`, all of whose sequences are at home in `home`.
    pub fn decode_watching(
        &mut self,
        home: usize,
        batch: &Batch,
        watch: &[Arc<AtomicU8>],
    ) -> Result<(), DecodeError> {
        self.last = home;
        self.ctxs[home].decode_watching(batch, watch)
    }

    pub fn graphs_reused(&self) -> u64 {
        self.ctxs.iter().map(Context::graphs_reused).sum()
    }

    pub fn set_embeddings(&mut self, on: bool) {
        self.ctxs.iter_mut().for_each(|c| c.set_embeddings(on));
    }

    pub fn embedding(&mut self, batch: &Batch, i: usize) -> &[f32] {
        self.last().embedding(batch, i)
    }

    pub fn clear_all_cells(&mut self) {
        self.ctxs.iter_mut().for_each(Context::clear_all_cells);
    }

    pub fn clear_sequence(&mut self, seq: i32) {
        self.of(seq).clear_sequence(seq);
    }

    /// Within one context only: `dst` is moved to `src`'s first.
    pub fn share_cells(&mut self, src: i32, dst: i32, p0: i32, p1: i32) {
        let home = self.home(src as usize);
        if (dst as usize) < self.home.len() {
            self.set_home(dst as usize, home);
        }
        self.ctxs[home].share_cells(src, dst, p0, p1);
    }

    pub fn truncate_sequence(&mut self, seq: i32, from: i32) {
        self.of(seq).truncate_sequence(seq, from);
    }

    pub fn sequence_state_size(&mut self, seq: i32) -> usize {
        self.of(seq).sequence_state_size(seq)
    }

    pub fn save_sequence(&mut self, seq: i32) -> Vec<u8> {
        self.of(seq).save_sequence(seq)
    }

    /// False also for a state saved in the other context (its KV types
    /// differ: llama.cpp refuses it).
    pub fn restore_sequence(&mut self, seq: i32, state: &[u8]) -> bool {
        self.of(seq).restore_sequence(seq, state)
    }

    pub fn sequence_pos_max(&self, seq: i32) -> i32 {
        self.ctxs[self.home(seq as usize)].sequence_pos_max(seq)
    }

    /// The next position of `seq`'s stream in context `home`, whether or not
    /// the sequence lives there (a stream it left is empty: 0), while that
    /// stream has a cell free for it; `None` when it has none.
    pub fn next_pos_in(&self, home: usize, seq: i32) -> Option<i32> {
        let ctx = &self.ctxs[home];
        let next = ctx.sequence_pos_max(seq) + 1;
        ((next as usize) < ctx.n_ctx_seq()).then_some(next)
    }

    /// Frees the cells of `seq` at positions `from..` in context `home`.
    pub fn truncate_in(&mut self, home: usize, seq: i32, from: i32) {
        self.ctxs[home].truncate_sequence(seq, from);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_request_joins_the_main_context_only_when_it_alone_runs() {
        let fit = |short, alone, shallow| Fit {
            short,
            alone,
            shallow,
        };
        let all = [[false, false], [true, false], [false, true], [true, true]];
        // Too long for the short context and not alone: the main one.
        for running in all {
            assert_eq!(place(fit(false, false, true), running), MAIN);
        }
        let chat = fit(true, false, true);
        assert_eq!(place(chat, [false, false]), SHORT, "nothing runs");
        assert_eq!(place(chat, [false, true]), SHORT);
        assert_eq!(place(chat, [true, true]), SHORT, "both pass anyway");
        assert_eq!(place(chat, [true, false]), MAIN, "no second pass for it");
    }

    #[test]
    fn a_long_prompt_goes_where_it_is_prefilled_faster() {
        let fit = |short, alone, shallow| Fit {
            short,
            alone,
            shallow,
        };
        // Alone, in whole chunks: where the whole chunks were faster.
        let long = fit(false, true, false);
        assert_eq!(place(long, [false, false]), SHORT);
        assert_eq!(place(fit(false, false, false), [false, false]), MAIN);
        // Beside streams, in small chunks: never deep in the short context.
        for running in [[true, false], [false, true], [true, true]] {
            assert_eq!(place(long, running), MAIN, "{running:?}");
        }
        let deep = fit(true, false, false);
        assert_eq!(place(deep, [false, false]), SHORT, "alone: whole chunks");
        assert_eq!(place(deep, [false, true]), MAIN, "small chunks, deep");
        assert_eq!(place(deep, [true, true]), MAIN);
    }
}
