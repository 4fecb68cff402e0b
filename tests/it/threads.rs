//! Thread budget: compute threads equal the usable cores; only the front
//! door's per-connection I/O threads grow with load.

use crate::harness::*;
use serde_json::json;
use std::collections::BTreeMap;
use std::net::TcpStream;
use std::time::Duration;

/// Thread names of `pid`, grouped: `sluice-http-N` becomes `sluice-http-*`.
fn thread_counts(pid: u32) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let comm = std::fs::read_to_string(entry.unwrap().path().join("comm")).unwrap_or_default();
        let comm = comm.trim();
        let key = if comm.starts_with("sluice-http-") {
            "sluice-http-*".to_string()
        } else if comm
            .strip_prefix("sluice-batch-")
            .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
        {
            "sluice-batch-*".to_string()
        } else {
            comm.to_string()
        };
        *counts.entry(key).or_default() += 1;
    }
    counts
}

fn usable_cores() -> usize {
    let mask = core_affinity::get_core_ids().map_or(0, |ids| ids.len());
    let quota = std::thread::available_parallelism().map_or(1, |n| n.get());
    if mask == 0 {
        quota
    } else {
        mask.min(quota)
    }
}

#[test]
fn compute_threads_equal_usable_cores_and_only_io_threads_grow_with_load() {
    let srv = Server::start(&[]);
    let cores = usable_cores();
    let http_threads = srv.metric("sluice_http_threads") as usize;
    // Running + the most that may ever wait in each class's queue (the derived
    // L_max moves below 9) + 4 spare.
    assert_eq!(srv.metric("sluice_queue_depth_ceiling"), 9.0);
    assert_eq!(http_threads, 4 + 2 * 9 + 4);
    let idle = thread_counts(srv.pid());

    // Load: 4 streams decoding, plus 20 idle keep-alive connections.
    let streams: Vec<_> = (0..4)
        .map(|i| {
            let body = json!({"prompt": format!("Story number {i}:"), "stream": true, "max_tokens": 400,
                              "ignore_eos": true, "temperature": 0.7, "seed": i});
            let mut sse = Sse::open(srv.addr, "/v1/completions", &body);
            assert_eq!(sse.status, 200);
            assert!(sse.next_json().is_some());
            sse
        })
        .collect();
    let idle_conns: Vec<TcpStream> = (0..20).map(|_| connect(srv.addr)).collect();
    // Every connection gets its own thread (the door's pool queues a
    // connection only while more threads are idle than queued; tiny_http's
    // own pool left a burst queued behind idle ones).
    wait_until(
        Duration::from_secs(120),
        "every connection to get its thread",
        || {
            thread_counts(srv.pid())
                .get("sluice-conn")
                .copied()
                .unwrap_or(0)
                > 20
        },
    );
    assert_eq!(srv.metric("sluice_sequences_active"), 4.0);
    let loaded = thread_counts(srv.pid());

    for counts in [&idle, &loaded] {
        let engine = counts.get("sluice-engine").copied().unwrap_or(0);
        let ggml = counts.get("sluice-ggml").copied().unwrap_or(0);
        assert_eq!(engine, 1, "{counts:?}");
        assert_eq!(
            engine + ggml,
            cores,
            "compute threads must equal the {cores} usable cores: {counts:?}"
        );
        assert_eq!(
            counts.get("sluice-http-*"),
            Some(&http_threads),
            "parallel + queue depth + 4 spare: {counts:?}"
        );
        assert_eq!(counts.get("sluice-main"), Some(&1), "{counts:?}");
        assert_eq!(
            counts.get("sluice-batch-*"),
            Some(&3),
            "batch workers: the slots batch may hold: {counts:?}"
        );
        let known = [
            "sluice-engine",
            "sluice-ggml",
            "sluice-http-*",
            "sluice-main",
            "sluice-accept",
            "sluice-conn",
            "sluice-tarpit",
            "sluice-batch-*",
            "sluice-yield",
        ];
        assert!(
            counts.keys().all(|k| known.contains(&k.as_str())),
            "unnamed or unknown threads: {counts:?}"
        );
    }
    assert_eq!(srv.metric("sluice_compute_threads"), cores as f64);
    // Only the connection threads grew: one per open keep-alive connection (the
    // 20 idle ones; the streams asked for `Connection: close`, so their reading
    // thread is released once the handler owns the writer), plus those idle.
    for key in [
        "sluice-engine",
        "sluice-ggml",
        "sluice-http-*",
        "sluice-main",
        "sluice-accept",
        "sluice-batch-*",
    ] {
        assert_eq!(idle.get(key), loaded.get(key), "{key} changed under load");
    }
    let conn = loaded["sluice-conn"];
    let idle_conn = idle.get("sluice-conn").copied().unwrap_or(0);
    assert!(
        (20..=4 + 24 + 2).contains(&conn),
        "sluice-conn threads: {conn}"
    );
    assert!(
        conn > idle_conn,
        "connection threads did not grow: {idle:?} -> {loaded:?}"
    );
    drop(idle_conns);
    drop(streams);
}
