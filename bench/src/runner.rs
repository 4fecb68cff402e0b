//! Load models: open loop (Poisson arrivals, bounded client threads) and closed
//! loop (a fixed number of clients, each sending its next request when the last
//! one ends), with a progress line, target sampling and `/metrics` deltas.

use crate::arrivals::{poisson_schedule, Phase, Rng};
use crate::client::{run_request, Target};
use crate::plot::{Arrival, DepthSample};
use crate::stats::{Kind, Outcome, Slo, Stats};
use crate::workload::Workload;
use crossbeam_channel::{bounded, TrySendError};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often the progress line and the target's memory and threads are sampled.
const SAMPLE_INTERVAL: Duration = Duration::from_millis(250);
const PROGRESS_INTERVAL: Duration = Duration::from_secs(2);
/// How long `/metrics` may take to answer.
const METRICS_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Clone)]
pub struct RunConfig {
    pub target: Target,
    pub workload: Workload,
    pub slo: Slo,
    /// Most client threads (open loop): arrivals beyond them are counted as overflow.
    pub clients_max: usize,
    pub seed: u64,
    /// PID of the server, to sample its memory and threads (same machine only).
    pub pid: Option<u32>,
    pub quiet: bool,
}

/// Live counters for the progress line.
#[derive(Default)]
struct Progress {
    sent: AtomicU64,
    done: AtomicU64,
    completed: AtomicU64,
    refused: AtomicU64,
    overflow: AtomicU64,
}

/// What one run measured: per phase, plus the target's and the server's view.
pub struct Report {
    pub phases: Vec<(Phase, Stats)>,
    pub target: Value,
    pub server_metrics: Value,
    pub wall: Duration,
    /// Each request at its arrival (for `plot::timeline_svg`).
    pub arrivals: Vec<Arrival>,
    /// The queue over time, every `DEPTH_INTERVAL`.
    pub depth: Vec<DepthSample>,
}

/// How often the queue (the clients' in-flight count, the server's
/// `sluice_queue_depth`) is sampled for the timeline.
const DEPTH_INTERVAL: Duration = Duration::from_millis(500);

impl Report {
    pub fn to_json(&self) -> Value {
        let phases: Vec<Value> = self
            .phases
            .iter()
            .map(|(p, s)| {
                let mut v = s.to_json(p.duration.as_secs_f64());
                v["offered_rps"] = json!(p.rate_per_s);
                v["duration_s"] = json!(p.duration.as_secs_f64());
                v
            })
            .collect();
        let arrivals: Vec<Value> = self
            .arrivals
            .iter()
            .map(|a| json!([a.at_s, a.completed, a.ttft_s]))
            .collect();
        let depth: Vec<Value> = self.depth.iter().map(|d| json!([d.0, d.1, d.2])).collect();
        json!({
            "phases": phases,
            "target_process": self.target,
            "server_metrics_delta": self.server_metrics,
            "wall_s": self.wall.as_secs_f64(),
            "timeline": {
                "arrivals": "[arrival s, completed, ttft s] per request",
                "requests": arrivals,
                "depth": "[s, in flight at the clients, server queue depth] every 0.5 s",
                "samples": depth,
            },
        })
    }
}

/// Open loop: Poisson arrivals through `phases`, each served by a free client
/// thread; an arrival that finds every client busy is counted, never dropped silently.
pub fn open_loop(cfg: &RunConfig, phases: &[Phase]) -> Report {
    let schedule = poisson_schedule(phases, cfg.seed);
    let session = Session::begin(cfg, phases.len());
    let (stats, progress) = (Arc::clone(&session.stats), Arc::clone(&session.progress));
    let timeline = Arc::clone(&session.timeline);

    // A zero-capacity channel: `try_send` succeeds only if a client is waiting.
    let (tx, rx) = bounded::<(crate::workload::RequestSpec, Instant, usize, u64)>(0);
    let clients: Vec<_> = (0..cfg.clients_max)
        .map(|_| {
            let rx = rx.clone();
            let (target, workload) = (cfg.target.clone(), cfg.workload.clone());
            let (stats, progress) = (Arc::clone(&stats), Arc::clone(&progress));
            let timeline = Arc::clone(&timeline);
            std::thread::spawn(move || {
                while let Ok((spec, arrival, phase, seed)) = rx.recv() {
                    let mut rng = Rng::new(seed);
                    let o = run_request(&target, &workload, &spec, arrival, &mut rng);
                    note(&progress, &o);
                    timeline.note(arrival, &o);
                    stats[phase].lock().expect("stats lock").record(&o);
                }
            })
        })
        .collect();
    drop(rx);

    let start = Instant::now();
    let mut rng = Rng::new(cfg.seed ^ 0x5EED);
    for (offset, phase) in schedule {
        let at = start + offset;
        if let Some(wait) = at.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let spec = cfg.workload.draw(&mut rng);
        progress.sent.fetch_add(1, Ordering::Relaxed);
        match tx.try_send((spec.clone(), at, phase, rng.next_u64())) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                let mut o = Outcome::new(Kind::Overflow, spec.long);
                o.attempts = 0;
                note(&progress, &o);
                timeline.note(at, &o);
                stats[phase].lock().expect("stats lock").record(&o);
            }
        }
    }
    drop(tx);
    for c in clients {
        let _ = c.join();
    }
    drop((stats, progress, timeline));
    session.end(cfg, phases)
}

