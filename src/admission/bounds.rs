//! The bounds, pure: Little's law from the measured rates and the request
//! mix (L_max = ceil(μ_req · W_max), the token budget μ_prefill · W_max), and
//! the Retry-After a refused client is told.

use std::time::Duration;

/// The design's ceiling on a derived queue: deeper queues only turn refusals
/// into waits past any useful budget on a CPU box.
pub const QUEUE_DEPTH_SAFE_MAX: usize = 9;
/// Shortest wait a refused client is told to observe.
pub const RETRY_AFTER_S_MIN: u64 = 1;

/// Service rates of this machine (measured at start-up, or given with `--mu-*`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rates {
    pub prefill_tok_s: f64,
    /// Aggregate decode rate with `--parallel` sequences running.
    pub decode_tok_s: f64,
}

/// The admission bounds derived from the rates and the budget.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bounds {
    /// Requests per second this box serves for the typical request.
    pub mu_req: f64,
    /// Most requests waiting for a slot.
    pub queue_depth_max: usize,
    /// Most prompt tokens that may wait ahead of a request that must wait
    /// for a slot.
    pub queued_tokens_max: usize,
    /// Requests that may wait for a slot whatever their prompts: the token
    /// budget judges only one that would wait behind more of them. With a
    /// derived budget, the slots' floor of L_max (`Policy::queue_depth_min`):
    /// a closed loop of twice the slots' clients is never refused on
    /// tokens either; with the operator's `--queued-tokens-max`, none.
    pub token_free_waiting: usize,
    /// Most requests waiting for a slot while the door is refusing (arrivals
    /// beyond what the slots and the queue hold: open-loop overload, not a
    /// closed loop): derived, `floor(μ_req · (W_max − a typical prompt's
    /// prefill))`, at least one, so that the last one admitted still gets
    /// its first token within W_max; the operator's `--queue-depth` stays.
    pub queue_depth_pressed: usize,
}

impl Bounds {
    /// The bounds while the door is refusing: the queue holds only what keeps
    /// a typical first token within W_max, without the slots' floor, and the
    /// token budget judges every request that waits.
    pub fn pressed(self) -> Bounds {
        Bounds {
            queue_depth_max: self.queue_depth_pressed,
            token_free_waiting: 0,
            ..self
        }
    }
}

/// What the typical request costs: prompt tokens prefilled and tokens
/// generated. Seeded by `--typical-prompt-tokens` and `--typical-max-tokens`,
/// then learned from the requests that complete ([`Mix`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Typical {
    pub prompt_tokens: usize,
    pub max_tokens: usize,
}

/// Weight of one completed request in the learned mix: about the last 1/w
/// requests count.
const MIX_WEIGHT: f64 = 1.0 / 16.0;

/// The request mix as it arrives: running means of the prompt tokens each
/// completed request had prefilled (what the prefix cache did not hold) and of
/// the tokens it generated, starting from the configured typical request.
/// Pure.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mix {
    prompt_tokens: f64,
    generated_tokens: f64,
}

impl Mix {
    pub fn new(seed: Typical) -> Mix {
        Mix {
            prompt_tokens: seed.prompt_tokens as f64,
            generated_tokens: seed.max_tokens as f64,
        }
    }

    pub fn observe(&mut self, prompt_tokens: usize, generated_tokens: usize) {
        self.prompt_tokens += MIX_WEIGHT * (prompt_tokens as f64 - self.prompt_tokens);
        self.generated_tokens += MIX_WEIGHT * (generated_tokens as f64 - self.generated_tokens);
    }

    pub fn typical(&self) -> Typical {
        Typical {
            prompt_tokens: self.prompt_tokens.round() as usize,
            // At least one token: a request that generates nothing still costs a step.
            max_tokens: (self.generated_tokens.round() as usize).max(1),
        }
    }
}

/// Request service rate: the box is compute-bound, so one typical request costs
/// its prefill time plus its share of decode time, and μ_req is the inverse.
pub fn mu_req(rates: Rates, typical: Typical) -> f64 {
    let seconds = typical.prompt_tokens as f64 / rates.prefill_tok_s
        + typical.max_tokens as f64 / rates.decode_tok_s;
    1.0 / seconds
}

/// How the bounds are derived from the rates: the budget, the typical request,
/// and what the operator fixed by hand.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Policy {
    pub typical: Typical,
    /// W_max (`--queue-wait-ms`).
    pub queue_wait: Duration,
    /// `--queue-depth`: a fixed L_max instead of the derived one (already checked
    /// against 9, or against the unsafe ceiling with `--queue-depth-unsafe`).
    pub queue_depth: Option<usize>,
    /// The least derived L_max: the slots the class may hold. A queue of one
    /// request per slot keeps every slot busy across a turnover, and each of
    /// them waits at most about one request's service time; so a closed loop
    /// of twice the slots' clients is never refused. (Below the ceiling.)
    pub queue_depth_min: usize,
    /// `--queued-tokens-max`: a fixed token budget instead of `μ_prefill · W_max`.
    pub queued_tokens_max: Option<usize>,
}

