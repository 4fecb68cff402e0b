//! OpenAI's response shapes for chat and (legacy) text completions, streamed and not.

use crate::stream::{FinishReason, TokenLogprob, Usage};
use serde_json::{json, Value};

use super::tools::CallDelta;
use super::validation::Api;

/// Identity of one response, repeated in every chunk.
pub struct Meta<'a> {
    pub id: &'a str,
    pub created: u64,
    pub model: &'a str,
    pub api: Api,
    /// `stream_options.include_usage`: every chunk before the usage chunk
    /// says `"usage": null`, as OpenAI's do.
    pub include_usage: bool,
}

impl Meta<'_> {
    fn object(&self, stream: bool) -> &'static str {
        match (self.api, stream) {
            (Api::Chat, true) => "chat.completion.chunk",
            (Api::Chat, false) => "chat.completion",
            (Api::Completions, _) => "text_completion",
        }
    }

    fn wrap(&self, stream: bool, choice: Value, usage: Option<Usage>) -> Value {
        let choices = match choice {
            Value::Null => Vec::new(),
            Value::Array(all) => all,
            one => vec![one],
        };
        let mut v = json!({
            "id": self.id,
            "object": self.object(stream),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": concat!("sluice-", env!("CARGO_PKG_VERSION")),
            "choices": choices,
        });
        match usage {
            Some(u) => v["usage"] = usage_json(u),
            None if stream && self.include_usage => v["usage"] = Value::Null,
            None => {}
        }
        v
    }

    /// The first chunk of a chat stream's choice `i` announces the assistant's role.
    pub fn role_chunk(&self, i: usize) -> Value {
        let choice = json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null});
        self.wrap(true, choice, None)
    }

    /// A chunk carrying text (and its log-probabilities when asked for).
    pub fn text_chunk(
        &self,
        i: usize,
        text: &str,
        logprobs: &[&TokenLogprob],
        offset: usize,
    ) -> Value {
        let choice = match self.api {
            Api::Chat => json!({
                "index": i,
                "delta": {"content": text},
                "logprobs": if logprobs.is_empty() { Value::Null } else { chat_logprobs(logprobs) },
                "finish_reason": null,
            }),
            Api::Completions => json!({
                "index": i,
                "text": text,
                "logprobs": if logprobs.is_empty() { Value::Null } else { legacy_logprobs(logprobs, offset) },
                "finish_reason": null,
            }),
        };
        self.wrap(true, choice, None)
    }

    /// The chunk that carries the finish reason.
    pub fn finish_chunk(&self, i: usize, finish: FinishReason) -> Value {
        let choice = match self.api {
            Api::Chat => {
                json!({"index": i, "delta": {}, "logprobs": null, "finish_reason": finish.as_str()})
            }
            Api::Completions => {
                json!({"index": i, "text": "", "logprobs": null, "finish_reason": finish.as_str()})
            }
        };
        self.wrap(true, choice, None)
    }

    /// With `stream_options.include_usage`: a last chunk with no choices and the usage.
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        self.wrap(true, Value::Null, Some(usage))
    }

    /// A whole non-streamed response of its choices.
    pub fn response(&self, choices: Vec<Value>, usage: Usage) -> Value {
        self.wrap(false, Value::Array(choices), Some(usage))
    }

    /// Choice `i` of a whole response: its text.
    pub fn text_choice(
        &self,
        i: usize,
        text: &str,
        logprobs: Option<&[&TokenLogprob]>,
        finish: FinishReason,
    ) -> Value {
        match self.api {
            Api::Chat => json!({
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs.map_or(Value::Null, chat_logprobs),
                "finish_reason": finish.as_str(),
            }),
            Api::Completions => json!({
                "index": i,
                "text": text,
                "logprobs": logprobs.map_or(Value::Null, |lp| legacy_logprobs(lp, 0)),
                "finish_reason": finish.as_str(),
            }),
        }
    }

    /// Choice `i` of a whole response that is a call: `tool_calls`, no
    /// content; `finish_reason` is `tool_calls`, or `length` for a call cut
    /// short.
    pub fn tool_choice(
        &self,
        i: usize,
        call_id: &str,
        name: &str,
        arguments: &str,
        finish: FinishReason,
    ) -> Value {
        json!({
            "index": i,
            "message": {"role": "assistant", "content": null, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            ]},
            "logprobs": null,
            "finish_reason": tool_finish(finish),
        })
    }

    /// A streamed call's first chunk (its id and name) or one of its
    /// arguments' pieces.
    pub fn tool_chunk(&self, i: usize, call_id: &str, delta: &CallDelta) -> Value {
        let call = match delta {
            CallDelta::Name(name) => json!({"index": 0, "id": call_id, "type": "function",
                                            "function": {"name": name, "arguments": ""}}),
            CallDelta::Arguments(a) => json!({"index": 0, "function": {"arguments": a}}),
        };
        let choice = json!({"index": i, "delta": {"tool_calls": [call]}, "logprobs": null, "finish_reason": null});
        self.wrap(true, choice, None)
    }

    /// The chunk that ends a streamed call.
    pub fn tool_finish_chunk(&self, i: usize, finish: FinishReason) -> Value {
        let choice = json!({"index": i, "delta": {}, "logprobs": null, "finish_reason": tool_finish(finish)});
        self.wrap(true, choice, None)
    }
}

