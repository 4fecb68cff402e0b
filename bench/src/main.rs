//! `sluice-bench SCENARIO [flags]`: load for sluice or any OpenAI-compatible
//! server, reported as a table, a JSON file and an SVG plot (the sweep; a
//! timeline for the open and closed loops and for hol).

use argh::FromArgs;
use serde_json::{json, Value};
use sluice_bench::arrivals::Phase;
use sluice_bench::client::Target;
use sluice_bench::hol::{HolConfig, HolReport};
use sluice_bench::http::parse_url;
use sluice_bench::plot::{hol_svg, sweep_svg, timeline_svg, Point};
use sluice_bench::runner::{closed_loop, open_loop, Report, RunConfig};
use sluice_bench::stats::{Kind, Slo, Stats};
use sluice_bench::workload::{Dist, Retry, Workload};
use std::time::Duration;

/// Long prompts of the `long-prompts` mix: near the default model's 8192 context.
const LONG_PROMPT_TOKENS_DEFAULT: u64 = 7000;
/// The head-of-line figure: a ~6,000-token prompt, among streams long enough to
/// outlast its prefill (which, kept to the ITL target beside them, takes
/// minutes on a 2-core box). All of it must fit the server's KV cells:
/// 2 x (prompt + 3,000) + 6,000 needs `sluice serve --ctx 16384`.
const HOL_LONG_PROMPT_TOKENS: u64 = 6000;
const HOL_STREAM_MAX_TOKENS_DEFAULT: u64 = 3000;
const HOL_WARM_TOKENS: usize = 8;

/// Offered load of each `sweep` point, as a multiple of the capacity.
const SWEEP_MULTIPLES: [f64; 9] = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0];

