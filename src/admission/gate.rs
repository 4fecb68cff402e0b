//! The gate: what waits and runs in each class, the rates and the mix the
//! bounds are derived from, the return times promised to refused clients, and
//! what a new prompt could reuse. The handlers hold it, behind a mutex held
//! for microseconds by whichever judges; the engine never touches it: it
//! reports (`report.rs`), and whoever takes the gate applies the reports
//! first (`lock`).

use super::prefixes::PrefixIndex;
use super::report::Report;
use super::*;
use crate::ffi::Token;

/// What is in the system now, per class (`Class::index`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Load {
    /// In a slot.
    running: [usize; Class::COUNT],
    /// Admitted and waiting for a slot.
    waiting: [usize; Class::COUNT],
    /// Prompt tokens of the ones waiting.
    waiting_tokens: [usize; Class::COUNT],
}

impl Load {
    fn running_total(&self) -> usize {
        self.running.iter().sum()
    }

    /// Requests and prompt tokens that wait ahead of a new request of `class`:
    /// those of its own class and of every class above it.
    fn ahead_of(&self, class: Class) -> (usize, usize) {
        let n = class.index() + 1;
        (
            self.waiting[..n].iter().sum(),
            self.waiting_tokens[..n].iter().sum(),
        )
    }

    /// A reserved place given up without a slot.
    fn drop_waiting(&mut self, class: Class, tokens: usize) {
        let c = class.index();
        assert!(self.waiting[c] > 0, "drop without reserve");
        self.waiting[c] -= 1;
        self.waiting_tokens[c] -= tokens;
    }
}

/// The gate's view of the queues, held by the handlers; the engine reports
/// when a request gets its slot and when it leaves it, and publishes the
/// rates it measures. A request of a class is refused when its class's waiting requests
/// would exceed the slots it could take now plus its L_max, or when it must
/// wait and its class's waiting prompt tokens already exceed their budget.
///
/// The slots a class could take now: for `interactive`, the free ones; for
/// `batch`, the free ones that interactive requests waiting do not take, and no
/// more than batch may hold (`--parallel` minus `--interactive-slots`).
pub struct QueueGauge {
    state: Mutex<State>,
    slots: usize,
    batch_slots: usize,
    policies: [Policy; Class::COUNT],
    /// What the engine reported and the gate has not applied yet.
    reports: Receiver<Report>,
    /// Where the engine publishes its measured rates.
    metrics: Arc<Metrics>,
}

struct State {
    load: Load,
    rates: Rates,
    mix: Mix,
    bounds: [Bounds; Class::COUNT],
    /// The return time last handed to a refused request of each class.
    promised: [Option<Instant>; Class::COUNT],
    /// Until when each class's bounds are the pressed ones: W_max after its
    /// door last refused a request that came alone (`Bounds::pressed`).
    pressed_until: [Option<Instant>; Class::COUNT],
    /// What the prefix cache and the running sequences hold.
    prefixes: PrefixIndex,
}

impl State {
    /// The bounds of `class` in force at `now`: the pressed ones for W_max
    /// after its door refused. A refusal means more arrive than the slots and
    /// the queue hold, so this is not a closed loop within them (which the
    /// slots' floor serves without refusing): waiting past W_max would only
    /// make every admitted request late, as arrivals keep the queue full.
    fn bounds_at(&self, class: Class, now: Instant) -> Bounds {
        let bounds = self.bounds[class.index()];
        if self.is_pressed(class, now) {
            bounds.pressed()
        } else {
            bounds
        }
    }

    /// Whether `class` is within W_max of its door's last refusal at `now`.
    fn is_pressed(&self, class: Class, now: Instant) -> bool {
        self.pressed_until[class.index()].is_some_and(|until| now < until)
    }

    /// The bounds of each class from the rates and the mix in force.
    fn derive(&mut self, policies: &[Policy; Class::COUNT]) {
        let typical = self.mix.typical();
        self.bounds = policies.map(|p| derive_bounds(self.rates, &Policy { typical, ..p }));
    }

    /// One report of the engine's, in the order it was sent.
    fn apply(&mut self, r: Report, policies: &[Policy; Class::COUNT]) {
        let l = &mut self.load;
        match r {
            Report::Started { class, tokens } => {
                let c = class.index();
                assert!(
                    l.waiting[c] > 0 && l.waiting_tokens[c] >= tokens,
                    "start without reserve"
                );
                l.running[c] += 1;
                l.waiting[c] -= 1;
                l.waiting_tokens[c] -= tokens;
            }
            Report::Finished { class } => {
                assert!(l.running[class.index()] > 0, "finish without start");
                l.running[class.index()] -= 1;
            }
            Report::Dropped { class, tokens } => l.drop_waiting(class, tokens),
            Report::Completed {
                prefilled,
                generated,
            } => {
                self.mix.observe(prefilled, generated);
                self.derive(policies);
            }
            Report::Cached(tokens) => self.prefixes.set_cached(tokens),
            Report::Running { slot, prompt } => match prompt {
                Some(p) => self.prefixes.set_running(slot, p),
                None => self.prefixes.clear_running(slot),
            },
        }
    }
}

