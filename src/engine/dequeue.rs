//! From the queue to a slot: which class goes next, the checks at dequeue
//! (deadline, CoDel, the first token's forecast against W_max), the KV
//! reservation, and where a prompt's reused prefix comes from.

use super::*;

/// Where a starting job's reused prompt prefix comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Source {
    /// The sequence running in this slot: its cells are shared.
    Running(usize),
    /// A prefix cache entry: its state is restored.
    Cached(EntryId),
    /// The parked sequence: its cells are shared.
    Parked,
}

/// What became of a job taken from its queue.
pub(super) enum Start {
    Started,
    /// Answered without running (deadline, client gone, shed).
    Refused,
    /// Its KV cells are not free yet: it goes back to the head of its queue.
    NoRoom(Box<Job>),
}

/// Why a job leaves the queue without running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Dropped {
    Deadline,
    Shed(ShedReason),
    Shutdown,
}

impl Engine {
    /// Prompt tokens the planner would prefill before a new prompt of `class`
    /// and `prompt_tokens` (higher class first, then shortest remaining): those
    /// of the prompts being prefilled of a higher class, and of its own class
    /// no longer than it.
    pub(super) fn prefill_ahead(&self, class: Class, prompt_tokens: usize) -> usize {
        self.slots
            .iter()
            .flatten()
            .filter(|s| !s.done)
            .map(|s| {
                // A later choice waiting for its first choice's cells
                // prefills the prompt's last token only.
                let r = match s.awaits_prompt_of {
                    Some(_) => 1,
                    None => s.job.prompt.len().saturating_sub(s.n_past),
                };
                (s.job.class, r)
            })
            .filter(|&(c, r)| r > 0 && (c < class || c == class && r <= prompt_tokens))
            .map(|(_, r)| r)
            .sum()
    }

    /// Batch sequences in slots.
    pub(super) fn batch_running(&self) -> usize {
        self.slots
            .iter()
            .flatten()
            .filter(|s| s.job.class == Class::Batch)
            .count()
    }

    /// Takes the head of each class's queue into `held`, where it is not yet.
    /// Returns true when every queue is closed.
    pub(super) fn fill_held(&mut self, jobs: &Queues) -> bool {
        let mut closed = true;
        for c in Class::ALL {
            let i = c.index();
            if self.held[i].is_none() {
                match jobs[i].try_recv() {
                    Ok(job) => self.held[i] = Some(job),
                    Err(e) => {
                        closed &= e.is_disconnected();
                        continue;
                    }
                }
            }
            closed = false;
        }
        closed
    }

    /// Forecast of the time from now to a new job's first token, if it started
    /// now and `prompt_tokens` (its own, and those ahead of it) were prefilled.
    pub(super) fn prefill_forecast(&self, prompt_tokens: usize) -> Duration {
        let n_decode = self.n_decoding();
        let budget = self.prefill_per_step(n_decode, self.cost.prefill_s_per_token());
        let s = self.cost.prefill_time_s(prompt_tokens, n_decode, budget);
        Duration::from_secs_f64(s.clamp(0.0, 86_400.0))
    }

    /// Admits queued jobs while a slot and their KV cells are free, the higher
    /// class first (under `Picker`'s anti-starvation rule). Returns true when
    /// the job channels are closed.
    pub(super) fn admit(&mut self, ctx: &mut Contexts, jobs: &Queues) -> bool {
        // A batch job waiting for KV cells must not hold up interactive ones.
        let mut batch_blocked = false;
        let closed = loop {
            let closed = self.fill_held(jobs);
            // Which free slot a job takes depends on the context it starts
            // in (`try_start`).
            if self.slots.iter().all(Option::is_some) {
                break closed;
            }
            let batch_may_start = !batch_blocked && self.batch_running() < self.cfg.batch_slots;
            let [interactive, batch] = [&self.held[0], &self.held[1]].map(Option::is_some);
            let Some(class) = self.picker.pick(interactive, batch, batch_may_start) else {
                break closed;
            };
            let job = self.held[class.index()]
                .take()
                .expect("the picker picks a class that waits");
            match self.try_start(ctx, job) {
                Start::Started => self.picker.started(class, batch && batch_may_start),
                Start::Refused => {}
                // Not enough KV cells: it keeps its place at the head, and
                // nothing of its class overtakes it; interactive jobs still
                // may, batch ones never overtake an interactive one.
                Start::NoRoom(job) => {
                    self.held[class.index()] = Some(*job);
                    if class == Class::Interactive {
                        break false;
                    }
                    batch_blocked = true;
                }
            }
        };
        // Nothing of a class waits (whether or not a slot is free): its standing
        // queue has drained, and, for interactive, the server is ready again.
        for c in Class::ALL {
            if self.held[c.index()].is_none() && jobs[c.index()].is_empty() {
                if let Some(codel) = &mut self.codel[c.index()] {
                    codel.on_empty();
                }
            }
        }
        self.publish_gauges();
        closed
    }

