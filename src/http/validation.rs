//! Request bodies → [`ValidRequest`], the only request type that goes further.
//!
//! Each check names the field and the limit, as OpenAI does ("'temperature' is
//! 3.5; it must be 0 to 2"). A field sluice does not implement is refused by
//! name (`fields`), as OpenAI refuses arguments it does not know.

use super::error::ApiError;
pub use super::fields::Api;
use super::fields::{opt_bool, opt_f32, opt_int};
pub use super::output::Format;
use super::output::{parse_format, parse_penalties};
use crate::admission::Penalties;
use crate::engine::logprobs::TOP_LOGPROBS_MAX;
use serde_json::{Map, Value};

/// Most stop strings per request, and the longest one, in bytes.
pub const STOP_STRINGS_MAX: usize = 16;
pub const STOP_BYTES_MAX: usize = 256;
/// Most messages in one chat request.
pub const MESSAGES_MAX: usize = 1024;
/// Most choices (`n`) per request; each is a sequence of its own.
pub const N_MAX: usize = 8;
/// Highest `max_tokens` anyone may ask for; the context bounds it further.
pub const MAX_TOKENS_CEILING: usize = crate::config::CTX_TOKENS_MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    System,
    User,
    Assistant,
    /// A tool's result, answering an assistant's call.
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub role: Role,
    pub content: String,
    /// An assistant's calls: (id, function name, arguments as JSON text).
    pub tool_calls: Vec<ToolCall>,
    /// A tool message: the call it answers.
    pub tool_call_id: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    Chat(Vec<Message>),
    Text(String),
    /// A prompt given as token ids (legacy completions API).
    Tokens(Vec<i32>),
}

