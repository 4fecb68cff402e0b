//! `POST /v1/embeddings`: each input's vector, pooled (`--pooling`, or the
//! GGUF's) from the model's token states as the engine prefills it. The same
//! door as a completion: who asks, class, deadline, the client's bucket (in
//! prompt tokens), the admission gate; one job, whose inputs run one after
//! another in one slot.

use super::error::ApiError;
use super::request::{
    authenticate, caller_timeout_ms, charge, json_body, priority_class, InFlight,
};
use super::validation::Input;
use super::{log_request, outcome_of_error, reply, respond_error, respond_json, AppState, Outcome};
use crate::admission::{GenParams, Job, Penalties};
use crate::embed::EmbedSpec;
use crate::ffi::{SamplingParams, Token};
use crate::stream::{CancelFlag, Event, Usage};
use base64::Engine as _;
use crossbeam_channel::bounded;
use serde_json::{json, Map, Value};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
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
    let inputs = match obj.get("input") {
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
    Ok(EmbedRequest { inputs, base64 })
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
pub(super) fn embed(state: &AppState, mut req: Request) {
    let _in_flight = InFlight::enter(&state.in_flight);
    let t0 = Instant::now();
    let path = req.url().to_string();
    let mut tags = format!(" id={}", super::request_id(&req));
    let fail = |req: Request, tags: &str, e: ApiError| {
        log_request(&path, tags, t0, &outcome_of_error(&e));
        respond_error(req, &e);
    };
    if state.draining.load(Ordering::SeqCst) {
        return fail(req, &tags, ApiError::Draining);
    }
    let client = match authenticate(state, &req) {
        Ok(c) => c,
        Err(e) => {
            state.metrics.unauthorized.fetch_add(1, Ordering::Relaxed);
            return fail(req, &tags, e);
        }
    };
    tags.push_str(&format!(" client={}", client.label));
    if let Err((e, hold)) = super::request::at_the_door(state, &mut req, &client) {
        return match hold {
            Some(wait) => {
                log_request(&path, &tags, t0, &outcome_of_error(&e));
                state.tarpit.hold(req, e, wait)
            }
            None => fail(req, &tags, e),
        };
    }
    let probe = req.take_peer_socket();
    let prepared = (|| {
        let Some(pooling) = state.pooling else {
            return Err(ApiError::invalid(
                "model",
                format!(
                    "'{}' makes no embeddings here: {}",
                    state.cfg.model_name, state.pooling_source
                ),
            ));
        };
        let timeout_ms = caller_timeout_ms(&req, state.cfg.request_timeout_ms)?;
        let class = priority_class(&req)?;
        let body = json_body(state, &mut req)?;
        let valid = parse(&body, state.n_embd)?;
        let n_ctx = match class {
            crate::priority::Class::Batch => state.batch_seq_tokens_max,
            crate::priority::Class::Interactive => state.seq_tokens_max,
        };
        let (prompt, ends) = tokens(state, &valid.inputs, n_ctx)?;
        state
            .metrics
            .prompts_tokenized
            .fetch_add(1, Ordering::Relaxed);
        Ok((pooling, timeout_ms, class, valid, prompt, ends))
    })();
    let (pooling, timeout_ms, class, valid, prompt, ends) = match prepared {
        Ok(p) => p,
        Err(e) => {
            state.metrics.invalid.fetch_add(1, Ordering::Relaxed);
            return fail(req, &tags, e);
        }
    };
    tags.push_str(&format!(
        " class={} inputs={} pooling={}",
        class.as_str(),
        ends.len(),
        pooling.name()
    ));
    let prompt_tokens = prompt.len();
    let cost = prompt_tokens as u64;
    // Charged in full: an embedding generates nothing, and reuses nothing.
    let mut bucket = match charge(state, &client, class, cost) {
        Ok(b) => b,
        Err(e) => return fail(req, &tags, e),
    };
    let n_inputs = ends.len();
    let (tx, rx) = bounded(state.cfg.stream_buffer_tokens);
    let cancel = CancelFlag::default();
    let job = Job {
        id: state.next_id.fetch_add(1, Ordering::Relaxed),
        request_id: super::request_id(&req).into(),
        class,
        prompt,
        gen: GenParams {
            max_tokens: 0,
            sampling: SamplingParams {
                temperature: 0.0,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                seed: 0,
            },
            penalties: Penalties::default(),
            constraint: None,
            stop: Vec::new(),
            ignore_eos: false,
            top_logprobs: None,
            echo_logprobs: false,
        },
        enqueued_at: t0,
        deadline: Some(t0 + Duration::from_millis(timeout_ms)),
        events: tx,
        cancel: cancel.clone(),
        cached_estimate: 0,
        embed: Some(EmbedSpec { ends, pooling }),
        prompt_of: None,
    };
    if let Err(refused) = state.admission.submit(job) {
        // Refused for overload: the charge goes back (when `bucket` drops).
        return fail(req, &tags, ApiError::from(refused));
    }
    // Admitted: the prompt is paid for, whatever becomes of the request.
    if let Some(b) = &mut bucket {
        b.unused = 0;
    }
    let waiter = reply::Waiter::new(state, t0, timeout_ms, vec![rx], vec![cancel], probe);
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
            Err(e) => {
                return fail(req, &tags, e);
            }
        }
    };
    let data: Vec<Value> = vectors
        .into_iter()
        .enumerate()
        .map(|(index, v)| {
            let v = v.unwrap_or_default();
            let embedding = if valid.base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    let body = json!({
        "object": "list",
        "data": data,
        "model": state.cfg.model_name,
        "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens},
    });
    respond_json(req, 200, &body);
    log_request(
        &path,
        &tags,
        t0,
        &Outcome {
            status: 200,
            usage: Usage {
                prompt_tokens,
                ..Usage::default()
            },
            first_token: None,
            note: "",
            cached_all: 0,
        },
    );
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