#[derive(FromArgs, Clone)]
/// Load harness for sluice and any OpenAI-compatible server (streaming chat).
///
/// Scenarios: capacity (closed loop at --concurrency: the sustainable request
/// rate), overload (open loop: 0.5x capacity, then a step to 2x), hol (the
/// head-of-line figure: --hol-streams chat streams running while one prompt of
/// --long-prompt-tokens arrives), long-prompts (chat traffic with a share of
/// long prompts), slow-readers, disconnects, sweep (0.25x to 3x
/// capacity, with an SVG plot of goodput and p99 TTFT), run (open loop at
/// --rate), closed (closed loop at --concurrency), conversation (--turns turns
/// of one chat that re-sends its history, after a system prompt of
/// --system-tokens: time to first token per turn). Scenarios that need the
/// capacity measure it first unless --capacity is given. `plot` sends no load:
/// it redraws the SVG of the sweep report named by --out.
struct Args {
    /// capacity, overload, hol, long-prompts, slow-readers, disconnects, sweep,
    /// run, closed, conversation or plot
    #[argh(positional)]
    scenario: String,
    /// server base URL (default: http://127.0.0.1:8080)
    #[argh(option, default = "String::from(\"http://127.0.0.1:8080\")")]
    url: String,
    /// model name sent in requests (default: sluice)
    #[argh(option, default = "String::from(\"sluice\")")]
    model: String,
    /// do not send ignore_eos (for servers that refuse unknown fields); answers
    /// then end where the model stops rather than at max_tokens
    #[argh(switch)]
    no_ignore_eos: bool,
    /// extra request header, 'Name: value' (repeatable), e.g. 'X-Priority: batch'
    #[argh(option)]
    header: Vec<String>,
    /// sampling temperature sent (default: 0.7; 0 is greedy)
    #[argh(option, default = "0.7")]
    temperature: f64,
    /// seconds per phase or sweep point (default: 60)
    #[argh(option, default = "60.0")]
    duration_s: f64,
    /// arrival rate in requests/s for `run` (default: 1)
    #[argh(option, default = "1.0")]
    rate: f64,
    /// clients of the closed loop (`closed`, and the capacity measurement; default: 4)
    #[argh(option, default = "4")]
    concurrency: usize,
    /// known capacity in requests/s; skips measuring it
    #[argh(option)]
    capacity: Option<f64>,
    /// seconds the capacity measurement runs (default: 30)
    #[argh(option, default = "30.0")]
    capacity_duration_s: f64,
    /// most client threads of the open loop; arrivals beyond are counted as
    /// client overflow (default: 64)
    #[argh(option, default = "64")]
    clients: usize,
    /// prompt length in tokens: fixed:N, uniform:LO:HI, exp:MEAN or
    /// lognormal:MEDIAN:SIGMA:LO:HI (default: uniform:20:200)
    #[argh(option, default = "String::from(\"uniform:20:200\")")]
    prompt_tokens: String,
    /// max_tokens per request, same forms (default: uniform:32:128)
    #[argh(option, default = "String::from(\"uniform:32:128\")")]
    max_tokens: String,
    /// every request sends the same prompt (what a prompt cache serves)
    #[argh(switch)]
    repeat_prompt: bool,
    /// tokens of the conversation's system prompt (default: 1500)
    #[argh(option, default = "1500")]
    system_tokens: u64,
    /// turns of the conversation (default: 5)
    #[argh(option, default = "5")]
    turns: usize,
    /// max_tokens of each conversation answer (default: 64)
    #[argh(option, default = "64")]
    answer_tokens: u64,
    /// share of requests with a long prompt (default: 0; long-prompts: 0.05)
    #[argh(option)]
    long_share: Option<f64>,
    /// tokens of a long prompt (default: 7000, near the default model's 8192
    /// context; hol: 6000)
    #[argh(option)]
    long_prompt_tokens: Option<u64>,
    /// chat streams running while the long prompt arrives, for hol (default: 2)
    #[argh(option, default = "2")]
    hol_streams: usize,
    /// max_tokens of each hol stream (default: 3000; with the long prompt, the
    /// server needs the KV cells for all of them: --ctx 16384)
    #[argh(option)]
    hol_stream_tokens: Option<u64>,
    /// share of clients that read slowly (default: 0; slow-readers: 0.25)
    #[argh(option)]
    slow_share: Option<f64>,
    /// read rate of a slow client in tokens/s (default: 5)
    #[argh(option, default = "5.0")]
    slow_read_tok_s: f64,
    /// share of clients that hang up mid-stream (default: 0; disconnects: 0.3)
    #[argh(option)]
    disconnect_share: Option<f64>,
    /// tokens a hanging-up client reads first (default: 8)
    #[argh(option, default = "8")]
    disconnect_after: u64,
    /// seconds a client waits for its whole answer before giving up (default: 60)
    #[argh(option, default = "60.0")]
    timeout_s: f64,
    /// after 429/503: none, or retry-after (wait Retry-After plus jitter) (default: none)
    #[argh(option, default = "String::from(\"none\")")]
    retry: String,
    /// most retries per request with --retry retry-after (default: 3)
    #[argh(option, default = "3")]
    retry_max: u32,
    /// longest wait before a retry, in seconds (default: 10)
    #[argh(option, default = "10.0")]
    retry_cap_s: f64,
    /// JSON file with workload keys (prompt_tokens, max_tokens, long_share,
    /// long_prompt_tokens, slow_share, slow_read_tok_s, disconnect_share,
    /// disconnect_after_tokens, timeout_s); they override the flags
    #[argh(option)]
    workload: Option<String>,
    /// SLO for goodput: time to first token in ms (default: 5000)
    #[argh(option, default = "5000")]
    slo_ttft_ms: u64,
    /// SLO for goodput: mean time between tokens in ms (default: 250)
    #[argh(option, default = "250")]
    slo_itl_ms: u64,
    /// seed of arrivals and workload draws (default: 1)
    #[argh(option, default = "1")]
    seed: u64,
    /// PID of the server, to sample its memory and thread count (same machine)
    #[argh(option)]
    pid: Option<u32>,
    /// JSON report file (default: sluice-bench-SCENARIO.json)
    #[argh(option)]
    out: Option<String>,
    /// sweep points as multiples of the capacity, comma-separated (default:
    /// 0.25,0.5,0.75,1,1.25,1.5,2,2.5,3)
    #[argh(option)]
    multiples: Option<String>,
    /// SVG plot file (sweep, overload and the other open and closed loops,
    /// hol; default: the report's name with .svg)
    #[argh(option)]
    plot: Option<String>,
    /// no progress line
    #[argh(switch)]
    quiet: bool,
}

fn main() {
    let args: Args = argh::from_env();
    if let Err(e) = run(args) {
        eprintln!("sluice-bench: error: {e}");
        std::process::exit(2);
    }
}

fn positive(flag: &str, v: f64) -> Result<f64, String> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(format!("{flag} must be positive"))
    }
}

