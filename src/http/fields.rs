//! Which request fields sluice implements, which it accepts because they do
//! not change an answer, and which it refuses: an OpenAI field that would
//! change the answer but is not implemented gets a 400 naming it, never a 200
//! that silently ignores it (OpenAI itself rejects arguments it does not know).
//! The README's field table is this module in prose. Also: reading one
//! optional field of a body (`opt_bool`, `opt_int`, `opt_f32`).

use super::error::ApiError;
use serde_json::{Map, Value};

/// Which endpoint a request body is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completions,
}

/// Fields both APIs implement (their values are checked in `validation`).
const COMMON: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    // Extensions (vLLM's and llama.cpp's names).
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
];

/// Chat-only fields implemented.
const CHAT: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
];

/// Completions-only fields implemented.
const COMPLETIONS: &[&str] = &["prompt", "echo"];

/// Fields accepted with any value because they change nothing in the answer:
/// identifiers and hints for a service that stores, bills or routes requests.
const METADATA: &[&str] = &["user", "metadata", "safety_identifier", "prompt_cache_key"];

/// Whether `value` of the unimplemented field `name` asks for nothing: the
/// field's default, which is what sluice does anyway.
fn is_default(name: &str, value: &Value) -> bool {
    match (name, value) {
        (_, Value::Null) => true,
        ("functions", Value::Array(a)) => a.is_empty(),
        ("function_call", Value::String(s)) => s == "none",
        ("modalities", Value::Array(a)) => a.len() == 1 && a[0].as_str() == Some("text"),
        ("store", Value::Bool(b)) => !*b,
        ("service_tier", Value::String(s)) => s == "auto" || s == "default",
        ("best_of", Value::Number(n)) => n.as_u64() == Some(1),
        ("suffix", Value::String(s)) => s.is_empty(),
        _ => false,
    }
}

/// OpenAI fields sluice does not implement, and what to do instead.
fn not_implemented(name: &str) -> Option<&'static str> {
    Some(match name {
        "functions" | "function_call" => {
            "the legacy function-calling fields are not implemented; use 'tools' and 'tool_choice'"
        }
        "store" => "sluice stores no completions; only false is accepted",
        "modalities" | "audio" => "sluice answers in text only",
        "prediction" => "predicted outputs are not implemented",
        "reasoning_effort" | "verbosity" => "this model has no such setting",
        "web_search_options" => "sluice does not search the web",
        "service_tier" => "only 'auto' or 'default' is accepted",
        "best_of" => "only 1 is accepted",
        "suffix" => "insertion (suffix) is not implemented",
        _ => return None,
    })
}

/// Refuses a body with a field that sluice would otherwise ignore.
pub fn check(api: Api, obj: &Map<String, Value>) -> Result<(), ApiError> {
    let own: &[&str] = match api {
        Api::Chat => CHAT,
        Api::Completions => COMPLETIONS,
    };
    for (name, value) in obj {
        let name = name.as_str();
        if COMMON.contains(&name) || own.contains(&name) || METADATA.contains(&name) {
            continue;
        }
        if is_default(name, value) {
            continue;
        }
        let message = match not_implemented(name) {
            Some(why) => format!("'{name}' is not supported by sluice: {why}"),
            None => format!(
                "'{name}' is not a field sluice knows for this endpoint; remove it (the README lists every field)"
            ),
        };
        return Err(ApiError::invalid(name, message));
    }
    Ok(())
}

// Reading one optional field, naming it and its range when it is wrong.

pub(super) fn opt_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::invalid(
            key,
            format!("'{key}' must be true or false"),
        )),
    }
}

/// OpenAI's rule for a function's or a schema's name: 1 to 64 of a-z, A-Z,
/// 0-9, `_` and `-`.
pub(super) fn is_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

