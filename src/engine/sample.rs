//! How one sequence picks its next token from its logits row.
//!
//! - Greedy: an argmax (llama.cpp's greedy sampler first builds a candidate
//!   array of the whole vocabulary every step).
//! - Temperature, with or without min-p, and no top-k or top-p (OpenAI's
//!   defaults): sampled here, from the row in place: one pass for the largest
//!   logit, one that writes each token's weight `exp((l - max) / T)` into a
//!   buffer the sequence keeps, with an `exp` of its own that runs as vector
//!   code, the weights' sums 256 tokens at a time, and a scan of those sums,
//!   then of one block, to the drawn share of their total. 20 us a draw over
//!   the default model's 49,152 logits on the 2-core Zen 4, against 200 us
//!   with libm's `exp` and one running sum (with 4 streams, 0.8 ms of a
//!   ~30 ms step).
//!   llama.cpp's chain (temperature, then its distribution sampler) builds a
//!   49,152-entry candidate array for the default model, scales it, computes
//!   its softmax and normalises it, every token.
//! - top-k or top-p: llama.cpp's chain, which orders the candidates those need.
//!
//! min-p keeps the tokens whose probability at temperature 1 is at least
//! `min_p` times the most likely one's, as llama.cpp's chain does (it applies
//! min-p before temperature): `l >= max + ln(min_p)`.
//!
//! Before any of them, a request's `Penalties` (logit bias, presence,
//! frequency and repetition penalties) change the row in place, touching only
//! the tokens they name or the sequence has seen, and a structured-output
//! `Constraint` sets every token it does not allow to minus infinity, and
//! `ignore_eos` sets the vocabulary's end-of-generation tokens to minus
//! infinity (as llama.cpp's server does: the answer runs to `max_tokens`
//! without ending its text and starting another turn, so that the text sent
//! back in a conversation tokenizes as generated; put back once the token is
//! picked); without them the row is not touched. Reported log-probabilities
//! are of the changed row, but for `ignore_eos`'s ban: with it they are the
//! model's, as scoring the answer again (`echo`) gives them.

use crate::admission::Penalties;
use crate::ffi::{self, Context, Model, SamplingParams, Token};
use crate::grammar::Constraint;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// The vocabulary's end-of-generation tokens (end of text, end of turn).
pub fn eog_tokens(model: &Model) -> Arc<[Token]> {
    (0..model.n_vocab() as Token)
        .filter(|&t| model.is_eog(t))
        .collect()
}

/// A sequence's sampler: its penalties, then how it picks.
pub struct Sampler {
    pick: Pick,
    adjust: Option<Adjust>,
    constraint: Option<Constraint>,
    /// End-of-sequence: what a failed constraint lets the sequence end with.
    eos: Option<Token>,
    /// Tokens never sampled (`ignore_eos`: the end-of-generation ones).
    banned: Option<Arc<[Token]>>,
}

enum Pick {
    Greedy,
    Softmax(Softmax),
    Chain(ffi::ChainSampler),
}

impl Sampler {
    pub fn new(
        p: &SamplingParams,
        penalties: &Penalties,
        constraint: Option<Constraint>,
        eos: Option<Token>,
        banned: Option<Arc<[Token]>>,
        prompt: &[Token],
    ) -> Sampler {
        let pick = if p.temperature <= 0.0 {
            Pick::Greedy
        } else if p.top_k > 0 || p.top_p < 1.0 {
            Pick::Chain(ffi::ChainSampler::new(p))
        } else {
            Pick::Softmax(Softmax::new(p.temperature, p.min_p, p.seed))
        };
        let adjust = (!penalties.is_none()).then(|| Adjust::new(penalties, prompt));
        Sampler {
            pick,
            adjust,
            constraint,
            eos,
            banned,
        }
    }