fn run(a: Args) -> Result<(), String> {
    if a.scenario == "plot" {
        return replot(&a);
    }
    let (addr, prefix) = parse_url(&a.url).map_err(|e| e.to_string())?;
    let duration = Duration::from_secs_f64(positive("--duration-s", a.duration_s)?);
    let scenario = a.scenario.as_str();
    let (long_d, slow_d, disc_d) = match scenario {
        "long-prompts" => (0.05, 0.0, 0.0),
        "slow-readers" => (0.0, 0.25, 0.0),
        "disconnects" => (0.0, 0.0, 0.3),
        "capacity" | "overload" | "sweep" | "run" | "closed" | "hol" | "conversation" => {
            (0.0, 0.0, 0.0)
        }
        other => return Err(format!("unknown scenario '{other}' (see --help)")),
    };
    let mut workload = Workload {
        prompt_tokens: Dist::parse(&a.prompt_tokens)?,
        max_tokens: Dist::parse(&a.max_tokens)?,
        long_share: a.long_share.unwrap_or(long_d),
        long_prompt_tokens: a.long_prompt_tokens.unwrap_or(LONG_PROMPT_TOKENS_DEFAULT),
        slow_share: a.slow_share.unwrap_or(slow_d),
        slow_read_tok_s: a.slow_read_tok_s,
        disconnect_share: a.disconnect_share.unwrap_or(disc_d),
        disconnect_after_tokens: a.disconnect_after,
        timeout: Duration::from_secs_f64(positive("--timeout-s", a.timeout_s)?),
        retry: Retry::parse(
            &a.retry,
            a.retry_max,
            Duration::from_secs_f64(a.retry_cap_s.max(0.0)),
        )?,
        repeat_prompt: a.repeat_prompt,
    };
    if let Some(path) = &a.workload {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| format!("{path}: {e}"))?;
        workload
            .apply_json(&v)
            .map_err(|e| format!("{path}: {e}"))?;
    }
    workload.check()?;
    if a.clients == 0 || a.concurrency == 0 {
        return Err("--clients and --concurrency must be at least 1".into());
    }
    let cfg = RunConfig {
        target: Target {
            addr,
            prefix,
            model: a.model.clone(),
            ignore_eos: !a.no_ignore_eos,
            temperature: a.temperature,
            headers: a
                .header
                .iter()
                .map(|h| {
                    h.split_once(':')
                        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                        .ok_or_else(|| format!("--header '{h}' is not 'Name: value'"))
                })
                .collect::<Result<_, _>>()?,
        },
        workload,
        slo: Slo {
            ttft: Duration::from_millis(a.slo_ttft_ms),
            itl: Duration::from_millis(a.slo_itl_ms),
        },
        clients_max: a.clients,
        seed: a.seed,
        pid: a.pid,
        quiet: a.quiet,
    };

    let needs_capacity = matches!(
        scenario,
        "capacity" | "overload" | "long-prompts" | "slow-readers" | "disconnects" | "sweep"
    );
    let mut capacity_report = Value::Null;
    let capacity = match (needs_capacity, a.capacity) {
        (false, _) => None,
        (true, Some(c)) if scenario != "capacity" => Some(positive("--capacity", c)?),
        (true, _) => {
            eprintln!(
                "sluice-bench: measuring capacity: closed loop, {} clients, {} s",
                a.concurrency, a.capacity_duration_s
            );
            // Capacity is measured with fast, well-behaved clients.
            let mut plain = cfg.clone();
            plain.workload.long_share = 0.0;
            plain.workload.slow_share = 0.0;
            plain.workload.disconnect_share = 0.0;
            let d =
                Duration::from_secs_f64(positive("--capacity-duration-s", a.capacity_duration_s)?);
            let r = closed_loop(&plain, a.concurrency, d);
            let s = &r.phases[0].1;
            let c = s.count(Kind::Completed) as f64 / r.wall.as_secs_f64();
            print_table("capacity (closed loop)", &r);
            eprintln!("sluice-bench: capacity {c:.3} requests/s");
            capacity_report = r.to_json();
            capacity_report["capacity_rps"] = json!(c);
            if c <= 0.0 {
                return Err("no request completed while measuring capacity".into());
            }
            Some(c)
        }
    };

    let phases_at = |mults: &[(f64, f64)]| -> Vec<Phase> {
        let c = capacity.expect("scenario has a capacity");
        mults
            .iter()
            .map(|&(m, share)| Phase {
                rate_per_s: m * c,
                duration: duration.mul_f64(share),
            })
            .collect()
    };
    let mut result = json!({});
    match scenario {
        "capacity" => {}
        "run" => {
            let r = open_loop(
                &cfg,
                &[Phase {
                    rate_per_s: positive("--rate", a.rate)?,
                    duration,
                }],
            );
            print_table("run (open loop)", &r);
            write_timeline(&a, "run (open loop)", &r)?;
            result = r.to_json();
        }
        "closed" => {
            let r = closed_loop(&cfg, a.concurrency, duration);
            print_table("closed loop", &r);
            write_timeline(&a, &format!("closed loop, {} clients", a.concurrency), &r)?;
            result = r.to_json();
        }
        // A step: a third of the time at half the capacity, then twice the capacity.
        "overload" => {
            let r = open_loop(&cfg, &phases_at(&[(0.5, 1.0 / 3.0), (2.0, 2.0 / 3.0)]));
            print_table("overload (0.5x, then 2x capacity)", &r);
            write_timeline(&a, "overload: 0.5x, then 2x capacity", &r)?;
            result = r.to_json();
        }
        "hol" => {
            let hol = HolConfig {
                streams: a.hol_streams.max(1),
                stream_max_tokens: a.hol_stream_tokens.unwrap_or(HOL_STREAM_MAX_TOKENS_DEFAULT),
                warm_tokens: HOL_WARM_TOKENS,
                long_prompt_tokens: a.long_prompt_tokens.unwrap_or(HOL_LONG_PROMPT_TOKENS),
                // A CPU prefills 6,000 tokens in about a minute; allow ten.
                timeout: Duration::from_secs_f64(positive("--timeout-s", a.timeout_s)?.max(600.0)),
            };
            eprintln!(
                "sluice-bench: hol: {} streams running, then one prompt of ~{} tokens",
                hol.streams, hol.long_prompt_tokens
            );
            let r = sluice_bench::hol::run(&cfg.target, &hol)?;
            print_hol(&r);
            let title = format!(
                "head of line: {} streams, then a prompt of {} tokens",
                hol.streams,
                r.long_prompt_tokens.unwrap_or(hol.long_prompt_tokens)
            );
            write_svg(
                &a,
                &hol_svg(&title, &r.stream_times_s, r.long_sent_s, r.long_first_s),
            )?;
            result = r.to_json();
        }
        "conversation" => {
            let conv = sluice_bench::conversation::ConversationConfig {
                system_tokens: a.system_tokens,
                turns: a.turns.max(1),
                answer_tokens: a.answer_tokens.max(1),
                seed: a.seed,
                timeout: Duration::from_secs_f64(positive("--timeout-s", a.timeout_s)?.max(600.0)),
            };
            let turns = sluice_bench::conversation::run(&cfg.target, &conv)?;
            println!(
                "\nconversation: system prompt ~{} tokens, {} turns",
                conv.system_tokens, conv.turns
            );
            println!(
                "{:>5} {:>10} {:>10} {:>8} {:>8}",
                "turn", "ttft ms", "total ms", "prompt", "cached"
            );
            let opt = |v: Option<u64>| v.map_or("-".to_string(), |n| n.to_string());
            for (i, t) in turns.iter().enumerate() {
                println!(
                    "{:>5} {:>10.0} {:>10.0} {:>8} {:>8}",
                    i + 1,
                    t.ttft.as_secs_f64() * 1e3,
                    t.total.as_secs_f64() * 1e3,
                    opt(t.prompt_tokens),
                    opt(t.cached_tokens)
                );
            }
            result = sluice_bench::conversation::to_json(&turns);
        }
        "long-prompts" | "slow-readers" | "disconnects" => {
            let r = open_loop(&cfg, &phases_at(&[(0.7, 1.0)]));
            let title = format!("{scenario} at 0.7x capacity");
            print_table(&title, &r);
            write_timeline(&a, &title, &r)?;
            result = r.to_json();
        }
        "sweep" => {
            let mut points = Vec::new();
            let mut rows = Vec::new();
            let multiples: Vec<f64> = match &a.multiples {
                None => SWEEP_MULTIPLES.to_vec(),
                Some(list) => list
                    .split(',')
                    .map(|m| {
                        m.trim()
                            .parse::<f64>()
                            .ok()
                            .filter(|m| m.is_finite() && *m > 0.0)
                            .ok_or(format!("--multiples: '{m}' is not a positive number"))
                    })
                    .collect::<Result<_, _>>()?,
            };
            for m in multiples {
                eprintln!("sluice-bench: sweep point {m}x capacity");
                let r = open_loop(&cfg, &phases_at(&[(m, 1.0)]));
                print_table(&format!("sweep {m}x capacity"), &r);
                let (phase, stats) = &r.phases[0];
                points.push(Point {
                    offered_rps: phase.rate_per_s,
                    goodput_rps: stats.good as f64 / phase.duration.as_secs_f64(),
                    ttft_p99_s: (!stats.ttft.is_empty())
                        .then(|| stats.ttft.value_at_quantile(0.99) as f64 / 1e6),
                });
                let mut j = r.to_json();
                j["multiple"] = json!(m);
                rows.push(j);
            }
            write_plot(&a, &points)?;
            result = json!({"points": rows});
        }
        _ => unreachable!("scenario checked above"),
    }

    let report = json!({
        "scenario": scenario,
        "params": params_json(&a, &cfg),
        "capacity_rps": capacity,
        "capacity_measurement": capacity_report,
        "result": result,
    });
    let out = report_path(&a);
    let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
    std::fs::write(&out, text).map_err(|e| format!("{out}: {e}"))?;
    eprintln!("sluice-bench: report written to {out}");
    Ok(())
}

