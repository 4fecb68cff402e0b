//! What a client sends the Batch API, read and checked: a multipart upload
//! (`POST /v1/files`) and a batch's input file, line by line, before the
//! batch is accepted.
//!
//! Multipart is read here, not by a crate: the body is already in memory
//! (the door read it whole, within its bound), and the maintained multipart
//! crate (`multer`) reads an async stream, which sluice, with no async
//! runtime, has none of; the synchronous ones are unmaintained.

use super::error::ApiError;
use super::validation::{self, Api};
use serde_json::Value;
use std::collections::HashSet;

/// Longest `custom_id` (OpenAI's docs give none; a bound all the same).
pub const CUSTOM_ID_BYTES_MAX: usize = 512;

/// One part of a `multipart/form-data` body.
#[derive(Debug, PartialEq)]
pub struct Part<'a> {
    pub name: String,
    pub filename: Option<String>,
    pub data: &'a [u8],
}

/// The boundary of a `multipart/form-data` Content-Type, or why there is none.
pub fn boundary(content_type: &str) -> Result<String, ApiError> {
    let mut params = content_type.split(';').map(str::trim);
    let kind = params.next().unwrap_or("").to_ascii_lowercase();
    if kind != "multipart/form-data" {
        return Err(ApiError::UnsupportedMediaType {
            given: content_type.to_string(),
        });
    }
    params
        .filter_map(|p| p.split_once('='))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("boundary"))
        .map(|(_, v)| v.trim().trim_matches('"').to_string())
        .filter(|b| !b.is_empty() && b.len() <= 70)
        .ok_or_else(|| ApiError::invalid("Content-Type", "multipart/form-data without a boundary"))
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    (from..=hay.len() - needle.len()).find(|&i| &hay[i..i + needle.len()] == needle)
}

/// The parts of a `multipart/form-data` body (RFC 7578).
pub fn parts<'a>(body: &'a [u8], boundary: &str) -> Result<Vec<Part<'a>>, ApiError> {
    let bad = |why: &str| ApiError::invalid("file", format!("malformed multipart body: {why}"));
    let delim = format!("--{boundary}");
    let next_delim = format!("\r\n--{boundary}");
    let mut at = find(body, delim.as_bytes(), 0).ok_or_else(|| bad("no boundary"))? + delim.len();
    let mut out = Vec::new();
    loop {
        if body[at..].starts_with(b"--") {
            return Ok(out);
        }
        if !body[at..].starts_with(b"\r\n") {
            return Err(bad("a boundary not followed by CRLF"));
        }
        let head_start = at + 2;
        let head_end =
            find(body, b"\r\n\r\n", head_start).ok_or_else(|| bad("a part without headers"))?;
        let head = std::str::from_utf8(&body[head_start..head_end])
            .map_err(|_| bad("part headers not UTF-8"))?;
        let data_start = head_end + 4;
        let data_end = find(body, next_delim.as_bytes(), data_start)
            .ok_or_else(|| bad("no closing boundary"))?;
        let (name, filename) = disposition(head).ok_or_else(|| bad("a part without a name"))?;
        out.push(Part {
            name,
            filename,
            data: &body[data_start..data_end],
        });
        at = data_end + next_delim.len();
    }
}

/// `name` and `filename` of a part's `Content-Disposition: form-data`.
fn disposition(head: &str) -> Option<(String, Option<String>)> {
    let line = head.lines().find(|l| {
        l.split(':')
            .next()
            .is_some_and(|k| k.trim().eq_ignore_ascii_case("content-disposition"))
    })?;
    let value = line.split_once(':')?.1;
    let param = |key: &str| {
        value.split(';').map(str::trim).find_map(|p| {
            let (k, v) = p.split_once('=')?;
            k.trim()
                .eq_ignore_ascii_case(key)
                .then(|| v.trim().trim_matches('"').to_string())
        })
    };
    Some((param("name")?, param("filename")))
}

/// A batch's input file, checked line by line for `endpoint`: each line a
/// JSON object with a unique `custom_id`, `method` POST, `url` the batch's
/// endpoint and a `body` that request validation accepts (not streamed).
/// Returns `(custom_id, body)` per line; the first bad line is named by its
/// number.
pub fn lines(
    content: &[u8],
    endpoint: &str,
    lines_max: usize,
    n_embd: usize,
) -> Result<Vec<(String, String)>, ApiError> {
    let text = std::str::from_utf8(content)
        .map_err(|_| ApiError::invalid("input_file_id", "the input file is not UTF-8 text"))?;
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let n = i + 1;
        if raw.trim().is_empty() {
            continue;
        }
        if out.len() == lines_max {
            return Err(too_many_lines(lines_max));
        }
        let at = |msg: String| ApiError::invalid(format!("line {n}"), format!("line {n}: {msg}"));
        let (custom_id, body) = line(raw, endpoint, n_embd).map_err(at)?;
        if !seen.insert(custom_id.clone()) {
            return Err(at(format!("custom_id '{custom_id}' is used twice")));
        }
        out.push((custom_id, body));
    }
    if out.is_empty() {
        return Err(ApiError::invalid(
            "input_file_id",
            "the input file has no lines",
        ));
    }
    Ok(out)
}

