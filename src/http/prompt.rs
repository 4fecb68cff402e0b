//! Validated input → prompt tokens: the request's cost, counted in tokens before
//! it is admitted.
//!
//! Chat messages are rendered with the model's own Jinja chat template (the
//! GGUF's `tokenizer.chat_template`, or `--chat-template-file`), through
//! `template`; when the GGUF has none, Gemma's turns for a Gemma model, else
//! ChatML, said at start-up.

use super::tools::{call_text, Tools};
use super::validation::{Input, Message, Role};
use crate::ffi::{Model, Token};
use crate::template::{fallback_for, ChatTemplate, Source};
use std::path::Path;
use std::sync::Arc;

pub struct Prompter {
    model: Arc<Model>,
    template: ChatTemplate,
    n_vocab: usize,
    /// Whether the template renders `tools`, and assistant `tool_calls`
    /// (else sluice writes them into the messages itself).
    renders_tools: bool,
    renders_tool_calls: bool,
}

impl Prompter {
    /// The template from `file` if given, else the GGUF's, else the fallback
    /// for its architecture (`template::fallback_for`). A
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
                None => {
                    let (text, source) =
                        fallback_for(model.meta("general.architecture").as_deref());
                    (text.to_string(), source)
                }
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
            renders_tools: text.contains("tools"),
            renders_tool_calls: text.contains("tool_calls"),
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
    ///
    /// Tools go to a template that renders them as `tools`; for one that
    /// does not, sluice describes them in the system message, and writes an
    /// assistant's calls as the call text structured output enforces
    /// (`tools::call_text`), so the model sees its own calls either way.
    pub fn render_chat(&self, messages: &[Message], tools: &Tools) -> Result<String, String> {
        let auto = tools.is_auto();
        let held = tools.calls();
        let tools = &tools.tools[..];
        use serde_json::{json, Value};
        let mut msgs: Vec<Value> = messages
            .iter()
            .map(|m| {
                let mut v = json!({"role": m.role.as_str(), "content": m.content});
                if !m.tool_calls.is_empty() {
                    if self.renders_tool_calls {
                        v["tool_calls"] = m
                            .tool_calls
                            .iter()
                            .map(|c| {
                                json!({"id": c.id, "type": "function",
                                       "function": {"name": c.name, "arguments": c.arguments}})
                            })
                            .collect();
                    } else {
                        let calls: Vec<String> = m
                            .tool_calls
                            .iter()
                            .map(|c| call_text(&c.name, &c.arguments))
                            .collect();
                        let mut text = m.content.clone();
                        if !text.is_empty() {
                            text.push('\n');
                        }
                        text.push_str(&calls.join("\n"));
                        v["content"] = Value::String(text);
                    }
                }
                if let Some(id) = &m.tool_call_id {
                    v["tool_call_id"] = Value::String(id.clone());
                }
                v
            })
            .collect();
        let specs: Vec<Value> = tools.iter().map(|t| t.spec.clone()).collect();
        // The format structured output holds the answer to.
        let format = |lead: &str| {
            format!(
                "{lead}, answer with only {}.{}",
                call_text("<function name>", "<its arguments as a JSON object>"),
                match auto {
                    true => " To answer in text instead, answer with only {\"response\": \"<your answer>\"}.",
                    false => "",
                }
            )
        };
        // A template that renders the tools describes them (and its own call
        // syntax); when the answer is held to sluice's format, that format is
        // said too.
        let about = match (tools.is_empty(), self.renders_tools) {
            (true, _) => None,
            (false, false) => Some(format!(
                "You can call these functions:\n{}\n{}",
                Value::Array(specs.clone()),
                format("To call one")
            )),
            (false, true) if held => Some(format(
                "Whatever call syntax is described above: to call a function",
            )),
            (false, true) => None,
        };
        if let Some(about) = about {
            match messages.first() {
                Some(m) if m.role == Role::System => {
                    msgs[0]["content"] = Value::String(format!("{}\n\n{about}", m.content));
                }
                _ => msgs.insert(0, json!({"role": "system", "content": about})),
            }
        }
        let tools_var = (!specs.is_empty()).then(|| Value::Array(specs));
        self.template
            .render(&Value::Array(msgs), tools_var.as_ref(), true)
    }

    /// Tokenizes the input. Token ids are checked against the vocabulary.
    pub fn tokens(&self, input: &Input, tools: &Tools) -> Result<Vec<Token>, String> {
        match input {
            Input::Chat(messages) => {
                // Special tokens in the template ("<|im_start|>") must become tokens.
                self.model
                    .tokenize(&self.render_chat(messages, tools)?, true, true)
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
