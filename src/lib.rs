//! sluice's code as a library: the binary (`main.rs`) only runs `app::run`;
//! the fuzz target (`fuzz/`) reaches request validation through `http`.

/// Writes one line to stderr, and never panics: `eprintln!` panics when
/// stderr is gone (a closed pipe), which would take a handler with it.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod admission;
pub mod app;
mod auth;
mod calibrate;
mod config;
mod embed;
mod engine;
mod ffi;
mod grammar;
pub mod http;
mod metrics;
mod notify;
mod priority;
mod ratelimit;
mod stream;
mod template;
