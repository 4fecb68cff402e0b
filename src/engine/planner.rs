//! The batch planner: which tokens go into the next engine step.
//!
//! It is a pure function of the scheduler's state so that the rules that keep
//! streams alive under a long prompt can be tested without threads or a model:
//!
//! 1. Every running sequence that is not paused gets exactly one decode token,
//!    and these come **first**. A stream's inter-token latency is therefore one
//!    step, whatever else is waiting.
//! 2. The rest of the per-step token budget goes to prefill chunks: the higher
//!    priority class first (`priority::Class`), then the shortest remaining
//!    prompt first (ties by age). A short prompt that arrives while an
//!    8k-token prompt is being prefilled gets its first token after one step, not
//!    after the whole long prefill. The long prompt cannot starve: the number of
//!    sequences is bounded by `--parallel`, each short prompt is prefilled once,
//!    and the budget left after decode tokens always goes to some prefill.
//!    An interactive prompt is never held behind a batch prompt's prefill.
//! 3. A step never holds more tokens than the budget, and the budget never
//!    exceeds llama.cpp's `n_batch` (more aborts the process); both are asserted.

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

    let mut prefills: Vec<(Class, usize, u64, usize)> = seqs
        .iter()
        .filter_map(|s| match s.phase {
            Phase::Prefill { remaining_tokens } if remaining_tokens > 0 => {
                Some((s.class, remaining_tokens, s.admitted, s.slot))
            }
            _ => None,
        })
        .collect();
    prefills.sort_unstable();
    for (_, remaining, _, slot) in prefills {
        if budget == 0 {
            break;
        }
        let n_tokens = remaining.min(budget);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(slot: usize, admitted: u64, phase: Phase) -> SeqView {
        SeqView {
            slot,
            class: Class::Interactive,
            admitted,
            phase,
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
        let plan = plan_step(&seqs[..2], 305);
        assert_eq!(
            plan.entries[1],
            Entry {
                slot: 0,
                work: Work::Prefill { n_tokens: 5 }
            },
            "batch takes what interactive leaves"
        );
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
        let seqs = [seq(0, 0, prefill(6000)), seq(1, 1, prefill(20))];
        let plan = plan_step(&seqs, 64);
        assert_eq!(
            plan.entries,
            vec![
                Entry {
                    slot: 1,
                    work: Work::Prefill { n_tokens: 20 }
                },
                Entry {
                    slot: 0,
                    work: Work::Prefill { n_tokens: 44 }
                },
            ]
        );
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
}
