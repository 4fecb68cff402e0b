//! Validated input → prompt tokens: the request's cost, counted in tokens before
//! it is admitted.
//!
//! Chat messages are rendered with the chat template stored in the GGUF through
//! llama.cpp's built-in template matcher. llama.cpp recognises template families
//! by substring, not by running Jinja; when the GGUF has no template or one it
//! does not recognise, sluice falls back to ChatML (`<|im_start|>role\n...<|im_end|>`),
//! which is what SmolLM2, Qwen and many fine-tunes use, and says so at start-up.

use super::validation::{Input, Message};
use crate::ffi::{Model, Token};
use std::sync::Arc;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Template {
    /// The GGUF's own template, which llama.cpp recognises.
    Model(String),
    /// ChatML, because the GGUF's template is missing or not recognised.
    ChatMlFallback,
}

pub struct Prompter {
    model: Arc<Model>,
    template: Template,
    n_vocab: usize,
}

impl Prompter {
    pub fn new(model: Arc<Model>) -> Prompter {
        let probe = [("user", "hi")];
        let template = match model.chat_template() {
            Some(t) if model.apply_chat_template(&t, &probe).is_some() => Template::Model(t),
            _ => Template::ChatMlFallback,
        };
        let n_vocab = model.n_vocab();
        Prompter {
            model,
            template,
            n_vocab,
        }
    }

    pub fn template(&self) -> &Template {
        &self.template
    }

    /// Renders a chat to the text the model is prompted with.
    pub fn render_chat(&self, messages: &[Message]) -> String {
        let pairs: Vec<(&str, &str)> = messages
            .iter()
            .map(|m| (m.role.as_str(), m.content.as_str()))
            .collect();
        if let Template::Model(t) = &self.template {
            if let Some(text) = self.model.apply_chat_template(t, &pairs) {
                return text;
            }
        }
        chatml(&pairs)
    }

    /// Tokenizes the input. Token ids are checked against the vocabulary.
    pub fn tokens(&self, input: &Input) -> Result<Vec<Token>, String> {
        match input {
            Input::Chat(messages) => {
                // Special tokens in the template ("<|im_start|>") must become tokens.
                self.model.tokenize(&self.render_chat(messages), true, true)
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

/// ChatML, ending with the opening of the assistant's turn.
pub fn chatml(messages: &[(&str, &str)]) -> String {
    let mut out = String::new();
    for (role, content) in messages {
        out.push_str("<|im_start|>");
        out.push_str(role);
        out.push('\n');
        out.push_str(content);
        out.push_str("<|im_end|>\n");
    }
    out.push_str("<|im_start|>assistant\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_renders_turns_and_opens_the_assistant_turn() {
        assert_eq!(
            chatml(&[("system", "Be brief."), ("user", "Hi")]),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }
}
