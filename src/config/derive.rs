//! The checks and derivations `Config::from_args` is made of: the ranges of
//! the numeric flags, and each setting that follows from several flags.

use super::*;

pub(super) fn check_range<T: PartialOrd + std::fmt::Display>(
    flag: &str,
    v: T,
    lo: T,
    hi: T,
) -> Result<(), String> {
    // Written so that NaN fails too.
    if !(v >= lo && v <= hi) {
        return Err(format!("{flag} is {v}; it must be {lo} to {hi}"));
    }
    Ok(())
}

/// The ranges of the flags that size the queue and the engine's steps.
pub(super) fn check_engine_ranges(a: &ServeArgs) -> Result<(), String> {
    let usize_ranges = [
        ("--parallel", a.parallel, 1, PARALLEL_MAX),
        (
            "--prefix-cache-mb",
            a.prefix_cache_mb,
            0,
            PREFIX_CACHE_MB_MAX,
        ),
        (
            "--client-table-max",
            a.client_table_max,
            1,
            CLIENT_TABLE_MAX,
        ),
        (
            "--typical-prompt-tokens",
            a.typical_prompt_tokens,
            1,
            CTX_TOKENS_MAX,
        ),
        (
            "--typical-max-tokens",
            a.typical_max_tokens,
            1,
            CTX_TOKENS_MAX,
        ),
        (
            "--max-tokens-default",
            a.max_tokens_default,
            1,
            CTX_TOKENS_MAX,
        ),
    ];
    for (flag, v, lo, hi) in usize_ranges {
        check_range(flag, v, lo, hi)?;
    }
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
    check_range(
        "--batch-queue-wait-ms",
        a.batch_queue_wait_ms,
        1,
        DURATION_MS_MAX,
    )?;
    check_range("--batch-every", a.batch_every, 1, BATCH_EVERY_MAX)?;
    if let Some(n) = a.step_tokens {
        check_range("--step-tokens", n, a.parallel, STEP_TOKENS_MAX)
            .map_err(|e| format!("{e} (every running sequence needs a token in each step, so it must be at least --parallel)"))?;
    }
    check_range("--itl-target-ms", a.itl_target_ms, 1, ITL_TARGET_MS_MAX)?;
    check_range("--itl-max-ms", a.itl_max_ms, 0, ITL_TARGET_MS_MAX)?;
    check_range("--decode-ahead-ms", a.decode_ahead_ms, 0, ITL_TARGET_MS_MAX)?;
    check_range(
        "--overdue-stretch",
        a.overdue_stretch,
        0.0,
        OVERDUE_STRETCH_MAX,
    )?;
    if let Some(ctx) = a.ctx {
        check_range("--ctx", ctx, CTX_TOKENS_MIN, CTX_TOKENS_MAX)?;
    }
    Ok(())
}

/// The ranges of the flags of the HTTP front: sizes, timeouts, the pool.
pub(super) fn check_http_ranges(a: &ServeArgs) -> Result<(), String> {
    let usize_ranges = [
        (
            "--max-body-bytes",
            a.max_body_bytes,
            BODY_BYTES_MIN,
            BODY_BYTES_MAX,
        ),
        (
            "--stream-buffer-tokens",
            a.stream_buffer_tokens,
            1,
            crate::stream::STREAM_BUFFER_TOKENS_MAX,
        ),
        (
            "--send-buffer-bytes",
            a.send_buffer_bytes,
            SEND_BUFFER_BYTES_MIN,
            SEND_BUFFER_BYTES_MAX,
        ),
    ];
    for (flag, v, lo, hi) in usize_ranges {
        check_range(flag, v, lo, hi)?;
    }
    let ms_ranges = [
        ("--stall-timeout-ms", a.stall_timeout_ms, 1),
        ("--sse-keep-alive-ms", a.sse_keep_alive_ms, 10),
        ("--client-timeout-ms", a.client_timeout_ms, 1),
        ("--drain-timeout-ms", a.drain_timeout_ms, 0),
        ("--header-timeout-ms", a.header_timeout_ms, 1),
        ("--keep-alive-ms", a.keep_alive_ms, 1),
    ];
    for (flag, v, lo) in ms_ranges {
        check_range(flag, v, lo, DURATION_MS_MAX)?;
    }
    check_range(
        "--drain-notice-ms",
        a.drain_notice_ms,
        0,
        DRAIN_NOTICE_MS_MAX,
    )?;
    if a.request_timeout_ms == 0 {
        return Err("--request-timeout-ms must be positive".into());
    }
    if let Some(n) = a.max_connections {
        check_range("--max-connections", n, 1, CONNECTIONS_MAX)?;
    }
    if let Some(n) = a.http_queue_depth {
        check_range("--http-queue-depth", n, 1, HTTP_THREADS_MAX)?;
    }
    check_range("--poll", a.poll, 0, POLL_MAX)?;
    if let Some(n) = a.http_threads {
        check_range("--http-threads", n, 2, HTTP_THREADS_MAX)?;
    }
    Ok(())
}

