//! The command line as argh defines it (`sluice`, `serve`, `calibrate`),
//! the environment variables derived from it, and the parsers of its
//! enumerated values. `Config::from_args` checks what it parsed.

use super::*;
use argh::FromArgs;

#[derive(FromArgs, Debug)]
/// sluice: a CPU-only LLM server whose every stage can say no, in time.
pub struct Cli {
    /// print the version, git commit and the CPU features llama.cpp was built with
    #[argh(switch)]
    pub version: bool,
    #[argh(subcommand)]
    pub command: Option<Command>,
}

// Parsed once at start-up, so its size does not matter, and argh cannot box a
// subcommand.
#[allow(clippy::large_enum_variant)]
#[derive(FromArgs, Debug)]
#[argh(subcommand)]
pub enum Command {
    Serve(ServeArgs),
    Calibrate(CalibrateArgs),
}

#[derive(FromArgs, Debug)]
/// Serve the OpenAI-compatible API.
#[argh(subcommand, name = "serve")]
pub struct ServeArgs {
    /// GGUF model file (default: models/SmolLM2-135M-Instruct.Q4_1.gguf)
    #[argh(option, default = "PathBuf::from(MODEL_PATH_DEFAULT)")]
    pub model: PathBuf,
    /// model name reported by the API (default: the file name without .gguf)
    #[argh(option)]
    pub model_name: Option<String>,
    /// jinja chat template file to use instead of the model's own (default:
    /// the GGUF's tokenizer.chat_template; ChatML if it has none)
    #[argh(option)]
    pub chat_template_file: Option<PathBuf>,
    /// how /v1/embeddings pools a text's token states into its vector: gguf
    /// (the model's own pooling_type; a generative model's GGUF has none,
    /// and then /v1/embeddings refuses), mean, cls, last, or none
    /// (default: gguf)
    #[argh(option, default = "PoolingSetting::Gguf", from_str_fn(parse_pooling))]
    pub pooling: PoolingSetting,
    /// log lines: text (one line of text each) or json (one JSON object
    /// each: time, msg, and a request's fields) (default: text)
    #[argh(option, default = "LogFormat::Text", from_str_fn(parse_log_format))]
    pub log_format: LogFormat,
    /// address to listen on (default: 127.0.0.1)
    #[argh(option, default = "String::from(\"127.0.0.1\")")]
    pub host: String,
    /// port to listen on (default: 8080; 0 picks a free port and logs it)
    #[argh(option, default = "8080")]
    pub port: u16,
    /// compute threads (default: the cores this process may use, from its
    /// affinity mask and CPU quota)
    #[argh(option)]
    pub threads: Option<usize>,
    /// KV cache size in tokens, shared by all sequences (default: the model's
    /// training context, at most 8192)
    #[argh(option)]
    pub ctx: Option<usize>,
    /// sequences decoded together (continuous batching; default: 4)
    #[argh(option, default = "4")]
    pub parallel: usize,
    /// memory for the prefix cache in MiB: finished sequences' KV state, for
    /// requests that start with the same tokens (least recently used evicted
    /// first; 0 turns it off) (default: 96)
    #[argh(option, default = "crate::engine::prefix::PREFIX_CACHE_MB_DEFAULT")]
    pub prefix_cache_mb: usize,
    /// KV cache type: measure (what --calibrate-only timed fastest with the
    /// flash attention setting, kept in the calibration cache; until then
    /// q8_0/f16, or q8_0 with flash attention on), f16, q8_0/f16 (K in q8_0,
    /// V in f16: 3/4 of the memory), or q8_0 (half the memory; needs flash
    /// attention) (default: measure)
    #[argh(
        option,
        default = "KvTypeSetting::Measure",
        from_str_fn(parse_kv_type_setting)
    )]
    pub kv_type: KvTypeSetting,
    /// KV layout: per-seq (each sequence attends over its own cells, in a
    /// stream of --ctx cells of its own) or unified (one pool of --ctx cells
    /// that every sequence's attention spans) (default: per-seq)
    #[argh(
        option,
        default = "KvLayout::PerSequence",
        from_str_fn(parse_kv_layout)
    )]
    pub kv_layout: KvLayout,
    /// a second llama context, flash attention on and an f16 cache, for the
    /// requests whose prompt and max_tokens fit this many cells; the rest run
    /// in the main one (0: none). Only per-seq; not when the main context has
    /// that pairing already (default: 1024 when --flash-attn and --kv-type are
    /// measure, else 0)
    #[argh(option)]
    pub short_cells: Option<usize>,
    /// flash attention: measure (what --calibrate-only timed faster on this
    /// machine, kept in the calibration cache, then what the tokens served
    /// favour at later starts; until then off), off, on, or auto (llama.cpp
    /// decides: on for the CPU) (default: measure)
    #[argh(
        option,
        default = "FlashAttnSetting::Measure",
        from_str_fn(parse_flash_attn_setting)
    )]
    pub flash_attn: FlashAttnSetting,
    /// inter-token latency target in ms: a step with running streams takes only
    /// as many prefill tokens as keep it within this (default: 150)
    #[argh(option, default = "150")]
    pub itl_target_ms: u64,
    /// longest pause a running stream may see so that a short prompt is
    /// prefilled whole in one step (its first token at once, not after many
    /// chunks), taken only while every stream keeps its k-th token within k
    /// --itl-target-ms and one such pause of its first; with no stream
    /// running, the longest step of prefill; 0 chunks every prompt under the
    /// target and lets prefill alone take 512-token steps (default: 3000)
    #[argh(option, default = "3000")]
    pub itl_max_ms: u64,
    /// longest chunk, in ms, of a long prompt prefilled beside running
    /// streams in chunks larger than --itl-target-ms allows: the streams
    /// first decode tokens ahead for as long, which go out at the target's
    /// pace while the chunk runs; 0 chunks every prompt beside streams under
    /// the target (default: 1000)
    #[argh(option, default = "1000")]
    pub decode_ahead_ms: u64,
    /// a prompt that has held its slot this many times its prefill's
    /// forecast (and at least its class's W_max) without its first token goes
    /// first on every other step, so shorter prompts overtake it no longer
    /// than that; 0: from W_max (default: 2)
    #[argh(option, default = "2.0")]
    pub overdue_stretch: f64,
    /// a fixed number of tokens per engine step (decode tokens first, then
    /// prefill chunks), instead of the budget derived from --itl-target-ms
    #[argh(option)]
    pub step_tokens: Option<usize>,
    /// queueing budget for time to first token, in ms: the queue holds what this
    /// machine serves in that time (Little's law); given explicitly, it is also
    /// a deadline: a request that waited past half of it starts only if its
    /// first token can still come within it (default: 5000, which sizes the
    /// queue only)
    #[argh(option)]
    pub queue_wait_ms: Option<u64>,
    /// queueing budget for time to first token of batch requests (X-Priority:
    /// batch), in ms: their own queue, bound and sojourn target follow from it
    /// (default: 60000)
    #[argh(option, default = "60_000")]
    pub batch_queue_wait_ms: u64,
    /// slots batch requests may never hold, kept for interactive ones
    /// (default: 1, or 0 with --parallel 1)
    #[argh(option)]
    pub interactive_slots: Option<usize>,
    /// anti-starvation: while both classes wait, at least one slot start in
    /// this many goes to a batch request (default: 8)
    #[argh(option, default = "8")]
    pub batch_every: u32,
    /// per-client rate limit in tokens of work (prompt + max_tokens) per
    /// second; clients are API keys, or addresses without one (default: off)
    #[argh(option)]
    pub client_rate: Option<f64>,
    /// per-client bucket size in tokens of work (default: 60 s of --client-rate)
    #[argh(option)]
    pub client_burst: Option<u64>,
    /// most clients whose buckets are kept; the one used longest ago makes room
    /// (default: 4096)
    #[argh(option, default = "4096")]
    pub client_table_max: usize,
    /// addresses or networks of proxies (comma-separated: 127.0.0.1,
    /// 10.0.0.0/8) whose X-Forwarded-For names the client, for per-client
    /// rate limits by address, and whose gateway fairness id is the client
    /// (default: none)
    #[argh(option)]
    pub trusted_proxies: Option<String>,
    /// TCP port of HAProxy's agent check (on --host): each connection gets
    /// one line, 'drain' while stopping, else 'ready N%' with N the headroom
    /// left (default: off)
    #[argh(option)]
    pub agent_port: Option<u16>,
    /// inference objectives (comma-separated names) whose requests are
    /// sheddable: a gateway's x-gateway-inference-objective naming one of
    /// them puts the request in the batch class (default: none)
    #[argh(option)]
    pub batch_objectives: Option<String>,
    /// file of API keys, one '<name> <key> [rate=N] [burst=N]' per line:
    /// requests without a known key get 401 (default: none, no keys needed)
    #[argh(option)]
    pub api_key_file: Option<PathBuf>,
    /// requests that may wait for a slot, instead of the derived bound (at most 9)
    #[argh(option)]
    pub queue_depth: Option<usize>,
    /// allow --queue-depth above 9 (waits past any useful budget; for comparisons)
    #[argh(switch)]
    pub queue_depth_unsafe: bool,
    /// never shed on queue sojourn (for comparisons)
    #[argh(switch)]
    pub no_shed: bool,
    /// prompt tokens that may wait ahead of any request that must wait for a
    /// slot, instead of mu_prefill x W_max beyond one waiting per slot
    #[argh(option)]
    pub queued_tokens_max: Option<usize>,
    /// sojourn target in ms (CoDel): not ready while requests wait longer than
    /// this; given explicitly (or with --queue-wait-ms), also shed while they
    /// do for a whole interval (default: half of --queue-wait-ms; batch
    /// requests: half of --batch-queue-wait-ms)
    #[argh(option)]
    pub shed_target_ms: Option<u64>,
    /// interval in ms over which the sojourn must stay above target before
    /// shedding (CoDel; default: --queue-wait-ms)
    #[argh(option)]
    pub shed_interval_ms: Option<u64>,
    /// prefill rate in prompt tokens/s; with --mu-decode, skips calibration
    #[argh(option)]
    pub mu_prefill: Option<f64>,
    /// aggregate decode rate in tokens/s at --parallel sequences; with --mu-prefill,
    /// skips calibration
    #[argh(option)]
    pub mu_decode: Option<f64>,
    /// keep --mu-prefill and --mu-decode as given: measured steps do not
    /// refine them (for tests that must not depend on the box's speed, and
    /// operators who know their box's rates better)
    #[argh(switch)]
    pub mu_fixed: bool,
    /// prompt tokens of a typical request, for the request service rate (default: 128)
    #[argh(option, default = "128")]
    pub typical_prompt_tokens: usize,
    /// generated tokens of a typical request, for the request service rate (default: 128)
    #[argh(option, default = "128")]
    pub typical_max_tokens: usize,
    /// max_tokens when a request gives none (default: 512)
    #[argh(option, default = "512")]
    pub max_tokens_default: usize,
    /// largest request body in bytes (default: 1048576)
    #[argh(option, default = "1_048_576")]
    pub max_body_bytes: usize,
    /// per-stream buffer between engine and client, in tokens (default: 16)
    #[argh(option, default = "crate::stream::STREAM_BUFFER_TOKENS_DEFAULT")]
    pub stream_buffer_tokens: usize,
    /// longest a request may take end to end, in milliseconds (default: 300000)
    #[argh(option, default = "300_000")]
    pub request_timeout_ms: u64,
    /// a stream whose client reads nothing for this long is cancelled, in
    /// milliseconds; also the write deadline: each response, or each event of
    /// a stream, must be written within it, else the connection is closed
    /// (default: 30000)
    #[argh(option, default = "30_000")]
    pub stall_timeout_ms: u64,
    /// a stream that has left the queue is sent an SSE comment (": keep-alive")
    /// this often until its first token, so that proxies and clients with
    /// read timeouts wait through a long prefill, in milliseconds (default: 2000)
    #[argh(option, default = "2_000")]
    pub sse_keep_alive_ms: u64,
    /// a request body must arrive whole within this, counted from the end of
    /// its head (else 408), in milliseconds (default: 10000)
    #[argh(option, default = "10_000")]
    pub client_timeout_ms: u64,
    /// a request head (request line and headers) must arrive whole within
    /// this, counted from accept or, on a kept-alive connection, from its first
    /// byte (else 408 and close), in milliseconds (default: 10000)
    #[argh(option, default = "10_000")]
    pub header_timeout_ms: u64,
    /// an idle kept-alive connection is closed after this, in milliseconds
    /// (default: 5000)
    #[argh(option, default = "5_000")]
    pub keep_alive_ms: u64,
    /// most open connections; at the bound, the connection waiting longest on
    /// its client is closed for room, and with none waiting a new one gets 503
    /// (default: 16 per handler thread, 64 to 1024, within the descriptor limit)
    #[argh(option)]
    pub max_connections: Option<usize>,
    /// requests read whole that may wait for a handler while every handler is
    /// busy; over it, 503 at once (default: 4 per handler thread)
    #[argh(option)]
    pub http_queue_depth: Option<usize>,
    /// host names (comma-separated) besides IP addresses, localhost, this
    /// machine's name and --host that requests may carry; others get 403,
    /// against DNS rebinding; '*' allows any (default: none)
    #[argh(option, default = "String::new()")]
    pub allowed_hosts: String,
    /// origins (comma-separated, e.g. http://localhost:3000) whose browser
    /// pages may call the API, with CORS; requests from other origins get 403;
    /// '*' allows any (default: none, same-origin only)
    #[argh(option, default = "String::new()")]
    pub allowed_origins: String,
    /// on SIGTERM or SIGINT, how long sluice stays not ready while still
    /// serving new requests, before it refuses them: time for a load
    /// balancer's health checks to take it out of rotation, in milliseconds
    /// (default: 0; behind HAProxy's checks every 250 ms: 1000)
    #[argh(option, default = "0")]
    pub drain_notice_ms: u64,
    /// on SIGTERM or SIGINT, how long accepted requests may take to finish
    /// before the rest are cancelled, in milliseconds (default: 30000)
    #[argh(option, default = "30_000")]
    pub drain_timeout_ms: u64,
    /// kernel send buffer per connection in bytes (SO_SNDBUF; Linux doubles
    /// it), so that a slow reader's stream waits in sluice's bounded buffer,
    /// not in the kernel (default: 16384)
    #[argh(option, default = "16_384")]
    pub send_buffer_bytes: usize,
    /// HTTP handler threads (default: --parallel + both classes' queue
    /// ceilings, 9 each or --queue-depth, + 4 for /health and /metrics)
    #[argh(option)]
    pub http_threads: Option<usize>,
    /// file that keeps what start-up measured (the flash attention/KV type
    /// pairing, the rates) for the next start on this CPU, model, build and
    /// settings, or off (default: calibration.json in $CACHE_DIRECTORY under
    /// systemd, else in $XDG_CACHE_HOME/sluice or ~/.cache/sluice)
    #[argh(option)]
    pub calibration_cache: Option<String>,
    /// directory of the Batch API's database (files, batches, results), or
    /// off: no /v1/files or /v1/batches (default: $STATE_DIRECTORY under
    /// systemd, else $XDG_STATE_HOME/sluice or ~/.local/state/sluice)
    #[argh(option)]
    pub data_dir: Option<String>,
    /// largest file /v1/files takes, in bytes (default: 33554432)
    #[argh(option, default = "33_554_432")]
    pub batch_file_bytes_max: usize,
    /// most lines in a batch's input file (default: 50000)
    #[argh(option, default = "50_000")]
    pub batch_lines_max: usize,
    /// most batches not yet ended (default: 100)
    #[argh(option, default = "100")]
    pub batches_max: usize,
    /// most bytes of files kept, uploads and results together (default:
    /// 1073741824)
    #[argh(option, default = "1_073_741_824")]
    pub data_bytes_max: u64,
    /// hours files and ended batches are kept (default: 720)
    #[argh(option, default = "720")]
    pub batch_retention_hours: u64,
    /// batch lines run at once (default: the slots batch may hold, --parallel
    /// - --interactive-slots)
    #[argh(option)]
    pub batch_concurrency: Option<usize>,
    /// time every flash attention/KV type pairing the flags leave open and
    /// the rates, for these settings; keep them in the calibration cache and
    /// exit (the long measurement, ahead of the next start)
    #[argh(switch)]
    pub calibrate_only: bool,
    /// ggml worker polling level after a pass, 0 to 100 (default: 50)
    #[argh(option, default = "50")]
    pub poll: u32,
    /// map the model file into memory instead of reading it: the weights that
    /// llama.cpp repacks for this CPU's matrix kernels (AMX, VNNI) would then
    /// be resident twice (default: read)
    #[argh(switch)]
    pub mmap: bool,
    /// show llama.cpp's informational log
    #[argh(switch)]
    pub verbose: bool,
}

