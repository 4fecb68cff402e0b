//! Command line and the validated configuration built from it.
//!
//! Every limit has a name with its unit, a default that is right for the default
//! model on a small box, and a check of its relation to the other limits here,
//! at start-up, rather than somewhere in the hot path.

use crate::admission::{Policy, Rates, Typical, QUEUE_DEPTH_SAFE_MAX};
use crate::auth::KeyFile;
use crate::ffi::{FlashAttn, KvLayout, KvType};
use crate::priority::Class;
use crate::ratelimit::Limit;
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
/// Most handler threads (`--http-threads`).
pub const HTTP_THREADS_MAX: usize = 8192;
/// The derived `--http-queue-depth`: this many requests per handler thread
/// may wait for one while all are busy. A burst of simultaneous requests is
/// then refused by admission (429 with its estimated wait), not by the front.
pub const HTTP_QUEUE_PER_HANDLER: usize = 4;
/// Most `--max-connections`.
pub const CONNECTIONS_MAX: usize = 1 << 20;
/// The derived `--max-connections`: this many per handler thread, within
/// `CONNECTIONS_DERIVED_MIN..=CONNECTIONS_DERIVED_MAX`.
pub const CONNECTIONS_PER_HANDLER: usize = 16;
pub const CONNECTIONS_DERIVED_MIN: usize = 64;
pub const CONNECTIONS_DERIVED_MAX: usize = 1024;
/// File descriptors a connection may hold (its socket, the clone its
/// responses are written through, and the duplicate a waiting handler probes).
pub const FDS_PER_CONNECTION: usize = 3;
/// Descriptors kept for everything else (model file, logs, listener, spares).
pub const FDS_RESERVED: usize = 64;
/// Longest duration a millisecond flag may give (W_max, timeouts): an hour.
pub const DURATION_MS_MAX: u64 = 3_600_000;
/// W_max when `--queue-wait-ms` is not given: how much waiting the queue at
/// the door holds (README, "Why W_max is 5 s").
pub const QUEUE_WAIT_MS_DEFAULT: u64 = 5_000;
/// Longest `--drain-notice-ms`: ten minutes; a load balancer checks readiness
/// every few seconds.
pub const DRAIN_NOTICE_MS_MAX: u64 = 600_000;
/// Longest `--itl-target-ms`: a minute between tokens is no longer a stream.
pub const ITL_TARGET_MS_MAX: u64 = 60_000;
/// Largest `--overdue-stretch`: a prompt overtaken for 100 times its
/// prefill is starved by any measure.
pub const OVERDUE_STRETCH_MAX: f64 = 100.0;
/// Largest `--batch-every`: starts out of which one goes to batch.
pub const BATCH_EVERY_MAX: u32 = 1000;
/// Largest `--client-table-max`, in clients.
pub const CLIENT_TABLE_MAX: usize = 1 << 20;
/// Smallest and largest `--max-body-bytes`, in bytes.
pub const BODY_BYTES_MIN: usize = 1024;
pub const BODY_BYTES_MAX: usize = 64 << 20;
/// Smallest and largest `--send-buffer-bytes` (SO_SNDBUF), in bytes.
pub const SEND_BUFFER_BYTES_MIN: usize = 2048;
pub const SEND_BUFFER_BYTES_MAX: usize = 64 << 20;
/// Smallest `--ctx`, in tokens.
pub const CTX_TOKENS_MIN: usize = 16;
/// ggml's polling levels (`--poll`).
pub const POLL_MAX: u32 = 100;

mod args;
mod callers;
mod derive;

