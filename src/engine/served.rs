//! What the engine served, by depth, and the attention pairing that serves
//! it cheapest.
//!
//! `--calibrate-only` times each flash attention/KV type pairing at a short
//! chat's depth and at a long one's, and chooses the pairing whose worst
//! timing against the best is least bad: it cannot know what this server
//! will be asked. The engine counts what it
//! computes: prompt tokens and decode tokens, and for each how deep in its
//! sequence it is (the cells its attention reads). A stop keeps these counts
//! beside the timings (`calibration_cache`), and the next start weighs the
//! timings by them. A pairing's cost per token grows linearly with depth
//! (attention reads every cell before the token), so its cost for the tokens
//! served is the line through its timings read at the mean depth of each
//! kind, times the tokens of that kind. The pairing in use stays unless
//! another costs `FLASH_ATTN_GAIN_MIN` less: a change costs a restart's
//! worth of prefix cache and rates measured under the other pairing.
//!
//! Pure: the engine counts (`PassCount`, into `Metrics::record_attention`),
//! start-up decides.

use super::calibration::{AttentionTiming, FLASH_ATTN_GAIN_MIN};
use serde::{Deserialize, Serialize};

/// Tokens served before they weigh the timings: a few requests' worth, so
/// that a start that served a health check and stopped does not choose.
pub const SERVED_TOKENS_MIN: f64 = 1_000.0;
/// Tokens of history kept: beyond it the older counts shrink, so that the
/// choice follows about the last million tokens served.
pub const SERVED_TOKENS_KEPT: f64 = 1_000_000.0;
/// The line through a pairing's timings is read at most this many times as
/// deep as its deepest timing.
const EXTRAPOLATION_MAX: f64 = 8.0;

/// Tokens computed in generation passes, and their mean depth.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Served {
    pub prefill_tokens: f64,
    pub prefill_depth_mean: f64,
    pub decode_tokens: f64,
    pub decode_depth_mean: f64,
}

impl Served {
    /// From counts: tokens, and the sum over them of the cells before each.
    pub fn from_counts(prefill: (u64, u64), decode: (u64, u64)) -> Served {
        let mean = |(n, sum): (u64, u64)| if n == 0 { 0.0 } else { sum as f64 / n as f64 };
        Served {
            prefill_tokens: prefill.0 as f64,
            prefill_depth_mean: mean(prefill),
            decode_tokens: decode.0 as f64,
            decode_depth_mean: mean(decode),
        }
    }

    pub fn tokens(&self) -> f64 {
        self.prefill_tokens + self.decode_tokens
    }

    /// Finite, not negative (a hand-edited cache file may hold anything).
    pub fn is_usable(&self) -> bool {
        [
            self.prefill_tokens,
            self.prefill_depth_mean,
            self.decode_tokens,
            self.decode_depth_mean,
        ]
        .iter()
        .all(|v| v.is_finite() && *v >= 0.0)
    }

    /// These counts followed by `newer`'s, scaled down to
    /// `SERVED_TOKENS_KEPT` tokens when they are more.
    pub fn then(self, newer: Served) -> Served {
        let mean = |(n, d): (f64, f64), (m, e): (f64, f64)| {
            if n + m > 0.0 {
                (n * d + m * e) / (n + m)
            } else {
                0.0
            }
        };
        let mut s = Served {
            prefill_tokens: self.prefill_tokens + newer.prefill_tokens,
            prefill_depth_mean: mean(
                (self.prefill_tokens, self.prefill_depth_mean),
                (newer.prefill_tokens, newer.prefill_depth_mean),
            ),
            decode_tokens: self.decode_tokens + newer.decode_tokens,
            decode_depth_mean: mean(
                (self.decode_tokens, self.decode_depth_mean),
                (newer.decode_tokens, newer.decode_depth_mean),
            ),
        };
        let total = s.tokens();
        if total > SERVED_TOKENS_KEPT {
            let k = SERVED_TOKENS_KEPT / total;
            s.prefill_tokens *= k;
            s.decode_tokens *= k;
        }
        s
    }
}

/// One pass's tokens, by kind: how many, and the sum of their depths (the
/// cells before each in its sequence).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PassCount {
    pub prefill: (u64, u64),
    pub decode: (u64, u64),
}

impl PassCount {
    /// A decode token at position `depth`.
    pub fn decode(&mut self, depth: usize) {
        self.decode = (self.decode.0 + 1, self.decode.1 + depth as u64);
    }

