//! Command line and the validated configuration built from it.
//!
//! Every limit has a name with its unit, a default that is right for the default
//! model on a small box, and a check of its relation to the other limits here,
//! at start-up, rather than somewhere in the hot path.

use crate::admission::{Policy, Rates, Typical, QUEUE_DEPTH_SAFE_MAX};
use crate::auth::KeyFile;
use crate::engine::ffi::{FlashAttn, KvLayout, KvType};
use crate::priority::Class;
use crate::ratelimit::Limit;
use argh::FromArgs;
use std::path::PathBuf;
use std::time::Duration;

pub const MODEL_PATH_DEFAULT: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
/// Largest `--ctx`: llama.cpp accepts more, but a CPU box will not serve it.
pub const CTX_TOKENS_MAX: usize = 131_072;
/// llama.cpp's limit on sequence ids (and below `STEP_TOKENS_CEILING`, so that
/// every running sequence fits in a step).
pub const PARALLEL_MAX: usize = 256;
/// Largest admission queue an operator may configure with `--queue-depth-unsafe`;
/// without it the ceiling is `admission::QUEUE_DEPTH_SAFE_MAX` (9).
pub const QUEUE_DEPTH_UNSAFE_MAX: usize = 4096;
/// Largest `--prefix-cache-mb`: a quarter of a terabyte is past any box this
/// serves from.
pub const PREFIX_CACHE_MB_MAX: usize = 1 << 18;
/// Largest `--step-tokens` (llama.cpp's n_batch; its compute buffers grow with it).
pub const STEP_TOKENS_MAX: usize = 8192;
/// Most tokens in a step when the budget is derived from the ITL target: the
/// chunk a prefill takes when no stream is decoding. Larger chunks are no
/// faster per token on a CPU, and cost compute-buffer memory.
pub const STEP_TOKENS_CEILING: usize = 512;
const _: () = assert!(PARALLEL_MAX <= STEP_TOKENS_CEILING);
/// Handler threads beyond those that can be busy streaming, so that `/health`
/// and `/metrics` are answered even when every slot and queue place is taken.
pub const HTTP_SPARE_THREADS: usize = 4;

impl Config {
    /// Handler threads: as given, or enough for every running and queued request
    /// to stream (at the highest L_max the gate may allow) while health checks
    /// are still answered. Refuses a pool that could leave no thread for them.
    pub fn http_threads(&self) -> Result<usize, String> {
        let busy_max = self.parallel
            + Class::ALL
                .map(|c| self.policy(c).queue_depth_ceiling())
                .iter()
                .sum::<usize>();
        let n = self.http_threads.unwrap_or(busy_max + HTTP_SPARE_THREADS);
        check_range("--http-threads", n, busy_max + 1, 8192).map_err(|e| {
            format!("{e} (handlers of running and queued requests, plus one for /health)")
        })?;
        Ok(n)
    }

    /// How admission derives the bounds of a class.
    pub fn policy(&self, class: Class) -> Policy {
        Policy {
            typical: self.typical,
            queue_wait: self.queue_wait(class),
            queue_depth: self.queue_depth,
            queued_tokens_max: self.queued_tokens_max,
        }
    }

    /// W_max of a class.
    pub fn queue_wait(&self, class: Class) -> Duration {
        match class {
            Class::Interactive => self.queue_wait,
            Class::Batch => self.batch_queue_wait,
        }
    }

    /// CoDel's target and interval for a class: as given for interactive;
    /// for batch, half its W_max and its W_max.
    pub fn shed(&self, class: Class) -> Option<(Duration, Duration)> {
        match class {
            Class::Interactive => self.shed,
            Class::Batch => self
                .shed
                .map(|_| (self.batch_queue_wait / 2, self.batch_queue_wait)),
        }
    }

    /// Slots batch requests may hold.
    pub fn batch_slots(&self) -> usize {
        self.parallel - self.interactive_slots
    }

    /// KV cells batch requests may reserve in a context of `n_ctx`: all but
    /// the reserved slots' share.
    pub fn batch_kv_cells(&self, n_ctx: usize) -> usize {
        n_ctx - self.interactive_slots * (n_ctx / self.parallel)
    }

