//! A running sequence's life after each decode: sampling and delivery (the
//! outbox, pauses), and its end: finished, failed or cancelled.

use super::*;

/// Events a finished or paused sequence may hold undelivered: its last token and
/// its end. The sequence is paused while any are held.
const OUTBOX_EVENTS_MAX: usize = 3;

impl Engine {
    /// Advances one sequence after a successful decode of its `n` tokens at batch
    /// indices `first..first + n`.
    pub(super) fn after_decode(&mut self, ctx: &mut Contexts, slot: usize, first: usize, n: usize) {
        if self.slots[slot]
            .as_ref()
            .is_some_and(|s| s.job.embed().is_some())
        {
            self.after_embed(ctx, slot, first, n);
            return;
        }
        let model = Arc::clone(&self.model);
        let (ahead, pace) = (self.ahead, self.pace());
        let seq = self.slots[slot].as_mut().expect("decoded slot is active");
        let prompt_len = seq.job.prompt.len();
        let was_prefill = seq.n_past < prompt_len;
        // The tokens whose cells this decode wrote.
        if was_prefill {
            let from = seq.n_past;
            seq.kv_tokens
                .extend_from_slice(&seq.job.prompt[from..from + n]);
        } else if let Some(t) = seq.next_token {
            seq.kv_tokens.push(t);
        }
        if was_prefill && seq.job.echo_logprobs() {
            echo_prompt_logprobs(seq, ctx.last(), &self.batch, &model, first, n);
        }
        seq.n_past += n;
        if seq.n_past < prompt_len {
            return; // more prompt to prefill
        }
        if was_prefill {
            self.metrics
                .record_prefill_done(prompt_len, seq.job.enqueued_at.elapsed());
            // Per sequence, a running sequence's cells are not shared.
            if self.prefix.is_enabled() && self.cfg.kv_layout == KvLayout::Unified {
                self.queue
                    .prefix_running(slot, Arc::from(&seq.job.prompt[..]));
            }
            if seq.job.echo_logprobs() {
                let logprobs = std::mem::take(&mut seq.prompt_logprobs);
                seq.outbox.push_back(Event::Prompt { logprobs });
            }
            if seq.job.max_tokens() == 0 {
                self.finish(ctx, slot, FinishReason::Length);
                return;
            }
        }

        // The last token of this chunk has logits: sample the next token.
        let at = first + n - 1;
        let (token, logprob) = sample_next(seq, ctx.last(), &self.batch, &model, at);
        let now = Instant::now();
        let release = ahead::release_at(now, seq.released_until, ahead, pace);
        count_token(&self.metrics, seq, release);

        let eog = model.is_eog(token) && !seq.job.ignore_eos();
        let fed = if eog {
            text::Fed::default()
        } else {
            seq.text.feed(&model.token_piece(token, false))
        };
        seq.outbox.push_back(Event::Token {
            token,
            text: fed.text,
            logprob,
            not_before: (release > now).then_some(release),
        });
        seq.next_token = Some(token);
        if eog || fed.stopped {
            self.finish(ctx, slot, FinishReason::Stop);
        } else if seq.completion_tokens >= seq.job.max_tokens() {
            self.finish(ctx, slot, FinishReason::Length);
        } else {
            self.flush(ctx, slot);
        }
    }

    /// Advances an embedding request after a decode of its `n` tokens at
    /// batch indices `first..first + n` (all of one input): their states
    /// pooled; at the input's end its vector is sent and its cells freed for
    /// the next input; after the last one, the request ends.
    fn after_embed(&mut self, ctx: &mut Contexts, slot: usize, first: usize, n: usize) {
        let seq = self.slots[slot].as_mut().expect("decoded slot is active");
        let spec = seq.job.embed().expect("an embedding job");
        let (index, start, end) = spec.input_at(seq.n_past);
        let pooling = spec.pooling;
        for k in 0..n {
            let pos = seq.n_past + k - start;
            if pooling.wants(pos, end - start) {
                seq.pooler.add(ctx.embedding(&self.batch, first + k));
            }
        }
        let from = seq.n_past;
        seq.kv_tokens
            .extend_from_slice(&seq.job.prompt[from..from + n]);
        seq.n_past += n;
        if seq.n_past < end {
            return;
        }
        let vector = seq.pooler.finish();
        seq.outbox.push_back(Event::Embedding { index, vector });
        let prompt_len = seq.job.prompt.len();
        if seq.n_past < prompt_len {
            ctx.clear_sequence(slot as i32);
            seq.kv_tokens.clear();
            self.flush(ctx, slot);
            return;
        }
        self.metrics
            .record_prefill_done(prompt_len, seq.job.enqueued_at.elapsed());
        self.finish(ctx, slot, FinishReason::Stop);
    }

