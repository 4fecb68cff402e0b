//! The next step's token budget: what the ITL target leaves room for beside
//! the decode tokens (or `--step-tokens`), and when a short prompt is taken
//! whole instead (`--itl-max-ms`); the planner's view of the slots.

use super::*;

impl Engine {
    /// The planner's view of the slots; a prompt that has held its slot past
    /// `Seq::overdue_at` without finishing its prefill is marked overdue
    /// (`take_overdue_turn` keeps the marks on every other step).
    pub(super) fn views(&self) -> Vec<SeqView> {
        let now = Instant::now();
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(slot, s)| {
                let s = s.as_ref()?;
                let phase = s.phase()?;
                Some(SeqView {
                    slot,
                    class: s.job.class,
                    admitted: s.admitted,
                    phase,
                    overdue: matches!(phase, Phase::Prefill { .. }) && now > s.overdue_at,
                })
            })
            .collect()
    }

    /// Before planning a step from `views`: keeps their overdue marks on the
    /// engine's overdue turn and clears them on the other, so that overdue
    /// prompts go first every other step (`planner`, rule 2); passes the
    /// turn while any prompt is overdue, and counts the step when its marks
    /// let no shorter prompt go first.
    pub(super) fn take_overdue_turn(&mut self, views: &mut [SeqView]) {
        if !views.iter().any(|v| v.overdue) {
            self.overdue_turn = true;
            return;
        }
        if !self.overdue_turn {
            views.iter_mut().for_each(|v| v.overdue = false);
        } else if planner::overdue_goes_first(views) {
            self.metrics
                .steps_overdue_first
                .fetch_add(1, Ordering::Relaxed);
        }
        self.overdue_turn = !self.overdue_turn;
    }

    /// The next step's plan: a long prompt's large chunk or the decode
    /// tokens that cover it (`ahead_step`), or the planner's ordinary step
    /// under the budget, without the decode tokens of streams that still
    /// have tokens decoded ahead to send (`skip_covered`).
    pub(super) fn next_plan(&mut self, views: &[SeqView]) -> planner::Plan {
        let (budget, whole) = self.step_budget(views);
        if let Some(plan) = self.ahead_step(views, whole) {
            return plan;
        }
        self.metrics
            .step_budget_tokens
            .store(budget, Ordering::Relaxed);
        if whole {
            self.metrics
                .steps_whole_prompt
                .fetch_add(1, Ordering::Relaxed);
        }
        let mut plan = planner::plan_step(views, budget);
        self.skip_covered(&mut plan);
        plan
    }

    /// Tokens the next step may hold: fixed by `--step-tokens`, or the decode
    /// tokens plus the prefill the ITL target leaves room for, or a short
    /// prompt whole (`whole_prompt_budget`; then also true).
    pub(super) fn step_budget(&self, views: &[SeqView]) -> (usize, bool) {
        let budget = self.target_budget(views);
        let whole = self.whole_prompt_budget(views, budget);
        (whole, whole != budget)
    }

    /// `planner::budget_with_whole_prompt` for this engine: a step may pause
    /// the streams for up to `--itl-max-ms` to take a prompt not yet begun
    /// whole, only while every stream keeps its k-th token within k ITL
    /// targets and one such pause of its first. (The prompt's first token
    /// comes at once instead of after as many steps as its chunks, each also
    /// carrying every stream's decode token; a stream absorbs one pause, then
    /// earns the next by running ahead of the target.) The forecast is held
    /// to the share of the allowance a step aims at, as under the target.
    fn whole_prompt_budget(&self, views: &[SeqView], budget: usize) -> usize {
        if self.cfg.step_tokens.is_some() || self.cfg.itl_max.is_zero() {
            return budget;
        }
        let allowed = || {
            let now = Instant::now();
            let itl_max = self.cfg.itl_max.as_secs_f64();
            let slack_min = views
                .iter()
                .filter(|v| v.phase == Phase::Decode)
                .map(|v| {
                    self.slots[v.slot]
                        .as_ref()
                        .and_then(|s| s.pace_slack_s(now, self.cfg.itl_target))
                        .map_or(0.0, |slack| slack + itl_max)
                })
                .fold(f64::INFINITY, f64::min);
            cost::STEP_AIM_SHARE * itl_max.min(slack_min)
        };
        let n_decode = views.iter().filter(|v| v.phase == Phase::Decode).count();
        planner::budget_with_whole_prompt(
            views,
            budget,
            self.cfg.n_batch,
            |slot, tokens| {
                let seq = self.slots[slot].as_ref()?;
                (!seq.prefill_begun()).then(|| self.cost.predict(n_decode, &[seq.chunk(tokens)]))
            },
            allowed,
        )
    }

    /// The decode tokens plus the prefill the ITL target leaves room for, or
    /// `--step-tokens`.
    fn target_budget(&self, views: &[SeqView]) -> usize {
        let n_decode = views.iter().filter(|v| v.phase == Phase::Decode).count();
        // Priced at the dearest prompt being prefilled: the planner may give it
        // the whole budget.
        let s_per_token = views
            .iter()
            .filter(|v| matches!(v.phase, Phase::Prefill { .. }))
            .filter_map(|v| self.slots[v.slot].as_ref())
            .map(|s| self.cost.chunk_s_per_token(&s.chunk(0)))
            .fold(self.cost.prefill_s_per_token(), f64::max);
        let budget = n_decode + self.prefill_per_step(n_decode, s_per_token);
        budget.clamp(views.len().max(1), self.cfg.n_batch)
    }

    /// Prompt tokens a step takes beside `n_decode` decode tokens: what the
    /// fixed `--step-tokens` leaves, or what the ITL target allows at
    /// `s_per_token` (with nothing decoding, what fits a step of
    /// `--itl-max-ms`; any chunk up to `n_batch` when it is 0).
    pub(super) fn prefill_per_step(&self, n_decode: usize, s_per_token: f64) -> usize {
        match self.cfg.step_tokens {
            Some(n) => n.saturating_sub(n_decode).max(1),
            None => self.cost.prefill_budget(
                n_decode,
                s_per_token,
                self.cfg.itl_target,
                (!self.cfg.itl_max.is_zero()).then_some(self.cfg.itl_max),
                self.cfg.n_batch,
            ),
        }
    }

    /// The pace of tokens decoded ahead: the ITL target.
    pub(super) fn pace(&self) -> Duration {
        self.cfg.itl_target
    }

    /// The next step while a long prompt beside streams goes in large
    /// chunks (`ahead`): that prompt's chunk alone, once every decoding
    /// stream has tokens to send for its forecast, or until then the decode
    /// tokens of those that have not (their tokens go out at `pace`). `None`: an ordinary
    /// step (`--decode-ahead-ms` 0, `--step-tokens`, no stream decoding or
    /// one slower than half the pace, the prompt first in order taken whole
    /// by the ordinary step (`whole`) or gaining nothing from a large chunk).
    pub(super) fn ahead_step(&mut self, views: &[SeqView], whole: bool) -> Option<planner::Plan> {
        self.ahead = false;
        self.ahead_forecast = None;
        if whole || self.cfg.decode_ahead.is_zero() || self.cfg.step_tokens.is_some() {
            return None;
        }
        let decoding: Vec<usize> = views
            .iter()
            .filter(|v| v.phase == Phase::Decode)
            .map(|v| v.slot)
            .collect();
        let decode_s = self.cost.decode_s(decoding.len());
        let pace = self.pace().as_secs_f64();
        if decoding.is_empty() || decode_s > ahead::DECODE_SHARE_MAX * pace {
            return None;
        }
        let (remaining, slot) = planner::first_prompt(views)?;
        let seq = self.slots[slot].as_ref()?;
        if seq.job.embed().is_some() {
            return None;
        }
        let s_per_token = self.cost.chunk_s_per_token(&seq.chunk(0));
        let target_chunk = self.prefill_per_step(decoding.len(), s_per_token);
        let n = ahead::chunk_tokens(
            remaining,
            s_per_token,
            self.cfg.decode_ahead.as_secs_f64(),
            self.cfg.n_batch,
            target_chunk,
        )?;
        self.ahead = true;
        let chunk_s = self.cost.predict(0, &[seq.chunk(n)]);
        let now = Instant::now();
        let first = !seq.prefill_begun();
        let stretch = self.ahead_stretch.of(first);
        let needed = ahead::cover_needed_s(chunk_s, stretch, decode_s, pace);
        let short: Vec<usize> = decoding
            .iter()
            .copied()
            .filter(|&s| {
                self.slots[s]
                    .as_ref()
                    .is_some_and(|s| ahead::cover_s(now, s.released_until) < needed)
            })
            .collect();
        let entries = if short.is_empty() {
            self.metrics
                .steps_ahead_chunk
                .fetch_add(1, Ordering::Relaxed);
            self.ahead_forecast = Some((chunk_s, first));
            vec![planner::Entry {
                slot,
                work: Work::Prefill { n_tokens: n },
            }]
        } else {
            short
                .into_iter()
                .map(|slot| planner::Entry {
                    slot,
                    work: Work::Decode,
                })
                .collect()
        };
        Some(planner::Plan { entries })
    }

    /// Drops from an ordinary step the decode tokens of the streams that
    /// still have a pace's worth of tokens decoded ahead to send: decoded
    /// now, their tokens would only wait, one pace apart, and the next
    /// steps would add more than they send. So after a long prompt's large
    /// chunks, a stream keeps the pace until what it had decoded ahead is
    /// sent, and then takes a token every step again.
    pub(super) fn skip_covered(&self, plan: &mut planner::Plan) {
        let now = Instant::now();
        let pace = self.pace().as_secs_f64();
        plan.entries.retain(|e| {
            e.work != Work::Decode
                || self.slots[e.slot]
                    .as_ref()
                    .is_none_or(|s| ahead::cover_s(now, s.released_until) < pace)
        });
    }

    /// Sequences that will take a decode token in the coming steps.
    pub(super) fn n_decoding(&self) -> usize {
        self.slots
            .iter()
            .flatten()
            .filter(|s| s.is_decoding())
            .count()
    }
}
