//! sluice-bench: load harness for sluice and any OpenAI-compatible server.
//!
//! The library holds what the binary and sluice's integration tests share: a
//! raw-socket HTTP/SSE client that can read a stream event by event.

pub mod http;
