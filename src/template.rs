//! Chat templates: a model's Jinja template (the GGUF's
//! `tokenizer.chat_template`, or `--chat-template-file`) rendered with
//! `minijinja`, the engine TGI uses, as Hugging Face's `transformers` renders
//! it: `trim_blocks` and `lstrip_blocks` on, Python's string and dict methods
//! (`.strip()`, `.items()`, ...), `raise_exception`, `strftime_now`, and the
//! variables templates expect: `messages`, `add_generation_prompt`,
//! `bos_token`, `eos_token`, `tools`.
//!
//! Rendering is pure: the same messages give the same text, which is what
//! the prefix cache relies on across a chat's turns.

use minijinja::value::Serde;
use minijinja::{Environment, Error, ErrorKind, Value};

/// ChatML, for a model without a template of its own (said at start-up).
pub const CHATML: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Gemma's turns (`<start_of_turn>user` ... `<end_of_turn>`, the assistant
/// called `model`, a system message put before the first user turn), for a
/// Gemma-family GGUF without a template (said at start-up). The BOS token is
/// not written: tokenization adds it, as the vocabulary asks.
pub const GEMMA: &str = "{% set first = namespace(prefix='') %}\
{% for message in messages %}\
{% if message['role'] == 'system' %}{% set first.prefix = first.prefix + message['content'] + '\n\n' %}\
{% else %}\
{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\n' }}\
{% if message['role'] == 'user' %}{{ first.prefix }}{% set first.prefix = '' %}{% endif %}\
{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}\
{% endif %}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}";

/// The template for a GGUF that has none, by its `general.architecture`:
/// Gemma's for the Gemma family, else ChatML.
pub fn fallback_for(architecture: Option<&str>) -> (&'static str, Source) {
    match architecture {
        Some(arch) if arch.starts_with("gemma") => (GEMMA, Source::Fallback("Gemma", arch.into())),
        _ => (CHATML, Source::ChatMlFallback),
    }
}

/// Where a server's template came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// The GGUF's `tokenizer.chat_template`.
    Model,
    /// `--chat-template-file`.
    File(String),
    /// ChatML: the GGUF has no template.
    ChatMlFallback,
    /// A family's own turns (name, the GGUF's architecture): the GGUF has no
    /// template.
    Fallback(&'static str, String),
}

impl Source {
    pub fn describe(&self) -> String {
        match self {
            Source::Model => "the model's Jinja template".into(),
            Source::File(path) => format!("the Jinja template in {path}"),
            Source::ChatMlFallback => "ChatML (fallback: the model has no chat template)".into(),
            Source::Fallback(name, arch) => format!(
                "{name}'s turns, built in (fallback: the model has no chat template; its architecture is {arch})"
            ),
        }
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    source: Source,
    bos_token: String,
    eos_token: String,
}

/// The template's name inside its environment.
const NAME: &str = "chat";

impl ChatTemplate {
    /// Compiles `text`; an error names the line it could not parse.
    pub fn new(
        text: &str,
        source: Source,
        bos_token: String,
        eos_token: String,
    ) -> Result<ChatTemplate, String> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| e.to_string())?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(NAME, text.to_string())
            .map_err(|e| describe(&e))?;
        Ok(ChatTemplate {
            env,
            source,
            bos_token,
            eos_token,
        })
    }

    pub fn source(&self) -> &Source {
        &self.source
    }

    /// Renders a chat: `messages` are OpenAI message objects (`role`,
    /// `content` as a string, and whatever else the caller passes on);
    /// `tools` the request's tool list, if it has one. An error is the
    /// template's own (`raise_exception`, e.g. roles that do not alternate)
    /// or a failure to render; the client's to fix either way.
    pub fn render(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let tmpl = self.env.get_template(NAME).map_err(|e| describe(&e))?;
        let ctx = minijinja::context! {
            messages => Value::from(Serde(messages)),
            tools => tools.map(|t| Value::from(Serde(t))),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        };
        tmpl.render(ctx).map_err(|e| describe(&e))
    }
}

