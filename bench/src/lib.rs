//! sluice-bench: load harness for sluice and any OpenAI-compatible server.
//!
//! The binary (`main.rs`) is the command line; everything else is here so that
//! sluice's integration tests can share the HTTP/SSE client.
//!
//! - `http`: raw-socket HTTP/1.1 client with Server-Sent Events.
//! - `arrivals`: seeded RNG and Poisson arrival schedules.
//! - `workload`: request mix (prompt and answer lengths, long prompts, slow readers,
//!   disconnecting clients, timeouts, retries).
//! - `client`: one simulated client.
//! - `hol`: the head-of-line figure (streams running while a long prompt arrives).
//! - `conversation`: a multi-turn chat that re-sends its history every turn.
//! - `runner`: open and closed loops, progress, target sampling, `/metrics` deltas.
//! - `stats`: outcomes, latency histograms, goodput.
//! - `steal`: the host's steal time from the box's CPUs (`/proc/stat`), sampled during `hol`.
//! - `plot`: the sweep's SVG.

pub mod arrivals;
pub mod client;
pub mod conversation;
pub mod hol;
pub mod http;
pub mod plot;
pub mod runner;
pub mod stats;
pub mod steal;
pub mod workload;
