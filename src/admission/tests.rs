//! The queue's bounds, refusals and promises, on gauges built by hand.

use super::bounds::tests::{policy, RATES};
use super::*;

#[test]
fn refused_requests_are_promised_return_times_one_service_time_apart() {
    let g = gauge(4, 3, 1000);
    let t0 = Instant::now();
    let ms = |d: Duration| d.as_millis() as u64;
    // A request of 0.5 s of service: the first comes back when the four
    // running ones are half done, the next ones 0.5 s after each other.
    let waits: Vec<u64> = (0..4).map(|_| ms(g.promise_at(I, 0.5, t0))).collect();
    assert_eq!(waits, vec![1000, 1500, 2000, 2500]);
    // Later, the line has moved on: 1.2 s on, the next place is 1.8 s away.
    assert_eq!(
        ms(g.promise_at(I, 0.5, t0 + Duration::from_millis(1200))),
        1800
    );
    // Another class keeps its own line.
    assert_eq!(ms(g.promise_at(B, 0.5, t0)), 1000);
    // After a quiet spell the line starts again.
    let later = t0 + Duration::from_secs(30);
    assert_eq!(ms(g.promise_at(I, 0.5, later)), 1000);
    // Promises end at the horizon.
    for _ in 0..200 {
        g.promise_at(I, 1.0, later);
    }
    assert_eq!(ms(g.promise_at(I, 1.0, later)), 60_000);
}

fn gauge(slots: usize, depth: usize, tokens: usize) -> Both {
    let p = Policy {
        queued_tokens_max: Some(tokens),
        ..policy(5000, Some(depth))
    };
    new_gauge(slots, slots, RATES, [p, p])
}

/// The gate and the engine's reporter, as `Admission::new` wires them: what
/// the tests tell the engine's side goes through the reports.
struct Both {
    gauge: QueueGauge,
    reporter: Reporter,
}

impl std::ops::Deref for Both {
    type Target = QueueGauge;
    fn deref(&self) -> &QueueGauge {
        &self.gauge
    }
}

impl Both {
    fn started(&self, class: Class, tokens: usize) -> Slot {
        self.reporter.started(class, tokens)
    }

    fn set_rates(&self, rates: Rates) {
        self.reporter.set_rates(rates);
    }

    fn observe_request(&self, prefilled: usize, generated: usize) {
        self.reporter.observe_request(prefilled, generated);
    }
}

fn new_gauge(slots: usize, batch_slots: usize, rates: Rates, p: [Policy; Class::COUNT]) -> Both {
    let (tx, rx) = bounded(report::reports_capacity(slots + 2 * 9 + 2 * slots));
    let metrics = Arc::new(Metrics::default());
    Both {
        gauge: QueueGauge::new(slots, batch_slots, rates, p, rx, Arc::clone(&metrics)),
        reporter: Reporter { tx, metrics },
    }
}

const I: Class = Class::Interactive;
const B: Class = Class::Batch;

#[test]
fn free_slots_and_the_queue_are_both_capacity() {
    let g = gauge(2, 3, 1000);
    for _ in 0..5 {
        assert!(g.reserve(I, 1, 10).is_ok());
    }
    assert_eq!(
        g.reserve(I, 1, 10).unwrap_err().bound,
        QueueBound::Requests,
        "2 slots + 3 queued"
    );
    let first = g.started(I, 10);
    let _second = g.started(I, 10);
    assert_eq!(g.queued_requests(I), 3);
    drop(first);
    assert!(
        g.reserve(I, 1, 10).is_ok(),
        "a finished request frees its place"
    );
}

