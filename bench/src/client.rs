//! One simulated client: sends a streaming chat request, reads it the way the
//! workload says (fast, slowly, or hanging up after N tokens), gives up at its
//! timeout, and retries refusals as its retry policy says.

use crate::arrivals::Rng;
use crate::http::Sse;
use crate::stats::{Kind, Outcome};
use crate::workload::{prompt_text, Reader, RequestSpec, Retry, Workload};
use serde_json::json;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Receive buffer of a slow reader's socket (Linux doubles it).
const SLOW_READER_RCVBUF_BYTES: usize = 4096;

/// Where and how requests are sent.
#[derive(Debug, Clone)]
pub struct Target {
    pub addr: SocketAddr,
    /// Path prefix of the API (empty for `http://host:port`).
    pub prefix: String,
    pub model: String,
    /// Send `ignore_eos: true` so that `max_tokens` sets the answer's length
    /// (sluice, llama.cpp and vLLM honour it; turn it off for servers that refuse
    /// unknown fields).
    pub ignore_eos: bool,
    pub temperature: f64,
    /// Extra request headers (`--header`), e.g. `X-Priority: batch`.
    pub headers: Vec<(String, String)>,
}

impl Target {
    pub fn body(&self, spec: &RequestSpec) -> Vec<u8> {
        let mut body = json!({
            "model": self.model,
            "messages": [{"role": "user", "content": format!(
                "Read these notes, then write a long story about them.\n{}",
                prompt_text(spec.prompt_tokens, spec.text_seed)
            )}],
            "max_tokens": spec.max_tokens,
            "temperature": self.temperature,
            "seed": spec.text_seed % 1_000_000,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if self.ignore_eos {
            body["ignore_eos"] = json!(true);
        }
        body.to_string().into_bytes()
    }
}

/// Runs one request (with its retries) that arrived at `arrival`.
pub fn run_request(
    target: &Target,
    w: &Workload,
    spec: &RequestSpec,
    arrival: Instant,
    rng: &mut Rng,
) -> Outcome {
    let deadline = arrival + w.timeout;
    let body = target.body(spec);
    let path = format!("{}/v1/chat/completions", target.prefix);
    let mut attempts = 0;
    loop {
        attempts += 1;
        let (mut outcome, retry_after) = attempt(target, &path, &body, spec, arrival, deadline);
        outcome.attempts = attempts;
        let refused = matches!(outcome.kind, Kind::Rejected | Kind::Shed);
        if let (true, Retry::RetryAfter { max, cap }) = (refused, w.retry) {
            if attempts <= max {
                // Jitter spreads the retries of clients refused together.
                let wait = retry_after.unwrap_or(1.0) * (1.0 + 0.5 * rng.next_f64());
                let wait = Duration::from_secs_f64(wait).min(cap);
                if Instant::now() + wait < deadline {
                    std::thread::sleep(wait);
                    continue;
                }
            }
        }
        return outcome;
    }
}

fn attempt(
    target: &Target,
    path: &str,
    body: &[u8],
    spec: &RequestSpec,
    arrival: Instant,
    deadline: Instant,
) -> (Outcome, Option<f64>) {
    let mut out = Outcome::new(Kind::Broken, spec.long);
    let finish = |mut out: Outcome, kind: Kind| {
        out.kind = kind;
        out.e2e = arrival.elapsed();
        out
    };
    let Some(remaining) = deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
    else {
        return (finish(out, Kind::Timeout), None);
    };
    // A slow reader gets a small receive buffer: otherwise its kernel would
    // read ahead for it, and the server would never see it as slow.
    let addr = target.addr;
    let headers: Vec<(&str, &str)> = target
        .headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let opened = match spec.reader {
        Reader::Slow { .. } => {
            crate::http::connect_with_rcvbuf(addr, remaining, SLOW_READER_RCVBUF_BYTES)
        }
        _ => crate::http::connect(addr, remaining),
    }
    .and_then(|s| Sse::open_with(s, path, body, &headers));
    let mut sse = match opened {
        Ok(s) => s,
        Err(e) if is_timeout(&e) => return (finish(out, Kind::Timeout), None),
        Err(_) => return (finish(out, Kind::Broken), None),
    };
    out.status = Some(sse.status);
    if sse.status != 200 {
        let retry_after = sse
            .headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("retry-after"))
            .and_then(|(_, v)| v.trim().parse::<f64>().ok());
        let kind = match sse.status {
            429 => Kind::Rejected,
            503 => Kind::Shed,
            _ => Kind::HttpError,
        };
        return (finish(out, kind), retry_after);
    }

    let mut first_token: Option<Instant> = None;
    let mut last_token: Option<Instant> = None;
    let mut seen = 0u64;
    loop {
        let event = match sse.next_json() {
            Ok(Some(v)) => v,
            // [DONE] (or the end of the body): complete only if a finish reason came.
            Ok(None) => return (finish(out, Kind::Broken), None),
            Err(e) if is_timeout(&e) || Instant::now() >= deadline => {
                return (finish(out, Kind::Timeout), None)
            }
            Err(_) => return (finish(out, Kind::Broken), None),
        };
        if event.get("error").is_some() {
            return (finish(out, Kind::Broken), None);
        }
        if let Some(n) = event["usage"]["completion_tokens"].as_u64() {
            out.tokens = n;
        }
        let choice = &event["choices"][0];
        if choice["delta"]["content"]
            .as_str()
            .is_some_and(|t| !t.is_empty())
        {
            let now = Instant::now();
            match last_token {
                None => {
                    out.ttft = Some(now - arrival);
                    first_token = Some(now);
                }
                Some(prev) => out.itls.push(now - prev),
            }
            last_token = Some(now);
            seen += 1;
            match spec.reader {
                Reader::Fast => {}
                Reader::Slow { tok_s } => {
                    let pause = Duration::from_secs_f64(1.0 / tok_s);
                    if now + pause >= deadline {
                        return (finish(out, Kind::Timeout), None);
                    }
                    std::thread::sleep(pause);
                }
                Reader::Disconnect { after_tokens } if seen >= after_tokens => {
                    out.tokens = out.tokens.max(seen);
                    // Dropping the stream closes the socket mid-response.
                    return (finish(out, Kind::ClientHungUp), None);
                }
                Reader::Disconnect { .. } => {}
            }
        }
        if choice["finish_reason"].is_string() {
            // The finish chunk follows the last token at once, even one with no text.
            out.decode = first_token.map(|f| f.elapsed());
            // Read on to [DONE] and the usage chunk; the request is complete.
            while let Ok(Some(v)) = sse.next_json() {
                if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                    out.tokens = n;
                }
            }
            out.tokens = out.tokens.max(seen);
            return (finish(out, Kind::Completed), None);
        }
    }
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}