    /// Samples from the logits of batch entry `i` of the last decode.
    pub fn sample(&mut self, ctx: &mut Context, batch: &ffi::Batch, i: usize) -> Token {
        if let Some(a) = &self.adjust {
            a.apply(ctx.logits_mut(batch, i));
        }
        let unbanned = self
            .banned
            .as_ref()
            .map(|banned| ban(ctx.logits_mut(batch, i), banned));
        if let Some(c) = &mut self.constraint {
            let row = ctx.logits_mut(batch, i);
            if let Err(e) = c.mask(row) {
                // Nothing more can be checked: the answer ends here.
                crate::say!("sluice: structured output failed, ending the answer: {e}");
                self.constraint = None;
                if let Some(eos) = self.eos {
                    row.fill(f32::NEG_INFINITY);
                    row[eos as usize] = 0.0;
                }
            }
        }
        let token = match &mut self.pick {
            Pick::Greedy => super::logprobs::argmax(ctx.logits(batch, i)),
            Pick::Softmax(s) => s.sample(ctx.logits(batch, i)),
            Pick::Chain(c) => c.sample(ctx, batch, i),
        };
        if let Some(unbanned) = unbanned {
            let row = ctx.logits_mut(batch, i);
            unbanned.into_iter().for_each(|(t, l)| row[t] = l);
        }
        if let Some(a) = &mut self.adjust {
            a.accept(token);
        }
        if let Some(c) = &mut self.constraint {
            if let Err(e) = c.accept(token) {
                crate::say!("sluice: structured output failed, ending the answer: {e}");
                self.constraint = None;
            }
        }
        token
    }
}

/// Sets `banned` tokens' logits to minus infinity; what they were, to put
/// back once the token is picked.
pub fn ban(row: &mut [f32], banned: &[Token]) -> Vec<(usize, f32)> {
    banned
        .iter()
        .filter_map(|&t| {
            let l = row.get_mut(t as usize)?;
            Some((t as usize, std::mem::replace(l, f32::NEG_INFINITY)))
        })
        .collect()
}

/// Penalties and biases over one sequence's tokens.
pub struct Adjust {
    p: Penalties,
    /// How often each token was generated.
    generated: HashMap<Token, u32>,
    /// Tokens of the prompt and the output (for the repetition penalty only).
    seen: HashSet<Token>,
}

impl Adjust {
    pub fn new(p: &Penalties, prompt: &[Token]) -> Adjust {
        let seen = if p.repetition != 1.0 {
            prompt.iter().copied().collect()
        } else {
            HashSet::new()
        };
        Adjust {
            p: p.clone(),
            generated: HashMap::new(),
            seen,
        }
    }

    /// Changes a logits row: bias, then the repetition penalty, then presence
    /// and frequency (vLLM's order). Ids outside the row are skipped (the
    /// request's were checked against the vocabulary).
    pub fn apply(&self, row: &mut [f32]) {
        for &(t, bias) in &self.p.logit_bias {
            if let Some(l) = row.get_mut(t as usize) {
                *l += bias;
            }
        }
        let r = self.p.repetition;
        if r != 1.0 {
            for &t in &self.seen {
                if let Some(l) = row.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / r } else { *l * r };
                }
            }
        }
        if self.p.presence != 0.0 || self.p.frequency != 0.0 {
            for (&t, &n) in &self.generated {
                if let Some(l) = row.get_mut(t as usize) {
                    *l -= self.p.presence + self.p.frequency * n as f32;
                }
            }
        }
    }

    /// Counts a token the sequence generated.
    pub fn accept(&mut self, token: Token) {
        *self.generated.entry(token).or_insert(0) += 1;
        if self.p.repetition != 1.0 {
            self.seen.insert(token);
        }
    }
}

/// Temperature and min-p sampling over a whole logits row; see the module
/// comment.
pub struct Softmax {
    inv_temperature: f32,
    /// ln(min_p), or minus infinity without min-p.
    ln_min_p: f32,
    rng: fastrand::Rng,
    weights: Vec<f32>,
    /// The weights' sums, `SUM_BLOCK` at a time.
    block_sums: Vec<f32>,
}

impl Softmax {
    pub fn new(temperature: f32, min_p: f32, seed: u32) -> Softmax {
        assert!(temperature > 0.0, "temperature sampling needs T > 0");
        Softmax {
            inv_temperature: 1.0 / temperature,
            ln_min_p: if min_p > 0.0 {
                min_p.ln()
            } else {
                f32::NEG_INFINITY
            },
            rng: fastrand::Rng::with_seed(u64::from(seed)),
            weights: Vec::new(),
            block_sums: Vec::new(),
        }
    }