#[test]
fn the_token_budget_bounds_the_prompts_ahead_of_one_that_must_wait() {
    let g = gauge(1, 3, 1000);
    assert!(
        g.reserve(I, 1, 5000).is_ok(),
        "a free slot takes any prompt that fits the context"
    );
    let _running = g.started(I, 5000);
    assert!(g.reserve(I, 1, 600).is_ok());
    assert!(
        g.reserve(I, 1, 900).is_ok(),
        "600 ahead of it: its own 900 are its service, not its wait"
    );
    assert_eq!(g.queued_tokens(I), 1500);
    let r = g.reserve(I, 1, 1).unwrap_err();
    assert_eq!(r.bound, QueueBound::Tokens, "1500 ahead > 1000");
    assert_eq!(r.waiting_tokens, 1500);
    assert_eq!(
        g.check(I).unwrap_err().bound,
        QueueBound::Tokens,
        "the door's check, without a prompt, says the same"
    );
    // The 600 get the slot: 900 ahead, within the budget again.
    drop(_running);
    let _next = g.started(I, 600);
    assert!(g.check(I).is_ok());
    assert!(g.reserve(I, 1, 0).is_ok());
    assert!(g.reserve(I, 1, 0).is_ok(), "a third may wait");
    assert_eq!(
        g.reserve(I, 1, 0).unwrap_err().bound,
        QueueBound::Requests,
        "1 running + 3 waiting"
    );
}

#[test]
fn a_prompt_over_the_whole_budget_is_admitted_behind_a_short_queue() {
    let g = gauge(1, 3, 1000);
    assert!(g.reserve(I, 1, 10).is_ok());
    let first = g.started(I, 10);
    assert!(g.reserve(I, 1, 6000).is_ok(), "nothing waits: it may");
    assert_eq!(
        g.reserve(I, 1, 10).unwrap_err().bound,
        QueueBound::Tokens,
        "6000 ahead of it"
    );
    drop(first); // the first request ends
    let _long = g.started(I, 6000); // the long one gets the slot
    assert!(g.reserve(I, 1, 300).is_ok());
    assert!(
        g.reserve(I, 1, 6000).is_ok(),
        "300 ahead of it: it waits no longer than a short one would"
    );
}

#[test]
fn the_choices_of_one_request_are_admitted_together_or_not_at_all() {
    let g = gauge(1, 2, 1000);
    assert!(g.reserve(I, 1, 10).is_ok());
    let _running = g.started(I, 10);
    assert!(g.reserve(I, 1, 10).is_ok());
    assert!(g.check(I).is_ok(), "one place is left");
    assert_eq!(
        g.reserve(I, 2, 20).unwrap_err().bound,
        QueueBound::Requests,
        "two choices need two places"
    );
    assert_eq!(g.queued_requests(I), 1, "nothing of it stayed");
    assert_eq!(g.queued_tokens(I), 10);
    assert!(g.reserve(I, 1, 10).is_ok(), "one choice still fits");
    // With the slot free, two choices take it and one place.
    let g = gauge(1, 1, 1000);
    assert!(g.reserve(I, 2, 20).is_ok());
    assert!(g.reserve(I, 1, 1).is_err());
}

#[test]
fn the_live_bound_follows_the_measured_rates() {
    // Derived bounds: 1 slot, L_max = ceil(0.667 * 5) = 4.
    let g = new_gauge(1, 1, RATES, [policy(5000, None); 2]);
    assert_eq!(g.snapshot().1[0].queue_depth_max, 4);
    for _ in 0..5 {
        assert!(g.reserve(I, 1, 10).is_ok());
    }
    // The box got four times slower: L_max = ceil(0.167 * 5) = 1.
    g.set_rates(Rates {
        prefill_tok_s: 50.0,
        decode_tok_s: 37.5,
    });
    let b = g.snapshot().1[0];
    assert_eq!(b.queue_depth_max, 1);
    assert_eq!(b.queued_tokens_max, 250);
    let r = g.reserve(I, 1, 10).unwrap_err();
    assert_eq!(r.bound, QueueBound::Requests, "5 in, 1 + 1 allowed");
    assert_eq!(r.bounds.queue_depth_max, 1, "judged by the live bound");
    // And faster than ever: clamped to 9, never above the channel's ceiling.
    g.set_rates(Rates {
        prefill_tok_s: 5000.0,
        decode_tok_s: 3000.0,
    });
    assert_eq!(g.snapshot().1[0].queue_depth_max, 9);
    for _ in 0..5 {
        assert!(g.reserve(I, 1, 10).is_ok());
    }
    assert_eq!(
        g.reserve(I, 1, 10).unwrap_err().bound,
        QueueBound::Requests,
        "1 + 9"
    );
}