    /// A prompt chunk of `n` tokens from position `start`.
    pub fn chunk(&mut self, start: usize, n: usize) {
        let (start, n) = (start as u64, n as u64);
        let depths = n * start + n * n.saturating_sub(1) / 2;
        self.prefill = (self.prefill.0 + n, self.prefill.1 + depths);
    }
}

/// A pairing's per-token timing at one depth, as `--calibrate-only` measured
/// it (`calibration::time_attention`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DepthTiming {
    pub depth: usize,
    #[serde(flatten)]
    pub timing: AttentionTiming,
}

impl DepthTiming {
    fn is_usable(&self) -> bool {
        let ok = |v: f64| v.is_finite() && v > 0.0;
        ok(self.timing.decode_s_per_token) && ok(self.timing.prefill_s_per_token)
    }
}

/// A pairing's per-token timing `depth` tokens deep: on the line through its
/// shallowest and deepest timings, read no shallower than the first and at
/// most `EXTRAPOLATION_MAX` times as deep as the last, and never below the
/// cheaper of the two (a line that falls with depth is noise).
pub fn at_depth(timings: &[DepthTiming], depth: f64) -> AttentionTiming {
    let (Some(first), Some(last)) = (timings.first(), timings.last()) else {
        return AttentionTiming {
            decode_s_per_token: f64::INFINITY,
            prefill_s_per_token: f64::INFINITY,
            whole_prefill_s_per_token: None,
        };
    };
    let (d0, d1) = (first.depth as f64, last.depth as f64);
    let (first, last) = (first.timing, last.timing);
    let d = depth.clamp(d0, d1.max(d0) * EXTRAPOLATION_MAX);
    let line = |y0: f64, y1: f64| {
        let y = if d1 > d0 {
            y0 + (y1 - y0) * (d - d0) / (d1 - d0)
        } else {
            y0
        };
        y.max(y0.min(y1))
    };
    AttentionTiming {
        decode_s_per_token: line(first.decode_s_per_token, last.decode_s_per_token),
        prefill_s_per_token: line(first.prefill_s_per_token, last.prefill_s_per_token),
        whole_prefill_s_per_token: None,
    }
}

/// A document's depth, where `--calibrate-only` also judges the pairings
/// (`judged_timings`): on the line through their two timings, not timed
/// (prefilling it in each pairing would take most of a first start's few
/// seconds). Two timings 1,024 deep at most do not tell a pairing whose cost
/// climbs steeply with depth: on the 2-core Xeon's AVX2 build (2026-12-07)
/// flash attention on with a q8_0 cache prefilled 32-token chunks 1,024
/// deep 1.11-1.15x slower than off with K in q8_0 and decoded 128 deep
/// ~1.24x faster, so judged at those two it won in 5 of 8 runs' timings
/// (bench/results/2026-12-07-xeon-s47/calibrate/); 4,096 deep
/// llama-bench had it at 52.8 tok/s against 78.8 (the line through the two
/// timings: 56 against 74), and with it a ~6,300-token prompt beside two
/// streams reached its first token in 135.7 s against 88.1 s.
pub const JUDGED_DEEP_TOKENS: usize = 4_096;

/// Each pairing's timings as `calibration::attention_choice` judges them:
/// those timed, depth by depth, then the line through them read `deep`
/// tokens deep (`at_depth`) where that is deeper than the last.
pub fn judged_timings(timings: &[Vec<DepthTiming>], deep: usize) -> Vec<Vec<AttentionTiming>> {
    timings
        .iter()
        .map(|t| {
            let mut judged: Vec<AttentionTiming> = t.iter().map(|d| d.timing).collect();
            if t.last().is_some_and(|last| deep > last.depth) {
                judged.push(at_depth(t, deep as f64));
            }
            judged
        })
        .collect()
}

/// Seconds a pairing with `timings` would have spent on the tokens `served`.
pub fn served_cost_s(timings: &[DepthTiming], served: &Served) -> f64 {
    let prefill = at_depth(timings, served.prefill_depth_mean).prefill_s_per_token;
    let decode = at_depth(timings, served.decode_depth_mean).decode_s_per_token;
    served.prefill_tokens * prefill + served.decode_tokens * decode
}

