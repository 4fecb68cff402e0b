//! Steal time: how long the host took the box's virtual CPUs away from it.
//!
//! On a virtual machine a vCPU may be descheduled by the host while the guest
//! has work for it; Linux counts that time per CPU as *steal* (`/proc/stat`,
//! the eighth value of each `cpuN` line, in ticks of 10 ms). A server whose
//! compute threads are pinned one per CPU waits at every barrier of a pass for
//! the thread that was taken away, so one steal of 100 ms makes one step, and
//! the stream gap around it, 100 ms longer whatever the server does. The
//! head-of-line figure samples it, so that such a gap can be told from the
//! server's own (on the 2-core Xeon VM of session 50, the streams' 215-222 ms
//! gaps beside a long prompt were each one pass stretched by ~100 ms, and the
//! one sampled lined up with 100 ms of steal on one CPU).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One tick of `/proc/stat`, in milliseconds (USER_HZ is 100 on Linux).
pub const TICK_MS: f64 = 10.0;
/// How often the sampler reads `/proc/stat`.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(50);
/// Most samples kept: 10 minutes at `SAMPLE_EVERY`; later ones are dropped.
pub const SAMPLES_MAX: usize = 12_000;

/// Each CPU's steal ticks from the text of `/proc/stat` (the `cpuN` lines, in
/// their order; the summary `cpu` line is left out). Empty when none parse.
pub fn parse(stat: &str) -> Vec<u64> {
    stat.lines()
        .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
        .filter_map(|l| l.split_whitespace().nth(8)?.parse().ok())
        .collect()
}

fn read() -> Option<Vec<u64>> {
    let v = parse(&std::fs::read_to_string("/proc/stat").ok()?);
    (!v.is_empty()).then_some(v)
}

/// Steal samples: seconds since the run's start, each CPU's ticks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Samples(pub Vec<(f64, Vec<u64>)>);

impl Samples {
    /// Steal (ms, all CPUs) from the last sample at or before `a` to the first
    /// at or after `b`: what overlapped `[a, b]`, give or take one sampling
    /// interval each side. None without samples that span it.
    pub fn within(&self, a: f64, b: f64) -> Option<f64> {
        let s = &self.0;
        let i = s.iter().rposition(|(t, _)| *t <= a)?;
        let j = s.iter().position(|(t, _)| *t >= b)?;
        let (x, y) = (&s[i].1, &s[j].1);
        let ticks: u64 = x.iter().zip(y).map(|(p, q)| q.saturating_sub(*p)).sum();
        Some(ticks as f64 * TICK_MS)
    }

    /// Every interval between two samples in which a CPU was stolen from:
    /// (its start, seconds; the CPU; milliseconds).
    pub fn events(&self) -> Vec<(f64, usize, f64)> {
        self.0
            .windows(2)
            .flat_map(|w| {
                let (t, x, y) = (w[0].0, &w[0].1, &w[1].1);
                x.iter()
                    .zip(y)
                    .enumerate()
                    .filter(|(_, (p, q))| q > p)
                    .map(move |(cpu, (p, q))| (t, cpu, (q - p) as f64 * TICK_MS))
            })
            .collect()
    }
}

/// Reads `/proc/stat` every `SAMPLE_EVERY` on a thread of its own until
/// `finish`. Where it cannot be read (not Linux), no samples.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<Samples>,
}

impl Sampler {
    /// Starts sampling; times are seconds since `origin`.
    pub fn start(origin: Instant) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let handle = std::thread::spawn(move || {
            let mut samples = Vec::new();
            loop {
                // The last sample is taken after `finish` asks: it closes
                // the interval the run ended in.
                let last = flag.load(Ordering::Relaxed);
                match read() {
                    Some(v) if samples.len() < SAMPLES_MAX => {
                        samples.push((origin.elapsed().as_secs_f64(), v));
                    }
                    Some(_) => {}
                    None => break,
                }
                if last {
                    break;
                }
                std::thread::sleep(SAMPLE_EVERY);
            }
            Samples(samples)
        });
        Sampler { stop, handle }
    }

    pub fn finish(self) -> Samples {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.join().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_cpus_steal_is_the_eighth_value_of_its_line() {
        let stat = "cpu  10569427 1473 334353 2278395 15483 0 8922 3895 0 0\n\
                    cpu0 5257895 714 149136 1192069 2026 0 2709 1787 0 0\n\
                    cpu1 5311472 759 185216 1086326 13457 0 6213 2108 0 0\n\
                    intr 1 2 3\nctxt 42\ncpufreq 1\n";
        assert_eq!(parse(stat), vec![1787, 2108]);
        assert!(parse("intr 1 2\n").is_empty());
    }

    #[test]
    fn steal_within_an_interval_spans_the_samples_around_it() {
        let s = Samples(vec![
            (0.0, vec![0, 0]),
            (0.05, vec![0, 0]),
            (0.10, vec![10, 0]),
            (0.15, vec![10, 1]),
            (0.20, vec![10, 1]),
        ]);
        // [0.06, 0.12] lies within the samples at 0.05 and 0.15.
        assert_eq!(s.within(0.06, 0.12), Some(110.0));
        assert_eq!(s.within(0.15, 0.20), Some(0.0));
        assert_eq!(s.within(0.0, 0.30), None, "no sample after it");
        assert_eq!(s.events(), vec![(0.05, 0, 100.0), (0.10, 1, 10.0)]);
        assert_eq!(Samples::default().within(0.0, 1.0), None);
    }
}
