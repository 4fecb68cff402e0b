//! `sluice-bench`: closed-loop streaming load against `/v1/chat/completions`.
//!
//! Each of `--concurrency` client threads sends `--requests` streaming requests
//! one after another and times every token as it arrives. Reported per request:
//! time to first token, and the decode rate after it ((tokens - 1) / time from
//! the first text to the finish chunk, tokens from the usage chunk); in aggregate:
//! tokens per second over the whole run.
//! Works against any server that speaks OpenAI's streaming chat API.

use argh::FromArgs;
use hdrhistogram::Histogram;
use serde_json::json;
use sluice_bench::http::{parse_url, Sse};
use std::time::{Duration, Instant};

#[derive(FromArgs)]
/// Closed-loop streaming load against an OpenAI-compatible server.
struct Args {
    /// server base URL (default: http://127.0.0.1:8080)
    #[argh(option, default = "String::from(\"http://127.0.0.1:8080\")")]
    url: String,
    /// concurrent client threads (default: 1)
    #[argh(option, default = "1")]
    concurrency: usize,
    /// requests per client thread (default: 3)
    #[argh(option, default = "3")]
    requests: usize,
    /// tokens to generate per request; sent with ignore_eos (default: 128)
    #[argh(option, default = "128")]
    max_tokens: usize,
    /// user message sent (default: a short story request)
    #[argh(
        option,
        default = "String::from(\"Write a long story about a lighthouse keeper.\")"
    )]
    prompt: String,
    /// model name sent in requests (default: sluice)
    #[argh(option, default = "String::from(\"sluice\")")]
    model: String,
    /// per-request socket timeout in seconds (default: 300)
    #[argh(option, default = "300")]
    timeout_s: u64,
}

/// Latencies in microseconds, up to an hour.
fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid bounds")
}

struct RequestResult {
    ttft: Duration,
    tokens: usize,
    decode_time: Duration,
}

fn one_request(
    addr: std::net::SocketAddr,
    path: &str,
    body: &[u8],
    timeout: Duration,
) -> Result<RequestResult, String> {
    let start = Instant::now();
    let mut sse = Sse::open(addr, path, body, timeout).map_err(|e| e.to_string())?;
    if sse.status != 200 {
        let status = sse.status;
        let body = sse.error_body().unwrap_or_default();
        return Err(format!(
            "status {status}: {}",
            String::from_utf8_lossy(&body)
        ));
    }
    let mut first = None;
    let mut last = start;
    let mut tokens = 0;
    while let Some(v) = sse.next_json().map_err(|e| e.to_string())? {
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            tokens = n as usize;
            continue;
        }
        let choice = &v["choices"][0];
        if choice["delta"]["content"]
            .as_str()
            .is_some_and(|t| !t.is_empty())
        {
            first.get_or_insert_with(Instant::now);
        }
        // The finish chunk follows the last token at once, even when that
        // token had no visible text.
        if choice["finish_reason"].is_string() {
            last = Instant::now();
        }
    }
    let first = first.ok_or("no tokens received")?;
    Ok(RequestResult {
        ttft: first - start,
        tokens,
        decode_time: last - first,
    })
}

fn main() {
    let args: Args = argh::from_env();
    let (addr, prefix) = match parse_url(&args.url) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("sluice-bench: {e}");
            std::process::exit(2);
        }
    };
    let path = format!("{prefix}/v1/chat/completions");
    // The token count comes from the usage chunk, so that tokens with no visible
    // text are counted without asking for logprobs (which cost the server work).
    let body = json!({
        "model": args.model,
        "messages": [{"role": "user", "content": args.prompt}],
        "max_tokens": args.max_tokens, "ignore_eos": true, "temperature": 0,
        "stream": true, "stream_options": {"include_usage": true},
    })
    .to_string();
    let timeout = Duration::from_secs(args.timeout_s);
    let started = Instant::now();
    let handles: Vec<_> = (0..args.concurrency)
        .map(|_| {
            let (path, body) = (path.clone(), body.clone());
            let n = args.requests;
            std::thread::spawn(move || {
                (0..n)
                    .map(|_| one_request(addr, &path, body.as_bytes(), timeout))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let results: Vec<Result<RequestResult, String>> = handles
        .into_iter()
        .flat_map(|h| h.join().expect("client thread"))
        .collect();
    let wall = started.elapsed();

    let mut ttft = histogram();
    let mut rates = Vec::new();
    let mut tokens = 0;
    let mut errors = 0;
    for r in &results {
        match r {
            Ok(r) => {
                ttft.saturating_record(r.ttft.as_micros() as u64);
                tokens += r.tokens;
                if r.tokens > 1 && !r.decode_time.is_zero() {
                    rates.push((r.tokens - 1) as f64 / r.decode_time.as_secs_f64());
                }
            }
            Err(e) => {
                errors += 1;
                eprintln!("sluice-bench: request failed: {e}");
            }
        }
    }
    rates.sort_by(f64::total_cmp);
    let median = |v: &[f64]| if v.is_empty() { 0.0 } else { v[v.len() / 2] };
    let aggregate = tokens as f64 / wall.as_secs_f64();
    println!(
        "concurrency {}: {} requests ({} failed), {tokens} tokens in {:.1} s",
        args.concurrency,
        results.len(),
        errors,
        wall.as_secs_f64()
    );
    println!(
        "  per-stream decode rate: median {:.1} tok/s (min {:.1}, max {:.1})",
        median(&rates),
        rates.first().unwrap_or(&0.0),
        rates.last().unwrap_or(&0.0)
    );
    println!("  aggregate: {aggregate:.1} tok/s (tokens / wall time, including prefill)");
    println!(
        "  TTFT: p50 {:.0} ms, max {:.0} ms",
        ttft.value_at_quantile(0.5) as f64 / 1e3,
        ttft.max() as f64 / 1e3
    );
    println!(
        "{}",
        json!({"concurrency": args.concurrency, "requests": results.len(), "failed": errors, "tokens": tokens,
               "wall_s": wall.as_secs_f64(), "aggregate_tok_s": aggregate, "decode_tok_s_median": median(&rates),
               "ttft_ms_p50": ttft.value_at_quantile(0.5) as f64 / 1e3})
    );
    if errors > 0 {
        std::process::exit(1);
    }
}
