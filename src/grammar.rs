//! Structured output: a JSON schema compiled by `llguidance` (the library
//! llama.cpp and vLLM use) into a constraint that masks, at each sampling
//! step, every token that would take the output off the schema.
//!
//! `Grammars` is built once per model: llguidance's token trie over the
//! model's vocabulary (each token's bytes as llama.cpp renders them; special
//! tokens marked with a leading 0xFF, as llama.cpp's own llguidance
//! integration does) and its parser factory. `compile` runs on an HTTP
//! handler, before admission, so a bad schema is a 400 that costs the engine
//! nothing; the `Constraint` it returns travels with the job, and the engine
//! thread masks with it (`engine::sample`).
//!
//! JSON is written with fixed separators (", " and ": ", as Python's
//! `json.dumps`) and no free whitespace: a small model let loose on optional
//! whitespace can emit newlines until `max_tokens`. With `strict`, a schema
//! keyword llguidance does not implement is an error naming it; without, it
//! is ignored (llguidance's lenient mode), as OpenAI's non-strict mode is
//! best effort.

use crate::ffi::{Model, Token};
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use std::sync::Arc;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

/// The model's vocabulary as llguidance sees it.
struct Vocab {
    trie: TokTrie,
    model: Arc<Model>,
}

impl TokenizerEnv for Vocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<toktrie::TokenId> {
        let text = String::from_utf8_lossy(s);
        self.model
            .tokenize(&text, false, false)
            .unwrap_or_default()
            .into_iter()
            .map(|t| t as toktrie::TokenId)
            .collect()
    }
}

pub struct Grammars {
    factory: ParserFactory,
    n_vocab: usize,
}

impl Grammars {
    /// `None` for a model without an end-of-sequence token (nothing could
    /// end a constrained answer).
    pub fn new(model: &Arc<Model>) -> Result<Grammars, String> {
        let eos = model
            .eos()
            .ok_or("the model has no end-of-sequence token")?;
        let n_vocab = model.n_vocab();
        let words: Vec<Vec<u8>> = (0..n_vocab as Token)
            .map(|t| {
                let plain = model.token_piece(t, false);
                if !plain.is_empty() {
                    return plain;
                }
                let special = model.token_piece(t, true);
                if special.is_empty() {
                    return special;
                }
                let mut marked = Vec::with_capacity(special.len() + 1);
                marked.push(TokTrie::SPECIAL_TOKEN_MARKER);
                marked.extend_from_slice(&special);
                marked
            })
            .collect();
        let info = TokRxInfo {
            vocab_size: n_vocab as u32,
            tok_eos: eos as toktrie::TokenId,
            tok_bos: model.bos().map(|t| t as toktrie::TokenId),
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: None,
        };
        let env: TokEnv = Arc::new(Vocab {
            trie: TokTrie::from(&info, &words),
            model: Arc::clone(model),
        });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(Grammars { factory, n_vocab })
    }

    /// A constraint for output that is JSON valid against `schema`; the
    /// error is the schema's fault, in llguidance's words.
    pub fn json_schema(&self, schema: &Value, strict: bool) -> Result<Constraint, String> {
        let Value::Object(obj) = schema else {
            return Err("the schema must be a JSON object".into());
        };
        let mut schema = obj.clone();
        schema.insert(
            "x-guidance".into(),
            json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
                "lenient": !strict,
            }),
        );
        let grammar = TopLevelGrammar::from_json_schema(Value::Object(schema));
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Constraint {
            matcher,
            n_vocab: self.n_vocab,
        })
    }

    /// Any JSON object (`response_format: json_object`).
    pub fn json_object(&self) -> Constraint {
        self.json_schema(&json!({"type": "object"}), true)
            .expect("the object schema compiles")
    }
}

/// One request's structured-output state: what it may generate next.
pub struct Constraint {
    matcher: Matcher,
    n_vocab: usize,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constraint")
    }
}

impl Clone for Constraint {
    fn clone(&self) -> Constraint {
        Constraint {
            matcher: self.matcher.deep_clone(),
            n_vocab: self.n_vocab,
        }
    }
}

impl Constraint {
    /// Sets the logit of every token the schema does not allow next to minus
    /// infinity. Once the output is complete only end-of-sequence is allowed.
    /// An error (the constraint has failed) leaves the row as it is.
    pub fn mask(&mut self, row: &mut [f32]) -> Result<(), String> {
        let allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| e.to_string())?;
        for (t, l) in row.iter_mut().enumerate().take(self.n_vocab) {
            if !allowed.is_allowed(t as toktrie::TokenId) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Advances past the token sampled.
    pub fn accept(&mut self, token: Token) -> Result<(), String> {
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher
            .consume_token(token as toktrie::TokenId)
            .map_err(|e| e.to_string())
    }
}