    /// Ends generation: flushes held text, queues `End`, frees KV cells now.
    pub(super) fn finish(&mut self, ctx: &mut Contexts, slot: usize, finish: FinishReason) {
        let seq_arrival = self.slots[slot]
            .as_ref()
            .expect("finishing slot is active")
            .job
            .enqueued_at;
        let seq = self.slots[slot].as_mut().expect("finishing slot is active");
        let rest = seq.text.finish();
        if !rest.is_empty() {
            // Attach the held text to the last token event if it is still here,
            // so the token count of the stream stays exact.
            match seq.outbox.back_mut() {
                Some(Event::Token { text, .. }) => text.push_str(&rest),
                _ => seq.outbox.push_back(Event::Token {
                    token: -1,
                    text: rest,
                    logprob: None,
                    not_before: seq.released_until.filter(|&t| t > Instant::now()),
                }),
            }
        }
        seq.outbox.push_back(Event::End {
            finish,
            usage: Usage {
                prompt_tokens: seq.job.prompt.len(),
                completion_tokens: seq.completion_tokens,
                cached_tokens: seq.reused,
            },
        });
        debug_assert!(seq.outbox.len() <= OUTBOX_EVENTS_MAX + 1);
        seq.done = true;
        let class = seq.job.class;
        // An embedding request's cells hold its last input only: not worth
        // a place in the prefix cache.
        let keep = seq.job.embed().is_none();
        self.release_kv(ctx, slot, keep);
        self.metrics.completed.fetch_add(1, Ordering::Relaxed);
        self.metrics
            .class(class)
            .completed
            .fetch_add(1, Ordering::Relaxed);
        self.metrics
            .record_request_time(class, seq_arrival.elapsed());
        let seq = self.slots[slot].as_ref().expect("finishing slot is active");
        self.queue
            .observe_request(seq.job.prompt.len() - seq.reused, seq.completion_tokens);
        // What the request left behind (its cells parked or saved, the slot
        // no longer active) is in the gauges before its client has the answer.
        self.publish_gauges();
        self.flush(ctx, slot);
    }

    pub(super) fn fail(&mut self, ctx: &mut Contexts, slot: usize, message: String) {
        let Some(seq) = self.slots[slot].as_mut() else {
            return;
        };
        crate::say!(
            "sluice: request id={} failed: {message}",
            seq.job.request_id
        );
        seq.outbox.clear();
        seq.outbox.push_back(Event::Error {
            kind: ErrorKind::Engine,
            message,
        });
        seq.done = true;
        self.release_kv(ctx, slot, false);
        self.metrics.failed.fetch_add(1, Ordering::Relaxed);
        self.flush(ctx, slot);
    }

    /// Sends what the sequence's outbox holds, as far as its channel takes it.
    /// A full channel leaves the rest for later (the sequence stays paused); a
    /// closed one means the client left: cancel and free everything now.
    pub(super) fn flush(&mut self, ctx: &mut Contexts, slot: usize) {
        let seq = self.slots[slot].as_mut().expect("flushing slot is active");
        let mut gone = false;
        while let Some(event) = seq.outbox.pop_front() {
            // The answer's last event, which the channel has room for:
            // admission learns that the slot is free first (its reports are
            // applied in order), so a client that sends its next request as
            // soon as it has this answer is judged with the slot counted
            // free, as it will be when the engine next admits.
            if seq.done && seq.outbox.is_empty() && !seq.job.events.is_full() {
                seq.slot_hold = None;
            }
            match seq.job.events.try_send(event) {
                Ok(()) => {}
                Err(TrySendError::Full(event)) => {
                    seq.outbox.push_front(event);
                    seq.pause.full(Instant::now());
                    return;
                }
                Err(TrySendError::Disconnected(_)) => {
                    gone = true;
                    break;
                }
            }
        }
        seq.pause.drained();
        if gone {
            // The handler stopped listening; it said why, or the client left.
            let reason = seq.job.cancel.reason().unwrap_or(CancelReason::Disconnect);
            self.cancel(ctx, slot, reason);
        } else if seq.done {
            self.slots[slot] = None;
        }
    }

    /// Cancels what the handlers gave up on, and what stalled: before each step,
    /// so a cancelled sequence never takes another one.
    pub(super) fn reap(&mut self, ctx: &mut Contexts) {
        let now = Instant::now();
        let shutdown = self.shutdown.is_shutdown();
        for slot in 0..self.slots.len() {
            let Some(seq) = self.slots[slot].as_ref() else {
                continue;
            };
            // A reason the handler gave first stays (`cancel` stamps the rest).
            let reason = seq
                .job
                .cancel
                .reason()
                .or(shutdown.then_some(CancelReason::Shutdown))
                .or(seq
                    .pause
                    .stalled(now, self.cfg.stall_timeout)
                    .then_some(CancelReason::Stall));
            if let Some(reason) = reason {
                self.cancel(ctx, slot, reason);
            }
        }
    }

