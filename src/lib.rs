//! sluice's code as a library: the binary (`main.rs`) only runs `app::run`;
//! the fuzz target (`fuzz/`) reaches request validation through `http`.

mod admission;
pub mod app;
mod auth;
mod calibrate;
mod config;
mod engine;
mod ffi;
pub mod http;
mod metrics;
mod notify;
mod priority;
mod ratelimit;
mod stream;
