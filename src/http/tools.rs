//! Tool calling: `tools` and `tool_choice` validated, the answer the model
//! must write (a JSON schema, enforced by structured output), and that
//! answer's text turned back into OpenAI's `tool_calls` or text, whole or
//! streamed.
//!
//! With `tool_choice: "required"` or a named function the answer is a call,
//! so it is constrained to one: the text `{"name": "<function>", "arguments":
//! {...}}`, with `arguments` valid against the function's `parameters`.
//! With `"auto"` (OpenAI's default with tools) the answer is a call or
//! `{"response": "<text>"}`, whichever the model starts to write: one
//! format every model can be held to (llama.cpp's generic tool format is the
//! same idea), instead of each model family's own free-form call syntax.
//! `"none"` answers in text (the tools stay in the prompt, as OpenAI keeps
//! them).

use super::error::ApiError;
use super::fields::is_name;
use serde_json::{json, Map, Value};

/// Most tools per request.
pub const TOOLS_MAX: usize = 128;

#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    /// The request's whole tool object (`{"type": "function", "function": ...}`),
    /// as chat templates expect it.
    pub spec: Value,
    pub parameters: Value,
    pub strict: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Choice {
    /// No tools, or `tool_choice: "none"`: the answer is text.
    None,
    /// The answer is a call of one of the tools.
    Required,
    /// The answer is a call of this tool.
    Named(String),
    /// The answer is a call of one of the tools, or text.
    Auto,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    pub tools: Vec<Tool>,
    pub choice: Choice,
}

impl Tools {
    pub fn none() -> Tools {
        Tools {
            tools: Vec::new(),
            choice: Choice::None,
        }
    }

    /// Whether the answer is constrained to a call (or, `auto`, to a call or
    /// a text response).
    pub fn calls(&self) -> bool {
        self.choice != Choice::None
    }

    pub fn is_auto(&self) -> bool {
        self.choice == Choice::Auto
    }

    /// The schema of the answer: `{"name": <const>, "arguments": <the
    /// function's parameters>}` for each tool the choice allows, and with
    /// `auto` also `{"response": <string>}`.
    pub fn call_schema(&self) -> Value {
        let allowed: Vec<Value> = self
            .tools
            .iter()
            .filter(|t| match &self.choice {
                Choice::Named(n) => &t.name == n,
                _ => true,
            })
            .map(|t| {
                json!({
                    "type": "object",
                    "properties": {
                        "name": {"const": t.name},
                        "arguments": t.parameters,
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                })
            })
            .collect();
        let mut allowed = allowed;
        if self.is_auto() {
            allowed.push(json!({
                "type": "object",
                "properties": {"response": {"type": "string"}},
                "required": ["response"],
                "additionalProperties": false,
            }));
        }
        match allowed.len() {
            1 => allowed.into_iter().next().expect("one"),
            _ => json!({"anyOf": allowed}),
        }
    }

    /// Whether every allowed function asked for `strict` (then a schema
    /// keyword that cannot be enforced is refused).
    pub fn strict(&self) -> bool {
        self.tools.iter().all(|t| t.strict)
    }
}

pub fn parse(obj: &Map<String, Value>) -> Result<Tools, ApiError> {
    let tools = parse_list(obj)?;
    let choice = parse_choice(obj, &tools)?;
    Ok(Tools { tools, choice })
}

/// `tools` alone (what a prompt renders; `/tokenize` takes it too).
pub fn parse_list(obj: &Map<String, Value>) -> Result<Vec<Tool>, ApiError> {
    let list = match obj.get("tools") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(_) => return Err(ApiError::invalid("tools", "'tools' must be an array")),
    };
    if list.len() > TOOLS_MAX {
        return Err(ApiError::invalid(
            "tools",
            format!(
                "'tools' has {} entries; the limit is {TOOLS_MAX}",
                list.len()
            ),
        ));
    }
    let mut tools: Vec<Tool> = Vec::with_capacity(list.len());
    for (i, spec) in list.into_iter().enumerate() {
        let p = format!("tools[{i}]");
        if spec.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::invalid(
                format!("{p}.type"),
                format!("{p}.type must be \"function\""),
            ));
        }
        let Some(Value::Object(f)) = spec.get("function") else {
            return Err(ApiError::invalid(
                format!("{p}.function"),
                format!("{p}.function must be an object with a name"),
            ));
        };
        let name = match f.get("name") {
            Some(Value::String(n)) if is_name(n) => n.clone(),
            _ => {
                return Err(ApiError::invalid(
                    format!("{p}.function.name"),
                    format!("{p}.function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -"),
                ))
            }
        };
        if tools.iter().any(|t| t.name == name) {
            return Err(ApiError::invalid(
                format!("{p}.function.name"),
                format!("two tools are named '{name}'"),
            ));
        }
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(v @ Value::Object(_)) => v.clone(),
            Some(_) => {
                return Err(ApiError::invalid(
                    format!("{p}.function.parameters"),
                    format!("{p}.function.parameters must be a JSON schema (an object)"),
                ))
            }
        };
        let strict = f.get("strict").and_then(Value::as_bool).unwrap_or(false);
        tools.push(Tool {
            name,
            spec,
            parameters,
            strict,
        });
    }
    Ok(tools)
}

