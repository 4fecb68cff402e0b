//! Every error a client can get, and the one place that maps it to a status.
//!
//! Errors use OpenAI's shape `{"error": {"message", "type", "code", "param"}}`,
//! built by `door::refusal`, which the door's own refusals share, as they
//! share its spread of the wait.
//! `code` is a stable string that also serves as a metrics label; messages name
//! the limit and the value given.

use crate::admission::{QueueBound, QueueFull, Refused};
use crate::door::refusal::{self, jittered_wait_ms};
use crate::priority::Class;
use crate::stream::ShedReason;
use serde_json::json;

/// What a client refused during a drain is told to wait: a restart, or a load
/// balancer's next health check, is seconds away.
pub const DRAIN_RETRY_AFTER_S: u64 = 5;

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
    /// The request's `Host` is not one this server answers to (DNS rebinding).
    ForbiddenHost {
        host: String,
    },
    /// The request comes from a browser page of an origin not allowed to call.
    ForbiddenOrigin {
        origin: String,
    },
    MethodNotAllowed {
        method: String,
        path: String,
    },
    /// Admitting the request would break a queue bound.
    QueueFull(QueueFull),
    /// The client came back before the Retry-After it was given: it is told
    /// a longer wait (`http::retry`).
    RetriedEarly {
        wait_ms: u64,
    },
    /// The client's token bucket holds less work than the request costs: a rate
    /// limit on this client, not overload of the server (`rate_limit_exceeded`;
    /// overload is `queue_full`, `queue_token_budget` or a 503).
    RateLimited {
        /// Tokens of work the request costs (prompt + max_tokens).
        cost: u64,
        /// Tokens of work the client's bucket holds now.
        available: u64,
        burst: u64,
        rate_tok_s: f64,
        /// `None` when the request costs more than the bucket ever holds: no
        /// wait helps.
        retry_after_s: Option<u64>,
    },
    /// `--api-key-file` is set and the request carries no key, or an unknown one.
    Unauthorized {
        missing: bool,
    },
    /// Shed at dequeue: the queue stood above its sojourn target (CoDel), or the
    /// request could no longer get its first token within W_max.
    Shed {
        reason: ShedReason,
        message: String,
        retry_after_s: u64,
    },
    /// A gateway's TTFT objective (`x-slo-ttft-ms`) the first token's forecast
    /// is past: refused at once, so the gateway can send it elsewhere (429
    /// for a sheddable request, 503 otherwise, as the inference gateways
    /// expect).
    SloUnmeetable {
        class: Class,
        slo_ms: u64,
        forecast_ms: u64,
        retry_after_s: u64,
    },
    /// The caller's deadline passed before the request could start; it never ran.
    DeadlineExceeded {
        message: String,
    },
    /// The engine failed or went away while serving the request.
    Engine {
        message: String,
    },
    /// The request took longer than the server's ceiling.
    Timeout {
        limit_ms: u64,
    },
    /// The client read nothing of its stream for the stall timeout; the
    /// request was cancelled.
    Stalled {
        limit_ms: u64,
    },
    /// The client closed its connection before the answer; nobody reads this
    /// error (it names the outcome in the log).
    ClientGone,
    /// The server is draining: it takes no new requests.
    Draining,
    /// The drain's deadline passed before this request finished; it was cancelled.
    ShuttingDown,
    /// The Batch API's refusals: a file or batch not found (404), a bound of
    /// the store (413, 429), the store failing (500), or off (404); `code`
    /// names which.
    Batch {
        status: u16,
        code: &'static str,
        message: String,
    },
}

