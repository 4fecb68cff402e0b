//! The Kubernetes manifests (`deploy/k8s/`): they pass `deploy/k8s/validate`
//! (the Kubernetes schemas, the InferencePool/InferenceObjective schemas, the
//! prometheus-adapter rule, and their agreement with each other and with
//! sluice's metrics), each kind of mistake makes it fail, and sluice started
//! as the container would be (PID 1, the Deployment's own arguments) answers
//! its probes and drains on its preStop command followed by the kubelet's
//! SIGTERM.

use crate::harness::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn manifest(name: &str) -> PathBuf {
    root().join("deploy/k8s").join(name)
}

const MANIFESTS: [&str; 3] = ["sluice.yaml", "autoscaling.yaml", "inference-pool.yaml"];

/// `deploy/k8s/validate` over `files` (with the suite's list of sluice's
/// metrics), in the test virtualenv, which has kubernetes-validate.
fn validate(files: &[PathBuf], extra: &[&str]) -> (bool, String) {
    let out: Output = Command::new(test_python())
        .arg(manifest("validate"))
        .arg("--metrics-list")
        .arg(root().join("tests/it/metrics.txt"))
        .args(extra)
        .args(files)
        .output()
        .expect("run deploy/k8s/validate");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn the_manifests_pass_the_schemas_and_agree_with_each_other() {
    let files: Vec<PathBuf> = MANIFESTS.iter().map(|m| manifest(m)).collect();
    let (ok, text) = validate(&files, &[]);
    assert!(ok, "{text}");
    // Every object was checked, each against its own schema.
    for line in [
        "Deployment/sluice (Kubernetes 1.30.0, 1.37.0)",
        "Service/sluice (Kubernetes",
        "PodDisruptionBudget/sluice (Kubernetes",
        "PersistentVolumeClaim/sluice-models (Kubernetes",
        "HorizontalPodAutoscaler/sluice (Kubernetes",
        "ConfigMap/prometheus-adapter-sluice (Kubernetes 1.30.0, 1.37.0 and schemas/prometheus-adapter-config.json)",
        "InferencePool/sluice (schemas/inferencepool-inference.networking.k8s.io-v1.json)",
        "InferenceObjective/interactive (schemas/inferenceobjective-",
        "InferenceObjective/batch (schemas/inferenceobjective-",
        "ok   the objects agree with each other and with sluice",
        "9 objects in 3 files: ok",
    ] {
        assert!(text.contains(line), "missing: {line}\n{text}");
    }
    // The image recipe copies the package `make deb` builds.
    let containerfile =
        std::fs::read_to_string(manifest("Containerfile")).expect("read Containerfile");
    let deb = format!(
        "target/debian/sluice_{}-1_amd64.deb",
        env!("CARGO_PKG_VERSION")
    );
    assert!(
        containerfile.contains(&format!("COPY {deb} ")),
        "{containerfile}"
    );
    assert!(root().join(&deb).exists(), "run make deb first");
}

/// A copy of `file` with `from` (which must occur exactly once) replaced by `to`.
fn broken(file: &str, from: &str, to: &str, n: usize) -> PathBuf {
    let text = std::fs::read_to_string(manifest(file)).expect("read manifest");
    assert_eq!(text.matches(from).count(), 1, "{from:?} in {file}");
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("k8s-broken-{n}"));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let path = dir.join(file);
    std::fs::write(&path, text.replace(from, to)).expect("write");
    path
}