    pub fn sample(&mut self, logits: &[f32]) -> Token {
        let u = self.rng.f64();
        self.sample_with(logits, u)
    }

    /// The token at share `u` (in [0, 1)) of the cumulative weights.
    fn sample_with(&mut self, logits: &[f32], u: f64) -> Token {
        assert!(!logits.is_empty());
        let max = super::logprobs::max_of(logits);
        if !max.is_finite() {
            return super::logprobs::argmax(logits);
        }
        let floor = max + self.ln_min_p;
        let inv_t = self.inv_temperature;
        // Branch-free, so that it runs as vector code; a token below the
        // floor (min-p), masked out (minus infinity) or NaN weighs nothing.
        self.weights.resize(logits.len(), 0.0);
        for (w, &l) in self.weights.iter_mut().zip(logits) {
            let x = (l - max) * inv_t;
            let e = exp_nonpositive(x);
            *w = if l >= floor && x >= EXP_ARG_MIN {
                e
            } else {
                0.0
            };
        }
        self.block_sums.clear();
        self.block_sums
            .extend(self.weights.chunks(SUM_BLOCK).map(sum_lanes));
        let total: f64 = self.block_sums.iter().map(|&s| f64::from(s)).sum();
        // The block the share falls in, by the blocks' sums; then the token,
        // within it.
        let mut left = u * total;
        let mut last_block = 0;
        for (b, &sum) in self.block_sums.iter().enumerate() {
            if sum > 0.0 {
                last_block = b;
                if left < f64::from(sum) {
                    return self.within(b, left);
                }
                left -= f64::from(sum);
            }
        }
        // Rounding left a sliver past the last weight: the last token with one.
        self.within(last_block, f64::INFINITY)
    }

    /// The token of block `b` at `left` of its cumulative weight, or its
    /// last token with a weight if `left` is past them all.
    fn within(&self, b: usize, mut left: f64) -> Token {
        let start = b * SUM_BLOCK;
        let block = &self.weights[start..(start + SUM_BLOCK).min(self.weights.len())];
        let mut last = 0;
        for (i, &w) in block.iter().enumerate() {
            if w > 0.0 {
                last = i;
                left -= f64::from(w);
                if left < 0.0 {
                    return (start + i) as Token;
                }
            }
        }
        (start + last) as Token
    }
}

/// Weights per block of the draw's sums: a draw adds up the blocks' sums
/// until its share, then a block's weights, instead of one weight after
/// another over the whole vocabulary (each addition waits for the one before):
/// 2 us for the default model's 49,152 weights (2-core Zen 4).
const SUM_BLOCK: usize = 256;
/// Lanes of a block's sum: independent additions the compiler keeps in vector
/// registers.
const SUM_LANES: usize = 16;

/// The sum of `weights` (at most `SUM_BLOCK` of them, each at most 1: an f32
/// sum of those loses nothing a draw could see).
fn sum_lanes(weights: &[f32]) -> f32 {
    let mut lanes = [0f32; SUM_LANES];
    let chunks = weights.chunks_exact(SUM_LANES);
    let rest: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (a, &w) in lanes.iter_mut().zip(c) {
            *a += w;
        }
    }
    lanes.iter().sum::<f32>() + rest
}

/// Below this, a weight `exp(x)` is taken as zero (`exp(-87)` is about the
/// smallest normal f32).
const EXP_ARG_MIN: f32 = -87.0;

