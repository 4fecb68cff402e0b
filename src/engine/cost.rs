//! What an engine step costs, learned online: the step budget, the admission
//! rates and the time-to-first-token forecast all come from here.
//!
//! A step with `d` decode tokens costs `F_d · (a + b·d)` seconds, and each
//! prefill chunk in it costs its tokens times a per-token cost. The *shape*
//! (`a`, `b`, and `c`, the per-token prefill cost of a fresh prompt) comes from
//! start-up calibration, or from the operator's `--mu-*` values; the *scales*
//! `F_d` and `F_p` start at 1 and follow the measured steps. So the estimates
//! follow reality when the box gets slower (another process, a thermal limit)
//! and recover when it speeds up again, without a restart.
//!
//! Identifiable parts only: `F_d` learns from pure decode steps; in a step with
//! prefill, the decode part is taken as predicted and the rest is the
//! prefill's, shared between its chunks by their predicted cost. A chunk's
//! per-token cost grows with its position in its prompt (attention reads every
//! cell before it: on the 2-core development box, ~4 ms per token at the start
//! of a prompt, ~20 ms at 6,000 tokens), so each prefilling sequence keeps its
//! own measured cost for its next chunk, and only chunks near the start of a
//! prompt (`SHORT_CONTEXT_TOKENS`) teach `F_p`, the fresh-prompt cost that
//! admission's μ_prefill and the forecasts use.
//!
//! The scales are averaged in log space, weighted by the step's duration: the
//! estimate is an average over roughly the last `TAU_S` of compute, however
//! many small steps that held. One observation may pull a scale up by at most
//! `OBSERVATION_RATIO_MAX`, so one step slowed tenfold by a preemption moves
//! it little.
//!
//! Pure: no clock, no threads; the engine feeds it measured step times.

use crate::admission::Rates;
use std::time::Duration;

/// Time constant of the online estimates, in seconds of measured compute.
const TAU_S: f64 = 1.0;
/// Share of the inter-token target a mixed step aims at: the rest is headroom
/// for the estimate's lag and for the noise of a shared machine.
pub const STEP_AIM_SHARE: f64 = 0.8;
/// Smallest prefill chunk in a step with decode tokens, even when the decode
/// tokens alone reach the target: a prompt always makes progress.
pub const PREFILL_CHUNK_MIN_TOKENS: usize = 1;
/// Share of the inter-token target a prompt being prefilled always gets in a
/// step, even when the decode tokens alone fill the target (a busy box, many
/// streams deep in a long context). Without it a prompt beside streams that
/// miss the target anyway advances by one token a step, and on the 2-core box
/// with a compiler running a 6,000-token prompt beside two streams did not
/// reach its first token in 300 s; with it, the streams' steps grow by at most
/// this share of the target.
pub const PREFILL_SHARE_MIN: f64 = 0.25;
/// Chunks that start within this many tokens of their prompt's start teach the
/// fresh-prompt cost; later ones pay for attention over what came before.
pub const SHORT_CONTEXT_TOKENS: usize = 512;
/// Weight of the newest measurement in a sequence's own per-token cost.
const OWN_COST_WEIGHT: f64 = 0.5;
/// A part of a step is never measured below this share of its prediction (so a
/// wrong prediction of the other part cannot drive it to zero or below).
const RESIDUAL_SHARE_MIN: f64 = 0.05;

/// How far one observation may pull a scale *up*: a step preempted for ten
/// times its length counts as three times. Down is not limited: noise on a
/// shared machine only ever makes a step slower, so a fast step is news. A
/// model seeded a hundredfold too fast still converges within half a minute of
/// compute; one seeded too slow, within a few steps.
const OBSERVATION_RATIO_MAX: f64 = 3.0;

/// The distance from `current` to `observed` (both ln), upwards at most the
/// largest ratio one observation may claim.
fn step_towards(current: f64, observed: f64) -> f64 {
    (observed - current).min(OBSERVATION_RATIO_MAX.ln())
}

