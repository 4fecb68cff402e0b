//! Arrival processes and a small seeded random number generator.
//!
//! Open-loop load is the honest one for overload: arrivals keep coming at rate λ
//! whatever the server does, as real users do, so queueing shows up as latency
//! or refusals instead of being hidden by clients that wait for each other.

use std::time::Duration;

/// SplitMix64: tiny, fast, and good enough for load generation; seeded so that a
/// run's arrivals and workload can be reproduced exactly.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform integer in [lo, hi].
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        assert!(lo <= hi);
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// Exponentially distributed with the given mean.
    pub fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.next_f64()).ln()
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.next_f64() < p
    }
}

/// One phase of a load schedule: a constant arrival rate for a while.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Phase {
    pub rate_per_s: f64,
    pub duration: Duration,
}

/// Poisson arrival times (offsets from the start) for consecutive phases.
/// Returns `(offset, phase index)` pairs in order.
pub fn poisson_schedule(phases: &[Phase], seed: u64) -> Vec<(Duration, usize)> {
    let mut rng = Rng::new(seed);
    let mut out = Vec::new();
    let mut phase_start = 0.0;
    for (i, p) in phases.iter().enumerate() {
        assert!(p.rate_per_s > 0.0, "arrival rate must be positive");
        let end = phase_start + p.duration.as_secs_f64();
        let mut t = phase_start;
        loop {
            t += rng.exp(1.0 / p.rate_per_s);
            if t >= end {
                break;
            }
            out.push((Duration::from_secs_f64(t), i));
        }
        phase_start = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_rate_is_right_over_many_arrivals() {
        let phases = [Phase {
            rate_per_s: 5.0,
            duration: Duration::from_secs(4000),
        }];
        let s = poisson_schedule(&phases, 42);
        let rate = s.len() as f64 / 4000.0;
        assert!((rate - 5.0).abs() < 0.1, "rate {rate}");
        // Inter-arrival gaps of a Poisson process: mean 1/λ, and as many gaps
        // above the mean as e^-1 of them.
        let gaps: Vec<f64> = s
            .windows(2)
            .map(|w| (w[1].0 - w[0].0).as_secs_f64())
            .collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        assert!((mean - 0.2).abs() < 0.005, "mean gap {mean}");
        let above = gaps.iter().filter(|&&g| g > 0.2).count() as f64 / gaps.len() as f64;
        assert!(
            (above - (-1.0f64).exp()).abs() < 0.01,
            "share above mean {above}"
        );
    }

    #[test]
    fn schedules_are_reproducible_from_the_seed() {
        let phases = [Phase {
            rate_per_s: 2.0,
            duration: Duration::from_secs(60),
        }];
        assert_eq!(poisson_schedule(&phases, 7), poisson_schedule(&phases, 7));
        assert_ne!(poisson_schedule(&phases, 7), poisson_schedule(&phases, 8));
    }

    #[test]
    fn phases_follow_each_other_with_their_own_rates() {
        let phases = [
            Phase {
                rate_per_s: 1.0,
                duration: Duration::from_secs(1000),
            },
            Phase {
                rate_per_s: 4.0,
                duration: Duration::from_secs(1000),
            },
        ];
        let s = poisson_schedule(&phases, 3);
        let first = s.iter().filter(|(_, p)| *p == 0).count() as f64;
        let second = s.iter().filter(|(_, p)| *p == 1).count() as f64;
        assert!((first / 1000.0 - 1.0).abs() < 0.1);
        assert!((second / 1000.0 - 4.0).abs() < 0.2);
        assert!(s
            .iter()
            .all(|(t, p)| (*p == 0) == (t.as_secs_f64() < 1000.0)));
        assert!(s.windows(2).all(|w| w[0].0 <= w[1].0));
    }
}
