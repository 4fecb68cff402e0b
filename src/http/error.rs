//! Every error a client can get, and the one place that maps it to a status.
//!
//! Errors use OpenAI's shape `{"error": {"message", "type", "code", "param"}}`.
//! `code` is a stable string that also serves as a metrics label; messages name
//! the limit and the value given.

use serde_json::json;

#[derive(Debug, Clone, PartialEq)]
pub enum ApiError {
    /// The body is not JSON, or a field has the wrong type or value.
    InvalidRequest {
        param: Option<String>,
        message: String,
    },
    /// The prompt (plus the tokens asked for) does not fit the context.
    ContextLength {
        message: String,
    },
    BodyTooLarge {
        limit: usize,
        given: Option<usize>,
    },
    UnsupportedMediaType {
        given: String,
    },
    NotFound {
        path: String,
    },
    MethodNotAllowed {
        method: String,
        path: String,
    },
    /// The admission queue is full.
    QueueFull {
        depth: usize,
        retry_after_s: u64,
    },
    /// The engine failed or went away while serving the request.
    Engine {
        message: String,
    },
    /// The request took longer than the server's ceiling.
    Timeout {
        limit_ms: u64,
    },
}

impl ApiError {
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError::InvalidRequest {
            param: Some(param.into()),
            message: message.into(),
        }
    }

    pub fn status(&self) -> u16 {
        match self {
            ApiError::InvalidRequest { .. } | ApiError::ContextLength { .. } => 400,
            ApiError::NotFound { .. } => 404,
            ApiError::MethodNotAllowed { .. } => 405,
            ApiError::BodyTooLarge { .. } => 413,
            ApiError::UnsupportedMediaType { .. } => 415,
            ApiError::QueueFull { .. } => 429,
            ApiError::Engine { .. } => 500,
            ApiError::Timeout { .. } => 504,
        }
    }

    /// Stable identifier; also the `reason` label in metrics.
    pub fn code(&self) -> &'static str {
        match self {
            ApiError::InvalidRequest { .. } => "invalid_request",
            ApiError::ContextLength { .. } => "context_length_exceeded",
            ApiError::BodyTooLarge { .. } => "body_too_large",
            ApiError::UnsupportedMediaType { .. } => "unsupported_media_type",
            ApiError::NotFound { .. } => "not_found",
            ApiError::MethodNotAllowed { .. } => "method_not_allowed",
            ApiError::QueueFull { .. } => "queue_full",
            ApiError::Engine { .. } => "engine_error",
            ApiError::Timeout { .. } => "request_timeout",
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            ApiError::QueueFull { .. } => "overloaded_error",
            ApiError::Engine { .. } | ApiError::Timeout { .. } => "server_error",
            _ => "invalid_request_error",
        }
    }

    pub fn message(&self) -> String {
        match self {
            ApiError::InvalidRequest { message, .. }
            | ApiError::ContextLength { message }
            | ApiError::Engine { message } => message.clone(),
            ApiError::BodyTooLarge { limit, given: Some(n) } => {
                format!("request body has {n} bytes; the limit is {limit}")
            }
            ApiError::BodyTooLarge { limit, given: None } => {
                format!("request body is over the limit of {limit} bytes")
            }
            ApiError::UnsupportedMediaType { given } => {
                format!("Content-Type is '{given}'; send application/json")
            }
            ApiError::NotFound { path } => format!("no route for {path}"),
            ApiError::MethodNotAllowed { method, path } => format!("{method} is not allowed on {path}"),
            ApiError::QueueFull { depth, retry_after_s } => format!(
                "server is at capacity: {depth} requests are already waiting; retry after {retry_after_s} s"
            ),
            ApiError::Timeout { limit_ms } => {
                format!("request took longer than the server's limit of {limit_ms} ms")
            }
        }
    }

    pub fn retry_after_s(&self) -> Option<u64> {
        match self {
            ApiError::QueueFull { retry_after_s, .. } => Some(*retry_after_s),
            _ => None,
        }
    }

    pub fn to_json(&self) -> serde_json::Value {
        let param = match self {
            ApiError::InvalidRequest { param, .. } => param.clone(),
            _ => None,
        };
        json!({
            "error": {
                "message": self.message(),
                "type": self.kind(),
                "code": self.code(),
                "param": param,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_have_openai_shape_and_stable_codes() {
        let e = ApiError::invalid("messages[1].role", "unknown role 'robot'");
        assert_eq!(e.status(), 400);
        let v = e.to_json();
        assert_eq!(v["error"]["code"], "invalid_request");
        assert_eq!(v["error"]["param"], "messages[1].role");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }

    #[test]
    fn queue_full_is_429_with_retry_after() {
        let e = ApiError::QueueFull {
            depth: 8,
            retry_after_s: 2,
        };
        assert_eq!(e.status(), 429);
        assert_eq!(e.retry_after_s(), Some(2));
        assert!(e.message().contains("8 requests"));
    }
}