/// Which pairing serves `served` cheapest, given each one's `timings` (in
/// candidate order): `kept`, unless another costs `FLASH_ATTN_GAIN_MIN`
/// less. `kept` too when too few tokens were served, or a pairing's timings
/// are missing or unusable.
pub fn choice_for(timings: &[Vec<DepthTiming>], served: &Served, kept: usize) -> usize {
    let usable = kept < timings.len()
        && served.is_usable()
        && served.tokens() >= SERVED_TOKENS_MIN
        && timings
            .iter()
            .all(|t| !t.is_empty() && t.iter().all(DepthTiming::is_usable));
    if !usable {
        return kept;
    }
    let costs: Vec<f64> = timings.iter().map(|t| served_cost_s(t, served)).collect();
    let best = (0..costs.len())
        .min_by(|&a, &b| costs[a].total_cmp(&costs[b]))
        .unwrap_or(kept);
    if costs[best] < costs[kept] * (1.0 - FLASH_ATTN_GAIN_MIN) {
        best
    } else {
        kept
    }
}

/// Whether a prompt prefilled alone goes faster with the pairing timed
/// `other` than with the one timed `main`: both were timed prefilling a
/// whole chunk (`calibration::WHOLE_CHUNK_TOKENS`) as deep as each other,
/// and `other` took `FLASH_ATTN_GAIN_MIN` less a token. False when either
/// lacks that timing (a cache written before it was taken).
pub fn prefills_whole_faster(main: &[DepthTiming], other: &[DepthTiming]) -> bool {
    let deepest = |t: &[DepthTiming]| {
        let last = t.last()?;
        let s = last.timing.whole_prefill_s_per_token?;
        (s.is_finite() && s > 0.0).then_some((last.depth, s))
    };
    match (deepest(main), deepest(other)) {
        (Some((d, m)), Some((e, o))) if d == e => o < m * (1.0 - FLASH_ATTN_GAIN_MIN),
        _ => false,
    }
}

