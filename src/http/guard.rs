//! Only the callers it should serve, checked before routing: a `Host` this
//! server answers to (DNS rebinding), an `Origin` allowed to call it (pages of
//! other sites), and CORS for the allowed cross-origin callers (see
//! `config::Callers` for where the lines are drawn).

use super::error::ApiError;
use super::AppState;
use tiny_http::{Header, Method, Request};

/// Headers a cross-origin page may read from a response.
const EXPOSED: &str = "Retry-After, WWW-Authenticate, Content-Type";
/// Methods the API answers.
pub(super) const METHODS: &str = "GET, POST, DELETE, OPTIONS";
/// How long a browser may cache a preflight's answer, in seconds.
const PREFLIGHT_MAX_AGE_S: u32 = 600;

fn header_value<'a>(req: &'a Request, name: &'static str) -> Option<&'a str> {
    req.headers()
        .iter()
        .find(|h| h.field.equiv(name))
        .map(|h| h.value.as_str())
}

fn header(name: &str, value: &str) -> Option<Header> {
    Header::from_bytes(name.as_bytes(), value.as_bytes()).ok()
}

/// Refuses a request from a caller this server should not serve; for an
/// allowed cross-origin caller, adds the CORS headers every response to it
/// carries (and, for a preflight, those the preflight's answer carries).
pub(super) fn admit(state: &AppState, req: &mut Request) -> Result<(), ApiError> {
    let callers = &state.cfg.callers;
    // HTTP/1.1 requests carry exactly one Host (the connection refuses others
    // with 400); an HTTP/1.0 request without one was sent to the bound address.
    let host = header_value(req, "Host").unwrap_or("").to_string();
    if !host.is_empty() && !callers.host_allowed(&host) {
        return Err(ApiError::ForbiddenHost { host });
    }
    let Some(origin) = header_value(req, "Origin").map(str::to_string) else {
        return Ok(());
    };
    if !callers.origin_allowed(&origin, &host) {
        return Err(ApiError::ForbiddenOrigin { origin });
    }
    if !callers.is_cross_origin(&origin, &host) {
        return Ok(());
    }
    let mut add = |name: &str, value: &str| {
        if let Some(h) = header(name, value) {
            req.add_response_header(h);
        }
    };
    add("Access-Control-Allow-Origin", &origin);
    add("Vary", "Origin");
    add("Access-Control-Expose-Headers", EXPOSED);
    if *req.method() == Method::Options
        && header_value(req, "Access-Control-Request-Method").is_some()
    {
        let asked = header_value(req, "Access-Control-Request-Headers")
            .filter(|h| {
                h.split(',').all(|t| {
                    let t = t.trim();
                    !t.is_empty()
                        && t.bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b))
                })
            })
            .map(str::to_string);
        let mut add = |name: &str, value: &str| {
            if let Some(h) = header(name, value) {
                req.add_response_header(h);
            }
        };
        add("Access-Control-Allow-Methods", METHODS);
        if let Some(asked) = asked {
            add("Access-Control-Allow-Headers", &asked);
        }
        add("Access-Control-Max-Age", &PREFLIGHT_MAX_AGE_S.to_string());
    }
    Ok(())
}