fn plot_path(a: &Args) -> String {
    a.plot
        .clone()
        .unwrap_or_else(|| report_path(a).trim_end_matches(".json").to_string() + ".svg")
}

/// The open or closed loop's timeline, beside its report.
fn write_timeline(a: &Args, title: &str, r: &sluice_bench::runner::Report) -> Result<(), String> {
    let mut ends = Vec::new();
    let mut t = 0.0;
    for (p, _) in &r.phases {
        t += p.duration.as_secs_f64();
        ends.push(t);
    }
    write_svg(a, &timeline_svg(title, &r.arrivals, &r.depth, &ends))
}

fn write_svg(a: &Args, svg: &str) -> Result<(), String> {
    let plot = plot_path(a);
    std::fs::write(&plot, svg).map_err(|e| format!("{plot}: {e}"))?;
    eprintln!("sluice-bench: plot written to {plot}");
    Ok(())
}

fn write_plot(a: &Args, points: &[Point]) -> Result<(), String> {
    let plot = plot_path(a);
    let title = format!("{}: goodput and p99 TTFT vs offered load", a.url);
    std::fs::write(&plot, sweep_svg(&title, points)).map_err(|e| format!("{plot}: {e}"))?;
    eprintln!("sluice-bench: plot written to {plot}");
    Ok(())
}

