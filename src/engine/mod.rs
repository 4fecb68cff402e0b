//! The engine: one thread that owns the llama contexts and runs continuous batching.
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

mod ahead;
mod budget;
pub mod calibration;
pub mod codel;
pub mod contexts;
pub mod cost;
mod decode;
mod dequeue;
mod kv;
mod model_file;
mod passes;
mod seq;

pub mod logprobs;
pub mod planner;
pub mod prefix;
pub mod sample;
pub mod served;
pub mod text;

use crate::admission::{Job, Queues, Reporter, Slot, Task};
use crate::embed::Pooler;
use crate::ffi::{self, Batch, Context, KvLayout, Model, Token};
use crate::metrics::Metrics;
use crate::priority::{Class, Picker};
use crate::stream::{
    CancelReason, ErrorKind, Event, FinishReason, Pause, ShedReason, TokenLogprob, Usage,
};
use codel::{Codel, Verdict};
use contexts::Contexts;
use cost::{Chunk, CostModel};
use crossbeam_channel::{Select, TrySendError};
pub use model_file::load_model;
use planner::{Phase, SeqView, Work};
use prefix::{EntryId, PrefixCache};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use text::TextAssembler;

/// How long an idle engine sleeps waiting for work before it checks for shutdown.
const IDLE_WAIT_MS: u64 = 100;
/// After this long with nothing running, the KV cache's pages are given back
/// to the kernel. Not at once: faulting a stream's pages in again costs the
/// next request a few milliseconds.
const KV_RELEASE_IDLE_MS: u64 = 2_000;
/// How often the engine publishes its measured rates to admission, at most.
const RATES_PUBLISH_INTERVAL_MS: u64 = 100;
/// Most embedding-request tokens in one pass. With embeddings on, llama.cpp
/// outputs every token of a pass, logits too: its output buffer holds a
/// row of n_vocab floats for each (~12 MB for 64 tokens of a 49k
/// vocabulary), and keeps the largest it was asked for.
const EMBED_PASS_TOKENS_MAX: usize = 64;
/// The token of a filler (`passes::gap_ids`): any will do, its cell is
/// freed after its pass and nothing reads its output.
const FILLER_TOKEN: Token = 0;
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
    /// The longest pause a step may cost the streams to prefill a short
    /// prompt whole, while each keeps its k-th token within k `itl_target`s
    /// and one such pause of its first (zero: never).
    pub itl_max: Duration,
    /// The longest chunk of a long prompt beside streams that tokens
    /// decoded ahead carry them through (`ahead`); zero: none.
    pub decode_ahead: Duration,
    /// A prompt that has held its slot this many times its prefill's
    /// forecast (and at least its class's W_max) without finishing its
    /// prefill goes first on every other step (`planner`, rule 2): no prompt
    /// is overtaken for long, yet a long one under load, slow anyway, does
    /// not take every other step from the short ones as soon as it passes
    /// W_max (`--overdue-stretch`).
    pub overdue_stretch: f64,
    /// W_max per class: a request that waited past its class's sojourn target
    /// starts only if its first token can still come within this.
    pub queue_wait: [Duration; Class::COUNT],
    pub cpus: Vec<usize>,
    pub poll: u32,
    /// CoDel's sojourn target and interval per class; `None` sheds nothing
    /// (`--no-shed`).
    pub shed: [Option<(Duration, Duration)>; Class::COUNT],
    /// Whether a request that waited too long is refused at dequeue (CoDel's
    /// verdict, the first token's forecast against W_max): only under an
    /// operator's explicit budget. Otherwise the target only tells readiness.
    pub shed_late: bool,
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
    /// Requests of at most this many cells run in a second context, with
    /// flash attention on and an f16 cache (`contexts`); 0: none.
    pub short_cells: usize,
}

