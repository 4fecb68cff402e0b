//! A multi-turn conversation: a long system prompt, then turns that each
//! re-send the whole history (as every chat client does) with a new question.
//!
//! What it shows: whether the server prefills the history again every turn, or
//! keeps the previous turn's KV cells and prefills only what is new. Each turn's
//! time to first token is recorded, with the prompt and cached tokens the server
//! reports in `usage` (OpenAI's `prompt_tokens_details.cached_tokens`, when it
//! reports them).

use crate::client::Target;
use crate::http::Sse;
use crate::workload::prompt_text;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct ConversationConfig {
    /// Approximate tokens of the system prompt.
    pub system_tokens: u64,
    pub turns: usize,
    /// `max_tokens` of each answer.
    pub answer_tokens: u64,
    /// Seed of the system prompt's text: a new seed is a conversation no cache
    /// has seen.
    pub seed: u64,
    pub timeout: Duration,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    pub ttft: Duration,
    pub total: Duration,
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
}

pub fn run(target: &Target, cfg: &ConversationConfig) -> Result<Vec<Turn>, String> {
    let path = format!("{}/v1/chat/completions", target.prefix);
    let system = format!(
        "You are a careful assistant. Answer questions about these notes.\n{}",
        prompt_text(cfg.system_tokens, cfg.seed)
    );
    let mut messages = vec![json!({"role": "system", "content": system})];
    let mut turns = Vec::with_capacity(cfg.turns);
    for t in 0..cfg.turns {
        messages.push(json!({"role": "user", "content": format!(
            "Question {}: what jumped over the fence on line {}, and what colour was the fence?",
            t + 1,
            3 + 7 * t
        )}));
        let mut body = json!({
            "model": target.model,
            "messages": messages,
            "max_tokens": cfg.answer_tokens,
            "temperature": target.temperature,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if target.ignore_eos {
            body["ignore_eos"] = json!(true);
        }
        let t0 = Instant::now();
        let mut sse = Sse::open(target.addr, &path, body.to_string().as_bytes(), cfg.timeout)
            .map_err(|e| format!("turn {}: {e}", t + 1))?;
        if sse.status != 200 {
            return Err(format!("turn {}: status {}", t + 1, sse.status));
        }
        let mut ttft = None;
        let mut answer = String::new();
        let mut usage = Value::Null;
        while let Some(v) = sse
            .next_json()
            .map_err(|e| format!("turn {}: {e}", t + 1))?
        {
            if let Some(s) = v["choices"][0]["delta"]["content"].as_str() {
                if !s.is_empty() && ttft.is_none() {
                    ttft = Some(t0.elapsed());
                }
                answer.push_str(s);
            }
            if !v["usage"].is_null() {
                usage = v["usage"].clone();
            }
        }
        let total = t0.elapsed();
        turns.push(Turn {
            ttft: ttft.ok_or(format!("turn {}: no token", t + 1))?,
            total,
            prompt_tokens: usage["prompt_tokens"].as_u64(),
            cached_tokens: usage["prompt_tokens_details"]["cached_tokens"].as_u64(),
            completion_tokens: usage["completion_tokens"].as_u64(),
        });
        messages.push(json!({"role": "assistant", "content": answer}));
    }
    Ok(turns)
}

pub fn to_json(turns: &[Turn]) -> Value {
    json!({
        "turns": turns.iter().map(|t| json!({
            "ttft_ms": t.ttft.as_secs_f64() * 1e3,
            "total_ms": t.total.as_secs_f64() * 1e3,
            "prompt_tokens": t.prompt_tokens,
            "cached_tokens": t.cached_tokens,
            "completion_tokens": t.completion_tokens,
        })).collect::<Vec<_>>(),
    })
}
