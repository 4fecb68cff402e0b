//! What an operator sees: `/metrics` as Prometheus parses it, the shipped
//! alert rules and their unit tests, the Grafana dashboard's queries, the
//! status page in a real browser, request ids in headers, bodies and logs.

use crate::harness::*;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

fn repo(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// Runs a tool the test set-up installs (`deploy/install-deps --for-tests`).
fn run(program: &str, args: &[&str], stdin: Option<&str>) -> (bool, String) {
    use std::io::Write as _;
    let mut child = Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{program}: {e} (deploy/install-deps --for-tests installs it)"));
    if let Some(text) = stdin {
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(text.as_bytes())
            .expect("write stdin");
    }
    drop(child.stdin.take());
    let out = child.wait_with_output().expect("wait");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn chat_body(max_tokens: usize) -> Value {
    json!({"messages": [{"role": "user", "content": "Tell me about the sea."}],
           "max_tokens": max_tokens, "ignore_eos": true, "temperature": 0})
}

#[test]
fn live_metrics_pass_promtool_and_latencies_are_histograms() {
    let srv = Server::start(&[]);
    assert_eq!(srv.post("/v1/chat/completions", &chat_body(4)).status, 200);
    assert_eq!(srv.post("/v1/chat/completions", &json!({})).status, 400);
    let text = srv.metrics();
    let (_, out) = run("promtool", &["check", "metrics"], Some(&text));
    // The gateway protocol's gauges carry vLLM's names, colon and all (what
    // the gateways read): valid exposition, which only the linter's naming
    // advice objects to. Nothing else may draw a word from it.
    let protocol = [
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
    ];
    let complaints: Vec<&str> = out
        .lines()
        .filter(|l| {
            !protocol
                .iter()
                .any(|p| *l == format!("{p} metric names should not contain ':'"))
        })
        .collect();
    let colons = out.lines().count() - complaints.len();
    assert!(
        complaints.iter().all(|l| l.trim().is_empty()) && colons == protocol.len(),
        "promtool check metrics:\n{out}"
    );
    // A linter that says nothing about broken text would prove nothing.
    let (ok, _) = run(
        "promtool",
        &["check", "metrics"],
        Some("# TYPE x_total counter\nx_total{a=\"1\" 1\n"),
    );
    assert!(!ok, "promtool accepted broken exposition text");
    for name in [
        "sluice_time_to_first_token_seconds",
        "sluice_inter_token_seconds",
        "sluice_queue_wait_seconds",
        "sluice_request_seconds",
        "sluice_prefill_done_seconds",
        "sluice_step_seconds",
    ] {
        assert!(
            text.contains(&format!("# TYPE {name} histogram")),
            "{name} is not a histogram"
        );
        assert!(
            text.contains(&format!("{name}_bucket{{")),
            "{name} has no buckets"
        );
    }
}

/// Each series of an exposition text as `family type labels` (the lines
/// of `tests/it/metrics.txt`): a histogram's buckets and a summary's
/// quantiles fold into their family; `le` and `quantile` are not listed.
fn series_of(text: &str) -> BTreeSet<String> {
    let mut types: Vec<(String, String)> = Vec::new();
    let mut out = BTreeSet::new();
    for line in text.lines() {
        if let Some(t) = line.strip_prefix("# TYPE ") {
            let (name, kind) = t.split_once(' ').expect("# TYPE name type");
            types.push((name.to_string(), kind.to_string()));
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let name_end = line.find(['{', ' ']).expect("a sample line");
        let name = &line[..name_end];
        let labels = match line[name_end..].strip_prefix('{') {
            Some(rest) => &rest[..rest.find('}').expect("closed labels")],
            None => "",
        };
        let (family, kind) = types
            .iter()
            .rev()
            .find(|(f, _)| {
                name == f
                    || ["_bucket", "_sum", "_count"]
                        .iter()
                        .any(|s| name.strip_suffix(s) == Some(f.as_str()))
            })
            .unwrap_or_else(|| panic!("{name} has no # TYPE before it"));
        let kept: Vec<&str> = labels
            .split(',')
            .filter(|l| !l.is_empty() && !l.starts_with("le=") && !l.starts_with("quantile="))
            .collect();
        let entry = match kept.is_empty() {
            true => format!("{family} {kind}"),
            false => format!("{family} {kind} {}", kept.join(",")),
        };
        out.insert(entry);
    }
    out
}

/// A lone stream's decode passes all have one shape (one token of one
/// sequence, one output, the same 256-cell attention span), so llama.cpp
/// reuses the compute graph of the one before instead of building it again:
/// what the engine does between passes must not stop it.
#[test]
fn a_lone_streams_decode_passes_reuse_the_compute_graph() {
    let srv = Server::start(&[]);
    let passes = srv.metric("sluice_passes_total");
    let reused = srv.metric("sluice_graphs_reused_total");
    let r = srv.post("/v1/chat/completions", &chat_body(40));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.body_json()["usage"]["completion_tokens"], 40);
    let (passes, reused) = (
        srv.metric("sluice_passes_total") - passes,
        srv.metric("sluice_graphs_reused_total") - reused,
    );
    // The prompt's pass and 39 decode passes; the first decode pass builds
    // its graph (the prompt's had another shape), the later 38 reuse it.
    assert!(passes >= 40.0, "{passes} passes");
    assert!(
        reused >= 38.0,
        "{reused} of {passes} passes reused the graph"
    );
}

#[test]
fn metrics_keep_every_listed_name_type_and_label() {
    let listed: BTreeSet<String> = include_str!("metrics.txt")
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(str::to_string)
        .collect();
    let srv = Server::start(&[]);
    assert_eq!(srv.post("/v1/chat/completions", &chat_body(2)).status, 200);
    let live = series_of(&srv.metrics());
    let missing: Vec<&String> = listed.difference(&live).collect();
    assert!(
        missing.is_empty(),
        "listed in metrics.txt, not exposed: {missing:#?}"
    );
    let unlisted: Vec<&String> = live.difference(&listed).collect();
    assert!(
        unlisted.is_empty(),
        "exposed, not in metrics.txt: {unlisted:#?}"
    );
    // The reader itself: a histogram folds into one line per label set.
    let folded = series_of(
        "# TYPE h histogram\nh_bucket{class=\"a\",le=\"1\"} 1\nh_sum{class=\"a\"} 1\nh_count{class=\"a\"} 1\n",
    );
    assert_eq!(
        folded.into_iter().collect::<Vec<_>>(),
        ["h histogram class=\"a\""]
    );
}

/// Alert names in the rules file, and for each the `exp_alerts` of its unit
/// tests: true for a case that expects it to fire, false for `[]`.
fn alert_cases(rules: &str, tests: &str) -> Vec<(String, Vec<bool>)> {
    let names: Vec<String> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .map(|n| n.trim().to_string())
        .collect();
    let lines: Vec<&str> = tests.lines().map(str::trim).collect();
    names
        .into_iter()
        .map(|name| {
            let cases = lines
                .iter()
                .enumerate()
                .filter(|(_, l)| **l == format!("alertname: {name}"))
                .map(|(i, _)| {
                    let next = lines.get(i + 1).copied().unwrap_or("");
                    assert!(next.starts_with("exp_alerts:"), "{name}: {next}");
                    next != "exp_alerts: []"
                })
                .collect();
            (name, cases)
        })
        .collect()
}

#[test]
fn the_alert_rules_pass_their_unit_tests_and_each_has_a_case_that_fires_and_one_that_does_not() {
    let rules = repo("deploy/prometheus/sluice-alerts.yml");
    let tests = repo("deploy/prometheus/sluice-alerts.test.yml");
    let (ok, out) = run(
        "promtool",
        &["check", "rules", rules.to_str().unwrap()],
        None,
    );
    assert!(ok, "promtool check rules:\n{out}");
    let (ok, out) = run(
        "promtool",
        &["test", "rules", tests.to_str().unwrap()],
        None,
    );
    assert!(ok, "promtool test rules:\n{out}");
    let cases = alert_cases(
        &std::fs::read_to_string(&rules).unwrap(),
        &std::fs::read_to_string(&tests).unwrap(),
    );
    assert!(cases.len() >= 7, "{cases:?}");
    for (name, fires) in &cases {
        assert!(fires.contains(&true), "no test fires {name}");
        assert!(fires.contains(&false), "no test keeps {name} quiet");
    }
    // Every metric the rules read is one sluice exposes.
    let srv = Server::start(&[]);
    let exposed = exposed_names(&srv.metrics());
    let text = std::fs::read_to_string(&rules).unwrap();
    for m in metric_names(&text) {
        assert!(
            exposed.contains(&m),
            "the rules read {m}, which /metrics lacks"
        );
    }
}

/// `sluice_*` names in PromQL text, with a histogram's `_bucket`, `_sum` and
/// `_count` taken as the histogram.
fn metric_names(promql: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = promql.as_bytes();
    let mut i = 0;
    while let Some(at) = promql[i..].find("sluice_") {
        let start = i + at;
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        names.insert(promql[start..end].to_string());
        i = end;
    }
    names
}

/// Metric families `/metrics` declares (`# TYPE`), and a histogram's series.
fn exposed_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for l in text.lines() {
        let Some(rest) = l.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut it = rest.split_whitespace();
        let (Some(name), Some(kind)) = (it.next(), it.next()) else {
            continue;
        };
        names.insert(name.to_string());
        if kind == "histogram" || kind == "summary" {
            for s in ["_bucket", "_sum", "_count"] {
                names.insert(format!("{name}{s}"));
            }
        }
    }
    names
}

#[test]
fn every_metric_the_dashboard_queries_is_one_sluice_exposes() {
    let dash: Value =
        serde_json::from_str(&std::fs::read_to_string(repo("deploy/grafana/sluice.json")).unwrap())
            .expect("the dashboard is JSON");
    assert_eq!(dash["uid"], "sluice");
    let mut queries = Vec::new();
    for p in dash["panels"].as_array().expect("panels") {
        let targets = p["targets"].as_array().expect("each panel has targets");
        assert!(!targets.is_empty(), "{}", p["title"]);
        for t in targets {
            queries.push(t["expr"].as_str().expect("expr").to_string());
        }
    }
    for v in dash["templating"]["list"].as_array().expect("variables") {
        if let Some(q) = v["query"]["query"].as_str() {
            queries.push(q.to_string());
        }
    }
    let srv = Server::start(&[]);
    let exposed = exposed_names(&srv.metrics());
    let used: BTreeSet<String> = queries.iter().flat_map(|q| metric_names(q)).collect();
    assert!(used.len() >= 20, "{used:?}");
    for m in &used {
        assert!(
            exposed.contains(m),
            "the dashboard queries {m}, which /metrics lacks"
        );
    }
}

/// The page as headless Chromium renders it after a few seconds of its own
/// updates (virtual time), and what Chromium said on stderr.
fn render_page(srv: &Server, extra: &[&str]) -> (String, String) {
    let url = format!("http://{}/", srv.addr);
    // Debian's name, else Ubuntu's.
    let chromium = ["chromium", "chromium-browser"]
        .into_iter()
        .find(|name| {
            Command::new("sh")
                .args(["-c", &format!("command -v {name}")])
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .unwrap_or("chromium");
    let out = Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=5000",
            "--window-size=1280,1100",
        ])
        .args(extra)
        .arg(&url)
        .output()
        .expect("chromium (deploy/install-deps --for-tests installs it)");
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The text of the element with this id.
fn element_text(dom: &str, id: &str) -> String {
    let open = format!("id=\"{id}\"");
    let at = dom
        .find(&open)
        .unwrap_or_else(|| panic!("no #{id} in:\n{dom}"));
    let rest = &dom[at..];
    let start = rest.find('>').expect("tag end") + 1;
    let end = rest[start..].find('<').expect("text end");
    rest[start..start + end].to_string()
}

fn attribute(dom: &str, name: &str) -> String {
    let key = format!("{name}=\"");
    let at = dom
        .find(&key)
        .unwrap_or_else(|| panic!("no {name} in the page"))
        + key.len();
    dom[at..at + dom[at..].find('"').expect("quote")].to_string()
}

#[test]
fn the_status_page_loads_without_errors_and_its_numbers_follow_the_load() {
    let srv = Server::start(&[]);
    let (dom, stderr) = render_page(&srv, &["--dump-dom"]);
    assert!(
        !stderr.contains(":CONSOLE"),
        "the page logged to its console:\n{stderr}"
    );
    assert_eq!(attribute(&dom, "data-errors"), "0", "{dom}");
    let updates: u32 = attribute(&dom, "data-updates").parse().expect("updates");
    assert!(updates >= 2, "the page drew /status {updates} times");
    let number = |dom: &str| -> u64 {
        element_text(dom, "tokens-total")
            .replace(',', "")
            .parse()
            .expect("a number")
    };
    assert_eq!(number(&dom), 0);
    assert!(element_text(&dom, "state").starts_with("ready"), "{dom}");

    // Load: a stream runs while the screenshot is taken, then two more chats.
    let addr = srv.addr;
    let stream =
        std::thread::spawn(move || post_json(addr, "/v1/chat/completions", &chat_body(160)));
    wait_until(Duration::from_secs(120), "tokens to be generated", || {
        srv.metric("sluice_tokens_generated_total") > 0.0
    });
    let shot = repo("target/status-page.png");
    let _ = std::fs::remove_file(&shot);
    let arg = format!("--screenshot={}", shot.display());
    let (_, stderr) = render_page(&srv, &[&arg]);
    assert!(!stderr.contains(":CONSOLE"), "{stderr}");
    assert!(
        std::fs::metadata(&shot).map(|m| m.len()).unwrap_or(0) > 10_000,
        "no screenshot at {}",
        shot.display()
    );
    assert_eq!(stream.join().expect("stream").status, 200);
    for _ in 0..2 {
        assert_eq!(srv.post("/v1/chat/completions", &chat_body(8)).status, 200);
    }
    let generated = srv.metric("sluice_tokens_generated_total") as u64;
    assert_eq!(generated, 160 + 2 * 8);
    let (dom, stderr) = render_page(&srv, &["--dump-dom"]);
    assert!(!stderr.contains(":CONSOLE"), "{stderr}");
    assert_eq!(attribute(&dom, "data-errors"), "0");
    assert_eq!(number(&dom), generated, "the page shows the server's count");
    assert_eq!(element_text(&dom, "completed"), "3");
}

#[test]
fn a_request_id_is_echoed_and_logged_and_a_bad_one_is_replaced() {
    let srv = Server::start(&[]);
    let body = chat_body(3).to_string();
    let chat = |id: &str| {
        request(
            srv.addr,
            "POST",
            "/v1/chat/completions",
            Some(body.as_bytes()),
            &[("Content-Type", "application/json"), ("X-Request-Id", id)],
        )
    };
    let r = chat("abc-123");
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-request-id"), Some("abc-123"));
    wait_until(Duration::from_secs(120), "the request's log line", || {
        srv.log()
            .lines()
            .any(|l| l.contains("POST /v1/chat/completions 200 id=abc-123 "))
    });
    // An error names the id in its body, its header and its log line.
    let bad = request(
        srv.addr,
        "POST",
        "/v1/chat/completions",
        Some(b"{}"),
        &[
            ("Content-Type", "application/json"),
            ("X-Request-Id", "err-9"),
        ],
    );
    assert_eq!(bad.status, 400);
    assert_eq!(bad.header("x-request-id"), Some("err-9"));
    let v: Value = serde_json::from_slice(&bad.body).unwrap();
    assert_eq!(v["error"]["request_id"], "err-9", "{v}");
    wait_until(Duration::from_secs(120), "the error's log line", || {
        srv.log().lines().any(|l| l.contains(" 400 id=err-9 "))
    });
    // Too long, or with characters a log line or header must not carry:
    // replaced by an id of sluice's own, never echoed.
    let long = "x".repeat(129);
    for given in [long.as_str(), "a b", "a\"b", "<script>", "a\tb"] {
        let r = chat(given);
        assert_eq!(r.status, 200);
        let id = r.header("x-request-id").expect("an id").to_string();
        assert_ne!(id, given);
        assert_eq!(id.len(), 16, "{id}");
        assert!(id.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
    }
    assert!(!srv.log().contains(&long));
    assert!(!srv.log().contains("<script>"));
    // Every response has one, streams and health checks too.
    let live = request(srv.addr, "GET", "/livez", None, &[]);
    assert_eq!(live.header("x-request-id").map(str::len), Some(16));
    let mut stream = chat_body(2);
    stream["stream"] = json!(true);
    let s = Sse::open(srv.addr, "/v1/chat/completions", &stream);
    assert_eq!(s.status, 200);
}

#[test]
fn json_logs_are_one_object_a_line_with_the_requests_fields() {
    let srv = Server::start(&["--log-format", "json"]);
    let body = chat_body(3).to_string();
    let r = request(
        srv.addr,
        "POST",
        "/v1/chat/completions",
        Some(body.as_bytes()),
        &[
            ("Content-Type", "application/json"),
            ("X-Request-Id", "json-1"),
        ],
    );
    assert_eq!(r.status, 200);
    let line = |log: &str| -> Option<Value> {
        log.lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| v["id"] == "json-1")
    };
    wait_until(Duration::from_secs(120), "the request's JSON line", || {
        line(&srv.log()).is_some()
    });
    let log = srv.log();
    for l in log.lines() {
        let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
        assert!(v["time"].as_str().is_some_and(|t| t.ends_with('Z')), "{l}");
        assert!(v["msg"].is_string(), "{l}");
    }
    let v = line(&log).expect("the line");
    assert_eq!(v["status"], 200);
    assert_eq!(v["path"], "/v1/chat/completions");
    assert_eq!(v["class"], "interactive");
    assert_eq!(v["completion_tokens"], 3);
    assert!(v["prompt_tokens"].as_u64().unwrap() > 0);
    assert!(v["ttft_ms"].is_u64());
}