impl From<Refused> for ApiError {
    fn from(r: Refused) -> ApiError {
        match r {
            Refused::QueueFull(q) => ApiError::QueueFull(q),
            Refused::EngineStopped => ApiError::Engine {
                message: "the engine is not taking requests".into(),
            },
        }
    }
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
            ApiError::ForbiddenHost { .. } | ApiError::ForbiddenOrigin { .. } => 403,
            ApiError::MethodNotAllowed { .. } => 405,
            ApiError::BodyTooLarge { .. } => 413,
            ApiError::UnsupportedMediaType { .. } => 415,
            ApiError::QueueFull(_)
            | ApiError::RetriedEarly { .. }
            | ApiError::RateLimited { .. } => 429,
            ApiError::Unauthorized { .. } => 401,
            ApiError::Engine { .. } => 500,
            ApiError::Shed { .. } => 503,
            ApiError::SloUnmeetable {
                class: Class::Batch,
                ..
            } => 429,
            ApiError::SloUnmeetable { .. } => 503,
            ApiError::DeadlineExceeded { .. } => 504,
            ApiError::Timeout { .. } | ApiError::Stalled { .. } => 504,
            ApiError::Draining | ApiError::ShuttingDown => 503,
            ApiError::Batch { status, .. } => *status,
            // nginx's "client closed request": never sent, only logged.
            ApiError::ClientGone => 499,
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
            ApiError::ForbiddenHost { .. } => "forbidden_host",
            ApiError::ForbiddenOrigin { .. } => "forbidden_origin",
            ApiError::MethodNotAllowed { .. } => "method_not_allowed",
            ApiError::QueueFull(QueueFull {
                bound: QueueBound::Requests,
                ..
            }) => "queue_full",
            ApiError::QueueFull(QueueFull {
                bound: QueueBound::Tokens,
                ..
            }) => "queue_token_budget",
            ApiError::RateLimited { .. } => "rate_limit_exceeded",
            ApiError::RetriedEarly { .. } => "retried_too_soon",
            ApiError::Unauthorized { .. } => "invalid_api_key",
            ApiError::Engine { .. } => "engine_error",
            ApiError::Shed { reason, .. } => reason.as_str(),
            ApiError::DeadlineExceeded { .. } => "deadline_exceeded",
            ApiError::SloUnmeetable { .. } => "slo_ttft_unmeetable",
            ApiError::Timeout { .. } => "request_timeout",
            ApiError::Stalled { .. } => "stream_stalled",
            ApiError::ClientGone => "client_gone",
            ApiError::Draining => "draining",
            ApiError::ShuttingDown => "shutting_down",
            ApiError::Batch { code, .. } => code,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            ApiError::QueueFull(_)
            | ApiError::RetriedEarly { .. }
            | ApiError::Shed { .. }
            | ApiError::SloUnmeetable { .. }
            | ApiError::Draining
            | ApiError::ShuttingDown => "overloaded_error",
            ApiError::Engine { .. }
            | ApiError::Timeout { .. }
            | ApiError::Stalled { .. }
            | ApiError::ClientGone
            | ApiError::DeadlineExceeded { .. } => "server_error",
            ApiError::RateLimited { .. } => "rate_limit_error",
            ApiError::Unauthorized { .. } => "authentication_error",
            ApiError::Batch { status: 500.., .. } => "server_error",
            _ => "invalid_request_error",
        }
    }

    pub fn message(&self) -> String {
        match self {
            ApiError::InvalidRequest { message, .. }
            | ApiError::ContextLength { message }
            | ApiError::Engine { message }
            | ApiError::Shed { message, .. }
            | ApiError::DeadlineExceeded { message }
            | ApiError::Batch { message, .. } => message.clone(),
            ApiError::RetriedEarly { wait_ms } => format!(
                "server is at capacity, and this client came back before the Retry-After it was \
                 given; each early retry doubles the wait: retry after {wait_ms} ms"
            ),
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
            ApiError::ForbiddenHost { host } => format!(
                "Host '{host}' is not a name this server answers to; add it with --allowed-hosts"
            ),
            ApiError::ForbiddenOrigin { origin } => format!(
                "pages of origin '{origin}' may not call this server; allow it with --allowed-origins"
            ),
            ApiError::MethodNotAllowed { method, path } => format!("{method} is not allowed on {path}"),
            ApiError::QueueFull(QueueFull {
                bound: QueueBound::Requests,
                class,
                queued,
                queue_depth_max,
                retry_after_s,
                ..
            }) => format!(
                "server is at capacity: {queued} requests are waiting ahead of this {} request, the most \
                 this server queues (its {} queue depth is {queue_depth_max}); estimated wait \
                 {retry_after_s} s, retry after that",
                class.as_str(),
                class.as_str()
            ),
            ApiError::RateLimited {
                cost,
                available,
                burst,
                rate_tok_s,
                retry_after_s: Some(s),
            } => format!(
                "rate limit for this client: the request costs {cost} tokens of work (prompt + max_tokens) \
                 and this client's bucket holds {available} (it holds at most {burst} and refills at \
                 {rate_tok_s} tokens/s); retry after {s} s. This is a per-client limit, not server overload"
            ),
            ApiError::RateLimited {
                cost,
                burst,
                ..
            } => format!(
                "rate limit for this client: the request costs {cost} tokens of work (prompt + max_tokens), \
                 more than this client's bucket ever holds ({burst}); lower max_tokens or shorten the prompt"
            ),
            ApiError::Unauthorized { missing: true } => {
                "this server requires an API key: send 'Authorization: Bearer <key>'".into()
            }
            ApiError::Unauthorized { missing: false } => "the API key is not valid".into(),
            ApiError::QueueFull(QueueFull {
                bound: QueueBound::Tokens,
                queued_tokens,
                queued_tokens_max,
                retry_after_s,
                ..
            }) => format!(
                "server is at capacity: {queued_tokens} prompt tokens are waiting, more than this server \
                 lets a request wait behind (its queued-token budget is {queued_tokens_max}); estimated \
                 wait {retry_after_s} s, retry after that"
            ),
            ApiError::Timeout { limit_ms } => {
                format!("request took longer than the server's limit of {limit_ms} ms")
            }
            ApiError::Stalled { limit_ms } => format!(
                "the client read nothing of this stream for {limit_ms} ms (the stall timeout); generation was cancelled"
            ),
            ApiError::ClientGone => "the client closed the connection".into(),
            ApiError::SloUnmeetable { .. } => self.slo_message(),
            ApiError::Draining => {
                "the server is shutting down and takes no new requests; retry on another replica, or after it restarts".into()
            }
            ApiError::ShuttingDown => {
                "the server shut down before this request finished; it was cancelled".into()
            }
        }
    }

    fn slo_message(&self) -> String {
        let ApiError::SloUnmeetable {
            class,
            slo_ms,
            forecast_ms,
            ..
        } = self
        else {
            return String::new();
        };
        format!(
            "this {} request's first token is forecast in {forecast_ms} ms, past its \
             x-slo-ttft-ms of {slo_ms} ms: refused before it queued; send it to another replica",
            class.as_str()
        )
    }

    pub fn retry_after_s(&self) -> Option<u64> {
        match self {
            ApiError::QueueFull(QueueFull { retry_after_s, .. })
            | ApiError::Shed { retry_after_s, .. }
            | ApiError::SloUnmeetable { retry_after_s, .. } => Some(*retry_after_s),
            ApiError::RateLimited { retry_after_s, .. } => *retry_after_s,
            ApiError::RetriedEarly { wait_ms } => Some(wait_ms.div_ceil(1000).max(1)),
            ApiError::Draining | ApiError::ShuttingDown => Some(DRAIN_RETRY_AFTER_S),
            _ => None,
        }
    }

    /// `x-should-retry`, which the OpenAI SDKs read before their own rules
    /// (they retry 408, 409, 429 and 5xx): `false` where no retry can help,
    /// `true` where the server says when to come back.
    pub fn should_retry(&self) -> Option<bool> {
        match self {
            // More than the client's whole bucket, or the caller's own time
            // already gone: a retry is refused the same way, or later still.
            ApiError::RateLimited {
                retry_after_s: None,
                ..
            }
            | ApiError::DeadlineExceeded { .. }
            | ApiError::Timeout { .. } => Some(false),
            _ if self.retry_after_s().is_some() => Some(true),
            _ => None,
        }
    }

    pub fn to_json(&self) -> serde_json::Value {
        let param = match self {
            ApiError::InvalidRequest { param, .. } => param.clone(),
            _ => None,
        };
        let mut v =
            refusal::error_body(&self.message(), self.kind(), self.code(), param.as_deref());
        if let ApiError::RateLimited {
            cost,
            available,
            burst,
            rate_tok_s,
            retry_after_s,
        } = self
        {
            v["error"]["rate_limit"] = json!({
                "cost_tokens": cost, "available_tokens": available,
                "burst_tokens": burst, "refill_tokens_per_second": rate_tok_s,
                "retry_after_s": retry_after_s,
            });
        }
        if let ApiError::QueueFull(QueueFull {
            class,
            queued,
            queue_depth_max,
            queued_tokens,
            queued_tokens_max,
            retry_after_s,
            ..
        }) = self
        {
            v["error"]["queue"] = json!({
                "class": class.as_str(),
                "depth": queued, "depth_max": queue_depth_max,
                "prompt_tokens": queued_tokens, "prompt_tokens_max": queued_tokens_max,
                "estimated_wait_s": retry_after_s,
            });
        }
        v
    }
}

