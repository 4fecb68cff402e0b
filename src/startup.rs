//! What start-up measures on the loaded model, and how: the flash
//! attention/KV type pairings the flags leave open and their timing, the KV
//! stream's size, and the prefill and decode rates (kept for the next start by
//! `calibration_cache`).

use crate::config::{FlashAttnSetting, KvTypeSetting};
use crate::engine::calibration::Calibration;
use crate::engine::served::{judged_timings, DepthTiming, JUDGED_DEEP_TOKENS};
use crate::engine::{self, EngineConfig};
use crate::ffi::{Context, ContextParams, FlashAttn, KvType, Model};
use std::sync::Arc;
use std::time::Instant;

/// Prompt tokens and decode steps of the start-up calibration (1-4 s on a
/// 2-core box: 3.5-3.8 s on an AMD EPYC Zen 1).
const CALIBRATION_PROMPT_TOKENS: usize = 128;
const CALIBRATION_STEPS: usize = 16;

/// The (flash attention, KV type) pairings `--calibrate-only` times, the
/// first being the one a start takes untimed, and kept unless another's worst
/// timing against the best is clearly less bad (`attention_choice`).
///
/// Flash attention off with K in q8_0 (V in f16: llama.cpp quantizes V only
/// with flash attention) comes first: it is never far from the fastest, on
/// every CPU measured. On a 2-core AMD EPYC (Zen 4), native and AVX2 builds,
/// its worst timing against the best was 1.11x and 1.22x (a decode step 128
/// tokens deep); flash attention on with a q8_0 cache decodes that step
/// 10-18 % faster but prefills 1,024 deep 1.38-1.48x slower, and llama-bench
/// on the AVX2 build prefilled 512 tokens 1,024 deep at 136 tok/s with it
/// against 230 (`bench/results/2026-12-05-zen4-e`). Then off with f16, on with
/// q8_0 (the chats' pairing: 17-22 % more tokens from 4 chat clients on an
/// AVX2 build, in half the memory of f16), on with f16.
pub fn attention_candidates(fa: FlashAttnSetting, kv: KvTypeSetting) -> Vec<(FlashAttn, KvType)> {
    let fa = match fa {
        FlashAttnSetting::Fixed(f) => vec![f],
        FlashAttnSetting::Measure => vec![FlashAttn::Off, FlashAttn::On],
    };
    fa.into_iter()
        .flat_map(|f| {
            let kv = match kv {
                KvTypeSetting::Fixed(k) => vec![k],
                KvTypeSetting::Measure if f == FlashAttn::Off => {
                    vec![KvType::Q8_0KeysF16Values, KvType::F16]
                }
                KvTypeSetting::Measure => vec![KvType::Q8_0, KvType::F16],
            };
            kv.into_iter().map(move |k| (f, k))
        })
        .filter(|&(f, k)| f != FlashAttn::Off || !k.needs_flash_attn())
        .collect()
}

/// `off/q8_0/f16`: flash attention, then the KV type's name.
pub fn pairing_name((fa, kv): (FlashAttn, KvType)) -> String {
    let fa = match fa {
        FlashAttn::Off => "off",
        FlashAttn::On => "on",
        FlashAttn::Auto => "auto",
    };
    format!("{fa}/{}", kv.name())
}

