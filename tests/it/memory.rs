//! KV memory: each sequence's stream is lazily backed, its pages go back to
//! the kernel when the engine is idle, and they come back as zeros, with the
//! same logits as before. And what else an idle server costs: few wake-ups.

use crate::batching::{compare, scored};
use crate::harness::*;
use serde_json::json;
use std::time::Duration;

#[test]
fn kv_pages_go_back_to_the_kernel_when_idle_and_read_as_zeros_again() {
    // No prefix cache: its entries are host memory of their own, and a repeat
    // would reuse the prompt instead of prefilling it into fresh pages. The
    // KV type fixed, so that the bytes a cell holds are known: flash
    // attention off, whose transposed V cache writes a token's values into
    // a row per dimension, across the stream's pages.
    let srv = Server::start(&[
        "--parallel",
        "2",
        "--prefix-cache-mb",
        "0",
        "--flash-attn",
        "off",
        "--kv-type",
        "q8_0/f16",
    ]);
    let released = || srv.metric("sluice_kv_pages_released_total");
    // Calibration wrote cells; idle, they go back.
    wait_until(Duration::from_secs(120), "the first release", || {
        released() >= 1.0
    });
    let before = rss_kb(srv.pid());

    // ~1,150 tokens: K and V of its cells are ~20 MB for the default model.
    let body = json!({"prompt": long_prompt(60), "max_tokens": 8, "temperature": 0,
                      "ignore_eos": true, "logprobs": 1, "echo": true});
    let r = srv.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let first = r.body_json();
    let n_prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(n_prompt > 1000, "prompt has {n_prompt} tokens");
    let loaded = rss_kb(srv.pid());
    let n = released();
    wait_until(Duration::from_secs(120), "the next release", || {
        released() > n
    });
    let after = rss_kb(srv.pid());
    eprintln!("RSS: {before} kB idle, {loaded} kB after a {n_prompt}-token prompt, {after} kB after the release");
    // Its cells' K and V alone are n_prompt × 17,640 bytes (30 layers × 192
    // values: K in q8_0, 34 bytes per 32 values, and V in f16); the release
    // gives back at least half that (compute and output buffers, also grown
    // by the prompt, stay).
    let kv_kb = n_prompt * 17_640 / 1024;
    assert!(
        loaded.saturating_sub(after) >= kv_kb / 2,
        "the release gave back {} kB; the prompt's cells alone are {kv_kb} kB",
        loaded.saturating_sub(after)
    );

    // The same prompt, prefilled into pages the kernel hands out again.
    let r = srv.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let second = r.body_json();
    compare(&scored(&first), &scored(&second), 1).check("after the pages went back");
}

/// A cgroup of its own with a memory limit (v1's memory controller where the
/// machine mounts it, else v2's), removed when dropped.
struct Cgroup {
    dir: std::path::PathBuf,
}

impl Cgroup {
    fn with_limit(bytes: u64) -> Cgroup {
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        let name = format!("sluice-test-{}", std::process::id());
        let (dir, file) = match own.lines().find_map(|l| l.split_once(":memory:")) {
            Some((_, path)) => (
                format!("/sys/fs/cgroup/memory{}/{name}", path.trim_end_matches('/')),
                "memory.limit_in_bytes",
            ),
            None => (format!("/sys/fs/cgroup/{name}"), "memory.max"),
        };
        let dir = std::path::PathBuf::from(dir);
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        std::fs::write(dir.join(file), bytes.to_string()).unwrap();
        Cgroup { dir }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

#[test]
fn a_memory_limit_below_what_the_kv_cells_may_take_is_a_warning_at_start() {
    // The default model: ~175 MiB resident after start, but 4 streams of
    // 8,448 q8_0 cells (394 MiB) and the prefix cache (96 MiB) on top.
    let limit_mib = 400;
    let cgroup = Cgroup::with_limit(limit_mib << 20);
    let procs = cgroup.dir.join("cgroup.procs");
    let enter = format!("echo $$ > {} && exec \"$@\"", procs.display());
    let program = [
        std::path::Path::new("sh"),
        std::path::Path::new("-c"),
        std::path::Path::new(&enter),
        std::path::Path::new("sh"),
        std::path::Path::new(binary()),
    ];
    let srv = Server::launch(&program, &model_path(), &["--kv-type", "q8_0"], &[]);
    let log = srv.log();
    let said = log
        .lines()
        .find(|l| l.starts_with("sluice: memory:"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(
        said.contains("KV cells up to 394 MiB (33792 cells x 12240 bytes"),
        "{said}"
    );
    assert!(
        said.contains(&format!("limit (MemoryMax) is {limit_mib} MiB")),
        "{said}"
    );
    assert!(
        log.contains(&format!("the memory limit is {limit_mib} MiB"))
            && log.contains("Raise MemoryMax"),
        "{log}"
    );
    drop(srv);
    drop(cgroup);
}

/// Voluntary context switches of each thread of process `pid` so far, by
/// thread id.
fn wake_ups(pid: u32) -> std::collections::HashMap<String, u64> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("the server's threads")
        .filter_map(|t| {
            let t = t.ok()?;
            let status = std::fs::read_to_string(t.path().join("status")).ok()?;
            let n = status
                .lines()
                .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))?
                .trim()
                .parse::<u64>()
                .expect("a count");
            Some((t.file_name().to_string_lossy().into_owned(), n))
        })
        .collect()
}

#[test]
fn an_idle_server_wakes_up_rarely() {
    // Each wake-up of an idle process is CPU a laptop's battery pays for;
    // they come from timers (the main thread's look at signals, the
    // engine's idle wait, the batch workers'), not from the box's speed. At
    // 20 ms, the main thread's alone were 50 a second.
    let srv = Server::start(&[]);
    let released = srv.metric("sluice_kv_pages_released_total");
    srv.post_ok(
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 4, "temperature": 0}),
    );
    // Idle, its last work done: the written KV pages went back.
    wait_until(Duration::from_secs(120), "the KV pages' release", || {
        srv.metric("sluice_kv_pages_released_total") > released
    });
    let window = Duration::from_secs(5);
    let before = wake_ups(srv.pid());
    std::thread::sleep(window);
    // A thread that ended meanwhile is not counted; one that began, whole
    // (one whose id an ended one had, from that one's count on).
    let woke: u64 = wake_ups(srv.pid())
        .iter()
        .map(|(tid, n)| n.saturating_sub(before.get(tid).copied().unwrap_or(0)))
        .sum();
    let per_s = woke as f64 / window.as_secs_f64();
    assert!(
        per_s < 40.0,
        "{woke} wake-ups in {window:?} of idleness ({per_s:.0} a second)"
    );
}
