//! Validated input → prompt tokens: the request's cost, counted in tokens before
//! it is admitted.
//!
//! Chat messages are rendered with the model's own Jinja chat template (the
//! GGUF's `tokenizer.chat_template`, or `--chat-template-file`), through
//! `template`; ChatML only when the GGUF has none, said at start-up.

use super::validation::{Input, Message};
use crate::ffi::{Model, Token};
use crate::template::{ChatTemplate, Source, CHATML};
use std::path::Path;
use std::sync::Arc;

pub struct Prompter {
    model: Arc<Model>,
    template: ChatTemplate,
    n_vocab: usize,
}

impl Prompter {
    /// The template from `file` if given, else the GGUF's, else ChatML. A
    /// template that does not compile is an error at start-up.
    pub fn new(model: Arc<Model>, file: Option<&Path>) -> Result<Prompter, String> {
        let (text, source) = match file {
            Some(path) => (
                std::fs::read_to_string(path)
                    .map_err(|e| format!("--chat-template-file {}: {e}", path.display()))?,
                Source::File(path.display().to_string()),
            ),
            None => match model.chat_template() {
                Some(t) => (t, Source::Model),
                None => (CHATML.to_string(), Source::ChatMlFallback),
            },
        };
        let piece = |t: Option<Token>| {
            t.map(|t| String::from_utf8_lossy(&model.token_piece(t, true)).into_owned())
                .unwrap_or_default()
        };
        let template = ChatTemplate::new(&text, source, piece(model.bos()), piece(model.eos()))
            .map_err(|e| format!("the chat template does not compile: {e}"))?;
        let n_vocab = model.n_vocab();
        Ok(Prompter {
            model,
            template,
            n_vocab,
        })
    }

    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    pub fn template_source(&self) -> &Source {
        self.template.source()
    }

    /// Renders a chat to the text the model is prompted with; an error is the
    /// template's refusal of these messages.
    pub fn render_chat(&self, messages: &[Message]) -> Result<String, String> {
        let msgs: Vec<serde_json::Value> = messages
            .iter()
            .map(|m| serde_json::json!({"role": m.role.as_str(), "content": m.content}))
            .collect();
        self.template
            .render(&serde_json::Value::Array(msgs), None, true)
    }

    /// Tokenizes the input. Token ids are checked against the vocabulary.
    pub fn tokens(&self, input: &Input) -> Result<Vec<Token>, String> {
        match input {
            Input::Chat(messages) => {
                // Special tokens in the template ("<|im_start|>") must become tokens.
                self.model
                    .tokenize(&self.render_chat(messages)?, true, true)
            }
            Input::Text(text) => self.model.tokenize(text, true, true),
            Input::Tokens(ids) => match ids.iter().find(|&&t| t as usize >= self.n_vocab) {
                Some(bad) => Err(format!(
                    "token id {bad} is outside the vocabulary of {} tokens",
                    self.n_vocab
                )),
                None => Ok(ids.clone()),
            },
        }
    }

    /// The text of tokens (for `echo` of a prompt given as ids).
    pub fn detokenize(&self, tokens: &[Token]) -> String {
        let bytes: Vec<u8> = tokens
            .iter()
            .flat_map(|&t| self.model.token_piece(t, true))
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}
