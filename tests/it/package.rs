//! The Debian package (`make deb`): it installs into a fresh root, its unit
//! passes `systemd-analyze verify`, the installed binary serves, an upgrade
//! keeps the operator's settings, a purge leaves nothing behind; and its
//! binary, built for x86-64-v3, answers on an emulated Haswell, where the
//! native build refuses (and where a CPU without AVX2 gets a sentence).

use crate::harness::*;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn deb() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!(
        "target/debian/sluice_{}-1_amd64.deb",
        env!("CARGO_PKG_VERSION")
    ));
    assert!(
        p.exists(),
        "no package: run make deb first ({})",
        p.display()
    );
    p
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `dpkg` acting on the root `root` only: maintainer scripts run outside a
/// chroot (the root has no shell) with DPKG_ROOT set, which sluice's honour;
/// the root has no libc package, so dependencies are not checked.
fn dpkg(root: &Path) -> Command {
    let mut c = Command::new("dpkg");
    c.arg(format!("--root={}", root.display())).args([
        "--log=/dev/null",
        "--force-script-chrootless",
        "--force-depends",
    ]);
    c
}

/// Every file and symbolic link under `root`, but dpkg's own database.
fn files_in(root: &Path) -> Vec<String> {
    let out = run(Command::new("find")
        .arg(root)
        .args(["(", "-type", "f", "-o", "-type", "l", ")"])
        .args(["-not", "-path", "*/var/lib/dpkg/*"]));
    let mut v: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.strip_prefix(root.to_str().unwrap()).unwrap().to_string())
        .collect();
    v.sort();
    v
}

fn fresh_root(name: &str) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&root);
    for d in [
        "var/lib/dpkg/info",
        "var/lib/dpkg/updates",
        "var/lib/dpkg/triggers",
    ] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::write(root.join("var/lib/dpkg/status"), "").unwrap();
    root
}

/// The same package as version `version` (an upgrade to install over it).
fn repacked(version: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("deb-repack");
    let _ = std::fs::remove_dir_all(&dir);
    run(Command::new("dpkg-deb").arg("-R").arg(deb()).arg(&dir));
    let control = dir.join("DEBIAN/control");
    let text = std::fs::read_to_string(&control).unwrap();
    let old = text.lines().find(|l| l.starts_with("Version: ")).unwrap();
    std::fs::write(&control, text.replace(old, &format!("Version: {version}"))).unwrap();
    let out = dir.with_extension("deb");
    run(Command::new("dpkg-deb")
        .args(["-b", "-Zgzip", "-z1"])
        .arg(&dir)
        .arg(&out));
    out
}

const INSTALLED: &[&str] = &[
    "/etc/default/sluice",
    "/lib/systemd/system/sluice.service",
    "/lib/systemd/system/sluice@.service",
    "/usr/bin/sluice",
    "/usr/share/doc/sluice/ARCHITECTURE.md",
    "/usr/share/doc/sluice/README.md",
    "/usr/share/doc/sluice/copyright",
    "/usr/share/sluice/models/SmolLM2-135M-Instruct.Q4_1.gguf",
];

#[test]
fn the_package_installs_serves_upgrades_and_purges_without_a_trace() {
    let deb = deb();
    let depends = run(Command::new("dpkg-deb").arg("-f").arg(&deb).arg("Depends"));
    assert!(
        String::from_utf8_lossy(&depends.stdout).contains("libc6"),
        "{depends:?}"
    );

    let root = fresh_root("deb-root");
    run(dpkg(&root).arg("-i").arg(&deb));
    assert_eq!(files_in(&root), INSTALLED);
    let unit = std::fs::read_to_string(root.join("lib/systemd/system/sluice.service")).unwrap();
    let ours = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy/sluice.service"),
    )
    .unwrap();
    assert_eq!(
        unit, ours,
        "the package's unit is not deploy/sluice.service"
    );

    // systemd-analyze verify also checks that ExecStart's program exists: a
    // copy of the installed unit, pointed at the installed binary in the root.
    let bin = root.join("usr/bin/sluice");
    let verify = root.join("verify");
    std::fs::create_dir_all(&verify).unwrap();
    let copy = unit.replace(
        "ExecStart=/usr/bin/sluice ",
        &format!("ExecStart={} ", bin.display()),
    );
    assert_ne!(copy, unit);
    std::fs::write(verify.join("sluice.service"), copy).unwrap();
    let out = run(Command::new("systemd-analyze")
        .current_dir(&verify)
        .args(["verify", "sluice.service"]));
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.trim().is_empty(), "systemd-analyze verify: {said}");
    std::fs::remove_dir_all(&verify).unwrap();

    let version = run(Command::new(&bin).arg("--version"));
    let version = String::from_utf8_lossy(&version.stdout);
    assert!(
        version.contains("built for: target-cpu=x86-64-v3"),
        "{version}"
    );

    // The installed binary and model answer a completion.
    {
        let model = root.join("usr/share/sluice/models/SmolLM2-135M-Instruct.Q4_1.gguf");
        let srv = Server::launch(&[&bin], &model, &[], &[]);
        let r = srv.post(
            "/v1/completions",
            &json!({"prompt": "Hello", "max_tokens": 3}),
        );
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.body_json()["usage"]["completion_tokens"], 3);
    }

    // An upgrade keeps the operator's edited settings and leaves no
    // .dpkg-* files.
    let settings = root.join("etc/default/sluice");
    let edited = std::fs::read_to_string(&settings).unwrap() + "SLUICE_PARALLEL=2\n";
    std::fs::write(&settings, &edited).unwrap();
    run(dpkg(&root).arg("-i").arg(repacked("0.1.0-99")));
    let status = run(dpkg(&root).args(["-s", "sluice"]));
    assert!(String::from_utf8_lossy(&status.stdout).contains("Version: 0.1.0-99"));
    assert_eq!(std::fs::read_to_string(&settings).unwrap(), edited);
    assert_eq!(files_in(&root), INSTALLED);

    // What a running service leaves: its state and cache (DynamicUser) and
    // the enablement link. A purge removes all of it with the package.
    for d in ["var/lib/private/sluice", "var/cache/private/sluice"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
        std::fs::write(root.join(d).join("sluice.db"), "x").unwrap();
    }
    let wants = root.join("etc/systemd/system/multi-user.target.wants");
    std::fs::create_dir_all(&wants).unwrap();
    std::os::unix::fs::symlink(
        "/lib/systemd/system/sluice.service",
        wants.join("sluice.service"),
    )
    .unwrap();
    run(dpkg(&root).args(["--purge", "sluice"]));
    assert_eq!(files_in(&root), Vec::<String>::new());
    let listed = run(dpkg(&root).args(["-l"]));
    assert!(!String::from_utf8_lossy(&listed.stdout).contains("sluice"));
}

