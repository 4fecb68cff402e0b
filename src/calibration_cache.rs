//! What start-up measured, kept for the next start: the flash attention and
//! KV type pairing and the service rates, per CPU, model file, build and the
//! settings they depend on (threads, parallel sequences, context, layout).
//!
//! Measuring costs seconds (timing four attention pairings took 3.8 s on the
//! 2-core Xeon and 11.8 s on a 2-core EPYC; the rates 0.9 and 2.4 s), and the
//! answer only changes with the machine, the model or the build. So a start
//! that finds its key here uses what was kept and is ready once the model is
//! loaded; the rates are refined online from the steps the engine runs (as
//! they always are), and the refined ones are kept again when sluice stops.
//! The attention pairings are timed only by `sluice serve --calibrate-only`
//! (the long measurement, ahead of time); until then a start uses the first
//! candidate, never far from the fastest on any CPU measured. The
//! timings are kept too, and each stop adds the tokens the engine served
//! (with their depth): a later start chooses among the timed pairings by
//! what they would have cost for those tokens (`engine::served`).
//!
//! The file is JSON (`{"version": 1, "entries": [...]}`), at most
//! `ENTRIES_MAX` entries, the newest first; a file that cannot be read or
//! parsed is treated as empty, and one that cannot be written costs only the
//! next start's measurement (logged).

use crate::engine::calibration::Calibration;
use crate::engine::served::{choice_for, lone_trade, DepthTiming, Served};
use crate::ffi::{FlashAttn, KvLayout, KvType};
use crate::startup::pairing_name;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// Entries kept in one file: one per machine, model, build and settings.
pub const ENTRIES_MAX: usize = 32;
/// The model file's head hashed whole: the GGUF header, its metadata (the
/// tokenizer's vocabulary among it) and the tensor table.
const MODEL_HEAD_BYTES: u64 = 4 << 20;
/// Samples of the tensor data hashed beside the head, evenly spaced.
const MODEL_SAMPLES: u64 = 16;
const MODEL_SAMPLE_BYTES: u64 = 64 << 10;
const FILE_VERSION: u32 = 1;

/// What a measurement depends on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Key {
    /// The CPU's model name and a hash of its feature flags.
    pub cpu: String,
    /// The model file's size and a hash of its head and samples.
    pub model: String,
    /// sluice's version, commit and the CPU features llama.cpp was built for.
    pub build: String,
    pub threads: usize,
    pub parallel: usize,
    pub n_ctx: usize,
    pub n_batch: usize,
    pub kv_layout: String,
    /// The attention pairings the flags leave open, in order.
    pub candidates: Vec<String>,
}

/// What was measured for a key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    pub key: Key,
    /// The pairing in use: `off/q8_0/f16` (flash attention / KV type).
    pub attention: String,
    /// Whether the pairing was chosen by timing the candidates.
    pub attention_measured: bool,
    pub prefill_tok_s: f64,
    pub decode_tok_s_batch_1: f64,
    pub decode_tok_s_parallel: f64,
    pub save_s_per_run: Option<f64>,
    /// Seconds since the epoch of the last write.
    pub written_unix_s: u64,
    /// The rates are the engine's online refinement, kept at a stop.
    pub refined: bool,
    /// What `--calibrate-only` timed: each candidate's per-token timings by
    /// depth, in `key.candidates`' order (none when nothing was timed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attention_timings: Vec<Vec<DepthTiming>>,
    /// The tokens served since the timings, added at each stop: the next
    /// start weighs the timings by them (`engine::served`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served: Option<Served>,
}

impl Entry {
    pub fn new(key: Key, pairing: (FlashAttn, KvType), measured: bool, c: &Calibration) -> Entry {
        Entry {
            key,
            attention: pairing_name(pairing),
            attention_measured: measured,
            prefill_tok_s: c.prefill_tok_s,
            decode_tok_s_batch_1: c.decode_tok_s_batch_1,
            decode_tok_s_parallel: c.decode_tok_s_parallel,
            save_s_per_run: c.save_s_per_run,
            written_unix_s: now_unix_s(),
            refined: false,
            attention_timings: Vec::new(),
            served: None,
        }
    }