/// The KV cache type and flash attention setting: a q8_0 cache needs flash
/// attention (llama.cpp quantizes the V cache only with it), so it implies it;
/// and the short requests' context's cells (`short_cells`).
pub(super) fn attention(a: &ServeArgs) -> Result<(KvTypeSetting, FlashAttnSetting, usize), String> {
    let q8 = KvTypeSetting::Fixed(KvType::Q8_0);
    let short = short_cells(a)?;
    let (kv, flash) = match (a.kv_type, a.flash_attn) {
        (k, FlashAttnSetting::Fixed(FlashAttn::Off)) if k == q8 => return Err(
            "--kv-type q8_0 needs flash attention (llama.cpp quantizes the V cache only with it): add --flash-attn on".into(),
        ),
        // Nothing to measure: a quantized V cache exists only with it.
        (k, FlashAttnSetting::Measure) if k == q8 => (k, FlashAttnSetting::Fixed(FlashAttn::On)),
        (k, f) => (k, f),
    };
    Ok((kv, flash, short))
}

/// Cells of the short requests' context's streams by default (`--short-cells`):
/// a chat's prompt and answer (the side-by-side's closed loops: ~90 + 64
/// tokens; a mix's short requests up to a few hundred each), deep enough
/// that flash attention with an f16 cache still decodes at least as fast as
/// the main context's pairing (on the Zen 1: 13-18 % faster 32 deep, ~10 %
/// 128 deep, 14 % slower 1,024 deep; bench/results/2026-12-06-zen1/).
pub const SHORT_CELLS_DEFAULT: usize = 1024;

/// `--short-cells`: as given (per-seq only), else the default when the
/// attention pairing is left to measurement.
pub(super) fn short_cells(a: &ServeArgs) -> Result<usize, String> {
    let per_seq = a.kv_layout == KvLayout::PerSequence;
    match a.short_cells {
        Some(n) if n > 0 && !per_seq => Err(format!(
            "--short-cells {n} needs --kv-layout per-seq (a second context's streams)"
        )),
        Some(n) => {
            check_range("--short-cells", n, 0, CTX_TOKENS_MAX)?;
            Ok(n)
        }
        None => {
            let measured =
                a.kv_type == KvTypeSetting::Measure && a.flash_attn == FlashAttnSetting::Measure;
            Ok(if per_seq && measured {
                SHORT_CELLS_DEFAULT
            } else {
                0
            })
        }
    }
}

/// Interactive-only slots: as given (below `--parallel`, so that batch
/// requests can run at all), else one when there are several.
pub(super) fn interactive_slots(a: &ServeArgs) -> Result<usize, String> {
    let n = a.interactive_slots.unwrap_or(usize::from(a.parallel > 1));
    check_range("--interactive-slots", n, 0, a.parallel - 1)
        .map_err(|e| format!("{e} (below --parallel, so that batch requests can run at all)"))?;
    Ok(n)
}

