//! Shed on delay, not on depth: CoDel on queue sojourn time.
//!
//! Queue length means nothing without the service rate that drains it; how long
//! requests have waited is directly comparable to the time-to-first-token
//! budget. When the sojourn of every request leaving the queue has stayed above
//! `target` for a whole `interval` (a standing queue, not a burst), the engine
//! enters the shedding state and refuses each request whose sojourn exceeds the
//! target (503 + Retry-After), until one leaves below target or the queue empties.
//! While shedding, the server is not ready (`/readyz` 503), so a load balancer
//! sends its traffic elsewhere.

use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Admit,
    Shed,
}

#[derive(Debug, Clone)]
pub struct Codel {
    target: Duration,
    interval: Duration,
    /// When the sojourn first went above target, plus `interval`: the time at
    /// which, still above target, the queue counts as standing.
    above_until: Option<Instant>,
    shedding: bool,
}

impl Codel {
    pub fn new(target: Duration, interval: Duration) -> Codel {
        assert!(!target.is_zero() && !interval.is_zero());
        Codel {
            target,
            interval,
            above_until: None,
            shedding: false,
        }
    }

    /// A request leaves the queue after waiting `sojourn`.
    pub fn on_dequeue(&mut self, sojourn: Duration, now: Instant) -> Verdict {
        if sojourn < self.target {
            self.reset();
            return Verdict::Admit;
        }
        match self.above_until {
            None => {
                self.above_until = Some(now + self.interval);
                Verdict::Admit
            }
            Some(t) if now >= t => {
                self.shedding = true;
                Verdict::Shed
            }
            Some(_) if self.shedding => Verdict::Shed,
            Some(_) => Verdict::Admit,
        }
    }

    /// Nothing is waiting: whatever stood has drained.
    pub fn on_empty(&mut self) {
        self.reset();
    }

    pub fn is_shedding(&self) -> bool {
        self.shedding
    }

    /// Requests are leaving the queue above target (shedding or not yet): the
    /// server should not be sent more work.
    pub fn is_above_target(&self) -> bool {
        self.above_until.is_some()
    }

    fn reset(&mut self) {
        self.above_until = None;
        self.shedding = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_burst_above_target_shorter_than_the_interval_is_not_shed() {
        let t0 = Instant::now();
        let mut c = Codel::new(ms(500), ms(1000));
        assert_eq!(c.on_dequeue(ms(800), t0), Verdict::Admit);
        assert!(c.is_above_target() && !c.is_shedding());
        assert_eq!(c.on_dequeue(ms(900), t0 + ms(600)), Verdict::Admit);
        assert_eq!(
            c.on_dequeue(ms(100), t0 + ms(900)),
            Verdict::Admit,
            "below target: resets"
        );
        assert_eq!(
            c.on_dequeue(ms(800), t0 + ms(1500)),
            Verdict::Admit,
            "a new interval starts"
        );
        assert!(!c.is_shedding());
    }

    #[test]
    fn a_standing_queue_is_shed_until_a_request_leaves_below_target() {
        let t0 = Instant::now();
        let mut c = Codel::new(ms(500), ms(1000));
        assert_eq!(c.on_dequeue(ms(700), t0), Verdict::Admit);
        assert_eq!(c.on_dequeue(ms(700), t0 + ms(999)), Verdict::Admit);
        assert_eq!(
            c.on_dequeue(ms(700), t0 + ms(1000)),
            Verdict::Shed,
            "above target for a whole interval"
        );
        assert!(c.is_shedding());
        assert_eq!(c.on_dequeue(ms(600), t0 + ms(1100)), Verdict::Shed);
        assert_eq!(
            c.on_dequeue(ms(200), t0 + ms(1200)),
            Verdict::Admit,
            "below target again"
        );
        assert!(!c.is_shedding());
    }

    #[test]
    fn an_empty_queue_ends_shedding() {
        let t0 = Instant::now();
        let mut c = Codel::new(ms(500), ms(1000));
        c.on_dequeue(ms(700), t0);
        assert_eq!(c.on_dequeue(ms(700), t0 + ms(2000)), Verdict::Shed);
        c.on_empty();
        assert!(!c.is_shedding() && !c.is_above_target());
        assert_eq!(
            c.on_dequeue(ms(700), t0 + ms(2100)),
            Verdict::Admit,
            "a fresh interval"
        );
    }
}
