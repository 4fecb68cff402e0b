//! The engine: one thread that owns the llama context and runs continuous batching.
//!
//! Each loop iteration: deliver what paused streams could not take, admit queued
//! jobs into free slots (only when their KV cells — prompt + max_tokens — can be
//! reserved), plan a step (decode tokens first, then prefill chunks under the
//! per-step token budget; see `planner`), run one `llama_decode`, then sample,
//! detokenize and `try_send` each sequence's token on its own bounded stream.
//! `Full` pauses the sequence; `Disconnected` cancels it and frees its KV cells.
//!
//! The step budget is derived, not configured: `cost` learns what a step costs
//! from every step run, and a step with running streams takes only as many
//! prefill tokens as keep it within the inter-token target. The same estimates
//! are published to admission, whose bounds follow them.

pub mod calibration;
pub mod codel;
pub mod cost;
pub mod ffi;
pub mod logprobs;
pub mod planner;
pub mod prefix;
pub mod sample;
pub mod text;

use crate::admission::{QueueGauge, Queues};
use crate::metrics::Metrics;
use crate::priority::{Class, Picker};
use crate::stream::{
    CancelFlag, CancelReason, ErrorKind, Event, FinishReason, Pause, ShedReason, TokenLogprob,
    Usage,
};
use codel::{Codel, Verdict};
use cost::{Chunk, CostModel};
use crossbeam_channel::{Select, Sender, TrySendError};
use ffi::{Batch, Context, KvLayout, Model, SamplingParams, Token};
use planner::{Phase, SeqView, Work};
use prefix::{EntryId, PrefixCache};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use text::TextAssembler;

/// How long an idle engine sleeps waiting for work before it checks for shutdown.
/// Longest stall a save may cause beside running streams, as a share of the
/// ITL target; a longer one is put off (the cells parked).
const SAVE_STALL_SHARE_MAX: f64 = 0.5;
/// Weight of the newest measurement in the save cost's running mean.
const SAVE_COST_WEIGHT: f64 = 0.5;
/// Saves of sequences in fewer runs than this do not teach the cost of a run:
/// their cost is mostly the bytes, not the runs.
const SAVE_RUNS_LEARN_MIN: usize = 16;
const IDLE_WAIT_MS: u64 = 100;
/// After this long with nothing running, the KV cache's pages are given back
/// to the kernel. Not at once: faulting a stream's pages in again costs the
/// next request a few milliseconds.
const KV_RELEASE_IDLE_MS: u64 = 2_000;
/// How often the engine publishes its measured rates to admission, at most.
const RATES_PUBLISH_INTERVAL_MS: u64 = 100;
/// Events a finished or paused sequence may hold undelivered: its last token and
/// its end. The sequence is paused while any are held.
const OUTBOX_EVENTS_MAX: usize = 3;

/// What a request asks the engine to generate.
#[derive(Debug, Clone)]
pub struct GenParams {
    /// Most tokens to generate (0 only with `echo_logprobs`: score the prompt).
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Keep generating past end-of-generation tokens (until `max_tokens`).
    pub ignore_eos: bool,
    /// Alternatives per position to report; `None` reports no log-probabilities.
    pub top_logprobs: Option<usize>,
    /// Also report the log-probabilities of the prompt tokens.
    pub echo_logprobs: bool,
}

/// A validated, tokenized request: the only thing that reaches the engine.
pub struct Job {
    pub id: u64,
    pub class: Class,
    pub prompt: Vec<Token>,
    pub gen: GenParams,
    pub enqueued_at: Instant,
    /// The caller's deadline (`X-Request-Timeout`, capped by the server's
    /// ceiling): past it, the job is dropped before it costs a single FLOP.
    pub deadline: Option<Instant>,
    pub events: Sender<Event>,
    /// Set by the handler when it stops waiting for this job.
    pub cancel: CancelFlag,
    /// Prompt tokens the handler found in the prefix cache when it admitted
    /// the job (`PrefixIndex::reusable`): admission counted only the rest.
    pub cached_estimate: usize,
}

impl Job {
    /// KV cells the job may occupy at most (cells it shares with another
    /// running sequence included).
    pub fn kv_cells(&self) -> usize {
        self.prompt.len() + self.gen.max_tokens
    }

    /// Prompt tokens admission counts for the job while it waits: the ones it
    /// was expected to prefill.
    pub fn queued_tokens(&self) -> usize {
        self.prompt.len().saturating_sub(self.cached_estimate)
    }
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub parallel: usize,
    pub n_ctx: usize,
    /// llama.cpp's batch size: the most tokens one step may hold.
    pub n_batch: usize,
    /// `--step-tokens`: a fixed step budget; `None` derives each step's budget
    /// from the cost model and `itl_target`.
    pub step_tokens: Option<usize>,
    pub itl_target: Duration,
    /// W_max per class: a request that waited past its class's sojourn target
    /// starts only if its first token can still come within this.
    pub queue_wait: [Duration; Class::COUNT],
    pub cpus: Vec<usize>,
    pub poll: u32,
    /// CoDel's sojourn target and interval per class; `None` sheds nothing
    /// (`--no-shed`).
    pub shed: [Option<(Duration, Duration)>; Class::COUNT],
    /// Slots batch requests may hold at most (`--parallel` minus
    /// `--interactive-slots`).
    pub batch_slots: usize,
    /// KV cells batch requests may reserve at most: the reserved slots keep
    /// their share of the cache.
    pub batch_kv_cells: usize,
    /// At least one start in this many goes to a waiting batch request.
    pub batch_every: u32,
    /// A sequence paused this long without a break (its reader takes nothing)
    /// is cancelled.
    pub stall_timeout: Duration,
    /// Seconds to save a sequence's state per run of consecutive cells
    /// (unified) or per token (per sequence), as start-up calibration
    /// measured it; learned online from saves.
    pub save_s_per_run: Option<f64>,
    /// Per sequence: no cells are shared between sequences (each sequence's
    /// cells sit in its own stream, one run; a parked sequence stays in its
    /// stream), and a step's decode tokens and prompt chunks go in separate
    /// passes (`step`).
    pub kv_layout: KvLayout,
}