/// Flash attention and the KV type, by timing each of `candidates` on this
/// CPU and model: a decode step of each of the server's `parallel`
/// sequences and a prefill chunk, at a short chat's depth and at a long
/// one's, each in a context shaped as the server's, `base`, the pairings
/// taking turns (`time_pairings`). The first candidate is the default;
/// another is taken only if its worst timing against the best is
/// `FLASH_ATTN_GAIN_MIN` less bad than the first's (`attention_choice`).
/// The first candidate if the measurement fails. Also each candidate's
/// timings by depth (none if it failed), which the calibration cache keeps
/// for later starts to weigh by the tokens served (`engine::served`).
pub fn measure_attention(
    model: &Arc<Model>,
    base: &ContextParams,
    parallel: usize,
    candidates: &[(FlashAttn, KvType)],
) -> ((FlashAttn, KvType), Vec<Vec<DepthTiming>>) {
    use engine::calibration::{
        attention_choice, worst_ratios, FLASH_ATTN_CHUNK_TOKENS, FLASH_ATTN_DEEP_TOKENS,
        FLASH_ATTN_DEPTH_TOKENS, WHOLE_CHUNK_TOKENS,
    };
    let started = Instant::now();
    let name = pairing_name;
    // A short chat's depth and a long one's, as deep as a sequence's cells
    // allow.
    let per_seq = base.n_ctx as usize / parallel.max(1);
    let depths: Vec<usize> = [FLASH_ATTN_DEPTH_TOKENS, FLASH_ATTN_DEEP_TOKENS]
        .into_iter()
        .filter(|&d| d == FLASH_ATTN_DEPTH_TOKENS || d + FLASH_ATTN_CHUNK_TOKENS < per_seq)
        .collect();
    let by_depth = match time_pairings(model, base, parallel, candidates, &depths) {
        Ok(t) => t,
        Err(e) => {
            crate::say!(
                "sluice: attention: flash attention {} (measuring failed: {e})",
                name(candidates[0])
            );
            return (candidates[0], Vec::new());
        }
    };
    let timings: Vec<Vec<DepthTiming>> = by_depth
        .iter()
        .map(|t| {
            depths
                .iter()
                .zip(t)
                .map(|(&depth, &timing)| DepthTiming { depth, timing })
                .collect()
        })
        .collect();
    // Also a document's depth, on each pairing's line, as deep as a
    // sequence's cells allow.
    let deep = JUDGED_DEEP_TOKENS.min(per_seq);
    let judged = judged_timings(&timings, deep);
    let chosen = candidates[attention_choice(&judged)];
    let each: Vec<String> = candidates
        .iter()
        .zip(&by_depth)
        .zip(worst_ratios(&judged))
        .map(|((&c, t), worst)| format!("{} {} ({worst:.2}x)", name(c), at_each_depth(t)))
        .collect();
    let at: Vec<String> = depths.iter().map(usize::to_string).collect();
    crate::say!(
        "sluice: attention: flash attention/KV type {} (measured in {:.1} s at depths {}, judged by each pairing's worst timing against the best there and {deep} deep on the line through them; ms a token decoding {parallel} sequences/prefilling a {FLASH_ATTN_CHUNK_TOKENS}-token chunk (deepest, also /a {WHOLE_CHUNK_TOKENS}-token one, as a prompt alone is prefilled: not judged here), and that worst: {})",
        name(chosen),
        started.elapsed().as_secs_f64(),
        at.join(" and "),
        each.join(", ")
    );
    (chosen, timings)
}