    /// The pairing to serve with: the one kept, or, when it was timed and
    /// enough tokens were served since, the candidate that would have served
    /// them at `FLASH_ATTN_GAIN_MIN` less cost (`served::choice_for`).
    pub fn serving_pairing(&self) -> Option<(FlashAttn, KvType)> {
        let kept = self.pairing()?;
        let (Some(served), true) = (self.served, self.attention_measured) else {
            return Some(kept);
        };
        let names = &self.key.candidates;
        let Some(at) = names.iter().position(|n| *n == self.attention) else {
            return Some(kept);
        };
        if self.attention_timings.len() != names.len() {
            return Some(kept);
        }
        let chosen = choice_for(&self.attention_timings, &served, at);
        Some(parse_pairing(&names[chosen]).unwrap_or(kept))
    }

    /// Where a prompt prefilled alone goes faster in the short requests'
    /// context (flash attention on, f16) than with `main`, the pairing
    /// served with, by the whole chunks both were timed prefilling
    /// (`served::prefills_whole_faster`): the answer tokens one prompt token
    /// pays for there (`served::lone_trade`). `None` when it is not faster,
    /// or either was not timed so.
    pub fn short_lone_trade(&self, main: (FlashAttn, KvType)) -> Option<f64> {
        let timings = |p: (FlashAttn, KvType)| {
            let at = self
                .key
                .candidates
                .iter()
                .position(|n| *n == pairing_name(p))?;
            self.attention_timings.get(at)
        };
        match (timings(main), timings((FlashAttn::On, KvType::F16))) {
            (Some(m), Some(s)) if self.attention_timings.len() == self.key.candidates.len() => {
                lone_trade(m, s)
            }
            _ => None,
        }
    }

    /// The pairing kept, if it still parses.
    pub fn pairing(&self) -> Option<(FlashAttn, KvType)> {
        parse_pairing(&self.attention)
    }

    /// The kept rates as a calibration, if they are usable.
    pub fn calibration(&self) -> Option<Calibration> {
        let ok = |r: f64| r.is_finite() && r > 0.0;
        let rates = [
            self.prefill_tok_s,
            self.decode_tok_s_batch_1,
            self.decode_tok_s_parallel,
        ];
        rates.into_iter().all(ok).then_some(Calibration {
            prefill_tok_s: self.prefill_tok_s,
            decode_tok_s_batch_1: self.decode_tok_s_batch_1,
            decode_tok_s_parallel: self.decode_tok_s_parallel,
            parallel: self.key.parallel,
            save_s_per_run: self.save_s_per_run.filter(|s| s.is_finite() && *s >= 0.0),
            seconds: 0.0,
        })
    }
}

/// A pairing from its name (`pairing_name`): `off/q8_0/f16`.
fn parse_pairing(name: &str) -> Option<(FlashAttn, KvType)> {
    let (fa, kv) = name.split_once('/')?;
    let fa = match fa {
        "off" => FlashAttn::Off,
        "on" => FlashAttn::On,
        "auto" => FlashAttn::Auto,
        _ => return None,
    };
    Some((fa, KvType::from_name(kv)?))
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct File {
    version: u32,
    entries: Vec<Entry>,
}

/// The entry for `key` in the file at `path`, if there is one.
pub fn find(path: &Path, key: &Key) -> Option<Entry> {
    read(path).entries.into_iter().find(|e| &e.key == key)
}

/// Keeps `entry` (replacing the one of its key) as the newest of at most
/// `ENTRIES_MAX`; written to a temporary file and renamed, so that a reader
/// never sees half a file.
pub fn store(path: &Path, mut entry: Entry) -> Result<(), String> {
    entry.written_unix_s = now_unix_s();
    let mut file = read(path);
    file.version = FILE_VERSION;
    file.entries.retain(|e| e.key != entry.key);
    file.entries.insert(0, entry);
    file.entries.truncate(ENTRIES_MAX);
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let text = serde_json::to_string_pretty(&file).map_err(|e| e.to_string())?;
    let tmp = path.with_extension(format!("json.{}.tmp", std::process::id()));
    std::fs::write(&tmp, text).map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("{}: {e}", path.display()))
}

fn read(path: &Path) -> File {
    std::fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice::<File>(&b).ok())
        .filter(|f| f.version == FILE_VERSION)
        .unwrap_or_default()
}

fn now_unix_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The key of this start: the machine, the model file, the build and the
/// settings a measurement depends on.
pub struct KeyParts<'a> {
    pub model: &'a Path,
    pub threads: usize,
    pub parallel: usize,
    pub n_ctx: usize,
    pub n_batch: usize,
    pub kv_layout: KvLayout,
    pub candidates: &'a [(FlashAttn, KvType)],
}

