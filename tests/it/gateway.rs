//! The inference gateways' model-server protocol (Gateway API Inference
//! Extension, llm-d): the gauges they scrape, under vLLM's names, agree with
//! sluice's own at every scrape; the headers they send have their effect.

use crate::harness::*;
use serde_json::{json, Value};
use sluice_bench::http;
use std::collections::HashMap;
use std::net::{IpAddr, TcpStream};
use std::time::Duration;

/// Each sample of an exposition text by its name (labels dropped), and each
/// family's type.
fn samples(text: &str) -> (HashMap<String, f64>, HashMap<String, String>) {
    let mut values = HashMap::new();
    let mut types = HashMap::new();
    for line in text.lines() {
        if let Some(t) = line.strip_prefix("# TYPE ") {
            let (name, kind) = t.split_once(' ').unwrap();
            types.insert(name.to_string(), kind.to_string());
        } else if !line.starts_with('#') && !line.is_empty() {
            let name_end = line.find(['{', ' ']).unwrap();
            let value = line.rsplit(' ').next().unwrap().parse().unwrap();
            values.entry(line[..name_end].to_string()).or_insert(value);
        }
    }
    (values, types)
}

fn long_stream(srv: &Server) -> TcpStream {
    let body = json!({"prompt": "Once upon a time", "stream": true, "max_tokens": 400,
                      "ignore_eos": true, "temperature": 0});
    send_json(srv.addr, "/v1/completions", &body)
}

#[test]
fn the_protocol_gauges_agree_with_sluices_own_at_every_scrape_under_load() {
    // Two slots and room for two to wait: four streams hold both.
    let srv = Server::start(&[
        "--parallel",
        "2",
        "--queue-depth",
        "4",
        "--mu-prefill",
        "200",
        "--mu-decode",
        "50",
        "--mu-fixed",
    ]);
    let streams: Vec<TcpStream> = (0..4).map(|_| long_stream(&srv)).collect();
    let mut loaded = None;
    wait_until(Duration::from_secs(300), "2 running and 2 waiting", || {
        let text = srv.metrics();
        let (v, _) = samples(&text);
        let busy = v["vllm:num_requests_running"] == 2.0 && v["vllm:num_requests_waiting"] == 2.0;
        if busy {
            loaded = Some(text);
        }
        busy
    });
    let mut scrapes = vec![loaded.unwrap()];
    scrapes.extend((0..20).map(|_| srv.metrics()));
    for text in &scrapes {
        let (v, types) = samples(text);
        assert_eq!(v["vllm:num_requests_waiting"], v["sluice_queue_depth"]);
        assert_eq!(v["vllm:num_requests_running"], v["sluice_sequences_active"]);
        let usage = v["sluice_kv_cells_reserved"] / v["sluice_kv_cells"];
        assert!(
            (v["vllm:kv_cache_usage_perc"] - usage).abs() < 1e-9,
            "{text}"
        );
        assert!((0.0..=1.0).contains(&v["vllm:kv_cache_usage_perc"]));
        for name in [
            "vllm:num_requests_waiting",
            "vllm:num_requests_running",
            "vllm:kv_cache_usage_perc",
            "vllm:cache_config_info",
        ] {
            assert_eq!(types[name], "gauge", "{name}");
        }
    }
    // Under load: what the first scrape saw is real work.
    let (v, _) = samples(&scrapes[0]);
    assert!(v["vllm:kv_cache_usage_perc"] > 0.0);
    // The 8,192 cells requests may reserve, in blocks of 16.
    let info = scrapes[0]
        .lines()
        .find(|l| l.starts_with("vllm:cache_config_info{"))
        .unwrap();
    assert!(
        info.contains("block_size=\"16\"") && info.contains("num_gpu_blocks=\"512\""),
        "{info}"
    );
    assert_eq!(v["sluice_kv_cells"], 8192.0);
    drop(streams);
}

fn chat(prompt: &str, max_tokens: usize) -> Vec<u8> {
    json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens})
        .to_string()
        .into_bytes()
}

/// A chat of exactly 250 tokens (`ignore_eos`), most of a 300-token bucket:
/// an answer that ended early would give its unused tokens back, and a short
/// sampled story once let a second one through.
fn story() -> Vec<u8> {
    json!({
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 250,
        "ignore_eos": true
    })
    .to_string()
    .into_bytes()
}

fn post(srv: &Server, body: &[u8], headers: &[(&str, &str)]) -> Response {
    let mut all = vec![("Content-Type", "application/json")];
    all.extend_from_slice(headers);
    request(srv.addr, "POST", "/v1/chat/completions", Some(body), &all)
}

