//! The Batch API: the official OpenAI client's whole round (`tests/py/batch_sdk.py`),
//! a batch that survives a SIGKILL mid-way, and the store's bounds.

use crate::harness::{collect_stream, request, run_python_checks, wait_until, Server, Sse};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(900);

/// A JSONL of `n` chat requests, `max_tokens` each (`ignore_eos`: every one
/// generates that many).
fn chat_lines(n: usize, max_tokens: usize) -> String {
    (0..n)
        .map(|i| {
            json!({"custom_id": format!("line-{i}"), "method": "POST", "url": "/v1/chat/completions",
                   "body": {"messages": [{"role": "user", "content": format!("Tell a story, part {i}.")}],
                            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true}})
            .to_string()
                + "\n"
        })
        .collect()
}

fn upload(srv: &Server, content: &str) -> (u16, Value) {
    let b = "sluiceTestBoundary";
    let body = format!(
        "--{b}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n\
         --{b}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n\
         Content-Type: application/octet-stream\r\n\r\n{content}\r\n--{b}--\r\n"
    );
    let ct = format!("multipart/form-data; boundary={b}");
    let r = request(
        srv.addr,
        "POST",
        "/v1/files",
        Some(body.as_bytes()),
        &[("Content-Type", &ct)],
    );
    (
        r.status,
        serde_json::from_slice(&r.body).unwrap_or(Value::Null),
    )
}