impl ApiError {
    /// The wait a refusal asks for, in milliseconds (`retry-after-ms`), with
    /// `u` uniform in [0, 1): a full queue's is the place it reserved
    /// (`QueueGauge::promise`), spread by ±10 % so that it keeps its order;
    /// any other is spread over 0.5-1.5 × its estimate (`jittered_wait_ms`).
    pub fn wait_ms(&self, u: f64) -> Option<u64> {
        match self {
            ApiError::QueueFull(q) => {
                Some((q.retry_after_ms as f64 * (0.9 + 0.2 * u.clamp(0.0, 1.0))).floor() as u64)
            }
            // The wait the ledger keeps: not spread, so that it is kept.
            ApiError::RetriedEarly { wait_ms } => Some(*wait_ms),
            _ => self.retry_after_s().map(|s| jittered_wait_ms(s, u)),
        }
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
        let e = ApiError::QueueFull(QueueFull {
            bound: QueueBound::Requests,
            class: Class::Interactive,
            queued: 4,
            queue_depth_max: 4,
            queued_tokens: 300,
            queued_tokens_max: 1000,
            retry_after_ms: 5_400,
            retry_after_s: 6,
        });
        assert_eq!(e.status(), 429);
        assert_eq!(e.retry_after_s(), Some(6));
        assert!(
            e.message().contains("4 requests are waiting"),
            "{}",
            e.message()
        );
        let v = e.to_json();
        assert_eq!(v["error"]["code"], "queue_full");
        assert_eq!(v["error"]["queue"]["estimated_wait_s"], 6);
        let t = ApiError::QueueFull(QueueFull {
            bound: QueueBound::Tokens,
            class: Class::Batch,
            queued: 1,
            queue_depth_max: 4,
            queued_tokens: 1200,
            queued_tokens_max: 1000,
            retry_after_ms: 5_000,
            retry_after_s: 5,
        });
        assert_eq!(t.code(), "queue_token_budget");
        assert!(t.message().contains("budget is 1000"), "{}", t.message());
    }