/// The package's binary, taken out of the .deb.
fn package_binary() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("deb-extract");
    let _ = std::fs::remove_dir_all(&dir);
    run(Command::new("dpkg-deb").arg("-x").arg(deb()).arg(&dir));
    dir.join("usr/bin/sluice")
}

/// qemu-user's TCG, with `cpu`'s CPUID and instruction set.
fn qemu(cpu: &str) -> Vec<PathBuf> {
    vec!["qemu-x86_64".into(), "-cpu".into(), cpu.into()]
}

fn emulated(cpu: &str, bin: &Path, args: &[&str]) -> Output {
    Command::new("qemu-x86_64")
        .args(["-cpu", cpu])
        .arg(bin)
        .args(args)
        .output()
        .expect("qemu-x86_64 (deploy/install-deps --for-tests installs qemu-user)")
}

#[test]
fn the_package_binary_answers_on_an_emulated_haswell_where_the_native_one_refuses() {
    let bin = package_binary();

    // The native build uses what this machine has beyond Haswell (AVX-512 on
    // a Xeon, SHA and ADX on any AMD Zen): it refuses, naming them.
    let native = emulated("Haswell", Path::new(binary()), &["--version"]);
    let said = String::from_utf8_lossy(&native.stderr);
    assert!(!native.status.success(), "the native build ran on Haswell");
    assert!(said.contains("does not have"), "{said}");

    // A CPU with AVX but no AVX2 (Sandy Bridge): the package's binary says
    // what it needs instead of dying of SIGILL.
    let old = emulated("SandyBridge", &bin, &["--version"]);
    let said = String::from_utf8_lossy(&old.stderr);
    assert_eq!(old.status.code(), Some(1), "{said}");
    assert!(
        said.contains("avx2") && said.contains("make build"),
        "{said}"
    );

    // On Haswell it serves. Rates given: calibration under emulation would
    // measure the emulator.
    let mut program: Vec<PathBuf> = qemu("Haswell");
    program.push(bin);
    let program: Vec<&Path> = program.iter().map(PathBuf::as_path).collect();
    let srv = Server::launch(
        &program,
        &model_path(),
        &[
            "--mu-prefill",
            "50",
            "--mu-decode",
            "10",
            "--parallel",
            "1",
            "--ctx",
            "1024",
        ],
        &[],
    );
    let v = srv.post_ok(
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 2}),
    );
    assert_eq!(v["usage"]["completion_tokens"], 2);
}

/// A box with Debian 12's apt Rust (cargo 1.63) and no rustup: `make serve`
/// stops before installing or building anything, with a sentence naming the
/// version needed and how to get it.
#[test]
fn make_serve_with_an_old_cargo_stops_with_the_version_it_needs() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("old-rust");
    let _ = std::fs::remove_dir_all(&dir);
    let bin = dir.join("bin");
    let home = dir.join("home");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(&home).unwrap();
    for (tool, says) in [("cargo", "cargo 1.63.0"), ("rustc", "rustc 1.63.0")] {
        let path = bin.join(tool);
        std::fs::write(&path, format!("#!/bin/sh\necho '{says}'\n")).unwrap();
        run(Command::new("chmod").arg("755").arg(&path));
    }
    let out = Command::new("make")
        .arg("-C")
        .arg(env!("CARGO_MANIFEST_DIR"))
        .arg("serve")
        .env_clear()
        .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
        .env("HOME", &home)
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{said}");
    let need = format!(
        "sluice needs Rust {} or newer",
        env!("CARGO_PKG_RUST_VERSION")
    );
    assert!(said.contains(&need), "{said}");
    assert!(
        said.contains("cargo (1.63)") && said.contains("rustup"),
        "{said}"
    );
    assert!(
        !said.contains("installing") && !said.contains("Compiling"),
        "{said}"
    );
}
