//! What a run measured: outcomes by kind and status, latency distributions
//! (hdrhistogram), tokens, and goodput.
//!
//! Goodput counts requests that completed *and* met the SLO: time to first
//! token within `ttft_ms` and mean inter-token time (time per output token after
//! the first) within `itl_ms`. A request that completes too late is throughput,
//! not goodput: its user already gave up.

use hdrhistogram::Histogram;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::Duration;

/// Latencies are recorded in microseconds, up to one hour.
const LATENCY_US_MAX: u64 = 3_600_000_000;

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, LATENCY_US_MAX, 3).expect("valid histogram bounds")
}

/// How a request ended, from the client's side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// The stream ended with a finish reason and `[DONE]`.
    Completed,
    /// 429 (the server said: not now).
    Rejected,
    /// 503 (the server shed it).
    Shed,
    /// Another HTTP error status.
    HttpError,
    /// The client gave up waiting.
    Timeout,
    /// The client hung up on purpose (the workload's disconnecting clients).
    ClientHungUp,
    /// The connection failed or the stream broke off without an end.
    Broken,
    /// No client thread was free at the arrival time (open loop).
    Overflow,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Completed => "completed",
            Kind::Rejected => "rejected_429",
            Kind::Shed => "shed_503",
            Kind::HttpError => "http_error",
            Kind::Timeout => "timeout",
            Kind::ClientHungUp => "client_hung_up",
            Kind::Broken => "broken",
            Kind::Overflow => "client_overflow",
        }
    }
}

/// One request's result as the client saw it (after any retries).
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub kind: Kind,
    /// Status of the last attempt, if one got a response head.
    pub status: Option<u16>,
    pub attempts: u32,
    /// From the arrival (first attempt) to the first token.
    pub ttft: Option<Duration>,
    /// Gaps between consecutive tokens.
    pub itls: Vec<Duration>,
    /// From the first token to the finish chunk (completed requests only).
    pub decode: Option<Duration>,
    /// From the arrival to the end (or the refusal).
    pub e2e: Duration,
    pub tokens: u64,
    /// True for a long-prompt request (reported apart in some scenarios).
    pub long: bool,
}

impl Outcome {
    /// An outcome with no response yet; the client fills it in as it goes.
    pub fn new(kind: Kind, long: bool) -> Outcome {
        Outcome {
            kind,
            status: None,
            attempts: 1,
            ttft: None,
            itls: Vec::new(),
            decode: None,
            e2e: Duration::ZERO,
            tokens: 0,
            long,
        }
    }
}

/// Service-level objective for goodput.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slo {
    pub ttft: Duration,
    pub itl: Duration,
}

impl Slo {
    /// Completed, first token in time, and tokens after it at least as fast as the SLO.
    pub fn met_by(&self, o: &Outcome) -> bool {
        if o.kind != Kind::Completed {
            return false;
        }
        let Some(ttft) = o.ttft else { return false };
        if ttft > self.ttft {
            return false;
        }
        if o.itls.is_empty() {
            return true;
        }
        let mean = o.itls.iter().sum::<Duration>() / o.itls.len() as u32;
        mean <= self.itl
    }
}

/// Aggregates outcomes.
pub struct Stats {
    pub slo: Slo,
    pub by_kind: BTreeMap<Kind, u64>,
    pub by_status: BTreeMap<u16, u64>,
    pub good: u64,
    pub tokens: u64,
    pub attempts: u64,
    pub ttft: Histogram<u64>,
    pub itl: Histogram<u64>,
    pub e2e: Histogram<u64>,
    /// Time to a 429: how fast the server said no at the door.
    pub rejection: Histogram<u64>,
    /// Time to a 503 (shed after waiting in the server's queue).
    pub shed: Histogram<u64>,
    /// TTFT and inter-token gaps of requests without a long prompt: what chat
    /// users feel while long prompts are being prefilled.
    pub ttft_short: Histogram<u64>,
    pub itl_short: Histogram<u64>,
    /// Per completed request: (tokens - 1) / decode time, in milli-tokens/s.
    pub decode_rate: Histogram<u64>,
    /// Per completed request: time per output token after the first, decode
    /// time / (tokens - 1) (what the goodput SLO's `itl_ms` judges).
    pub tpot: Histogram<u64>,
}

fn us(d: Duration) -> u64 {
    (d.as_micros() as u64).clamp(1, LATENCY_US_MAX)
}

impl Stats {
    pub fn new(slo: Slo) -> Stats {
        Stats {
            slo,
            by_kind: BTreeMap::new(),
            by_status: BTreeMap::new(),
            good: 0,
            tokens: 0,
            attempts: 0,
            ttft: histogram(),
            itl: histogram(),
            e2e: histogram(),
            rejection: histogram(),
            shed: histogram(),
            ttft_short: histogram(),
            itl_short: histogram(),
            decode_rate: histogram(),
            tpot: histogram(),
        }
    }