#[test]
fn each_kind_of_mistake_fails_validation_and_is_named() {
    // (file, text, replacement, what the failure says)
    let cases: &[(&str, &str, &str, &str)] = &[
        // Kubernetes' schemas: a misspelt field (strict), a wrong type, a
        // required field left out.
        (
            "sluice.yaml",
            "          livenessProbe:",
            "          livenesProbe:",
            "Additional properties are not allowed ('livenesProbe' was unexpected)",
        ),
        (
            "sluice.yaml",
            "  replicas: 2",
            "  replicas: two",
            "spec.replicas: 'two' is not of type 'integer'",
        ),
        (
            "autoscaling.yaml",
            "    kind: Deployment\n    name: sluice\n",
            "    kind: Deployment\n",
            "spec.scaleTargetRef: 'name' is a required property",
        ),
        // The extension's schemas.
        (
            "inference-pool.yaml",
            "    - number: 8080",
            "    - number: 80800",
            "spec.targetPorts.0.number: 80800 is greater than the maximum of 65535",
        ),
        (
            "inference-pool.yaml",
            "    failureMode: FailClose",
            "    failureMode: Close",
            "spec.endpointPickerRef.failureMode: 'Close' is not one of",
        ),
        (
            "inference-pool.yaml",
            "    port:\n      number: 9002\n",
            "",
            "port is required when kind is 'Service' or unspecified",
        ),
        (
            "inference-pool.yaml",
            "  priority: 10\n  poolRef:\n    name: sluice\n",
            "  priority: 10\n",
            "InferenceObjective/interactive: spec: 'poolRef' is a required property",
        ),
        // prometheus-adapter's rule.
        (
            "autoscaling.yaml",
            "        metricsQuery: ",
            "        metricQuery: ",
            "data.config.yaml: rules.0: Additional properties are not allowed",
        ),
        // The objects against each other and against sluice.
        (
            "sluice.yaml",
            "            limits:\n              cpu: \"2\"",
            "            limits:\n              cpu: \"3\"",
            "resources: cpu request (2) must equal its limit (3)",
        ),
        (
            "sluice.yaml",
            "terminationGracePeriodSeconds: 45",
            "terminationGracePeriodSeconds: 30",
            "terminationGracePeriodSeconds (30) must exceed the drain",
        ),
        (
            "sluice.yaml",
            "              path: /readyz",
            "              path: /livez",
            "readinessProbe must GET /readyz",
        ),
        (
            "sluice.yaml",
            "                  - kill -TERM 1",
            "                  - sleep 5",
            "lifecycle.preStop must start the drain",
        ),
        (
            "sluice.yaml",
            "      targetPort: http",
            "      targetPort: 9090",
            "Service/sluice: targetPort 9090 is not sluice's port",
        ),
        (
            "autoscaling.yaml",
            "          name: sluice_queue_depth\n",
            "          name: sluice_queue_length\n",
            "no prometheus-adapter rule serves sluice_queue_length",
        ),
        (
            "autoscaling.yaml",
            "      - seriesQuery: 'sluice_queue_depth{",
            "      - seriesQuery: 'sluice_queue_length{",
            "is not one sluice exports",
        ),
        (
            "inference-pool.yaml",
            "  priority: -10",
            "  priority: 0",
            "InferenceObjective/batch: priority 0 but in --batch-objectives",
        ),
        (
            "inference-pool.yaml",
            "    - number: 8080",
            "    - number: 8081",
            "InferencePool/sluice: target port 8081 is not sluice's port",
        ),
    ];
    for (n, (file, from, to, says)) in cases.iter().enumerate() {
        let files: Vec<PathBuf> = MANIFESTS
            .iter()
            .map(|m| match m == file {
                true => broken(file, from, to, n),
                false => manifest(m),
            })
            .collect();
        let (ok, text) = validate(&files, &[]);
        assert!(!ok, "case {n} ({file}: {from:?} -> {to:?}) passed:\n{text}");
        assert!(
            text.contains(says),
            "case {n} ({file}: {from:?} -> {to:?}) does not say {says:?}:\n{text}"
        );
    }
}

/// The Deployment's sluice container, as `validate --container-json` reads it.
fn container() -> (Value, Value) {
    let (ok, text) = validate(&[manifest("sluice.yaml")], &["--container-json"]);
    assert!(ok, "{text}");
    let v: Value = serde_json::from_str(text.trim()).expect("container JSON");
    (v["container"].clone(), v["pod"].clone())
}

/// The PID of the process `unshare --fork` started (PID 1 of its namespace).
fn child_of(pid: u32) -> u32 {
    let children =
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).expect("read children");
    children
        .split_whitespace()
        .next()
        .expect("unshare has its child")
        .parse()
        .expect("a pid")
}