/// The per-client token bucket, if `--client-rate` asks for one.
pub(super) fn client_limit(rate: Option<f64>, burst: Option<u64>) -> Result<Option<Limit>, String> {
    match (rate, burst) {
        (None, None) => Ok(None),
        (None, Some(_)) => Err("--client-burst needs --client-rate".into()),
        (Some(r), _) if !(r.is_finite() && r > 0.0) => Err(format!(
            "--client-rate is {r}; it must be a positive number of tokens/s"
        )),
        (Some(_), Some(0)) => Err("--client-burst must be positive".into()),
        (Some(r), b) => Ok(Some(Limit {
            rate_tok_s: r,
            burst: b.unwrap_or_else(|| crate::auth::default_burst(r)),
        })),
    }
}

/// `--trusted-proxies`: a comma-separated list of IP addresses (each a
/// network of one) and networks (`10.0.0.0/8`).
pub(super) fn trusted_proxies(list: Option<&str>) -> Result<Vec<ipnet::IpNet>, String> {
    list.into_iter()
        .flat_map(|l| l.split(','))
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| {
            p.parse::<ipnet::IpNet>()
                .map(|n| n.trunc())
                .or_else(|_| p.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
                .map_err(|_| format!("--trusted-proxies: '{p}' is not an IP address or network"))
        })
        .collect()
}

/// Rates given on the command line (both or neither; then sluice calibrates).
pub(super) fn rates(a: &ServeArgs) -> Result<Option<Rates>, String> {
    let rates = match (a.mu_prefill, a.mu_decode) {
        (None, None) => None,
        (Some(p), Some(d)) if p > 0.0 && d > 0.0 && p.is_finite() && d.is_finite() => Some(Rates {
            prefill_tok_s: p,
            decode_tok_s: d,
        }),
        (Some(_), Some(_)) => return Err("--mu-prefill and --mu-decode must be positive".into()),
        _ => {
            return Err(
                "give both --mu-prefill and --mu-decode, or neither (then sluice calibrates)"
                    .into(),
            )
        }
    };
    if a.mu_fixed && rates.is_none() {
        return Err("--mu-fixed keeps --mu-prefill and --mu-decode: give both".into());
    }
    Ok(rates)
}

/// CoDel's (target, interval): half W_max and W_max unless given.
pub(super) fn shed(a: &ServeArgs, queue_wait_ms: u64) -> Option<(Duration, Duration)> {
    if a.no_shed {
        return None;
    }
    let target = a.shed_target_ms.unwrap_or(queue_wait_ms / 2).max(1);
    let interval = a.shed_interval_ms.unwrap_or(queue_wait_ms).max(1);
    Some((
        Duration::from_millis(target),
        Duration::from_millis(interval),
    ))
}

/// `--batch-objectives`: its comma-separated names, trimmed, the empty ones
/// left out.
pub(super) fn batch_objectives(a: &ServeArgs) -> Vec<String> {
    a.batch_objectives
        .as_deref()
        .unwrap_or("")
        .split(',')
        .map(|o| o.trim().to_string())
        .filter(|o| !o.is_empty())
        .collect()
}

/// The name the API reports: `--model-name`, else the file's without `.gguf`.
pub(super) fn model_name(a: &ServeArgs) -> String {
    a.model_name.clone().unwrap_or_else(|| {
        a.model
            .file_name()
            .map(|f| f.to_string_lossy().trim_end_matches(".gguf").to_string())
            .unwrap_or_else(|| "model".into())
    })
}

/// The calibration cache file: `--calibration-cache` (`off`: none), else
/// the default path.
pub(super) fn calibration_cache(a: &ServeArgs) -> Result<Option<PathBuf>, String> {
    let path = match a.calibration_cache.as_deref() {
        Some("off") => None,
        Some("") => return Err("--calibration-cache is empty; give a file, or off".into()),
        Some(path) => Some(PathBuf::from(path)),
        None => default_calibration_cache(|k| std::env::var(k).ok()),
    };
    if a.calibrate_only && path.is_none() {
        return Err(
            "--calibrate-only keeps its measurements in the calibration cache: give --calibration-cache FILE"
                .into(),
        );
    }
    Ok(path)
}

/// Largest `--batch-file-bytes-max`: a whole upload is held in memory.
pub const BATCH_FILE_BYTES_MAX: usize = 1 << 30;
/// Largest `--batch-lines-max` (OpenAI's own bound).
pub const BATCH_LINES_MAX: usize = 50_000;
/// Largest `--batches-max`.
pub const BATCHES_MAX: usize = 100_000;