/// One prefill chunk of a step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Chunk {
    pub tokens: usize,
    /// Its first token's position in its prompt.
    pub start: usize,
    /// Its sequence's own measured seconds per token, once it has one.
    pub own_s_per_token: Option<f64>,
}

/// A sequence's own per-token prefill cost after a new measurement.
pub fn update_own_cost(own: Option<f64>, measured: f64) -> f64 {
    match own {
        Some(old) => old + OWN_COST_WEIGHT * (measured - old),
        None => measured,
    }
}

/// Step cost estimates; see the module comment.
#[derive(Debug, Clone)]
pub struct CostModel {
    parallel: usize,
    /// Decode step seconds at batch `n`: `a + b·n` (seed shape).
    a: f64,
    b: f64,
    /// Prefill seconds per prompt token (seed shape).
    c: f64,
    /// ln of the measured-to-seed scales.
    ln_decode: f64,
    ln_prefill: f64,
    /// No measured step moves the scales (`frozen`).
    frozen: bool,
}

impl CostModel {
    /// From start-up calibration: decode rates at batch 1 and at `parallel`
    /// give the decode line, the prefill rate gives the cost per prompt token.
    pub fn from_calibration(
        prefill_tok_s: f64,
        decode_tok_s_batch_1: f64,
        decode_tok_s_parallel: f64,
        parallel: usize,
    ) -> CostModel {
        assert!(prefill_tok_s > 0.0 && decode_tok_s_batch_1 > 0.0 && decode_tok_s_parallel > 0.0);
        assert!(parallel >= 1);
        let t1 = 1.0 / decode_tok_s_batch_1;
        let tp = parallel as f64 / decode_tok_s_parallel;
        // A larger batch never costs less than a smaller one; with one sequence
        // (or noisy measurements) assume a step's fixed part is half of it.
        let b = if parallel > 1 && tp > t1 {
            (tp - t1) / (parallel - 1) as f64
        } else {
            t1 / 2.0
        };
        let a = (t1 - b).max(t1 / 10.0);
        CostModel::new(a, b, 1.0 / prefill_tok_s, parallel)
    }

    /// From the operator's rates (`--mu-prefill`, `--mu-decode` at `--parallel`):
    /// without a batch-1 measurement, a step's fixed part is taken to cost as
    /// much as one sequence's part (as calibration measures on small CPUs: about
    /// 10 ms at batch 1 and 25 ms at batch 4 here). Online refinement corrects
    /// the scale, not this shape.
    pub fn from_rates(rates: Rates, parallel: usize) -> CostModel {
        assert!(rates.prefill_tok_s > 0.0 && rates.decode_tok_s > 0.0 && parallel >= 1);
        let tp = parallel as f64 / rates.decode_tok_s;
        let per = tp / (parallel + 1) as f64;
        CostModel::new(per, per, 1.0 / rates.prefill_tok_s, parallel)
    }

    fn new(a: f64, b: f64, c: f64, parallel: usize) -> CostModel {
        assert!(
            a > 0.0 && b >= 0.0 && c > 0.0,
            "cost shape must be positive"
        );
        CostModel {
            parallel,
            a,
            b,
            c,
            ln_decode: 0.0,
            ln_prefill: 0.0,
            frozen: false,
        }
    }

    /// The same model, whose scales no measured step moves (`--mu-fixed`): its
    /// rates, budgets and forecasts stay those it was made with.
    pub fn frozen(self) -> CostModel {
        CostModel {
            frozen: true,
            ..self
        }
    }

    /// Seconds of the decode part of a step with `n` decode tokens.
    pub fn decode_s(&self, n: usize) -> f64 {
        if n == 0 {
            0.0
        } else {
            self.ln_decode.exp() * (self.a + self.b * n as f64)
        }
    }

    /// Seconds per prefilled prompt token.
    pub fn prefill_s_per_token(&self) -> f64 {
        self.ln_prefill.exp() * self.c
    }