    /// Starts `job` in a free slot (there is one), or refuses it (deadline
    /// passed, client gone, shed); gives it back when its KV cells are not
    /// free yet.
    pub(super) fn try_start(&mut self, ctx: &mut Contexts, job: Job) -> Start {
        let now = Instant::now();
        let class = job.class;
        let Some(job) = self.alive(job, now) else {
            return Start::Refused;
        };
        let cells = job.kv_cells();
        let batch_over =
            class == Class::Batch && self.batch_kv_cells_reserved + cells > self.cfg.batch_kv_cells;
        // Cached prefixes hold no cells: they never make a job wait.
        if self.kv_cells_reserved + cells > self.cfg.n_ctx || batch_over {
            return Start::NoRoom(Box::new(job));
        }
        // A later choice whose first choice runs takes the prompt's cells
        // from it (`share_prompts`), not from elsewhere.
        let first_slot = job.prompt_of.and_then(|first| {
            self.slots
                .iter()
                .position(|s| s.as_ref().is_some_and(|s| s.job.id == first && !s.done))
        });
        let awaits_prompt_of = first_slot.and(job.prompt_of);
        // The context it runs in, and so where a prefix may come from; a
        // later choice runs where its first choice does.
        let home = match first_slot {
            Some(slot) => ctx.home(slot),
            None => self.home_for(ctx, &job),
        };
        let (source, reuse) = match awaits_prompt_of {
            Some(_) => (None, 0),
            None => self.reuse_source(ctx, home, &job),
        };
        let sojourn = now.saturating_duration_since(job.enqueued_at);
        let p = match awaits_prompt_of {
            Some(_) => 1,
            None => job.prompt.len().saturating_sub(reuse),
        };
        if let Some((why, message)) = self.late(class, sojourn, p, now) {
            self.refuse(job, why, message);
            return Start::Refused;
        }
        // Cells shared in place are in the runs their owner's are; a restored
        // entry's are in one.
        let shared_runs = match source {
            Some(Source::Running(src)) => self.slots[src].as_ref().map_or(0, |s| s.runs),
            Some(Source::Parked) => self.parked_runs.0,
            Some(Source::Cached(_)) | None => 0,
        };
        let slot = self.free_slot(ctx, home);
        let (slot, reuse) = self.place(ctx, (slot, home), source, reuse, &job);
        self.metrics
            .prefix_tokens_reused
            .fetch_add(reuse as u64, Ordering::Relaxed);
        self.admitted += 1;
        let slot_hold = self.queue.started(class, job.queued_tokens());
        self.metrics.record_queue_wait(class, sojourn);
        self.metrics
            .class(class)
            .started
            .fetch_add(1, Ordering::Relaxed);
        let seq = self.new_seq(job, slot_hold, reuse, shared_runs, awaits_prompt_of);
        // The channel is new and empty, so this never finds it full; a
        // handler that already left is seen through its cancel flag.
        let _ = seq.job.events.try_send(Event::Started);
        self.slots[slot] = Some(seq);
        Start::Started
    }

    /// The free slot a job starting in context `home` takes
    /// (`passes::slot_for`): per sequence, one that keeps the ids of the
    /// sequences there consecutive, so that their decode tokens go in one
    /// pass over the weights; the parked slot last otherwise (`place` moves
    /// a job that reuses its cells there).
    fn free_slot(&self, ctx: &Contexts, home: usize) -> usize {
        let per_seq = self.cfg.kv_layout == KvLayout::PerSequence;
        let (running, free): (Vec<usize>, Vec<usize>) =
            (0..self.slots.len()).partition(|&i| self.slots[i].is_some());
        let running: Vec<usize> = running
            .into_iter()
            .filter(|&i| per_seq && ctx.home(i) == home)
            .collect();
        passes::slot_for(&free, &running, self.parked_slot())
            .expect("a job starts only when a slot is free")
    }