impl Input {
    /// The request field the input came from.
    pub fn param(&self) -> &'static str {
        match self {
            Input::Chat(_) => "messages",
            Input::Text(_) | Input::Tokens(_) => "prompt",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ValidRequest {
    pub api: Api,
    pub input: Input,
    pub stream: bool,
    pub include_usage: bool,
    pub max_tokens: Option<usize>,
    pub temperature: f32,
    pub top_k: i32,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: Option<u32>,
    /// Token ids in `logit_bias` are checked against the vocabulary later.
    pub penalties: Penalties,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// Alternatives to report per token; `None` reports no log-probabilities.
    pub top_logprobs: Option<usize>,
    /// Completions only: return the prompt (and its log-probabilities) too.
    pub echo: bool,
    /// Chat only: `response_format`.
    pub format: Format,
    /// Chat only: `tools` and `tool_choice`.
    pub tools: super::tools::Tools,
    /// Choices to generate (`n`).
    pub n: usize,
}

pub fn parse(api: Api, body: &[u8]) -> Result<ValidRequest, ApiError> {
    let text = std::str::from_utf8(body).map_err(|e| ApiError::InvalidRequest {
        param: None,
        message: format!(
            "request body is not valid UTF-8 (at byte {})",
            e.valid_up_to()
        ),
    })?;
    let value: Value = serde_json::from_str(text).map_err(|e| ApiError::InvalidRequest {
        param: None,
        message: format!("request body is not valid JSON: {e}"),
    })?;
    let Value::Object(obj) = value else {
        return Err(ApiError::InvalidRequest {
            param: None,
            message: "request body must be a JSON object".into(),
        });
    };
    super::fields::check(api, &obj)?;

    let input = match api {
        Api::Chat => Input::Chat(parse_messages(&obj)?),
        Api::Completions => parse_prompt(&obj)?,
    };
    let n = opt_int(&obj, "n", 1, N_MAX)?.unwrap_or(1);
    let stream = opt_bool(&obj, "stream")?.unwrap_or(false);
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => opt_bool(o, "include_usage")?.unwrap_or(false),
        Some(_) => {
            return Err(ApiError::invalid(
                "stream_options",
                "'stream_options' must be an object",
            ))
        }
    };
    let echo = match api {
        Api::Completions => opt_bool(&obj, "echo")?.unwrap_or(false),
        Api::Chat => false,
    };
    let max_tokens = match opt_int(&obj, "max_completion_tokens", 0, MAX_TOKENS_CEILING)? {
        Some(n) => Some(n),
        None => opt_int(&obj, "max_tokens", 0, MAX_TOKENS_CEILING)?,
    };
    if max_tokens == Some(0) && !echo {
        return Err(ApiError::invalid(
            "max_tokens",
            "'max_tokens' is 0; it must be at least 1 (0 is only for scoring a prompt with echo)",
        ));
    }
    let top_logprobs = match api {
        // Chat: `logprobs: bool` plus `top_logprobs: int`.
        Api::Chat => match opt_bool(&obj, "logprobs")? {
            Some(true) => Some(opt_int(&obj, "top_logprobs", 0, TOP_LOGPROBS_MAX)?.unwrap_or(0)),
            _ => None,
        },
        // Legacy completions: `logprobs: int` is the number of alternatives.
        Api::Completions => opt_int(&obj, "logprobs", 0, TOP_LOGPROBS_MAX)?,
    };

    Ok(ValidRequest {
        api,
        input,
        stream,
        include_usage,
        max_tokens,
        temperature: opt_f32(&obj, "temperature", 0.0, 2.0)?.unwrap_or(1.0),
        top_k: opt_int(&obj, "top_k", 0, 1_000_000)?.unwrap_or(0) as i32,
        top_p: opt_f32(&obj, "top_p", 0.0, 1.0)?.unwrap_or(1.0),
        min_p: opt_f32(&obj, "min_p", 0.0, 1.0)?.unwrap_or(0.0),
        seed: opt_int(&obj, "seed", 0, u64::MAX as usize)?
            .map(|s| (s as u64 % (1u64 << 32)) as u32),
        penalties: parse_penalties(&obj)?,
        stop: parse_stop(&obj)?,
        ignore_eos: opt_bool(&obj, "ignore_eos")?.unwrap_or(false),
        format: match api {
            Api::Chat => parse_format(&obj)?,
            Api::Completions => Format::Text,
        },
        tools: match api {
            Api::Chat => super::tools::parse(&obj)?,
            Api::Completions => super::tools::Tools::none(),
        },
        n,
        top_logprobs,
        echo,
    })
}

pub(super) fn parse_messages(obj: &Map<String, Value>) -> Result<Vec<Message>, ApiError> {
    let Some(v) = obj.get("messages") else {
        return Err(ApiError::invalid("messages", "'messages' is required"));
    };
    let Value::Array(items) = v else {
        return Err(ApiError::invalid(
            "messages",
            "'messages' must be an array of messages",
        ));
    };
    if items.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "'messages' is empty; give at least one message",
        ));
    }
    if items.len() > MESSAGES_MAX {
        return Err(ApiError::invalid(
            "messages",
            format!(
                "'messages' has {} entries; the limit is {MESSAGES_MAX}",
                items.len()
            ),
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let Value::Object(m) = m else {
                return Err(ApiError::invalid(format!("messages[{i}]"), format!("messages[{i}] must be an object")));
            };
            let role = match m.get("role") {
                Some(Value::String(r)) => match r.as_str() {
                    "system" | "developer" => Role::System,
                    "user" => Role::User,
                    "assistant" => Role::Assistant,
                    "tool" => Role::Tool,
                    other => {
                        return Err(ApiError::invalid(
                            format!("messages[{i}].role"),
                            format!("messages[{i}].role is '{other}'; it must be system, developer, user, assistant or tool"),
                        ))
                    }
                },
                _ => {
                    return Err(ApiError::invalid(
                        format!("messages[{i}].role"),
                        format!("messages[{i}].role is required and must be a string"),
                    ))
                }
            };
            let tool_calls = match (role, m.get("tool_calls")) {
                (_, None | Some(Value::Null)) => Vec::new(),
                (Role::Assistant, Some(Value::Array(calls))) => parse_tool_calls(i, calls)?,
                _ => {
                    return Err(ApiError::invalid(
                        format!("messages[{i}].tool_calls"),
                        format!("messages[{i}].tool_calls must be an array, on an assistant message"),
                    ))
                }
            };
            let tool_call_id = match (role, m.get("tool_call_id")) {
                (Role::Tool, Some(Value::String(id))) => Some(id.clone()),
                (Role::Tool, _) => {
                    return Err(ApiError::invalid(
                        format!("messages[{i}].tool_call_id"),
                        format!("messages[{i}].tool_call_id is required on a tool message: the id of the call it answers"),
                    ))
                }
                _ => None,
            };
            // An assistant message may be only its calls.
            let content = match (m.get("content"), tool_calls.is_empty()) {
                (None, false) => String::new(),
                (c, _) => parse_content(i, c)?,
            };
            Ok(Message {
                role,
                content,
                tool_calls,
                tool_call_id,
            })
        })
        .collect()
}

fn parse_tool_calls(i: usize, calls: &[Value]) -> Result<Vec<ToolCall>, ApiError> {
    calls
        .iter()
        .enumerate()
        .map(|(j, c)| {
            let p = format!("messages[{i}].tool_calls[{j}]");
            let f = c.get("function");
            match (
                c.get("id").and_then(Value::as_str),
                f.and_then(|f| f.get("name")).and_then(Value::as_str),
                f.and_then(|f| f.get("arguments")).and_then(Value::as_str),
            ) {
                (Some(id), Some(name), Some(arguments)) => Ok(ToolCall {
                    id: id.to_string(),
                    name: name.to_string(),
                    arguments: arguments.to_string(),
                }),
                _ => Err(ApiError::invalid(
                    p.clone(),
                    format!("{p} must be {{\"id\": ..., \"type\": \"function\", \"function\": {{\"name\": ..., \"arguments\": \"<JSON text>\"}}}}"),
                )),
            }
        })
        .collect()
}