fn parse_choice(obj: &Map<String, Value>, tools: &[Tool]) -> Result<Choice, ApiError> {
    let choice = match obj.get("tool_choice") {
        None | Some(Value::Null) if tools.is_empty() => Choice::None,
        Some(Value::String(s)) if s == "none" => Choice::None,
        None | Some(Value::Null) => Choice::Auto,
        Some(Value::String(s)) if s == "auto" => Choice::Auto,
        Some(Value::String(s)) if s == "required" => Choice::Required,
        Some(Value::Object(c))
            if c.get("type").and_then(Value::as_str) == Some("function") =>
        {
            match c.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) {
                Some(n) if tools.iter().any(|t| t.name == n) => Choice::Named(n.to_string()),
                Some(n) => {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        format!("tool_choice names '{n}', which is not in 'tools'"),
                    ))
                }
                None => {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        "tool_choice must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    ))
                }
            }
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "tool_choice",
                "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
            ))
        }
    };
    if choice != Choice::None && tools.is_empty() {
        return Err(ApiError::invalid(
            "tool_choice",
            "tool_choice asks for a call, but 'tools' is empty",
        ));
    }
    Ok(choice)
}

/// The text a call is written as (what structured output enforces), e.g.
/// for the history of a model whose template does not render tool calls.
pub fn call_text(name: &str, arguments: &str) -> String {
    format!("{{\"name\": \"{name}\", \"arguments\": {arguments}}}")
}

/// A call read back from its text: (name, arguments as the JSON text the
/// model wrote, as they are streamed). For text cut short (`max_tokens`)
/// the arguments are what was written.
pub fn parse_call(text: &str) -> Option<(String, String)> {
    let (name, args) = split_prefix(text)?;
    let complete = serde_json::from_str::<Value>(text).is_ok();
    let args = match complete {
        true => args.strip_suffix('}').unwrap_or(args),
        false => args,
    };
    Some((name, args.to_string()))
}

/// `{"name": "<name>", "arguments": ` and what follows it.
fn split_prefix(text: &str) -> Option<(String, &str)> {
    let rest = text.strip_prefix("{\"name\": \"")?;
    let end = rest.find('"')?;
    let name = &rest[..end];
    let args = rest[end..].strip_prefix("\", \"arguments\": ")?;
    Some((name.to_string(), args))
}

/// A streamed call: text in, OpenAI's `tool_calls` deltas out. The name goes
/// out once the prefix is whole; then the arguments as they come, all but
/// the last character, which may be the call's closing brace.
#[derive(Debug, Default)]
pub struct CallStream {
    text: String,
    /// The name, once announced.
    name: Option<String>,
    /// Bytes of `text` up to where arguments were sent.
    sent: usize,
}

/// What a streamed call says next.
#[derive(Debug, PartialEq)]
pub enum CallDelta {
    /// The call starts: its function's name.
    Name(String),
    Arguments(String),
}

impl CallStream {
    pub fn push(&mut self, piece: &str) -> Vec<CallDelta> {
        self.text.push_str(piece);
        let mut out = Vec::new();
        if self.name.is_none() {
            let Some((name, args)) = split_prefix(&self.text) else {
                return out;
            };
            self.sent = self.text.len() - args.len();
            self.name = Some(name.clone());
            out.push(CallDelta::Name(name));
        }
        // Hold back the last character (a char boundary: the text is UTF-8).
        let upto = self.text[..]
            .char_indices()
            .last()
            .map_or(0, |(i, _)| i)
            .max(self.sent);
        if upto > self.sent {
            out.push(CallDelta::Arguments(self.text[self.sent..upto].to_string()));
            self.sent = upto;
        }
        out
    }