/// One admitted request, bound to a slot (= llama.cpp sequence id).
struct Seq {
    job: Job,
    admitted: u64,
    sampler: sample::Sampler,
    text: TextAssembler,
    /// Tokens of this sequence already in the KV cache.
    n_past: usize,
    /// Those tokens (`n_past` of them): what a prefix cache entry made of
    /// this sequence holds.
    kv_tokens: Vec<Token>,
    /// Runs of consecutive KV cells those tokens are in, at most: one more
    /// for every step that placed other sequences' tokens beside its own.
    /// What saving its state costs.
    runs: usize,
    /// False when its prefix was shared in place: `runs` then counts all of
    /// the owner's runs, more than the prefix's, and its save must not teach
    /// the cost of a run (it would learn too low a cost, and let a long save
    /// stall the streams).
    runs_exact: bool,
    /// Prompt tokens taken from the prefix cache instead of prefilled.
    reused: usize,
    /// The last sampled token, to be decoded next step.
    next_token: Option<Token>,
    /// When the last token was sampled.
    last_token_at: Option<Instant>,
    /// Measured seconds per token of this prompt's latest prefill chunks.
    prefill_s_per_token: Option<f64>,
    completion_tokens: usize,
    prompt_logprobs: Vec<TokenLogprob>,
    outbox: VecDeque<Event>,
    /// Since when the outbox has waited for room in the stream.
    pause: Pause,
    /// Generation ended; the slot is held only until the outbox is delivered.
    done: bool,
}

impl Seq {
    /// The cost model's view of this sequence's next `tokens` prompt tokens.
    /// Generating: a stream waits for this sequence's next token.
    fn is_decoding(&self) -> bool {
        !self.done && self.job.prompt.len() <= self.n_past
    }

    fn chunk(&self, tokens: usize) -> Chunk {
        Chunk {
            tokens,
            start: self.n_past,
            own_s_per_token: self.prefill_s_per_token,
        }
    }

    fn phase(&self) -> Option<Phase> {
        if self.done {
            return None;
        }
        if !self.outbox.is_empty() {
            return Some(Phase::Paused);
        }
        let remaining = self.job.prompt.len().saturating_sub(self.n_past);
        if remaining > 0 {
            Some(Phase::Prefill {
                remaining_tokens: remaining,
            })
        } else {
            Some(Phase::Decode)
        }
    }
}

/// What the engine is handed once admission exists: its queues, admission's
/// gauge (told of starts, ends and measured rates), the cost model seeded by
/// calibration, and the prefix cache (whose index the handlers hold).
pub struct Wiring {
    pub jobs: Queues,
    pub queue: Arc<QueueGauge>,
    pub cost: CostModel,
    pub prefix: PrefixCache,
}

/// Runs the engine loop until the job channel is closed and no work is left.
pub fn run(
    model: Arc<Model>,
    mut ctx: Context,
    cfg: EngineConfig,
    metrics: Arc<Metrics>,
    wiring: Wiring,
) {
    let Wiring {
        jobs,
        queue,
        cost,
        prefix,
    } = wiring;
    assert!(cfg.n_batch >= cfg.parallel, "n_batch below --parallel");
    assert_eq!(cfg.n_batch, ctx.n_batch(), "n_batch of the context");
    assert!(
        cfg.step_tokens
            .is_none_or(|n| n >= cfg.parallel && n <= cfg.n_batch),
        "fixed step budget outside parallel..=n_batch"
    );
    let shutdown = ctx.abort_handle();
    let mut engine = Engine {
        shutdown,
        model,
        slots: (0..cfg.parallel).map(|_| None).collect(),
        batch: Batch::new(cfg.n_batch),
        held: [None, None],
        picker: Picker::new(cfg.batch_every),
        cost,
        rates_published_at: Instant::now(),
        kv_cells_reserved: 0,
        batch_kv_cells_reserved: 0,
        prefix,
        parked: None,
        parked_runs: (0, true),
        parked_seq: cfg.parallel as i32,
        idle_since: None,
        kv_written: true,
        save_s_per_run: cfg.save_s_per_run,
        admitted: 0,
        codel: cfg
            .shed
            .map(|s| s.map(|(target, interval)| Codel::new(target, interval))),
        cfg,
        metrics,
        queue,
    };
    loop {
        engine.metrics.beat();
        engine.reap(&mut ctx);
        engine.deliver_outboxes(&mut ctx);
        engine.save_parked_when_quiet(&mut ctx);
        let closed = if engine.shutdown.is_shutdown() {
            engine.refuse_queued(&jobs)
        } else {
            engine.admit(&mut ctx, &jobs)
        };
        let views = engine.views();
        let budget = engine.step_budget(&views);
        engine
            .metrics
            .step_budget_tokens
            .store(budget, Ordering::Relaxed);
        let plan = planner::plan_step(&views, budget);
        if plan.is_empty() {
            let active =
                engine.slots.iter().any(Option::is_some) || engine.held.iter().any(Option::is_some);
            if closed && !active {
                break;
            }
            engine.wait_for_work(&mut ctx, &jobs);
            continue;
        }
        engine.step(&mut ctx, &plan);
    }
}

