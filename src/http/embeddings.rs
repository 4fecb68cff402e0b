//! `POST /v1/embeddings`: each input's vector, pooled (`--pooling`, or the
//! GGUF's) from the model's token states as the engine prefills it. The same
//! door as a completion: who asks, class, deadline, the client's bucket (in
//! prompt tokens), the admission gate; one job, whose inputs run one after
//! another in one slot.

use super::error::ApiError;
use super::intake::{json_body, Intake};
use super::validation::Input;
use super::{respond_json, AppState, Outcome};
use crate::admission::{Job, Task};
use crate::embed::EmbedSpec;
use crate::ffi::Token;
use crate::stream::{Event, Usage};
use base64::Engine as _;
use serde_json::{json, Map, Value};
use std::sync::atomic::Ordering;
use tiny_http::Request;

/// Most inputs in one request (OpenAI's limit).
pub const INPUTS_MAX: usize = 2048;

/// The request, validated.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct EmbedRequest {
    pub inputs: Vec<Input>,
    pub base64: bool,
}

/// Reads the body: `input` (a string, an array of strings, an array of token
/// ids, or an array of those), `encoding_format` (`float` or `base64`),
/// `dimensions` (only the model's own), `model` and `user` (metadata).
pub(super) fn parse(body: &[u8], n_embd: usize) -> Result<EmbedRequest, ApiError> {
    let obj: Map<String, Value> = match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => o,
        Ok(_) => {
            return Err(ApiError::InvalidRequest {
                param: None,
                message: "request body must be a JSON object".into(),
            })
        }
        Err(e) => {
            return Err(ApiError::InvalidRequest {
                param: None,
                message: format!("request body is not valid JSON: {e}"),
            })
        }
    };
    for key in obj.keys() {
        if !matches!(
            key.as_str(),
            "input" | "model" | "encoding_format" | "dimensions" | "user"
        ) {
            return Err(ApiError::invalid(
                key.as_str(),
                format!("'{key}' is not a field of /v1/embeddings (input, model, encoding_format, dimensions, user)"),
            ));
        }
    }
    let base64 = match obj.get("encoding_format") {
        None | Some(Value::Null) => false,
        Some(Value::String(f)) if f == "float" => false,
        Some(Value::String(f)) if f == "base64" => true,
        Some(other) => {
            return Err(ApiError::invalid(
                "encoding_format",
                format!("'encoding_format' is {other}; it must be \"float\" or \"base64\""),
            ))
        }
    };
    match obj.get("dimensions") {
        None | Some(Value::Null) => {}
        Some(d) if d.as_u64() == Some(n_embd as u64) => {}
        Some(d) => {
            return Err(ApiError::invalid(
                "dimensions",
                format!("'dimensions' is {d}; this model's embeddings have {n_embd} (it was not trained to be cut shorter)"),
            ))
        }
    }
    for key in ["model", "user"] {
        if let Some(v) = obj.get(key) {
            if !v.is_string() && !v.is_null() {
                return Err(ApiError::invalid(key, format!("'{key}' must be a string")));
            }
        }
    }
    let inputs = inputs(obj.get("input"))?;
    Ok(EmbedRequest { inputs, base64 })
}