/// One admitted request, bound to a slot (= llama.cpp sequence id).
struct Seq {
    job: Job,
    /// Its slot in admission's count, given back when the sequence is dropped
    /// or, when it completes, just before its `End` goes out (`flush`).
    slot_hold: Option<Slot>,
    admitted: u64,
    /// From when its prompt, not yet prefilled, is overdue (`views`): its
    /// class's W_max after it got its slot, or `overdue_stretch` times its
    /// prefill's forecast then (beside the streams running) if that is longer.
    overdue_at: Instant,
    /// How it picks its tokens; none for an embedding job.
    sampler: Option<sample::Sampler>,
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
    /// When its first token went out: the stream's pace counts from here.
    first_token_at: Option<Instant>,
    /// When its last token goes out: when it was sampled, or later when it
    /// was decoded ahead (`ahead`).
    released_until: Option<Instant>,
    /// Measured seconds per token of this prompt's latest prefill chunks.
    prefill_s_per_token: Option<f64>,
    completion_tokens: usize,
    prompt_logprobs: Vec<TokenLogprob>,
    /// An embedding request's current input's vector in the making.
    pooler: Pooler,
    /// A later choice of an `n` > 1 request waiting (unplanned) for the first
    /// choice's job, of this id, to prefill the prompt they share
    /// (`share_prompts`).
    awaits_prompt_of: Option<u64>,
    outbox: VecDeque<Event>,
    /// Since when the outbox has waited for room in the stream.
    pause: Pause,
    /// Generation ended; the slot is held only until the outbox is delivered.
    done: bool,
}

impl Seq {
    /// Generating: a stream waits for this sequence's next token.
    fn is_decoding(&self) -> bool {
        !self.done && self.job.prompt.len() <= self.n_past
    }

    /// Seconds until its next token is due at one token per `pace` from its
    /// first (`planner::pace_slack_s`); none before its first token.
    fn pace_slack_s(&self, now: Instant, pace: Duration) -> Option<f64> {
        let first = self.first_token_at?;
        Some(planner::pace_slack_s(
            now.saturating_duration_since(first).as_secs_f64(),
            self.completion_tokens,
            pace.as_secs_f64(),
        ))
    }

    /// A chunk of its prompt was prefilled (and measured) already.
    fn prefill_begun(&self) -> bool {
        self.prefill_s_per_token.is_some()
    }

    /// The cost model's view of this sequence's next `tokens` prompt tokens.
    fn chunk(&self, tokens: usize) -> Chunk {
        Chunk {
            tokens,
            start: self.n_past,
            own_s_per_token: self.prefill_s_per_token,
        }
    }