/// `exp(x)` for `x <= 0`, within a few ulps of it: `x = n ln 2 + f` with `n`
/// the nearest integer (|f| <= ln 2 / 2), `exp(f)` by its series to the 6th
/// power (the remainder is under (ln 2 / 2)^7 / 7!), and `2^n` set in the
/// exponent bits. No branch and no call, so that a whole
/// logits row runs as vector code (libm's `expf` is a call a token): the
/// weights of the default model's 49,152 logits in 15 us (2-core Zen 4).
/// Below `EXP_ARG_MIN` the caller takes zero.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    // Adding 1.5 * 2^23 rounds to the nearest integer and leaves it in the
    // low bits of the sum (a float-to-int conversion would keep the loop from
    // running as vector code).
    const ROUND: f32 = 12_582_912.0;
    // ln 2 in two parts (Cody and Waite): `n` times the first is exact, so
    // the rest keeps the bits a large `x` would otherwise lose.
    const LN_2_HI: f32 = 0.693_359_4;
    const LN_2_LO: f32 = -2.121_944_4e-4;
    let x = x.max(EXP_ARG_MIN);
    let r = x * std::f32::consts::LOG2_E + ROUND;
    let n = r - ROUND;
    let f = (x - n * LN_2_HI) - n * LN_2_LO;
    let p = 1.0
        + f * (1.0
            + f * (1.0 / 2.0
                + f * (1.0 / 6.0 + f * (1.0 / 24.0 + f * (1.0 / 120.0 + f * (1.0 / 720.0))))));
    let exponent = (r.to_bits() as i32 - ROUND.to_bits() as i32 + 127) as u32;
    f32::from_bits(exponent << 23) * p
}

#[cfg(test)]
mod tests {
    use super::*;

    fn penalties(
        presence: f32,
        frequency: f32,
        repetition: f32,
        bias: &[(Token, f32)],
    ) -> Penalties {
        Penalties {
            presence,
            frequency,
            repetition,
            logit_bias: bias.to_vec(),
        }
    }

    #[test]
    fn presence_and_frequency_subtract_per_generated_token() {
        let mut a = Adjust::new(&penalties(0.5, 0.25, 1.0, &[]), &[0, 1, 2]);
        a.accept(1);
        a.accept(1);
        a.accept(3);
        let mut row = [1.0f32; 5];
        a.apply(&mut row);
        // Token 1 twice: 1 - 0.5 - 2 * 0.25; token 3 once: 1 - 0.5 - 0.25;
        // the prompt's tokens are not penalised (OpenAI counts the output).
        assert_eq!(row, [1.0, 0.0, 1.0, 0.25, 1.0]);
    }

    #[test]
    fn repetition_divides_positive_and_multiplies_negative_logits_of_seen_tokens() {
        let mut a = Adjust::new(&penalties(0.0, 0.0, 2.0, &[]), &[0, 1]);
        a.accept(2);
        let mut row = [4.0f32, -4.0, 3.0, 5.0];
        a.apply(&mut row);
        assert_eq!(row, [2.0, -8.0, 1.5, 5.0]);
    }

    #[test]
    fn logit_bias_adds_and_minus_100_bans_the_argmax() {
        let a = Adjust::new(
            &penalties(0.0, 0.0, 1.0, &[(0, -100.0), (2, 1.5), (99, 5.0)]),
            &[],
        );
        let mut row = [3.0f32, 2.0, 0.0];
        a.apply(&mut row);
        assert_eq!(row, [-97.0, 2.0, 1.5]);
        assert_eq!(crate::engine::logprobs::argmax(&row), 1);
    }

    #[test]
    fn shares_of_the_cumulative_weight_pick_tokens_in_proportion() {
        // Weights 1, 2, 1 at T = 1 (logits ln 1, ln 2, ln 1): a quarter, half, a quarter.
        let logits = [0.0, 2f32.ln(), 0.0];
        let mut s = Softmax::new(1.0, 0.0, 1);
        assert_eq!(s.sample_with(&logits, 0.0), 0);
        assert_eq!(s.sample_with(&logits, 0.24), 0);
        assert_eq!(s.sample_with(&logits, 0.26), 1);
        assert_eq!(s.sample_with(&logits, 0.74), 1);
        assert_eq!(s.sample_with(&logits, 0.76), 2);
        assert_eq!(s.sample_with(&logits, 0.999_999), 2);
    }

    #[test]
    fn temperature_sharpens_and_flattens() {
        // At T = 0.5 weights square: 1, 4, 1 → token 1 from 1/6 to 5/6.
        let logits = [0.0, 2f32.ln(), 0.0];
        let mut s = Softmax::new(0.5, 0.0, 1);
        assert_eq!(s.sample_with(&logits, 0.15), 0);
        assert_eq!(s.sample_with(&logits, 0.18), 1);
        assert_eq!(s.sample_with(&logits, 0.82), 1);
        assert_eq!(s.sample_with(&logits, 0.85), 2);
    }

