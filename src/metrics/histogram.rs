//! Latency histograms as Prometheus has them: fixed buckets (upper bounds
//! in seconds) counted with atomics, their sum and count.

use crate::priority::Class;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Bucket bounds in seconds. Time to first token and prefill: from a short
/// chat on an idle box (~0.1 s) to a 6k-token prompt behind others (~40 s)
/// and the request timeout's range.
pub const TTFT_BUCKETS: &[f64] = &[
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
];
/// Between two tokens: around the 150 ms ITL target, finer below it.
pub const ITL_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
];
/// Queue wait: the sojourn targets (tens of ms) to W_max (seconds).
pub const QUEUE_WAIT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
/// A whole request: a few tokens to a few thousand.
pub const REQUEST_BUCKETS: &[f64] = &[
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
];
/// One engine step: a decode pass (~10 ms) to a full prefill chunk.
pub const STEP_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
];

/// A Prometheus histogram: observations counted in fixed buckets (upper
/// bounds in seconds, increasing; one more for +Inf), their sum and count.
pub struct Buckets {
    bounds: &'static [f64],
    /// Observations in each bucket alone (not cumulative), +Inf last.
    counts: Vec<AtomicU64>,
    sum_us: AtomicU64,
}

impl Buckets {
    pub fn new(bounds: &'static [f64]) -> Buckets {
        debug_assert!(bounds.windows(2).all(|w| w[0] < w[1]), "increasing bounds");
        Buckets {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_us: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let i = self.bounds.partition_point(|&b| b < s);
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_us
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    /// Cumulative counts per bound (+Inf last: the count), and the sum in
    /// seconds.
    pub fn snapshot(&self) -> (Vec<u64>, f64) {
        let mut total = 0;
        let cumulative = self
            .counts
            .iter()
            .map(|c| {
                total += c.load(Ordering::Relaxed);
                total
            })
            .collect();
        (cumulative, self.sum_us.load(Ordering::Relaxed) as f64 / 1e6)
    }

    pub fn bounds(&self) -> &'static [f64] {
        self.bounds
    }

    /// The `_bucket`, `_sum` and `_count` lines, with `labels` (e.g.
    /// `class="batch"`, or empty) on each.
    pub(super) fn render(&self, out: &mut String, name: &str, labels: &str) {
        let (cumulative, sum) = self.snapshot();
        let sep = if labels.is_empty() { "" } else { "," };
        for (i, c) in cumulative.iter().enumerate() {
            let le = match self.bounds.get(i) {
                Some(b) => format!("{b}"),
                None => "+Inf".to_string(),
            };
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{le}\"}} {c}");
        }
        let count = cumulative.last().copied().unwrap_or(0);
        let braces = |l: &str| match l.is_empty() {
            true => String::new(),
            false => format!("{{{l}}}"),
        };
        let _ = writeln!(out, "{name}_sum{} {sum}", braces(labels));
        let _ = writeln!(out, "{name}_count{} {count}", braces(labels));
    }
}

/// A histogram per priority class.
pub struct ClassBuckets([Buckets; Class::COUNT]);

impl ClassBuckets {
    pub(super) fn new(bounds: &'static [f64]) -> ClassBuckets {
        ClassBuckets(Class::ALL.map(|_| Buckets::new(bounds)))
    }

    pub fn class(&self, c: Class) -> &Buckets {
        &self.0[c.index()]
    }

    pub(super) fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for c in Class::ALL {
            self.class(c)
                .render(out, name, &format!("class=\"{}\"", c.as_str()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_histogram_counts_each_observation_in_its_bucket_cumulatively() {
        let h = Buckets::new(&[0.1, 1.0]);
        for ms in [50, 100, 150, 2_000] {
            h.observe(Duration::from_millis(ms));
        }
        // le=0.1 holds 50 and 100 ms (a bound is inclusive), le=1 adds 150.
        let (cumulative, sum) = h.snapshot();
        assert_eq!(cumulative, vec![2, 3, 4]);
        assert!((sum - 2.3).abs() < 1e-9);
        let mut out = String::new();
        h.render(&mut out, "x_seconds", "class=\"batch\"");
        assert_eq!(
            out,
            "x_seconds_bucket{class=\"batch\",le=\"0.1\"} 2\n\
             x_seconds_bucket{class=\"batch\",le=\"1\"} 3\n\
             x_seconds_bucket{class=\"batch\",le=\"+Inf\"} 4\n\
             x_seconds_sum{class=\"batch\"} 2.3\n\
             x_seconds_count{class=\"batch\"} 4\n"
        );
        let mut bare = String::new();
        Buckets::new(&[1.0]).render(&mut bare, "y", "");
        assert_eq!(
            bare,
            "y_bucket{le=\"1\"} 0\ny_bucket{le=\"+Inf\"} 0\ny_sum 0\ny_count 0\n"
        );
    }

    #[test]
    fn every_latency_histogram_has_increasing_bounds() {
        for b in [
            TTFT_BUCKETS,
            ITL_BUCKETS,
            QUEUE_WAIT_BUCKETS,
            REQUEST_BUCKETS,
            STEP_BUCKETS,
        ] {
            assert!(b.windows(2).all(|w| w[0] < w[1]), "{b:?}");
        }
    }
}
