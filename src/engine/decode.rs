//! A pass's `llama_decode`: the batch of its entries (and of the filler
//! tokens in the ids missing among them, `passes::gap_ids`), the call, and
//! what it failed, aborted or counted.

use super::*;

impl Engine {
    /// Puts `entries` in the batch: each one's (slot, first batch index,
    /// tokens), and what the pass counts for the attention pairing's choice;
    /// and a token of no output for each of `fillers` (id, position:
    /// `passes::gap_ids`) in its place among them.
    pub(super) fn fill_batch(
        &mut self,
        entries: &[&planner::Entry],
        fillers: &[(usize, i32)],
    ) -> (Vec<Placed>, served::PassCount) {
        self.batch.clear();
        let mut placed: Vec<Placed> = Vec::with_capacity(entries.len());
        // llama.cpp takes the sequences of one pass over the weights in
        // consecutive ids, and in the batch's order: in order, as few passes
        // as the ids allow.
        let mut entries = entries.to_vec();
        entries.sort_by_key(|e| e.slot);
        let mut fillers = fillers.iter().peekable();
        let mut embed_quota = EMBED_PASS_TOKENS_MAX;
        // For the attention pairing's choice at the next start (`served`).
        let mut count = served::PassCount::default();
        for entry in entries {
            while let Some(&(id, pos)) = fillers.next_if(|&&(id, _)| id < entry.slot) {
                self.batch.push(FILLER_TOKEN, pos, id as i32, false);
            }
            let seq_id = entry.slot as i32;
            let seq = self.slots[entry.slot]
                .as_mut()
                .expect("planned slot is active");
            let first = self.batch.len();
            match entry.work {
                Work::Decode => {
                    let token = seq.next_token.expect("a decoding sequence has a token");
                    self.batch.push(token, seq.n_past as i32, seq_id, true);
                    placed.push((entry.slot, first, 1));
                    count.decode(seq.n_past);
                }
                Work::Prefill { n_tokens } if seq.job.embed().is_some() => {
                    // One input at a time, each from position 0 of cells the
                    // one before left empty; every token's state is output.
                    let spec = seq.job.embed().expect("an embedding job");
                    let (_, input_start, input_end) = spec.input_at(seq.n_past);
                    let n = n_tokens.min(input_end - seq.n_past).min(embed_quota);
                    if n == 0 {
                        continue;
                    }
                    embed_quota -= n;
                    for pos in seq.n_past..seq.n_past + n {
                        let at = (pos - input_start) as i32;
                        self.batch.push(seq.job.prompt[pos], at, seq_id, true);
                    }
                    placed.push((entry.slot, first, n));
                }
                Work::Prefill { n_tokens } => {
                    let start = seq.n_past;
                    let end = start + n_tokens;
                    let prompt_len = seq.job.prompt.len();
                    for pos in start..end {
                        let last = pos + 1 == prompt_len;
                        let logits = last || seq.job.echo_logprobs();
                        self.batch
                            .push(seq.job.prompt[pos], pos as i32, seq_id, logits);
                    }
                    placed.push((entry.slot, first, n_tokens));
                    count.chunk(start, n_tokens);
                }
            }
        }
        (placed, count)
    }

    /// Decodes `entries` in one llama.cpp call. Returns each entry's (slot,
    /// first batch index, tokens) and the call's time; `None` when it failed
    /// or was aborted (its sequences are then failed or cancelled).
    pub(super) fn decode_pass(
        &mut self,
        ctx: &mut Contexts,
        entries: &[&planner::Entry],
    ) -> Option<(Vec<Placed>, Duration)> {
        let started = Instant::now();
        let home = entries.first().map_or(contexts::MAIN, |e| ctx.home(e.slot));
        let fillers = self.fillers(ctx, home, entries);
        let (placed, count) = self.fill_batch(entries, &fillers);
        let decoded = self.decode_placed(ctx, home, placed, count, &fillers);
        for &(id, pos) in &fillers {
            ctx.truncate_in(home, id as i32, pos);
        }
        decoded.map(|placed| (placed, started.elapsed()))
    }

