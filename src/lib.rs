//! sluice's code as a library: the binary (`main.rs`) only runs `app::run`;
//! the fuzz target (`fuzz/`) reaches request validation through `http`;
//! `log` is public for `say!`, which the binary uses too. Only `ffi` may
//! hold `unsafe` code.

#![deny(unsafe_code)]

/// Writes one line to stderr (text, or a JSON object with `--log-format
/// json`; see `log`), and never panics: `eprintln!` panics when stderr is
/// gone (a closed pipe), which would take a handler with it.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        $crate::log::line(format_args!($($arg)*));
    }};
}

mod admission;
pub mod app;
mod auth;
mod batch;
mod calibrate;
mod calibration_cache;
mod config;
mod cpu;
mod door;
mod embed;
mod engine;
#[allow(unsafe_code)]
mod ffi;
mod grammar;
pub mod http;
pub mod log;
mod metrics;
mod notify;
mod priority;
mod ratelimit;
mod startup;
mod stream;
mod template;