fn create(srv: &Server, file_id: &str) -> (u16, Value) {
    let r = srv.post(
        "/v1/batches",
        &json!({"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}),
    );
    (
        r.status,
        serde_json::from_slice(&r.body).unwrap_or(Value::Null),
    )
}

fn get(srv: &Server, path: &str) -> Value {
    let r = request(srv.addr, "GET", path, None, &[]);
    assert_eq!(
        r.status,
        200,
        "GET {path}: {}",
        String::from_utf8_lossy(&r.body)
    );
    serde_json::from_slice(&r.body).expect("JSON")
}

#[test]
fn the_official_openai_client_uploads_runs_cancels_and_downloads_batches() {
    let srv = Server::start(&[]);
    run_python_checks(
        &srv,
        "batch_sdk.py",
        &[],
        &[
            "a_50_line_batch_completes_with_every_custom_id_answered_once",
            "a_malformed_line_is_refused_with_its_line_number",
            "cancel_stops_a_batch_mid_way_and_every_line_has_one_result",
            "files_are_listed_read_and_deleted",
        ],
    );
    // Every line ran as a batch-class request through admission.
    assert!(
        srv.metric("sluice_class_requests_total{class=\"batch\",outcome=\"completed\"}") >= 50.0
    );
    assert_eq!(srv.metric("sluice_batch_lines{state=\"pending\"}"), 0.0);
    assert_eq!(srv.metric("sluice_batches{status=\"completed\"}"), 1.0);
    assert_eq!(srv.metric("sluice_batches{status=\"cancelled\"}"), 1.0);
    // The status page's numbers are the same.
    let st = get(&srv, "/status");
    assert_eq!(st["batch"]["batches"]["completed"], 1, "{st}");
    assert_eq!(st["batch"]["batches"]["cancelled"], 1, "{st}");
    assert_eq!(st["batch"]["lines"]["pending"], 0, "{st}");
}

#[test]
fn a_batch_killed_mid_way_resumes_at_the_next_start_with_each_line_answered_once() {
    let dir =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("kill-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let args = ["--data-dir", dir.to_str().unwrap()];
    let mut srv = Server::start(&args);
    // 60 lines of 16 tokens: after the third is answered, the rest need over
    // ten more rounds of the slots, while the kill follows within a poll.
    let (status, f) = upload(&srv, &chat_lines(60, 16));
    assert_eq!(status, 200, "{f}");
    let (status, b) = create(&srv, f["id"].as_str().unwrap());
    assert_eq!(status, 200, "{b}");
    let path = format!("/v1/batches/{}", b["id"].as_str().unwrap());
    // Some lines done, not all: then SIGKILL, no drain.
    wait_until(WAIT, "a few lines to complete", || {
        get(&srv, &path)["request_counts"]["completed"]
            .as_u64()
            .unwrap()
            >= 3
    });
    srv.signal("KILL");
    assert_eq!(
        srv.wait_exit(Duration::from_secs(600)),
        None,
        "killed by a signal"
    );
    let done_before = {
        let again = Server::start(&args);
        let b = get(&again, &path);
        let done = b["request_counts"]["completed"].as_u64().unwrap();
        assert!(done < 60, "the batch ended before the kill: {b}");
        wait_until(WAIT, "the batch to complete after the restart", || {
            get(&again, &path)["status"] == "completed"
        });
        let b = get(&again, &path);
        assert_eq!(
            b["request_counts"],
            json!({"total": 60, "completed": 60, "failed": 0})
        );
        let out = request(
            again.addr,
            "GET",
            &format!(
                "/v1/files/{}/content",
                b["output_file_id"].as_str().unwrap()
            ),
            None,
            &[],
        );
        let mut seen = BTreeMap::new();
        for line in String::from_utf8(out.body).unwrap().lines() {
            let v: Value = serde_json::from_str(line).unwrap();
            assert_eq!(v["response"]["status_code"], 200, "{v}");
            *seen
                .entry(v["custom_id"].as_str().unwrap().to_string())
                .or_insert(0) += 1;
        }
        assert_eq!(seen.len(), 60, "every custom_id answered");
        assert!(seen.values().all(|&n| n == 1), "no custom_id twice");
        assert!(b["error_file_id"].is_null(), "{b}");
        done
    };
    assert!(done_before >= 3);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_stores_bounds_are_refused_by_name_and_the_api_can_be_off() {
    let srv = Server::start(&[
        "--batch-lines-max",
        "2",
        "--batches-max",
        "1",
        "--batch-file-bytes-max",
        "4096",
    ]);
    let (status, e) = upload(&srv, &chat_lines(3, 4));
    assert_eq!(
        (status, e["error"]["code"].as_str()),
        (413, Some("too_many_lines")),
        "{e}"
    );
    let big = "x".repeat(5000);
    let (status, e) = upload(&srv, &big);
    assert_eq!(
        (status, e["error"]["code"].as_str()),
        (413, Some("file_too_large")),
        "{e}"
    );
    let (status, f) = upload(&srv, &chat_lines(2, 400));
    assert_eq!(status, 200, "{f}");
    let id = f["id"].as_str().unwrap();
    let (status, _) = create(&srv, id);
    assert_eq!(status, 200);
    let (status, e) = create(&srv, id);
    assert_eq!(
        (status, e["error"]["code"].as_str()),
        (429, Some("too_many_batches")),
        "{e}"
    );
    let (status, e) = create(&srv, "file-none");
    assert_eq!(
        (status, e["error"]["code"].as_str()),
        (404, Some("not_found")),
        "{e}"
    );

    let off = Server::start(&["--data-dir", "off"]);
    let r = request(off.addr, "GET", "/v1/batches", None, &[]);
    assert_eq!(r.status, 404);
    assert!(String::from_utf8_lossy(&r.body).contains("batch_api_off"));
}

#[test]
fn an_interactive_request_preempts_running_batch_lines_which_run_again_later() {
    let srv = Server::start(&[]);
    // Lines long enough to be running when the stream arrives, a poll after
    // the first starts; each preempted one runs again from its start.
    let (_, f) = upload(&srv, &chat_lines(4, 150));
    let (status, b) = create(&srv, f["id"].as_str().unwrap());
    assert_eq!(status, 200, "{b}");
    let path = format!("/v1/batches/{}", b["id"].as_str().unwrap());
    wait_until(WAIT, "batch lines to run", || {
        srv.metric("sluice_sequences_active") >= 1.0
    });
    let body = json!({"messages": [{"role": "user", "content": "Say something."}],
                      "max_tokens": 300, "ignore_eos": true, "stream": true, "temperature": 0});
    let mut sse = Sse::open(srv.addr, "/v1/chat/completions", &body);
    assert_eq!(sse.status, 200);
    // While the interactive stream runs, it runs alone: the batch lines were
    // preempted (cancelled, to run again later), and none starts beside it.
    wait_until(WAIT, "the batch lines to give way", || {
        srv.metric("sluice_sequences_active") == 1.0
    });
    let preempted = srv.metric("sluice_requests_cancelled_total{reason=\"preempted\"}");
    assert!(preempted >= 1.0, "no batch line was preempted");
    let (text, _) = collect_stream(&mut sse);
    assert!(!text.is_empty());
    // Then the batch goes on, and every line still has one result.
    wait_until(WAIT, "the batch to complete", || {
        get(&srv, &path)["status"] == "completed"
    });
    let b = get(&srv, &path);
    assert_eq!(
        b["request_counts"],
        json!({"total": 4, "completed": 4, "failed": 0})
    );
}

#[test]
fn a_full_store_refuses_uploads_by_name_and_stays_consistent() {
    let srv = Server::start(&["--batch-file-bytes-max", "4096", "--data-bytes-max", "8192"]);
    let content = "y".repeat(3000);
    let (s1, f1) = upload(&srv, &content);
    let (s2, _) = upload(&srv, &content);
    assert_eq!((s1, s2), (200, 200));
    let (status, e) = upload(&srv, &content);
    assert_eq!(
        (status, e["error"]["code"].as_str()),
        (429, Some("storage_full")),
        "{e}"
    );
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .contains("--data-bytes-max"));
    assert_eq!(get(&srv, "/v1/files")["data"].as_array().unwrap().len(), 2);
    assert_eq!(srv.metric("sluice_batch_stored_bytes"), 6000.0);
    let r = request(
        srv.addr,
        "DELETE",
        &format!("/v1/files/{}", f1["id"].as_str().unwrap()),
        None,
        &[],
    );
    assert_eq!(r.status, 200);
    let (status, _) = upload(&srv, &content);
    assert_eq!(status, 200, "room again after a delete");
    assert_eq!(srv.metric("sluice_batch_stored_bytes"), 6000.0);
    assert_eq!(srv.metric("sluice_batch_files"), 2.0);
}