impl KeyParts<'_> {
    pub fn key(&self) -> Result<Key, String> {
        Ok(Key {
            cpu: cpu_identity(),
            model: model_fingerprint(self.model)?,
            build: format!(
                "{} {} {}",
                env!("CARGO_PKG_VERSION"),
                env!("SLUICE_GIT_COMMIT"),
                env!("SLUICE_TARGET_FEATURES")
            ),
            threads: self.threads,
            parallel: self.parallel,
            n_ctx: self.n_ctx,
            n_batch: self.n_batch,
            kv_layout: match self.kv_layout {
                KvLayout::PerSequence => "per-seq".into(),
                KvLayout::Unified => "unified".into(),
            },
            candidates: self.candidates.iter().map(|&p| pairing_name(p)).collect(),
        })
    }
}

/// The CPU's model name and a hash of its feature flags (`/proc/cpuinfo`'s
/// first processor): two VMs on one host model may be given different
/// features.
fn cpu_identity() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find(|l| l.split(':').next().is_some_and(|k| k.trim() == name))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_default()
    };
    let model = match field("model name") {
        m if m.is_empty() => std::env::consts::ARCH.to_string(),
        m => m,
    };
    let flags = Sha256::digest(field("flags").as_bytes());
    format!("{model} flags:{}", hex(&flags[..8]))
}

