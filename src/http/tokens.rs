//! `/tokenize` and `/detokenize` (also under `/v1/`): so that a client can
//! size a prompt against the budgets (context, `--max-body-bytes`, its token
//! bucket) before it sends it. Chat messages are rendered with the same
//! template a completion request gets, so the count is the one admission
//! charges.

use super::error::ApiError;
use super::validation::{self, Input};
use super::AppState;
use serde_json::{json, Map, Value};

/// Most token ids `/detokenize` takes at once.
pub const DETOKENIZE_TOKENS_MAX: usize = 1 << 20;

fn object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(ApiError::InvalidRequest {
            param: None,
            message: "request body must be a JSON object".into(),
        }),
        Err(e) => Err(ApiError::InvalidRequest {
            param: None,
            message: format!("request body is not valid JSON: {e}"),
        }),
    }
}

/// `{"messages": [...]}` (rendered with the chat template), or
/// `{"prompt": "..."}` / `{"content": "..."}` (llama.cpp's name): the tokens.
pub(super) fn tokenize(state: &AppState, body: &[u8]) -> Result<Value, ApiError> {
    let obj = object(body)?;
    for key in obj.keys() {
        if !matches!(
            key.as_str(),
            "messages" | "tools" | "tool_choice" | "prompt" | "content" | "model"
        ) {
            return Err(ApiError::invalid(
                key.as_str(),
                format!(
                    "'{key}' is not a field of /tokenize (messages, tools and tool_choice, prompt or content)"
                ),
            ));
        }
    }
    let tools = super::tools::parse(&obj)?;
    let input = if obj.contains_key("messages") {
        Input::Chat(validation::parse_messages(&obj)?)
    } else {
        match obj.get("prompt").or_else(|| obj.get("content")) {
            Some(Value::String(s)) => Input::Text(s.clone()),
            _ => {
                return Err(ApiError::invalid(
                    "prompt",
                    "give 'messages' (an array of messages) or 'prompt' (a string)",
                ))
            }
        }
    };
    let tokens = state
        .prompter
        .tokens(&input, &tools)
        .map_err(|m| ApiError::invalid(input.param(), m))?;
    Ok(json!({
        "tokens": tokens,
        "count": tokens.len(),
        "max_model_len": state.seq_tokens_max,
    }))
}

/// `{"tokens": [ids]}`: their text.
pub(super) fn detokenize(state: &AppState, body: &[u8]) -> Result<Value, ApiError> {
    let obj = object(body)?;
    let Some(Value::Array(items)) = obj.get("tokens") else {
        return Err(ApiError::invalid(
            "tokens",
            "'tokens' (an array of token ids) is required",
        ));
    };
    if items.len() > DETOKENIZE_TOKENS_MAX {
        return Err(ApiError::invalid(
            "tokens",
            format!("at most {DETOKENIZE_TOKENS_MAX} tokens at once"),
        ));
    }
    let ids: Option<Vec<_>> = items
        .iter()
        .map(|v| v.as_u64().and_then(|n| i32::try_from(n).ok()))
        .collect();
    let ids = ids.ok_or_else(|| ApiError::invalid("tokens", "token ids are integers >= 0"))?;
    // The vocabulary check is the prompt's.
    let ids = state
        .prompter
        .tokens(&Input::Tokens(ids), &super::tools::Tools::none())
        .map_err(|m| ApiError::invalid("tokens", m))?;
    let text = state.prompter.detokenize(&ids);
    Ok(json!({"prompt": text, "content": text}))
}
