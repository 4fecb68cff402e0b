//! sluice patch: tiny_http's HTTP messages (`Request`, `Response`, headers,
//! methods, status codes) without its server: sluice's own front door
//! (`src/front/` in sluice) accepts, reads and frames connections and builds
//! each `Request` with `Request::from_parts`. See SLUICE-PATCH.md.
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]
#![allow(clippy::match_like_matches_macro)]

pub use common::{HTTPVersion, Header, HeaderField, Method, StatusCode};
pub use request::{ReadWrite, Request};
pub use response::{Response, ResponseBox};
pub use request::Completion;

mod common;
mod request;
mod response;
mod util;
