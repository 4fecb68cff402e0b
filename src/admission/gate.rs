//! The gate, pure: what waits and runs in each class, the rates and the mix
//! the bounds are derived from, and the return times promised to refused
//! clients. Only the admission thread holds it (`mod.rs`), and applies the
//! handlers' and the engine's messages to it in the order they arrive.
//!
//! A request of a class is refused when its class's waiting requests would
//! exceed the slots it could take now plus its L_max, or when it must wait
//! and its class's waiting prompt tokens already exceed their budget. The
//! slots a class could take now: for `interactive`, the free ones; for
//! `batch`, the free ones that interactive requests waiting do not take, and
//! no more than batch may hold (`--parallel` minus `--interactive-slots`).

use super::*;

/// How far ahead refused requests are given return times, at most (the
/// OpenAI SDKs honour a `retry-after-ms` up to 60 s).
const PROMISE_HORIZON_S: f64 = 60.0;

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

pub(super) struct Gate {
    load: Load,
    rates: Rates,
    mix: Mix,
    bounds: [Bounds; Class::COUNT],
    /// The return time last handed to a refused request of each class.
    promised: [Option<Instant>; Class::COUNT],
    slots: usize,
    batch_slots: usize,
    policies: [Policy; Class::COUNT],
}

impl Gate {
    pub(super) fn new(
        slots: usize,
        batch_slots: usize,
        rates: Rates,
        policies: [Policy; Class::COUNT],
    ) -> Gate {
        assert!(batch_slots >= 1 && batch_slots <= slots);
        Gate {
            load: Load::default(),
            rates,
            mix: Mix::new(policies[Class::Interactive.index()].typical),
            bounds: policies.map(|p| derive_bounds(rates, &p)),
            promised: [None; Class::COUNT],
            slots,
            batch_slots,
            policies,
        }
    }

    /// The bounds of each class from the rates and the mix in force.
    fn derive(&mut self) {
        let typical = self.mix.typical();
        let rates = self.rates;
        self.bounds = self
            .policies
            .map(|p| derive_bounds(rates, &Policy { typical, ..p }));
    }

    /// When a refused request should come back, as a wait from `now`.
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
    pub(super) fn promise_at(&mut self, class: Class, own_s: f64, now: Instant) -> Duration {
        let slots = match class {
            Class::Interactive => self.slots,
            Class::Batch => self.batch_slots,
        } as f64;
        let own = Duration::from_secs_f64(own_s.clamp(0.001, PROMISE_HORIZON_S));
        let first = now + own.mul_f64(slots / 2.0);
        let slot = &mut self.promised[class.index()];
        let t = match *slot {
            Some(p) if p + own > first => p + own,
            _ => first,
        }
        .min(now + Duration::from_secs_f64(PROMISE_HORIZON_S));
        *slot = Some(t);
        t - now
    }

    /// Slots a new request of `class` could take at once.
    fn free_for(&self, class: Class) -> usize {
        let l = &self.load;
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
        &mut self,
        class: Class,
        n: usize,
        prompt_tokens: usize,
    ) -> Result<(), Refusal> {
        self.judge(class, n)?;
        let c = class.index();
        self.load.waiting[c] += n;
        self.load.waiting_tokens[c] += prompt_tokens;
        Ok(())
    }

    /// Whether a request of `class` would be admitted now, without reserving
    /// its place. Its prompt does not matter (`judge`): the door's answer,
    /// before the body is read, is the gate's.
    pub(super) fn check(&self, class: Class) -> Result<(), Refusal> {
        self.judge(class, 1)
    }

    /// The gate's rule (`reserve`) for `n` requests.
    ///
    /// The token budget bounds the prompt tokens *ahead* of a request that
    /// must wait: their prefill is its queueing delay, W_max of it at most.
    /// Its own prompt is its service, not its wait, so a long prompt behind a
    /// short queue is admitted (below capacity it is served, and refusing it
    /// only sends it back later), while one behind more than W_max of prompts
    /// is refused, whatever its own size. So the rule needs no prompt: the
    /// door applies it exactly, before the body is read.
    fn judge(&self, class: Class, n: usize) -> Result<(), Refusal> {
        let free = self.free_for(class);
        let l = self.load;
        let c = class.index();
        let bounds = self.bounds[c];
        let (ahead, ahead_tokens) = l.ahead_of(class);
        let refuse = |bound| Refusal {
            bound,
            waiting: ahead,
            waiting_tokens: ahead_tokens,
            rates: self.rates,
            bounds,
        };
        if l.waiting[c] + n > free + bounds.queue_depth_max {
            return Err(refuse(QueueBound::Requests));
        }
        // Free slots take requests at once: only one that must wait is judged
        // by what waits ahead of it.
        let would_wait = l.waiting[c] + n > free;
        if would_wait && l.waiting_tokens[c] > bounds.queued_tokens_max {
            return Err(refuse(QueueBound::Tokens));
        }
        Ok(())
    }

    /// A request left its queue for a slot.
    pub(super) fn started(&mut self, class: Class, prompt_tokens: usize) {
        let c = class.index();
        let l = &mut self.load;
        assert!(
            l.waiting[c] > 0 && l.waiting_tokens[c] >= prompt_tokens,
            "start without reserve"
        );
        l.running[c] += 1;
        l.waiting[c] -= 1;
        l.waiting_tokens[c] -= prompt_tokens;
    }

    /// A running request ended (completed, failed or cancelled) and freed its
    /// slot.
    pub(super) fn finished(&mut self, class: Class) {
        let l = &mut self.load;
        assert!(l.running[class.index()] > 0, "finish without start");
        l.running[class.index()] -= 1;
    }

    /// A reserved request left without a slot: it never reached the engine, or
    /// the engine refused it at dequeue (shed, deadline passed).
    pub(super) fn dropped(&mut self, class: Class, prompt_tokens: usize) {
        let c = class.index();
        let l = &mut self.load;
        assert!(l.waiting[c] > 0, "drop without reserve");
        l.waiting[c] -= 1;
        l.waiting_tokens[c] -= prompt_tokens;
    }

    /// The engine measured new rates: the bounds follow them.
    pub(super) fn set_rates(&mut self, rates: Rates) {
        self.rates = rates;
        self.derive();
    }

    /// A request completed, having prefilled `prompt_tokens` and generated
    /// `generated_tokens`: μ_req, and so L_max, follow the work that arrives.
    pub(super) fn observe_request(&mut self, prompt_tokens: usize, generated_tokens: usize) {
        self.mix.observe(prompt_tokens, generated_tokens);
        self.derive();
    }

    /// The typical request the bounds are derived from now.
    pub(super) fn typical(&self) -> Typical {
        self.mix.typical()
    }

    /// The rates and each class's bounds in force now.
    pub(super) fn snapshot(&self) -> (Rates, [Bounds; Class::COUNT]) {
        (self.rates, self.bounds)
    }

    /// Seconds a client of `class` refused now should wait (for 503s sent by
    /// the engine).
    pub(super) fn retry_after_s(&self, class: Class) -> u64 {
        let (ahead, tokens) = self.load.ahead_of(class);
        retry_after_s(ahead, tokens, self.rates, self.bounds[class.index()])
    }

    /// Requests of `class` waiting for a slot.
    pub(super) fn queued_requests(&self, class: Class) -> usize {
        self.load.waiting[class.index()]
    }

    /// Prompt tokens of `class` waiting for a slot.
    pub(super) fn queued_tokens(&self, class: Class) -> usize {
        self.load.waiting_tokens[class.index()]
    }
}