    /// Learns from a step of `n_decode` decode tokens and `chunks` that took
    /// `seconds`. Returns each chunk's measured seconds per token, in order.
    pub fn observe(&mut self, n_decode: usize, chunks: &[Chunk], seconds: f64) -> Vec<f64> {
        if seconds.is_nan()
            || seconds <= 0.0
            || seconds.is_infinite()
            || n_decode + chunks.len() == 0
        {
            return Vec::new();
        }
        let alpha = if self.frozen {
            0.0
        } else {
            1.0 - (-seconds / TAU_S).exp()
        };
        if chunks.is_empty() {
            let ln = (seconds / (self.a + self.b * n_decode as f64)).ln();
            self.ln_decode += alpha * step_towards(self.ln_decode, ln);
            return Vec::new();
        }
        let predicted: Vec<f64> = chunks
            .iter()
            .map(|c| c.tokens as f64 * self.chunk_s_per_token(c))
            .collect();
        let total: f64 = predicted.iter().sum();
        let prefill = (seconds - self.decode_s(n_decode)).max(total * RESIDUAL_SHARE_MIN);
        chunks
            .iter()
            .zip(&predicted)
            .map(|(c, &p)| {
                let share = p / total;
                let per_token = prefill * share / c.tokens.max(1) as f64;
                if c.start < SHORT_CONTEXT_TOKENS {
                    let ln = (per_token / self.c).ln();
                    self.ln_prefill += alpha * share * step_towards(self.ln_prefill, ln);
                }
                per_token
            })
            .collect()
    }

    /// Forecast of a step of `n_decode` decode tokens and `chunks`, in seconds.
    pub fn predict(&self, n_decode: usize, chunks: &[Chunk]) -> f64 {
        self.decode_s(n_decode)
            + chunks
                .iter()
                .map(|c| c.tokens as f64 * self.chunk_s_per_token(c))
                .sum::<f64>()
    }

    /// What a chunk is expected to cost per token: its sequence's own measured
    /// cost, or a fresh prompt's.
    pub fn chunk_s_per_token(&self, c: &Chunk) -> f64 {
        c.own_s_per_token
            .unwrap_or_else(|| self.prefill_s_per_token())
    }

    /// The rates the admission bounds are derived from: fresh-prompt prefill
    /// tokens per second, and aggregate decode tokens per second at `--parallel`.
    pub fn rates(&self) -> Rates {
        Rates {
            prefill_tok_s: 1.0 / self.prefill_s_per_token(),
            decode_tok_s: self.parallel as f64 / self.decode_s(self.parallel),
        }
    }

    /// Prefill tokens that fit in a step beside `n_decode` decode tokens, at
    /// `s_per_token` (the dearest of the prompts being prefilled): as many as
    /// keep the step within `STEP_AIM_SHARE` of the inter-token target (at least
    /// `PREFILL_CHUNK_MIN_TOKENS`). With nothing decoding no stream waits for a
    /// token, and prefill takes the largest chunk, `ceiling`, but no more than
    /// keeps the step within `STEP_AIM_SHARE` of `step_max` (`--itl-max-ms`),
    /// when there is one: a request that arrives meanwhile waits for the step
    /// in flight before its prompt can start, and on a slow CPU a `ceiling`
    /// chunk deep in a long prompt takes seconds (512 tokens ~1,500 deep: ~5 s
    /// on a 2-core AMD EPYC Zen 1). A chunk so capped is still hundreds of
    /// tokens there; its pass's fixed part (~6-28 ms by depth) is a few per
    /// cent of it at most.
    pub fn prefill_budget(
        &self,
        n_decode: usize,
        s_per_token: f64,
        itl_target: Duration,
        step_max: Option<Duration>,
        ceiling: usize,
    ) -> usize {
        let room = if n_decode == 0 {
            let Some(step_max) = step_max else {
                return ceiling;
            };
            step_max.as_secs_f64() * STEP_AIM_SHARE
        } else {
            let target = itl_target.as_secs_f64();
            (target * STEP_AIM_SHARE - self.decode_s(n_decode)).max(target * PREFILL_SHARE_MIN)
        };
        let tokens = (room / s_per_token).floor();
        let tokens = if tokens.is_finite() && tokens > 0.0 {
            tokens.min(ceiling as f64) as usize
        } else {
            0
        };
        tokens
            .max(PREFILL_CHUNK_MIN_TOKENS)
            .min(ceiling.saturating_sub(n_decode))
    }

