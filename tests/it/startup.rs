//! Start-up: version, flash attention chosen by measurement, and model files
//! that are missing, not GGUF, or cut short.

use crate::harness::*;
use serde_json::json;
use std::process::Command;

#[test]
fn version_reports_commit_and_cpu_features() {
    let out = Command::new(binary()).arg("--version").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.starts_with(&format!("sluice {}", env!("CARGO_PKG_VERSION"))),
        "{text}"
    );
    assert!(text.contains("commit: "), "{text}");
    assert!(text.contains("llama.cpp: CPU :"), "{text}");
}

#[test]
fn version_and_help_into_a_closed_pipe_exit_quietly() {
    // `sluice --version | head -1`: the reader is gone before the rest is
    // written. That is the reader's choice, not a crash of sluice.
    for arg in ["--version", "--help"] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = Command::new(binary())
            .arg(arg)
            .stdout(writer)
            .stderr(std::process::Stdio::piped())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{arg}: {:?}\n{stderr}", out.status);
        assert!(!stderr.contains("panicked"), "{arg}: {stderr}");
    }
}

fn serve_fails(model: &std::path::Path) -> String {
    let out = Command::new(binary())
        .args(["serve", "--port", "0", "--model"])
        .arg(model)
        .output()
        .unwrap();
    // Exit code 1: a clear error, not a signal from an abort or a crash.
    assert_eq!(
        out.status.code(),
        Some(1),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_bad_model_file_is_a_clear_error_not_a_crash() {
    let dir = std::env::temp_dir().join(format!("sluice-startup-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    let err = serve_fails(&dir.join("missing.gguf"));
    assert!(
        err.contains("missing.gguf") && err.contains("No such file"),
        "{err}"
    );

    let text = dir.join("notes.gguf");
    std::fs::write(&text, "this is not a model\n".repeat(100)).unwrap();
    let err = serve_fails(&text);
    assert!(err.contains("is not a GGUF file"), "{err}");

    // The real model, cut short after its header and some tensor data.
    let real = std::fs::read(model_path()).unwrap();
    for keep in [2048, real.len() / 2] {
        let truncated = dir.join(format!("truncated-{keep}.gguf"));
        std::fs::write(&truncated, &real[..keep]).unwrap();
        let err = serve_fails(&truncated);
        assert!(err.contains("truncated or corrupt"), "{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A calibration cache of the test's own, empty.
fn own_cache(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("sluice-it-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir.join("calibration.json")
}

#[test]
fn flash_attention_is_measured_ahead_of_time_kept_and_used_unless_it_is_set() {
    let cache = own_cache("attention");
    let cache_arg = cache.to_str().expect("path");
    // The long measurement, ahead of time: it times, keeps and exits. With
    // the KV type given, two pairings are timed (flash attention off and on,
    // f16), not four: half the time, the same code (the four candidates are
    // a unit test's).
    let out = Command::new(binary())
        .args([
            "serve",
            "--calibrate-only",
            "--kv-type",
            "f16",
            "--calibration-cache",
            cache_arg,
            "--model",
        ])
        .arg(model_path())
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{log}");
    let line = log
        .lines()
        .find(|l| l.starts_with("sluice: attention: "))
        .unwrap_or_else(|| panic!("no attention line in the log:\n{log}"));
    // Flash attention off and on, f16: both timed, at a short chat's depth
    // and a long one's.
    assert!(
        line.contains("measured in")
            && line.contains("at depths 128 and 1024,")
            && line.contains("off/f16 ")
            && line.contains("on/f16 ")
            && !line.contains("q8_0"),
        "{line}"
    );
    let chosen = line
        .split("flash attention/KV type ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .expect("the chosen pairing")
        .to_string();
    assert!(log.contains("sluice: calibrate-only: prefill "), "{log}");
    assert!(!log.contains("listening on"), "{log}");
    // Kept with each pairing's timings at both depths, for later starts to
    // weigh by the tokens served.
    let kept: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cache).unwrap()).unwrap();
    let timings = kept["entries"][0]["attention_timings"]
        .as_array()
        .expect("timings kept");
    assert_eq!(timings.len(), 2, "{kept}");
    for t in timings {
        let depths: Vec<u64> = t
            .as_array()
            .expect("by depth")
            .iter()
            .map(|d| d["depth"].as_u64().expect("depth"))
            .collect();
        assert_eq!(depths, [128, 1024], "{kept}");
    }
    // A start with the same settings takes the pairing kept, without timing.
    let srv = Server::start(&["--calibration-cache", cache_arg, "--kv-type", "f16"]);
    let log = srv.log();
    assert!(
        log.contains(&format!(
            "sluice: attention: flash attention/KV type {chosen} (measured before, from the calibration cache"
        )),
        "{log}"
    );
    assert!(!log.contains("measured in"), "{log}");
    // Without flash attention llama.cpp computes a 512-token step in passes
    // of 256 (the scores of a pass stay in cache); with it, in one.
    let passes = if chosen.starts_with("off/") { 256 } else { 512 };
    assert!(
        log.contains(&format!("computed in passes of at most {passes} tokens")),
        "{log}"
    );
    let r = srv.post(
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    drop(srv);
    let _ = std::fs::remove_dir_all(cache.parent().expect("dir"));

    let srv = Server::start(&["--flash-attn", "off", "--kv-type", "q8_0/f16"]);
    assert!(
        !srv.log().contains("sluice: attention: "),
        "set by the operator: nothing to measure\n{}",
        srv.log()
    );
    assert!(
        srv.log()
            .contains("computed in passes of at most 256 tokens"),
        "{}",
        srv.log()
    );
    let r = srv.post(
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}

#[test]
fn a_cached_calibration_is_used_at_the_next_start_then_corrected_online_and_kept() {
    let cache = own_cache("rates");
    let cache_arg = cache.to_str().expect("path");
    // First start: nothing kept, so the rates are measured, and kept.
    let mut srv = Server::start(&["--calibration-cache", cache_arg]);
    assert!(srv.log().contains("sluice: calibration ("), "{}", srv.log());
    assert!(
        srv.log().contains("calibration cache: kept in"),
        "{}",
        srv.log()
    );
    srv.signal("TERM");
    assert_eq!(srv.wait_exit(std::time::Duration::from_secs(120)), Some(0));
    // Make the kept rates wrong: 5 tokens/s, slower than any box runs this
    // model, so that the online correction must show.
    let text = std::fs::read_to_string(&cache).expect("the cache file");
    let mut v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(v["entries"].as_array().map(Vec::len), Some(1));
    for field in [
        "prefill_tok_s",
        "decode_tok_s_batch_1",
        "decode_tok_s_parallel",
    ] {
        v["entries"][0][field] = json!(5.0);
    }
    std::fs::write(&cache, v.to_string()).unwrap();

    // Second start: the kept rates are used as they are, nothing is timed.
    let mut srv = Server::start(&["--calibration-cache", cache_arg]);
    let log = srv.log();
    assert!(
        log.contains("sluice: calibration: from the cache: prefill 5 tok/s"),
        "{log}"
    );
    assert!(!log.contains("sluice: calibration ("), "{log}");
    assert_eq!(srv.metric("sluice_mu_prefill_tokens_per_second"), 5.0);
    assert_eq!(srv.metric("sluice_mu_decode_tokens_per_second"), 5.0);
    // A few requests: every step they take is a measurement, and a rate
    // this far too slow moves up from the first.
    for i in 0..3 {
        let r = srv.post(
            "/v1/completions",
            &json!({"prompt": format!("Request {i}.\n{}", long_prompt(20 + i)), "max_tokens": 64, "ignore_eos": true, "temperature": 0}),
        );
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    }
    // Corrected online: the published rates leave the kept ones.
    wait_until(
        std::time::Duration::from_secs(300),
        "the engine to publish the rates it measured",
        || {
            srv.metric("sluice_mu_prefill_tokens_per_second") > 5.0
                && srv.metric("sluice_mu_decode_tokens_per_second") > 5.0
        },
    );
    srv.signal("TERM");
    assert_eq!(srv.wait_exit(std::time::Duration::from_secs(120)), Some(0));
    // And the corrected rates are what the next start finds.
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cache).unwrap()).unwrap();
    let e = &v["entries"][0];
    assert_eq!(e["refined"], true, "{e}");
    assert!(e["prefill_tok_s"].as_f64().unwrap() > 5.0, "{e}");
    assert!(e["decode_tok_s_parallel"].as_f64().unwrap() > 5.0, "{e}");
    let _ = std::fs::remove_dir_all(cache.parent().expect("dir"));
}

/// A cache entry as `--calibrate-only` writes it, with timings of the
/// 2-core EPYC's shape (flash attention on ties at a chat's depth and is
/// twice as dear deep in a context) and on/q8_0 chosen (as a mean of the
/// timings chose before the worst one judged). The timing itself
/// is tested above; here, what the tokens served make of the timings.
fn timed_entry(cache: &std::path::Path) {
    let t = |depth: u64, decode_ms: f64, prefill_ms: f64| json!({"depth": depth, "decode_s_per_token": decode_ms / 1e3, "prefill_s_per_token": prefill_ms / 1e3});
    set_timings(
        cache,
        "on/q8_0",
        json!([
            [t(128, 8.5, 5.7), t(1024, 10.0, 9.0)],
            [t(128, 9.0, 6.0), t(1024, 11.0, 9.5)],
            [t(128, 8.1, 6.1), t(1024, 12.0, 18.0)],
            [t(128, 8.3, 6.5), t(1024, 13.0, 20.0)],
        ]),
    );
}

/// The cache's one entry (of the default flags' four candidates) made to
/// say that `--calibrate-only` chose `attention` with these `timings`.
fn set_timings(cache: &std::path::Path, attention: &str, timings: serde_json::Value) {
    let text = std::fs::read_to_string(cache).expect("the cache file");
    let mut v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let e = &mut v["entries"][0];
    assert_eq!(
        e["key"]["candidates"],
        json!(["off/q8_0/f16", "off/f16", "on/q8_0", "on/f16"]),
        "{e}"
    );
    e["attention"] = json!(attention);
    e["attention_measured"] = json!(true);
    e["attention_timings"] = timings;
    std::fs::write(cache, v.to_string()).unwrap();
}

#[test]
fn the_tokens_served_choose_among_the_timed_pairings_at_the_next_start() {
    let cache = own_cache("served");
    let cache_arg = cache.to_str().expect("path");
    let mut srv = Server::start(&["--calibration-cache", cache_arg]);
    srv.signal("TERM");
    assert_eq!(srv.wait_exit(std::time::Duration::from_secs(120)), Some(0));
    timed_entry(&cache);

    // The pairing kept is used as it is: nothing served yet.
    let mut srv = Server::start(&["--calibration-cache", cache_arg]);
    let log = srv.log();
    assert!(
        log.contains(
            "sluice: attention: flash attention/KV type on/q8_0 (measured before, from the calibration cache"
        ),
        "{log}"
    );
    // One long prompt: the tokens it computes are counted with their depth.
    let v = srv.post_ok(
        "/v1/completions",
        &json!({"prompt": long_prompt(90), "max_tokens": 8, "ignore_eos": true, "temperature": 0}),
    );
    let n = v["usage"]["prompt_tokens"].as_f64().expect("usage");
    assert!(n >= 1_000.0, "{v}");
    let count = |name: &str, kind: &str| srv.metric(&format!("{name}{{kind=\"{kind}\"}}"));
    assert_eq!(count("sluice_attention_tokens_total", "prefill"), n);
    assert_eq!(
        count("sluice_attention_depth_cells_total", "prefill"),
        n * (n - 1.0) / 2.0,
        "each prompt token as deep as the tokens before it"
    );
    let k = count("sluice_attention_tokens_total", "decode");
    assert!((1.0..=8.0).contains(&k), "{k}");
    assert_eq!(
        count("sluice_attention_depth_cells_total", "decode"),
        k * n + k * (k - 1.0) / 2.0,
        "each decode token after the prompt and the tokens generated before it"
    );
    srv.signal("TERM");
    assert_eq!(srv.wait_exit(std::time::Duration::from_secs(120)), Some(0));
    let kept: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cache).unwrap()).unwrap();
    let served = &kept["entries"][0]["served"];
    assert_eq!(served["prefill_tokens"].as_f64(), Some(n), "{served}");
    assert_eq!(served["decode_tokens"].as_f64(), Some(k), "{served}");

    // The next start weighs the timings by what was served: deep prompts,
    // where off with K in q8_0 costs half as much.
    let srv = Server::start(&["--calibration-cache", cache_arg]);
    let log = srv.log();
    assert!(
        log.contains(
            "sluice: attention: flash attention/KV type off/q8_0/f16, not on/q8_0 (measured before; chosen anew for the tokens served since"
        ),
        "{log}"
    );
    srv.post_ok(
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 4, "temperature": 0}),
    );
    drop(srv);
    let kept: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cache).unwrap()).unwrap();
    assert_eq!(kept["entries"][0]["attention"], "off/q8_0/f16");
    let _ = std::fs::remove_dir_all(cache.parent().expect("dir"));
}

/// The cache's entry made to say what `--calibrate-only` would have timed
/// on a CPU where flash attention with an f16 cache prefills a whole chunk
/// 1,024 deep at `on_f16_ms` a token, off with K in q8_0 (the pairing kept,
/// the fastest at everything else) at 6.3 ms; and decodes there at
/// `on_f16_decode_ms` a token against 10.
fn whole_chunks_entry(cache: &std::path::Path, on_f16_ms: f64, on_f16_decode_ms: f64) {
    let t = |depth: u64, ms: f64, whole: Option<f64>| {
        let mut t = json!({"depth": depth, "decode_s_per_token": ms / 1e3, "prefill_s_per_token": ms / 2e3});
        if let Some(w) = whole {
            t["whole_prefill_s_per_token"] = json!(w / 1e3);
        }
        t
    };
    set_timings(
        cache,
        "off/q8_0/f16",
        json!([
            [t(128, 8.0, None), t(1024, 10.0, Some(6.3))],
            [t(128, 9.0, None), t(1024, 12.0, Some(6.6))],
            [t(128, 9.0, None), t(1024, 12.0, Some(7.2))],
            [
                t(128, 9.0, None),
                t(1024, on_f16_decode_ms, Some(on_f16_ms))
            ],
        ]),
    );
}

/// A stream of a short prompt and a 2,000-token answer, started (its first
/// token read), whose client then reads nothing: paused, in its slot.
fn long_answer_started(srv: &Server) -> Sse {
    let mut sse = Sse::open(
        srv.addr,
        "/v1/completions",
        &json!({"prompt": "Write a poem about the sea.", "stream": true, "max_tokens": 2000, "ignore_eos": true, "temperature": 0}),
    );
    assert_eq!(sse.status, 200);
    assert!(sse.next_json().is_some(), "a first token");
    sse
}

#[test]
fn a_prompt_alone_runs_where_whole_chunks_were_timed_faster_and_a_deep_one_beside_streams_does_not()
{
    let cache = own_cache("alone");
    let cache_arg = cache.to_str().expect("path");
    let args = [
        "--calibration-cache",
        cache_arg,
        "--stall-timeout-ms",
        "600000",
    ];
    let mut srv = Server::start(&args);
    assert!(
        srv.log().contains("run in a second context"),
        "{}",
        srv.log()
    );
    srv.signal("TERM");
    assert_eq!(srv.wait_exit(std::time::Duration::from_secs(120)), Some(0));
    // Flash attention with an f16 cache timed faster at whole chunks: the
    // short requests' context takes a long prompt that runs alone.
    whole_chunks_entry(&cache, 5.4, 10.0);
    let mut srv = Server::start(&args);
    assert!(
        srv.log()
            .contains("and with nothing else running those of at most 4352 cells"),
        "{}",
        srv.log()
    );
    let short_starts = |srv: &Server| srv.metric("sluice_short_context_requests_total");
    // The main context's prompt tokens (the short one's are not counted).
    let main_prefill = |srv: &Server| srv.metric("sluice_attention_tokens_total{kind=\"prefill\"}");
    let v = srv.post_ok(
        "/v1/completions",
        &json!({"prompt": long_prompt(90), "max_tokens": 8, "temperature": 0}),
    );
    let n = v["usage"]["prompt_tokens"].as_f64().expect("usage");
    assert!(n > 1_024.0, "longer than --short-cells: {v}");
    assert_eq!(
        short_starts(&srv),
        1.0,
        "alone: the short requests' context"
    );
    assert_eq!(main_prefill(&srv), 0.0);

    // A stream too long for --short-cells starts alone there too, and stays
    // (its client reads one event and then nothing: paused, in its slot).
    let sse = long_answer_started(&srv);
    assert_eq!(short_starts(&srv), 2.0);
    // Beside it, a chat joins it there; a prompt of over 256 tokens (that
    // would go in small chunks, deep) runs in the main context.
    srv.post_ok(
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(short_starts(&srv), 3.0, "a chat beside the stream");
    let v = srv.post_ok(
        "/v1/completions",
        &json!({"prompt": format!("Another text.\n{}", long_prompt(40)), "max_tokens": 8, "temperature": 0}),
    );
    let deep = v["usage"]["prompt_tokens"].as_f64().expect("usage");
    assert!((257.0..1_000.0).contains(&deep), "fits --short-cells: {v}");
    assert_eq!(
        short_starts(&srv),
        3.0,
        "deep beside the stream: the main context"
    );
    assert_eq!(main_prefill(&srv), deep);
    drop(sse);
    srv.signal("TERM");
    assert_eq!(srv.wait_exit(std::time::Duration::from_secs(120)), Some(0));

    // Decoding dearer there (14 ms a token against 10): a prompt token's
    // 0.9 ms gained pays for 0.225 answer tokens. The long prompt with a
    // short answer alone still runs there; a short prompt with a long
    // answer (the side-by-side's head-of-line streams) in the main context.
    whole_chunks_entry(&cache, 5.4, 14.0);
    let mut srv = Server::start(&args);
    assert!(
        srv.log().contains("its answer at most 0.2"),
        "{}",
        srv.log()
    );
    srv.post_ok(
        "/v1/completions",
        &json!({"prompt": long_prompt(90), "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(short_starts(&srv), 1.0, "its prompt pays for its answer");
    let sse = long_answer_started(&srv);
    assert_eq!(
        short_starts(&srv),
        1.0,
        "a long answer alone: the main context"
    );
    drop(sse);
    srv.signal("TERM");
    assert_eq!(srv.wait_exit(std::time::Duration::from_secs(120)), Some(0));

    // Timed slower there: a long prompt alone runs in the main context.
    whole_chunks_entry(&cache, 7.0, 10.0);
    let srv = Server::start(&args);
    assert!(!srv.log().contains("nothing else running"), "{}", srv.log());
    srv.post_ok(
        "/v1/completions",
        &json!({"prompt": long_prompt(90), "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(short_starts(&srv), 0.0);
    assert_eq!(main_prefill(&srv), n);
    drop(srv);
    let _ = std::fs::remove_dir_all(cache.parent().expect("dir"));
}
