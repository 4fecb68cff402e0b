//! A step's `llama_decode` passes. Per-sequence KV, a step beside decoding
//! streams makes two: in one pass every sequence attends as deep as the
//! deepest stream in it, so decode tokens go apart from prompt chunks, but
//! for a one-token chunk (a restored prompt's last token) no deeper than the
//! decode tokens' padded span, which rides with them. The decode tokens' pass
//! goes first, unless a chunk of the other ends its prompt: that prompt's
//! first token then comes out one decode pass sooner (llama-server's comes
//! out of the one pass that holds both), and the streams' tokens of the step
//! one prefill later (the gap a prompt costs them is as long, one token
//! sooner). An embedding request's chunks always go in a pass of their own,
//! with embeddings on.

use super::contexts::MAIN;
use super::planner::{Entry, Plan, Work};

/// Cells llama.cpp's attention spans for a stream holding `cells`: it pads
/// the span to a multiple of 256 (`llama_kv_cache::get_n_kv`), and in one pass
/// every sequence attends as far as the deepest one's padded span.
pub const ATTENTION_SPAN_PAD: usize = 256;

fn attention_span(cells: usize) -> usize {
    cells.div_ceil(ATTENTION_SPAN_PAD).max(1) * ATTENTION_SPAN_PAD
}

/// Whether a prompt chunk rides in the decode tokens' pass (per-sequence KV,
/// where decode tokens and prompt chunks otherwise go in two passes): only a
/// chunk of one token (a prompt whose prefix came back from the prefix cache
/// or from its first choice, its last token left to compute for logits) that
/// extends its stream no deeper than the span the decode pass attends anyway.
/// Such a token costs what a decode token costs; in a pass of its own it
/// reads all the weights again for one token. `depth` is the chunk's first
/// position, `deepest_decode` the largest position a decode token of the step
/// takes (`None`: nothing decodes, there is no decode pass).
pub fn rides_decode_pass(work: Work, depth: usize, deepest_decode: Option<usize>) -> bool {
    match (work, deepest_decode) {
        (Work::Prefill { n_tokens: 1 }, Some(deepest)) => {
            attention_span(depth + 1) <= attention_span(deepest + 1)
        }
        _ => false,
    }
}

/// A step's `llama_decode` passes: each with whether it runs with embeddings
/// on, and the slots of the prompt chunks that ride in the decode pass.
pub struct Passes<'p> {
    pub passes: Vec<(Vec<&'p Entry>, bool)>,
    pub riders: Vec<usize>,
}

/// Splits `plan` into passes. An embedding request's chunks go in a pass of
/// their own, the one with embeddings on (every token of it is output). Per
/// sequence (`per_seq`), decode tokens and prompt chunks go in two passes,
/// since in one pass every sequence attends as deep as the deepest stream
/// in it; a chunk that `rides_decode_pass` goes in the decode tokens' (the
/// cost model counts it as a decode token). The prompt chunks' pass goes
/// first when `ends_prompt(slot, tokens)` says one of them ends its prompt.
/// `depth` is a slot's next position.
pub fn passes<'p>(
    plan: &'p Plan,
    per_seq: bool,
    embeds: impl Fn(usize) -> bool,
    depth: impl Fn(usize) -> usize,
    ends_prompt: impl Fn(usize, usize) -> bool,
) -> Passes<'p> {
    let (embeds, rest): (Vec<&Entry>, Vec<&Entry>) =
        plan.entries.iter().partition(|e| embeds(e.slot));
    let n_decode = rest.iter().filter(|e| e.work == Work::Decode).count();
    let deepest_decode = rest
        .iter()
        .filter(|e| e.work == Work::Decode)
        .map(|e| depth(e.slot))
        .max();
    let riders: Vec<usize> = rest
        .iter()
        .filter(|e| per_seq && rides_decode_pass(e.work, depth(e.slot), deepest_decode))
        .map(|e| e.slot)
        .collect();
    let mut passes = if per_seq && n_decode > 0 && n_decode + riders.len() < rest.len() {
        let (decode, prefill): (Vec<&Entry>, Vec<&Entry>) = rest
            .into_iter()
            .partition(|e| e.work == Work::Decode || riders.contains(&e.slot));
        let first_token = prefill.iter().any(|e| match e.work {
            Work::Prefill { n_tokens } => ends_prompt(e.slot, n_tokens),
            Work::Decode => false,
        });
        if first_token {
            vec![(prefill, false), (decode, false)]
        } else {
            vec![(decode, false), (prefill, false)]
        }
    } else if rest.is_empty() {
        Vec::new()
    } else {
        vec![(rest, false)]
    };
    if !embeds.is_empty() {
        passes.push((embeds, true));
    }
    Passes { passes, riders }
}