#[derive(FromArgs, Debug)]
/// Time bare llama_decode steps (no server) at batch 1 and 4, for comparison
/// with what the server achieves.
#[argh(subcommand, name = "calibrate")]
pub struct CalibrateArgs {
    /// GGUF model file (default: models/SmolLM2-135M-Instruct.Q4_1.gguf)
    #[argh(option, default = "PathBuf::from(MODEL_PATH_DEFAULT)")]
    pub model: PathBuf,
    /// compute threads (default: the cores this process may use)
    #[argh(option)]
    pub threads: Option<usize>,
    /// decode steps timed per batch size (default: 128)
    #[argh(option, default = "128")]
    pub steps: usize,
    /// prompt tokens prefilled before timing decode (default: 32)
    #[argh(option, default = "32")]
    pub prompt_tokens: usize,
    /// ggml worker polling level, 0 to 100 (default: 50)
    #[argh(option, default = "50")]
    pub poll: u32,
    /// KV cache type: f16, q8_0/f16 (K/V) or q8_0 (default: f16)
    #[argh(option, default = "KvType::F16", from_str_fn(parse_kv_type))]
    pub kv_type: KvType,
    /// flash attention: off, on or auto (default: off)
    #[argh(option, default = "FlashAttn::Off", from_str_fn(parse_flash_attn))]
    pub flash_attn: FlashAttn,
}

