//! sluice: a single-binary, CPU-only server for small language models whose every
//! stage can say no, in time, in the right units. `main` only maps the result of
//! `app::run` to an exit code.

#![forbid(unsafe_code)]

fn main() {
    match sluice::app::run() {
        Ok(()) => {}
        Err(message) => {
            sluice::say!("sluice: error: {message}");
            std::process::exit(1);
        }
    }
}