    /// At the end: the name if it never went out, and the rest of the
    /// arguments without the call's closing brace (kept if the call was cut).
    pub fn finish(&mut self, complete: bool) -> Vec<CallDelta> {
        let mut out = Vec::new();
        if self.name.is_none() {
            let (name, sent) = match split_prefix(&self.text) {
                Some((name, args)) => (name, self.text.len() - args.len()),
                None => (String::new(), self.text.len()),
            };
            self.sent = sent;
            self.name = Some(name.clone());
            out.push(CallDelta::Name(name));
        }
        let mut rest = &self.text[self.sent..];
        if complete {
            rest = rest.strip_suffix('}').unwrap_or(rest);
        }
        if !rest.is_empty() {
            out.push(CallDelta::Arguments(rest.to_string()));
        }
        self.sent = self.text.len();
        out
    }
}

/// How an `auto` answer that is text starts (what structured output writes).
const RESPONSE_PREFIX: &str = "{\"response\": \"";
/// How a call starts.
const CALL_PREFIX: &str = "{\"name\": \"";

/// A whole answer read back: text, or a call (name, arguments).
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    Text(String),
    Call(String, String),
}

/// An answer read back from its text: `{"response": "..."}` is text (its
/// string decoded; cut short, what was written), anything else a call.
pub fn parse_answer(text: &str) -> Answer {
    if let Some(rest) = text.strip_prefix(RESPONSE_PREFIX) {
        let mut d = JsonString::default();
        return Answer::Text(d.push(rest));
    }
    let (name, args) = parse_call(text).unwrap_or_default();
    Answer::Call(name, args)
}

/// The characters of a JSON string's body, decoded as its text comes in
/// pieces: an escape is held until it is whole (a surrogate pair until both
/// halves are), and nothing after the closing quote is text.
#[derive(Debug, Default)]
pub struct JsonString {
    raw: String,
    /// Bytes of `raw` decoded so far.
    done: usize,
    closed: bool,
}

impl JsonString {
    pub fn push(&mut self, piece: &str) -> String {
        self.raw.push_str(piece);
        let mut out = String::new();
        while !self.closed {
            let rest = &self.raw[self.done..];
            let Some(c) = rest.chars().next() else { break };
            match c {
                '"' => {
                    self.closed = true;
                    self.done += 1;
                }
                '\\' => match decode_escape(rest) {
                    Some((ch, used)) => {
                        out.extend(ch);
                        self.done += used;
                    }
                    None => break, // not whole yet
                },
                c => {
                    out.push(c);
                    self.done += c.len_utf8();
                }
            }
        }
        out
    }
}

/// The escape at the start of `s` (which starts with a backslash): its
/// character (none for a lone surrogate) and its length; `None` until it is
/// whole.
fn decode_escape(s: &str) -> Option<(Option<char>, usize)> {
    let b = s.as_bytes();
    let simple = match *b.get(1)? {
        b'"' => '"',
        b'\\' => '\\',
        b'/' => '/',
        b'b' => '\u{8}',
        b'f' => '\u{c}',
        b'n' => '\n',
        b'r' => '\r',
        b't' => '\t',
        b'u' => {
            let hex = |at: usize| -> Option<u32> {
                let h = s.get(at..at + 4)?;
                u32::from_str_radix(h, 16).ok()
            };
            let hi = hex(2)?;
            if (0xD800..0xDC00).contains(&hi) {
                // A pair: \uD8xx\uDCxx.
                if s.len() < 12 {
                    return None;
                }
                let lo = if &s[6..8] == "\\u" { hex(8) } else { None };
                return Some(match lo {
                    Some(lo) if (0xDC00..0xE000).contains(&lo) => (
                        char::from_u32(0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)),
                        12,
                    ),
                    _ => (None, 6),
                });
            }
            return Some((char::from_u32(hi), 6));
        }
        _ => return Some((None, 2)),
    };
    Some((Some(simple), 2))
}