/// `sluice serve`'s flags as argh defines them, and whether each takes a
/// value, read from argh's own usage line (`[--port <port>]`, `[--mmap]`):
/// the environment's list is derived from the definitions, not kept beside
/// them. `--help` is not among them.
pub fn serve_flags() -> Vec<(String, bool)> {
    let usage = match ServeArgs::from_args(&["sluice", "serve"], &["--help"]) {
        Err(e) => e.output,
        Ok(_) => unreachable!("--help always exits early"),
    };
    let line = usage
        .lines()
        .find(|l| l.starts_with("Usage:"))
        .expect("argh's help starts with its usage line");
    line.split('[')
        .skip(1)
        .filter_map(|part| {
            let inner = part.split(']').next()?;
            let mut words = inner.split_whitespace();
            let name = words.next()?.strip_prefix("--")?;
            Some((name.to_string(), words.next().is_some()))
        })
        .collect()
}

/// The environment variable of a `sluice serve` flag: `SLUICE_` and the flag in
/// upper case with `_` for `-` (`--queue-wait-ms` → `SLUICE_QUEUE_WAIT_MS`).
pub fn env_name(flag: &str) -> String {
    format!("SLUICE_{}", flag.to_uppercase().replace('-', "_"))
}

/// Every `sluice serve` flag may also come from the environment (for systemd's
/// `EnvironmentFile`): `SLUICE_PORT=9000`, `SLUICE_NO_SHED=1`. A flag given on
/// the command line wins. Other commands take the command line only.
pub fn args_with_env(
    mut args: Vec<String>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Vec<String>, String> {
    if args.get(1).map(String::as_str) != Some("serve") {
        return Ok(args);
    }
    let given = |flag: &str| {
        let long = format!("--{flag}");
        let long_eq = format!("--{flag}=");
        args.iter().any(|a| *a == long || a.starts_with(&long_eq))
    };
    let mut extra = Vec::new();
    let flags = serve_flags();
    for (flag, _) in flags.iter().filter(|(_, takes_value)| *takes_value) {
        if given(flag) {
            continue;
        }
        if let Some(v) = env(&env_name(flag)) {
            extra.push(format!("--{flag}"));
            extra.push(v);
        }
    }
    for (flag, _) in flags.iter().filter(|(_, takes_value)| !*takes_value) {
        if given(flag) {
            continue;
        }
        let name = env_name(flag);
        match env(&name).as_deref().map(str::trim) {
            None | Some("" | "0" | "false" | "no") => {}
            Some("1" | "true" | "yes") => extra.push(format!("--{flag}")),
            Some(v) => {
                return Err(format!(
                    "{name} is '{v}'; a switch takes 1, true or yes (on), or 0, false or no (off)"
                ))
            }
        }
    }
    args.splice(2..2, extra);
    Ok(args)
}

fn parse_kv_type(v: &str) -> Result<KvType, String> {
    KvType::from_name(v)
        .ok_or_else(|| format!("--kv-type is '{v}'; it must be f16, q8_0/f16 or q8_0"))
}

fn parse_kv_layout(v: &str) -> Result<KvLayout, String> {
    match v {
        "per-seq" => Ok(KvLayout::PerSequence),
        "unified" => Ok(KvLayout::Unified),
        _ => Err(format!(
            "--kv-layout is '{v}'; it must be per-seq or unified"
        )),
    }
}

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

fn parse_log_format(v: &str) -> Result<LogFormat, String> {
    match v {
        "text" => Ok(LogFormat::Text),
        "json" => Ok(LogFormat::Json),
        _ => Err(format!("--log-format is '{v}'; it must be text or json")),
    }
}

/// `--pooling`: the GGUF's, fixed by the operator, or none (no embeddings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolingSetting {
    Gguf,
    Fixed(crate::embed::Pooling),
    None,
}