fn describe(e: &Error) -> String {
    match (e.kind(), e.detail()) {
        // raise_exception's message, as the template wrote it.
        (ErrorKind::InvalidOperation, Some(d)) => d.to_string(),
        _ => {
            let mut s = e.to_string();
            if let Some(line) = e.line() {
                if !s.contains("line") {
                    s.push_str(&format!(" (template line {line})"));
                }
            }
            s
        }
    }
}

/// `raise_exception(message)`: the template refuses the chat.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the local time, as Python's `strftime` formats it
/// (Llama 3's templates put today's date in the system prompt).
fn strftime_now(format: String) -> Result<Value, Error> {
    crate::ffi::strftime_now(&format)
        .map(Value::from)
        .ok_or_else(|| Error::new(ErrorKind::InvalidOperation, "strftime_now: bad format"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chatml() -> ChatTemplate {
        ChatTemplate::new(CHATML, Source::ChatMlFallback, String::new(), String::new()).unwrap()
    }

    #[test]
    fn chatml_renders_turns_and_opens_the_assistant_turn() {
        let msgs =
            json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]);
        assert_eq!(
            chatml().render(&msgs, None, true).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            chatml().render(&msgs, None, false).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        );
    }

    #[test]
    fn a_gemma_model_without_a_template_gets_gemmas_turns() {
        let (text, source) = fallback_for(Some("gemma3"));
        assert_eq!(source, Source::Fallback("Gemma", "gemma3".into()));
        let t = ChatTemplate::new(text, source, "<bos>".into(), "<eos>".into()).unwrap();
        let msgs = serde_json::json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": " Hi "},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"}
        ]);
        assert_eq!(
            t.render(&msgs, None, true).unwrap(),
            "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n\
             <start_of_turn>model\nHello.<end_of_turn>\n\
             <start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
        );
        assert_eq!(fallback_for(Some("llama")).1, Source::ChatMlFallback);
        assert_eq!(fallback_for(None).1, Source::ChatMlFallback);
    }

    #[test]
    fn blocks_trim_their_newline_and_python_methods_work() {
        // As transformers (jinja2) renders: trim_blocks, lstrip_blocks (only
        // before a block tag), str.strip(), bos/eos tokens and tools passed.
        let src = "{{ bos_token }}\n{% for m in messages %}\n    {{ m.role.upper() }}: {{ m.content.strip() }}\n{% endfor %}\n{% if tools %}{{ tools | length }} tools{% endif %}{{ eos_token }}";
        let t = ChatTemplate::new(src, Source::Model, "<s>".into(), "</s>".into()).unwrap();
        let msgs = json!([{"role": "user", "content": "  hi  "}]);
        let tools = json!([{"type": "function", "function": {"name": "f"}}]);
        assert_eq!(
            t.render(&msgs, Some(&tools), true).unwrap(),
            "<s>\n    USER: hi\n1 tools</s>"
        );
    }

    #[test]
    fn raise_exception_is_the_templates_refusal() {
        let src = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok";
        let t = ChatTemplate::new(src, Source::Model, String::new(), String::new()).unwrap();
        assert_eq!(
            t.render(&json!([{"role": "assistant", "content": "x"}]), None, true)
                .unwrap_err(),
            "Conversation must start with user"
        );
        assert_eq!(
            t.render(&json!([{"role": "user", "content": "x"}]), None, true),
            Ok("ok".into())
        );
    }

    #[test]
    fn a_template_that_does_not_parse_is_an_error_naming_its_line() {
        let e = ChatTemplate::new("a\n{% for %}", Source::Model, String::new(), String::new())
            .err()
            .unwrap();
        assert!(e.contains("line 2"), "{e}");
    }

    #[test]
    fn strftime_now_formats_todays_date() {
        let t = ChatTemplate::new(
            "{{ strftime_now('%Y') }}",
            Source::Model,
            String::new(),
            String::new(),
        )
        .unwrap();
        let year: u32 = t.render(&json!([]), None, true).unwrap().parse().unwrap();
        assert!(year >= 2024);
    }
}