fn tool_finish(finish: FinishReason) -> &'static str {
    match finish {
        FinishReason::Stop => "tool_calls",
        FinishReason::Length => "length",
    }
}

fn usage_json(u: Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": { "cached_tokens": u.cached_tokens },
    })
}

/// Chat format: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
pub fn chat_logprobs(entries: &[&TokenLogprob]) -> Value {
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let top: Vec<Value> = e
                .top
                .iter()
                .map(
                    |(_, text, lp)| json!({"token": text, "logprob": lp, "bytes": text.as_bytes()}),
                )
                .collect();
            json!({
                "token": e.text,
                "logprob": e.logprob,
                "bytes": e.text.as_bytes(),
                "top_logprobs": top,
            })
        })
        .collect();
    json!({ "content": content })
}

/// Legacy completions format, plus `token_ids` (a sluice extension: the ids of
/// `tokens`, so that a client can replay or score exactly these tokens).
pub fn legacy_logprobs(entries: &[&TokenLogprob], first_offset: usize) -> Value {
    let mut offset = first_offset;
    let mut tokens = Vec::new();
    let mut token_logprobs = Vec::new();
    let mut top_logprobs = Vec::new();
    let mut text_offset = Vec::new();
    let mut token_ids = Vec::new();
    for e in entries {
        tokens.push(json!(e.text));
        token_logprobs.push(json!(e.logprob));
        top_logprobs.push(if e.logprob.is_none() {
            Value::Null
        } else {
            let mut m = serde_json::Map::new();
            for (_, text, lp) in &e.top {
                m.entry(text.clone()).or_insert(json!(lp));
            }
            Value::Object(m)
        });
        text_offset.push(json!(offset));
        token_ids.push(json!(e.token));
        offset += e.text.chars().count();
    }
    json!({
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
        "token_ids": token_ids,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lp(token: i32, text: &str, logprob: Option<f32>) -> TokenLogprob {
        TokenLogprob {
            token,
            text: text.into(),
            logprob,
            top: vec![(token, text.into(), logprob.unwrap_or(0.0))],
        }
    }

    #[test]
    fn legacy_logprobs_have_parallel_arrays_and_offsets() {
        let a = lp(1, "Hé", None);
        let b = lp(2, "llo", Some(-0.5));
        let v = legacy_logprobs(&[&a, &b], 0);
        assert_eq!(v["tokens"], json!(["Hé", "llo"]));
        assert_eq!(v["token_logprobs"], json!([null, -0.5]));
        assert_eq!(v["top_logprobs"][0], Value::Null);
        assert_eq!(v["top_logprobs"][1]["llo"], json!(-0.5));
        assert_eq!(v["text_offset"], json!([0, 2]));
        assert_eq!(v["token_ids"], json!([1, 2]));
    }

    #[test]
    fn chat_chunks_follow_openai_shape() {
        let meta = Meta {
            id: "chatcmpl-1",
            created: 7,
            model: "m",
            api: Api::Chat,
            include_usage: true,
        };
        let c = meta.text_chunk(0, "hi", &[], 0);
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(
            c.get("usage"),
            Some(&Value::Null),
            "usage: null until the usage chunk"
        );
        assert_eq!(meta.role_chunk(0).get("usage"), Some(&Value::Null));
        let quiet = Meta {
            id: "chatcmpl-2",
            created: 7,
            model: "m",
            api: Api::Chat,
            include_usage: false,
        };
        assert_eq!(quiet.text_chunk(0, "hi", &[], 0).get("usage"), None);
        assert_eq!(c["choices"][0]["delta"]["content"], "hi");
        assert_eq!(
            meta.finish_chunk(0, FinishReason::Length)["choices"][0]["finish_reason"],
            "length"
        );
        let u = meta.usage_chunk(Usage {
            prompt_tokens: 3,
            completion_tokens: 4,
            cached_tokens: 2,
        });
        assert_eq!(u["choices"], json!([]));
        assert_eq!(u["usage"]["total_tokens"], 7);
        assert_eq!(u["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
        // n choices, each with its index.
        let whole = meta.response(
            vec![
                meta.text_choice(0, "a", None, FinishReason::Stop),
                meta.text_choice(1, "b", None, FinishReason::Length),
            ],
            Usage::default(),
        );
        assert_eq!(whole["choices"][1]["index"], 1);
        assert_eq!(whole["choices"][1]["message"]["content"], "b");
        assert_eq!(whole["choices"][1]["finish_reason"], "length");
        assert_eq!(meta.text_chunk(2, "x", &[], 0)["choices"][0]["index"], 2);
    }
}