    fn phase(&self) -> Option<Phase> {
        if self.done || self.awaits_prompt_of.is_some() {
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
/// reporter (told of starts, ends, measured rates and what the prefix cache
/// holds), the cost model seeded by calibration, and the prefix cache.
pub struct Wiring {
    pub jobs: Queues,
    pub queue: Reporter,
    pub cost: CostModel,
    pub prefix: PrefixCache,
}

/// Runs the engine loop until the job channel is closed and no work is left.
pub fn run(
    model: Arc<Model>,
    mut ctx: Contexts,
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
        eog: sample::eog_tokens(&model),
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
        overdue_turn: true,
        ahead: false,
        ahead_forecast: None,
        ahead_stretch: ahead::Stretches::default(),
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
        // Entries restored, evicted or saved since: admission's estimate
        // follows within one turn.
        engine.report_prefixes();
        let closed = if engine.shutdown.is_shutdown() {
            engine.refuse_queued(&jobs)
        } else {
            engine.admit(&mut ctx, &jobs)
        };
        engine.share_prompts(&mut ctx);
        let mut views = engine.views();
        engine.take_overdue_turn(&mut views);
        let plan = engine.next_plan(&views);
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
    /// The vocabulary's end-of-generation tokens, which `ignore_eos` bans.
    eog: Arc<[Token]>,
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
    /// another job starts there only when no other slot is free, and saves
    /// or drops them first: `put_away_parked`).
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
    /// The streams decode ahead of a long prompt's large chunk: their tokens
    /// go out at the target's pace (`ahead`).
    ahead: bool,
    /// The forecast of the large chunk this step takes, if it takes one, and
    /// whether it is its prompt's first.
    ahead_forecast: Option<(f64, bool)>,
    /// How far large chunks ran over their forecasts (`ahead::Stretches`).
    ahead_stretch: ahead::Stretches,
    /// This step keeps the overdue prompts' marks (`take_overdue_turn`);
    /// flips on every step that has one, so they go first every other step.
    overdue_turn: bool,
    cfg: EngineConfig,
    metrics: Arc<Metrics>,
    /// Admission's reporter: told when a job gets a slot and when it leaves
    /// it, the rates the cost model measures, and what the prefix cache holds.
    queue: Reporter,
    /// CoDel per class.
    codel: [Option<Codel>; Class::COUNT],
    cost: CostModel,
    rates_published_at: Instant,
}

/// A plan entry placed in a pass's batch: (slot, first batch index, tokens).
type Placed = (usize, usize, usize);

impl Engine {
    fn wait_for_work(&mut self, ctx: &mut Contexts, jobs: &Queues) {
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
    /// so streams decoding beside a long prompt would pay for its depth. A
    /// chunk of one token no deeper than the decode tokens goes in their pass.
    /// The chunks' pass goes first when one of them ends its prompt
    /// (`passes::passes`): its first token does not wait for the streams'.
    fn step(&mut self, ctx: &mut Contexts, plan: &planner::Plan) {
        let n_decode = plan.n_decode();
        let seq = |slot: usize| self.slots[slot].as_ref().expect("planned slot is active");
        let passes::Passes { passes, riders } = passes::passes(
            plan,
            self.cfg.kv_layout == KvLayout::PerSequence,
            |slot| seq(slot).job.embed().is_some(),
            |slot| seq(slot).n_past,
            |slot, n| seq(slot).n_past + n >= seq(slot).job.prompt.len(),
        );
        let mut took = Duration::ZERO;
        let mut n_tokens = 0;
        let mut counted = false;
        self.kv_written = true;
        self.idle_since = None;
        let mut prefills: Vec<(usize, Chunk)> = Vec::new();
        // With a second context for short requests, a pass whose sequences
        // live in both goes as two.
        for (pass, embeddings) in passes::by_home(passes, |slot| ctx.home(slot)) {
            ctx.set_embeddings(embeddings);
            let Some((placed, t)) = self.decode_pass(ctx, &pass) else {
                ctx.set_embeddings(false);
                return;
            };
            took += t;
            if !counted {
                // Before any of the step's tokens goes out.
                self.metrics
                    .count_step(n_decode > 0 && plan.n_tokens() > n_decode);
                counted = true;
            }
            n_tokens += self.batch.len();
            let counted = prefills.len();
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
            // Counted before `after_decode` answers a request whose prompt
            // this pass finished (a scoring request ends here), so a client
            // that reads /metrics after its answer finds its prompt in them.
            let pass_prefill: usize = prefills[counted..].iter().map(|(_, c)| c.tokens).sum();
            self.metrics
                .prefill_tokens
                .fetch_add(pass_prefill as u64, Ordering::Relaxed);
            // The logits of this pass are read before the next pass's decode.
            // Sampling (with a structured-output mask, not free) is part of
            // the step's cost, so it is timed into what the cost model sees.
            let sampling = Instant::now();
            for (slot, first, n) in placed {
                self.after_decode(ctx, slot, first, n);
            }
            took += sampling.elapsed();
        }
        ctx.set_embeddings(false);
        self.metrics.record_step(n_tokens, took);
        prefills.retain(|(slot, _)| !riders.contains(slot));
        let n_decode = n_decode + riders.len();
        let chunks: Vec<Chunk> = prefills.iter().map(|&(_, c)| c).collect();
        self.metrics
            .record_step_forecast(self.cost.predict(n_decode, &chunks), took.as_secs_f64());
        if let Some((forecast, first)) = self.ahead_forecast.take() {
            self.ahead_stretch
                .after(first, took.as_secs_f64() / forecast);
        }
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

    fn publish_gauges(&self) {
        let active = self.slots.iter().flatten().filter(|s| !s.done).count();
        let paused = self
            .slots
            .iter()
            .flatten()
            .filter(|s| s.pause.is_paused())
            .count();
        let used: usize = self.slots.iter().flatten().map(|s| s.kv_tokens.len()).sum();
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
        self.metrics
            .shedding
            .store(shedding && self.cfg.shed_late, Ordering::Relaxed);
        self.metrics
            .sojourn_above_target
            .store(above, Ordering::Relaxed);
    }
}
