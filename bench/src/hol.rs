//! The head-of-line figure: running chat streams while one long prompt arrives.
//!
//! `streams` streaming chat requests start and read a few tokens; then one
//! request with a prompt of about `long_prompt_tokens` tokens arrives. Each
//! stream records when every token arrived, so the report can say how long the
//! streams waited between two tokens while the long prompt was prefilled (from
//! its send to its first token), against how long they waited before it came;
//! and what the long prompt's time to first token was. The streams hang up once
//! each has received a token after the long prompt's first token.
//!
//! A server that prefills the long prompt in one piece (or in chunks that are
//! large for this machine) makes every stream wait for it: the largest gap is
//! the prefill time. One that budgets each step keeps the gap near one step.
//!
//! On a virtual machine the host may take a CPU away for a while (`steal`):
//! the report says how much it took during the prefill and around the
//! largest gap, which is then the server's only where that is about nothing.

use crate::client::Target;
use crate::http::Sse;
use crate::steal;
use crate::workload::prompt_text;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct HolConfig {
    /// Chat streams running when the long prompt arrives.
    pub streams: usize,
    /// `max_tokens` of each stream: enough to outlast the long prefill.
    pub stream_max_tokens: u64,
    /// Tokens each stream reads before the long prompt is sent.
    pub warm_tokens: usize,
    /// Approximate prompt tokens of the long request.
    pub long_prompt_tokens: u64,
    /// Longest the whole figure may take.
    pub timeout: Duration,
}

/// Gaps between two tokens of the streams, in milliseconds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Gaps {
    pub count: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl Gaps {
    pub fn of(mut ms: Vec<f64>) -> Gaps {
        if ms.is_empty() {
            return Gaps::default();
        }
        ms.sort_by(f64::total_cmp);
        let at = |q: f64| ms[((ms.len() - 1) as f64 * q).round() as usize];
        Gaps {
            count: ms.len(),
            p50_ms: at(0.5),
            p99_ms: at(0.99),
            max_ms: ms[ms.len() - 1],
        }
    }

    fn to_json(&self) -> Value {
        json!({"count": self.count, "p50_ms": self.p50_ms, "p99_ms": self.p99_ms, "max_ms": self.max_ms})
    }
}

#[derive(Debug, Clone)]
pub struct HolReport {
    /// Gaps before the long prompt was sent (the streams alone).
    pub before: Gaps,
    /// Gaps that overlap the long prompt's prefill (send to first token).
    pub during: Gaps,
    pub long_ttft: Duration,
    /// Prompt tokens of the long request, as the server counted them.
    pub long_prompt_tokens: Option<u64>,
    pub long_status: u16,
    /// Every stream still received a token after the long prompt's first one;
    /// if not, the gaps cover only part of the prefill (raise
    /// `stream_max_tokens`, and the server's KV cells to hold it).
    pub streams_outlasted_prefill: bool,
    /// Each stream's token arrivals, and the long prompt's send and first
    /// token, in seconds since the streams started (for `plot::hol_svg`).
    pub stream_times_s: Vec<Vec<f64>>,
    pub long_sent_s: f64,
    pub long_first_s: f64,
    /// The largest gap during the prefill: its start and end, seconds since
    /// the streams started.
    pub largest_gap_s: Option<(f64, f64)>,
    /// Steal time (all CPUs, ms) during the prefill, and around its largest
    /// gap (`steal::Samples::within`); None where `/proc/stat` is not read.
    pub steal_during_ms: Option<f64>,
    pub steal_in_largest_gap_ms: Option<f64>,
    /// Each interval of the run in which a CPU was stolen from: (seconds
    /// since the streams started, the CPU, ms).
    pub steal_events: Vec<(f64, usize, f64)>,
}

impl HolReport {
    pub fn to_json(&self) -> Value {
        json!({
            "gaps_before": self.before.to_json(),
            "gaps_during_long_prefill": self.during.to_json(),
            "long_ttft_ms": self.long_ttft.as_secs_f64() * 1e3,
            "long_prompt_tokens": self.long_prompt_tokens,
            "long_status": self.long_status,
            "streams_outlasted_prefill": self.streams_outlasted_prefill,
            "timeline": {
                "long_sent_s": self.long_sent_s,
                "long_first_token_s": self.long_first_s,
                "stream_token_s": self.stream_times_s,
            },
            "steal": {
                "during_long_prefill_ms": self.steal_during_ms,
                "largest_gap_s": self.largest_gap_s.map(|(a, b)| [a, b]),
                "in_largest_gap_ms": self.steal_in_largest_gap_ms,
                "events": self.steal_events.iter().map(|&(t, cpu, ms)| json!([t, cpu, ms])).collect::<Vec<_>>(),
            },
        })
    }
}

