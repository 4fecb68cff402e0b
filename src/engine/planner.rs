//! The batch planner: which tokens go into the next engine step.
//!
//! It is a pure function of the scheduler's state so that the rules that keep
//! streams alive under a long prompt can be tested without threads or a model:
//!
//! 1. Every running sequence that is not paused gets exactly one decode token,
//!    and these come **first**. A stream's inter-token latency is therefore one
//!    step, whatever else is waiting. (The one step planned elsewhere: a
//!    long prompt's large chunk alone, while every stream sends tokens
//!    decoded ahead of it, `engine::ahead`.)
//! 2. The rest of the per-step token budget goes to prefill chunks: the higher
//!    priority class first (`priority::Class`), then the shortest remaining
//!    prompt first (ties by age). A short prompt that arrives while an
//!    8k-token prompt is being prefilled gets its first token after one step, not
//!    after the whole long prefill. Alone, that lets a long prompt be overtaken
//!    for as long as shorter ones keep arriving (in a closed loop of 4 clients
//!    sending 500-2,000-token prompts one waited 78 s for its first token on a
//!    2-core Zen 4, against 22-28 s at most in llama-server's first-come order).
//!    So a prompt that has held its slot longer than its class's W_max, and
//!    `--overdue-stretch` (2) times its prefill's forecast, without finishing
//!    its prefill is *overdue*, and on every other step the engine
//!    marks it to go first (`SeqView::overdue`, the oldest first): it gets at
//!    least every second step's prefill budget, and the shortest prompt beside
//!    it the steps between (its prefill takes at most about twice the steps
//!    it would alone). In that loop the longest first token fell to 36-38 s
//!    (`bench/results/2026-12-04-zen4-c/overdue/`). (Putting overdue prompts
//!    first on every step, counted from arrival, was tried: under overload
//!    every prompt that gets a slot has waited about W_max in the queue, so
//!    the order became first-come and short prompts waited 15-25 s behind a
//!    3,100-token one; `bench/results/2026-12-04-zen4-b/`. Counted from the
//!    slot at W_max alone, a long prompt under load took every other step
//!    from the short ones early: in the same bench, 0.100 req/s goodput in
//!    the worst round against 0.144 with the forecast's stretch.)
//!    An interactive prompt is never held behind a batch prompt's prefill.
//! 3. A step never holds more tokens than the budget, and the budget never
//!    exceeds llama.cpp's `n_batch` (more aborts the process); both are asserted.
//! 4. With nothing decoding, a step that finishes a prompt's prefill takes no
//!    chunk of a prompt it does not finish. No stream bounds such a step (its
//!    budget is `n_batch`, or what fits `--itl-max-ms`: seconds on a slow
//!    CPU), so the chunk would hold back the first tokens of
//!    the prompts it finishes by its whole cost (in the side-by-side's mix
//!    on a 2-core Zen 1, a 139-token prompt that arrived while a 1,964-token
//!    one was being prefilled alone shared its step with 373 of that one's
//!    tokens, seconds of compute that deep, and waited 14.2 s for its first
//!    token). The prompt left out starts in the next step, beside the new
//!    streams, whole if their pace allows a short prompt whole
//!    (`budget_with_whole_prompt`: only a prompt not yet begun may be).

use crate::priority::Class;

/// The planner's view of one active sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqView {
    /// Slot index (the llama.cpp sequence id).
    pub slot: usize,
    pub class: Class,
    /// Admission order; smaller is older.
    pub admitted: u64,
    pub phase: Phase,
    /// Goes first among its class's prompts in this step: set by the engine,
    /// on every other step, for a prompt overdue in its slot.
    pub overdue: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Prompt tokens not yet in the KV cache.
    Prefill { remaining_tokens: usize },
    /// Generating; needs one token per step.
    Decode,
    /// Generating, but its stream buffer is full: no compute until the reader drains.
    Paused,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// One decode token (the last sampled token of the sequence).
    Decode,
    /// The next `n_tokens` prompt tokens.
    Prefill { n_tokens: usize },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub slot: usize,
    pub work: Work,
}

/// The plan for one step: decode entries first, then prefill chunks.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Plan {
    pub entries: Vec<Entry>,
}