#[test]
fn the_bound_follows_the_mix_of_requests_that_complete() {
    // Seeded with 100 + 150 tokens: 1.5 s per request, L_max = ceil(0.667 * 5) = 4.
    let g = new_gauge(1, 1, RATES, [policy(5000, None); 2]);
    assert_eq!(g.snapshot().1[0].queue_depth_max, 4);
    // Requests of 40 prefilled + 30 generated tokens: 0.4 s each, L_max 13 -> 9.
    for _ in 0..200 {
        g.observe_request(40, 30);
    }
    assert_eq!(
        g.typical(),
        Typical {
            prompt_tokens: 40,
            max_tokens: 30
        }
    );
    assert_eq!(g.snapshot().1[0].queue_depth_max, 9);
    // Then long answers: 0 + 600 tokens, 4 s each: L_max 2.
    for _ in 0..200 {
        g.observe_request(0, 600);
    }
    assert_eq!(g.snapshot().1[0].queue_depth_max, 2);
    // The operator's depth is never overridden.
    let g = new_gauge(1, 1, RATES, [policy(5000, Some(3)); 2]);
    g.observe_request(1, 1);
    assert_eq!(g.snapshot().1[0].queue_depth_max, 3);
}

#[test]
fn each_class_has_its_own_queue_and_batch_leaves_the_reserved_slots_free() {
    // 3 slots, batch may hold 2 of them; L_max 2 for each class.
    let p = policy(5000, Some(2));
    let g = new_gauge(3, 2, RATES, [p, p]);
    for _ in 0..4 {
        assert!(g.reserve(B, 1, 10).is_ok(), "2 batch slots + 2 waiting");
    }
    assert_eq!(g.reserve(B, 1, 10).unwrap_err().bound, QueueBound::Requests);
    let _b1 = g.started(B, 10);
    let _b2 = g.started(B, 10);
    assert_eq!(
        g.reserve(B, 1, 10).unwrap_err().bound,
        QueueBound::Requests,
        "the third slot is not batch's"
    );
    for _ in 0..3 {
        assert!(g.reserve(I, 1, 10).is_ok(), "1 free slot + 2 waiting");
    }
    let r = g.reserve(I, 1, 10).unwrap_err();
    assert_eq!(r.bound, QueueBound::Requests);
    assert_eq!(r.waiting, 3, "batch waiting is not ahead of interactive");
    assert_eq!(g.queued_requests(I), 3);
    assert_eq!(g.queued_requests(B), 2);
    assert_eq!(g.retry_after_s(B), 8, "5 ahead of batch at 0.667/s");
}

#[test]
fn interactive_requests_waiting_take_the_free_slots_before_batch() {
    let p = policy(5000, Some(1));
    let g = new_gauge(2, 2, RATES, [p, p]);
    assert!(g.reserve(I, 1, 10).is_ok());
    assert!(g.reserve(I, 1, 10).is_ok());
    assert!(
        g.reserve(B, 1, 10).is_ok(),
        "no free slot left for it: it waits"
    );
    assert_eq!(
        g.reserve(B, 1, 10).unwrap_err().bound,
        QueueBound::Requests,
        "L_max 1 for batch"
    );
    g.dropped(B, 10);
    drop(g.started(I, 10));
    drop(g.started(I, 10));
    assert!(g.reserve(B, 1, 10).is_ok());
    assert!(g.reserve(B, 1, 10).is_ok());
    assert!(g.reserve(B, 1, 10).is_ok(), "2 free slots + 1 waiting");
}