    /// Forecast of the seconds a fresh prompt of `prompt_tokens` needs until its
    /// first token, when it shares steps with `n_decode` decoding sequences and
    /// each step takes `budget` prefill tokens. (It leaves out the attention
    /// cost that grows along a long prompt: an underestimate for those.)
    pub fn prefill_time_s(&self, prompt_tokens: usize, n_decode: usize, budget: usize) -> f64 {
        let budget = budget.max(1);
        let steps = prompt_tokens.div_ceil(budget);
        steps as f64 * self.decode_s(n_decode) + prompt_tokens as f64 * self.prefill_s_per_token()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A machine whose steps cost exactly `a + b·d + c·p` (decode part only with
    /// `d > 0`), for chunks near the start of their prompts.
    fn truth(a: f64, b: f64, c: f64) -> impl Fn(usize, usize) -> f64 {
        move |d, p| {
            let dec = if d > 0 { a + b * d as f64 } else { 0.0 };
            dec + c * p as f64
        }
    }

    fn fresh(tokens: usize) -> Vec<Chunk> {
        if tokens == 0 {
            return Vec::new();
        }
        vec![Chunk {
            tokens,
            start: 0,
            own_s_per_token: None,
        }]
    }

    fn close(x: f64, y: f64, rel: f64) -> bool {
        (x - y).abs() <= rel * y.abs()
    }

    #[test]
    fn calibration_gives_the_decode_line_and_the_prefill_cost() {
        // 100 tok/s at batch 1 (10 ms/step), 160 tok/s at batch 4 (25 ms/step).
        let m = CostModel::from_calibration(250.0, 100.0, 160.0, 4);
        assert!(close(m.decode_s(1), 0.010, 1e-9));
        assert!(close(m.decode_s(4), 0.025, 1e-9));
        assert!(close(m.prefill_s_per_token(), 0.004, 1e-9));
        let r = m.rates();
        assert!(close(r.prefill_tok_s, 250.0, 1e-9));
        assert!(close(r.decode_tok_s, 160.0, 1e-9));
        assert_eq!(m.decode_s(0), 0.0, "no decode tokens, no decode part");
    }

    #[test]
    fn a_correct_model_stays_put() {
        let mut m = CostModel::from_calibration(250.0, 100.0, 160.0, 4);
        let t = truth(0.005, 0.005, 0.004);
        for (d, p) in [(4, 0), (2, 30), (0, 512), (1, 100), (3, 16)] {
            m.observe(d, &fresh(p), t(d, p));
        }
        assert!(
            close(m.rates().prefill_tok_s, 250.0, 1e-6),
            "{:?}",
            m.rates()
        );
        assert!(
            close(m.rates().decode_tok_s, 160.0, 1e-6),
            "{:?}",
            m.rates()
        );
    }

    #[test]
    fn the_estimates_follow_a_box_that_gets_three_times_slower_and_back() {
        let mut m = CostModel::from_calibration(250.0, 100.0, 160.0, 4);
        let mix = [(4, 0), (4, 20), (0, 512), (2, 40), (4, 0), (1, 0)];
        let slow = truth(0.015, 0.015, 0.012);
        for _ in 0..200 {
            for &(d, p) in &mix {
                m.observe(d, &fresh(p), slow(d, p));
            }
        }
        assert!(
            close(m.rates().prefill_tok_s, 250.0 / 3.0, 0.05),
            "{:?}",
            m.rates()
        );
        assert!(
            close(m.rates().decode_tok_s, 160.0 / 3.0, 0.05),
            "{:?}",
            m.rates()
        );
        let fast = truth(0.005, 0.005, 0.004);
        for _ in 0..200 {
            for &(d, p) in &mix {
                m.observe(d, &fresh(p), fast(d, p));
            }
        }
        assert!(
            close(m.rates().prefill_tok_s, 250.0, 0.05),
            "{:?}",
            m.rates()
        );
        assert!(
            close(m.rates().decode_tok_s, 160.0, 0.05),
            "{:?}",
            m.rates()
        );
    }

    #[test]
    fn seeds_off_by_a_hundredfold_converge_within_half_a_minute_of_work() {
        // The operator claimed 20,000 tok/s; the box does 250 prefill, 160 decode.
        let mut m = CostModel::from_rates(
            Rates {
                prefill_tok_s: 20_000.0,
                decode_tok_s: 20_000.0,
            },
            4,
        );
        let t = truth(0.005, 0.005, 0.004);
        let mut spent = 0.0;
        // Serving: a prompt alone, then two streams decode, a third prompt is
        // prefilled beside them, and four streams decode.
        let mut serve = vec![(0, 128)];
        serve.extend([(2, 0); 20]);
        serve.extend([(2, 30); 4]);
        serve.extend([(4, 0); 20]);
        while spent < 30.0 {
            for &(d, p) in &serve {
                m.observe(d, &fresh(p), t(d, p));
                spent += t(d, p);
            }
        }
        assert!(
            close(m.rates().prefill_tok_s, 250.0, 0.1),
            "{:?}",
            m.rates()
        );
        assert!(close(m.rates().decode_tok_s, 160.0, 0.1), "{:?}", m.rates());
    }

    #[test]
    fn seeds_far_too_slow_converge_within_a_few_steps() {
        let mut m = CostModel::from_rates(
            Rates {
                prefill_tok_s: 5.0,
                decode_tok_s: 5.0,
            },
            4,
        );
        let t = truth(0.005, 0.005, 0.004);
        for _ in 0..3 {
            m.observe(0, &fresh(128), t(0, 128));
            for _ in 0..64 {
                m.observe(1, &[], t(1, 0));
            }
        }
        assert!(m.rates().prefill_tok_s > 60.0, "{:?}", m.rates());
        assert!(m.rates().decode_tok_s > 80.0, "{:?}", m.rates());
    }

    #[test]
    fn one_preempted_step_moves_the_estimate_little() {
        let mut m = CostModel::from_calibration(250.0, 100.0, 160.0, 4);
        m.observe(4, &[], 0.25); // a 25 ms step took ten times longer
        assert!(m.decode_s(4) < 0.025 * 1.3, "{}", m.decode_s(4));
    }

    #[test]
    fn a_long_prompts_dear_chunks_are_its_own_and_do_not_teach_the_fresh_cost() {
        let mut m = CostModel::from_calibration(250.0, 100.0, 160.0, 4);
        // Two decoders (15 ms) and 5 tokens at position 5,000 costing 20 ms each.
        let deep = Chunk {
            tokens: 5,
            start: 5000,
            own_s_per_token: Some(0.018),
        };
        let measured = m.observe(2, &[deep], 0.015 + 0.100);
        assert!(close(measured[0], 0.020, 1e-9), "{measured:?}");
        assert!(
            close(m.prefill_s_per_token(), 0.004, 1e-9),
            "fresh cost unchanged"
        );
        assert!(
            close(m.decode_s(2), 0.015, 1e-9),
            "decode learns from decode steps only"
        );
        let own = update_own_cost(Some(0.018), measured[0]);
        assert!(close(own, 0.019, 1e-9));
        assert!(close(update_own_cost(None, 0.02), 0.02, 1e-9));
        // A short prompt and the long one share a step: split by predicted cost.
        let short = Chunk {
            tokens: 10,
            start: 0,
            own_s_per_token: None,
        };
        let measured = m.observe(2, &[short, deep], 0.015 + 0.040 + 0.090);
        // Predicted 40 ms and 90 ms; measured exactly that.
        assert!(
            close(measured[0], 0.004, 1e-9) && close(measured[1], 0.018, 1e-9),
            "{measured:?}"
        );
    }

    #[test]
    fn the_prefill_budget_fills_the_step_to_its_aim() {
        let m = CostModel::from_calibration(250.0, 100.0, 160.0, 4);
        let target = Duration::from_millis(150);
        let fresh = m.prefill_s_per_token();
        // 0.8 * 150 ms = 120 ms; two decode tokens cost 15 ms; 105 ms / 4 ms = 26.
        assert_eq!(m.prefill_budget(2, fresh, target, None, 512), 26);
        // Deep in a long prompt at 20 ms a token: 5.
        assert_eq!(m.prefill_budget(2, 0.020, target, None, 512), 5);
        assert_eq!(
            m.prefill_budget(0, fresh, target, None, 512),
            512,
            "nothing decodes: largest chunk"
        );
        // Four decode tokens cost 25 ms, past a 20 ms target: the prompt still
        // gets a quarter of the target, 5 ms, one token at 4 ms.
        assert_eq!(
            m.prefill_budget(4, fresh, Duration::from_millis(20), None, 512),
            1,
            "a prompt always progresses"
        );
        assert_eq!(
            m.prefill_budget(4, fresh, Duration::from_millis(2), None, 512),
            PREFILL_CHUNK_MIN_TOKENS,
            "at least one token"
        );
        // Decode alone (25 ms) past a 30 ms target's aim of 24 ms: 7.5 ms of
        // prefill, one token; at 100 ms, 80 - 25 = 55 ms: 13 tokens.
        assert_eq!(
            m.prefill_budget(4, fresh, Duration::from_millis(100), None, 512),
            13
        );
        // A target as long as the decode part alone (25 ms): a quarter of it,
        // 6.25 ms, goes to the prompt: 6 tokens at 1 ms.
        let target = Duration::from_secs_f64(m.decode_s(4));
        assert_eq!(
            m.prefill_budget(4, 0.001, target, None, 512),
            6,
            "decode past the target: a quarter of the target for the prompt"
        );
        assert_eq!(
            m.prefill_budget(4, fresh, Duration::from_secs(60), None, 512),
            508,
            "never above the step ceiling"
        );
    }

    #[test]
    fn with_nothing_decoding_a_chunk_fills_a_step_of_itl_max_at_most() {
        let m = CostModel::from_calibration(250.0, 100.0, 160.0, 4);
        let target = Duration::from_millis(150);
        let max = Some(Duration::from_secs(3));
        // The aim is 80 % of 3 s, 2.4 s: at 4 ms a token 600 fit, more than
        // the largest chunk.
        assert_eq!(m.prefill_budget(0, 0.004, target, max, 512), 512);
        // Deep in a long prompt on a slow CPU, 12 ms a token: 200.
        assert_eq!(m.prefill_budget(0, 0.012, target, max, 512), 200);
        // Slower than the whole step: one token, the least a step takes.
        assert_eq!(
            m.prefill_budget(0, 5.0, target, max, 512),
            PREFILL_CHUNK_MIN_TOKENS
        );
        // No bound (`--itl-max-ms 0`): the largest chunk, however dear.
        assert_eq!(m.prefill_budget(0, 0.012, target, None, 512), 512);
        // Beside streams the ITL target decides, not the bound.
        assert_eq!(m.prefill_budget(2, 0.020, target, max, 512), 5);
    }

    #[test]
    fn the_prefill_forecast_counts_the_decode_part_of_every_step() {
        let m = CostModel::from_calibration(250.0, 100.0, 160.0, 4);
        // 100 tokens in chunks of 26 beside 2 decoders: 4 steps of 15 ms + 400 ms.
        assert!(close(m.prefill_time_s(100, 2, 26), 0.460, 1e-9));
        assert!(close(m.prefill_time_s(100, 0, 512), 0.400, 1e-9));
    }

    #[test]
    fn a_frozen_model_keeps_its_rates_whatever_the_steps_measure() {
        let rates = Rates {
            prefill_tok_s: 200.0,
            decode_tok_s: 150.0,
        };
        let mut m = CostModel::from_rates(rates, 4).frozen();
        let before = m.rates();
        assert!((before.decode_tok_s - 150.0).abs() < 1e-9);
        for _ in 0..100 {
            m.observe(4, &[], 1.0);
            let own = m.observe(0, &fresh(64), 0.01);
            assert_eq!(own.len(), 1, "a chunk's own cost is still measured");
        }
        assert_eq!(m.rates(), before);
    }
}
