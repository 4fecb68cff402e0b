//! The official OpenAI Python client against sluice (`tests/py/openai_sdk.py`,
//! in the virtualenv `deploy/install-deps --for-tests` makes).

use crate::harness::{model_path, run_python_checks, Server};
use std::path::PathBuf;

/// Every check in `openai_sdk.py`, each named so a failure says which.
const CHECKS: &[&str] = &[
    "prompt_tokens_are_the_models_jinja_template_rendered_in_python",
    "an_unimplemented_field_gets_400_naming_it",
    "frequency_penalty_changes_a_greedy_answer_that_repeats",
    "presence_and_repetition_penalties_change_it_too",
    "logit_bias_bans_and_forces_tokens",
    "json_mode_output_parses",
    "json_schema_output_validates_for_ten_seeds_at_temperature_1",
    "the_sdks_pydantic_parse_helper_gets_a_parsed_model",
    "unsupported_schema_keywords_get_400_naming_them_when_strict",
    "a_required_tool_call_returns_tool_calls_whose_arguments_validate",
    "a_streamed_tool_call_arrives_as_tool_calls_deltas",
    "a_call_and_its_result_in_the_history_are_answered_in_text",
    "tool_choice_auto_answers_in_text_or_with_a_call",
    "n_choices_come_back_by_index",
    "embeddings_come_back_through_the_sdk",
];

#[test]
fn the_official_openai_client_gets_what_it_asks_for() {
    let srv = Server::start(&["--pooling", "mean"]);
    let model = model_path();
    run_python_checks(&srv, "openai_sdk.py", &[model.to_str().unwrap()], CHECKS);
    // Every check of the script is in the list above.
    let script = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/py/openai_sdk.py"),
    )
    .unwrap();
    assert_eq!(
        script.matches("\ndef check_").count(),
        CHECKS.len(),
        "a check of openai_sdk.py is not run"
    );
}