/// Redraws a sweep's plot from its JSON report (`--out`, default the sweep's).
fn replot(a: &Args) -> Result<(), String> {
    let path = a
        .out
        .clone()
        .unwrap_or_else(|| "sluice-bench-sweep.json".into());
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
    let report: Value = serde_json::from_str(&text).map_err(|e| format!("{path}: {e}"))?;
    let rows = report["result"]["points"]
        .as_array()
        .ok_or(format!("{path} is not a sweep report"))?;
    let points: Vec<Point> = rows
        .iter()
        .map(|r| {
            let p = &r["phases"][0];
            Point {
                offered_rps: p["offered_rps"].as_f64().unwrap_or(0.0),
                goodput_rps: p["goodput_rps"].as_f64().unwrap_or(0.0),
                ttft_p99_s: p["ttft"]["p99_ms"].as_f64().map(|ms| ms / 1e3),
            }
        })
        .collect();
    let url = report["params"]["url"].as_str().unwrap_or("").to_string();
    write_plot(
        &Args {
            url,
            out: Some(path),
            ..a.clone()
        },
        &points,
    )
}

fn report_path(a: &Args) -> String {
    a.out
        .clone()
        .unwrap_or_else(|| format!("sluice-bench-{}.json", a.scenario))
}

fn params_json(a: &Args, cfg: &RunConfig) -> Value {
    let w = &cfg.workload;
    json!({
        "url": a.url, "model": a.model, "ignore_eos": cfg.target.ignore_eos, "temperature": a.temperature,
        "duration_s": a.duration_s, "rate": a.rate, "concurrency": a.concurrency,
        "capacity": a.capacity, "capacity_duration_s": a.capacity_duration_s, "clients": a.clients,
        "prompt_tokens": format!("{:?}", w.prompt_tokens), "max_tokens": format!("{:?}", w.max_tokens),
        "long_share": w.long_share, "long_prompt_tokens": w.long_prompt_tokens,
        "slow_share": w.slow_share, "slow_read_tok_s": w.slow_read_tok_s,
        "disconnect_share": w.disconnect_share, "disconnect_after_tokens": w.disconnect_after_tokens,
        "timeout_s": w.timeout.as_secs_f64(), "retry": format!("{:?}", w.retry),
        "slo_ttft_ms": a.slo_ttft_ms, "slo_itl_ms": a.slo_itl_ms, "seed": a.seed, "pid": a.pid,
        "workload_file": a.workload, "repeat_prompt": w.repeat_prompt,
    })
}

