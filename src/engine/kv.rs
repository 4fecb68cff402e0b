//! A sequence's KV cells when it ends: saved into the prefix cache, or
//! parked in place until saving stalls no stream, then freed.

use super::*;

/// Longest stall a save may cause beside running streams, as a share of the
/// ITL target; a longer one is put off (the cells parked).
const SAVE_STALL_SHARE_MAX: f64 = 0.5;
/// Per sequence, how long the engine has had nothing to do before the parked
/// sequence is saved: a client that sends its next request at once (a closed
/// loop, an agent's next call, a retry) finds the cells in place first.
const PARKED_SAVE_IDLE_MS: u64 = 100;
/// Weight of the newest measurement in the save cost's running mean.
const SAVE_COST_WEIGHT: f64 = 0.5;
/// Saves of sequences in fewer runs than this do not teach the cost of a run:
/// their cost is mostly the bytes, not the runs.
const SAVE_RUNS_LEARN_MIN: usize = 16;
impl Engine {
    /// Frees the slot's KV cells, or, with `keep` (its cells hold what its
    /// tokens say: it completed or was cancelled, not failed), moves them into
    /// a prefix cache entry. Either way its reservation ends.
    /// The slot whose stream holds parked cells (per sequence only).
    pub(super) fn parked_slot(&self) -> Option<usize> {
        let per_seq = self.cfg.kv_layout == KvLayout::PerSequence;
        (per_seq && self.parked.is_some()).then_some(self.parked_seq as usize)
    }

    /// Cells the parked sequence holds (some may be shared with running ones).
    pub(super) fn parked_cells(&self) -> usize {
        self.parked.as_ref().map_or(0, Vec::len)
    }

    /// Saves sequence `seq`'s KV state (its cells hold `tokens`, in at most
    /// `runs` runs) as a prefix cache entry, after making room for it; a
    /// sequence in many runs teaches what a run costs to save.
    pub(super) fn save_into_cache(
        &mut self,
        ctx: &mut Contexts,
        seq: i32,
        tokens: Vec<Token>,
        (runs, exact): (usize, bool),
    ) {
        let home = ctx.home(seq as usize);
        let bytes = ctx.sequence_state_size(seq);
        let room = self.prefix.make_room(&tokens, bytes, home);
        if !room.room {
            // Larger than the whole bound, or only the entry about to be
            // restored could have made room: not copied out (in the latter
            // case its tokens are as good as evicted).
            let dropped = if self.prefix.could_keep(bytes) {
                tokens.len()
            } else {
                0
            };
            self.metrics
                .prefix_tokens_evicted
                .fetch_add((room.evicted_tokens + dropped) as u64, Ordering::Relaxed);
            return;
        }
        let started = Instant::now();
        let state = ctx.save_sequence(seq);
        if exact && runs >= SAVE_RUNS_LEARN_MIN {
            let s = started.elapsed().as_secs_f64() / runs as f64;
            self.save_s_per_run = Some(
                self.save_s_per_run
                    .map_or(s, |old| old + SAVE_COST_WEIGHT * (s - old)),
            );
        }
        let kept = self.prefix.insert(tokens, state, home);
        self.metrics.prefix_tokens_evicted.fetch_add(
            (room.evicted_tokens + kept.evicted_tokens) as u64,
            Ordering::Relaxed,
        );
    }

    /// Whether sequence `seq`'s state could be kept in the prefix cache; counts
    /// one that could not.
    fn state_fits_cache(&self, ctx: &mut Contexts, seq: i32) -> bool {
        let fits = self.prefix.could_keep(ctx.sequence_state_size(seq));
        if !fits {
            self.metrics
                .prefix_too_large
                .fetch_add(1, Ordering::Relaxed);
        }
        fits
    }

    /// Frees the parked cells without saving them.
    pub(super) fn drop_parked(&mut self, ctx: &mut Contexts) {
        if let Some(tokens) = self.parked.take() {
            self.clear_parked(ctx);
            self.metrics
                .prefix_tokens_evicted
                .fetch_add(tokens.len() as u64, Ordering::Relaxed);
        }
    }

    /// Makes the parked sequence's cells free for another: saves it into the
    /// prefix cache unless that would stall decoding streams longer than
    /// `SAVE_STALL_SHARE_MAX` of the ITL target, else frees it unsaved.
    pub(super) fn put_away_parked(&mut self, ctx: &mut Contexts) {
        if self.parked_save_stalls() {
            self.drop_parked(ctx);
        } else {
            self.save_parked(ctx);
        }
    }

    /// Saves the parked sequence (if any) into the prefix cache and frees it.
    fn save_parked(&mut self, ctx: &mut Contexts) {
        if let Some(tokens) = self.parked.take() {
            self.save_into_cache(ctx, self.parked_seq, tokens, self.parked_runs);
            self.clear_parked(ctx);
        }
    }