#[test]
fn sluice_as_pid_1_with_the_deployments_arguments_answers_its_probes_and_drains_on_its_prestop() {
    let (c, pod) = container();
    // The container's arguments, less where it listens and what it loads,
    // which a test on loopback gives itself, and its volumes' paths.
    let args: Vec<String> = c["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("string arg").to_string())
        .collect();
    assert_eq!(args[0], "serve");
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("k8s-volumes");
    std::fs::create_dir_all(&tmp).expect("mkdir");
    let mut kept: Vec<String> = Vec::new();
    let mut drain_ms = 0u64;
    let mut it = args[1..].iter();
    while let Some(flag) = it.next() {
        let value = it.next().expect("every flag has a value").clone();
        match flag.as_str() {
            "--host" | "--port" | "--model" => continue,
            "--calibration-cache" => {
                kept.push(flag.clone());
                kept.push(tmp.join("calibration.json").display().to_string());
            }
            "--data-dir" => {
                kept.push(flag.clone());
                kept.push(tmp.join("data").display().to_string());
            }
            _ => {
                if flag == "--drain-notice-ms" || flag == "--drain-timeout-ms" {
                    drain_ms += value.parse::<u64>().expect("ms");
                }
                kept.push(flag.clone());
                kept.push(value);
            }
        }
    }
    assert!(
        pod["terminationGracePeriodSeconds"]
            .as_u64()
            .expect("grace")
            * 1000
            > drain_ms,
        "{pod}"
    );
    let kept: Vec<&str> = kept.iter().map(String::as_str).collect();
    let unshare = ["unshare", "--pid", "--fork", "--kill-child"].map(Path::new);
    let program = [&unshare[..], &[Path::new(binary())]].concat();
    let mut srv = Server::launch(&program, &model_path(), &kept, &[]);
    let pid1 = child_of(srv.pid());

    // The probes, as the kubelet asks them.
    let path = |probe: &str| {
        c[probe]["httpGet"]["path"]
            .as_str()
            .expect("path")
            .to_string()
    };
    let get = |p: &str| request(srv.addr, "GET", p, None, &[]).status;
    assert_eq!(get(&path("startupProbe")), 200);
    assert_eq!(get(&path("livenessProbe")), 200);
    wait_until(Duration::from_secs(120), "readiness", || {
        get(&path("readinessProbe")) == 200
    });

    // A stream in flight when the pod is deleted.
    let body = json!({"prompt": "Once upon a time", "stream": true, "max_tokens": 48,
                      "ignore_eos": true, "temperature": 0});
    let mut stream = Sse::open(srv.addr, "/v1/completions", &body);
    assert_eq!(stream.status, 200);
    assert!(stream.next_json().is_some());

    // The preStop hook, run in the container's PID namespace, returns 0 ...
    let command: Vec<&str> = c["lifecycle"]["preStop"]["exec"]["command"]
        .as_array()
        .expect("preStop command")
        .iter()
        .map(|a| a.as_str().expect("string"))
        .collect();
    let hook = Command::new("nsenter")
        .args(["-t", &pid1.to_string(), "-p", "--"])
        .args(&command)
        .status()
        .expect("run the preStop hook");
    assert!(hook.success(), "preStop failed: {hook}");
    // ... then the kubelet sends its own SIGTERM, which changes nothing.
    let term = Command::new("kill")
        .args(["-TERM", &pid1.to_string()])
        .status()
        .expect("kill");
    assert!(term.success());
    wait_until(Duration::from_secs(120), "not ready while draining", || {
        get(&path("readinessProbe")) == 503
    });
    assert_eq!(get(&path("livenessProbe")), 200, "draining is not dead");

    // The stream runs to its end, and sluice exits 0.
    let (_, chunks) = collect_stream(&mut stream);
    let finish = chunks
        .iter()
        .rev()
        .find_map(|ch| ch["choices"][0]["finish_reason"].as_str());
    assert_eq!(finish, Some("length"), "{}", srv.log());
    assert_eq!(
        srv.wait_exit(Duration::from_secs(120)),
        Some(0),
        "{}",
        srv.log()
    );
    let log = srv.log();
    assert!(log.contains("sluice: drained; exiting"), "{log}");
}