    /// Per sequence, a token in each id missing among the pass's
    /// (`passes::gap_ids`), so that it is one pass over the weights: where
    /// that id's stream has a cell free no deeper than the pass attends
    /// anyway. An embedding pass (its own, `passes::passes`) takes none.
    fn fillers(
        &self,
        ctx: &Contexts,
        home: usize,
        entries: &[&planner::Entry],
    ) -> Vec<(usize, i32)> {
        let seqs = || {
            entries
                .iter()
                .filter_map(|e| Some((e, self.slots[e.slot].as_ref()?)))
        };
        if self.cfg.kv_layout != KvLayout::PerSequence
            || seqs().any(|(_, s)| s.job.embed().is_some())
        {
            return Vec::new();
        }
        let deepest = seqs()
            .map(|(e, s)| match e.work {
                Work::Decode => s.n_past,
                Work::Prefill { n_tokens } => s.n_past + n_tokens.saturating_sub(1),
            })
            .max()
            .unwrap_or(0);
        passes::gap_ids(entries.iter().map(|e| e.slot))
            .into_iter()
            .filter_map(|id| Some((id, ctx.next_pos_in(home, id as i32)?)))
            .filter(|&(_, pos)| passes::filler_fits(pos as usize, deepest))
            .collect()
    }

    /// Decodes the batch `fill_batch` made of `placed` (and `fillers`) in
    /// context `home`; `None` when it failed or was aborted.
    fn decode_placed(
        &mut self,
        ctx: &mut Contexts,
        home: usize,
        placed: Vec<Placed>,
        count: served::PassCount,
        fillers: &[(usize, i32)],
    ) -> Option<Vec<Placed>> {
        // A pass whose every sequence is cancelled meanwhile stops mid-way.
        let watch: Vec<_> = placed
            .iter()
            .filter_map(|&(slot, _, _)| self.slots[slot].as_ref())
            .map(|s| Arc::clone(s.job.cancel.raw()))
            .collect();
        self.metrics.passes.fetch_add(1, Ordering::Relaxed);
        if self.cfg.kv_layout == KvLayout::PerSequence {
            let runs = passes::id_runs(
                placed
                    .iter()
                    .map(|&(slot, _, _)| slot)
                    .chain(fillers.iter().map(|&(id, _)| id)),
            );
            let split = runs.saturating_sub(1) as u64;
            self.metrics
                .passes_split
                .fetch_add(split, Ordering::Relaxed);
            self.metrics
                .pass_fillers
                .fetch_add(fillers.len() as u64, Ordering::Relaxed);
        }
        let reused_before = ctx.graphs_reused();
        debug_assert!(
            placed.iter().all(|&(slot, _, _)| ctx.home(slot) == home),
            "a pass's sequences live in one context"
        );
        if let Err(e) = ctx.decode_watching(home, &self.batch, &watch) {
            if e == ffi::DecodeError::Aborted {
                self.metrics.decodes_aborted.fetch_add(1, Ordering::Relaxed);
                for &(slot, _, _) in &placed {
                    let reason = self.slots[slot]
                        .as_ref()
                        .and_then(|s| s.job.cancel.reason())
                        .unwrap_or(CancelReason::Shutdown);
                    self.cancel(ctx, slot, reason);
                }
                return None;
            }
            crate::say!(
                "sluice: decode of a {}-token step failed: {e:?}",
                self.batch.len()
            );
            for &(slot, _, _) in &placed {
                self.fail(
                    ctx,
                    slot,
                    format!("the engine could not decode this request ({e:?})"),
                );
            }
            return None;
        }
        // They choose the main context's pairing at the next start: the
        // short requests' context's tokens are not its to serve.
        if home == contexts::MAIN {
            self.metrics.record_attention(count.prefill, count.decode);
        }
        self.metrics.graphs_reused.fetch_add(
            ctx.graphs_reused().saturating_sub(reused_before),
            Ordering::Relaxed,
        );
        Some(placed)
    }
}