/// Splits each pass into one per context its sequences live in (`home` of
/// a slot; `engine::contexts`), the main context's first: a pass is one
/// context's `llama_decode`.
pub fn by_home(
    passes: Vec<(Vec<&Entry>, bool)>,
    home: impl Fn(usize) -> usize,
) -> Vec<(Vec<&Entry>, bool)> {
    let mut out = Vec::with_capacity(passes.len());
    for (pass, embeddings) in passes {
        let (main, other): (Vec<&Entry>, Vec<&Entry>) =
            pass.into_iter().partition(|e| home(e.slot) == MAIN);
        out.extend(
            [(main, embeddings), (other, embeddings)]
                .into_iter()
                .filter(|(p, _)| !p.is_empty()),
        );
    }
    out
}

/// Runs of consecutive ids among `slots`. Per-sequence KV, llama.cpp takes a
/// micro-batch's sequences in increasing consecutive ids only
/// (`llama_batch_allocr::split_equal`), so a `llama_decode` makes one pass
/// over the weights per run: decode tokens of slots 0 and 2 cost two passes,
/// of 2 and 3 one.
pub fn id_runs(slots: impl IntoIterator<Item = usize>) -> usize {
    let mut ids: Vec<usize> = slots.into_iter().collect();
    ids.sort_unstable();
    ids.dedup();
    let gaps = ids.windows(2).filter(|w| w[1] != w[0] + 1).count();
    usize::from(!ids.is_empty()) + gaps
}

/// The ids missing between the lowest and the highest of `slots`: per
/// sequence, a pass whose decode tokens leave such a hole (a stream ended
/// in a middle slot, and its client's next request has not started there
/// yet) takes one token more for each, a *filler* in that id's stream whose
/// cell is freed after the pass, so that llama.cpp makes one pass over the
/// weights, not one per run of ids. On the 2-core Zen 4 a decode step of
/// slots 0, 1 and 3 took 79 ms in two passes, one of all four 61 ms
/// (medians, with a test build beside it); in a 4-client closed loop 61 of
/// 234 steps had such a hole.
pub fn gap_ids(slots: impl IntoIterator<Item = usize>) -> Vec<usize> {
    let mut ids: Vec<usize> = slots.into_iter().collect();
    ids.sort_unstable();
    ids.dedup();
    ids.windows(2).flat_map(|w| w[0] + 1..w[1]).collect()
}

/// Whether a filler at position `pos` costs the pass no attention: in one
/// pass every sequence attends as far as the deepest one's padded span
/// (`attention_span`), `deepest` being the largest position the pass's
/// tokens take. A deeper one (a long prompt's stream, a long conversation
/// parked) would make every token of the pass attend that deep, which costs
/// more than the second pass it saves.
pub fn filler_fits(pos: usize, deepest: usize) -> bool {
    attention_span(pos + 1) <= attention_span(deepest + 1)
}

/// The slot, of the `free` ones, a job takes beside the sequences `running`
/// in the context it starts in: the one that leaves them in the fewest runs
/// of consecutive ids (`id_runs`: each run is one more pass over the weights
/// at every step they decode together), then one other than the `parked`
/// slot (its cells wait for their conversation's next turn; a job that
/// starts there puts them away first), then the lowest. In a closed loop of
/// 2 clients, taking the lowest free slot left the two streams in slots 0
/// and 2 a third of the time: two passes a decode step.
pub fn slot_for(free: &[usize], running: &[usize], parked: Option<usize>) -> Option<usize> {
    free.iter().copied().min_by_key(|&slot| {
        let runs = id_runs(running.iter().copied().chain([slot]));
        (runs, Some(slot) == parked, slot)
    })
}

#[cfg(test)]
mod tests {
    use super::super::contexts::SHORT;
    use super::*;