impl QueueGauge {
    pub(super) fn new(
        slots: usize,
        batch_slots: usize,
        rates: Rates,
        policies: [Policy; Class::COUNT],
        reports: Receiver<Report>,
        metrics: Arc<Metrics>,
    ) -> QueueGauge {
        assert!(batch_slots >= 1 && batch_slots <= slots);
        QueueGauge {
            state: Mutex::new(State {
                load: Load::default(),
                rates,
                mix: Mix::new(policies[Class::Interactive.index()].typical),
                bounds: policies.map(|p| derive_bounds(rates, &p)),
                promised: [None; Class::COUNT],
                pressed_until: [None; Class::COUNT],
                prefixes: PrefixIndex::default(),
            }),
            slots,
            batch_slots,
            policies,
            reports,
            metrics,
        }
    }

    /// The gate, with every report the engine sent so far applied and the
    /// rates it published last in force.
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        let mut s = self.state.lock().expect("queue gauge lock");
        for r in self.reports.try_iter() {
            s.apply(r, &self.policies);
        }
        if let Some((prefill_tok_s, decode_tok_s)) = self.metrics.rates() {
            let rates = Rates {
                prefill_tok_s,
                decode_tok_s,
            };
            if rates != s.rates {
                s.rates = rates;
                s.derive(&self.policies);
            }
        }
        s
    }

    /// When a refused request should come back, as a wait from now.
    ///
    /// Refused requests are given places in a virtual queue served at the
    /// rate capacity frees: each one reserves its own service time
    /// (`own_s`: its prompt at the prefill rate, its `max_tokens` at the
    /// decode rate of the full batch) after the one refused before it, and
    /// the first after a quiet spell comes back when, on average, the
    /// running requests are half done (`slots × own_s / 2`). So a burst's
    /// refused clients return one by one as room opens, not all together
    /// (capacity idle in between) nor all at once (refused again). The
    /// reservations end `PROMISE_HORIZON_S` ahead: clients that never come
    /// back cannot push the others' waits out for good.
    pub fn promise(&self, class: Class, own_s: f64) -> Duration {
        self.promise_at(class, own_s, Instant::now())
    }

    pub(super) fn promise_at(&self, class: Class, own_s: f64, now: Instant) -> Duration {
        let slots = match class {
            Class::Interactive => self.slots,
            Class::Batch => self.batch_slots,
        } as f64;
        let own = Duration::from_secs_f64(own_s.clamp(0.001, PROMISE_HORIZON_S));
        let first = now + own.mul_f64(slots / 2.0);
        let mut st = self.lock();
        let slot = &mut st.promised[class.index()];
        let t = match *slot {
            Some(p) if p + own > first => p + own,
            _ => first,
        }
        .min(now + Duration::from_secs_f64(PROMISE_HORIZON_S));
        *slot = Some(t);
        t - now
    }

    /// Slots a new request of `class` could take at once.
    fn free_for(&self, l: &Load, class: Class) -> usize {
        let free = self.slots.saturating_sub(l.running_total());
        match class {
            Class::Interactive => free,
            Class::Batch => free
                .saturating_sub(l.waiting[Class::Interactive.index()])
                .min(
                    self.batch_slots
                        .saturating_sub(l.running[Class::Batch.index()]),
                ),
        }
    }

    /// Reserves places for `n` requests of `class` (the choices of one
    /// request: all of them or none) holding `prompt_tokens` together, or says
    /// which bound they break (with what is waiting ahead of them, and the
    /// bounds and rates they were judged by).
    pub(super) fn reserve(
        &self,
        class: Class,
        n: usize,
        prompt_tokens: usize,
    ) -> Result<(), Refusal> {
        let mut s = self.lock();
        self.judge_pressing(&mut s, class, n, Instant::now())?;
        let c = class.index();
        s.load.waiting[c] += n;
        s.load.waiting_tokens[c] += prompt_tokens;
        Ok(())
    }

    /// Whether a request of `class` would be admitted now, without reserving
    /// its place. Its prompt does not matter (`judge`): the door's answer,
    /// before the body is read, is the gate's.
    pub(super) fn check(&self, class: Class) -> Result<(), Refusal> {
        self.check_at(class, Instant::now())
    }

    /// `check` at a given instant, so that the unit tests can step past W_max
    /// without waiting for it.
    pub(super) fn check_at(&self, class: Class, now: Instant) -> Result<(), Refusal> {
        let mut s = self.lock();
        self.judge_pressing(&mut s, class, 1, now)
    }

    /// `judge` at `now`; a refusal that a single request would also get
    /// (not one of a request's choices too many) presses the class's bounds
    /// for W_max from now.
    fn judge_pressing(
        &self,
        s: &mut State,
        class: Class,
        n: usize,
        now: Instant,
    ) -> Result<(), Refusal> {
        let free = self.free_for(&s.load, class);
        let verdict = Self::judge(s, free, class, n, now);
        if verdict.is_err() && (n == 1 || Self::judge(s, free, class, 1, now).is_err()) {
            let wait = self.policies[class.index()].queue_wait;
            s.pressed_until[class.index()] = Some(now + wait);
        }
        verdict
    }

    /// The gate's rule (`reserve`) for `n` requests, given the slots the class
    /// could take now.
    ///
    /// The token budget bounds the prompt tokens *ahead* of a request that
    /// must wait: their prefill is its queueing delay, W_max of it at most.
    /// Its own prompt is its service, not its wait, so a long prompt behind a
    /// short queue is admitted (below capacity it is served, and refusing it
    /// only sends it back later), while one behind more than W_max of prompts
    /// is refused, whatever its own size; the derived budget judges only one
    /// that would wait behind more than `Bounds::token_free_waiting`. So the
    /// rule needs no prompt: the door applies it exactly, before the body is
    /// read. The bounds are those in force at `now` (`State::bounds_at`).
    fn judge(s: &State, free: usize, class: Class, n: usize, now: Instant) -> Result<(), Refusal> {
        let l = s.load;
        let c = class.index();
        let bounds = s.bounds_at(class, now);
        let (ahead, ahead_tokens) = l.ahead_of(class);
        let refuse = |bound| Refusal {
            bound,
            waiting: ahead,
            waiting_tokens: ahead_tokens,
            rates: s.rates,
            bounds,
        };
        if l.waiting[c] + n > free + bounds.queue_depth_max {
            return Err(refuse(QueueBound::Requests));
        }
        // Free slots take requests at once, and one waiting request per slot
        // is let in whatever the prompts (`Bounds::token_free_waiting`): only
        // one that must wait behind more is judged by what waits ahead of it.
        let judged = l.waiting[c] + n > free + bounds.token_free_waiting;
        if judged && l.waiting_tokens[c] > bounds.queued_tokens_max {
            return Err(refuse(QueueBound::Tokens));
        }
        Ok(())
    }

    /// A reserved place given up without a slot, on the handler's side (the
    /// engine stopped before it took the job).
    pub(super) fn dropped(&self, class: Class, prompt_tokens: usize) {
        self.lock().load.drop_waiting(class, prompt_tokens);
    }

    /// Prompt tokens of `prompt` that would be reused if it started now.
    pub fn reusable(&self, prompt: &[Token]) -> usize {
        self.lock().prefixes.reusable(prompt)
    }

    /// The typical request the bounds are derived from now.
    pub fn typical(&self) -> Typical {
        self.lock().mix.typical()
    }

    /// The rates and each class's bounds in force now (pressed or not).
    pub fn snapshot(&self) -> (Rates, [Bounds; Class::COUNT]) {
        let s = self.lock();
        let now = Instant::now();
        (s.rates, Class::ALL.map(|c| s.bounds_at(c, now)))
    }

    /// Whether each class's bounds are the pressed ones now.
    pub fn pressed(&self) -> [bool; Class::COUNT] {
        let s = self.lock();
        let now = Instant::now();
        Class::ALL.map(|c| s.is_pressed(c, now))
    }

    /// Seconds a client of `class` refused now should wait (for 503s sent by
    /// the engine).
    pub fn retry_after_s(&self, class: Class) -> u64 {
        let s = self.lock();
        let (ahead, tokens) = s.load.ahead_of(class);
        retry_after_s(ahead, tokens, s.rates, s.bounds[class.index()])
    }

    /// Forecast of the time to a new request's first token, if it came now
    /// with `prompt_tokens` to prefill: the wait for a slot (none while one
    /// is free for it; else the requests ahead of it, and itself, leaving at
    /// the service rate `mu_req`), then the prompt tokens ahead of it and its
    /// own at the prefill rate (prefill takes the cores in turn).
    pub fn first_token_forecast(&self, class: Class, prompt_tokens: usize) -> Duration {
        let s = self.lock();
        let free = self.free_for(&s.load, class);
        let (ahead, ahead_tokens) = s.load.ahead_of(class);
        let bounds = s.bounds[class.index()];
        let slot_wait_s = match ahead < free {
            true => 0.0,
            false => (ahead + 1 - free) as f64 / bounds.mu_req.max(1e-6),
        };
        let prefill_s = (ahead_tokens + prompt_tokens) as f64 / s.rates.prefill_tok_s.max(1e-6);
        Duration::from_secs_f64((slot_wait_s + prefill_s).clamp(0.0, 86_400.0))
    }

    /// Requests of `class` in a slot or waiting for one.
    pub fn holds(&self, class: Class) -> usize {
        let s = self.lock();
        s.load.running[class.index()] + s.load.waiting[class.index()]
    }

    /// Requests of `class` waiting for a slot.
    pub fn queued_requests(&self, class: Class) -> usize {
        self.lock().load.waiting[class.index()]
    }

    pub fn queued_tokens(&self, class: Class) -> usize {
        self.lock().load.waiting_tokens[class.index()]
    }
}

/// Why the gate said no, and what it saw.
#[derive(Debug, Clone, Copy)]
pub(super) struct Refusal {
    pub(super) bound: QueueBound,
    pub(super) waiting: usize,
    pub(super) waiting_tokens: usize,
    pub(super) rates: Rates,
    pub(super) bounds: Bounds,
}