/// The model file's size and a SHA-256 over its head and evenly spaced
/// samples of its tensor data: milliseconds for any size, and a different
/// file of the same size differs in its header or its weights.
pub fn model_fingerprint(path: &Path) -> Result<String, String> {
    let mut f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let size = f
        .metadata()
        .map_err(|e| format!("{}: {e}", path.display()))?
        .len();
    let mut h = Sha256::new();
    h.update(size.to_le_bytes());
    let mut buf = Vec::new();
    let mut take = |f: &mut std::fs::File, at: u64, n: u64| -> std::io::Result<()> {
        f.seek(SeekFrom::Start(at))?;
        buf.clear();
        f.take(n).read_to_end(&mut buf)?;
        h.update(&buf);
        Ok(())
    };
    let read = |e: std::io::Error| format!("{}: {e}", path.display());
    take(&mut f, 0, MODEL_HEAD_BYTES).map_err(read)?;
    if size > MODEL_HEAD_BYTES {
        let span = size - MODEL_HEAD_BYTES;
        for i in 0..MODEL_SAMPLES {
            let at = MODEL_HEAD_BYTES + span * i / MODEL_SAMPLES;
            take(&mut f, at, MODEL_SAMPLE_BYTES).map_err(read)?;
        }
    }
    Ok(format!("{size} bytes sha256:{}", hex(&h.finalize()[..16])))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// This start's place in the cache: the file, its key, and what was kept
/// under it (none with `--calibrate-only`, which measures anew).
pub struct Kept {
    path: PathBuf,
    key: Key,
    pub entry: Option<Entry>,
}

impl Kept {
    /// The cache's entry for this start, or `None` with the cache off (or a
    /// model file that cannot be read, which loading reports).
    pub fn look_up(cfg: &crate::config::Config, n_ctx: usize) -> Option<Kept> {
        let path = cfg.calibration_cache.clone()?;
        let candidates = crate::startup::attention_candidates(cfg.flash_attn, cfg.kv_type);
        let parts = KeyParts {
            model: &cfg.model,
            threads: cfg.cpus.len(),
            parallel: cfg.parallel,
            n_ctx,
            n_batch: cfg.n_batch(),
            kv_layout: cfg.kv_layout,
            candidates: &candidates,
        };
        let key = match parts.key() {
            Ok(k) => k,
            Err(e) => {
                crate::say!("sluice: calibration cache: not used ({e})");
                return None;
            }
        };
        let entry = match cfg.calibrate_only {
            true => None,
            false => find(&path, &key),
        };
        Some(Kept { path, key, entry })
    }

    /// Logs where the attention pairing came from, and keeps what was
    /// measured now (the pairing, the rates, and `timings`, the pairings'
    /// timings if they were timed now).
    pub fn report(
        mut self,
        pairing: (FlashAttn, KvType),
        measured: bool,
        calibration: Option<&Calibration>,
        from_cache: bool,
        timings: &[Vec<DepthTiming>],
    ) -> Kept {
        let name = pairing_name(pairing);
        match (&self.entry, measured) {
            (Some(e), true) if e.attention_measured && e.attention == name => crate::say!(
                "sluice: attention: flash attention/KV type {name} (measured before, from the calibration cache {})",
                self.path.display()
            ),
            (Some(e), true) if e.attention_measured => {
                let s = e.served.unwrap_or_default();
                crate::say!(
                    "sluice: attention: flash attention/KV type {name}, not {} (measured before; chosen anew for the tokens served since: {:.0} prompt tokens {:.0} deep on average, {:.0} decode tokens {:.0} deep; calibration cache {})",
                    e.attention,
                    s.prefill_tokens,
                    s.prefill_depth_mean,
                    s.decode_tokens,
                    s.decode_depth_mean,
                    self.path.display()
                );
                self = self.keep_pairing(&name);
            }
            (_, true) => {}
            (_, false) if self.key.candidates.len() > 1 => crate::say!(
                "sluice: attention: flash attention/KV type {name}, the first candidate (not timed on this machine; `sluice serve --calibrate-only` times {} and keeps the choice)",
                self.key.candidates.join(", ")
            ),
            (_, false) => {}
        }
        let Some(c) = calibration else {
            return self;
        };
        let fresh = !from_cache
            || self
                .entry
                .as_ref()
                .is_some_and(|e| e.attention_measured != measured);
        if fresh {
            let mut entry = Entry::new(self.key.clone(), pairing, measured, c);
            // Timed now, or before (the rates measured anew): the timings,
            // and the tokens served since them, stay.
            match (&self.entry, timings.is_empty()) {
                (Some(old), true) if measured => {
                    entry.attention_timings = old.attention_timings.clone();
                    entry.served = old.served;
                }
                _ => entry.attention_timings = timings.to_vec(),
            }
            match store(&self.path, entry.clone()) {
                Ok(()) => crate::say!(
                    "sluice: calibration cache: kept in {} for the next start",
                    self.path.display()
                ),
                Err(e) => crate::say!("sluice: calibration cache: could not keep it ({e})"),
            }
            return Kept {
                entry: Some(entry),
                ..self
            };
        }
        self
    }

    /// The entry's pairing becomes `name` (chosen anew at this start), kept
    /// at once: a start after a crash chooses from the same counts.
    fn keep_pairing(mut self, name: &str) -> Kept {
        if let Some(e) = self.entry.as_mut() {
            e.attention = name.to_string();
            if let Err(e) = store(&self.path, e.clone()) {
                crate::say!("sluice: calibration cache: could not keep the pairing ({e})");
            }
        }
        self
    }

    /// At a stop: the rates the engine refined online replace the kept ones
    /// (the batch-1 decode rate and the save cost stay as measured), and
    /// the tokens `served` are added to the kept ones where pairings were
    /// timed.
    pub fn keep_refined(
        self,
        c: &Calibration,
        prefill_tok_s: f64,
        decode_tok_s: f64,
        served: Served,
    ) {
        let Some(mut entry) = self.entry else {
            return;
        };
        let usable = |r: f64| r.is_finite() && r > 0.0;
        if !usable(prefill_tok_s) || !usable(decode_tok_s) {
            return;
        }
        entry.prefill_tok_s = prefill_tok_s;
        entry.decode_tok_s_parallel = decode_tok_s;
        entry.decode_tok_s_batch_1 = c.decode_tok_s_batch_1;
        entry.refined = true;
        if !entry.attention_timings.is_empty() && served.is_usable() {
            let kept = entry.served.filter(Served::is_usable).unwrap_or_default();
            entry.served = Some(kept.then(served));
        }
        match store(&self.path, entry) {
            Ok(()) => crate::say!(
                "sluice: calibration cache: the rates refined online (prefill {prefill_tok_s:.0} tok/s, decode {decode_tok_s:.1} tok/s) kept in {}",
                self.path.display()
            ),
            Err(e) => crate::say!("sluice: calibration cache: could not keep the refined rates ({e})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(parallel: usize) -> Key {
        Key {
            cpu: "cpu".into(),
            model: "model".into(),
            build: "build".into(),
            threads: 2,
            parallel,
            n_ctx: 8192,
            n_batch: 512,
            kv_layout: "per-seq".into(),
            candidates: vec!["off/q8_0/f16".into(), "off/f16".into()],
        }
    }

    fn calibration(prefill: f64) -> Calibration {
        Calibration {
            prefill_tok_s: prefill,
            decode_tok_s_batch_1: 100.0,
            decode_tok_s_parallel: 200.0,
            parallel: 4,
            save_s_per_run: Some(2e-5),
            seconds: 1.0,
        }
    }

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("sluice-cc-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir.join("sub").join("calibration.json")
    }

    #[test]
    fn an_entry_is_found_by_its_whole_key_and_replaced_by_a_newer_one() {
        let path = temp("replace");
        assert!(find(&path, &key(4)).is_none(), "no file: nothing cached");
        let pairing = (FlashAttn::Off, KvType::Q8_0KeysF16Values);
        store(
            &path,
            Entry::new(key(4), pairing, false, &calibration(700.0)),
        )
        .unwrap();
        store(
            &path,
            Entry::new(key(2), pairing, true, &calibration(500.0)),
        )
        .unwrap();
        let e = find(&path, &key(4)).expect("kept");
        assert_eq!(e.pairing(), Some(pairing));
        assert_eq!(e.calibration().unwrap().prefill_tok_s, 700.0);
        assert!(!e.attention_measured);
        assert!(find(
            &path,
            &Key {
                threads: 1,
                ..key(4)
            }
        )
        .is_none());
        store(
            &path,
            Entry::new(key(4), pairing, true, &calibration(800.0)),
        )
        .unwrap();
        let e = find(&path, &key(4)).expect("kept");
        assert_eq!(e.calibration().unwrap().prefill_tok_s, 800.0);
        assert_eq!(read(&path).entries.len(), 2, "one entry per key");
        let _ = std::fs::remove_dir_all(path.parent().unwrap().parent().unwrap());
    }

    #[test]
    fn the_file_keeps_the_newest_entries_and_a_broken_one_reads_as_empty() {
        let path = temp("bounded");
        let pairing = (FlashAttn::On, KvType::F16);
        for p in 1..=ENTRIES_MAX + 5 {
            store(&path, Entry::new(key(p), pairing, true, &calibration(1.0))).unwrap();
        }
        let f = read(&path);
        assert_eq!(f.entries.len(), ENTRIES_MAX);
        assert_eq!(f.entries[0].key.parallel, ENTRIES_MAX + 5, "newest first");
        assert!(find(&path, &key(1)).is_none(), "the oldest made room");
        std::fs::write(&path, "{not json").unwrap();
        assert!(find(&path, &key(ENTRIES_MAX + 5)).is_none());
        store(&path, Entry::new(key(1), pairing, true, &calibration(1.0))).unwrap();
        assert!(find(&path, &key(1)).is_some(), "a broken file is rewritten");
        let _ = std::fs::remove_dir_all(path.parent().unwrap().parent().unwrap());
    }

    #[test]
    fn unusable_rates_are_not_a_calibration() {
        let pairing = (FlashAttn::Off, KvType::F16);
        let mut e = Entry::new(key(4), pairing, true, &calibration(700.0));
        assert!(e.calibration().is_some());
        e.decode_tok_s_parallel = 0.0;
        assert!(e.calibration().is_none());
        e.decode_tok_s_parallel = f64::NAN;
        assert!(e.calibration().is_none());
        e.attention = "sideways/f16".into();
        assert_eq!(e.pairing(), None);
    }

    #[test]
    fn the_tokens_served_choose_among_the_timed_pairings() {
        let t = |depth: usize, decode_ms: f64, prefill_ms: f64| DepthTiming {
            depth,
            timing: crate::engine::calibration::AttentionTiming {
                decode_s_per_token: decode_ms / 1e3,
                prefill_s_per_token: prefill_ms / 1e3,
                whole_prefill_s_per_token: None,
            },
        };
        // key(4)'s candidates: off/q8_0/f16, then off/f16, the one kept;
        // K in q8_0 is half as dear deep in a context, a tie at a chat's.
        let (q8, f16) = (
            (FlashAttn::Off, KvType::Q8_0KeysF16Values),
            (FlashAttn::Off, KvType::F16),
        );
        let mut e = Entry::new(key(4), f16, true, &calibration(700.0));
        e.attention_timings = vec![
            vec![t(128, 8.5, 5.7), t(1024, 10.0, 9.0)],
            vec![t(128, 8.4, 5.8), t(1024, 12.0, 18.0)],
        ];
        assert_eq!(e.serving_pairing(), Some(f16), "nothing served yet");
        let deep = Served {
            prefill_tokens: 50_000.0,
            prefill_depth_mean: 2_500.0,
            decode_tokens: 5_000.0,
            decode_depth_mean: 5_000.0,
        };
        e.served = Some(deep);
        assert_eq!(e.serving_pairing(), Some(q8));
        let chats = Served {
            prefill_depth_mean: 60.0,
            decode_depth_mean: 150.0,
            ..deep
        };
        e.served = Some(chats);
        assert_eq!(e.serving_pairing(), Some(f16), "a tie keeps the pairing");
        e.served = Some(deep);
        e.attention_timings.pop();
        assert_eq!(e.serving_pairing(), Some(f16), "timings missing");
        e.attention_timings = vec![Vec::new(), Vec::new()];
        assert_eq!(e.serving_pairing(), Some(f16), "timings empty");
        e.attention_measured = false;
        assert_eq!(e.serving_pairing(), Some(f16), "not timed");
    }

    #[test]
    fn the_whole_chunks_kept_say_where_a_prompt_alone_goes_faster() {
        let t = |depth: usize, whole_ms: Option<f64>| DepthTiming {
            depth,
            timing: crate::engine::calibration::AttentionTiming {
                decode_s_per_token: 0.01,
                prefill_s_per_token: 0.006,
                whole_prefill_s_per_token: whole_ms.map(|ms| ms / 1e3),
            },
        };
        let q8 = (FlashAttn::Off, KvType::Q8_0KeysF16Values);
        let on_f16 = (FlashAttn::On, KvType::F16);
        let mut k = key(4);
        k.candidates = vec!["off/q8_0/f16".into(), "on/f16".into()];
        let mut e = Entry::new(k, q8, true, &calibration(700.0));
        assert!(e.short_lone_trade(q8).is_none(), "nothing timed");
        e.attention_timings = vec![
            vec![t(128, None), t(1024, Some(6.3))],
            vec![t(128, None), t(1024, Some(5.4))],
        ];
        assert_eq!(
            e.short_lone_trade(q8),
            Some(f64::INFINITY),
            "decoding no dearer"
        );
        assert!(e.short_lone_trade(on_f16).is_none(), "itself");
        assert!(
            e.short_lone_trade((FlashAttn::Off, KvType::F16)).is_none(),
            "not a candidate timed"
        );
        e.attention_timings[1][1] = t(1024, Some(7.0));
        assert!(e.short_lone_trade(q8).is_none(), "slower");
        e.attention_timings[1][1] = t(1024, None);
        assert!(e.short_lone_trade(q8).is_none(), "an older cache's");
        e.attention_timings.pop();
        assert!(e.short_lone_trade(q8).is_none(), "timings missing");
    }

    #[test]
    fn an_entry_from_before_the_timings_were_kept_still_reads() {
        let path = temp("older");
        let pairing = (FlashAttn::Off, KvType::F16);
        let mut v =
            serde_json::to_value(Entry::new(key(4), pairing, true, &calibration(1.0))).unwrap();
        let fields = v.as_object_mut().unwrap();
        assert!(!fields.contains_key("attention_timings") && !fields.contains_key("served"));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(
            &path,
            serde_json::json!({"version": 1, "entries": [v]}).to_string(),
        )
        .unwrap();
        let e = find(&path, &key(4)).expect("read");
        assert!(e.attention_timings.is_empty() && e.served.is_none());
        assert_eq!(e.serving_pairing(), Some(pairing));
        let _ = std::fs::remove_dir_all(path.parent().unwrap().parent().unwrap());
    }

    #[test]
    fn a_model_fingerprint_changes_with_the_bytes() {
        let dir = std::env::temp_dir().join(format!("sluice-fp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let a = dir.join("a.gguf");
        let mut bytes = vec![7u8; (MODEL_HEAD_BYTES as usize) * 2];
        std::fs::write(&a, &bytes).unwrap();
        let fa = model_fingerprint(&a).unwrap();
        assert_eq!(fa, model_fingerprint(&a).unwrap(), "stable");
        bytes[MODEL_HEAD_BYTES as usize] = 8;
        std::fs::write(&a, &bytes).unwrap();
        assert_ne!(
            fa,
            model_fingerprint(&a).unwrap(),
            "a sampled weight changed"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