fn class_admitted(srv: &Server, class: &str) -> f64 {
    let line = format!("sluice_class_requests_total{{class=\"{class}\",outcome=\"admitted\"}} ");
    srv.metrics()
        .lines()
        .find_map(|l| l.strip_prefix(&line))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn a_sheddable_objective_runs_as_batch_and_a_fairness_id_is_its_own_bucket() {
    let srv = Server::start(&[
        "--batch-objectives",
        "bulk, offline",
        // A network (as a gateway's pods are): 127.0.0.0 to 127.0.0.3.
        "--trusted-proxies",
        "127.0.0.0/30",
        "--client-rate",
        "1",
        "--client-burst",
        "300",
    ]);
    let objective = |o: &'static str| [("x-gateway-inference-objective", o)];
    let r = post(&srv, &chat("Hi", 4), &objective("bulk"));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(class_admitted(&srv, "batch"), 1.0);
    let r = post(&srv, &chat("Hi", 4), &objective("chat"));
    assert_eq!(r.status, 200);
    assert_eq!(class_admitted(&srv, "interactive"), 1.0);
    assert_eq!(class_admitted(&srv, "batch"), 1.0);
    assert!(srv.log().contains("class=batch"), "{}", srv.log());

    // The gateway's fairness ids from the trusted proxy: a's bucket runs dry,
    // b's is its own, though both come from the same address.
    let fair = |id: &'static str| [("x-gateway-inference-fairness-id", id)];
    let big = story();
    assert_eq!(post(&srv, &big, &fair("tenant-a")).status, 200);
    let again = post(&srv, &big, &fair("tenant-a"));
    assert_eq!(again.status, 429);
    assert_eq!(again.body_json()["error"]["code"], "rate_limit_exceeded");
    assert_eq!(post(&srv, &big, &fair("tenant-b")).status, 200);
    assert!(
        srv.log().contains("client=fairness:tenant-a"),
        "{}",
        srv.log()
    );
}

#[test]
fn a_fairness_id_from_an_untrusted_peer_is_not_an_identity() {
    let srv = Server::start(&[
        "--client-rate",
        "1",
        "--client-burst",
        "300",
        "--trusted-proxies",
        "127.0.0.0/30",
    ]);
    let big = story();
    // From 127.0.0.9, outside the trusted network.
    let from_outside = |id: &str| {
        let s = http::connect_from(
            srv.addr,
            IpAddr::from([127, 0, 0, 9]),
            Duration::from_secs(60),
        )
        .expect("connect");
        let headers = [
            ("Content-Type", "application/json"),
            ("x-gateway-inference-fairness-id", id),
        ];
        http::request_on(s, "POST", "/v1/chat/completions", Some(&big[..]), &headers)
            .expect("request")
    };
    assert_eq!(from_outside("tenant-a").status, 200);
    // Another id, the same address: the address's bucket, already used.
    assert_eq!(from_outside("tenant-b").status, 429);
}

#[test]
fn an_unmeetable_ttft_slo_is_refused_at_once_429_if_sheddable_503_otherwise() {
    // Rates fixed: 100 prompt tokens a second, so ~700 prompt tokens are
    // forecast at ~7 s, whatever this machine's speed.
    let srv = Server::start(&[
        "--mu-prefill",
        "100",
        "--mu-decode",
        "50",
        "--mu-fixed",
        "--batch-objectives",
        "bulk",
    ]);
    let prompt = long_prompt(50);
    let body = chat(&prompt, 4);
    let accepted = srv.metric("sluice_requests_accepted_total");
    let r = post(&srv, &body, &[("x-slo-ttft-ms", "500")]);
    assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
    let v: Value = r.body_json();
    assert_eq!(v["error"]["code"], "slo_ttft_unmeetable", "{v}");
    assert!(r.header("Retry-After").is_some());
    let r = post(
        &srv,
        &body,
        &[
            ("x-slo-ttft-ms", "500"),
            ("x-gateway-inference-objective", "bulk"),
        ],
    );
    assert_eq!(r.status, 429, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.body_json()["error"]["code"], "slo_ttft_unmeetable");
    // Refused before admission: nothing queued, both counted.
    assert_eq!(srv.metric("sluice_requests_accepted_total"), accepted);
    let refused = srv
        .metrics()
        .lines()
        .find_map(|l| l.strip_prefix("sluice_requests_rejected_total{reason=\"slo_ttft\"} "))
        .unwrap()
        .trim()
        .parse::<f64>()
        .unwrap();
    assert_eq!(refused, 2.0);
    // An objective the forecast meets is served.
    let r = post(&srv, &body, &[("x-slo-ttft-ms", "3600000")]);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let bad = post(&srv, &body, &[("x-slo-ttft-ms", "soon")]);
    assert_eq!(bad.status, 400);
}