fn parse_content(i: usize, v: Option<&Value>) -> Result<String, ApiError> {
    let param = format!("messages[{i}].content");
    match v {
        Some(Value::String(s)) => Ok(s.clone()),
        // OpenAI allows null content on assistant messages (tool calls); treat as empty.
        Some(Value::Null) => Ok(String::new()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("text"), Some(Value::String(t))) => text.push_str(t),
                    _ => {
                        return Err(ApiError::invalid(
                            format!("{param}[{j}]"),
                            format!("{param}[{j}] must be {{\"type\": \"text\", \"text\": \"...\"}}; this model reads text only"),
                        ))
                    }
                }
            }
            Ok(text)
        }
        None => Err(ApiError::invalid(
            param.clone(),
            format!("{param} is required"),
        )),
        Some(_) => Err(ApiError::invalid(
            param.clone(),
            format!("{param} must be a string or an array of text parts"),
        )),
    }
}

fn parse_prompt(obj: &Map<String, Value>) -> Result<Input, ApiError> {
    match obj.get("prompt") {
        Some(Value::String(s)) => Ok(Input::Text(s.clone())),
        Some(Value::Array(items)) if items.iter().all(Value::is_string) => match items.as_slice() {
            [Value::String(s)] => Ok(Input::Text(s.clone())),
            _ => Err(ApiError::invalid(
                "prompt",
                "'prompt' as an array of strings must hold exactly one (batches are not supported)",
            )),
        },
        Some(Value::Array(items)) if !items.is_empty() => {
            let ids = items
                .iter()
                .map(|v| v.as_i64().and_then(|n| i32::try_from(n).ok()).filter(|&n| n >= 0))
                .collect::<Option<Vec<i32>>>()
                .ok_or_else(|| ApiError::invalid("prompt", "'prompt' must be a string, or an array of token ids (non-negative integers)"))?;
            Ok(Input::Tokens(ids))
        }
        None => Err(ApiError::invalid("prompt", "'prompt' is required")),
        Some(_) => Err(ApiError::invalid(
            "prompt",
            "'prompt' must be a non-empty string or array of token ids",
        )),
    }
}