pub(super) fn opt_int(
    obj: &Map<String, Value>,
    key: &str,
    lo: usize,
    hi: usize,
) -> Result<Option<usize>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => {
            let range = || {
                ApiError::invalid(
                    key,
                    format!("'{key}' is {n}; it must be an integer from {lo} to {hi}"),
                )
            };
            let v = n.as_u64().ok_or_else(range)?;
            let v = usize::try_from(v).map_err(|_| range())?;
            if v < lo || v > hi {
                return Err(range());
            }
            Ok(Some(v))
        }
        Some(_) => Err(ApiError::invalid(
            key,
            format!("'{key}' must be an integer"),
        )),
    }
}

pub(super) fn opt_f32(
    obj: &Map<String, Value>,
    key: &str,
    lo: f32,
    hi: f32,
) -> Result<Option<f32>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => {
            let v = n.as_f64().unwrap_or(f64::NAN);
            if !(v >= f64::from(lo) && v <= f64::from(hi)) {
                return Err(ApiError::invalid(
                    key,
                    format!("'{key}' is {n}; it must be {lo} to {hi}"),
                ));
            }
            Ok(Some(v as f32))
        }
        Some(_) => Err(ApiError::invalid(key, format!("'{key}' must be a number"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check_json(api: Api, v: Value) -> Result<(), String> {
        let Value::Object(m) = v else { panic!() };
        check(api, &m).map_err(|e| match e {
            ApiError::InvalidRequest { param, .. } => param.unwrap_or_default(),
            other => panic!("{other:?}"),
        })
    }

    #[test]
    fn implemented_and_metadata_fields_pass() {
        let chat = json!({"model": "m", "messages": [], "max_completion_tokens": 3,
            "top_logprobs": 2, "logprobs": true, "user": "u", "metadata": {"k": "v"},
            "stream": true, "stream_options": {"include_usage": true}, "top_k": 4,
            "min_p": 0.1, "ignore_eos": true, "n": 1, "seed": 3, "stop": ["x"],
            "frequency_penalty": 0.5, "presence_penalty": -1, "repetition_penalty": 1.2,
            "logit_bias": {"50256": -100}});
        assert_eq!(check_json(Api::Chat, chat), Ok(()));
        let comp = json!({"prompt": "p", "echo": true, "logprobs": 2, "user": "u",
            "frequency_penalty": 1, "logit_bias": {"1": 5}});
        assert_eq!(check_json(Api::Completions, comp), Ok(()));
    }

    #[test]
    fn defaults_of_unimplemented_fields_pass() {
        let chat = json!({"messages": [], "frequency_penalty": 0, "presence_penalty": 0.0,
            "logit_bias": {}, "functions": [], "function_call": "none", "response_format": {"type": "text"},
            "modalities": ["text"], "store": false, "service_tier": "auto", "parallel_tool_calls": true,
            "audio": null});
        assert_eq!(check_json(Api::Chat, chat), Ok(()));
        let comp = json!({"prompt": "p", "best_of": 1, "suffix": ""});
        assert_eq!(check_json(Api::Completions, comp), Ok(()));
    }

    #[test]
    fn what_would_change_the_answer_is_refused_by_name() {
        for (field, value) in [
            ("functions", json!([{"name": "f"}])),
            ("function_call", json!("auto")),
            ("store", json!(true)),
            ("modalities", json!(["text", "audio"])),
            ("reasoning_effort", json!("low")),
            ("frobnicate", json!({"deeply": [1]})),
            ("max_completion_tokens_typo", json!(3)),
        ] {
            let mut body = json!({"messages": []});
            body[field] = value;
            assert_eq!(check_json(Api::Chat, body), Err(field.to_string()));
        }
        // Fields of the other endpoint are not this one's.
        assert_eq!(
            check_json(Api::Completions, json!({"prompt": "p", "messages": []})),
            Err("messages".into())
        );
        assert_eq!(
            check_json(Api::Chat, json!({"messages": [], "echo": true})),
            Err("echo".into())
        );
        assert_eq!(
            check_json(Api::Completions, json!({"prompt": "p", "best_of": 2})),
            Err("best_of".into())
        );
    }
}