pub use args::*;
pub use callers::Callers;
use derive::check_range;

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
        check_range("--http-threads", n, busy_max + 1, HTTP_THREADS_MAX).map_err(|e| {
            format!("{e} (handlers of running and queued requests, plus one for /health)")
        })?;
        Ok(n)
    }

    /// Most open connections: as given, or 16 per handler thread (64 to
    /// 1024); either way no more than the descriptor limit `nofile` allows.
    pub fn max_connections(&self, http_threads: usize, nofile: u64) -> Result<usize, String> {
        let fd_room = (nofile as usize).saturating_sub(FDS_RESERVED) / FDS_PER_CONNECTION;
        match self.max_connections {
            Some(n) if n > fd_room => Err(format!(
                "--max-connections {n} needs about {} file descriptors, and the limit is {nofile} (raise it, e.g. LimitNOFILE= in the unit)",
                n * FDS_PER_CONNECTION + FDS_RESERVED
            )),
            Some(n) => Ok(n),
            None => {
                let derived = (http_threads * CONNECTIONS_PER_HANDLER)
                    .clamp(CONNECTIONS_DERIVED_MIN, CONNECTIONS_DERIVED_MAX);
                Ok(derived.min(fd_room).max(1))
            }
        }
    }

    /// How admission derives the bounds of a class.
    pub fn policy(&self, class: Class) -> Policy {
        Policy {
            typical: self.typical,
            queue_wait: self.queue_wait(class),
            queue_depth: self.queue_depth,
            queue_depth_min: match class {
                Class::Interactive => self.parallel,
                Class::Batch => self.batch_slots(),
            },
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

/// The Batch API: where its database lives, its bounds, and how many lines
/// run at once.
#[derive(Debug, Clone)]
pub struct BatchConfig {
    pub dir: PathBuf,
    pub limits: crate::batch::StoreLimits,
    pub concurrency: usize,
}

/// The validated serve configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub model: PathBuf,
    pub model_name: String,
    pub chat_template_file: Option<PathBuf>,
    pub pooling: PoolingSetting,
    pub log_format: LogFormat,
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
    /// `--short-cells`: requests of at most this many cells run in a second
    /// context with flash attention on and an f16 cache (0: none).
    pub short_cells: usize,
    /// `--step-tokens`: a fixed step budget; `None` derives it from the ITL target.
    pub step_tokens: Option<usize>,
    pub itl_target: Duration,
    /// `--itl-max-ms`: the longest pause a whole short prompt may cost the
    /// streams, and the longest step of prefill alone (zero: prompts are
    /// always chunked under the target, and prefill alone takes `n_batch`).
    pub itl_max: Duration,
    /// `--decode-ahead-ms`: the longest chunk of a long prompt beside
    /// streams fed by tokens decoded ahead (zero: none; `engine::ahead`).
    pub decode_ahead: Duration,
    /// `--overdue-stretch`: a prompt is overdue (goes first every other step)
    /// once it has held its slot this many times its prefill's forecast, and
    /// at least W_max.
    pub overdue_stretch: f64,
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
    pub trusted_proxies: Vec<ipnet::IpNet>,
    /// Inference objectives (a gateway's `x-gateway-inference-objective`)
    /// whose requests go to the batch class.
    pub batch_objectives: Vec<String>,
    /// HAProxy's agent check's port (`http::agent`).
    pub agent_port: Option<u16>,
    pub api_keys: Option<KeyFile>,
    /// The operator's queue depth, instead of the derived one.
    pub queue_depth: Option<usize>,
    /// Where start-up's measurements are kept (`--calibration-cache`); `None`:
    /// off.
    pub calibration_cache: Option<PathBuf>,
    /// The Batch API's store and runner (`--data-dir`); `None`: off.
    pub batch: Option<BatchConfig>,
    /// `--calibrate-only`: measure, keep, exit.
    pub calibrate_only: bool,
    /// CoDel's sojourn target and interval (readiness, and shedding with
    /// `shed_late`); `None` with `--no-shed`.
    pub shed: Option<(Duration, Duration)>,
    /// Requests that waited too long are refused at dequeue (CoDel, and the
    /// first token's forecast against W_max): only when the operator gave a
    /// budget (`--queue-wait-ms`, `--shed-target-ms`, `--shed-interval-ms`).
    pub shed_late: bool,
    /// The operator's queued-token budget, instead of the derived one.
    pub queued_tokens_max: Option<usize>,
    /// Rates given on the command line; `None` means calibrate at start-up.
    pub rates: Option<Rates>,
    /// `--mu-fixed`: the rates stay as given (no online refinement).
    pub rates_fixed: bool,
    pub typical: Typical,
    pub max_tokens_default: usize,
    pub body_bytes_max: usize,
    pub stream_buffer_tokens: usize,
    pub request_timeout_ms: u64,
    pub stall_timeout: Duration,
    /// `--sse-keep-alive-ms`.
    pub sse_keep_alive: Duration,
    pub drain_timeout: Duration,
    pub drain_notice: Duration,
    pub client_timeout: Duration,
    pub header_timeout: Duration,
    pub keep_alive: Duration,
    /// `None`: derived from the handler threads and the descriptor limit.
    pub max_connections: Option<usize>,
    /// `None`: the handler threads.
    pub http_queue_depth: Option<usize>,
    /// Who may call (`--allowed-hosts`, `--allowed-origins`).
    pub callers: Callers,
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
        derive::check_engine_ranges(&a)?;
        derive::check_http_ranges(&a)?;
        let (kv_type, flash_attn, short_cells) = derive::attention(&a)?;
        let queue_wait_ms = a.queue_wait_ms.unwrap_or(QUEUE_WAIT_MS_DEFAULT);
        check_range("--queue-wait-ms", queue_wait_ms, 1, DURATION_MS_MAX)?;
        let interactive_slots = derive::interactive_slots(&a)?;
        let client_limit = derive::client_limit(a.client_rate, a.client_burst)?;
        let api_keys = a.api_key_file.as_deref().map(KeyFile::load).transpose()?;
        let trusted_proxies = derive::trusted_proxies(a.trusted_proxies.as_deref())?;
        let rates = derive::rates(&a)?;
        let shed = derive::shed(&a, queue_wait_ms);
        let machine = std::fs::read_to_string("/proc/sys/kernel/hostname").ok();
        let callers = Callers::parse(
            &a.host,
            &a.allowed_hosts,
            &a.allowed_origins,
            machine.as_deref().map(str::trim),
        )?;
        let model_name = derive::model_name(&a);
        let calibration_cache = derive::calibration_cache(&a)?;
        let batch = derive::batch(&a, interactive_slots)?;
        let batch_objectives = derive::batch_objectives(&a);
        Ok(Config {
            batch,
            calibration_cache,
            calibrate_only: a.calibrate_only,
            model: a.model,
            model_name,
            chat_template_file: a.chat_template_file,
            pooling: a.pooling,
            log_format: a.log_format,
            host: a.host,
            port: a.port,
            cpus,
            ctx_tokens: a.ctx,
            parallel: a.parallel,
            prefix_cache_mb: a.prefix_cache_mb,
            kv_type,
            kv_layout: a.kv_layout,
            flash_attn,
            short_cells,
            step_tokens: a.step_tokens,
            itl_target: Duration::from_millis(a.itl_target_ms),
            itl_max: Duration::from_millis(a.itl_max_ms),
            decode_ahead: Duration::from_millis(a.decode_ahead_ms),
            overdue_stretch: a.overdue_stretch,
            queue_wait: Duration::from_millis(queue_wait_ms),
            batch_queue_wait: Duration::from_millis(a.batch_queue_wait_ms),
            interactive_slots,
            batch_every: a.batch_every,
            client_limit,
            client_table_max: a.client_table_max,
            trusted_proxies,
            batch_objectives,
            agent_port: a.agent_port,
            api_keys,
            queue_depth: a.queue_depth,
            shed,
            // Only an operator's explicit budget turns a wait into a refusal:
            // the default W_max sizes the queue, and a request admitted into
            // it is served unless its own deadline passes.
            shed_late: !a.no_shed
                && (a.queue_wait_ms.is_some()
                    || a.shed_target_ms.is_some()
                    || a.shed_interval_ms.is_some()),
            queued_tokens_max: a.queued_tokens_max.filter(|&n| n > 0),
            rates,
            rates_fixed: a.mu_fixed,
            typical: Typical {
                prompt_tokens: a.typical_prompt_tokens,
                max_tokens: a.typical_max_tokens,
            },
            max_tokens_default: a.max_tokens_default,
            body_bytes_max: a.max_body_bytes,
            stream_buffer_tokens: a.stream_buffer_tokens,
            request_timeout_ms: a.request_timeout_ms,
            stall_timeout: Duration::from_millis(a.stall_timeout_ms),
            sse_keep_alive: Duration::from_millis(a.sse_keep_alive_ms),
            drain_timeout: Duration::from_millis(a.drain_timeout_ms),
            drain_notice: Duration::from_millis(a.drain_notice_ms),
            client_timeout: Duration::from_millis(a.client_timeout_ms),
            header_timeout: Duration::from_millis(a.header_timeout_ms),
            keep_alive: Duration::from_millis(a.keep_alive_ms),
            max_connections: a.max_connections,
            http_queue_depth: a.http_queue_depth,
            callers,
            send_buffer_bytes: a.send_buffer_bytes,
            http_threads: a.http_threads,
            poll: a.poll,
            mmap: a.mmap,
            verbose: a.verbose,
        })
    }
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
mod tests;