/// What a streamed answer says next.
#[derive(Debug, PartialEq)]
pub enum AnswerDelta {
    Text(String),
    Call(CallDelta),
}

/// A streamed answer: a call (`required`, a named function), or with `auto`
/// whichever the model starts to write, text or a call.
#[derive(Debug)]
pub enum AnswerStream {
    /// `auto`, before the answer's first characters say which: what came.
    Undecided(String),
    Text(JsonString),
    Call(CallStream),
}

impl AnswerStream {
    pub fn new(auto: bool) -> AnswerStream {
        match auto {
            true => AnswerStream::Undecided(String::new()),
            false => AnswerStream::Call(CallStream::default()),
        }
    }

    pub fn is_call(&self) -> bool {
        !matches!(self, AnswerStream::Text(_))
    }

    pub fn push(&mut self, piece: &str) -> Vec<AnswerDelta> {
        if let AnswerStream::Undecided(seen) = self {
            seen.push_str(piece);
            let seen = std::mem::take(seen);
            if let Some(rest) = seen.strip_prefix(RESPONSE_PREFIX) {
                let mut text = JsonString::default();
                let out = text.push(rest);
                *self = AnswerStream::Text(text);
                return texts(out);
            }
            if seen.starts_with(CALL_PREFIX) || !RESPONSE_PREFIX.starts_with(seen.as_str()) {
                let mut call = CallStream::default();
                let out = call.push(&seen);
                *self = AnswerStream::Call(call);
                return out.into_iter().map(AnswerDelta::Call).collect();
            }
            *self = AnswerStream::Undecided(seen);
            return Vec::new();
        }
        match self {
            AnswerStream::Text(t) => texts(t.push(piece)),
            AnswerStream::Call(c) => c.push(piece).into_iter().map(AnswerDelta::Call).collect(),
            AnswerStream::Undecided(_) => unreachable!("decided above"),
        }
    }

    /// At the end (`complete`: the answer was not cut short).
    pub fn finish(&mut self, complete: bool) -> Vec<AnswerDelta> {
        if let AnswerStream::Undecided(seen) = self {
            // Too short to tell: a call's beginning, cut.
            let seen = std::mem::take(seen);
            let mut call = CallStream::default();
            call.push(&seen);
            *self = AnswerStream::Call(call);
        }
        match self {
            AnswerStream::Text(_) => Vec::new(),
            AnswerStream::Call(c) => c
                .finish(complete)
                .into_iter()
                .map(AnswerDelta::Call)
                .collect(),
            AnswerStream::Undecided(_) => unreachable!("decided above"),
        }
    }
}