impl Plan {
    pub fn n_tokens(&self) -> usize {
        self.entries
            .iter()
            .map(|e| match e.work {
                Work::Decode => 1,
                Work::Prefill { n_tokens } => n_tokens,
            })
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn n_decode(&self) -> usize {
        self.entries
            .iter()
            .filter(|e| e.work == Work::Decode)
            .count()
    }
}

/// Plans one step under `step_tokens_max`.
///
/// Precondition (asserted at start-up, repeated here): the budget is at least the
/// number of sequences, so every running sequence always gets its decode token.
pub fn plan_step(seqs: &[SeqView], step_tokens_max: usize) -> Plan {
    assert!(step_tokens_max >= 1, "step budget must be at least 1 token");
    assert!(
        seqs.len() <= step_tokens_max,
        "{} sequences cannot each get a token in a {}-token step",
        seqs.len(),
        step_tokens_max
    );

    let mut entries: Vec<Entry> = seqs
        .iter()
        .filter(|s| s.phase == Phase::Decode)
        .map(|s| Entry {
            slot: s.slot,
            work: Work::Decode,
        })
        .collect();
    let mut budget = step_tokens_max - entries.len();
    let streams = !entries.is_empty();
    let mut finishes_one = false;

    for (remaining, slot) in prefill_order(seqs) {
        if budget == 0 {
            break;
        }
        if !streams && finishes_one && remaining > budget {
            // Rule 4: nothing else waits on this step but the prompts it
            // finishes; a chunk it cannot finish would only delay them.
            continue;
        }
        let n_tokens = remaining.min(budget);
        finishes_one |= n_tokens == remaining;
        budget -= n_tokens;
        entries.push(Entry {
            slot,
            work: Work::Prefill { n_tokens },
        });
    }

    let plan = Plan { entries };
    debug_assert!(plan.n_tokens() <= step_tokens_max);
    plan
}

/// The prompt the next step's prefill goes to first, as (remaining tokens,
/// slot).
pub fn first_prompt(seqs: &[SeqView]) -> Option<(usize, usize)> {
    prefill_order(seqs).first().copied()
}

/// The prompts being prefilled, in the order the budget goes to them: the
/// higher class first; in a class, those marked overdue first (oldest
/// first), then the shortest remaining, then the oldest; as (remaining
/// tokens, slot).
fn prefill_order(seqs: &[SeqView]) -> Vec<(usize, usize)> {
    let mut prefills: Vec<&SeqView> = seqs
        .iter()
        .filter(|s| matches!(s.phase, Phase::Prefill { remaining_tokens } if remaining_tokens > 0))
        .collect();
    prefills.sort_unstable_by_key(|s| {
        let size = if s.overdue { 0 } else { remaining(s) };
        (s.class, !s.overdue, size, s.admitted)
    });
    prefills.iter().map(|s| (remaining(s), s.slot)).collect()
}

fn remaining(s: &SeqView) -> usize {
    match s.phase {
        Phase::Prefill { remaining_tokens } => remaining_tokens,
        _ => 0,
    }
}

/// True when marking the overdue prompts changes which prompt the step's
/// prefill goes to first: a shorter prompt is not let overtake.
pub fn overdue_goes_first(seqs: &[SeqView]) -> bool {
    let unmarked: Vec<SeqView> = seqs
        .iter()
        .map(|s| SeqView {
            overdue: false,
            ..*s
        })
        .collect();
    prefill_order(seqs).first() != prefill_order(&unmarked).first()
}

/// Seconds until a stream's next token is due when it keeps a pace of one
/// token per `pace_s` from its first: `tokens` sampled so far, the first of
/// them `since_first_s` ago. Negative when it is behind that pace.
pub fn pace_slack_s(since_first_s: f64, tokens: usize, pace_s: f64) -> f64 {
    tokens as f64 * pace_s - since_first_s
}

/// The step budget raised so that the prompt first in the planner's order is
/// prefilled whole, or `budget` unchanged.
///
/// Chunking a short prompt under the ITL target spreads it over several
/// steps, each also carrying every stream's decode token: its first token
/// comes later, for streams that may be far ahead of any reader. So when
/// streams are decoding and the first prompt does not fit `budget`, it is
/// taken whole if `whole_step_s(slot, tokens)` (the forecast of a step with
/// the decode tokens and all of it; `None` for a prompt already begun: a long
/// prompt's last chunks never stall the streams) is at most `allowed_s()`
/// (what the streams' pace and the longest pause allow; asked only when a
/// prompt could be taken whole) and the step fits `ceiling` (llama.cpp's
/// `n_batch`).
pub fn budget_with_whole_prompt(
    seqs: &[SeqView],
    budget: usize,
    ceiling: usize,
    whole_step_s: impl Fn(usize, usize) -> Option<f64>,
    allowed_s: impl FnOnce() -> f64,
) -> usize {
    let n_decode = seqs.iter().filter(|s| s.phase == Phase::Decode).count();
    if n_decode == 0 {
        return budget;
    }
    let Some(&(remaining, slot)) = prefill_order(seqs).first() else {
        return budget;
    };
    let whole = n_decode + remaining;
    if whole <= budget || whole > ceiling {
        return budget;
    }
    match whole_step_s(slot, remaining) {
        Some(s) if s <= allowed_s() => whole,
        _ => budget,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(slot: usize, admitted: u64, phase: Phase) -> SeqView {
        SeqView {
            slot,
            class: Class::Interactive,
            admitted,
            phase,
            overdue: false,
        }
    }

    #[test]
    fn interactive_prompts_are_prefilled_before_batch_prompts() {
        let batch = |slot, admitted, phase| SeqView {
            class: Class::Batch,
            ..seq(slot, admitted, phase)
        };
        let seqs = [
            batch(0, 0, prefill(10)),
            seq(1, 1, prefill(300)),
            batch(2, 2, Phase::Decode),
        ];
        let plan = plan_step(&seqs, 64);
        assert_eq!(
            plan.entries,
            vec![
                Entry {
                    slot: 2,
                    work: Work::Decode
                },
                Entry {
                    slot: 1,
                    work: Work::Prefill { n_tokens: 63 }
                },
            ],
            "a batch stream still decodes; the short batch prompt waits"
        );
        let plan = plan_step(&seqs, 306);
        assert_eq!(
            plan.entries[2],
            Entry {
                slot: 0,
                work: Work::Prefill { n_tokens: 5 }
            },
            "batch takes what interactive leaves"
        );
        let plan = plan_step(&seqs[..2], 310);
        assert_eq!(plan.entries[1].slot, 0, "and with nothing decoding too");
    }

    fn prefill(n: usize) -> Phase {
        Phase::Prefill {
            remaining_tokens: n,
        }
    }

    #[test]
    fn empty_state_plans_nothing() {
        assert!(plan_step(&[], 64).is_empty());
    }

    #[test]
    fn decode_tokens_come_before_prefill_chunks() {
        let seqs = [
            seq(0, 0, prefill(6000)),
            seq(1, 1, Phase::Decode),
            seq(2, 2, Phase::Decode),
        ];
        let plan = plan_step(&seqs, 64);
        assert_eq!(
            plan.entries,
            vec![
                Entry {
                    slot: 1,
                    work: Work::Decode
                },
                Entry {
                    slot: 2,
                    work: Work::Decode
                },
                Entry {
                    slot: 0,
                    work: Work::Prefill { n_tokens: 62 }
                },
            ]
        );
        assert_eq!(plan.n_tokens(), 64);
    }

    #[test]
    fn a_long_prompt_is_chunked_under_the_budget() {
        let mut remaining = 6000;
        let mut steps = 0;
        while remaining > 0 {
            let plan = plan_step(&[seq(3, 0, prefill(remaining))], 512);
            assert!(plan.n_tokens() <= 512);
            remaining -= plan.n_tokens();
            steps += 1;
        }
        assert_eq!(steps, 12); // ceil(6000 / 512)
    }

    #[test]
    fn shortest_prefill_goes_first_so_a_short_prompt_is_not_stuck_behind_a_long_one() {
        let seqs = [
            seq(0, 0, prefill(6000)),
            seq(1, 1, prefill(20)),
            seq(2, 2, Phase::Decode),
        ];
        let plan = plan_step(&seqs, 64);
        assert_eq!(
            plan.entries,
            vec![
                Entry {
                    slot: 2,
                    work: Work::Decode
                },
                Entry {
                    slot: 1,
                    work: Work::Prefill { n_tokens: 20 }
                },
                Entry {
                    slot: 0,
                    work: Work::Prefill { n_tokens: 43 }
                },
            ]
        );
    }

    #[test]
    fn with_nothing_decoding_a_step_that_finishes_a_prompt_takes_no_chunk_it_does_not_finish() {
        let chunks = |seqs: &[SeqView]| -> Vec<(usize, usize)> {
            plan_step(seqs, 512)
                .entries
                .iter()
                .map(|e| (e.slot, n_prefill(e.work)))
                .collect()
        };
        let long = seq(0, 0, prefill(6000));
        assert_eq!(
            chunks(&[long, seq(1, 1, prefill(20))]),
            [(1, 20)],
            "the short prompt's first token does not wait for 492 of the long one's"
        );
        // Every prompt it finishes, it takes.
        let short = [
            seq(1, 1, prefill(20)),
            seq(2, 2, prefill(300)),
            seq(3, 3, prefill(100)),
        ];
        assert_eq!(
            chunks(&[long, short[0], short[1], short[2]]),
            [(1, 20), (3, 100), (2, 300)]
        );
        // A step that finishes none still fills its budget.
        assert_eq!(chunks(&[long, seq(1, 1, prefill(700))]), [(1, 512)]);
        // A stream decoding bounds the step anyway: the rest goes to the
        // next prompt.
        let seqs = [long, short[0], seq(2, 2, Phase::Decode)];
        assert_eq!(plan_step(&seqs, 512).n_tokens(), 512);
    }

    fn n_prefill(work: Work) -> usize {
        match work {
            Work::Prefill { n_tokens } => n_tokens,
            Work::Decode => 0,
        }
    }

    #[test]
    fn a_prompt_marked_overdue_is_not_overtaken_by_shorter_ones() {
        let overdue = |slot, admitted, n| SeqView {
            overdue: true,
            ..seq(slot, admitted, prefill(n))
        };
        let seqs = [
            seq(0, 9, prefill(20)),
            overdue(1, 5, 2000),
            overdue(2, 3, 1500),
            seq(3, 1, Phase::Decode),
        ];
        let order: Vec<usize> = plan_step(&seqs, 512)
            .entries
            .iter()
            .map(|e| e.slot)
            .collect();
        assert_eq!(order, [3, 2], "the stream, then the oldest overdue prompt");
        assert!(overdue_goes_first(&seqs));
        let plan = plan_step(&seqs, 3600);
        assert_eq!(
            plan.entries[1..],
            [
                Entry {
                    slot: 2,
                    work: Work::Prefill { n_tokens: 1500 }
                },
                Entry {
                    slot: 1,
                    work: Work::Prefill { n_tokens: 2000 }
                },
                Entry {
                    slot: 0,
                    work: Work::Prefill { n_tokens: 20 }
                },
            ],
            "overdue oldest first, then the shortest"
        );
        // On the steps between, the engine marks none: shortest first again.
        let unmarked = [seqs[0], seq(1, 5, prefill(2000)), seq(2, 3, prefill(1500))];
        assert_eq!(plan_step(&unmarked, 512).entries[0].slot, 0);
        assert!(!overdue_goes_first(&unmarked));
        let batch = SeqView {
            class: Class::Batch,
            ..overdue(4, 0, 10)
        };
        let plan = plan_step(&[batch, seq(0, 9, prefill(20))], 30);
        assert_eq!(
            plan.entries[0].slot, 0,
            "an overdue batch prompt still waits for interactive ones"
        );
        // Already first (the shortest), it changes nothing.
        assert!(!overdue_goes_first(&[
            overdue(1, 5, 10),
            seq(0, 9, prefill(20))
        ]));
    }

    #[test]
    fn equal_prefills_are_served_oldest_first() {
        let seqs = [seq(0, 7, prefill(100)), seq(1, 3, prefill(100))];
        let plan = plan_step(&seqs, 100);
        assert_eq!(
            plan.entries,
            vec![Entry {
                slot: 1,
                work: Work::Prefill { n_tokens: 100 }
            }]
        );
    }

    #[test]
    fn paused_sequences_get_no_compute() {
        let seqs = [seq(0, 0, Phase::Paused), seq(1, 1, Phase::Decode)];
        let plan = plan_step(&seqs, 8);
        assert_eq!(
            plan.entries,
            vec![Entry {
                slot: 1,
                work: Work::Decode
            }]
        );
    }

    #[test]
    fn a_full_budget_of_decodes_leaves_no_room_for_prefill() {
        let seqs = [
            seq(0, 0, Phase::Decode),
            seq(1, 1, Phase::Decode),
            seq(2, 2, prefill(10)),
        ];
        let plan = plan_step(&seqs, 3);
        assert_eq!(plan.n_decode(), 2);
        assert_eq!(plan.n_tokens(), 3);
        assert_eq!(
            plan.entries[2],
            Entry {
                slot: 2,
                work: Work::Prefill { n_tokens: 1 }
            }
        );
    }

    #[test]
    fn never_exceeds_the_budget_for_any_mix() {
        // Exhaustive over small states: the budget holds and every decoder is served.
        for budget in 4..=9 {
            for mask in 0..81u32 {
                let mut seqs = Vec::new();
                let mut m = mask;
                for slot in 0..4 {
                    let phase = match m % 3 {
                        0 => Phase::Decode,
                        1 => Phase::Paused,
                        _ => prefill(1 + slot * 5),
                    };
                    m /= 3;
                    seqs.push(seq(slot, slot as u64, phase));
                }
                let plan = plan_step(&seqs, budget);
                let decoders = seqs.iter().filter(|s| s.phase == Phase::Decode).count();
                assert!(plan.n_tokens() <= budget);
                assert_eq!(plan.n_decode(), decoders);
                assert!(plan.entries[..decoders]
                    .iter()
                    .all(|e| e.work == Work::Decode));
            }
        }
    }

    #[test]
    #[should_panic(expected = "cannot each get a token")]
    fn more_sequences_than_budget_is_a_programming_error() {
        let seqs = [seq(0, 0, Phase::Decode), seq(1, 1, Phase::Decode)];
        plan_step(&seqs, 1);
    }

    /// A step forecast of 10 ms a token, and every prompt not begun.
    fn ten_ms(_slot: usize, tokens: usize) -> Option<f64> {
        Some(tokens as f64 * 0.010)
    }

    #[test]
    fn a_short_prompt_beside_streams_ahead_of_their_pace_is_taken_whole() {
        let seqs = [
            seq(0, 0, Phase::Decode),
            seq(1, 1, Phase::Decode),
            seq(2, 2, prefill(90)),
        ];
        // 90 tokens at 10 ms: 0.9 s, allowed.
        let budget = budget_with_whole_prompt(&seqs, 20, 512, ten_ms, || 1.0);
        assert_eq!(budget, 92);
        // The planner then gives it all of them, beside both decode tokens.
        let plan = plan_step(&seqs, budget);
        assert_eq!(plan.n_decode(), 2);
        assert!(plan.entries.contains(&Entry {
            slot: 2,
            work: Work::Prefill { n_tokens: 90 }
        }));
    }

    #[test]
    fn the_prompt_taken_whole_is_the_one_the_planner_serves_first() {
        // The shorter of two interactive prompts, not the older; an
        // interactive one before a shorter batch one.
        let mut batch = seq(4, 0, prefill(5));
        batch.class = Class::Batch;
        let seqs = [
            seq(0, 0, Phase::Decode),
            seq(1, 1, prefill(80)),
            seq(2, 2, prefill(60)),
            batch,
        ];
        let budget = budget_with_whole_prompt(&seqs, 10, 512, ten_ms, || 1.0);
        assert_eq!(budget, 61);
        let plan = plan_step(&seqs, budget);
        assert_eq!(
            plan.entries,
            vec![
                Entry {
                    slot: 0,
                    work: Work::Decode
                },
                Entry {
                    slot: 2,
                    work: Work::Prefill { n_tokens: 60 }
                },
            ]
        );
    }

    #[test]
    fn a_prompt_is_chunked_when_the_pause_is_not_allowed() {
        let seqs = [seq(0, 0, Phase::Decode), seq(1, 1, prefill(90))];
        // A stream behind its pace (or a longest pause) allowing 0.5 s.
        assert_eq!(budget_with_whole_prompt(&seqs, 20, 512, ten_ms, || 0.5), 20);
        assert_eq!(
            budget_with_whole_prompt(&seqs, 20, 512, ten_ms, || -3.0),
            20
        );
        // A prompt already begun is never finished in one long step.
        assert_eq!(
            budget_with_whole_prompt(&seqs, 20, 512, |_, _| None, || 100.0),
            20
        );
        // Nor one that would not fit llama.cpp's batch.
        assert_eq!(
            budget_with_whole_prompt(&seqs, 20, 64, ten_ms, || 100.0),
            20
        );
    }

    #[test]
    fn without_streams_or_when_it_fits_the_budget_is_unchanged() {
        // Nothing decodes: the budget is already the ceiling's.
        let alone = [seq(0, 0, prefill(900)), seq(1, 1, Phase::Paused)];
        assert_eq!(
            budget_with_whole_prompt(&alone, 512, 512, ten_ms, || 100.0),
            512
        );
        // The prompt fits the budget as it is.
        let seqs = [seq(0, 0, Phase::Decode), seq(1, 1, prefill(10))];
        assert_eq!(
            budget_with_whole_prompt(&seqs, 20, 512, ten_ms, || 100.0),
            20
        );
        // No prompt at all.
        let decoding = [seq(0, 0, Phase::Decode)];
        assert_eq!(
            budget_with_whole_prompt(&decoding, 20, 512, ten_ms, || 100.0),
            20
        );
    }

    #[test]
    fn pace_slack_is_the_time_until_the_next_token_is_due() {
        // First token 0.3 s ago, 3 tokens at a 150 ms pace: the 4th is due
        // 0.45 s after the first, 0.15 s from now.
        assert!((pace_slack_s(0.3, 3, 0.150) - 0.15).abs() < 1e-9);
        // Behind: 10 tokens in 2 s at 150 ms.
        assert!(pace_slack_s(2.0, 10, 0.150) < 0.0);
    }
}