    /// Whether a save of `runs` runs (or tokens) would stall the streams
    /// longer than `SAVE_STALL_SHARE_MAX` of the ITL target.
    fn save_too_long(&self, runs: usize) -> bool {
        let stall_s = self.save_s_per_run.map_or(0.0, |s| s * runs as f64);
        stall_s > SAVE_STALL_SHARE_MAX * self.cfg.itl_target.as_secs_f64()
    }

    /// Whether saving the parked sequence now would stall decoding streams
    /// longer than `SAVE_STALL_SHARE_MAX` of the ITL target.
    fn parked_save_stalls(&self) -> bool {
        self.save_too_long(self.parked_runs.0) && self.slots.iter().flatten().any(Seq::is_decoding)
    }

    /// Per sequence, the parked sequence's stream is taken over in place by a
    /// job that reuses its first `reuse` tokens; the rest is cut. When that
    /// keeps less than half of its tokens (another prompt sharing only a
    /// system prompt, or a short prompt that a long one extended), the whole
    /// is saved first, unless that would stall the streams: a client that
    /// comes back to it finds it in the cache. A re-sent prompt keeps its
    /// prompt and loses only its answer, uncopied.
    pub(super) fn take_over_parked(&mut self, ctx: &mut Contexts, reuse: usize) -> usize {
        let slot = self.parked_seq;
        if let Some(tokens) = self.parked.take() {
            if reuse * 2 < tokens.len() && !self.parked_save_stalls() {
                self.save_into_cache(ctx, slot, tokens, self.parked_runs);
            }
        }
        self.queue.prefix_ended(slot as usize);
        ctx.truncate_sequence(slot, reuse as i32);
        slot as usize
    }

    /// Saves the parked sequence into the prefix cache once nothing waits for
    /// the copy: unified, once no stream waits for a token (the copy then
    /// delays only prompts); per sequence, once the engine has had nothing to
    /// do for `PARKED_SAVE_IDLE_MS`.
    pub(super) fn save_parked_when_quiet(&mut self, ctx: &mut Contexts) {
        if self.parked.is_none() {
            return;
        }
        let quiet = match self.cfg.kv_layout {
            KvLayout::Unified => !self.slots.iter().flatten().any(Seq::is_decoding),
            KvLayout::PerSequence => self
                .idle_since
                .is_some_and(|t| t.elapsed() >= Duration::from_millis(PARKED_SAVE_IDLE_MS)),
        };
        if quiet {
            self.save_parked(ctx);
        }
    }

    /// Frees the parked sequence's cells and takes them out of the index.
    pub(super) fn clear_parked(&mut self, ctx: &mut Contexts) {
        ctx.clear_sequence(self.parked_seq);
        // A save just made goes to admission first: a prompt judged between
        // the two reports finds its prefix in the cache, not nowhere.
        self.report_prefixes();
        self.queue.prefix_ended(self.parked_seq as usize);
    }

    pub(super) fn release_kv(&mut self, ctx: &mut Contexts, slot: usize, keep: bool) {
        let seq = self.slots[slot].as_mut().expect("slot is active");
        let tokens = std::mem::take(&mut seq.kv_tokens);
        debug_assert!(
            seq.job.embed().is_some() || tokens.len() == seq.n_past,
            "kv_tokens follow n_past"
        );
        // What a save costs: one run of cells at a time (unified), or in
        // proportion to its cells (per sequence: one run in its own stream).
        let runs = match self.cfg.kv_layout {
            KvLayout::Unified => (seq.runs, seq.runs_exact),
            KvLayout::PerSequence => (tokens.len(), true),
        };
        let seq_id = slot as i32;
        self.queue.prefix_ended(slot);
        let others_decoding = self
            .slots
            .iter()
            .enumerate()
            .any(|(s, q)| s != slot && q.as_ref().is_some_and(Seq::is_decoding));
        // Saving copies the sequence's cells one run of consecutive cells at a
        // time (for the transposed V cache, one row of one run): per sequence
        // by the cell (~180 ms for a 6,258-token prompt on the 2-core
        // development box), and in a unified cache more, its cells
        // interleaved with other streams' (196 ms for the same prompt): a
        // stall every stream sees. A save expected to stall them longer than
        // SAVE_STALL_SHARE_MAX of the ITL target is put off: the cells are
        // parked (per sequence where they are, unified on the spare sequence
        // by a metadata copy) and saved when no stream waits; meanwhile a new
        // request can reuse them in place. Unified, shorter saves happen at
        // once: parked cells lengthen every step's attention (at 4 clients,
        // parking every finished request raised the time to first token from
        // ~270 to ~340 ms). Per sequence, parked cells cost the streams
        // nothing (no pass attends a free slot's stream), so a sequence is
        // always parked: a client that sends its prompt again or extends it
        // (a retry, an agent's next call) takes its cells over in place, where
        // a save and a restore would each stall every stream and the request
        // (17-18 us a token on the 2-core Zen 4: ~3.4 ms each for a
        // 190-token chat).
        let park = self.cfg.kv_layout == KvLayout::PerSequence
            || (others_decoding && self.save_too_long(runs.0));
        // A state larger than the whole cache would be copied out (a stall
        // beside the streams, and that much memory past the cache's bound
        // for a moment) only to be dropped: with the default 96 MiB, a
        // ~6,300-token prompt's 111 MB (flash attention off, K in q8_0).
        let keep = keep
            && self.prefix.is_enabled()
            && !tokens.is_empty()
            && self.state_fits_cache(ctx, seq_id);
        if keep {
            if park {
                self.put_away_parked(ctx);
                self.parked_seq = match self.cfg.kv_layout {
                    KvLayout::Unified => {
                        let spare = self.cfg.parallel as i32;
                        ctx.share_cells(seq_id, spare, 0, tokens.len() as i32);
                        spare
                    }
                    // The cells stay where they are, in the slot's own stream.
                    KvLayout::PerSequence => seq_id,
                };
                self.queue
                    .prefix_running(self.parked_seq as usize, tokens.clone().into());
                self.parked = Some(tokens);
                self.parked_runs = runs;
            } else {
                self.save_into_cache(ctx, seq_id, tokens, runs);
            }
        }
        if self.parked_slot() != Some(slot) {
            ctx.clear_sequence(seq_id);
        }
        debug_assert!(
            self.parked_slot() == Some(slot) || ctx.sequence_pos_max(seq_id) == -1,
            "KV cells of slot {slot} not freed"
        );
        let seq = self.slots[slot].as_mut().expect("slot is active");
        seq.n_past = 0;
        seq.next_token = None;
        let cells = seq.job.kv_cells();
        self.kv_cells_reserved -= cells;
        if seq.job.class == Class::Batch {
            self.batch_kv_cells_reserved -= cells;
        }
        // Before the client hears the end: its next request is judged with
        // what this one left in the cache.
        self.report_prefixes();
    }