#[test]
fn the_engine_reports_are_applied_in_order_before_the_next_judgement() {
    // One slot, nothing may wait: the engine's reports decide whether the
    // next request fits, and the gate applies them when it is taken.
    let g = gauge(1, 0, 1000);
    assert!(g.reserve(I, 1, 10).is_ok(), "the free slot");
    let slot = g.started(I, 10);
    assert!(g.reserve(I, 1, 10).is_err(), "the slot is taken");
    drop(slot); // sent before the next request is judged: applied first
    assert!(g.reserve(I, 1, 10).is_ok());
    g.reporter.dropped(I, 10);
    assert_eq!(g.queued_requests(I), 0);
    assert_eq!(g.queued_tokens(I), 0);
    // What the prefix cache and the running sequences hold, too.
    let prompt: Vec<crate::ffi::Token> = (0..40).collect();
    assert_eq!(g.reusable(&prompt), 0);
    g.reporter.prefix_cached(vec![prompt[..30].into()]);
    assert_eq!(g.reusable(&prompt), 30);
    g.reporter.prefix_cached(Vec::new());
    g.reporter.prefix_running(2, prompt[..20].into());
    assert_eq!(g.reusable(&prompt), 20);
    g.reporter.prefix_ended(2);
    assert_eq!(g.reusable(&prompt), 0);
    assert_eq!(
        g.reporter
            .metrics
            .admission_reports_lost
            .load(Ordering::Relaxed),
        0
    );
}

#[test]
fn every_report_of_the_requests_alive_fits_the_channel() {
    // The wiring's capacity: 4 slots, a ceiling of 9 per class.
    let policies = [policy(5000, None); 2];
    let metrics = Arc::new(Metrics::default());
    let (admission, _jobs, gauge, reporter) =
        Admission::new(4, 4, RATES, policies, Arc::clone(&metrics));
    let alive = 4 + 2 * (4 + 9);
    // Every request alive reports its whole life (10 reports, more than the
    // engine sends for one) without the gate being taken: the engine never
    // finds the channel full.
    for _ in 0..alive {
        drop(reporter.started(I, 1));
        reporter.observe_request(1, 1);
        reporter.prefix_running(0, vec![1, 2, 3].into());
        reporter.prefix_ended(0);
        reporter.prefix_cached(Vec::new());
        reporter.prefix_running(1, vec![1].into());
        reporter.prefix_ended(1);
        reporter.prefix_cached(Vec::new());
        reporter.prefix_cached(Vec::new());
    }
    assert_eq!(metrics.admission_reports_lost.load(Ordering::Relaxed), 0);
    drop((admission, gauge));
}

#[test]
fn the_first_token_forecast_is_the_wait_for_a_slot_then_the_prefill_ahead_and_own() {
    let g = gauge(1, 3, 100_000);
    let (rates, bounds) = g.snapshot();
    let prefill = |tokens: f64| tokens / rates.prefill_tok_s;
    let close = |d: Duration, s: f64| (d.as_secs_f64() - s).abs() < 1e-3;
    // A free slot: its own prompt only.
    assert!(close(g.first_token_forecast(I, 200), prefill(200.0)));
    // The slot taken, one of 300 tokens waiting: two leave before it starts,
    // then both prompts are prefilled.
    assert!(g.reserve(I, 1, 50).is_ok());
    let _running = g.started(I, 50);
    assert!(g.reserve(I, 1, 300).is_ok());
    let slot_wait = 2.0 / bounds[I.index()].mu_req;
    assert!(close(
        g.first_token_forecast(I, 200),
        slot_wait + prefill(500.0)
    ));
}

/// Four slots, W_max 5 s, the bounds derived (L_max at least the slots).
fn four_slots_derived() -> Both {
    let p = Policy {
        queue_depth_min: 4,
        ..policy(5000, None)
    };
    new_gauge(4, 4, RATES, [p, p])
}

