//! The official OpenAI Python client against sluice (`tests/py/openai_sdk.py`,
//! in the virtualenv `deploy/install-deps --for-tests` makes).

use crate::harness::{model_path, Server};
use std::path::PathBuf;
use std::process::Command;

fn python() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/test-venv/bin/python");
    assert!(
        p.exists(),
        "the test virtualenv is missing: run deploy/install-deps --for-tests ({})",
        p.display()
    );
    p
}

/// Runs the named checks of `openai_sdk.py` against `srv`; fails with their output.
fn run_checks(srv: &Server, checks: &[&str]) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/py/openai_sdk.py");
    let out = Command::new(python())
        .arg(script)
        .arg(format!("http://{}", srv.addr))
        .arg(model_path())
        .args(checks)
        .output()
        .expect("run python");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    for c in checks {
        assert!(
            text.contains(&format!("ok   check_{c}")),
            "{c} did not run:\n{text}"
        );
    }
}

#[test]
fn the_openai_client_sees_the_models_template_its_penalties_and_refused_fields() {
    let srv = Server::start(&[]);
    run_checks(
        &srv,
        &[
            "prompt_tokens_are_the_models_jinja_template_rendered_in_python",
            "an_unimplemented_field_gets_400_naming_it",
            "frequency_penalty_changes_a_greedy_answer_that_repeats",
            "presence_and_repetition_penalties_change_it_too",
            "logit_bias_bans_and_forces_tokens",
        ],
    );
}