/// Splits one stream's token times into the gaps before `t0` and the gaps whose
/// interval overlaps `[t0, t1]` (a gap that starts before the long prompt was
/// sent and ends during its prefill counts as during).
pub fn split_gaps(times: &[Instant], t0: Instant, t1: Instant) -> (Vec<f64>, Vec<f64>) {
    let mut before = Vec::new();
    let mut during = Vec::new();
    for w in times.windows(2) {
        let ms = w[1].duration_since(w[0]).as_secs_f64() * 1e3;
        if w[1] <= t0 {
            before.push(ms);
        } else if w[0] < t1 {
            during.push(ms);
        }
    }
    (before, during)
}

struct Stream {
    times: Mutex<Vec<Instant>>,
    tokens: AtomicUsize,
    ended: AtomicBool,
}

/// The largest gap between two tokens of one stream that overlaps
/// `[t0, t1]`: (ms, its start, its end), times as `split_gaps` splits them.
pub fn largest_gap(streams: &[Vec<f64>], t0: f64, t1: f64) -> Option<(f64, f64, f64)> {
    streams
        .iter()
        .flat_map(|times| times.windows(2))
        .filter(|w| w[1] > t0 && w[0] < t1)
        .map(|w| ((w[1] - w[0]) * 1e3, w[0], w[1]))
        .max_by(|a, b| a.0.total_cmp(&b.0))
}