#[test]
fn a_closed_loop_of_twice_the_slots_is_never_refused_on_tokens() {
    // The derived budget (μ_prefill · W_max = 200 tok/s · 5 s = 1000), four
    // slots, L_max at its floor of four: eight clients that each send again
    // only when answered can never have more than four waiting, so none of
    // them is refused, however long their prompts.
    let g = four_slots_derived();
    let (_, [b, _]) = g.snapshot();
    assert_eq!((b.queue_depth_max, b.queued_tokens_max), (4, 1000));
    let mut running: Vec<Slot> = Vec::new();
    for round in 0..3 {
        while g.queued_requests(I) + running.len() < 8 {
            assert!(g.check(I).is_ok(), "round {round}: the door");
            assert!(g.reserve(I, 1, 900).is_ok(), "round {round}");
        }
        while running.len() < 4 {
            running.push(g.started(I, 900));
        }
        assert_eq!(g.queued_tokens(I), 3600, "four 900-token prompts wait");
        // Two answers come back; their clients send again.
        running.truncate(2);
    }
    // With room for six waiting, a fifth waits behind more than one request
    // per slot: the budget judges it by the 3,600 tokens ahead.
    let p = Policy {
        queue_depth_min: 4,
        ..policy(5000, Some(6))
    };
    let g = new_gauge(4, 4, RATES, [p, p]);
    for _ in 0..8 {
        assert!(g.reserve(I, 1, 900).is_ok());
    }
    let _running: Vec<Slot> = (0..4).map(|_| g.started(I, 900)).collect();
    let r = g.reserve(I, 1, 10).unwrap_err();
    assert_eq!(r.bound, QueueBound::Tokens);
    assert_eq!(r.waiting_tokens, 3600);
}

#[test]
fn after_a_refusal_the_queue_holds_only_what_meets_w_max_until_w_max_passes_without_one() {
    // Four slots, the derived bounds: L_max 4 (the slots' floor), 3 pressed
    // (floor(0.667 req/s · (5 s − 0.5 s of a typical prompt))).
    let g = four_slots_derived();
    let t0 = Instant::now();
    // A request of more choices than the slots and the queue hold is refused
    // on an idle server: that says nothing about the load.
    assert!(g.reserve(I, 9, 9).is_err());
    assert_eq!(g.pressed(), [false, false]);
    assert!(g.check_at(I, t0).is_ok());
    // Four run, four wait: a closed loop of eight fits, and nothing presses.
    for _ in 0..8 {
        assert!(g.reserve(I, 1, 10).is_ok());
    }
    let mut running: Vec<Slot> = (0..4).map(|_| g.started(I, 10)).collect();
    assert_eq!(g.pressed(), [false, false]);
    // A ninth is refused: more arrive than the slots and the queue hold.
    let r = g.reserve(I, 1, 10).unwrap_err();
    assert_eq!(
        (r.bound, r.bounds.queue_depth_max),
        (QueueBound::Requests, 4)
    );
    assert_eq!(g.pressed(), [true, false], "only its own class");
    assert_eq!(g.snapshot().1[I.index()].queue_depth_max, 3);
    // One leaves the queue for a slot: three wait, and a newcomer would be
    // the fourth, past what meets W_max.
    running.truncate(3);
    running.push(g.started(I, 10));
    let r = g.reserve(I, 1, 10).unwrap_err();
    assert_eq!(
        (r.bound, r.bounds.queue_depth_max),
        (QueueBound::Requests, 3)
    );
    running.truncate(3);
    running.push(g.started(I, 10));
    assert!(g.reserve(I, 1, 10).is_ok(), "the third waiting one");
    // W_max after the last refusal, the slots' floor is back.
    let last_refusal = Instant::now();
    assert!(g
        .check_at(I, last_refusal + Duration::from_millis(4900))
        .is_err());
    assert!(g
        .check_at(
            I,
            last_refusal + Duration::from_millis(4900) + Duration::from_millis(5100)
        )
        .is_ok());
}
