//! The floors of the code, checked on its text: no module imports one on
//! its own floor or above (so no circle), no file is over 700 lines, no
//! function over 100, and `unsafe` is allowed in `ffi` alone. ARCHITECTURE.md
//! ("Code map") lists the same floors.

use std::fs;
use std::path::{Path, PathBuf};

/// sluice's modules from the bottom floor up; a module may use only modules
/// of lower floors. `lib.rs` (the crate root, which declares them) and
/// `main.rs` (the binary, which runs `app`) stand above them all.
const FLOORS: &[&[&str]] = &[
    &["log", "notify", "priority", "embed", "door"],
    &["ffi"],
    &["batch", "cpu", "grammar", "stream", "template"],
    &["metrics"],
    &["admission", "ratelimit"],
    &["engine", "auth"],
    &["config"],
    &["startup", "calibrate", "http"],
    &["calibration_cache"],
    &["app"],
];

const FILE_LINES_MAX: usize = 700;
const FUNCTION_LINES_MAX: usize = 100;

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`, with its path relative to `src/`.
fn rust_files(dir: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for entry in fs::read_dir(&d).expect("src/ is readable") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path
                    .strip_prefix(src())
                    .expect("under src/")
                    .to_string_lossy()
                    .into_owned();
                let text = fs::read_to_string(&path).expect("a readable source file");
                out.push((rel, text));
            }
        }
    }
    out.sort();
    out
}

/// The module a file belongs to: `engine` for `engine/seq.rs`, `app` for
/// `app.rs` or `app/mod.rs`.
fn module_of(rel: &str) -> &str {
    let first = rel.split('/').next().unwrap_or(rel);
    first.strip_suffix(".rs").unwrap_or(first)
}

fn floor_of(module: &str) -> Option<usize> {
    FLOORS.iter().position(|f| f.contains(&module))
}

/// The crate modules `text` names as `crate::name` (`say` is the crate
/// root's macro, which writes through `log`).
fn crate_uses(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().next_back();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            out.push(if name == "say" { "log".into() } else { name });
        }
    }
    out
}

#[test]
fn no_module_uses_one_on_its_own_floor_or_above() {
    let mut wrong = Vec::new();
    for (rel, text) in rust_files(&src()) {
        let from = module_of(&rel);
        if from == "lib" || from == "main" {
            continue;
        }
        let Some(own) = floor_of(from) else {
            wrong.push(format!(
                "{rel}: module `{from}` is on no floor (add it to FLOORS)"
            ));
            continue;
        };
        for to in crate_uses(&text) {
            if to == from {
                continue;
            }
            match floor_of(&to) {
                Some(f) if f < own => {}
                Some(f) => wrong.push(format!(
                    "{rel}: `{from}` (floor {own}) uses `{to}` (floor {f})"
                )),
                None => wrong.push(format!("{rel}: uses `{to}`, which is on no floor")),
            }
        }
    }
    wrong.dedup();
    assert!(
        wrong.is_empty(),
        "imports that run sideways or up:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn every_module_of_the_crate_root_has_a_floor() {
    let lib = fs::read_to_string(src().join("lib.rs")).expect("src/lib.rs");
    let declared: Vec<&str> = lib
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            l.strip_prefix("mod ")?.strip_suffix(';')
        })
        .collect();
    assert!(
        declared.len() >= 10,
        "read the modules of lib.rs: {declared:?}"
    );
    let missing: Vec<&&str> = declared.iter().filter(|m| floor_of(m).is_none()).collect();
    assert!(missing.is_empty(), "modules on no floor: {missing:?}");
}

#[test]
fn no_file_is_over_700_lines() {
    let long: Vec<String> = rust_files(&src())
        .into_iter()
        .map(|(rel, text)| (rel, text.lines().count()))
        .filter(|&(_, n)| n > FILE_LINES_MAX)
        .map(|(rel, n)| format!("{rel}: {n} lines"))
        .collect();
    assert!(
        long.is_empty(),
        "files over {FILE_LINES_MAX} lines:\n{}",
        long.join("\n")
    );
}

/// Each function's (name, lines) in `text`, as rustfmt lays it out: from its
/// `fn` line to the closing brace at the same indentation.
fn functions(text: &str) -> Vec<(String, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let body = line.trim_start();
        let indent = &line[..line.len() - body.len()];
        let mut words = body.split_whitespace().peekable();
        let mut name = None;
        while let Some(w) = words.next() {
            let qualifier = w.starts_with("pub")
                || ["const", "async", "unsafe", "extern", "\"C\""].contains(&w);
            if w == "fn" {
                name = words.peek().map(|n| {
                    n.chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect::<String>()
                });
                break;
            }
            if !qualifier {
                break;
            }
        }
        let Some(name) = name.filter(|n| !n.is_empty()) else {
            continue;
        };
        // Where the signature ends: at a body's `{`, or at a declaration's
        // `;` (a trait's method without a default).
        let Some(open) = lines[i..]
            .iter()
            .position(|l| l.ends_with('{') || l.ends_with(';') || l.ends_with('}'))
        else {
            continue;
        };
        if !lines[i + open].ends_with('{') {
            continue;
        }
        let close = format!("{indent}}}");
        if let Some(end) = lines[i + 1..].iter().position(|l| *l == close) {
            out.push((name, end + 2));
        }
    }
    out
}

#[test]
fn no_function_is_over_100_lines() {
    let mut long = Vec::new();
    for (rel, text) in rust_files(&src()) {
        for (name, n) in functions(&text) {
            if n > FUNCTION_LINES_MAX {
                long.push(format!("{rel}: fn {name} is {n} lines"));
            }
        }
    }
    assert!(
        long.is_empty(),
        "functions over {FUNCTION_LINES_MAX} lines:\n{}",
        long.join("\n")
    );
}

#[test]
fn the_function_reader_measures_what_rustfmt_writes() {
    let text = "fn a() {\n    x();\n}\n\npub(crate) fn b(\n    y: u8,\n) -> u8 {\n    y\n}\n    fn c() {}\nimpl T {\n    pub const unsafe fn d() {\n        1;\n    }\n}\ntrait U {\n    fn e(\n        z: u8,\n    ) -> u8;\n}\n";
    assert_eq!(
        functions(text),
        vec![("a".into(), 3), ("b".into(), 5), ("d".into(), 3)]
    );
    assert_eq!(
        crate_uses("use crate::ffi::X; $crate::log::line; crate::say!(); notcrate::a"),
        vec!["ffi".to_string(), "log".to_string()]
    );
}

#[test]
fn unsafe_code_is_allowed_in_ffi_alone() {
    let lib = fs::read_to_string(src().join("lib.rs")).expect("src/lib.rs");
    assert!(
        lib.contains("#![deny(unsafe_code)]"),
        "lib.rs denies unsafe code"
    );
    let main = fs::read_to_string(src().join("main.rs")).expect("src/main.rs");
    assert!(
        main.contains("#![forbid(unsafe_code)]"),
        "main.rs forbids unsafe code"
    );
    let allowed: Vec<String> = rust_files(&src())
        .into_iter()
        .flat_map(|(rel, text)| {
            text.lines()
                .enumerate()
                .filter(|(_, l)| l.contains("allow(unsafe_code)"))
                .map(|(i, l)| format!("{rel}:{}: {}", i + 1, l.trim()))
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(allowed.len(), 1, "one allowance, on `mod ffi`: {allowed:?}");
    let at = lib
        .find("#[allow(unsafe_code)]")
        .expect("the allowance is in lib.rs");
    assert!(
        lib[at..].lines().nth(1) == Some("mod ffi;"),
        "the allowance sits on `mod ffi;`"
    );
}