fn parse_stop(obj: &Map<String, Value>) -> Result<Vec<String>, ApiError> {
    let stops: Vec<String> = match obj.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or_else(|| {
                ApiError::invalid("stop", "'stop' must be a string or an array of strings")
            })?,
        Some(_) => {
            return Err(ApiError::invalid(
                "stop",
                "'stop' must be a string or an array of strings",
            ))
        }
    };
    if stops.len() > STOP_STRINGS_MAX {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "'stop' has {} strings; the limit is {STOP_STRINGS_MAX}",
                stops.len()
            ),
        ));
    }
    if let Some(s) = stops.iter().find(|s| s.len() > STOP_BYTES_MAX) {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "a stop string has {} bytes; the limit is {STOP_BYTES_MAX}",
                s.len()
            ),
        ));
    }
    Ok(stops.into_iter().filter(|s| !s.is_empty()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<ValidRequest, ApiError> {
        parse(Api::Chat, body.as_bytes())
    }

    fn param_of(e: ApiError) -> Option<String> {
        match e {
            ApiError::InvalidRequest { param, .. } => param,
            _ => None,
        }
    }

    #[test]
    fn a_minimal_chat_request_gets_defaults() {
        let r = chat(r#"{"messages":[{"role":"user","content":"hi"}]}"#).unwrap();
        assert_eq!(
            r.input,
            Input::Chat(vec![Message {
                role: Role::User,
                content: "hi".into(),
                tool_calls: Vec::new(),
                tool_call_id: None,
            }])
        );
        assert!(!r.stream);
        assert_eq!(r.max_tokens, None);
        assert_eq!(r.temperature, 1.0);
        assert_eq!(r.top_logprobs, None);
    }

    #[test]
    fn bad_input_names_the_field() {
        let cases = [
            ("not json", None),
            ("[]", None),
            (r#"{"messages":[]}"#, Some("messages")),
            (r#"{"messages":"hi"}"#, Some("messages")),
            (
                r#"{"messages":[{"role":"robot","content":"x"}]}"#,
                Some("messages[0].role"),
            ),
            (
                r#"{"messages":[{"role":"user"}]}"#,
                Some("messages[0].content"),
            ),
            (
                r#"{"messages":[{"role":"user","content":5}]}"#,
                Some("messages[0].content"),
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"temperature":"hot"}"#,
                Some("temperature"),
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"temperature":3.5}"#,
                Some("temperature"),
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":-1}"#,
                Some("max_tokens"),
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":1e30}"#,
                Some("max_tokens"),
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":0}"#,
                Some("max_tokens"),
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"stream":"yes"}"#,
                Some("stream"),
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"n":9}"#,
                Some("n"),
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"stop":[1]}"#,
                Some("stop"),
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":50}"#,
                Some("top_logprobs"),
            ),
        ];
        for (body, param) in cases {
            let e = chat(body).expect_err(body);
            assert_eq!(e.status(), 400, "{body}");
            assert_eq!(param_of(e).as_deref(), param, "{body}");
        }
    }

    #[test]
    fn invalid_utf8_and_deep_nesting_are_400_not_a_crash() {
        assert_eq!(
            parse(Api::Chat, b"{\"messages\":\"\xff\"}")
                .unwrap_err()
                .status(),
            400
        );
        let deep = "[".repeat(100_000);
        assert_eq!(chat(&deep).unwrap_err().status(), 400);
    }

    #[test]
    fn too_many_stop_strings_are_refused() {
        let stops: Vec<String> = (0..STOP_STRINGS_MAX + 1)
            .map(|i| format!("\"s{i}\""))
            .collect();
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":"x"}}],"stop":[{}]}}"#,
            stops.join(",")
        );
        assert_eq!(param_of(chat(&body).unwrap_err()).as_deref(), Some("stop"));
    }

    #[test]
    fn content_parts_and_developer_role_are_accepted() {
        let r = chat(r#"{"messages":[{"role":"developer","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#).unwrap();
        assert_eq!(
            r.input,
            Input::Chat(vec![Message {
                role: Role::System,
                content: "ab".into(),
                tool_calls: Vec::new(),
                tool_call_id: None,
            }])
        );
    }

    #[test]
    fn tool_calls_and_tool_results_are_read_from_the_history() {
        // The arguments are a JSON string holding JSON, as OpenAI sends them.
        let body = serde_json::json!({"messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "w", "arguments": r#"{"city": "Oslo"}"#}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]});
        let r = chat(&body.to_string()).unwrap();
        let Input::Chat(m) = r.input else { panic!() };
        assert_eq!(
            m[1].tool_calls,
            vec![ToolCall {
                id: "call_1".into(),
                name: "w".into(),
                arguments: r#"{"city": "Oslo"}"#.into()
            }]
        );
        assert_eq!(m[2].role, Role::Tool);
        assert_eq!(m[2].tool_call_id.as_deref(), Some("call_1"));
    }

    #[test]
    fn a_tool_message_without_its_call_or_a_malformed_call_is_refused_by_name() {
        for (body, param) in [
            (
                r#"[{"role":"tool","content":"x"}]"#,
                "messages[0].tool_call_id",
            ),
            (
                r#"[{"role":"user","content":"x","tool_calls":[]}]"#,
                "messages[0].tool_calls",
            ),
            (
                r#"[{"role":"assistant","tool_calls":[{"id":"a"}]}]"#,
                "messages[0].tool_calls[0]",
            ),
        ] {
            match chat(&format!(r#"{{"messages":{body}}}"#)) {
                Err(ApiError::InvalidRequest { param: Some(p), .. }) => {
                    assert_eq!(p, param, "{body}")
                }
                other => panic!("{body}: {other:?}"),
            }
        }
    }

    #[test]
    fn completions_take_text_or_token_ids_and_echo() {
        let r = parse(
            Api::Completions,
            br#"{"prompt":"Once","echo":true,"logprobs":2,"max_tokens":0}"#,
        )
        .unwrap();
        assert_eq!(r.input, Input::Text("Once".into()));
        assert!(r.echo);
        assert_eq!(r.top_logprobs, Some(2));
        let r = parse(Api::Completions, br#"{"prompt":[1,2,3]}"#).unwrap();
        assert_eq!(r.input, Input::Tokens(vec![1, 2, 3]));
        assert!(parse(Api::Completions, br#"{"prompt":[1,-2]}"#).is_err());
        assert!(parse(Api::Completions, br#"{"prompt":[]}"#).is_err());
    }

    #[test]
    fn unknown_fields_are_refused_by_name() {
        let e = chat(r#"{"messages":[{"role":"user","content":"x"}],"frobnicate":{"a":[1]}}"#)
            .unwrap_err();
        assert_eq!(e.to_json()["error"]["param"], "frobnicate");
        assert!(chat(r#"{"messages":[{"role":"user","content":"x"}],"user":"u"}"#).is_ok());
    }
}

/// Property-based tests: no body, however malformed, panics validation or
/// gets through without its limits holding. A crash any of them finds becomes
/// a named regression test in `tests` above.
#[cfg(test)]
mod properties;