    #[test]
    fn the_gaps_are_the_ids_missing_inside_a_pass() {
        assert!(gap_ids([]).is_empty());
        assert!(gap_ids([2]).is_empty());
        assert!(gap_ids([0, 1, 2, 3]).is_empty());
        assert_eq!(gap_ids([3, 0, 1]), vec![2]);
        assert_eq!(gap_ids([0, 3]), vec![1, 2]);
        assert_eq!(gap_ids([1, 1, 4, 6]), vec![2, 3, 5]);
        // With its gaps filled, a pass is one run of ids.
        let slots = [0, 3, 5];
        assert_eq!(id_runs(slots.into_iter().chain(gap_ids(slots))), 1);
    }

    #[test]
    fn a_filler_goes_only_where_the_pass_attends_anyway() {
        // Streams 300 deep attend 512 cells: a filler up to that span fits.
        assert!(filler_fits(0, 300));
        assert!(filler_fits(511, 300));
        assert!(!filler_fits(512, 300), "a stream parked deeper");
        assert!(!filler_fits(5000, 300), "a long prompt's stream");
        assert!(filler_fits(5000, 5100));
    }

    #[test]
    fn id_runs_counts_the_passes_llama_cpp_makes_of_per_sequence_ids() {
        assert_eq!(id_runs([]), 0);
        assert_eq!(id_runs([2]), 1);
        assert_eq!(id_runs([2, 3]), 1);
        assert_eq!(id_runs([0, 2]), 2);
        assert_eq!(id_runs([3, 0, 1]), 2);
        assert_eq!(id_runs([0, 1, 2, 3]), 1);
        assert_eq!(id_runs([0, 2, 4, 5]), 3);
        assert_eq!(id_runs([1, 1, 2]), 1, "a slot counted once");
    }

    #[test]
    fn a_job_takes_the_free_slot_that_keeps_the_running_ids_consecutive() {
        // Nothing running: the lowest slot that is not parked.
        assert_eq!(slot_for(&[0, 1, 2, 3], &[], None), Some(0));
        assert_eq!(slot_for(&[0, 1, 2, 3], &[], Some(0)), Some(1));
        // Beside slot 2: slot 3 (or 1), not 0.
        assert_eq!(slot_for(&[0, 1, 3], &[2], Some(1)), Some(3));
        assert_eq!(slot_for(&[0, 1, 3], &[2], None), Some(1));
        // Beside slot 3, with 2 parked and 0 and 1 free: the parked slot,
        // rather than a second pass at every step.
        assert_eq!(slot_for(&[0, 1, 2], &[3], Some(2)), Some(2));
        // A gap the job fills: two runs become one.
        assert_eq!(slot_for(&[1, 3], &[0, 2], None), Some(1));
        // No free slot.
        assert_eq!(slot_for(&[], &[0, 1, 2, 3], None), None);
    }

    #[test]
    fn a_pass_over_sequences_of_both_contexts_goes_as_two() {
        let e = |slot, work| Entry { slot, work };
        let chunk = Work::Prefill { n_tokens: 32 };
        let plan = Plan {
            entries: vec![
                e(0, Work::Decode),
                e(1, Work::Decode),
                e(2, Work::Decode),
                e(3, chunk),
            ],
        };
        // Slots 1 and 2 are short requests; 0 and 3 (a long prompt) are not.
        let home = |slot: usize| [MAIN, SHORT, SHORT, MAIN][slot];
        let p = passes(&plan, true, |_| false, |_| 100, |_, _| false);
        assert_eq!(p.passes.len(), 2, "decode tokens apart from the chunk");
        let split = by_home(p.passes, home);
        let slots: Vec<Vec<usize>> = split
            .iter()
            .map(|(p, _)| p.iter().map(|e| e.slot).collect())
            .collect();
        assert_eq!(slots, vec![vec![0], vec![1, 2], vec![3]]);
        // Every sequence in one context: the passes as they were.
        let p = passes(&plan, true, |_| false, |_| 100, |_, _| false);
        assert_eq!(by_home(p.passes, |_| SHORT).len(), 2);
        let p = passes(&plan, true, |_| false, |_| 100, |_, _| false);
        assert_eq!(by_home(p.passes, |_| MAIN).len(), 2);
    }