/// `input`: a string, an array of strings, an array of token ids, or an
/// array of arrays of token ids; at most `INPUTS_MAX`.
fn inputs(input: Option<&Value>) -> Result<Vec<Input>, ApiError> {
    let bad = || {
        ApiError::invalid(
            "input",
            "'input' must be a string, an array of strings, an array of token ids, or an array of arrays of token ids",
        )
    };
    let ids = |items: &[Value]| -> Result<Vec<i32>, ApiError> {
        items
            .iter()
            .map(|t| {
                t.as_i64()
                    .and_then(|t| i32::try_from(t).ok())
                    .filter(|&t| t >= 0)
                    .ok_or_else(bad)
            })
            .collect()
    };
    let inputs = match input {
        None => return Err(ApiError::invalid("input", "'input' is required")),
        Some(Value::String(s)) => vec![Input::Text(s.clone())],
        Some(Value::Array(items)) if items.is_empty() => {
            return Err(ApiError::invalid("input", "'input' is an empty array"))
        }
        Some(Value::Array(items)) if items.iter().all(Value::is_number) => {
            vec![Input::Tokens(ids(items)?)]
        }
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| match item {
                Value::String(s) => Ok(Input::Text(s.clone())),
                Value::Array(t) => Ok(Input::Tokens(ids(t)?)),
                _ => Err(bad()),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(bad()),
    };
    if inputs.len() > INPUTS_MAX {
        return Err(ApiError::invalid(
            "input",
            format!(
                "'input' has {} items; at most {INPUTS_MAX} in one request",
                inputs.len()
            ),
        ));
    }
    Ok(inputs)
}

/// The inputs' tokens, one after another, and where each ends. Each input
/// must have a token, and fit the context.
fn tokens(
    state: &AppState,
    inputs: &[Input],
    n_ctx: usize,
) -> Result<(Vec<Token>, Vec<usize>), ApiError> {
    let mut all = Vec::new();
    let mut ends = Vec::with_capacity(inputs.len());
    for (i, input) in inputs.iter().enumerate() {
        let t = state
            .prompter
            .tokens(input, &super::tools::Tools::none())
            .map_err(|m| ApiError::invalid("input", format!("input {i}: {m}")))?;
        if t.is_empty() {
            return Err(ApiError::invalid(
                "input",
                format!("input {i} is empty (0 tokens)"),
            ));
        }
        if t.len() > n_ctx {
            return Err(ApiError::ContextLength {
                message: format!(
                    "input {i} has {} tokens; the context limit is {n_ctx} tokens",
                    t.len()
                ),
            });
        }
        all.extend_from_slice(&t);
        ends.push(all.len());
    }
    Ok((all, ends))
}

/// One embedding request, from the socket to its answer.
pub(super) fn embed(state: &AppState, req: Request) {
    let Some((mut intake, mut req)) = Intake::open(state, req) else {
        return;
    };
    let read = intake.read(&mut req, |req, ask| {
        let Some(pooling) = state.pooling else {
            return Err(ApiError::invalid(
                "model",
                format!(
                    "'{}' makes no embeddings here: {}",
                    state.cfg.model_name, state.pooling_source
                ),
            ));
        };
        let body = json_body(state, req)?;
        let valid = parse(&body, state.n_embd)?;
        let n_ctx = match ask.class {
            crate::priority::Class::Batch => state.batch_seq_tokens_max,
            crate::priority::Class::Interactive => state.seq_tokens_max,
        };
        let (prompt, ends) = tokens(state, &valid.inputs, n_ctx)?;
        state
            .metrics
            .prompts_tokenized
            .fetch_add(1, Ordering::Relaxed);
        Ok((pooling, valid, prompt, ends))
    });
    let (ask, (pooling, valid, prompt, ends)) = match read {
        Ok(r) => r,
        Err(e) => return intake.invalid(req, e),
    };
    intake.tags.push_str(&format!(
        " inputs={} pooling={}",
        ends.len(),
        pooling.name()
    ));
    let prompt_tokens = prompt.len();
    // Charged in full: an embedding generates nothing, and reuses nothing.
    let mut bucket = match intake.charge(ask.class, prompt_tokens as u64) {
        Ok(b) => b,
        Err(e) => return intake.fail(req, e),
    };
    let n_inputs = ends.len();
    let (tx, rx, cancel) = intake.channel();
    let job = Job {
        id: state.next_id.fetch_add(1, Ordering::Relaxed),
        request_id: super::request_id(&req).into(),
        class: ask.class,
        prompt,
        enqueued_at: intake.t0,
        deadline: intake.deadline(&ask),
        events: tx,
        cancel: cancel.clone(),
        cached_estimate: 0,
        task: Task::Embed(EmbedSpec { ends, pooling }),
        prompt_of: None,
    };
    // Refused for overload: the charge goes back (when `bucket` drops).
    if let Err(e) = intake.submit(vec![job]) {
        return intake.fail(req, e);
    }
    // Admitted: the prompt is paid for, whatever becomes of the request.
    if let Some(b) = &mut bucket {
        b.unused = 0;
    }
    let waiter = intake.waiter(&ask, vec![rx], vec![cancel]);
    let mut vectors: Vec<Option<Vec<f32>>> = vec![None; n_inputs];
    let usage = loop {
        match waiter.next_before(None, &[false]) {
            Ok(Some((_, Event::Embedding { index, vector }))) => {
                if let Some(v) = vectors.get_mut(index) {
                    *v = Some(vector);
                }
            }
            Ok(Some((_, Event::End { usage, .. }))) => break usage,
            Ok(_) => {}
            Err(e) => return intake.fail(req, e),
        }
    };
    let body = answer(state, vectors, valid.base64, usage.prompt_tokens);
    respond_json(req, 200, &body);
    intake.log(&Outcome {
        status: 200,
        usage: Usage {
            prompt_tokens,
            ..Usage::default()
        },
        first_token: None,
        note: "",
        cached_all: 0,
    });
}

/// The answer's body: each input's vector (floats, or base64 of their
/// little-endian bytes) and the usage.
fn answer(
    state: &AppState,
    vectors: Vec<Option<Vec<f32>>>,
    base64: bool,
    prompt_tokens: usize,
) -> Value {
    let data: Vec<Value> = vectors
        .into_iter()
        .enumerate()
        .map(|(index, v)| {
            let v = v.unwrap_or_default();
            let embedding = if base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    json!({
        "object": "list",
        "data": data,
        "model": state.cfg.model_name,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(body: &str) -> Result<EmbedRequest, ApiError> {
        parse(body.as_bytes(), 576)
    }

    #[test]
    fn every_input_shape_is_read() {
        let one = parsed(r#"{"input": "a"}"#).unwrap();
        assert_eq!(one.inputs, vec![Input::Text("a".into())]);
        assert!(!one.base64);
        let many = parsed(r#"{"input": ["a", [1, 2]], "encoding_format": "base64"}"#).unwrap();
        assert_eq!(
            many.inputs,
            vec![Input::Text("a".into()), Input::Tokens(vec![1, 2])]
        );
        assert!(many.base64);
        let ids = parsed(r#"{"input": [5, 6, 7], "model": "m", "user": "u"}"#).unwrap();
        assert_eq!(ids.inputs, vec![Input::Tokens(vec![5, 6, 7])]);
        assert!(parsed(r#"{"input": "a", "dimensions": 576}"#).is_ok());
    }

    #[test]
    fn what_cannot_be_served_is_refused_by_name() {
        let param = |body: &str| {
            let e = parsed(body).unwrap_err();
            e.to_json()["error"]["param"].as_str().map(str::to_string)
        };
        assert_eq!(param(r#"{}"#).as_deref(), Some("input"));
        assert_eq!(param(r#"{"input": []}"#).as_deref(), Some("input"));
        assert_eq!(param(r#"{"input": [1.5]}"#).as_deref(), Some("input"));
        assert_eq!(param(r#"{"input": [-1]}"#).as_deref(), Some("input"));
        assert_eq!(param(r#"{"input": {"a": 1}}"#).as_deref(), Some("input"));
        assert_eq!(
            param(r#"{"input": "a", "dimensions": 64}"#).as_deref(),
            Some("dimensions")
        );
        assert_eq!(
            param(r#"{"input": "a", "encoding_format": "int8"}"#).as_deref(),
            Some("encoding_format")
        );
        assert_eq!(
            param(r#"{"input": "a", "normalize": false}"#).as_deref(),
            Some("normalize")
        );
        let too_many = format!(r#"{{"input": {}}}"#, json!(vec!["a"; INPUTS_MAX + 1]));
        assert_eq!(param(&too_many).as_deref(), Some("input"));
    }
}