    /// Tokens in llama.cpp's batch: the most one step may hold.
    pub fn n_batch(&self) -> usize {
        self.step_tokens.unwrap_or(STEP_TOKENS_CEILING)
    }
}

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
    /// KV cache type: measure (time the types that fit the flash attention
    /// setting at start-up), f16, q8_0/f16 (K in q8_0, V in f16: 3/4 of the
    /// memory), or q8_0 (half the memory; needs flash attention)
    /// (default: measure)
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
    /// flash attention: measure (time a decode token and a prefill chunk at
    /// depth with it and without, at start-up, and take the faster), off, on,
    /// or auto (llama.cpp decides: on for the CPU) (default: measure)
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
    /// a fixed number of tokens per engine step (decode tokens first, then
    /// prefill chunks), instead of the budget derived from --itl-target-ms
    #[argh(option)]
    pub step_tokens: Option<usize>,
    /// queueing budget for time to first token, in ms: the queue holds what this
    /// machine serves in that time (Little's law) (default: 5000)
    #[argh(option, default = "5000")]
    pub queue_wait_ms: u64,
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
    /// addresses of proxies (comma-separated) whose X-Forwarded-For names the
    /// client, for per-client rate limits by address (default: none)
    #[argh(option)]
    pub trusted_proxies: Option<String>,
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
    /// prompt tokens that may wait for a slot, instead of mu_prefill x W_max
    #[argh(option)]
    pub queued_tokens_max: Option<usize>,
    /// sojourn target in ms (CoDel): shed while requests wait longer than this for
    /// a whole interval (default: half of --queue-wait-ms; batch requests: half
    /// of --batch-queue-wait-ms)
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
    /// milliseconds; also the socket send timeout (default: 30000)
    #[argh(option, default = "30_000")]
    pub stall_timeout_ms: u64,
    /// a client that sends nothing for this long is disconnected (idle
    /// keep-alive, slow headers), and a request body must arrive within it, in
    /// milliseconds (default: 10000)
    #[argh(option, default = "10_000")]
    pub client_timeout_ms: u64,
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
    /// HTTP handler threads (default: parallel + queue depth + 4)
    #[argh(option)]
    pub http_threads: Option<usize>,
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

/// The validated serve configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub model: PathBuf,
    pub model_name: String,
    pub host: String,
    pub port: u16,
    pub cpus: Vec<usize>,
    pub ctx_tokens: Option<usize>,
    pub parallel: usize,
    /// Host memory for the prefix cache, in MiB (0: none).
    pub prefix_cache_mb: usize,
    pub kv_type: KvTypeSetting,
    pub kv_layout: KvLayout,
    pub flash_attn: FlashAttnSetting,
    /// `--step-tokens`: a fixed step budget; `None` derives it from the ITL target.
    pub step_tokens: Option<usize>,
    pub itl_target: Duration,
    pub queue_wait: Duration,
    pub batch_queue_wait: Duration,
    /// Slots batch requests may not hold (< parallel).
    pub interactive_slots: usize,
    pub batch_every: u32,
    /// The per-client default bucket; `None`: no limit unless a key sets one.
    pub client_limit: Option<Limit>,
    pub client_table_max: usize,
    /// Connections from these are a proxy's: the client is the last address
    /// of their X-Forwarded-For.
    pub trusted_proxies: Vec<std::net::IpAddr>,
    pub api_keys: Option<KeyFile>,
    /// The operator's queue depth, instead of the derived one.
    pub queue_depth: Option<usize>,
    /// CoDel's sojourn target and interval; `None` with `--no-shed`.
    pub shed: Option<(Duration, Duration)>,
    /// The operator's queued-token budget, instead of the derived one.
    pub queued_tokens_max: Option<usize>,
    /// Rates given on the command line; `None` means calibrate at start-up.
    pub rates: Option<Rates>,
    pub typical: Typical,
    pub max_tokens_default: usize,
    pub body_bytes_max: usize,
    pub stream_buffer_tokens: usize,
    pub request_timeout_ms: u64,
    pub stall_timeout: Duration,
    pub drain_timeout: Duration,
    pub drain_notice: Duration,
    pub client_timeout: Duration,
    pub send_buffer_bytes: usize,
    /// `None`: parallel + queue depth + spare, once the depth is known.
    pub http_threads: Option<usize>,
    pub poll: u32,
    pub mmap: bool,
    pub verbose: bool,
}