impl Policy {
    /// The highest L_max the gate may ever allow: the channel's capacity beyond
    /// the slots, and the number of handlers that may wait on it.
    pub fn queue_depth_ceiling(&self) -> usize {
        self.queue_depth.unwrap_or(QUEUE_DEPTH_SAFE_MAX)
    }
}

/// `L_max = ceil(μ_req · W_max)` clamped to the slots (`queue_depth_min`) and
/// 9, unless the operator set a depth; and the queued-token budget
/// `μ_prefill · W_max`, judged only beyond one waiting request per slot,
/// unless the operator set one. Under pressure (`Bounds::pressed`), no floor:
/// `floor(μ_req · (W_max − own prefill))` of a typical request.
pub fn derive_bounds(rates: Rates, policy: &Policy) -> Bounds {
    assert!(
        rates.prefill_tok_s > 0.0 && rates.decode_tok_s > 0.0,
        "rates must be positive"
    );
    let mu = mu_req(rates, policy.typical);
    let w = policy.queue_wait.as_secs_f64();
    let floor = policy.queue_depth_min.clamp(1, QUEUE_DEPTH_SAFE_MAX) as f64;
    let little = (mu * w).ceil().clamp(floor, QUEUE_DEPTH_SAFE_MAX as f64) as usize;
    let tokens = (rates.prefill_tok_s * w).floor().max(1.0) as usize;
    let queue_depth_max = policy.queue_depth.unwrap_or(little);
    // The last one admitted waits for that many completions, then prefills
    // its own prompt: both within W_max. (The epsilon keeps an exact product
    // from flooring one below.)
    let own_prefill_s = policy.typical.prompt_tokens as f64 / rates.prefill_tok_s;
    let pressed = (mu * (w - own_prefill_s) + 1e-9).floor().max(1.0) as usize;
    Bounds {
        mu_req: mu,
        queue_depth_max,
        queued_tokens_max: policy.queued_tokens_max.unwrap_or(tokens),
        token_free_waiting: match policy.queued_tokens_max {
            Some(_) => 0,
            None => policy.queue_depth_min.min(queue_depth_max),
        },
        queue_depth_pressed: policy.queue_depth.unwrap_or(pressed.min(queue_depth_max)),
    }
}