/// Where a prompt alone goes faster with `other` (`prefills_whole_faster`):
/// how many answer tokens one prompt token pays for there. Its answer is
/// decoded there too, at `other`'s decode cost, which may be dearer (the
/// Xeon's AVX2 build, 1,024 deep: 12.63 against 11.60 ms a token with flash
/// attention and f16): the whole-chunk gain a prompt token, over the decode
/// loss an answer token, at the deepest depth timed. Infinite where decoding
/// there costs no more; `None` where a prompt alone is not faster there.
pub fn lone_trade(main: &[DepthTiming], other: &[DepthTiming]) -> Option<f64> {
    if !prefills_whole_faster(main, other) {
        return None;
    }
    let (m, o) = (main.last()?.timing, other.last()?.timing);
    let gain = m.whole_prefill_s_per_token? - o.whole_prefill_s_per_token?;
    let loss = o.decode_s_per_token - m.decode_s_per_token;
    Some(if loss > 0.0 {
        gain / loss
    } else {
        f64::INFINITY
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(depth: usize, decode_ms: f64, prefill_ms: f64) -> DepthTiming {
        DepthTiming {
            depth,
            timing: AttentionTiming {
                decode_s_per_token: decode_ms / 1e3,
                prefill_s_per_token: prefill_ms / 1e3,
                whole_prefill_s_per_token: None,
            },
        }
    }

    /// The 2-core EPYC's shape: flash attention on ties at a short chat's
    /// depth and is twice as dear deep in a context.
    fn epyc() -> Vec<Vec<DepthTiming>> {
        vec![
            vec![t(128, 8.1, 6.1), t(1024, 12.0, 18.0)],
            vec![t(128, 8.5, 5.7), t(1024, 10.0, 9.0)],
        ]
    }

    fn served(prefill: f64, prefill_depth: f64, decode: f64, decode_depth: f64) -> Served {
        Served {
            prefill_tokens: prefill,
            prefill_depth_mean: prefill_depth,
            decode_tokens: decode,
            decode_depth_mean: decode_depth,
        }
    }

    #[test]
    fn the_timings_are_read_on_their_line_within_bounds() {
        let line = [t(128, 10.0, 4.0), t(1024, 20.0, 12.0)];
        let at = |d: f64| at_depth(&line, d);
        assert!((at(576.0).decode_s_per_token - 0.015).abs() < 1e-12);
        assert!((at(576.0).prefill_s_per_token - 0.008).abs() < 1e-12);
        assert_eq!(at(0.0), at(128.0), "no shallower than the first timing");
        assert!((at(1920.0).prefill_s_per_token - 0.020).abs() < 1e-12);
        assert_eq!(at(1e9), at(8.0 * 1024.0), "extrapolated at most 8x deeper");
        let falling = [t(128, 10.0, 4.0), t(1024, 9.0, 3.0)];
        assert!((at_depth(&falling, 5000.0).decode_s_per_token - 0.009).abs() < 1e-12);
        let one = [t(128, 10.0, 4.0)];
        assert_eq!(at_depth(&one, 4000.0), at_depth(&one, 128.0));
        assert!(at_depth(&[], 100.0).prefill_s_per_token.is_infinite());
    }

    #[test]
    fn the_pairings_are_also_judged_a_documents_depth_deep_on_their_lines() {
        use crate::engine::calibration::{attention_choice, worst_ratios};
        // The Xeon's AVX2 build, `--calibrate-only` 2026-12-07 (ms a token at
        // 128 and 1,024 deep; candidate order off/q8_0/f16, off/f16, on/q8_0,
        // on/f16): on/q8_0 decodes 1.24x faster 128 deep, prefills 1.11x
        // slower 1,024 deep, and 4,096 deep (llama-bench) 1.49x slower.
        let xeon_avx2 = vec![
            vec![t(128, 8.00, 4.27), t(1024, 11.95, 6.35)],
            vec![t(128, 8.29, 4.33), t(1024, 14.26, 6.76)],
            vec![t(128, 6.44, 3.94), t(1024, 10.30, 7.04)],
            vec![t(128, 6.60, 4.16), t(1024, 12.71, 9.04)],
        ];
        let timed: Vec<Vec<AttentionTiming>> = xeon_avx2
            .iter()
            .map(|p| p.iter().map(|d| d.timing).collect())
            .collect();
        assert_eq!(attention_choice(&timed), 2, "the two timed depths alone");
        let judged = judged_timings(&xeon_avx2, JUDGED_DEEP_TOKENS);
        assert_eq!(judged[2].len(), 3);
        assert_eq!(judged[2][2], at_depth(&xeon_avx2[2], 4096.0));
        // 4,096 deep on its line: 17.7 against 13.5 ms a prompt token.
        let worst = worst_ratios(&judged);
        assert!((1.30..1.32).contains(&worst[2]), "{worst:?}");
        assert!((1.24..1.25).contains(&worst[0]), "{worst:?}");
        assert_eq!(attention_choice(&judged), 0);
        // No deeper than the last timing: the timings as they are.
        let shallow = judged_timings(&xeon_avx2, 1024);
        assert_eq!(shallow, timed);
        assert_eq!(attention_choice(&shallow), 2);
    }

    #[test]
    fn the_tokens_served_choose_the_pairing_that_costs_them_least() {
        // Chats a few hundred tokens deep: a tie, the kept pairing stays,
        // whichever it is.
        let chats = served(50_000.0, 150.0, 40_000.0, 250.0);
        assert_eq!(choice_for(&epyc(), &chats, 0), 0);
        assert_eq!(choice_for(&epyc(), &chats, 1), 1);
        // Documents thousands of tokens deep: off, by far.
        let documents = served(200_000.0, 3_000.0, 10_000.0, 6_000.0);
        assert_eq!(choice_for(&epyc(), &documents, 0), 1);
        assert_eq!(choice_for(&epyc(), &documents, 1), 1);
        // Too little served: the kept pairing, whatever it was.
        let few = served(900.0, 3_000.0, 50.0, 6_000.0);
        assert_eq!(choice_for(&epyc(), &few, 0), 0);
        // Missing or broken timings, a broken count: the kept pairing.
        assert_eq!(choice_for(&epyc()[..1], &documents, 0), 0);
        let mut broken = epyc();
        broken[1][0].timing.prefill_s_per_token = f64::NAN;
        assert_eq!(choice_for(&broken, &documents, 0), 0);
        assert_eq!(choice_for(&epyc(), &served(-1.0, 0.0, 5e3, 0.0), 0), 0);
        assert_eq!(choice_for(&epyc(), &documents, 2), 2);
    }

    #[test]
    fn a_pass_counts_each_token_at_its_own_depth() {
        let mut c = PassCount::default();
        c.chunk(5, 3);
        c.chunk(0, 1);
        c.chunk(9, 0);
        c.decode(40);
        c.decode(0);
        assert_eq!(c.prefill, (4, 5 + 6 + 7));
        assert_eq!(c.decode, (2, 40));
    }

    #[test]
    fn counts_add_up_and_the_oldest_fade_beyond_what_is_kept() {
        let s = Served::from_counts((100, 100 * 99 / 2), (10, 10 * 105));
        assert_eq!(s, served(100.0, 49.5, 10.0, 105.0));
        assert_eq!(Served::from_counts((0, 0), (0, 0)), Served::default());
        let both = s.then(served(300.0, 449.5, 0.0, 0.0));
        assert_eq!(both, served(400.0, 349.5, 10.0, 105.0));
        assert_eq!(Served::default().then(s), s);
        let old = served(1_000_000.0, 100.0, 0.0, 0.0);
        let kept = old.then(served(1_000_000.0, 3_000.0, 0.0, 0.0));
        assert_eq!(kept.tokens(), SERVED_TOKENS_KEPT);
        assert!((kept.prefill_depth_mean - 1_550.0).abs() < 1e-9);
        let next = kept.then(served(1_000_000.0, 3_000.0, 0.0, 0.0));
        assert!(
            (next.prefill_depth_mean - 2_275.0).abs() < 1e-9,
            "the old half fades"
        );
    }

    #[test]
    fn a_prompt_alone_goes_faster_only_where_whole_chunks_were_timed_faster() {
        let whole = |depth, ms: Option<f64>| {
            let mut d = t(depth, 10.0, 6.0);
            d.timing.whole_prefill_s_per_token = ms.map(|ms| ms / 1e3);
            d
        };
        // The Xeon's AVX2 build, 1,024 deep: 5.4 ms a token (f16, flash
        // attention) against 6.3 (off, K in q8_0).
        let main = [t(128, 8.0, 4.0), whole(1024, Some(6.3))];
        let on_f16 = [t(128, 7.0, 4.2), whole(1024, Some(5.4))];
        assert!(prefills_whole_faster(&main, &on_f16));
        assert!(!prefills_whole_faster(&on_f16, &main));
        // Within FLASH_ATTN_GAIN_MIN: no.
        assert!(!prefills_whole_faster(&main, &[whole(1024, Some(6.1))]));
        // Not timed so (a cache from before), or not as deep, or nonsense.
        assert!(!prefills_whole_faster(&main, &[whole(1024, None)]));
        assert!(!prefills_whole_faster(&[whole(1024, None)], &on_f16));
        assert!(!prefills_whole_faster(&main, &[whole(512, Some(1.0))]));
        assert!(!prefills_whole_faster(
            &main,
            &[whole(1024, Some(f64::NAN))]
        ));
        assert!(!prefills_whole_faster(&main, &[whole(1024, Some(0.0))]));
        assert!(!prefills_whole_faster(&main, &[]));
    }

    #[test]
    fn a_prompt_token_alone_pays_for_the_answer_tokens_its_gain_covers() {
        let whole = |decode_ms, ms: f64| {
            let mut d = t(1024, decode_ms, 6.0);
            d.timing.whole_prefill_s_per_token = Some(ms / 1e3);
            d
        };
        // 0.9 ms gained a prompt token, 4 ms lost an answer token.
        let trade = lone_trade(&[whole(10.0, 6.3)], &[whole(14.0, 5.4)]).unwrap();
        assert!((trade - 0.225).abs() < 1e-9, "{trade}");
        // Decoding there no dearer: any answer.
        assert_eq!(
            lone_trade(&[whole(10.0, 6.3)], &[whole(10.0, 5.4)]),
            Some(f64::INFINITY)
        );
        // Not faster alone: no trade.
        assert_eq!(lone_trade(&[whole(10.0, 6.3)], &[whole(8.0, 6.2)]), None);
    }

    #[test]
    fn a_whole_chunks_timing_is_kept_and_an_old_entry_without_it_still_reads() {
        let mut d = t(1024, 10.0, 6.0);
        d.timing.whole_prefill_s_per_token = Some(0.0054);
        let text = serde_json::to_string(&d).unwrap();
        assert!(
            text.contains("\"whole_prefill_s_per_token\":0.0054"),
            "{text}"
        );
        assert_eq!(serde_json::from_str::<DepthTiming>(&text).unwrap(), d);
        let old = serde_json::to_string(&t(1024, 10.0, 6.0)).unwrap();
        assert!(!old.contains("whole"), "{old}");
        let read: DepthTiming = serde_json::from_str(&old).unwrap();
        assert_eq!(read.timing.whole_prefill_s_per_token, None);
    }
}