/// Closed loop: `concurrency` clients, each sending its next request as soon as
/// the previous one ends, for `duration`.
pub fn closed_loop(cfg: &RunConfig, concurrency: usize, duration: Duration) -> Report {
    let session = Session::begin(cfg, 1);
    let start = session.start;
    let clients: Vec<_> = (0..concurrency)
        .map(|i| {
            let (target, workload) = (cfg.target.clone(), cfg.workload.clone());
            let (stats, progress) = (Arc::clone(&session.stats), Arc::clone(&session.progress));
            let timeline = Arc::clone(&session.timeline);
            let mut rng = Rng::new(cfg.seed.wrapping_add(i as u64 * 7919));
            std::thread::spawn(move || {
                while start.elapsed() < duration {
                    let spec = workload.draw(&mut rng);
                    progress.sent.fetch_add(1, Ordering::Relaxed);
                    let arrival = Instant::now();
                    let o = run_request(&target, &workload, &spec, arrival, &mut rng);
                    note(&progress, &o);
                    timeline.note(arrival, &o);
                    stats[0].lock().expect("stats lock").record(&o);
                }
            })
        })
        .collect();
    for c in clients {
        let _ = c.join();
    }
    // Requests still running at the end were let finish: the span is the wall time.
    let phases = [Phase {
        rate_per_s: f64::NAN,
        duration: start.elapsed(),
    }];
    session.end(cfg, &phases)
}

fn note(p: &Progress, o: &Outcome) {
    p.done.fetch_add(1, Ordering::Relaxed);
    match o.kind {
        Kind::Completed => p.completed.fetch_add(1, Ordering::Relaxed),
        Kind::Rejected | Kind::Shed => p.refused.fetch_add(1, Ordering::Relaxed),
        Kind::Overflow => p.overflow.fetch_add(1, Ordering::Relaxed),
        _ => 0,
    };
}

/// What both loops set up before the first request and read after the last:
/// per-phase stats, the progress line, the target sampler, `/metrics` before.
struct Session {
    stats: Arc<Vec<Mutex<Stats>>>,
    progress: Arc<Progress>,
    timeline: Arc<Timeline>,
    /// The queue sampler and its stop flag.
    depth: (std::thread::JoinHandle<Vec<DepthSample>>, Arc<AtomicBool>),
    before: Option<Value>,
    sampler: TargetSampler,
    stop_progress: Arc<AtomicBool>,
    progress_thread: Option<std::thread::JoinHandle<()>>,
    start: Instant,
}