/// Seconds until the queued work ahead would be done: requests ÷ μ_req, or
/// tokens ÷ μ_prefill, whichever is longer; at least one second, rounded up.
pub fn retry_after_s(queued: usize, queued_tokens: usize, rates: Rates, bounds: Bounds) -> u64 {
    let by_count = queued as f64 / bounds.mu_req;
    let by_tokens = queued_tokens as f64 / rates.prefill_tok_s;
    (by_count.max(by_tokens).ceil() as u64).max(RETRY_AFTER_S_MIN)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// The rates and the typical request the admission tests judge by.
    pub const RATES: Rates = Rates {
        prefill_tok_s: 200.0,
        decode_tok_s: 150.0,
    };
    pub const TYPICAL: Typical = Typical {
        prompt_tokens: 100,
        max_tokens: 150,
    };

    pub fn policy(wait_ms: u64, depth: Option<usize>) -> Policy {
        Policy {
            typical: TYPICAL,
            queue_wait: Duration::from_millis(wait_ms),
            queue_depth: depth,
            queue_depth_min: 1,
            queued_tokens_max: None,
        }
    }

    #[test]
    fn mu_req_is_the_inverse_of_a_typical_request_time() {
        // 100 / 200 + 150 / 150 = 1.5 s per request.
        assert!((mu_req(RATES, TYPICAL) - 1.0 / 1.5).abs() < 1e-9);
    }

    #[test]
    fn queue_depth_follows_littles_law_and_is_clamped() {
        let b = derive_bounds(RATES, &policy(5000, None));
        assert_eq!(b.queue_depth_max, 4, "ceil(0.667 * 5) = 4");
        assert_eq!(b.queued_tokens_max, 1000, "200 tok/s * 5 s");
        let b = derive_bounds(RATES, &policy(100, None));
        assert_eq!(b.queue_depth_max, 1, "never below one");
        let four_slots = Policy {
            queue_depth_min: 4,
            ..policy(100, None)
        };
        let b = derive_bounds(RATES, &four_slots);
        assert_eq!(b.queue_depth_max, 4, "never below one waiting per slot");
        let many_slots = Policy {
            queue_depth_min: 64,
            ..policy(100, None)
        };
        let b = derive_bounds(RATES, &many_slots);
        assert_eq!(b.queue_depth_max, 9, "the floor stays below the ceiling");
        let fast = Rates {
            prefill_tok_s: 5000.0,
            decode_tok_s: 3000.0,
        };
        let b = derive_bounds(fast, &policy(5000, None));
        assert_eq!(
            b.queue_depth_max, 9,
            "ceil(14.29 * 5) clamped to the safe ceiling"
        );
        let b = derive_bounds(RATES, &policy(5000, Some(3)));
        assert_eq!(b.queue_depth_max, 3, "the operator's depth wins");
        let b = derive_bounds(fast, &policy(5000, Some(50)));
        assert_eq!(
            b.queue_depth_max, 50,
            "config checked it against the unsafe ceiling"
        );
        let p = Policy {
            queued_tokens_max: Some(123),
            ..policy(5000, None)
        };
        assert_eq!(derive_bounds(RATES, &p).queued_tokens_max, 123);
    }

    #[test]
    fn the_token_budget_spares_one_waiting_request_per_slot_unless_the_operator_set_it() {
        let four_slots = Policy {
            queue_depth_min: 4,
            ..policy(5000, None)
        };
        assert_eq!(derive_bounds(RATES, &four_slots).token_free_waiting, 4);
        let shallow = Policy {
            queue_depth_min: 4,
            ..policy(5000, Some(2))
        };
        assert_eq!(
            derive_bounds(RATES, &shallow).token_free_waiting,
            2,
            "no more than may wait at all"
        );
        let explicit = Policy {
            queue_depth_min: 4,
            queued_tokens_max: Some(500),
            ..policy(5000, None)
        };
        assert_eq!(
            derive_bounds(RATES, &explicit).token_free_waiting,
            0,
            "the operator's budget judges every request that waits"
        );
    }

    #[test]
    fn under_pressure_the_queue_holds_what_keeps_a_typical_first_token_within_w_max() {
        let four_slots = Policy {
            queue_depth_min: 4,
            ..policy(5000, None)
        };
        // 0.667 requests/s; a typical 100-token prompt prefills in 0.5 s:
        // floor(0.667 · 4.5) = 3, not the slots' floor of 4.
        let b = derive_bounds(RATES, &four_slots);
        assert_eq!((b.queue_depth_max, b.queue_depth_pressed), (4, 3));
        let p = b.pressed();
        assert_eq!((p.queue_depth_max, p.token_free_waiting), (3, 0));
        assert_eq!(p.queued_tokens_max, b.queued_tokens_max);
        // A typical prompt that alone takes W_max: still one may wait.
        let long = Policy {
            typical: Typical {
                prompt_tokens: 2000,
                max_tokens: 10,
            },
            ..four_slots
        };
        assert_eq!(derive_bounds(RATES, &long).queue_depth_pressed, 1);
        // Never above the calm bound; the operator's depth stays as set.
        let fast = Rates {
            prefill_tok_s: 5000.0,
            decode_tok_s: 3000.0,
        };
        let b = derive_bounds(fast, &policy(5000, None));
        assert_eq!((b.queue_depth_max, b.queue_depth_pressed), (9, 9));
        let b = derive_bounds(RATES, &policy(5000, Some(6)));
        assert_eq!(b.queue_depth_pressed, 6);
    }

    #[test]
    fn the_channel_is_sized_for_the_highest_bound_the_gate_may_allow() {
        assert_eq!(policy(5000, None).queue_depth_ceiling(), 9);
        assert_eq!(policy(5000, Some(3)).queue_depth_ceiling(), 3);
        assert_eq!(policy(5000, Some(1000)).queue_depth_ceiling(), 1000);
    }

    #[test]
    fn retry_after_covers_the_longer_of_count_and_token_work() {
        let b = derive_bounds(RATES, &policy(5000, None));
        assert_eq!(retry_after_s(0, 0, RATES, b), 1, "at least one second");
        assert_eq!(retry_after_s(4, 0, RATES, b), 6, "4 requests at 0.667/s");
        assert_eq!(
            retry_after_s(1, 1000, RATES, b),
            5,
            "1000 tokens at 200 tok/s"
        );
    }

    #[test]
    fn one_request_moves_the_mix_by_a_sixteenth() {
        let mut m = Mix::new(Typical {
            prompt_tokens: 160,
            max_tokens: 160,
        });
        m.observe(0, 0);
        assert_eq!(
            m.typical(),
            Typical {
                prompt_tokens: 150,
                max_tokens: 150
            }
        );
    }
}
