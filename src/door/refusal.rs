//! The one place a refusal becomes an answer: OpenAI's error body and the
//! spread of the wait it asks for. The door writes its own refusals (framing,
//! deadlines, sizes, a full handler queue, the connection bound) as whole
//! responses from here; `http::error` builds its bodies and waits from here too.

use serde_json::{json, Value};

/// A refusal the door writes itself, before any handler sees the request.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Refusal {
    pub status: u16,
    pub code: &'static str,
    pub message: String,
}

impl Refusal {
    pub fn new(status: u16, code: &'static str, message: impl Into<String>) -> Refusal {
        Refusal {
            status,
            code,
            message: message.into(),
        }
    }

    pub fn bad(message: impl Into<String>) -> Refusal {
        Refusal::new(400, "bad_request", message)
    }

    /// A complete response: `Retry-After` and `retry-after-ms` (spread) when
    /// `retry_after_s` is given, `Connection: close` when `close`.
    pub fn to_bytes(&self, retry_after_s: Option<u64>, close: bool) -> Vec<u8> {
        let kind = match self.status {
            503 => "overloaded_error",
            _ => "invalid_request_error",
        };
        let body = error_body(&self.message, kind, self.code, None).to_string();
        let reason = tiny_http::StatusCode(self.status).default_reason_phrase();
        let mut out = format!(
            "HTTP/1.1 {} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
            self.status,
            body.len()
        );
        if close {
            out.push_str("Connection: close\r\n");
        }
        if let Some(s) = retry_after_s {
            let ms = jittered_wait_ms(s, fastrand::f64());
            let s = retry_after_header_s(ms);
            out.push_str(&format!("Retry-After: {s}\r\nretry-after-ms: {ms}\r\n"));
        }
        out.push_str("\r\n");
        out.push_str(&body);
        out.into_bytes()
    }
}

/// OpenAI's error shape: `{"error": {"message", "type", "code", "param"}}`.
pub fn error_body(message: &str, kind: &str, code: &str, param: Option<&str>) -> Value {
    json!({
        "error": {
            "message": message,
            "type": kind,
            "code": code,
            "param": param,
        }
    })
}

/// The wait a refusal asks for, in milliseconds, spread so that clients
/// refused together do not come back together: `u` (uniform in [0, 1)) picks
/// a point in [0.5, 1.5) × the estimated wait, whose mean is the estimate.
pub fn jittered_wait_ms(retry_after_s: u64, u: f64) -> u64 {
    (retry_after_s as f64 * 1000.0 * (0.5 + u.clamp(0.0, 1.0))).floor() as u64
}

/// `Retry-After` (whole seconds) for a jittered wait: never before it.
pub fn retry_after_header_s(wait_ms: u64) -> u64 {
    wait_ms.div_ceil(1000).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_are_spread_around_the_estimate_and_retry_after_is_never_earlier() {
        assert_eq!(jittered_wait_ms(4, 0.0), 2000);
        assert_eq!(jittered_wait_ms(4, 0.5), 4000);
        assert_eq!(jittered_wait_ms(4, 0.999_999), 5999, "never the whole 1.5x");
        assert_eq!(jittered_wait_ms(1, 0.25), 750);
        assert_eq!(retry_after_header_s(750), 1);
        assert_eq!(retry_after_header_s(1001), 2);
        assert_eq!(retry_after_header_s(2001), 3);
        assert_eq!(retry_after_header_s(6000), 6);
        assert_eq!(retry_after_header_s(0), 1);
    }

    #[test]
    fn refusals_are_complete_responses_that_close() {
        let r = Refusal::new(413, "body_too_large", "over \"1\" byte");
        let text = String::from_utf8(r.to_bytes(Some(2), true)).unwrap();
        assert!(
            text.starts_with("HTTP/1.1 413 Payload Too Large\r\n"),
            "{text}"
        );
        assert!(text.contains("\r\nConnection: close\r\n"));
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.contains(&format!("Content-Length: {}", body.len())));
        let s: u64 = header(head, "Retry-After").parse().unwrap();
        let ms: u64 = header(head, "retry-after-ms").parse().unwrap();
        assert!((1000..3000).contains(&ms), "{ms}");
        assert_eq!(s, retry_after_header_s(ms));
        let v: Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["message"], "over \"1\" byte");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "body_too_large");
        assert!(v["error"]["param"].is_null());
    }

    #[test]
    fn overload_is_typed_as_the_handlers_type_it() {
        let r = Refusal::new(503, "server_busy", "busy");
        let text = String::from_utf8(r.to_bytes(None, false)).unwrap();
        assert!(!text.contains("Connection: close") && !text.contains("Retry-After"));
        let body = text.split_once("\r\n\r\n").unwrap().1;
        let v: Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["type"], "overloaded_error");
    }

    fn header<'a>(head: &'a str, name: &str) -> &'a str {
        head.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .unwrap_or_else(|| panic!("no {name} in {head}"))
    }
}