    /// `job`, unless it is dead work: its caller's deadline passed (it never
    /// costs a FLOP), or its client left while it waited.
    fn alive(&mut self, job: Job, now: Instant) -> Option<Job> {
        if job.deadline.is_some_and(|d| now >= d) {
            let waited = now.saturating_duration_since(job.enqueued_at);
            let message = format!(
                "the request's deadline passed after {} ms in the queue, before it could start; it was not run",
                waited.as_millis()
            );
            self.refuse(job, Dropped::Deadline, message);
            return None;
        }
        // Its client left while it waited: it never runs either.
        if let Some(reason) = job.cancel.reason() {
            self.queue.dropped(job.class, job.queued_tokens());
            self.metrics.count_cancel(reason);
            return None;
        }
        Some(job)
    }

    /// Why a job of `class` that waited `sojourn` and has `p` prompt tokens
    /// to prefill is shed, if it is: CoDel hears every dequeue (readiness
    /// follows it), but refuses only under the operator's budget (a closed
    /// loop of patient clients stands in the queue by design, and is
    /// served); and a job starts only if its first token can still come
    /// within its class's W_max: otherwise it would only be late, and hold a
    /// slot that a job with time left could use. A prompt whose own prefill
    /// takes longer than the sojourn target is judged on its own prefill, and
    /// only once it has waited past the target: its first token is late by
    /// its size, not by the queue.
    fn late(
        &mut self,
        class: Class,
        sojourn: Duration,
        p: usize,
        now: Instant,
    ) -> Option<(Dropped, String)> {
        let shed = self.cfg.shed[class.index()];
        let codel = self.codel[class.index()].as_mut();
        let verdict = codel.map(|c| c.on_dequeue(sojourn, now));
        if verdict == Some(Verdict::Shed) && self.cfg.shed_late {
            let message = format!(
                "shed: {} requests have waited over the {} ms target for a whole interval (this one {} ms)",
                class.as_str(),
                shed.map_or(0, |(t, _)| t.as_millis()),
                sojourn.as_millis()
            );
            return Some((Dropped::Shed(ShedReason::Sojourn), message));
        }
        let (target, _) = shed.filter(|_| self.cfg.shed_late)?;
        let w_max = self.cfg.queue_wait[class.index()];
        let own = self.prefill_forecast(p);
        let (late, forecast) = if own <= target {
            let forecast = self.prefill_forecast(p + self.prefill_ahead(class, p));
            (sojourn + forecast > w_max, forecast)
        } else {
            (sojourn >= target && sojourn + own > w_max, own)
        };
        late.then(|| {
            let message = format!(
                "shed: it waited {} ms, and its {} prompt tokens need about {} ms more before a first token: past the {} ms budget of {} requests",
                sojourn.as_millis(),
                p,
                forecast.as_millis(),
                w_max.as_millis(),
                class.as_str()
            );
            (Dropped::Shed(ShedReason::TtftBudget), message)
        })
    }

    /// Reserves `job`'s cells in context `home` and puts its reused prefix
    /// (`reuse` tokens from `source`) in place. Returns the slot it runs in
    /// and the tokens reused (0 when a cached entry could not be restored).
    fn place(
        &mut self,
        ctx: &mut Contexts,
        (slot, home): (usize, usize),
        source: Option<Source>,
        mut reuse: usize,
        job: &Job,
    ) -> (usize, usize) {
        let cells = job.kv_cells();
        // Per sequence, parked cells are in a free slot's stream: a job that
        // reuses them starts there (no copy), and cuts what follows the shared
        // prefix; another job starting there puts them away first (saved
        // when short enough, else dropped).
        // Putting the parked sequence away below saves it: the entry about to
        // be restored is not the one that makes room.
        if let Some(Source::Cached(id)) = source {
            self.prefix.hold(id);
        }
        let slot = match (source, self.parked_slot()) {
            (Some(Source::Parked), Some(_)) => self.take_over_parked(ctx, reuse),
            (_, Some(parked)) if parked == slot => {
                self.put_away_parked(ctx);
                slot
            }
            _ => slot,
        };
        let seq_id = slot as i32;
        // What the slot held in another context is gone (put away above).
        ctx.set_home(slot, home);
        if home == contexts::SHORT {
            self.metrics
                .short_context_starts
                .fetch_add(1, Ordering::Relaxed);
        }
        // Parked cells give way to the cells this job reserves (and to an
        // entry restored whole): they never make a job wait or fail.
        let restoring = match source {
            Some(Source::Cached(id)) => self.prefix.entry_tokens(id),
            _ => 0,
        };
        if source == Some(Source::Parked) && self.cfg.kv_layout == KvLayout::Unified {
            ctx.share_cells(self.parked_seq, seq_id, 0, reuse as i32);
        }
        if self.kv_cells_reserved + cells.max(restoring) + self.parked_cells() > self.cfg.n_ctx {
            // Saving them might evict the entry about to be restored.
            if restoring > 0 {
                self.drop_parked(ctx);
            } else {
                self.put_away_parked(ctx);
            }
        }
        self.kv_cells_reserved += cells;
        if job.class == Class::Batch {
            self.batch_kv_cells_reserved += cells;
        }
        match source {
            Some(Source::Parked) => {}
            Some(Source::Running(src)) => ctx.share_cells(src as i32, seq_id, 0, reuse as i32),
            Some(Source::Cached(id)) => {
                // The entry's whole state comes back (into cells no running
                // sequence reserved), then what follows the shared prefix goes.
                let restored = self
                    .prefix
                    .take_use(id)
                    .is_some_and(|state| ctx.restore_sequence(seq_id, state));
                if restored {
                    ctx.truncate_sequence(seq_id, reuse as i32);
                } else {
                    crate::say!(
                        "sluice: request id={}: the prefix cache entry could not be restored; prefilling its prompt",
                        job.request_id
                    );
                    reuse = 0;
                }
            }
            None => {}
        }
        debug_assert_eq!(
            ctx.sequence_pos_max(seq_id),
            reuse as i32 - 1,
            "slot {slot} holds its reused prefix"
        );
        (slot, reuse)
    }