/// The Batch API's settings, or `None` with `--data-dir off` (or no
/// directory to default to).
pub(super) fn batch(
    a: &ServeArgs,
    interactive_slots: usize,
) -> Result<Option<super::BatchConfig>, String> {
    let dir = match a.data_dir.as_deref() {
        Some("off") => return Ok(None),
        Some("") => return Err("--data-dir is empty; give a directory, or off".into()),
        Some(dir) => PathBuf::from(dir),
        None => match default_data_dir(|k| std::env::var(k).ok()) {
            Some(dir) => dir,
            None => return Ok(None),
        },
    };
    check_range(
        "--batch-file-bytes-max",
        a.batch_file_bytes_max,
        1024,
        BATCH_FILE_BYTES_MAX,
    )?;
    check_range("--batch-lines-max", a.batch_lines_max, 1, BATCH_LINES_MAX)?;
    check_range("--batches-max", a.batches_max, 1, BATCHES_MAX)?;
    check_range(
        "--batch-retention-hours",
        a.batch_retention_hours as usize,
        1,
        24 * 365 * 10,
    )?;
    if a.data_bytes_max < a.batch_file_bytes_max as u64 {
        return Err(format!(
            "--data-bytes-max {} is less than --batch-file-bytes-max {}: no file could be kept",
            a.data_bytes_max, a.batch_file_bytes_max
        ));
    }
    let batch_slots = a.parallel.saturating_sub(interactive_slots).max(1);
    let concurrency = a.batch_concurrency.unwrap_or(batch_slots);
    check_range("--batch-concurrency", concurrency, 1, a.parallel)?;
    Ok(Some(super::BatchConfig {
        dir,
        limits: crate::batch::StoreLimits {
            file_bytes_max: a.batch_file_bytes_max,
            lines_max: a.batch_lines_max,
            batches_max: a.batches_max,
            stored_bytes_max: a.data_bytes_max,
            retention_s: a.batch_retention_hours as i64 * 3600,
        },
        concurrency,
    }))
}

/// The Batch API's directory when `--data-dir` is not given: systemd's
/// `StateDirectory=` (`$STATE_DIRECTORY`), else `$XDG_STATE_HOME/sluice`,
/// else `~/.local/state/sluice`.
pub(super) fn default_data_dir(env: impl Fn(&str) -> Option<String>) -> Option<PathBuf> {
    let nonempty = |k: &str| env(k).filter(|v| !v.is_empty());
    if let Some(dirs) = nonempty("STATE_DIRECTORY") {
        return Some(PathBuf::from(dirs.split(':').next().unwrap_or_default()));
    }
    if let Some(xdg) = nonempty("XDG_STATE_HOME") {
        return Some(PathBuf::from(xdg).join("sluice"));
    }
    nonempty("HOME").map(|h| PathBuf::from(h).join(".local/state/sluice"))
}

/// The calibration cache's file name in its directory.
const CALIBRATION_CACHE_FILE: &str = "calibration.json";

/// The cache file sluice uses when `--calibration-cache` is not given:
/// systemd's `CacheDirectory=` (`$CACHE_DIRECTORY`), else
/// `$XDG_CACHE_HOME/sluice`, else `~/.cache/sluice`.
pub(super) fn default_calibration_cache(env: impl Fn(&str) -> Option<String>) -> Option<PathBuf> {
    let nonempty = |k: &str| env(k).filter(|v| !v.is_empty());
    let file = CALIBRATION_CACHE_FILE;
    if let Some(dirs) = nonempty("CACHE_DIRECTORY") {
        // systemd separates several directories with ':'; the first is ours.
        let first = dirs.split(':').next().unwrap_or_default().to_string();
        return Some(PathBuf::from(first).join(file));
    }
    if let Some(xdg) = nonempty("XDG_CACHE_HOME") {
        return Some(PathBuf::from(xdg).join("sluice").join(file));
    }
    nonempty("HOME").map(|h| PathBuf::from(h).join(".cache/sluice").join(file))
}