struct Engine {
    /// Set by the main thread when a drain's deadline passes: everything still
    /// running or queued is cancelled (running decodes abort through it too).
    shutdown: Arc<ffi::AbortWatch>,
    model: Arc<Model>,
    slots: Vec<Option<Seq>>,
    batch: Batch,
    /// The job at the head of each class's queue, taken out but not yet
    /// admitted (no slot or not enough KV cells free, or the other class goes
    /// first). At most one per class; admission still counts it as waiting.
    held: [Option<Job>; Class::COUNT],
    /// Which class gets the next free slot.
    picker: Picker,
    kv_cells_reserved: usize,
    /// Of those, the ones reserved by batch requests.
    batch_kv_cells_reserved: usize,
    /// Finished sequences' KV states, in host memory, for reuse.
    prefix: PrefixCache,
    /// The tokens of a finished sequence whose cells are parked (on
    /// `parked_seq`) until it can be saved without delaying a stream; see
    /// `release_kv`.
    parked: Option<Vec<Token>>,
    /// What saving the parked sequence costs, in runs of cells (unified) or
    /// tokens (per sequence), and whether exactly.
    parked_runs: (usize, bool),
    /// The sequence id the parked cells are on. Unified: the spare one,
    /// `cfg.parallel` (copied there by metadata). Per sequence: their own
    /// stream, that of a slot left free (a job that reuses them starts there;
    /// another job starts there only when no other slot is free, and drops
    /// them first).
    parked_seq: i32,
    /// Since when nothing has run or waited (`wait_for_work`).
    idle_since: Option<Instant>,
    /// Cells were written since the KV pages last went back to the kernel
    /// (start-up calibration wrote some).
    kv_written: bool,
    /// Seconds per run of consecutive cells (unified) or per token (per
    /// sequence) of saving a sequence's KV state (running mean; seeded by
    /// calibration).
    save_s_per_run: Option<f64>,
    admitted: u64,
    cfg: EngineConfig,
    metrics: Arc<Metrics>,
    /// Admission's count of the load: told when a job gets a slot and when it
    /// leaves it, and the rates the cost model measures.
    queue: Arc<QueueGauge>,
    /// CoDel per class.
    codel: [Option<Codel>; Class::COUNT],
    cost: CostModel,
    rates_published_at: Instant,
}

/// A plan entry placed in a pass's batch: (slot, first batch index, tokens).
type Placed = (usize, usize, usize);

/// Where a starting job's reused prompt prefix comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// The sequence running in this slot: its cells are shared.
    Running(usize),
    /// A prefix cache entry: its state is restored.
    Cached(EntryId),
    /// The parked sequence: its cells are shared.
    Parked,
}

/// What became of a job taken from its queue.
enum Start {
    Started,
    /// Answered without running (deadline, client gone, shed).
    Refused,
    /// Its KV cells are not free yet: it goes back to the head of its queue.
    NoRoom(Job),
}

/// Why a job leaves the queue without running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dropped {
    Deadline,
    Shed(ShedReason),
    Shutdown,
}

