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

#[test]
fn flash_attention_is_measured_at_start_up_unless_it_is_set() {
    let srv = Server::start(&[]);
    let log = srv.log();
    let line = log
        .lines()
        .find(|l| l.starts_with("sluice: attention: "))
        .unwrap_or_else(|| panic!("no attention line in the log:\n{log}"));
    // Flash attention off with q8_0 keys and with f16, on with f16 and with
    // q8_0: four timed.
    assert!(
        line.contains("measured in")
            && line.contains("off/q8_0/f16 ")
            && line.contains("off/f16 ")
            && line.contains("on/f16 ")
            && line.contains("on/q8_0 "),
        "{line}"
    );
    let r = srv.post(
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    drop(srv);

    let srv = Server::start(&["--flash-attn", "off", "--kv-type", "q8_0/f16"]);
    assert!(
        !srv.log().contains("sluice: attention: "),
        "set by the operator: nothing to measure\n{}",
        srv.log()
    );
    let r = srv.post(
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}