    #[test]
    fn a_chunk_that_ends_its_prompt_goes_before_the_decode_tokens() {
        let e = |slot, work| Entry { slot, work };
        let plan = Plan {
            entries: vec![
                e(0, Work::Decode),
                e(1, Work::Decode),
                e(2, Work::Prefill { n_tokens: 40 }),
                e(3, Work::Prefill { n_tokens: 90 }),
            ],
        };
        let order = |ends: &dyn Fn(usize, usize) -> bool| -> Vec<Vec<usize>> {
            passes(&plan, true, |_| false, |_| 100, ends)
                .passes
                .iter()
                .map(|(p, _)| p.iter().map(|e| e.slot).collect())
                .collect()
        };
        // Chunks of prompts that go on: the streams' tokens first.
        assert_eq!(order(&|_, _| false), vec![vec![0, 1], vec![2, 3]]);
        // Slot 3's 90 tokens end its prompt: its first token comes out first.
        assert_eq!(
            order(&|slot, n| slot == 3 && n == 90),
            vec![vec![2, 3], vec![0, 1]]
        );
        // Unified, or nothing decoding: one pass, as before.
        let one = passes(&plan, false, |_| false, |_| 100, |_, _| true);
        assert_eq!(one.passes.len(), 1);
    }

    #[test]
    fn only_a_one_token_chunk_no_deeper_than_the_decode_pass_rides_in_it() {
        let one = Work::Prefill { n_tokens: 1 };
        // A restored 200-token prompt beside streams 300 tokens deep.
        assert!(rides_decode_pass(one, 199, Some(300)));
        // Deeper, but within the span the decode pass pads to anyway.
        assert!(rides_decode_pass(one, 250, Some(100)));
        assert!(rides_decode_pass(one, 511, Some(300)));
        // Past it: every stream would attend its depth.
        assert!(!rides_decode_pass(one, 512, Some(300)));
        assert!(!rides_decode_pass(one, 6_000, Some(300)));
        // More than one token, a decode token itself, or no decode pass.
        assert!(!rides_decode_pass(
            Work::Prefill { n_tokens: 2 },
            10,
            Some(300)
        ));
        assert!(!rides_decode_pass(Work::Decode, 10, Some(300)));
        assert!(!rides_decode_pass(one, 10, None));
    }

    #[test]
    fn passes_put_a_rider_with_the_decode_tokens_and_the_rest_apart() {
        let plan = Plan {
            entries: vec![
                Entry {
                    slot: 0,
                    work: Work::Decode,
                },
                Entry {
                    slot: 1,
                    work: Work::Prefill { n_tokens: 1 },
                },
                Entry {
                    slot: 2,
                    work: Work::Prefill { n_tokens: 40 },
                },
                Entry {
                    slot: 3,
                    work: Work::Prefill { n_tokens: 8 },
                },
            ],
        };
        // Slot 3 is an embedding request; slot 1 a restored prompt as deep as
        // slot 0's stream.
        let depth = |slot: usize| [300, 200, 0, 0][slot];
        let p = passes(&plan, true, |slot| slot == 3, depth, |_, _| false);
        let slots = |i: usize| p.passes[i].0.iter().map(|e| e.slot).collect::<Vec<_>>();
        assert_eq!(p.passes.len(), 3);
        assert_eq!((slots(0), p.passes[0].1), (vec![0, 1], false));
        assert_eq!((slots(1), p.passes[1].1), (vec![2], false));
        assert_eq!((slots(2), p.passes[2].1), (vec![3], true));
        assert_eq!(p.riders, vec![1]);
        // Unified: one pass for all but the embedding, no riders.
        let p = passes(&plan, false, |slot| slot == 3, depth, |_, _| false);
        assert_eq!(p.passes.len(), 2);
        assert_eq!(p.passes[0].0.len(), 3);
        assert!(p.riders.is_empty());
        // Nothing deeper than its span: the rider alone with the decode token.
        let only = Plan {
            entries: plan.entries[..2].to_vec(),
        };
        let p = passes(&only, true, |_| false, depth, |_, _| false);
        assert_eq!(p.passes.len(), 1);
        assert_eq!(p.riders, vec![1]);
    }
}
