//! How the answer is shaped beyond its text: `response_format` (structured
//! output) and the logit bias and penalties the sampler applies.

use super::error::ApiError;
use super::fields::{is_name, opt_f32};
use crate::admission::Penalties;
use serde_json::{Map, Value};

/// Most `logit_bias` entries per request.
pub const LOGIT_BIAS_MAX: usize = 1024;
/// What the answer must be (`response_format`).
#[derive(Debug, Clone, PartialEq)]
pub enum Format {
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON valid against `schema`; `strict` refuses keywords that cannot be
    /// enforced.
    JsonSchema {
        schema: Value,
        strict: bool,
    },
}

pub(super) fn parse_format(obj: &Map<String, Value>) -> Result<Format, ApiError> {
    const P: &str = "response_format";
    let rf = match obj.get(P) {
        None | Some(Value::Null) => return Ok(Format::Text),
        Some(Value::Object(rf)) => rf,
        Some(_) => return Err(ApiError::invalid(P, "'response_format' must be an object")),
    };
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(Format::Text),
        Some("json_object") => Ok(Format::JsonObject),
        Some("json_schema") => {
            let Some(Value::Object(js)) = rf.get("json_schema") else {
                return Err(ApiError::invalid(
                    "response_format.json_schema",
                    "'response_format.json_schema' is required with type json_schema: {\"name\": ..., \"schema\": {...}}",
                ));
            };
            match js.get("name") {
                Some(Value::String(n)) if is_name(n) => {}
                _ => {
                    return Err(ApiError::invalid(
                        "response_format.json_schema.name",
                        "'response_format.json_schema.name' is required: 1 to 64 of a-z, A-Z, 0-9, _ and -",
                    ))
                }
            }
            let schema =
                match js.get("schema") {
                    Some(s @ Value::Object(_)) => s.clone(),
                    _ => return Err(ApiError::invalid(
                        "response_format.json_schema.schema",
                        "'response_format.json_schema.schema' must be a JSON schema (an object)",
                    )),
                };
            let strict = match js.get("strict") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(ApiError::invalid(
                        "response_format.json_schema.strict",
                        "'response_format.json_schema.strict' must be true or false",
                    ))
                }
            };
            Ok(Format::JsonSchema { schema, strict })
        }
        _ => Err(ApiError::invalid(
            "response_format.type",
            "'response_format.type' must be text, json_object or json_schema",
        )),
    }
}