pub fn run(target: &Target, cfg: &HolConfig) -> Result<HolReport, String> {
    let started = Instant::now();
    let steal = steal::Sampler::start(started);
    let stop = Arc::new(AtomicBool::new(false));
    let path = format!("{}/v1/chat/completions", target.prefix);
    let streams: Vec<Arc<Stream>> = (0..cfg.streams)
        .map(|_| {
            Arc::new(Stream {
                times: Mutex::new(Vec::new()),
                tokens: AtomicUsize::new(0),
                ended: AtomicBool::new(false),
            })
        })
        .collect();
    let handles: Vec<_> = streams
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let (s, stop, path) = (Arc::clone(s), Arc::clone(&stop), path.clone());
            let body = chat_body(
                target,
                &format!("Stream {i}: tell me a long story about a lighthouse keeper."),
                cfg.stream_max_tokens,
            );
            let (addr, timeout) = (target.addr, cfg.timeout);
            std::thread::spawn(move || -> Result<(), String> {
                let mut sse = Sse::open(addr, &path, &body, timeout).map_err(|e| e.to_string())?;
                if sse.status != 200 {
                    return Err(format!("stream {i}: status {}", sse.status));
                }
                while !stop.load(Ordering::Relaxed) {
                    match sse.next_json() {
                        Ok(Some(v)) if has_content(&v) => {
                            s.times.lock().expect("times").push(Instant::now());
                            s.tokens.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(Some(_)) => {}
                        Ok(None) => {
                            s.ended.store(true, Ordering::Relaxed);
                            break;
                        }
                        Err(e) => return Err(format!("stream {i}: {e}")),
                    }
                }
                // Dropping the connection cancels the rest of the stream.
                Ok(())
            })
        })
        .collect();
    let wait = |what: &str, cond: &dyn Fn() -> bool| -> Result<(), String> {
        while !cond() {
            if started.elapsed() > cfg.timeout {
                return Err(format!("timed out waiting for {what}"));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    };
    let result = (|| -> Result<(Instant, Instant, u16, Option<u64>, bool), String> {
        wait("the streams to start", &|| {
            streams
                .iter()
                .all(|s| s.tokens.load(Ordering::Relaxed) >= cfg.warm_tokens)
        })?;
        let body = chat_body(
            target,
            &format!(
                "Read these notes, then answer in one word.\n{}",
                prompt_text(cfg.long_prompt_tokens, 7)
            ),
            1,
        );
        let t0 = Instant::now();
        let mut long =
            Sse::open(target.addr, &path, &body, cfg.timeout).map_err(|e| e.to_string())?;
        let status = long.status;
        let mut t1 = None;
        let mut prompt_tokens = None;
        if status == 200 {
            while let Some(v) = long.next_json().map_err(|e| format!("long prompt: {e}"))? {
                if t1.is_none() && has_content(&v) {
                    t1 = Some(Instant::now());
                }
                if let Some(n) = v["usage"]["prompt_tokens"].as_u64() {
                    prompt_tokens = Some(n);
                }
            }
        }
        let t1 = t1.ok_or(format!("the long prompt got no token (status {status})"))?;
        // Each stream's gap across the end of the prefill needs its next token.
        let after: Vec<usize> = streams
            .iter()
            .map(|s| s.tokens.load(Ordering::Relaxed))
            .collect();
        wait("a token after the long prefill", &|| {
            streams.iter().zip(&after).all(|(s, &n)| {
                s.tokens.load(Ordering::Relaxed) > n || s.ended.load(Ordering::Relaxed)
            })
        })?;
        // A stream that ended before the prefill did says nothing about the rest
        // of it: the figure needs streams that outlast the prefill.
        let outlasted = streams.iter().all(|s| {
            s.times
                .lock()
                .expect("times")
                .last()
                .is_some_and(|&t| t >= t1)
        });
        Ok((t0, t1, status, prompt_tokens, outlasted))
    })();
    stop.store(true, Ordering::Relaxed);
    let steal = steal.finish();
    for h in handles {
        h.join()
            .map_err(|_| "a stream thread panicked".to_string())??;
    }
    let (t0, t1, long_status, long_prompt_tokens, streams_outlasted_prefill) = result?;
    let (mut before, mut during) = (Vec::new(), Vec::new());
    let since = |t: Instant| t.saturating_duration_since(started).as_secs_f64();
    let mut stream_times_s = Vec::new();
    for s in &streams {
        let times = s.times.lock().expect("times");
        let (b, d) = split_gaps(&times, t0, t1);
        before.extend(b);
        during.extend(d);
        stream_times_s.push(times.iter().map(|&t| since(t)).collect());
    }
    let largest = largest_gap(&stream_times_s, since(t0), since(t1));
    Ok(HolReport {
        largest_gap_s: largest.map(|(_, a, b)| (a, b)),
        steal_during_ms: steal.within(since(t0), since(t1)),
        steal_in_largest_gap_ms: largest.and_then(|(_, a, b)| steal.within(a, b)),
        steal_events: steal.events(),
        before: Gaps::of(before),
        during: Gaps::of(during),
        long_ttft: t1.duration_since(t0),
        long_prompt_tokens,
        long_status,
        streams_outlasted_prefill,
        stream_times_s,
        long_sent_s: since(t0),
        long_first_s: since(t1),
    })
}

fn chat_body(target: &Target, content: &str, max_tokens: u64) -> Vec<u8> {
    let mut body = json!({
        "model": target.model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": target.temperature,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if target.ignore_eos {
        body["ignore_eos"] = json!(true);
    }
    body.to_string().into_bytes()
}

fn has_content(v: &Value) -> bool {
    v["choices"][0]["delta"]["content"]
        .as_str()
        .is_some_and(|s| !s.is_empty())
        || v["choices"][0]["text"]
            .as_str()
            .is_some_and(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_gap_is_one_that_overlaps_the_prefill() {
        let streams = vec![vec![0.0, 1.0, 1.1, 1.35, 1.4], vec![0.9, 1.2, 3.0]];
        // The prefill is [1.05, 1.3]: [0.0, 1.0] ends before it; [1.2, 3.0]
        // starts within it and is the largest.
        let (ms, a, b) = largest_gap(&streams, 1.05, 1.3).unwrap();
        assert_eq!(((ms * 1e3).round() / 1e3, a, b), (1800.0, 1.2, 3.0));
        // A prefill that ends before 1.2: [0.9, 1.2] is the largest.
        let (ms, a, b) = largest_gap(&streams, 1.05, 1.15).unwrap();
        assert_eq!(((ms * 1e3).round() / 1e3, a, b), (300.0, 0.9, 1.2));
        assert_eq!(largest_gap(&streams, 5.0, 6.0), None);
    }

    #[test]
    fn gaps_are_split_at_the_long_prompts_send_and_first_token() {
        let base = Instant::now();
        let at = |ms: u64| base + Duration::from_millis(ms);
        // Tokens every 100 ms, then one 900 ms gap during the prefill (t0 = 350, t1 = 1300).
        let times: Vec<Instant> = [0, 100, 200, 300, 400, 1300, 1400]
            .into_iter()
            .map(at)
            .collect();
        let (before, during) = split_gaps(&times, at(350), at(1300));
        assert_eq!(before, vec![100.0, 100.0, 100.0]);
        assert_eq!(
            during,
            vec![100.0, 900.0],
            "300-400 overlaps the send; 1300-1400 starts at t1"
        );
        let g = Gaps::of(during);
        assert_eq!(g.max_ms, 900.0);
        assert_eq!(g.count, 2);
        assert_eq!(Gaps::of(Vec::new()), Gaps::default());
    }
}