    #[test]
    fn min_p_drops_tokens_below_its_share_of_the_most_likely() {
        // Probabilities at T = 1 proportional to 8, 1, 4: min_p 0.25 keeps 8 and 4.
        let logits = [8f32.ln(), 0.0, 4f32.ln()];
        let mut s = Softmax::new(1.0, 0.25, 1);
        for k in 0..100 {
            let t = s.sample_with(&logits, f64::from(k) / 100.0);
            assert_ne!(t, 1, "token 1 is below min_p");
        }
        // The kept 8 : 4 split: the first two thirds go to token 0.
        assert_eq!(s.sample_with(&logits, 0.66), 0);
        assert_eq!(s.sample_with(&logits, 0.67), 2);
    }

    #[test]
    fn a_seed_gives_the_same_draws_and_frequencies_follow_the_distribution() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i % 7) as f32) * 0.5).collect();
        let draw = |seed| {
            let mut s = Softmax::new(0.8, 0.0, seed);
            (0..2000).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(42), draw(42));
        assert_ne!(draw(42), draw(43));
        // Tokens of class 6 (logit 3.0) against class 0 (logit 0): their
        // probability ratio is exp(3.0 / 0.8) = 42.5; over 50,000 draws (some
        // 550 of class 0) the counts' ratio lands within 15 % of it.
        let mut s = Softmax::new(0.8, 0.0, 7);
        let (mut top, mut bottom) = (0u32, 0u32);
        for _ in 0..50_000 {
            match s.sample(&logits) as usize % 7 {
                6 => top += 1,
                0 => bottom += 1,
                _ => {}
            }
        }
        let ratio = f64::from(top) / f64::from(bottom.max(1));
        let want = (3.0f64 / 0.8).exp();
        assert!(
            (ratio / want - 1.0).abs() < 0.15,
            "class 6 : class 0 = {top} : {bottom} = {ratio:.1}, want {want:.1}"
        );
    }

    #[test]
    fn a_row_with_one_finite_logit_gives_that_token() {
        let mut logits = vec![f32::NEG_INFINITY; 100];
        logits[37] = 1.0;
        let mut s = Softmax::new(1.0, 0.0, 3);
        for _ in 0..20 {
            assert_eq!(s.sample(&logits), 37);
        }
    }

    #[test]
    fn the_vector_exp_is_within_a_few_ulps_of_libm() {
        let mut worst = 0f64;
        for i in 0..=870_000 {
            let x = -(i as f32) * 1e-4;
            let want = f64::from(x.exp());
            let got = f64::from(exp_nonpositive(x));
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst < 5e-7, "relative error {worst:e}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
    }

    #[test]
    fn a_draw_lands_where_one_running_sum_over_the_whole_row_would() {
        // 1,000 tokens over four blocks of the sums, some masked out, some
        // below min-p: the token at each share is the one a single running
        // sum of the weights reaches it at (away from the rounding between
        // two tokens).
        let logits: Vec<f32> = (0..1000)
            .map(|i| match i % 11 {
                0 => f32::NEG_INFINITY,
                k => (k as f32 * 0.37).sin() * 4.0,
            })
            .collect();
        let (t, min_p) = (0.8f32, 0.01f32);
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f64> = logits
            .iter()
            .map(|&l| {
                if l >= max + min_p.ln() {
                    f64::from(((l - max) / t).exp())
                } else {
                    0.0
                }
            })
            .collect();
        let total: f64 = weights.iter().sum();
        let mut s = Softmax::new(t, min_p, 1);
        let mut cumulative = 0.0;
        for (i, &w) in weights.iter().enumerate() {
            if w == 0.0 {
                continue;
            }
            // The middle of token i's share.
            let u = (cumulative + w / 2.0) / total;
            cumulative += w;
            assert_eq!(s.sample_with(&logits, u), i as Token, "share {u}");
        }
        assert_eq!(
            s.sample_with(&logits, 0.999_999_999),
            weights.iter().rposition(|&w| w > 0.0).unwrap() as Token
        );
    }
}