impl Engine {
    fn views(&self) -> Vec<SeqView> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(slot, s)| {
                let s = s.as_ref()?;
                Some(SeqView {
                    slot,
                    class: s.job.class,
                    admitted: s.admitted,
                    phase: s.phase()?,
                })
            })
            .collect()
    }

    /// Tokens the next step may hold: fixed by `--step-tokens`, or the decode
    /// tokens plus the prefill the ITL target leaves room for.
    fn step_budget(&self, views: &[SeqView]) -> usize {
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
    /// `s_per_token`.
    fn prefill_per_step(&self, n_decode: usize, s_per_token: f64) -> usize {
        match self.cfg.step_tokens {
            Some(n) => n.saturating_sub(n_decode).max(1),
            None => self.cost.prefill_budget(
                n_decode,
                s_per_token,
                self.cfg.itl_target,
                self.cfg.n_batch,
            ),
        }
    }

    /// Sequences that will take a decode token in the coming steps.
    fn n_decoding(&self) -> usize {
        self.slots
            .iter()
            .flatten()
            .filter(|s| s.is_decoding())
            .count()
    }

    /// Prompt tokens the planner would prefill before a new prompt of `class`
    /// and `prompt_tokens` (higher class first, then shortest remaining): those
    /// of the prompts being prefilled of a higher class, and of its own class
    /// no longer than it.
    fn prefill_ahead(&self, class: Class, prompt_tokens: usize) -> usize {
        self.slots
            .iter()
            .flatten()
            .filter(|s| !s.done)
            .map(|s| (s.job.class, s.job.prompt.len().saturating_sub(s.n_past)))
            .filter(|&(c, r)| r > 0 && (c < class || c == class && r <= prompt_tokens))
            .map(|(_, r)| r)
            .sum()
    }

    /// Batch sequences in slots.
    fn batch_running(&self) -> usize {
        self.slots
            .iter()
            .flatten()
            .filter(|s| s.job.class == Class::Batch)
            .count()
    }

    /// Takes the head of each class's queue into `held`, where it is not yet.
    /// Returns true when every queue is closed.
    fn fill_held(&mut self, jobs: &Queues) -> bool {
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
    fn prefill_forecast(&self, prompt_tokens: usize) -> Duration {
        let n_decode = self.n_decoding();
        let budget = self.prefill_per_step(n_decode, self.cost.prefill_s_per_token());
        let s = self.cost.prefill_time_s(prompt_tokens, n_decode, budget);
        Duration::from_secs_f64(s.clamp(0.0, 86_400.0))
    }

    /// Admits queued jobs while a slot and their KV cells are free, the higher
    /// class first (under `Picker`'s anti-starvation rule). Returns true when
    /// the job channels are closed.
    fn admit(&mut self, ctx: &mut Context, jobs: &Queues) -> bool {
        // A batch job waiting for KV cells must not hold up interactive ones.
        let mut batch_blocked = false;
        let closed = loop {
            let closed = self.fill_held(jobs);
            // A free slot whose stream holds parked cells is taken last
            // (try_start moves a job that reuses them there).
            let parked = self.parked_slot();
            let Some(slot) = (0..self.slots.len())
                .filter(|&i| self.slots[i].is_none())
                .min_by_key(|&i| Some(i) == parked)
            else {
                break closed;
            };
            let batch_may_start = !batch_blocked && self.batch_running() < self.cfg.batch_slots;
            let [interactive, batch] = [&self.held[0], &self.held[1]].map(Option::is_some);
            let Some(class) = self.picker.pick(interactive, batch, batch_may_start) else {
                break closed;
            };
            let job = self.held[class.index()]
                .take()
                .expect("the picker picks a class that waits");
            match self.try_start(ctx, slot, job) {
                Start::Started => self.picker.started(class, batch && batch_may_start),
                Start::Refused => {}
                // Not enough KV cells: it keeps its place at the head, and
                // nothing of its class overtakes it; interactive jobs still
                // may, batch ones never overtake an interactive one.
                Start::NoRoom(job) => {
                    self.held[class.index()] = Some(job);
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

    /// Starts `job` in `slot`, or refuses it (deadline passed, client gone,
    /// shed); gives it back when its KV cells are not free yet.
    fn try_start(&mut self, ctx: &mut Context, slot: usize, job: Job) -> Start {
        let now = Instant::now();
        let class = job.class;
        // Dead work: its caller has given up, so it never costs a FLOP.
        if job.deadline.is_some_and(|d| now >= d) {
            let waited = now.saturating_duration_since(job.enqueued_at);
            let message = format!(
                "the request's deadline passed after {} ms in the queue, before it could start; it was not run",
                waited.as_millis()
            );
            self.refuse(job, Dropped::Deadline, message);
            return Start::Refused;
        }
        // Its client left while it waited: it never runs either.
        if let Some(reason) = job.cancel.reason() {
            self.queue.dropped(class, job.queued_tokens());
            self.metrics.count_cancel(reason);
            return Start::Refused;
        }
        let cells = job.kv_cells();
        let batch_over =
            class == Class::Batch && self.batch_kv_cells_reserved + cells > self.cfg.batch_kv_cells;
        // Cached prefixes hold no cells: they never make a job wait.
        if self.kv_cells_reserved + cells > self.cfg.n_ctx || batch_over {
            return Start::NoRoom(job);
        }
        let (source, mut reuse) = self.reuse_source(&job);
        // Cells shared in place are in the runs their owner's are; a restored
        // entry's are in one.
        let shared_runs = match source {
            Some(Source::Running(src)) => self.slots[src].as_ref().map_or(0, |s| s.runs),
            Some(Source::Parked) => self.parked_runs.0,
            Some(Source::Cached(_)) | None => 0,
        };
        let sojourn = now.saturating_duration_since(job.enqueued_at);
        let shed = self.cfg.shed[class.index()];
        let codel = self.codel[class.index()].as_mut();
        if let Some(Verdict::Shed) = codel.map(|c| c.on_dequeue(sojourn, now)) {
            let message = format!(
                "shed: {} requests have waited over the {} ms target for a whole interval (this one {} ms)",
                class.as_str(),
                shed.map_or(0, |(t, _)| t.as_millis()),
                sojourn.as_millis()
            );
            self.refuse(job, Dropped::Shed(ShedReason::Sojourn), message);
            return Start::Refused;
        }
        // A job starts only if its first token can still come within its
        // class's W_max: otherwise it would only be late, and hold a slot that a
        // job with time left could use. A prompt whose own prefill takes longer
        // than the sojourn target is judged on its own prefill, and only once
        // it has waited past the target: its first token is late by its size,
        // not by the queue.
        if let Some((target, _)) = shed {
            let w_max = self.cfg.queue_wait[class.index()];
            let p = job.prompt.len() - reuse;
            let own = self.prefill_forecast(p);
            let (late, forecast) = if own <= target {
                let forecast = self.prefill_forecast(p + self.prefill_ahead(class, p));
                (sojourn + forecast > w_max, forecast)
            } else {
                (sojourn >= target && sojourn + own > w_max, own)
            };
            if late {
                let message = format!(
                    "shed: it waited {} ms, and its {} prompt tokens need about {} ms more before a first token: past the {} ms budget of {} requests",
                    sojourn.as_millis(),
                    p,
                    forecast.as_millis(),
                    w_max.as_millis(),
                    class.as_str()
                );
                self.refuse(job, Dropped::Shed(ShedReason::TtftBudget), message);
                return Start::Refused;
            }
        }
        // Per sequence, parked cells are in a free slot's stream: a job that
        // reuses them starts there (no copy), and cuts what follows the shared
        // prefix; another job starting there drops them.
        let slot = match (source, self.parked_slot()) {
            (Some(Source::Parked), Some(parked)) => {
                self.parked = None;
                self.prefix.index().clear_running(parked);
                ctx.truncate_sequence(parked as i32, reuse as i32);
                parked
            }
            (_, Some(parked)) if parked == slot => {
                self.drop_parked(ctx);
                slot
            }
            _ => slot,
        };
        let seq_id = slot as i32;
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
            self.drop_parked(ctx);
        }
        self.kv_cells_reserved += cells;
        if class == Class::Batch {
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
                    eprintln!(
                        "sluice: request {}: the prefix cache entry could not be restored; prefilling its prompt",
                        job.id
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
        self.metrics
            .prefix_tokens_reused
            .fetch_add(reuse as u64, Ordering::Relaxed);
        self.admitted += 1;
        self.queue.started(class, job.queued_tokens());
        self.metrics.record_queue_wait(sojourn);
        self.metrics
            .class(class)
            .started
            .fetch_add(1, Ordering::Relaxed);
        let seq = Seq {
            sampler: sample::Sampler::new(&job.gen.sampling),
            text: TextAssembler::new(job.gen.stop.clone()),
            admitted: self.admitted,
            n_past: reuse,
            kv_tokens: job.prompt[..reuse].to_vec(),
            runs: 1 + shared_runs,
            runs_exact: shared_runs == 0,
            reused: reuse,
            next_token: None,
            last_token_at: None,
            prefill_s_per_token: None,
            completion_tokens: 0,
            prompt_logprobs: Vec::new(),
            outbox: VecDeque::new(),
            pause: Pause::default(),
            done: false,
            job,
        };
        self.slots[slot] = Some(seq);
        Start::Started
    }

    /// Where `job` may take its prompt's first tokens from instead of
    /// prefilling them, and how many: the running sequence (its cells are
    /// shared in place) or the prefix cache entry (its state is restored) that
    /// shares the longest prefix with it. An entry is used only for at least
    /// `REUSE_TOKENS_MIN` tokens, and only if its whole state fits the cells
    /// no running sequence has reserved (it is restored whole, then cut to
    /// the shared prefix). A job that wants its prompt's log-probabilities
    /// prefills all of it.
    fn reuse_source(&self, job: &Job) -> (Option<Source>, usize) {
        if job.gen.echo_logprobs || !self.prefix.is_enabled() {
            return (None, 0);
        }
        let free = self.cfg.n_ctx - self.kv_cells_reserved;
        // Per sequence, cells are not shared across streams (llama.cpp would
        // copy the whole stream): only saved entries are reused.
        let share = self.cfg.kv_layout == KvLayout::Unified;
        let running = self
            .slots
            .iter()
            .enumerate()
            .filter(|_| share)
            .filter_map(|(slot, s)| Some((slot, s.as_ref()?)))
            .map(|(slot, s)| {
                let n = prefix::common_prefix(&s.kv_tokens, &job.prompt);
                (Source::Running(slot), n)
            })
            .chain(
                self.parked
                    .as_ref()
                    .map(|t| (Source::Parked, prefix::common_prefix(t, &job.prompt))),
            )
            .max_by_key(|&(_, n)| n);
        let cached = self
            .prefix
            .best(&job.prompt)
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

    /// Shutdown: every queued job is answered without running. Returns true
    /// when the job channels are closed.
    fn refuse_queued(&mut self, jobs: &Queues) -> bool {
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
    fn refuse(&mut self, job: Job, why: Dropped, message: String) {
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
                let retry_after_s = self.queue.retry_after_s(class);
                let counter = match reason {
                    ShedReason::Sojourn => &self.metrics.shed_sojourn,
                    ShedReason::TtftBudget => &self.metrics.shed_ttft_budget,
                };
                let kind = ErrorKind::Shed {
                    reason,
                    retry_after_s,
                };
                (
                    counter,
                    kind,
                    format!("{message}; retry after {retry_after_s} s"),
                )
            }
        };
        counter.fetch_add(1, Ordering::Relaxed);
        // The stream is empty: this is its first event, so it fits.
        let _ = job.events.try_send(Event::Error { kind, message });
    }

    fn wait_for_work(&mut self, ctx: &mut Context, jobs: &Queues) {
        if self.held.iter().any(Option::is_some) || self.slots.iter().any(Option::is_some) {
            // Only paused or undelivered streams, or a job waiting for KV
            // cells: poll again shortly.
            std::thread::sleep(Duration::from_millis(1));
            self.idle_since = None;
            return;
        }
        // Idle for a while, nothing parked: the KV pages written go back to
        // the kernel (a burst's memory does not stay resident), and the next
        // cells written fault in zero pages again.
        let idle_since = *self.idle_since.get_or_insert_with(Instant::now);
        if self.kv_written
            && self.parked.is_none()
            && idle_since.elapsed() >= Duration::from_millis(KV_RELEASE_IDLE_MS)
        {
            ctx.clear_all_cells();
            self.kv_written = false;
            self.metrics
                .kv_pages_released
                .fetch_add(1, Ordering::Relaxed);
        }
        let mut select = Select::new();
        for rx in jobs {
            select.recv(rx);
        }
        // A ready queue is read at the next turn (`fill_held`), so that the
        // picker sees both classes before it chooses.
        let _ = select.ready_timeout(Duration::from_millis(IDLE_WAIT_MS));
    }

    /// Runs one step of `plan`. Per sequence, its decode tokens and its prompt
    /// chunks go to llama.cpp in two passes: in one pass every sequence's
    /// attention spans as many cells as the deepest sequence's stream holds,
    /// so streams decoding beside a long prompt would pay for its depth.
    fn step(&mut self, ctx: &mut Context, plan: &planner::Plan) {
        let split = self.cfg.kv_layout == KvLayout::PerSequence
            && plan.n_decode() > 0
            && plan.n_decode() < plan.entries.len();
        let passes: Vec<Vec<&planner::Entry>> = if split {
            let (decode, prefill) = plan.entries.iter().partition(|e| e.work == Work::Decode);
            vec![decode, prefill]
        } else {
            vec![plan.entries.iter().collect()]
        };
        let mut took = Duration::ZERO;
        let mut n_tokens = 0;
        self.kv_written = true;
        self.idle_since = None;
        let mut prefills: Vec<(usize, Chunk)> = Vec::new();
        for pass in passes {
            let Some((placed, t)) = self.decode_pass(ctx, &pass) else {
                return;
            };
            took += t;
            n_tokens += self.batch.len();
            prefills.extend(
                placed
                    .iter()
                    .filter(|&&(slot, _, n)| {
                        self.slots[slot]
                            .as_ref()
                            .is_some_and(|s| s.n_past < s.job.prompt.len())
                            && n > 0
                    })
                    .map(|&(slot, _, n)| {
                        let seq = self.slots[slot].as_ref().expect("placed slot is active");
                        (slot, seq.chunk(n))
                    }),
            );
            // Unified, each sequence's tokens of a step sit in one run of
            // cells; beside other sequences' they start a new one. Per
            // sequence, its cells are one run in its own stream.
            if self.cfg.kv_layout == KvLayout::Unified && placed.len() > 1 {
                for &(slot, _, _) in &placed {
                    if let Some(seq) = self.slots[slot].as_mut() {
                        seq.runs += 1;
                    }
                }
            }
            // The logits of this pass are read before the next pass's decode.
            for (slot, first, n) in placed {
                self.after_decode(ctx, slot, first, n);
            }
        }
        let n_decode = plan.n_decode();
        self.metrics.record_step(n_tokens, n_decode, took);
        self.metrics
            .prefill_tokens
            .fetch_add((n_tokens - n_decode) as u64, Ordering::Relaxed);
        let chunks: Vec<Chunk> = prefills.iter().map(|&(_, c)| c).collect();
        self.metrics
            .record_step_forecast(self.cost.predict(n_decode, &chunks), took.as_secs_f64());
        let measured = self.cost.observe(n_decode, &chunks, took.as_secs_f64());
        for (&(slot, _), m) in prefills.iter().zip(measured) {
            if let Some(seq) = self.slots[slot].as_mut() {
                seq.prefill_s_per_token = Some(cost::update_own_cost(seq.prefill_s_per_token, m));
            }
        }
        if self.rates_published_at.elapsed() >= Duration::from_millis(RATES_PUBLISH_INTERVAL_MS) {
            self.queue.set_rates(self.cost.rates());
            self.rates_published_at = Instant::now();
        }
        self.publish_gauges();
    }

    /// Decodes `entries` in one llama.cpp call. Returns each entry's (slot,
    /// first batch index, tokens) and the call's time; `None` when it failed
    /// or was aborted (its sequences are then failed or cancelled).
    fn decode_pass(
        &mut self,
        ctx: &mut Context,
        entries: &[&planner::Entry],
    ) -> Option<(Vec<Placed>, Duration)> {
        let started = Instant::now();
        self.batch.clear();
        let mut placed: Vec<Placed> = Vec::with_capacity(entries.len());
        // llama.cpp takes the sequences of one pass over the weights in
        // consecutive ids: in order, as few passes as the ids allow.
        let mut entries = entries.to_vec();
        entries.sort_by_key(|e| e.slot);
        for entry in entries {
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
                }
                Work::Prefill { n_tokens } => {
                    let start = seq.n_past;
                    let end = start + n_tokens;
                    let prompt_len = seq.job.prompt.len();
                    for pos in start..end {
                        let last = pos + 1 == prompt_len;
                        let logits = last || seq.job.gen.echo_logprobs;
                        self.batch
                            .push(seq.job.prompt[pos], pos as i32, seq_id, logits);
                    }
                    placed.push((entry.slot, first, n_tokens));
                }
            }
        }

        // A pass whose every sequence is cancelled meanwhile stops mid-way.
        let watch: Vec<_> = placed
            .iter()
            .filter_map(|&(slot, _, _)| self.slots[slot].as_ref())
            .map(|s| Arc::clone(s.job.cancel.raw()))
            .collect();
        if let Err(e) = ctx.decode_watching(&self.batch, &watch) {
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
            eprintln!(
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
        Some((placed, started.elapsed()))
    }

    /// Advances one sequence after a successful decode of its `n` tokens at batch
    /// indices `first..first + n`.
    fn after_decode(&mut self, ctx: &mut Context, slot: usize, first: usize, n: usize) {
        let model = Arc::clone(&self.model);
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
        if was_prefill && seq.job.gen.echo_logprobs {
            let top_n = seq.job.gen.top_logprobs.unwrap_or(0);
            if seq.n_past == 0 {
                seq.prompt_logprobs.push(TokenLogprob {
                    token: seq.job.prompt[0],
                    text: piece_text(&model, seq.job.prompt[0]),
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
                let logits = ctx.logits(&self.batch, first + k);
                let summary = logprobs::summarize(logits, top_n);
                seq.prompt_logprobs.push(TokenLogprob {
                    token: next,
                    text: piece_text(&model, next),
                    logprob: Some(summary.logprob(logits, next)),
                    top: with_text(&model, &summary.top),
                });
            }
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
                self.prefix
                    .index()
                    .set_running(slot, Arc::from(&seq.job.prompt[..]));
            }
            if seq.job.gen.echo_logprobs {
                let logprobs = std::mem::take(&mut seq.prompt_logprobs);
                seq.outbox.push_back(Event::Prompt { logprobs });
            }
            if seq.job.gen.max_tokens == 0 {
                self.finish(ctx, slot, FinishReason::Length);
                return;
            }
        }

        // The last token of this chunk has logits: sample the next token.
        let at = first + n - 1;
        let token = seq.sampler.sample(ctx, &self.batch, at);
        let logprob = seq.job.gen.top_logprobs.map(|top_n| {
            let logits = ctx.logits(&self.batch, at);
            let summary = logprobs::summarize(logits, top_n);
            TokenLogprob {
                token,
                text: piece_text(&model, token),
                logprob: Some(summary.logprob(logits, token)),
                top: with_text(&model, &summary.top),
            }
        });
        seq.completion_tokens += 1;
        let now = Instant::now();
        let first = seq
            .last_token_at
            .is_none()
            .then(|| now.saturating_duration_since(seq.job.enqueued_at));
        let gap = seq.last_token_at.map(|t| now.saturating_duration_since(t));
        seq.last_token_at = Some(now);
        self.metrics.record_token(seq.job.class, first, gap);
        self.metrics
            .tokens_generated
            .fetch_add(1, Ordering::Relaxed);
        if seq.job.cancel.reason().is_some() {
            self.metrics
                .tokens_after_cancel
                .fetch_add(1, Ordering::Relaxed);
        }

        let eog = model.is_eog(token) && !seq.job.gen.ignore_eos;
        let fed = if eog {
            text::Fed::default()
        } else {
            seq.text.feed(&model.token_piece(token, false))
        };
        seq.outbox.push_back(Event::Token {
            token,
            text: fed.text,
            logprob,
        });
        seq.next_token = Some(token);
        if eog || fed.stopped {
            self.finish(ctx, slot, FinishReason::Stop);
        } else if seq.completion_tokens >= seq.job.gen.max_tokens {
            self.finish(ctx, slot, FinishReason::Length);
        } else {
            self.flush(ctx, slot);
        }
    }

    /// Ends generation: flushes held text, queues `End`, frees KV cells now.
    fn finish(&mut self, ctx: &mut Context, slot: usize, finish: FinishReason) {
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
        self.release_kv(ctx, slot, true);
        self.metrics.completed.fetch_add(1, Ordering::Relaxed);
        self.metrics
            .class(class)
            .completed
            .fetch_add(1, Ordering::Relaxed);
        self.metrics.record_request_time(seq_arrival.elapsed());
        let seq = self.slots[slot].as_ref().expect("finishing slot is active");
        self.queue
            .observe_request(seq.job.prompt.len() - seq.reused, seq.completion_tokens);
        self.flush(ctx, slot);
    }

    fn fail(&mut self, ctx: &mut Context, slot: usize, message: String) {
        let Some(seq) = self.slots[slot].as_mut() else {
            return;
        };
        eprintln!("sluice: request {} failed: {message}", seq.job.id);
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

    /// Frees the slot's KV cells, or, with `keep` (its cells hold what its
    /// tokens say: it completed or was cancelled, not failed), moves them into
    /// a prefix cache entry. Either way its reservation ends.
    /// The slot whose stream holds parked cells (per sequence only).
    fn parked_slot(&self) -> Option<usize> {
        let per_seq = self.cfg.kv_layout == KvLayout::PerSequence;
        (per_seq && self.parked.is_some()).then_some(self.parked_seq as usize)
    }

    /// Cells the parked sequence holds (some may be shared with running ones).
    fn parked_cells(&self) -> usize {
        self.parked.as_ref().map_or(0, Vec::len)
    }

    /// Saves sequence `seq`'s KV state (its cells hold `tokens`, in at most
    /// `runs` runs) as a prefix cache entry, after making room for it; a
    /// sequence in many runs teaches what a run costs to save.
    fn save_into_cache(
        &mut self,
        ctx: &mut Context,
        seq: i32,
        tokens: Vec<Token>,
        (runs, exact): (usize, bool),
    ) {
        let room = self.prefix.make_room(&tokens, ctx.sequence_state_size(seq));
        let started = Instant::now();
        let state = ctx.save_sequence(seq);
        if exact && runs >= SAVE_RUNS_LEARN_MIN {
            let s = started.elapsed().as_secs_f64() / runs as f64;
            self.save_s_per_run = Some(
                self.save_s_per_run
                    .map_or(s, |old| old + SAVE_COST_WEIGHT * (s - old)),
            );
        }
        let kept = self.prefix.insert(tokens, state);
        self.metrics.prefix_tokens_evicted.fetch_add(
            (room.evicted_tokens + kept.evicted_tokens) as u64,
            Ordering::Relaxed,
        );
    }

    /// Frees the parked cells without saving them.
    fn drop_parked(&mut self, ctx: &mut Context) {
        if let Some(tokens) = self.parked.take() {
            self.clear_parked(ctx);
            self.metrics
                .prefix_tokens_evicted
                .fetch_add(tokens.len() as u64, Ordering::Relaxed);
        }
    }

    /// Saves the parked sequence into the prefix cache once no stream is
    /// waiting for a token (the copy then delays only prompts).
    fn save_parked_when_quiet(&mut self, ctx: &mut Context) {
        if self.parked.is_none() || self.slots.iter().flatten().any(Seq::is_decoding) {
            return;
        }
        let tokens = self.parked.take().expect("parked");
        self.save_into_cache(ctx, self.parked_seq, tokens, self.parked_runs);
        self.clear_parked(ctx);
    }

    /// Frees the parked sequence's cells and takes them out of the index.
    fn clear_parked(&mut self, ctx: &mut Context) {
        ctx.clear_sequence(self.parked_seq);
        self.prefix.index().clear_running(self.parked_seq as usize);
    }

    fn release_kv(&mut self, ctx: &mut Context, slot: usize, keep: bool) {
        let seq = self.slots[slot].as_mut().expect("slot is active");
        let tokens = std::mem::take(&mut seq.kv_tokens);
        debug_assert_eq!(tokens.len(), seq.n_past, "kv_tokens follow n_past");
        // What a save costs: one run of cells at a time (unified), or in
        // proportion to its cells (per sequence: one run in its own stream).
        let runs = match self.cfg.kv_layout {
            KvLayout::Unified => (seq.runs, seq.runs_exact),
            KvLayout::PerSequence => (tokens.len(), true),
        };
        let seq_id = slot as i32;
        self.prefix.index().clear_running(slot);
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
        // request can reuse them in place. Shorter saves happen at once:
        // unified, parked cells lengthen every step's attention (at 4
        // clients, parking every finished request raised the time to first
        // token from ~270 to ~340 ms).
        let stall_s = self.save_s_per_run.map_or(0.0, |s| s * runs.0 as f64);
        let too_long = stall_s > SAVE_STALL_SHARE_MAX * self.cfg.itl_target.as_secs_f64();
        if keep && self.prefix.is_enabled() && !tokens.is_empty() {
            if others_decoding && too_long {
                self.drop_parked(ctx);
                self.parked_seq = match self.cfg.kv_layout {
                    KvLayout::Unified => {
                        let spare = self.cfg.parallel as i32;
                        ctx.share_cells(seq_id, spare, 0, tokens.len() as i32);
                        spare
                    }
                    // The cells stay where they are, in the slot's own stream.
                    KvLayout::PerSequence => seq_id,
                };
                self.prefix
                    .index()
                    .set_running(self.parked_seq as usize, tokens.clone().into());
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
    }

    /// Sends what the sequence's outbox holds, as far as its channel takes it.
    /// A full channel leaves the rest for later (the sequence stays paused); a
    /// closed one means the client left: cancel and free everything now.
    fn flush(&mut self, ctx: &mut Context, slot: usize) {
        let seq = self.slots[slot].as_mut().expect("flushing slot is active");
        let mut gone = false;
        while let Some(event) = seq.outbox.pop_front() {
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
            let class = seq.job.class;
            self.slots[slot] = None;
            self.queue.finished(class);
        }
    }

    /// Cancels what the handlers gave up on, and what stalled: before each step,
    /// so a cancelled sequence never takes another one.
    fn reap(&mut self, ctx: &mut Context) {
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
    fn cancel(&mut self, ctx: &mut Context, slot: usize, reason: CancelReason) {
        let Some(seq) = self.slots[slot].as_ref() else {
            return;
        };
        // The handler learns why when its stream closes.
        let steps = self.metrics.steps.load(Ordering::Relaxed);
        seq.job.cancel.cancel(reason, steps);
        let class = seq.job.class;
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
        self.queue.finished(class);
    }

    fn deliver_outboxes(&mut self, ctx: &mut Context) {
        for slot in 0..self.slots.len() {
            if self.slots[slot]
                .as_ref()
                .is_some_and(|s| !s.outbox.is_empty() || s.done)
            {
                self.flush(ctx, slot);
            }
        }
    }

    fn publish_gauges(&self) {
        let active = self.slots.iter().flatten().filter(|s| !s.done).count();
        let paused = self
            .slots
            .iter()
            .flatten()
            .filter(|s| s.pause.is_paused())
            .count();
        let used: usize = self.slots.iter().flatten().map(|s| s.n_past).sum();
        self.metrics
            .set_engine_gauges(active, paused, self.kv_cells_reserved, used);
        self.metrics
            .set_prefix_gauges(self.prefix.len(), self.prefix.bytes(), self.parked_cells());
        // Readiness follows the interactive queue only: batch work is meant to
        // stand in its queue, and a box whose interactive requests start in
        // time can take more of them.
        let i = Class::Interactive.index();
        let (shedding, left_above) = self.codel[i]
            .as_ref()
            .map_or((false, false), |c| (c.is_shedding(), c.is_above_target()));
        // CoDel learns of a long wait only when the request leaves the queue;
        // while every slot stays busy, the head's own wait tells it sooner.
        let head_above = match (&self.held[i], self.cfg.shed[i]) {
            (Some(job), Some((target, _))) => job.enqueued_at.elapsed() > target,
            _ => false,
        };
        let above = left_above || head_above;
        self.metrics.shedding.store(shedding, Ordering::Relaxed);
        self.metrics
            .sojourn_above_target
            .store(above, Ordering::Relaxed);
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

/// GGUF files start with these four bytes.
const GGUF_MAGIC: &[u8; 4] = b"GGUF";
/// Smaller than any real GGUF header plus tensor data.
const GGUF_BYTES_MIN: u64 = 1024;

/// Checks the model file for the usual mistakes (missing, not GGUF, cut short),
/// with a message that says which, then loads it.
pub fn load_model(path: &std::path::Path, mmap: bool) -> Result<Model, String> {
    use std::io::Read;
    let meta = std::fs::metadata(path).map_err(|e| {
        format!(
            "model file {}: {e}. Fetch the default model with 'models/fetch', or pass --model PATH",
            path.display()
        )
    })?;
    if !meta.is_file() {
        return Err(format!("model path {} is not a file", path.display()));
    }
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .map_err(|e| format!("cannot read model file {}: {e}", path.display()))?;
    if &magic != GGUF_MAGIC {
        return Err(format!(
            "{} is not a GGUF file (it starts with {:02x?}, not \"GGUF\")",
            path.display(),
            magic
        ));
    }
    if meta.len() < GGUF_BYTES_MIN {
        return Err(format!(
            "{} has only {} bytes: the file is truncated",
            path.display(),
            meta.len()
        ));
    }
    Model::load(path, mmap).map_err(|e| format!("{e}; the file may be truncated or corrupt"))
}