    /// The running sequence of `job` in its slot, `reuse` tokens in.
    fn new_seq(
        &self,
        mut job: Job,
        slot_hold: Slot,
        reuse: usize,
        shared_runs: usize,
        awaits_prompt_of: Option<u64>,
    ) -> Seq {
        let (sampler, stop) = match &mut job.task {
            Task::Generate(gen) => {
                // A constraint decides where its answer ends; otherwise
                // `ignore_eos` runs to max_tokens without ending the text.
                let banned =
                    (gen.ignore_eos && gen.constraint.is_none()).then(|| Arc::clone(&self.eog));
                let sampler = sample::Sampler::new(
                    &gen.sampling,
                    &gen.penalties,
                    gen.constraint.take(),
                    self.model.eos(),
                    banned,
                    &job.prompt,
                );
                (Some(sampler), gen.stop.clone())
            }
            Task::Embed(_) => (None, Vec::new()),
        };
        Seq {
            slot_hold: Some(slot_hold),
            sampler,
            text: TextAssembler::new(stop),
            admitted: self.admitted,
            overdue_at: Instant::now()
                + self
                    .prefill_forecast(job.prompt.len().saturating_sub(reuse))
                    .mul_f64(self.cfg.overdue_stretch)
                    .max(self.cfg.queue_wait[job.class.index()]),
            n_past: reuse,
            kv_tokens: job.prompt[..reuse].to_vec(),
            runs: 1 + shared_runs,
            runs_exact: shared_runs == 0,
            reused: reuse,
            next_token: None,
            first_token_at: None,
            released_until: None,
            prefill_s_per_token: None,
            completion_tokens: 0,
            prompt_logprobs: Vec::new(),
            pooler: Pooler::default(),
            awaits_prompt_of,
            outbox: VecDeque::new(),
            pause: Pause::default(),
            done: false,
            job,
        }
    }

    /// Where `job` may take its prompt's first tokens from instead of
    /// prefilling them, and how many: the running sequence (its cells are
    /// shared in place) or the prefix cache entry (its state is restored) that
    /// shares the longest prefix with it. An entry is used only for at least
    /// `REUSE_TOKENS_MIN` tokens, and only if its whole state fits the cells
    /// no running sequence has reserved (it is restored whole, then cut to
    /// the shared prefix). A job that wants its prompt's log-probabilities
    /// prefills all of it.
    pub(super) fn reuse_source(
        &self,
        ctx: &Contexts,
        home: usize,
        job: &Job,
    ) -> (Option<Source>, usize) {
        // An embedding needs every token's state: nothing is reused.
        if job.echo_logprobs() || job.embed().is_some() || !self.prefix.is_enabled() {
            return (None, 0);
        }
        let free = self.cfg.n_ctx - self.kv_cells_reserved;
        // Cells and saved states are reused within the context the job will
        // run in (`home`) only.
        // Per sequence, cells are not shared across streams (llama.cpp would
        // copy the whole stream): only saved entries are reused.
        let share = self.cfg.kv_layout == KvLayout::Unified;
        let running = self
            .slots
            .iter()
            .enumerate()
            .filter(|_| share)
            .filter_map(|(slot, s)| Some((slot, s.as_ref()?)))
            .filter(|&(slot, _)| ctx.home(slot) == home)
            .map(|(slot, s)| {
                let n = prefix::common_prefix(&s.kv_tokens, &job.prompt);
                (Source::Running(slot), n)
            })
            .chain(
                self.parked
                    .as_ref()
                    .filter(|_| ctx.home(self.parked_seq as usize) == home)
                    .map(|t| (Source::Parked, prefix::common_prefix(t, &job.prompt))),
            )
            .max_by_key(|&(_, n)| n);
        let cached = self
            .prefix
            .best(&job.prompt, home)
            .filter(|&(_, n, len)| n >= prefix::REUSE_TOKENS_MIN && len <= free)
            .map(|(id, n, _)| (Source::Cached(id), n));
        let best = match (cached, running) {
            (Some(c), Some(r)) => Some(if r.1 >= c.1 { r } else { c }),
            (c, r) => c.or(r),
        };
        match best.map(|(src, n)| (src, prefix::reusable(n, job.prompt.len()))) {
            Some((src, reuse)) if reuse > 0 => (Some(src), reuse),
            _ => (None, 0),
        }
    }

