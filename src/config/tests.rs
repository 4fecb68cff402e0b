//! The configuration's checks and derivations, from command lines and the
//! environment.

use super::*;
use argh::FromArgs;

fn config(args: &[&str]) -> Config {
    let mut all = vec!["--mu-prefill", "1000", "--mu-decode", "100"];
    all.extend_from_slice(args);
    let a = ServeArgs::from_args(&["sluice", "serve"], &all).expect("args");
    Config::from_args(a).expect("config")
}

#[test]
fn a_short_prompt_may_pause_the_streams_three_seconds_by_default() {
    // On a 2-core Zen 1 a 100-200-token prompt beside three streams takes
    // 1-2.5 s: under a 1 s pause a 4-client loop of 20-200-token prompts took
    // 0-3 of them whole in 30 s, the rest in small chunks, and served 2-16 %
    // fewer tokens per second (README, "Continuous batching").
    let c = config(&[]);
    assert_eq!(c.itl_max, Duration::from_secs(3));
    assert_eq!(c.itl_target, Duration::from_millis(150));
    assert_eq!(config(&["--itl-max-ms", "0"]).itl_max, Duration::ZERO);
}

#[test]
fn the_connection_bound_follows_the_handlers_and_the_descriptors() {
    let c = config(&[]);
    // 16 per handler, within 64..=1024.
    assert_eq!(c.max_connections(26, 1 << 20), Ok(416));
    assert_eq!(c.max_connections(2, 1 << 20), Ok(64));
    assert_eq!(c.max_connections(500, 1 << 20), Ok(1024));
    // No more than the descriptors hold: (1024 - 64) / 3.
    assert_eq!(c.max_connections(26, 1024), Ok(320));
    let c = config(&["--max-connections", "5000"]);
    assert_eq!(c.max_connections(26, 1 << 20), Ok(5000));
    let e = c.max_connections(26, 1024).unwrap_err();
    assert!(e.contains("file descriptors"), "{e}");
    let a = ServeArgs::from_args(&["sluice", "serve"], &["--max-connections", "0"]).unwrap();
    assert!(Config::from_args(a).is_err());
    let a = ServeArgs::from_args(&["sluice", "serve"], &["--allowed-origins", "evil"]).unwrap();
    assert!(Config::from_args(a).is_err());
}

#[test]
fn usable_cpus_follow_the_mask_and_the_quota() {
    assert_eq!(usable_cpus(&[2, 3, 5], 8), vec![2, 3, 5]);
    assert_eq!(usable_cpus(&[2, 3, 5], 1), vec![2]);
    assert_eq!(usable_cpus(&[], 2), vec![0, 1]);
}

#[test]
fn every_serve_flag_has_its_environment_variable() {
    let early =
        ServeArgs::from_args(&["sluice", "serve"], &["--help"]).expect_err("--help exits early");
    let in_help: std::collections::BTreeSet<String> = early
        .output
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("--"))
        .map(|f| f.trim_end_matches([',', '.']).to_string())
        .filter(|f| !f.is_empty() && f.chars().all(|c| c.is_ascii_lowercase() || c == '-'))
        .collect();
    let flags = serve_flags();
    let known: std::collections::BTreeSet<String> = flags
        .iter()
        .map(|(f, _)| f.clone())
        .chain(["help".to_string()])
        .collect();
    // Every flag the help names is one the environment may give, and the
    // usage line's reading tells options from switches.
    assert!(flags.contains(&("port".to_string(), true)), "{flags:?}");
    assert!(flags.contains(&("mmap".to_string(), false)), "{flags:?}");
    assert!(flags.contains(&("queue-depth-unsafe".to_string(), false)));
    assert_eq!(flags.len(), known.len() - 1, "no flag twice: {flags:?}");
    let missing: Vec<_> = in_help.difference(&known).collect();
    assert!(
        missing.is_empty(),
        "flags without an environment variable: {missing:?}"
    );
}