    /// Ends a sequence before its time: frees its KV cells and its slot, and
    /// counts why. A sequence already done (its answer complete, only not
    /// delivered) was counted as completed and just leaves.
    pub(super) fn cancel(&mut self, ctx: &mut Contexts, slot: usize, reason: CancelReason) {
        let Some(seq) = self.slots[slot].as_ref() else {
            return;
        };
        // The handler learns why when its stream closes.
        let steps = self.metrics.steps.load(Ordering::Relaxed);
        seq.job.cancel.cancel(reason, steps);
        if !seq.done {
            self.metrics
                .record_cancel_lag(steps.saturating_sub(seq.job.cancel.at_step()));
            let unprefilled = seq.job.prompt.len().saturating_sub(seq.n_past);
            self.metrics
                .prefill_tokens_abandoned
                .fetch_add(unprefilled as u64, Ordering::Relaxed);
            self.release_kv(ctx, slot, true);
            self.metrics.count_cancel(reason);
        }
        self.slots[slot] = None;
    }

    pub(super) fn deliver_outboxes(&mut self, ctx: &mut Contexts) {
        for slot in 0..self.slots.len() {
            if self.slots[slot]
                .as_ref()
                .is_some_and(|s| !s.outbox.is_empty() || s.done)
            {
                self.flush(ctx, slot);
            }
        }
    }
}

fn piece_text(model: &Model, token: Token) -> String {
    String::from_utf8_lossy(&model.token_piece(token, false)).into_owned()
}

fn with_text(model: &Model, top: &[(Token, f32)]) -> Vec<(Token, String, f32)> {
    top.iter()
        .map(|&(t, lp)| (t, piece_text(model, t), lp))
        .collect()
}

/// The prompt's log-probabilities (`echo` with `logprobs`) for the `n`
/// tokens just prefilled at batch indices `first..`: each position's logits
/// score the next prompt token; the first token has none.
fn echo_prompt_logprobs(
    seq: &mut Seq,
    ctx: &mut Context,
    batch: &Batch,
    model: &Model,
    first: usize,
    n: usize,
) {
    let prompt_len = seq.job.prompt.len();
    let top_n = seq.job.top_logprobs().unwrap_or(0);
    if seq.n_past == 0 {
        seq.prompt_logprobs.push(TokenLogprob {
            token: seq.job.prompt[0],
            text: piece_text(model, seq.job.prompt[0]),
            logprob: None,
            top: Vec::new(),
        });
    }
    for k in 0..n {
        let pos = seq.n_past + k;
        if pos + 1 >= prompt_len {
            break;
        }
        let next = seq.job.prompt[pos + 1];
        let logits = ctx.logits(batch, first + k);
        let summary = logprobs::summarize(logits, top_n);
        seq.prompt_logprobs.push(TokenLogprob {
            token: next,
            text: piece_text(model, next),
            logprob: Some(summary.logprob(logits, next)),
            top: with_text(model, &summary.top),
        });
    }
}

/// The next token from the logits at batch index `at`, and its
/// log-probabilities when the request asks for them.
fn sample_next(
    seq: &mut Seq,
    ctx: &mut Context,
    batch: &Batch,
    model: &Model,
    at: usize,
) -> (Token, Option<TokenLogprob>) {
    let token = seq
        .sampler
        .as_mut()
        .expect("a generating sequence has a sampler")
        .sample(ctx, batch, at);
    let logprob = seq.job.top_logprobs().map(|top_n| {
        let logits = ctx.logits(batch, at);
        let summary = logprobs::summarize(logits, top_n);
        TokenLogprob {
            token,
            text: piece_text(model, token),
            logprob: Some(summary.logprob(logits, token)),
            top: with_text(model, &summary.top),
        }
    });
    (token, logprob)
}

/// A sampled token counted, `release` being when it goes out (later than
/// now when decoded ahead): the sequence's, its first-token or gap time as
/// its client sees them, the totals (and those sampled after a cancel).
fn count_token(metrics: &Metrics, seq: &mut Seq, release: Instant) {
    seq.completion_tokens += 1;
    let first = seq
        .released_until
        .is_none()
        .then(|| release.saturating_duration_since(seq.job.enqueued_at));
    let gap = seq
        .released_until
        .map(|t| release.saturating_duration_since(t));
    seq.released_until = Some(release);
    seq.first_token_at.get_or_insert(release);
    metrics.record_token(seq.job.class, first, gap);
    metrics.tokens_generated.fetch_add(1, Ordering::Relaxed);
    if seq.job.cancel.reason().is_some() {
        metrics.tokens_after_cancel.fetch_add(1, Ordering::Relaxed);
    }
}