/// Each of `candidates`' timings, depth by depth: every pairing in a
/// context shaped as the server's, `base` (its sequences, its streams' size:
/// the cost of a step depends on both), all alive at once so that they take
/// turns (`calibration::time_attention`).
fn time_pairings(
    model: &Arc<Model>,
    base: &ContextParams,
    parallel: usize,
    candidates: &[(FlashAttn, KvType)],
    depths: &[usize],
) -> Result<Vec<Vec<engine::calibration::AttentionTiming>>, String> {
    use engine::calibration::{prompt, time_attention, WHOLE_CHUNK_TOKENS};
    let mut ctxs = candidates
        .iter()
        .map(|&(flash_attn, kv_type)| {
            let p = ContextParams {
                // Big enough for what is timed (the chunks, a decode token
                // of every sequence); the server's 512 would give each of
                // the contexts alive together buffers for 512-token passes.
                n_batch: (WHOLE_CHUNK_TOKENS.max(parallel)) as u32,
                flash_attn,
                kv_type,
                ..base.clone()
            };
            Context::new(Arc::clone(model), &p)
        })
        .collect::<Result<Vec<_>, String>>()?;
    // The whole chunk at the deepest depth only, where it fits a stream.
    let per_seq = base.n_ctx as usize / parallel.max(1);
    let at_depth = depths
        .iter()
        .enumerate()
        .map(|(i, &d)| {
            let whole = i + 1 == depths.len() && d + WHOLE_CHUNK_TOKENS < per_seq;
            let prompt = prompt(model, d + WHOLE_CHUNK_TOKENS)?;
            time_attention(&mut ctxs, &prompt, d, parallel, base.kv_layout, whole)
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok((0..candidates.len())
        .map(|c| at_depth.iter().map(|timings| timings[c]).collect())
        .collect())
}

/// A pairing's timings for the log, depth by depth: `decode/prefill` ms a
/// token, and `/whole` where a whole chunk was timed.
fn at_each_depth(timings: &[engine::calibration::AttentionTiming]) -> String {
    let at: Vec<String> = timings
        .iter()
        .map(|t| {
            let whole = t
                .whole_prefill_s_per_token
                .map_or(String::new(), |s| format!("/{:.2}", s * 1e3));
            format!(
                "{:.2}/{:.2}{whole}",
                t.decode_s_per_token * 1e3,
                t.prefill_s_per_token * 1e3
            )
        })
        .collect();
    at.join(" ")
}

/// Cells of a KV stream holding at least `n`: an odd multiple of 256.
///
/// With flash attention off, V is stored transposed: one row of the stream's
/// cells per dimension and layer (5,760 rows for the default model). With
/// rows a multiple of 4 KiB long, every row crosses into a new page at the
/// same cell, every 2,048 cells, and the first write there faults in 5,760
/// pages at once (KV pages are given back when idle, `lazy_zero`): measured
/// ~100 ms more on that step on the development VM. Rows of an odd multiple
/// of 512 bytes start at 8 different offsets within a page, so the faults
/// come in 8 smaller groups, 256 cells apart.
pub fn staggered_cells(n: usize) -> usize {
    let blocks = n.div_ceil(256).max(1);
    (blocks | 1) * 256
}

/// Measures this machine on the loaded model before any request is taken.
pub fn start_up_calibration(
    model: &Model,
    ctx: &mut Context,
    cfg: &EngineConfig,
) -> Result<Calibration, String> {
    // Every calibration sequence must fit the context: prompt + warm-up + steps.
    let per_seq = cfg.n_ctx / cfg.parallel.max(1);
    let room = per_seq.saturating_sub(CALIBRATION_STEPS + engine::calibration::WARMUP_STEPS + 1);
    let n = CALIBRATION_PROMPT_TOKENS.min(room);
    if n < 8 {
        return Err(format!(
            "--ctx {} is too small to calibrate {} parallel sequences; give --mu-prefill and --mu-decode",
            cfg.n_ctx, cfg.parallel
        ));
    }
    let prompt = engine::calibration::prompt(model, n)?;
    engine::calibration::measure(ctx, &prompt, cfg.parallel, CALIBRATION_STEPS, cfg.kv_layout)
}

#[cfg(test)]
mod tests {
    use super::{attention_candidates, staggered_cells};
    use crate::config::{FlashAttnSetting, KvTypeSetting};
    use crate::ffi::{FlashAttn, KvType};

    #[test]
    fn attention_candidates_are_the_pairings_the_flags_leave_open() {
        use FlashAttn::{Off, On};
        use KvType::{Q8_0KeysF16Values as Q8K, F16, Q8_0};
        let m = (FlashAttnSetting::Measure, KvTypeSetting::Measure);
        assert_eq!(
            attention_candidates(m.0, m.1),
            vec![(Off, Q8K), (Off, F16), (On, Q8_0), (On, F16)]
        );
        assert_eq!(
            attention_candidates(FlashAttnSetting::Fixed(Off), KvTypeSetting::Measure),
            vec![(Off, Q8K), (Off, F16)]
        );
        assert_eq!(
            attention_candidates(FlashAttnSetting::Fixed(On), KvTypeSetting::Measure),
            vec![(On, Q8_0), (On, F16)]
        );
        assert_eq!(
            attention_candidates(FlashAttnSetting::Measure, KvTypeSetting::Fixed(F16)),
            vec![(Off, F16), (On, F16)]
        );
        // A quantized V cache never goes without flash attention.
        assert_eq!(
            attention_candidates(FlashAttnSetting::Measure, KvTypeSetting::Fixed(Q8_0)),
            vec![(On, Q8_0)]
        );
    }

    #[test]
    fn kv_streams_are_an_odd_number_of_256_cell_blocks() {
        assert_eq!(staggered_cells(1), 256);
        assert_eq!(staggered_cells(256), 256);
        assert_eq!(staggered_cells(257), 768);
        assert_eq!(staggered_cells(1024), 1280);
        assert_eq!(staggered_cells(8192), 8448);
        assert_eq!(staggered_cells(8448), 8448);
        for n in [16, 1000, 4096, 6000, 32768] {
            let c = staggered_cells(n);
            assert!(
                c >= n && c < n + 512 && c.is_multiple_of(256) && !(c / 256).is_multiple_of(2),
                "{n} -> {c}"
            );
        }
    }
}
