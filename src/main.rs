//! sluice: a single-binary, CPU-only server for small language models whose every
//! stage can say no, in time, in the right units. `main` only maps the result of
//! `app::run` to an exit code.

mod admission;
mod app;
mod calibrate;
mod config;
mod engine;
mod http;
mod metrics;
mod notify;
mod prompt;
mod stream;

fn main() {
    match app::run() {
        Ok(()) => {}
        Err(message) => {
            eprintln!("sluice: error: {message}");
            std::process::exit(1);
        }
    }
}