fn print_table(title: &str, r: &Report) {
    let ms = |h: &hdrhistogram::Histogram<u64>, q: f64| {
        if h.is_empty() {
            "-".to_string()
        } else {
            format!("{:.0}", h.value_at_quantile(q) as f64 / 1e3)
        }
    };
    println!("\n{title}  (wall {:.1} s)", r.wall.as_secs_f64());
    println!(
        "{:>9} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6} {:>8} {:>8} {:>8} {:>7} {:>7} {:>8}",
        "offered",
        "reqs",
        "done",
        "429",
        "503",
        "t/o",
        "ovfl",
        "goodput",
        "ttft50",
        "ttft99",
        "itl50",
        "itl99",
        "tok/s"
    );
    for (phase, s) in &r.phases {
        let secs = phase.duration.as_secs_f64();
        let offered = if phase.rate_per_s.is_nan() {
            "closed".to_string()
        } else {
            format!("{:.2}/s", phase.rate_per_s)
        };
        row(&offered, s, secs, &ms);
    }
    if !r.server_metrics.is_null() {
        println!("server /metrics delta: {}", r.server_metrics);
    }
    if !r.target.is_null() {
        println!("server process: {}", r.target);
    }
}

fn print_hol(r: &HolReport) {
    println!(
        "\nhead-of-line: long prompt of {} tokens: status {}, time to first token {:.2} s",
        r.long_prompt_tokens
            .map_or("?".to_string(), |n| n.to_string()),
        r.long_status,
        r.long_ttft.as_secs_f64()
    );
    if !r.streams_outlasted_prefill {
        println!("warning: a stream ended before the prefill did; the gaps cover part of it");
    }
    println!(
        "{:<28} {:>6} {:>9} {:>9} {:>9}",
        "gaps between stream tokens", "count", "p50 ms", "p99 ms", "max ms"
    );
    for (name, g) in [
        ("before the long prompt", &r.before),
        ("during its prefill", &r.during),
    ] {
        println!(
            "{:<28} {:>6} {:>9.1} {:>9.1} {:>9.1}",
            name, g.count, g.p50_ms, g.p99_ms, g.max_ms
        );
    }
    if let Some(during) = r.steal_during_ms {
        // The host's steal from this box's CPUs (a VM): a gap it stretched
        // is not the server's.
        let around = r
            .steal_in_largest_gap_ms
            .map_or("?".to_string(), |ms| format!("{ms:.0}"));
        println!(
            "steal (CPU time the host took from this box): {during:.0} ms during the prefill, {around} ms around its largest gap"
        );
    }
}

fn row(
    offered: &str,
    s: &Stats,
    secs: f64,
    ms: &dyn Fn(&hdrhistogram::Histogram<u64>, f64) -> String,
) {
    println!(
        "{:>9} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6} {:>7.2}/s {:>8} {:>8} {:>7} {:>7} {:>8.1}",
        offered,
        s.total(),
        s.count(Kind::Completed),
        s.count(Kind::Rejected),
        s.count(Kind::Shed),
        s.count(Kind::Timeout),
        s.count(Kind::Overflow),
        s.good as f64 / secs,
        ms(&s.ttft, 0.5),
        ms(&s.ttft, 0.99),
        ms(&s.itl, 0.5),
        ms(&s.itl, 0.99),
        s.tokens as f64 / secs,
    );
}