fn parse_pooling(v: &str) -> Result<PoolingSetting, String> {
    match v {
        "gguf" => Ok(PoolingSetting::Gguf),
        "none" => Ok(PoolingSetting::None),
        _ => crate::embed::Pooling::from_name(v)
            .map(PoolingSetting::Fixed)
            .ok_or_else(|| format!("--pooling is '{v}'; it must be gguf, mean, cls, last or none")),
    }
}

/// `--kv-type`: fixed by the operator, or measured by `--calibrate-only`
/// (with flash attention; see `startup::measure_attention`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvTypeSetting {
    Measure,
    Fixed(KvType),
}

fn parse_kv_type_setting(v: &str) -> Result<KvTypeSetting, String> {
    match v {
        "measure" => Ok(KvTypeSetting::Measure),
        _ => parse_kv_type(v)
            .map(KvTypeSetting::Fixed)
            .map_err(|_| format!("--kv-type is '{v}'; it must be measure, f16, q8_0/f16 or q8_0")),
    }
}

/// `--flash-attn`: fixed by the operator, or measured at start-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlashAttnSetting {
    Measure,
    Fixed(FlashAttn),
}

fn parse_flash_attn_setting(v: &str) -> Result<FlashAttnSetting, String> {
    match v {
        "measure" => Ok(FlashAttnSetting::Measure),
        _ => parse_flash_attn(v)
            .map(FlashAttnSetting::Fixed)
            .map_err(|_| format!("--flash-attn is '{v}'; it must be measure, on, off or auto")),
    }
}

fn parse_flash_attn(v: &str) -> Result<FlashAttn, String> {
    match v {
        "auto" => Ok(FlashAttn::Auto),
        "on" => Ok(FlashAttn::On),
        "off" => Ok(FlashAttn::Off),
        _ => Err(format!("--flash-attn is '{v}'; it must be on, off or auto")),
    }
}