#[test]
fn the_environment_fills_in_flags_the_command_line_does_not_give() {
    let env = |k: &str| match k {
        "SLUICE_PORT" => Some("9000".to_string()),
        "SLUICE_PARALLEL" => Some("2".to_string()),
        "SLUICE_NO_SHED" => Some("1".to_string()),
        "SLUICE_VERBOSE" => Some("0".to_string()),
        _ => None,
    };
    let args: Vec<String> = ["sluice", "serve", "--parallel", "3"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let out = args_with_env(args, env).unwrap();
    assert_eq!(
        out,
        [
            "sluice",
            "serve",
            "--port",
            "9000",
            "--no-shed",
            "--parallel",
            "3"
        ]
    );
    let bad = |k: &str| (k == "SLUICE_NO_SHED").then(|| "maybe".to_string());
    let args = vec!["sluice".to_string(), "serve".to_string()];
    assert!(args_with_env(args, bad)
        .unwrap_err()
        .contains("SLUICE_NO_SHED"));
    let other = vec!["sluice".to_string(), "calibrate".to_string()];
    assert_eq!(args_with_env(other.clone(), env).unwrap(), other);
    assert_eq!(env_name("queue-wait-ms"), "SLUICE_QUEUE_WAIT_MS");
}

#[test]
fn flash_attention_is_measured_unless_given_or_implied_by_a_quantized_cache() {
    let cfg = |args: &[&str]| {
        ServeArgs::from_args(&["sluice", "serve"], args)
            .map_err(|e| e.output)
            .and_then(Config::from_args)
    };
    assert_eq!(cfg(&[]).unwrap().flash_attn, FlashAttnSetting::Measure);
    assert_eq!(
        cfg(&["--flash-attn", "off"]).unwrap().flash_attn,
        FlashAttnSetting::Fixed(FlashAttn::Off)
    );
    assert_eq!(
        cfg(&["--kv-type", "q8_0"]).unwrap().flash_attn,
        FlashAttnSetting::Fixed(FlashAttn::On)
    );
    assert!(cfg(&["--kv-type", "q8_0", "--flash-attn", "off"]).is_err());
    assert_eq!(cfg(&[]).unwrap().kv_type, KvTypeSetting::Measure);
    assert_eq!(
        cfg(&["--flash-attn", "off"]).unwrap().kv_type,
        KvTypeSetting::Measure
    );
    assert_eq!(
        cfg(&["--kv-type", "q8_0/f16", "--flash-attn", "off"])
            .unwrap()
            .kv_type,
        KvTypeSetting::Fixed(KvType::Q8_0KeysF16Values)
    );
    assert_eq!(
        cfg(&["--flash-attn", "on"]).unwrap().kv_type,
        KvTypeSetting::Measure
    );
    assert!(cfg(&["--kv-type", "q4"]).is_err());
    assert!(cfg(&["--flash-attn", "sometimes"]).is_err());
}

#[test]
fn range_errors_name_the_flag_and_value() {
    let e = check_range("--parallel", 0, 1, 256).unwrap_err();
    assert_eq!(e, "--parallel is 0; it must be 1 to 256");
    assert!(check_range("--overdue-stretch", f64::NAN, 0.0, 100.0).is_err());
    assert!(check_range("--overdue-stretch", 0.0, 0.0, 100.0).is_ok());
}

#[test]
fn the_default_path_follows_systemd_then_xdg_then_home() {
    let env = |vars: &'static [(&'static str, &'static str)]| {
        move |k: &str| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    };
    assert_eq!(
        derive::default_calibration_cache(env(&[
            ("CACHE_DIRECTORY", "/var/cache/sluice:/x"),
            ("HOME", "/h")
        ])),
        Some(PathBuf::from("/var/cache/sluice/calibration.json"))
    );
    assert_eq!(
        derive::default_calibration_cache(env(&[("XDG_CACHE_HOME", "/c"), ("HOME", "/h")])),
        Some(PathBuf::from("/c/sluice/calibration.json"))
    );
    assert_eq!(
        derive::default_calibration_cache(env(&[("HOME", "/h")])),
        Some(PathBuf::from("/h/.cache/sluice/calibration.json"))
    );
    assert_eq!(derive::default_calibration_cache(env(&[])), None);
}

#[test]
fn trusted_proxies_are_addresses_and_networks() {
    let c = config(&["--trusted-proxies", "127.0.0.1, 10.1.2.3/16,fd00::/8"]);
    let has = |a: &str| {
        let a: std::net::IpAddr = a.parse().unwrap();
        c.trusted_proxies.iter().any(|n| n.contains(&a))
    };
    assert!(has("127.0.0.1"));
    assert!(!has("127.0.0.2"));
    assert!(has("10.1.0.0") && has("10.1.255.255"));
    assert!(!has("10.2.0.1"));
    assert!(has("fd12::1") && !has("fe80::1"));
    let err = derive::trusted_proxies(Some("10.0.0.0/33")).unwrap_err();
    assert!(
        err.contains("'10.0.0.0/33' is not an IP address or network"),
        "{err}"
    );
}

#[test]
fn short_requests_get_a_second_context_when_the_pairing_is_left_to_measurement() {
    assert_eq!(config(&[]).short_cells, derive::SHORT_CELLS_DEFAULT);
    assert_eq!(config(&["--short-cells", "0"]).short_cells, 0);
    assert_eq!(config(&["--short-cells", "300"]).short_cells, 300);
    // A pairing the operator set is the one every request runs with.
    assert_eq!(config(&["--flash-attn", "off"]).short_cells, 0);
    assert_eq!(config(&["--kv-type", "f16"]).short_cells, 0);
    assert_eq!(
        config(&["--flash-attn", "on", "--short-cells", "512"]).short_cells,
        512
    );
    // One pool of cells has no streams to give a second context's.
    assert_eq!(config(&["--kv-layout", "unified"]).short_cells, 0);
    let a = ServeArgs::from_args(
        &["sluice", "serve"],
        &["--kv-layout", "unified", "--short-cells", "512"],
    )
    .unwrap();
    let e = Config::from_args(a).unwrap_err();
    assert!(e.contains("per-seq"), "{e}");
}