fn texts(s: String) -> Vec<AnswerDelta> {
    match s.is_empty() {
        true => Vec::new(),
        false => vec![AnswerDelta::Text(s)],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_json(v: Value) -> Result<Tools, String> {
        let Value::Object(m) = v else { panic!() };
        parse(&m).map_err(|e| match e {
            ApiError::InvalidRequest { param, .. } => param.unwrap_or_default(),
            other => panic!("{other:?}"),
        })
    }

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    }

    #[test]
    fn choices_are_parsed() {
        let t = parse_json(json!({"tools": [weather()], "tool_choice": "required"})).unwrap();
        assert_eq!(t.choice, Choice::Required);
        assert!(t.calls());
        let t = parse_json(json!({"tools": [weather()], "tool_choice":
            {"type": "function", "function": {"name": "get_weather"}}}))
        .unwrap();
        assert_eq!(t.choice, Choice::Named("get_weather".into()));
        let t = parse_json(json!({"tools": [weather()], "tool_choice": "none"})).unwrap();
        assert!(!t.calls());
        assert_eq!(parse_json(json!({})).unwrap(), Tools::none());
        assert_eq!(
            parse_json(json!({"tools": [weather()]})).unwrap().choice,
            Choice::Auto
        );
        let auto = parse_json(json!({"tools": [weather()], "tool_choice": "auto"})).unwrap();
        assert!(auto.is_auto() && auto.calls());
        assert_eq!(
            auto.call_schema()["anyOf"][1]["required"],
            json!(["response"])
        );
        for bad in [
            json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            json!({"tool_choice": "required"}),
        ] {
            assert_eq!(parse_json(bad), Err("tool_choice".into()));
        }
        assert_eq!(
            parse_json(
                json!({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "required"})
            ),
            Err("tools[0].function.name".into())
        );
        assert_eq!(
            parse_json(json!({"tools": [{"type": "retrieval"}], "tool_choice": "required"})),
            Err("tools[0].type".into())
        );
    }

    #[test]
    fn the_call_schema_pins_the_name_and_the_functions_parameters() {
        let t = parse_json(json!({"tools": [weather()], "tool_choice": "required"})).unwrap();
        let s = t.call_schema();
        assert_eq!(s["properties"]["name"]["const"], "get_weather");
        assert_eq!(s["properties"]["arguments"]["required"], json!(["city"]));
        let two = json!({"type": "function", "function": {"name": "time"}});
        let t = parse_json(json!({"tools": [weather(), two], "tool_choice": "required"})).unwrap();
        assert_eq!(t.call_schema()["anyOf"].as_array().unwrap().len(), 2);
        let t = parse_json(json!({"tools": [weather(), two], "tool_choice":
            {"type": "function", "function": {"name": "time"}}}))
        .unwrap();
        assert_eq!(t.call_schema()["properties"]["name"]["const"], "time");
    }

    #[test]
    fn a_call_is_read_back_whole_or_cut() {
        let text = call_text("get_weather", r#"{"city": "Paris"}"#);
        assert_eq!(
            parse_call(&text),
            Some(("get_weather".into(), r#"{"city": "Paris"}"#.into()))
        );
        assert_eq!(
            parse_call(r#"{"name": "f", "arguments": {"a": "unfinis"#),
            Some(("f".into(), r#"{"a": "unfinis"#.into()))
        );
        assert_eq!(parse_call("hello"), None);
    }

    #[test]
    fn a_streamed_call_announces_its_name_then_streams_its_arguments() {
        let text = call_text("f", r#"{"city": "Zürich"}"#);
        for cut in 1..text.len() {
            if !text.is_char_boundary(cut) {
                continue;
            }
            let mut s = CallStream::default();
            let mut deltas = s.push(&text[..cut]);
            deltas.extend(s.push(&text[cut..]));
            deltas.extend(s.finish(true));
            assert_eq!(deltas[0], CallDelta::Name("f".into()), "cut at {cut}");
            let args: String = deltas[1..]
                .iter()
                .map(|d| match d {
                    CallDelta::Arguments(a) => a.as_str(),
                    CallDelta::Name(_) => panic!("a second name"),
                })
                .collect();
            assert_eq!(args, r#"{"city": "Zürich"}"#, "cut at {cut}");
        }
    }

    #[test]
    fn an_auto_answer_is_text_or_a_call_whole_or_streamed() {
        let text = r#"{"response": "Caf\u00e9 \"ok\"\n\ud83d\ude00 done"}"#;
        assert_eq!(
            parse_answer(text),
            Answer::Text("Café \"ok\"\n😀 done".into())
        );
        assert_eq!(
            parse_answer(r#"{"response": "cut sho"#),
            Answer::Text("cut sho".into())
        );
        let call = call_text("f", r#"{"a": 1}"#);
        assert_eq!(
            parse_answer(&call),
            Answer::Call("f".into(), r#"{"a": 1}"#.into())
        );
        // Streamed in every two pieces: the same text, or the same call.
        for cut in 1..text.len() {
            let mut s = AnswerStream::new(true);
            let mut out = s.push(&text[..cut]);
            out.extend(s.push(&text[cut..]));
            out.extend(s.finish(true));
            assert!(!s.is_call());
            let got: String = out
                .iter()
                .map(|d| match d {
                    AnswerDelta::Text(t) => t.as_str(),
                    AnswerDelta::Call(_) => panic!("a call"),
                })
                .collect();
            assert_eq!(got, "Café \"ok\"\n😀 done", "cut at {cut}");
        }
        for cut in 1..call.len() {
            let mut s = AnswerStream::new(true);
            let mut out = s.push(&call[..cut]);
            out.extend(s.push(&call[cut..]));
            out.extend(s.finish(true));
            assert!(s.is_call());
            assert_eq!(
                out[0],
                AnswerDelta::Call(CallDelta::Name("f".into())),
                "cut at {cut}"
            );
        }
        // Not auto: a call from the first character.
        let mut s = AnswerStream::new(false);
        assert!(s.is_call());
        assert!(s.push("{").is_empty());
    }
}