pub fn too_many_lines(lines_max: usize) -> ApiError {
    ApiError::Batch {
        status: 413,
        code: "too_many_lines",
        message: format!(
            "the input file has more than {lines_max} lines, the most a batch takes (--batch-lines-max)"
        ),
    }
}

/// One line: its `custom_id` and its body's JSON text, or what is wrong.
fn line(raw: &str, endpoint: &str, n_embd: usize) -> Result<(String, String), String> {
    let v: Value = serde_json::from_str(raw).map_err(|e| format!("not JSON: {e}"))?;
    let obj = v.as_object().ok_or("not a JSON object")?;
    let custom_id = obj
        .get("custom_id")
        .and_then(Value::as_str)
        .filter(|c| !c.is_empty() && c.len() <= CUSTOM_ID_BYTES_MAX)
        .ok_or(format!(
            "custom_id must be a string of 1 to {CUSTOM_ID_BYTES_MAX} bytes"
        ))?;
    if obj.get("method").and_then(Value::as_str) != Some("POST") {
        return Err("method must be \"POST\"".into());
    }
    let url = obj.get("url").and_then(Value::as_str).unwrap_or("");
    if url != endpoint {
        return Err(format!(
            "url is '{url}'; this batch's endpoint is {endpoint}"
        ));
    }
    if let Some(k) = obj
        .keys()
        .find(|k| !["custom_id", "method", "url", "body"].contains(&k.as_str()))
    {
        return Err(format!("unknown field '{k}'"));
    }
    let body = obj
        .get("body")
        .filter(|b| b.is_object())
        .ok_or("body must be a JSON object")?;
    if body.get("stream").and_then(Value::as_bool) == Some(true) {
        return Err("body.stream: a batch line is answered whole, not streamed".into());
    }
    let text = body.to_string();
    let checked = match endpoint {
        "/v1/chat/completions" => validation::parse(Api::Chat, text.as_bytes()).map(drop),
        "/v1/completions" => validation::parse(Api::Completions, text.as_bytes()).map(drop),
        _ => super::embeddings::parse(text.as_bytes(), n_embd).map(drop),
    };
    checked.map_err(|e| format!("body: {}", e.message()))?;
    Ok((custom_id.to_string(), text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multipart_parts_come_back_with_names_and_data() {
        let body = b"--XyZ\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n\
--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n\
Content-Type: application/octet-stream\r\n\r\nline one\r\nline two\n\r\n--XyZ--\r\n";
        let b = boundary("multipart/form-data; boundary=XyZ").unwrap();
        let p = parts(body, &b).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!((p[0].name.as_str(), p[0].data), ("purpose", &b"batch"[..]));
        assert_eq!(p[1].filename.as_deref(), Some("in.jsonl"));
        assert_eq!(p[1].data, b"line one\r\nline two\n");
        assert!(parts(b"--XyZ\r\nno end", "XyZ").is_err());
        assert!(boundary("application/json").is_err());
    }

    #[test]
    fn input_lines_are_checked_and_a_bad_one_is_named_by_number() {
        let ok = r#"{"custom_id":"a","method":"POST","url":"/v1/chat/completions","body":{"messages":[{"role":"user","content":"hi"}],"max_tokens":4}}"#;
        let file = format!("{ok}\n\n{}\n", ok.replace("\"a\"", "\"b\""));
        let l = lines(file.as_bytes(), "/v1/chat/completions", 10, 576).unwrap();
        assert_eq!(l.len(), 2);
        assert_eq!(l[1].0, "b");
        let twice = format!("{ok}\n{ok}\n");
        let e = lines(twice.as_bytes(), "/v1/chat/completions", 10, 576).unwrap_err();
        assert!(
            e.message()
                .starts_with("line 2: custom_id 'a' is used twice"),
            "{}",
            e.message()
        );
        let bad = format!(
            "{ok}\n{}\n",
            ok.replace("\"max_tokens\":4", "\"max_tokens\":-4")
        );
        let e = lines(bad.as_bytes(), "/v1/chat/completions", 10, 576).unwrap_err();
        assert!(e.message().starts_with("line 2: body:"), "{}", e.message());
        let wrong_url = lines(ok.as_bytes(), "/v1/completions", 10, 576).unwrap_err();
        assert!(wrong_url.message().starts_with("line 1: url"));
        let many = format!("{ok}\n{}\n", ok.replace("\"a\"", "\"b\""));
        assert_eq!(
            lines(many.as_bytes(), "/v1/chat/completions", 1, 576)
                .unwrap_err()
                .code(),
            "too_many_lines"
        );
    }
}