    /// The context `job` runs in (`contexts::place`): the short requests'
    /// one when there is one and its prompt and answer fit a sequence there
    /// (an embedding, whose states are read, stays in the main one), unless
    /// only the main one runs sequences now, or sequences run there and its
    /// prompt would be prefilled deep beside them; or, with nothing running,
    /// when a prompt alone goes faster there and it fits its streams.
    pub(super) fn home_for(&self, ctx: &Contexts, job: &Job) -> usize {
        let Some(cells) = ctx.short_cells() else {
            return contexts::MAIN;
        };
        if job.embed().is_some() {
            return contexts::MAIN;
        }
        let running = |home| {
            (0..self.slots.len()).any(|slot| self.slots[slot].is_some() && ctx.home(slot) == home)
        };
        let short = job.kv_cells() <= cells;
        let shallow = || {
            let n = job.prompt.len();
            n <= contexts::SHORT_CHUNKED_PROMPT_MAX
                || n - self.reuse_source(ctx, contexts::SHORT, job).1
                    <= contexts::SHORT_CHUNKED_PROMPT_MAX
        };
        let running = [contexts::MAIN, contexts::SHORT].map(running);
        let fit = contexts::Fit {
            short,
            alone: ctx.goes_alone(job.kv_cells(), job.prompt.len()),
            // Asked only where it decides (a prefix lookup).
            shallow: short && running[contexts::SHORT] && shallow(),
        };
        contexts::place(fit, running)
    }

    /// Shutdown: every queued job is answered without running. Returns true
    /// when the job channels are closed.
    pub(super) fn refuse_queued(&mut self, jobs: &Queues) -> bool {
        loop {
            let closed = self.fill_held(jobs);
            let held: Vec<Job> = self.held.iter_mut().filter_map(Option::take).collect();
            if held.is_empty() {
                self.publish_gauges();
                return closed;
            }
            for job in held {
                let message =
                    "the server shut down before this request could start; it was not run";
                self.refuse(job, Dropped::Shutdown, message.into());
            }
        }
    }

    /// Answers a job that leaves the queue without running, counts it, and
    /// frees its place in admission.
    pub(super) fn refuse(&mut self, job: Job, why: Dropped, message: String) {
        let class = job.class;
        self.queue.dropped(class, job.queued_tokens());
        let by_class = self.metrics.class(class);
        let (counter, kind, message) = match why {
            Dropped::Deadline => {
                by_class.dropped_deadline.fetch_add(1, Ordering::Relaxed);
                (
                    &self.metrics.dropped_deadline,
                    ErrorKind::DeadlineExceeded,
                    message,
                )
            }
            Dropped::Shutdown => {
                self.metrics.count_cancel(CancelReason::Shutdown);
                let _ = job.events.try_send(Event::Error {
                    kind: ErrorKind::Shutdown,
                    message,
                });
                return;
            }
            Dropped::Shed(reason) => {
                by_class.shed.fetch_add(1, Ordering::Relaxed);
                let counter = match reason {
                    ShedReason::Sojourn => &self.metrics.shed_sojourn,
                    ShedReason::TtftBudget => &self.metrics.shed_ttft_budget,
                };
                // When to come back is admission's to say (the handler asks
                // the gate).
                (counter, ErrorKind::Shed { reason }, message)
            }
        };
        counter.fetch_add(1, Ordering::Relaxed);
        // The stream is empty: this is its first event, so it fits.
        let _ = job.events.try_send(Event::Error { kind, message });
    }
}