impl Session {
    fn begin(cfg: &RunConfig, n_phases: usize) -> Session {
        let stats = (0..n_phases)
            .map(|_| Mutex::new(Stats::new(cfg.slo)))
            .collect();
        let progress = Arc::new(Progress::default());
        let stop_progress = Arc::new(AtomicBool::new(false));
        let start = Instant::now();
        let stop_depth = Arc::new(AtomicBool::new(false));
        let depth = {
            let (p, stop, target) = (
                Arc::clone(&progress),
                Arc::clone(&stop_depth),
                cfg.target.clone(),
            );
            std::thread::spawn(move || {
                let mut samples = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let t = start.elapsed().as_secs_f64();
                    let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
                    let in_flight = l(&p.sent).saturating_sub(l(&p.done)) as f64;
                    let server = server_gauge(&target, "sluice_queue_depth");
                    samples.push((t, in_flight, server));
                    std::thread::sleep(DEPTH_INTERVAL);
                }
                samples
            })
        };
        Session {
            timeline: Arc::new(Timeline {
                start,
                arrivals: Mutex::new(Vec::new()),
            }),
            depth: (depth, stop_depth),
            stats: Arc::new(stats),
            before: server_metrics(&cfg.target),
            sampler: TargetSampler::start(cfg.pid),
            progress_thread: spawn_progress(
                cfg.quiet,
                Arc::clone(&progress),
                Arc::clone(&stop_progress),
            ),
            progress,
            stop_progress,
            start,
        }
    }

    /// Call once every client thread has ended.
    fn end(self, cfg: &RunConfig, phases: &[Phase]) -> Report {
        let wall = self.start.elapsed();
        self.stop_progress.store(true, Ordering::Relaxed);
        if let Some(t) = self.progress_thread {
            let _ = t.join();
        }
        let after = server_metrics(&cfg.target);
        let server_metrics = match (self.before, after) {
            (Some(b), Some(a)) => metrics_delta(&b, &a),
            _ => Value::Null,
        };
        let stats = Arc::try_unwrap(self.stats)
            .unwrap_or_else(|_| panic!("client threads still hold the stats"));
        self.depth.1.store(true, Ordering::Relaxed);
        let depth = self.depth.0.join().unwrap_or_default();
        let mut arrivals = std::mem::take(&mut *self.timeline.arrivals.lock().expect("timeline"));
        arrivals.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
        Report {
            phases: phases
                .iter()
                .copied()
                .zip(
                    stats
                        .into_iter()
                        .map(|m| m.into_inner().expect("stats lock")),
                )
                .collect(),
            target: self.sampler.stop(),
            server_metrics,
            wall,
            arrivals,
            depth,
        }
    }
}

fn spawn_progress(
    quiet: bool,
    p: Arc<Progress>,
    stop: Arc<AtomicBool>,
) -> Option<std::thread::JoinHandle<()>> {
    if quiet {
        return None;
    }
    let start = Instant::now();
    Some(std::thread::spawn(move || {
        let mut last = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            std::thread::sleep(SAMPLE_INTERVAL);
            if last.elapsed() >= PROGRESS_INTERVAL {
                last = Instant::now();
                let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
                eprintln!(
                    "[{:6.1} s] sent {} | done {} | completed {} | refused {} | overflow {} | in flight {}",
                    start.elapsed().as_secs_f64(),
                    l(&p.sent),
                    l(&p.done),
                    l(&p.completed),
                    l(&p.refused),
                    l(&p.overflow),
                    l(&p.sent) - l(&p.done)
                );
            }
        }
    }))
}

/// What the sampling thread saw: RSS in kB (first, last and largest sample)
/// and the largest thread count.
#[derive(Debug, Default, Clone, Copy)]
struct Samples {
    rss_kb_first: Option<u64>,
    rss_kb_last: u64,
    rss_kb_max: u64,
    threads_max: u64,
}

/// The sampling thread and its stop flag.
type Sampling = (std::thread::JoinHandle<Samples>, Arc<AtomicBool>);

/// Samples the target process's resident memory and thread count.
struct TargetSampler {
    handle: Option<Sampling>,
    pid: Option<u32>,
}

impl TargetSampler {
    fn start(pid: Option<u32>) -> TargetSampler {
        let handle = pid.map(|pid| {
            let stop = Arc::new(AtomicBool::new(false));
            let flag = Arc::clone(&stop);
            let h = std::thread::spawn(move || {
                let mut s = Samples::default();
                while !flag.load(Ordering::Relaxed) {
                    if let Some((r, t)) = read_proc_status(pid) {
                        s.rss_kb_first.get_or_insert(r);
                        s.rss_kb_last = r;
                        s.rss_kb_max = s.rss_kb_max.max(r);
                        s.threads_max = s.threads_max.max(t);
                    }
                    std::thread::sleep(SAMPLE_INTERVAL);
                }
                s
            });
            (h, stop)
        });
        TargetSampler { handle, pid }
    }