    #[test]
    fn a_rate_limit_is_told_apart_from_overload() {
        let e = ApiError::RateLimited {
            cost: 300,
            available: 40,
            burst: 400,
            rate_tok_s: 20.0,
            retry_after_s: Some(13),
        };
        assert_eq!(e.status(), 429);
        assert_eq!(e.retry_after_s(), Some(13));
        let v = e.to_json();
        assert_eq!(v["error"]["code"], "rate_limit_exceeded");
        assert_eq!(v["error"]["type"], "rate_limit_error");
        assert_eq!(v["error"]["rate_limit"]["cost_tokens"], 300);
        assert!(
            e.message().contains("not server overload"),
            "{}",
            e.message()
        );
        let never = ApiError::RateLimited {
            cost: 900,
            available: 400,
            burst: 400,
            rate_tok_s: 20.0,
            retry_after_s: None,
        };
        assert_eq!(never.retry_after_s(), None, "no wait helps");
        let overload = ApiError::QueueFull(QueueFull {
            bound: QueueBound::Requests,
            class: Class::Batch,
            queued: 4,
            queue_depth_max: 4,
            queued_tokens: 0,
            queued_tokens_max: 1000,
            retry_after_ms: 6_000,
            retry_after_s: 6,
        });
        assert_ne!(overload.code(), e.code());
        assert_eq!(overload.to_json()["error"]["type"], "overloaded_error");
        assert_eq!(overload.to_json()["error"]["queue"]["class"], "batch");
        let u = ApiError::Unauthorized { missing: true };
        assert_eq!((u.status(), u.code()), (401, "invalid_api_key"));
    }
}