    /// Tells admission the prefix cache's entries, if they changed.
    pub(super) fn report_prefixes(&mut self) {
        if let Some(tokens) = self.prefix.take_changed() {
            self.queue.prefix_cached(tokens);
        }
    }

    /// Gives each later choice of an `n` > 1 request the prompt's cells
    /// once its first choice has prefilled them: all but the prompt's last
    /// token, which the choice prefills itself for logits of its own.
    /// Unified, the cells are shared by metadata; per sequence, the first
    /// choice's state is copied into the choice's stream (saved once for all
    /// of them) and cut to the prompt. A choice whose first choice is gone
    /// prefills the prompt itself.
    pub(super) fn share_prompts(&mut self, ctx: &mut Contexts) {
        let mut saved: Option<(usize, Vec<u8>)> = None;
        for slot in 0..self.slots.len() {
            let Some(first_id) = self.slots[slot].as_ref().and_then(|s| s.awaits_prompt_of) else {
                continue;
            };
            let first = self
                .slots
                .iter()
                .position(|s| s.as_ref().is_some_and(|f| f.job.id == first_id && !f.done));
            let seq = self.slots[slot].as_ref().expect("slot is active");
            let shared = seq.job.prompt.len() - 1;
            let Some(first) = first.filter(|_| shared > 0) else {
                self.slots[slot]
                    .as_mut()
                    .expect("slot is active")
                    .awaits_prompt_of = None;
                continue;
            };
            let leader = self.slots[first].as_ref().expect("first choice is active");
            debug_assert_eq!(leader.job.prompt, seq.job.prompt, "choices share a prompt");
            if leader.n_past < shared {
                continue; // still prefilling
            }
            let leader_runs = leader.runs;
            let (src, dst) = (first as i32, slot as i32);
            let copied = match self.cfg.kv_layout {
                KvLayout::Unified => {
                    ctx.share_cells(src, dst, 0, shared as i32);
                    true
                }
                KvLayout::PerSequence => {
                    if saved.as_ref().is_none_or(|(s, _)| *s != first) {
                        saved = Some((first, ctx.save_sequence(src)));
                    }
                    let state = &saved.as_ref().expect("saved above").1;
                    let ok = ctx.restore_sequence(dst, state);
                    if ok {
                        ctx.truncate_sequence(dst, shared as i32);
                    }
                    ok
                }
            };
            let seq = self.slots[slot].as_mut().expect("slot is active");
            seq.awaits_prompt_of = None;
            if !copied {
                crate::say!(
                    "sluice: request id={}: the first choice's cells could not be copied; prefilling its prompt",
                    seq.job.request_id
                );
                continue;
            }
            debug_assert_eq!(ctx.sequence_pos_max(dst), shared as i32 - 1);
            seq.n_past = shared;
            seq.kv_tokens = seq.job.prompt[..shared].to_vec();
            seq.reused = shared;
            if self.cfg.kv_layout == KvLayout::Unified {
                seq.runs = 1 + leader_runs;
                seq.runs_exact = false;
            }
            self.metrics
                .prefix_tokens_reused
                .fetch_add(shared as u64, Ordering::Relaxed);
        }
    }
}