impl Config {
    pub fn from_args(a: ServeArgs) -> Result<Config, String> {
        let cpus = compute_cpus(a.threads)?;
        check_range("--parallel", a.parallel, 1, PARALLEL_MAX)?;
        check_range(
            "--prefix-cache-mb",
            a.prefix_cache_mb,
            0,
            PREFIX_CACHE_MB_MAX,
        )?;
        let q8 = KvTypeSetting::Fixed(KvType::Q8_0);
        let (kv_type, flash_attn) = match (a.kv_type, a.flash_attn) {
            (k, FlashAttnSetting::Fixed(FlashAttn::Off)) if k == q8 => {
                return Err(
                    "--kv-type q8_0 needs flash attention (llama.cpp quantizes the V cache only with it): add --flash-attn on".into(),
                );
            }
            // Nothing to measure: a quantized V cache exists only with it.
            (k, FlashAttnSetting::Measure) if k == q8 => {
                (k, FlashAttnSetting::Fixed(FlashAttn::On))
            }
            (k, f) => (k, f),
        };
        let queue_depth_cap = if a.queue_depth_unsafe {
            QUEUE_DEPTH_UNSAFE_MAX
        } else {
            QUEUE_DEPTH_SAFE_MAX
        };
        if let Some(d) = a.queue_depth {
            check_range("--queue-depth", d, 1, queue_depth_cap).map_err(|e| {
                if a.queue_depth_unsafe {
                    e
                } else {
                    format!("{e} (a deeper queue only turns refusals into waits; --queue-depth-unsafe allows it)")
                }
            })?;
        }
        if a.queue_wait_ms == 0 || a.queue_wait_ms > 3_600_000 {
            return Err(format!(
                "--queue-wait-ms is {}; it must be 1 to 3600000",
                a.queue_wait_ms
            ));
        }
        if a.batch_queue_wait_ms == 0 || a.batch_queue_wait_ms > 3_600_000 {
            return Err(format!(
                "--batch-queue-wait-ms is {}; it must be 1 to 3600000",
                a.batch_queue_wait_ms
            ));
        }
        let interactive_slots = a.interactive_slots.unwrap_or(usize::from(a.parallel > 1));
        check_range("--interactive-slots", interactive_slots, 0, a.parallel - 1).map_err(|e| {
            format!("{e} (below --parallel, so that batch requests can run at all)")
        })?;
        if a.batch_every == 0 || a.batch_every > 1000 {
            return Err(format!(
                "--batch-every is {}; it must be 1 to 1000",
                a.batch_every
            ));
        }
        let client_limit = match (a.client_rate, a.client_burst) {
            (None, None) => None,
            (None, Some(_)) => return Err("--client-burst needs --client-rate".into()),
            (Some(r), _) if !(r.is_finite() && r > 0.0) => {
                return Err(format!(
                    "--client-rate is {r}; it must be a positive number of tokens/s"
                ))
            }
            (Some(_), Some(0)) => return Err("--client-burst must be positive".into()),
            (Some(r), b) => Some(Limit {
                rate_tok_s: r,
                burst: b.unwrap_or_else(|| crate::auth::default_burst(r)),
            }),
        };
        check_range("--client-table-max", a.client_table_max, 1, 1 << 20)?;
        let api_keys = a.api_key_file.as_deref().map(KeyFile::load).transpose()?;
        let trusted_proxies = a
            .trusted_proxies
            .iter()
            .flat_map(|l| l.split(','))
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| {
                p.parse()
                    .map_err(|_| format!("--trusted-proxies: '{p}' is not an IP address"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let rates =
            match (a.mu_prefill, a.mu_decode) {
                (None, None) => None,
                (Some(p), Some(d)) if p > 0.0 && d > 0.0 && p.is_finite() && d.is_finite() => {
                    Some(Rates {
                        prefill_tok_s: p,
                        decode_tok_s: d,
                    })
                }
                (Some(_), Some(_)) => {
                    return Err("--mu-prefill and --mu-decode must be positive".into())
                }
                _ => return Err(
                    "give both --mu-prefill and --mu-decode, or neither (then sluice calibrates)"
                        .into(),
                ),
            };
        let shed = if a.no_shed {
            None
        } else {
            let target = a.shed_target_ms.unwrap_or(a.queue_wait_ms / 2).max(1);
            let interval = a.shed_interval_ms.unwrap_or(a.queue_wait_ms).max(1);
            Some((
                Duration::from_millis(target),
                Duration::from_millis(interval),
            ))
        };
        check_range(
            "--typical-prompt-tokens",
            a.typical_prompt_tokens,
            1,
            CTX_TOKENS_MAX,
        )?;
        check_range(
            "--typical-max-tokens",
            a.typical_max_tokens,
            1,
            CTX_TOKENS_MAX,
        )?;
        if let Some(n) = a.step_tokens {
            check_range("--step-tokens", n, a.parallel, STEP_TOKENS_MAX)
                .map_err(|e| format!("{e} (every running sequence needs a token in each step, so it must be at least --parallel)"))?;
        }
        if a.itl_target_ms == 0 || a.itl_target_ms > 60_000 {
            return Err(format!(
                "--itl-target-ms is {}; it must be 1 to 60000",
                a.itl_target_ms
            ));
        }
        if let Some(ctx) = a.ctx {
            check_range("--ctx", ctx, 16, CTX_TOKENS_MAX)?;
        }
        check_range(
            "--max-tokens-default",
            a.max_tokens_default,
            1,
            CTX_TOKENS_MAX,
        )?;
        check_range("--max-body-bytes", a.max_body_bytes, 1024, 64 << 20)?;
        check_range(
            "--stream-buffer-tokens",
            a.stream_buffer_tokens,
            1,
            crate::stream::STREAM_BUFFER_TOKENS_MAX,
        )?;
        if a.stall_timeout_ms == 0 || a.stall_timeout_ms > 3_600_000 {
            return Err(format!(
                "--stall-timeout-ms is {}; it must be 1 to 3600000",
                a.stall_timeout_ms
            ));
        }
        check_range("--send-buffer-bytes", a.send_buffer_bytes, 2048, 64 << 20)?;
        if a.client_timeout_ms == 0 || a.client_timeout_ms > 3_600_000 {
            return Err(format!(
                "--client-timeout-ms is {}; it must be 1 to 3600000",
                a.client_timeout_ms
            ));
        }
        if a.drain_notice_ms > 600_000 {
            return Err(format!(
                "--drain-notice-ms is {}; it must be 0 to 600000",
                a.drain_notice_ms
            ));
        }
        if a.drain_timeout_ms > 3_600_000 {
            return Err(format!(
                "--drain-timeout-ms is {}; it must be 0 to 3600000",
                a.drain_timeout_ms
            ));
        }
        if a.request_timeout_ms == 0 {
            return Err("--request-timeout-ms must be positive".into());
        }
        if a.poll > 100 {
            return Err(format!("--poll is {}; it must be 0 to 100", a.poll));
        }
        if let Some(n) = a.http_threads {
            check_range("--http-threads", n, 2, 8192)?;
        }
        let model_name = a.model_name.unwrap_or_else(|| {
            a.model
                .file_name()
                .map(|f| f.to_string_lossy().trim_end_matches(".gguf").to_string())
                .unwrap_or_else(|| "model".into())
        });
        Ok(Config {
            model: a.model,
            model_name,
            host: a.host,
            port: a.port,
            cpus,
            ctx_tokens: a.ctx,
            parallel: a.parallel,
            prefix_cache_mb: a.prefix_cache_mb,
            kv_type,
            kv_layout: a.kv_layout,
            flash_attn,
            step_tokens: a.step_tokens,
            itl_target: Duration::from_millis(a.itl_target_ms),
            queue_wait: Duration::from_millis(a.queue_wait_ms),
            batch_queue_wait: Duration::from_millis(a.batch_queue_wait_ms),
            interactive_slots,
            batch_every: a.batch_every,
            client_limit,
            client_table_max: a.client_table_max,
            trusted_proxies,
            api_keys,
            queue_depth: a.queue_depth,
            shed,
            queued_tokens_max: a.queued_tokens_max.filter(|&n| n > 0),
            rates,
            typical: Typical {
                prompt_tokens: a.typical_prompt_tokens,
                max_tokens: a.typical_max_tokens,
            },
            max_tokens_default: a.max_tokens_default,
            body_bytes_max: a.max_body_bytes,
            stream_buffer_tokens: a.stream_buffer_tokens,
            request_timeout_ms: a.request_timeout_ms,
            stall_timeout: Duration::from_millis(a.stall_timeout_ms),
            drain_timeout: Duration::from_millis(a.drain_timeout_ms),
            drain_notice: Duration::from_millis(a.drain_notice_ms),
            client_timeout: Duration::from_millis(a.client_timeout_ms),
            send_buffer_bytes: a.send_buffer_bytes,
            http_threads: a.http_threads,
            poll: a.poll,
            mmap: a.mmap,
            verbose: a.verbose,
        })
    }
}

/// `sluice serve`'s options (they take a value); see [`args_with_env`].
const SERVE_OPTIONS: [&str; 41] = [
    "model",
    "model-name",
    "host",
    "port",
    "threads",
    "ctx",
    "parallel",
    "prefix-cache-mb",
    "kv-type",
    "kv-layout",
    "flash-attn",
    "itl-target-ms",
    "step-tokens",
    "queue-wait-ms",
    "batch-queue-wait-ms",
    "interactive-slots",
    "batch-every",
    "client-rate",
    "client-burst",
    "client-table-max",
    "trusted-proxies",
    "api-key-file",
    "queue-depth",
    "queued-tokens-max",
    "shed-target-ms",
    "shed-interval-ms",
    "mu-prefill",
    "mu-decode",
    "typical-prompt-tokens",
    "typical-max-tokens",
    "max-tokens-default",
    "max-body-bytes",
    "stream-buffer-tokens",
    "request-timeout-ms",
    "stall-timeout-ms",
    "drain-timeout-ms",
    "drain-notice-ms",
    "client-timeout-ms",
    "send-buffer-bytes",
    "http-threads",
    "poll",
];
/// `sluice serve`'s switches.
const SERVE_SWITCHES: [&str; 5] = ["queue-depth-unsafe", "no-shed", "mmap", "verbose", "help"];

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
    for flag in SERVE_OPTIONS {
        if given(flag) {
            continue;
        }
        if let Some(v) = env(&env_name(flag)) {
            extra.push(format!("--{flag}"));
            extra.push(v);
        }
    }
    for flag in SERVE_SWITCHES.iter().filter(|&&f| f != "help") {
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

/// `--kv-type`: fixed by the operator, or measured at start-up (with flash
/// attention; see `app::measure_attention`).
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

fn check_range(flag: &str, v: usize, lo: usize, hi: usize) -> Result<(), String> {
    if v < lo || v > hi {
        return Err(format!("{flag} is {v}; it must be {lo} to {hi}"));
    }
    Ok(())
}

/// The CPUs compute threads are pinned to: the ones in this process's affinity
/// mask, no more than its CPU quota allows (`available_parallelism` reads the
/// cgroup quota; the mask alone does not), or `--threads` of them.
pub fn compute_cpus(threads: Option<usize>) -> Result<Vec<usize>, String> {
    let mask: Vec<usize> = core_affinity::get_core_ids()
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.id)
        .collect();
    let quota = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let usable = usable_cpus(&mask, quota);
    match threads {
        None => Ok(usable),
        Some(0) => Err("--threads must be at least 1".into()),
        Some(n) if n > usable.len() => Err(format!(
            "--threads is {n}, but this process may use {} cores (affinity mask {:?}, CPU quota {quota}); more threads than cores only makes them wait for each other",
            usable.len(),
            mask
        )),
        Some(n) => Ok(usable[..n].to_vec()),
    }
}

/// Pure part of [`compute_cpus`]: the first `quota` CPUs of the mask.
fn usable_cpus(mask: &[usize], quota: usize) -> Vec<usize> {
    if mask.is_empty() {
        // No mask readable: threads are not pinned to known CPUs; use 0..quota.
        return (0..quota.max(1)).collect();
    }
    mask.iter().copied().take(quota.max(1)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usable_cpus_follow_the_mask_and_the_quota() {
        assert_eq!(usable_cpus(&[2, 3, 5], 8), vec![2, 3, 5]);
        assert_eq!(usable_cpus(&[2, 3, 5], 1), vec![2]);
        assert_eq!(usable_cpus(&[], 2), vec![0, 1]);
    }

    #[test]
    fn every_serve_flag_has_its_environment_variable() {
        let early = ServeArgs::from_args(&["sluice", "serve"], &["--help"])
            .expect_err("--help exits early");
        let in_help: std::collections::BTreeSet<String> = early
            .output
            .split_whitespace()
            .filter_map(|w| w.strip_prefix("--"))
            .map(|f| f.trim_end_matches([',', '.']).to_string())
            .filter(|f| !f.is_empty() && f.chars().all(|c| c.is_ascii_lowercase() || c == '-'))
            .collect();
        let known: std::collections::BTreeSet<String> = SERVE_OPTIONS
            .iter()
            .chain(SERVE_SWITCHES.iter())
            .map(|f| f.to_string())
            .collect();
        let missing: Vec<_> = in_help.difference(&known).collect();
        assert!(
            missing.is_empty(),
            "flags without an environment variable: {missing:?}"
        );
    }

    #[test]
    fn the_environment_fills_in_flags_the_command_line_does_not_give() {
        let env = |k: &str| match k {
            "SLUICE_PORT" => Some("9000".to_string()),
            "SLUICE_PARALLEL" => Some("2".to_string()),
            "SLUICE_NO_SHED" => Some("1".to_string()),
            "SLUICE_VERBOSE" => Some("0".to_string()),
            _ => None,
        };
        let args: Vec<String> = ["sluice", "serve", "--parallel", "3"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let out = args_with_env(args, env).unwrap();
        assert_eq!(
            out,
            [
                "sluice",
                "serve",
                "--port",
                "9000",
                "--no-shed",
                "--parallel",
                "3"
            ]
        );
        let bad = |k: &str| (k == "SLUICE_NO_SHED").then(|| "maybe".to_string());
        let args = vec!["sluice".to_string(), "serve".to_string()];
        assert!(args_with_env(args, bad)
            .unwrap_err()
            .contains("SLUICE_NO_SHED"));
        let other = vec!["sluice".to_string(), "calibrate".to_string()];
        assert_eq!(args_with_env(other.clone(), env).unwrap(), other);
        assert_eq!(env_name("queue-wait-ms"), "SLUICE_QUEUE_WAIT_MS");
    }

    #[test]
    fn flash_attention_is_measured_unless_given_or_implied_by_a_quantized_cache() {
        let cfg = |args: &[&str]| {
            ServeArgs::from_args(&["sluice", "serve"], args)
                .map_err(|e| e.output)
                .and_then(Config::from_args)
        };
        assert_eq!(cfg(&[]).unwrap().flash_attn, FlashAttnSetting::Measure);
        assert_eq!(
            cfg(&["--flash-attn", "off"]).unwrap().flash_attn,
            FlashAttnSetting::Fixed(FlashAttn::Off)
        );
        assert_eq!(
            cfg(&["--kv-type", "q8_0"]).unwrap().flash_attn,
            FlashAttnSetting::Fixed(FlashAttn::On)
        );
        assert!(cfg(&["--kv-type", "q8_0", "--flash-attn", "off"]).is_err());
        assert_eq!(cfg(&[]).unwrap().kv_type, KvTypeSetting::Measure);
        assert_eq!(
            cfg(&["--flash-attn", "off"]).unwrap().kv_type,
            KvTypeSetting::Measure
        );
        assert_eq!(
            cfg(&["--kv-type", "q8_0/f16", "--flash-attn", "off"])
                .unwrap()
                .kv_type,
            KvTypeSetting::Fixed(KvType::Q8_0KeysF16Values)
        );
        assert_eq!(
            cfg(&["--flash-attn", "on"]).unwrap().kv_type,
            KvTypeSetting::Measure
        );
        assert!(cfg(&["--kv-type", "q4"]).is_err());
        assert!(cfg(&["--flash-attn", "sometimes"]).is_err());
    }

    #[test]
    fn range_errors_name_the_flag_and_value() {
        let e = check_range("--parallel", 0, 1, 256).unwrap_err();
        assert_eq!(e, "--parallel is 0; it must be 1 to 256");
    }
}