    fn stop(self) -> Value {
        let Some((h, stop)) = self.handle else {
            return Value::Null;
        };
        stop.store(true, Ordering::Relaxed);
        let s = h.join().unwrap_or_default();
        let mb = |kb: u64| kb as f64 / 1024.0;
        json!({"pid": self.pid, "rss_mb_max": mb(s.rss_kb_max),
               "rss_mb_first": mb(s.rss_kb_first.unwrap_or(0)), "rss_mb_last": mb(s.rss_kb_last),
               "threads_max": s.threads_max})
    }
}

/// `(VmRSS in kB, Threads)` from `/proc/<pid>/status`.
pub fn read_proc_status(pid: u32) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
    };
    Some((field("VmRSS:")?, field("Threads:")?))
}

/// Each request at its arrival, as the client threads end them.
struct Timeline {
    start: Instant,
    arrivals: Mutex<Vec<Arrival>>,
}

impl Timeline {
    fn note(&self, arrival: Instant, o: &Outcome) {
        let a = Arrival {
            at_s: arrival.saturating_duration_since(self.start).as_secs_f64(),
            completed: o.kind == Kind::Completed,
            ttft_s: o.ttft.map(|d| d.as_secs_f64()),
        };
        self.arrivals.lock().expect("timeline").push(a);
    }
}

/// One unlabelled gauge of the target's `/metrics`, if it has it (quickly:
/// the sampler must not fall behind a busy server).
fn server_gauge(t: &Target, name: &str) -> Option<f64> {
    let path = format!("{}/metrics", t.prefix);
    let r =
        crate::http::request(t.addr, "GET", &path, None, &[], Duration::from_millis(400)).ok()?;
    if r.status != 200 {
        return None;
    }
    parse_prometheus(&String::from_utf8_lossy(&r.body))
        .get(name)
        .copied()
}

/// sluice's counters from `/metrics`, when the target has them.
fn server_metrics(t: &Target) -> Option<Value> {
    let path = format!("{}/metrics", t.prefix);
    let r = crate::http::request(t.addr, "GET", &path, None, &[], METRICS_TIMEOUT).ok()?;
    if r.status != 200 {
        return None;
    }
    let text = String::from_utf8_lossy(&r.body);
    let counters = parse_prometheus(&text);
    if !counters.keys().any(|k| k.starts_with("sluice_")) {
        return None;
    }
    Some(json!(counters))
}

/// Sample lines of a Prometheus text exposition: `name{labels} value`.
pub fn parse_prometheus(text: &str) -> std::collections::BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_string(), value.parse::<f64>().ok()?))
        })
        .collect()
}

fn metrics_delta(before: &Value, after: &Value) -> Value {
    let counters = [
        ("accepted", "sluice_requests_accepted_total"),
        (
            "rejected_queue_full",
            "sluice_requests_rejected_total{reason=\"queue_full\"}",
        ),
        (
            "rejected_invalid",
            "sluice_requests_rejected_total{reason=\"invalid\"}",
        ),
        ("completed", "sluice_requests_completed_total"),
        (
            "cancelled_disconnect",
            "sluice_requests_cancelled_total{reason=\"disconnect\"}",
        ),
        (
            "cancelled_stall",
            "sluice_requests_cancelled_total{reason=\"stall\"}",
        ),
        (
            "cancelled_deadline",
            "sluice_requests_cancelled_total{reason=\"deadline\"}",
        ),
        ("tokens_after_cancel", "sluice_tokens_after_cancel_total"),
        ("failed", "sluice_requests_failed_total"),
        ("tokens_generated", "sluice_tokens_generated_total"),
    ];
    let mut out = serde_json::Map::new();
    for (label, name) in counters {
        if let (Some(b), Some(a)) = (before[name].as_f64(), after[name].as_f64()) {
            out.insert(label.to_string(), json!(a - b));
        }
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_samples_are_parsed_with_labels() {
        let m = parse_prometheus(
            "# HELP x y\n# TYPE x counter\nsluice_requests_accepted_total 12\n\
             sluice_requests_rejected_total{reason=\"queue_full\"} 3\nsluice_step_seconds{quantile=\"0.5\"} 0.01\n",
        );
        assert_eq!(m["sluice_requests_accepted_total"], 12.0);
        assert_eq!(
            m["sluice_requests_rejected_total{reason=\"queue_full\"}"],
            3.0
        );
        assert_eq!(m.len(), 3);
    }

    #[test]
    fn this_process_status_is_readable() {
        let (rss, threads) = read_proc_status(std::process::id()).unwrap();
        assert!(rss > 0 && threads >= 1);
    }
}
