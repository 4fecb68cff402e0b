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

pub use args::*;
pub use callers::Callers;

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
    /// Where start-up's measurements are kept (`--calibration-cache`); `None`:
    /// off.
    pub calibration_cache: Option<PathBuf>,
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
        let queue_wait_ms = a.queue_wait_ms.unwrap_or(QUEUE_WAIT_MS_DEFAULT);
        check_range("--queue-wait-ms", queue_wait_ms, 1, DURATION_MS_MAX)?;
        check_range(
            "--batch-queue-wait-ms",
            a.batch_queue_wait_ms,
            1,
            DURATION_MS_MAX,
        )?;
        let interactive_slots = a.interactive_slots.unwrap_or(usize::from(a.parallel > 1));
        check_range("--interactive-slots", interactive_slots, 0, a.parallel - 1).map_err(|e| {
            format!("{e} (below --parallel, so that batch requests can run at all)")
        })?;
        check_range("--batch-every", a.batch_every, 1, BATCH_EVERY_MAX)?;
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
        check_range(
            "--client-table-max",
            a.client_table_max,
            1,
            CLIENT_TABLE_MAX,
        )?;
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
        if a.mu_fixed && rates.is_none() {
            return Err("--mu-fixed keeps --mu-prefill and --mu-decode: give both".into());
        }
        let shed = if a.no_shed {
            None
        } else {
            let target = a.shed_target_ms.unwrap_or(queue_wait_ms / 2).max(1);
            let interval = a.shed_interval_ms.unwrap_or(queue_wait_ms).max(1);
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
        check_range("--itl-target-ms", a.itl_target_ms, 1, ITL_TARGET_MS_MAX)?;
        if let Some(ctx) = a.ctx {
            check_range("--ctx", ctx, CTX_TOKENS_MIN, CTX_TOKENS_MAX)?;
        }
        check_range(
            "--max-tokens-default",
            a.max_tokens_default,
            1,
            CTX_TOKENS_MAX,
        )?;
        check_range(
            "--max-body-bytes",
            a.max_body_bytes,
            BODY_BYTES_MIN,
            BODY_BYTES_MAX,
        )?;
        check_range(
            "--stream-buffer-tokens",
            a.stream_buffer_tokens,
            1,
            crate::stream::STREAM_BUFFER_TOKENS_MAX,
        )?;
        check_range("--stall-timeout-ms", a.stall_timeout_ms, 1, DURATION_MS_MAX)?;
        check_range(
            "--sse-keep-alive-ms",
            a.sse_keep_alive_ms,
            10,
            DURATION_MS_MAX,
        )?;
        check_range(
            "--send-buffer-bytes",
            a.send_buffer_bytes,
            SEND_BUFFER_BYTES_MIN,
            SEND_BUFFER_BYTES_MAX,
        )?;
        check_range(
            "--client-timeout-ms",
            a.client_timeout_ms,
            1,
            DURATION_MS_MAX,
        )?;
        check_range(
            "--drain-notice-ms",
            a.drain_notice_ms,
            0,
            DRAIN_NOTICE_MS_MAX,
        )?;
        check_range("--drain-timeout-ms", a.drain_timeout_ms, 0, DURATION_MS_MAX)?;
        if a.request_timeout_ms == 0 {
            return Err("--request-timeout-ms must be positive".into());
        }
        check_range(
            "--header-timeout-ms",
            a.header_timeout_ms,
            1,
            DURATION_MS_MAX,
        )?;
        check_range("--keep-alive-ms", a.keep_alive_ms, 1, DURATION_MS_MAX)?;
        if let Some(n) = a.max_connections {
            check_range("--max-connections", n, 1, CONNECTIONS_MAX)?;
        }
        if let Some(n) = a.http_queue_depth {
            check_range("--http-queue-depth", n, 1, HTTP_THREADS_MAX)?;
        }
        let machine = std::fs::read_to_string("/proc/sys/kernel/hostname").ok();
        let callers = Callers::parse(
            &a.host,
            &a.allowed_hosts,
            &a.allowed_origins,
            machine.as_deref().map(str::trim),
        )?;
        check_range("--poll", a.poll, 0, POLL_MAX)?;
        if let Some(n) = a.http_threads {
            check_range("--http-threads", n, 2, HTTP_THREADS_MAX)?;
        }
        let model_name = a.model_name.unwrap_or_else(|| {
            a.model
                .file_name()
                .map(|f| f.to_string_lossy().trim_end_matches(".gguf").to_string())
                .unwrap_or_else(|| "model".into())
        });
        let calibration_cache = match a.calibration_cache.as_deref() {
            Some("off") => None,
            Some("") => return Err("--calibration-cache is empty; give a file, or off".into()),
            Some(path) => Some(PathBuf::from(path)),
            None => crate::calibration_cache::default_path(|k| std::env::var(k).ok()),
        };
        if a.calibrate_only && calibration_cache.is_none() {
            return Err(
                "--calibrate-only keeps its measurements in the calibration cache: give --calibration-cache FILE"
                    .into(),
            );
        }
        Ok(Config {
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
            step_tokens: a.step_tokens,
            itl_target: Duration::from_millis(a.itl_target_ms),
            queue_wait: Duration::from_millis(queue_wait_ms),
            batch_queue_wait: Duration::from_millis(a.batch_queue_wait_ms),
            interactive_slots,
            batch_every: a.batch_every,
            client_limit,
            client_table_max: a.client_table_max,
            trusted_proxies,
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

fn check_range<T: PartialOrd + std::fmt::Display>(
    flag: &str,
    v: T,
    lo: T,
    hi: T,
) -> Result<(), String> {
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
    use argh::FromArgs;

    fn config(args: &[&str]) -> Config {
        let mut all = vec!["--mu-prefill", "1000", "--mu-decode", "100"];
        all.extend_from_slice(args);
        let a = ServeArgs::from_args(&["sluice", "serve"], &all).expect("args");
        Config::from_args(a).expect("config")
    }

    #[test]
    fn the_connection_bound_follows_the_handlers_and_the_descriptors() {
        let c = config(&[]);
        // 16 per handler, within 64..=1024.
        assert_eq!(c.max_connections(26, 1 << 20), Ok(416));
        assert_eq!(c.max_connections(2, 1 << 20), Ok(64));
        assert_eq!(c.max_connections(500, 1 << 20), Ok(1024));
        // No more than the descriptors hold: (1024 - 64) / 3.
        assert_eq!(c.max_connections(26, 1024), Ok(320));
        let c = config(&["--max-connections", "5000"]);
        assert_eq!(c.max_connections(26, 1 << 20), Ok(5000));
        let e = c.max_connections(26, 1024).unwrap_err();
        assert!(e.contains("file descriptors"), "{e}");
        let a = ServeArgs::from_args(&["sluice", "serve"], &["--max-connections", "0"]).unwrap();
        assert!(Config::from_args(a).is_err());
        let a = ServeArgs::from_args(&["sluice", "serve"], &["--allowed-origins", "evil"]).unwrap();
        assert!(Config::from_args(a).is_err());
    }

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
        let flags = serve_flags();
        let known: std::collections::BTreeSet<String> = flags
            .iter()
            .map(|(f, _)| f.clone())
            .chain(["help".to_string()])
            .collect();
        // Every flag the help names is one the environment may give, and the
        // usage line's reading tells options from switches.
        assert!(flags.contains(&("port".to_string(), true)), "{flags:?}");
        assert!(flags.contains(&("mmap".to_string(), false)), "{flags:?}");
        assert!(flags.contains(&("queue-depth-unsafe".to_string(), false)));
        assert_eq!(flags.len(), known.len() - 1, "no flag twice: {flags:?}");
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
