//! Any request body: validation gives a request or a 4xx error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::http::validation::{parse, Api};

fuzz_target!(|body: &[u8]| {
    for api in [Api::Chat, Api::Completions] {
        if let Err(e) = parse(api, body) {
            assert!((400..500).contains(&e.status()), "{e:?}");
        }
    }
});
