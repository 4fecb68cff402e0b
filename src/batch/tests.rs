//! The store's rules: one result per line, bounds by name, state kept across opens.

use super::store::*;
use super::*;
use std::path::PathBuf;

fn limits() -> StoreLimits {
    StoreLimits {
        file_bytes_max: 1 << 20,
        lines_max: 100,
        batches_max: 2,
        stored_bytes_max: 10_000,
        retention_s: 3600,
    }
}

fn temp_store() -> (Store, PathBuf) {
    let dir = std::env::temp_dir().join(new_id("sluice-store-test-"));
    (Store::open(&dir, limits()).unwrap(), dir)
}

fn new_batch(file: &str, n: usize) -> NewBatch {
    NewBatch {
        input_file_id: file.into(),
        endpoint: "/v1/chat/completions".into(),
        completion_window: "24h".into(),
        window_s: 86_400,
        metadata: None,
        lines: (0..n).map(|i| (format!("req-{i}"), "{}".into())).collect(),
    }
}

#[test]
fn a_line_gets_one_result_and_a_batch_ends_with_its_files() {
    let (s, dir) = temp_store();
    let f = s.add_file("", "batch", "in.jsonl", b"x", None).unwrap();
    let b = s.create_batch("", &new_batch(&f.id, 3)).unwrap();
    assert_eq!((b.status, b.total, b.completed), (Status::InProgress, 3, 0));
    let todo = s.pending(&[], 10);
    assert_eq!(todo.len(), 3);
    assert_eq!(
        s.pending(&[(b.id.clone(), 1)], 10).len(),
        2,
        "running lines are skipped"
    );
    assert!(s.record(&b.id, 1, true, "one"));
    assert!(
        !s.record(&b.id, 1, true, "one again"),
        "a second result is refused"
    );
    assert!(s.record(&b.id, 2, false, "two failed"));
    assert!(s.to_settle(now_s()).is_empty(), "a line is still pending");
    assert!(s.record(&b.id, 3, true, "three"));
    let settle = s.to_settle(now_s());
    assert_eq!(settle.len(), 1);
    assert!(settle[0].1.is_empty());
    s.finalize(&b.id, Status::Completed).unwrap();
    let b = s.batch("", &b.id).unwrap();
    assert_eq!((b.status, b.completed, b.failed), (Status::Completed, 2, 1));
    let out = s
        .file_content("", b.output_file_id.as_deref().unwrap())
        .unwrap();
    assert_eq!(out, b"one\nthree\n");
    let err = s
        .file_content("", b.error_file_id.as_deref().unwrap())
        .unwrap();
    assert_eq!(err, b"two failed\n");
    assert!(
        s.batch("someone-else", &b.id).is_none(),
        "a batch is its owner's"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bounds_name_themselves_and_state_survives_reopening() {
    let (s, dir) = temp_store();
    assert!(matches!(
        s.add_file("", "batch", "big", &[0; 10_001], None),
        Err(Refusal::StorageFull { max: 10_000, .. })
    ));
    let f = s.add_file("", "batch", "in.jsonl", b"x", None).unwrap();
    s.create_batch("", &new_batch(&f.id, 1)).unwrap();
    let b = s.create_batch("", &new_batch(&f.id, 2)).unwrap();
    assert_eq!(
        s.create_batch("", &new_batch(&f.id, 1)),
        Err(Refusal::TooManyBatches { max: 2 })
    );
    let c = s.cancel("", &b.id).unwrap().unwrap();
    assert_eq!(c.status, Status::Cancelling);
    drop(s);
    let s = Store::open(&dir, limits()).unwrap();
    let st = s.stored();
    assert_eq!(st.batches[0], 1, "in progress");
    assert_eq!(st.batches[4], 1, "cancelling");
    assert_eq!(st.lines_pending, 3);
    assert_eq!(
        s.pending(&[], 10).len(),
        1,
        "a cancelling batch's lines do not run"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn ids_carry_their_prefix_and_differ() {
    let a = new_id("file-");
    let b = new_id("file-");
    assert!(a.starts_with("file-") && a.len() == 29);
    assert_ne!(a, b);
}