pub(super) fn parse_penalties(obj: &Map<String, Value>) -> Result<Penalties, ApiError> {
    let mut logit_bias = Vec::new();
    match obj.get("logit_bias") {
        None | Some(Value::Null) => {}
        Some(Value::Object(m)) => {
            if m.len() > LOGIT_BIAS_MAX {
                return Err(ApiError::invalid(
                    "logit_bias",
                    format!(
                        "'logit_bias' has {} entries; the limit is {LOGIT_BIAS_MAX}",
                        m.len()
                    ),
                ));
            }
            for (key, v) in m {
                let token: i32 = key.parse().ok().filter(|t| *t >= 0).ok_or_else(|| {
                    ApiError::invalid(
                        "logit_bias",
                        format!(
                            "'logit_bias' key '{key}' is not a token id (a non-negative integer)"
                        ),
                    )
                })?;
                let bias = v
                    .as_f64()
                    .filter(|b| (-100.0..=100.0).contains(b))
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "logit_bias",
                            format!("'logit_bias' value for token {token} is {v}; it must be a number from -100 to 100"),
                        )
                    })?;
                // "1" and "01" are the same token: the last one given wins.
                logit_bias.retain(|&(t, _)| t != token);
                logit_bias.push((token, bias as f32));
            }
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "logit_bias",
                "'logit_bias' must be an object mapping token ids to biases",
            ))
        }
    }
    let repetition = match obj.get("repetition_penalty") {
        None | Some(Value::Null) => 1.0,
        Some(Value::Number(n)) if n.as_f64().is_some_and(|r| r > 0.0 && r <= 10.0) => {
            n.as_f64().unwrap_or(1.0) as f32
        }
        Some(v) => {
            return Err(ApiError::invalid(
                "repetition_penalty",
                format!("'repetition_penalty' is {v}; it must be a number above 0 and at most 10 (1 is none)"),
            ))
        }
    };
    Ok(Penalties {
        presence: opt_f32(obj, "presence_penalty", -2.0, 2.0)?.unwrap_or(0.0),
        frequency: opt_f32(obj, "frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0),
        repetition,
        logit_bias,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(text: &str) -> Map<String, Value> {
        match serde_json::from_str(text) {
            Ok(Value::Object(m)) => m,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn response_formats_are_parsed_and_bad_ones_named() {
        let with = |rf: &str| parse_format(&body(&format!(r#"{{"response_format":{rf}}}"#)));
        assert_eq!(with(r#"{"type":"text"}"#).unwrap(), Format::Text);
        assert_eq!(
            with(r#"{"type":"json_object"}"#).unwrap(),
            Format::JsonObject
        );
        assert_eq!(
            with(r#"{"type":"json_schema","json_schema":{"name":"p","strict":true,"schema":{"type":"object"}}}"#)
                .unwrap(),
            Format::JsonSchema {
                schema: serde_json::json!({"type": "object"}),
                strict: true
            }
        );
        for (rf, param) in [
            (r#""json""#, "response_format"),
            (r#"{"type":"yaml"}"#, "response_format.type"),
            (r#"{"type":"json_schema"}"#, "response_format.json_schema"),
            (
                r#"{"type":"json_schema","json_schema":{"schema":{}}}"#,
                "response_format.json_schema.name",
            ),
            (
                r#"{"type":"json_schema","json_schema":{"name":"a b","schema":{}}}"#,
                "response_format.json_schema.name",
            ),
            (
                r#"{"type":"json_schema","json_schema":{"name":"p","schema":true}}"#,
                "response_format.json_schema.schema",
            ),
            (
                r#"{"type":"json_schema","json_schema":{"name":"p","schema":{},"strict":"yes"}}"#,
                "response_format.json_schema.strict",
            ),
        ] {
            match with(rf) {
                Err(ApiError::InvalidRequest { param: Some(p), .. }) => {
                    assert_eq!(p, param, "{rf}")
                }
                other => panic!("{rf}: {other:?}"),
            }
        }
    }

    #[test]
    fn penalties_and_logit_bias_are_parsed_within_their_ranges() {
        let p = parse_penalties(&body(r#"{"presence_penalty":-2,"frequency_penalty":1.5,"repetition_penalty":1.1,"logit_bias":{"7":-100,"3":2.5}}"#)).unwrap();
        assert_eq!(p.presence, -2.0);
        assert_eq!(p.frequency, 1.5);
        assert!((p.repetition - 1.1).abs() < 1e-6);
        let mut bias = p.logit_bias.clone();
        bias.sort_by_key(|&(t, _)| t);
        assert_eq!(bias, vec![(3, 2.5), (7, -100.0)]);
        for (field, param) in [
            (r#""presence_penalty":2.5"#, "presence_penalty"),
            (r#""frequency_penalty":"lots""#, "frequency_penalty"),
            (r#""repetition_penalty":0"#, "repetition_penalty"),
            (r#""logit_bias":{"x":1}"#, "logit_bias"),
            (r#""logit_bias":{"-1":1}"#, "logit_bias"),
            (r#""logit_bias":{"5":101}"#, "logit_bias"),
            (r#""logit_bias":[1]"#, "logit_bias"),
        ] {
            let full = format!(r#"{{{field}}}"#);
            match parse_penalties(&body(&full)) {
                Err(ApiError::InvalidRequest { param: Some(p), .. }) => {
                    assert_eq!(p, param, "{field}")
                }
                other => panic!("{field}: {other:?}"),
            }
        }
    }
}
