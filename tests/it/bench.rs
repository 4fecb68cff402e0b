//! The bundled harness measures what really happened: its counts agree with
//! sluice's own counters.

use crate::harness::*;
use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;

fn bench_binary() -> PathBuf {
    // Built by `cargo build --release --workspace` (the Makefile's `integration`
    // target does it first); it lives next to the sluice binary.
    let p = std::path::Path::new(binary()).with_file_name("sluice-bench");
    assert!(
        p.exists(),
        "{} is missing: run cargo build --release --workspace",
        p.display()
    );
    p
}

/// Runs `sluice-bench <scenario> --url <srv> --quiet <args>`, which must
/// succeed: its report, and the SVG it wrote beside it (if any); both files
/// are removed.
fn run_bench(srv: &Server, scenario: &str, args: &[&str]) -> (Value, Option<String>) {
    let out = std::env::temp_dir().join(format!(
        "sluice-bench-{scenario}-{}.json",
        std::process::id()
    ));
    let status = Command::new(bench_binary())
        .args([
            scenario,
            "--url",
            &format!("http://{}", srv.addr),
            "--quiet",
        ])
        .args(args)
        .arg("--out")
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .status()
        .expect("run sluice-bench");
    assert!(status.success(), "sluice-bench {scenario} failed");
    let report = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    std::fs::remove_file(&out).unwrap();
    let svg_path = out.with_extension("svg");
    let svg = std::fs::read_to_string(&svg_path).ok();
    let _ = std::fs::remove_file(&svg_path);
    (report, svg)
}

fn sum_over_phases(report: &Value, f: impl Fn(&Value) -> u64) -> u64 {
    report["result"]["phases"]
        .as_array()
        .expect("phases")
        .iter()
        .map(f)
        .sum()
}

#[test]
fn a_short_overload_run_counts_what_sluice_counted() {
    // A small server so that twice the claimed capacity overflows its queue.
    let srv = Server::start(&["--parallel", "2", "--queue-depth", "2"]);
    let before = srv.metrics();
    let pid = srv.pid().to_string();
    let (report, svg) = run_bench(
        &srv,
        "overload",
        &[
            "--capacity",
            "4",
            "--duration-s",
            "9",
            "--prompt-tokens",
            "fixed:20",
            "--max-tokens",
            "fixed:24",
            "--timeout-s",
            "300",
            "--clients",
            "64",
            "--pid",
            &pid,
        ],
    );
    let after = srv.metrics();
    let svg = svg.expect("the overload run's timeline plot");

    let delta = |name: &str| metric_value(&after, name) - metric_value(&before, name);
    let statuses =
        |code: &str| sum_over_phases(&report, |p| p["statuses"][code].as_u64().unwrap_or(0));
    let outcome =
        |kind: &str| sum_over_phases(&report, |p| p["outcomes"][kind].as_u64().unwrap_or(0));
    // sluice counts a request accepted when it enters the queue; it may then be
    // shed (503) if it waits past the sojourn target.
    let shed = statuses("503");
    let accepted = statuses("200") + shed;
    let rejected = statuses("429");
    let completed = outcome("completed");
    eprintln!(
        "harness: {accepted} accepted, {rejected} rejected, {completed} completed; report {report}"
    );

    // The run was an overload: some requests were served and some refused.
    assert!(
        completed > 0 && rejected > 0,
        "not an overload: {accepted} accepted, {rejected} rejected"
    );
    assert_eq!(
        outcome("client_overflow"),
        0,
        "every arrival had a client thread"
    );
    assert_eq!(outcome("timeout") + outcome("broken"), 0);
    // The harness saw exactly what sluice counted.
    assert_eq!(accepted as f64, delta("sluice_requests_accepted_total"));
    assert_eq!(
        rejected as f64,
        delta("sluice_requests_rejected_total{reason=\"queue_full\"}")
    );
    assert_eq!(completed as f64, delta("sluice_requests_completed_total"));
    assert_eq!(
        shed as f64,
        delta("sluice_requests_dropped_total{reason=\"shed_sojourn\"}")
    );
    // Its own /metrics reading says the same, and it sampled the server process.
    let own = &report["result"]["server_metrics_delta"];
    assert_eq!(own["accepted"].as_f64(), Some(accepted as f64));
    assert_eq!(own["rejected_queue_full"].as_f64(), Some(rejected as f64));
    assert_eq!(own["completed"].as_f64(), Some(completed as f64));
    assert!(
        report["result"]["target_process"]["threads_max"]
            .as_u64()
            .unwrap()
            > 4
    );
    // Every arrival of the schedule is accounted for.
    let phases = report["result"]["phases"].as_array().unwrap();
    assert_eq!(phases.len(), 2);
    let requests: u64 = phases.iter().map(|p| p["requests"].as_u64().unwrap()).sum();
    assert_eq!(requests, accepted + rejected);
    // The timeline has every request: a dot per completed one at its first
    // token, a tick per other; and the queue sampled over the run.
    let timeline = &report["result"]["timeline"];
    assert_eq!(
        timeline["requests"].as_array().unwrap().len() as u64,
        requests
    );
    assert!(timeline["samples"].as_array().unwrap().len() >= 2);
    assert!(svg.starts_with("<svg"), "{svg}");
    assert_eq!(svg.matches("<circle").count() as u64, completed);
    assert_eq!(
        svg.matches("stroke=\"#d62728\"").count() as u64,
        requests - completed
    );
}

/// The head-of-line figure reports its largest gap where it was, and the
/// host's steal time from the box's CPUs during the prefill and around that
/// gap (read from `/proc/stat`: a VM's host may stretch a step by taking a
/// CPU away, and the figure must say so rather than blame the server).
#[test]
fn a_short_head_of_line_run_places_its_largest_gap_and_reads_steal_time() {
    let srv = Server::start(&[]);
    let (report, _) = run_bench(
        &srv,
        "hol",
        &[
            "--long-prompt-tokens",
            "400",
            "--hol-stream-tokens",
            "600",
            "--temperature",
            "0",
            "--timeout-s",
            "600",
        ],
    );
    let r = &report["result"];
    assert_eq!(r["long_status"], 200, "{r}");
    assert_eq!(r["streams_outlasted_prefill"], true, "{r}");
    // The largest gap lies across the prefill, and is the one the table gives.
    let gap = r["steal"]["largest_gap_s"].as_array().expect("largest gap");
    let (a, b) = (gap[0].as_f64().unwrap(), gap[1].as_f64().unwrap());
    let timeline = &r["timeline"];
    let (sent, first) = (
        timeline["long_sent_s"].as_f64().unwrap(),
        timeline["long_first_token_s"].as_f64().unwrap(),
    );
    assert!(
        a < b && b > sent && a < first,
        "{gap:?} against [{sent}, {first}]"
    );
    let max_ms = r["gaps_during_long_prefill"]["max_ms"].as_f64().unwrap();
    assert!(
        ((b - a) * 1e3 - max_ms).abs() < 1e-3,
        "{a}..{b} against {max_ms}"
    );
    // Steal is read on Linux: a number of milliseconds, whole ticks.
    for key in ["during_long_prefill_ms", "in_largest_gap_ms"] {
        let ms = r["steal"][key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key} in {r}"));
        assert!(ms >= 0.0 && ms % 10.0 == 0.0, "{key}: {ms}");
    }
    assert!(r["steal"]["events"].is_array());
}
