//! Property-based tests: no body, however malformed, panics validation or
//! gets through without its limits holding. A crash any of them finds becomes
//! a named regression test in `validation.rs`.

use super::*;
use proptest::prelude::*;
use serde_json::{json, Value};

/// Cases per property: bounded, so that CI stays fast.
const CASES: u32 = 2_000;

/// Arbitrary JSON values, a few levels deep.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        ".{0,40}".prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::from),
            prop::collection::btree_map(".{0,12}", inner, 0..8)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A request object whose known fields take arbitrary values.
fn request_like() -> impl Strategy<Value = Value> {
    let keys = prop::sample::select(vec![
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "logprobs",
        "top_logprobs",
        "echo",
        "n",
        "ignore_eos",
        "model",
    ]);
    prop::collection::btree_map(keys, json_value(), 0..10)
        .prop_map(|m| Value::Object(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect()))
}

fn check(api: Api, body: &[u8]) {
    match parse(api, body) {
        Ok(v) => {
            assert!(v.stop.len() <= 16);
            assert!(v.temperature.is_finite() && v.temperature >= 0.0);
            assert!(v.max_tokens.is_none_or(|n| n <= MAX_TOKENS_CEILING));
        }
        Err(e) => {
            assert!((400..500).contains(&e.status()), "{e:?}");
            assert!(!e.message().is_empty());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn arbitrary_bytes_get_a_request_or_a_4xx(body in prop::collection::vec(any::<u8>(), 0..512)) {
        check(Api::Chat, &body);
        check(Api::Completions, &body);
    }

    #[test]
    fn arbitrary_json_gets_a_request_or_a_4xx(v in json_value()) {
        let body = v.to_string();
        check(Api::Chat, body.as_bytes());
        check(Api::Completions, body.as_bytes());
    }

    #[test]
    fn arbitrary_values_of_known_fields_get_a_request_or_a_4xx(v in request_like()) {
        let body = v.to_string();
        check(Api::Chat, body.as_bytes());
        check(Api::Completions, body.as_bytes());
    }
}
