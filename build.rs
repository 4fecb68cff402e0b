//! Embeds what `sluice --version` reports: the version, the git commit, and the
//! CPU target llama.cpp was compiled for (llama-cpp-sys-2 turns rustc's
//! `target-cpu` and target features into ggml's build options).

use std::process::Command;

fn main() {
    let commit = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let dirty = Command::new("git")
        .args(["status", "--porcelain", "--untracked-files=no"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .is_some_and(|o| !o.stdout.is_empty());
    let commit = if dirty {
        format!("{commit}-dirty")
    } else {
        commit
    };
    println!("cargo:rustc-env=SLUICE_GIT_COMMIT={commit}");

    let target_cpu = std::env::var("CARGO_ENCODED_RUSTFLAGS")
        .unwrap_or_default()
        .split('\x1f')
        .find_map(|f| f.split("target-cpu=").nth(1).map(str::to_string))
        .unwrap_or_else(|| "generic".into());
    println!("cargo:rustc-env=SLUICE_TARGET_CPU={target_cpu}");

    let wanted = [
        "sse4.2",
        "avx",
        "avx2",
        "fma",
        "f16c",
        "bmi2",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512vnni",
        "avx512vbmi",
        "avx512bf16",
        "avxvnni",
        "neon",
        "dotprod",
        "i8mm",
        "sve",
    ];
    let features: Vec<String> = std::env::var("CARGO_CFG_TARGET_FEATURE")
        .unwrap_or_default()
        .split(',')
        .filter(|f| wanted.contains(f))
        .map(str::to_string)
        .collect();
    println!(
        "cargo:rustc-env=SLUICE_TARGET_FEATURES={}",
        features.join(",")
    );

    println!("cargo:rerun-if-changed=.git/HEAD");
    // The working tree too: a build from edited sources must say `-dirty`
    // (and a commit's, not say it), or `--version` and the calibration
    // cache's key (which holds this string) name code the binary is not.
    println!("cargo:rerun-if-changed=.git/index");
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=Cargo.toml");
    println!("cargo:rerun-if-changed=.git/refs/heads");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=RUSTFLAGS");
    println!("cargo:rerun-if-env-changed=CARGO_ENCODED_RUSTFLAGS");
}