    pub fn record(&mut self, o: &Outcome) {
        *self.by_kind.entry(o.kind).or_default() += 1;
        if let Some(s) = o.status {
            *self.by_status.entry(s).or_default() += 1;
        }
        self.attempts += u64::from(o.attempts);
        self.tokens += o.tokens;
        if self.slo.met_by(o) {
            self.good += 1;
        }
        if let Some(t) = o.ttft {
            self.ttft.saturating_record(us(t));
            if !o.long {
                self.ttft_short.saturating_record(us(t));
            }
        }
        for &gap in &o.itls {
            self.itl.saturating_record(us(gap));
            if !o.long {
                self.itl_short.saturating_record(us(gap));
            }
        }
        if let (Kind::Completed, Some(d)) = (o.kind, o.decode) {
            if o.tokens > 1 && !d.is_zero() {
                let rate = (o.tokens - 1) as f64 / d.as_secs_f64();
                self.decode_rate
                    .saturating_record(((rate * 1e3) as u64).max(1));
                self.tpot.saturating_record(us(d / (o.tokens - 1) as u32));
            }
        }
        match o.kind {
            Kind::Completed => self.e2e.saturating_record(us(o.e2e)),
            Kind::Rejected => self.rejection.saturating_record(us(o.e2e)),
            Kind::Shed => self.shed.saturating_record(us(o.e2e)),
            _ => {}
        }
    }

    pub fn count(&self, k: Kind) -> u64 {
        self.by_kind.get(&k).copied().unwrap_or(0)
    }

    pub fn total(&self) -> u64 {
        self.by_kind.values().sum()
    }

    /// Every figure, for the JSON report. `seconds` is the span arrivals covered.
    pub fn to_json(&self, seconds: f64) -> Value {
        let lat = |h: &Histogram<u64>| {
            if h.is_empty() {
                return Value::Null;
            }
            let ms = |q: f64| h.value_at_quantile(q) as f64 / 1e3;
            json!({"count": h.len(), "p50_ms": ms(0.5), "p90_ms": ms(0.9), "p99_ms": ms(0.99),
                   "max_ms": h.max() as f64 / 1e3, "mean_ms": h.mean() / 1e3})
        };
        let refused = self.rejection.len() + self.shed.len();
        let fast = self.rejection.count_between(0, 10_000) + self.shed.count_between(0, 10_000);
        let refused_fast = match refused {
            0 => Value::Null,
            n => json!(fast as f64 / n as f64),
        };
        let kinds: BTreeMap<&str, u64> =
            self.by_kind.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        let statuses: BTreeMap<String, u64> = self
            .by_status
            .iter()
            .map(|(k, v)| (k.to_string(), *v))
            .collect();
        json!({
            "requests": self.total(),
            "attempts": self.attempts,
            "outcomes": kinds,
            "statuses": statuses,
            "good": self.good,
            "goodput_rps": self.good as f64 / seconds,
            "completed_rps": self.count(Kind::Completed) as f64 / seconds,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens as f64 / seconds,
            "slo": {"ttft_ms": self.slo.ttft.as_secs_f64() * 1e3, "itl_ms": self.slo.itl.as_secs_f64() * 1e3},
            "ttft": lat(&self.ttft),
            "itl": lat(&self.itl),
            "tpot": lat(&self.tpot),
            "e2e": lat(&self.e2e),
            "rejection": lat(&self.rejection),
            // Refusals (429 and 503) answered within 10 ms of the request's
            // arrival: a refusal should cost the client no wait.
            "refused_within_10ms_share": refused_fast,
            "shed": lat(&self.shed),
            "short_requests": {"ttft": lat(&self.ttft_short), "itl": lat(&self.itl_short)},
            "decode_tok_s_per_stream": if self.decode_rate.is_empty() { Value::Null } else {
                json!({"count": self.decode_rate.len(),
                       "p50": self.decode_rate.value_at_quantile(0.5) as f64 / 1e3,
                       "mean": self.decode_rate.mean() / 1e3})
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn completed(ttft: u64, itls: &[u64]) -> Outcome {
        Outcome {
            kind: Kind::Completed,
            status: Some(200),
            attempts: 1,
            ttft: Some(ms(ttft)),
            itls: itls.iter().map(|&g| ms(g)).collect(),
            decode: Some(ms(itls.iter().sum::<u64>())),
            e2e: ms(ttft + itls.iter().sum::<u64>()),
            tokens: itls.len() as u64 + 1,
            long: false,
        }
    }

    const SLO: Slo = Slo {
        ttft: Duration::from_millis(1000),
        itl: Duration::from_millis(100),
    };

    #[test]
    fn goodput_needs_completion_ttft_and_itl() {
        assert!(
            SLO.met_by(&completed(900, &[50, 150, 90])),
            "mean ITL 97 ms is within 100"
        );
        assert!(!SLO.met_by(&completed(1100, &[10])), "first token too late");
        assert!(!SLO.met_by(&completed(100, &[200, 200])), "tokens too slow");
        assert!(
            SLO.met_by(&completed(100, &[])),
            "a one-token answer only has a TTFT"
        );
        let mut rejected = completed(10, &[]);
        rejected.kind = Kind::Rejected;
        assert!(!SLO.met_by(&rejected));
    }

    #[test]
    fn stats_count_kinds_statuses_and_goodput() {
        let mut s = Stats::new(SLO);
        s.record(&completed(100, &[50, 50]));
        s.record(&completed(5000, &[50]));
        let mut r = completed(3, &[]);
        r.kind = Kind::Rejected;
        r.status = Some(429);
        r.ttft = None;
        r.tokens = 0;
        s.record(&r);
        assert_eq!(s.count(Kind::Completed), 2);
        assert_eq!(s.count(Kind::Rejected), 1);
        assert_eq!(s.good, 1);
        assert_eq!(s.tokens, 5);
        let j = s.to_json(10.0);
        assert_eq!(j["statuses"]["429"], 1);
        assert_eq!(j["outcomes"]["completed"], 2);
        assert_eq!(j["goodput_rps"], 0.1);
        assert_eq!(j["rejection"]["count"], 1);
        assert_eq!(j["ttft"]["count"], 2);
    }
}
