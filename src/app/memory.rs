//! What the server may hold in memory, said at start-up from the model, and
//! held against the memory limit of its cgroup (systemd's `MemoryMax`, or a
//! container's), so a
//! limit the KV cache would break is a warning at start, not a kill by the
//! kernel hours later when the cells fill up.
//!
//! The bound: what is resident once start-up is done (the weights, read and
//! repacked; compute buffers; tokenizer and grammar tables), plus the KV
//! cells, which become resident only as they are written (`ffi::lazy_zero`),
//! plus the prefix cache's budget.

use crate::ffi::{KvType, Model};

const MIB: f64 = (1u64 << 20) as f64;

/// Bytes one KV cell takes across all layers: K and V rows of
/// `head_count_kv · key_length` (`value_length`) elements each. From the
/// GGUF's `<arch>.*` keys; the head size defaults to the embedding over the
/// heads. `None` when the GGUF lacks what it takes.
pub fn kv_bytes_per_cell(meta: impl Fn(&str) -> Option<String>, kv: KvType) -> Option<f64> {
    let arch = meta("general.architecture")?;
    let num = |key: &str| -> Option<f64> { meta(&format!("{arch}.{key}"))?.trim().parse().ok() };
    let layers = num("block_count")?;
    let heads = num("attention.head_count")?;
    // Some GGUFs give the KV heads per layer (an array): then not estimated.
    let heads_kv = num("attention.head_count_kv").unwrap_or(heads);
    let head_k = num("attention.key_length").or_else(|| Some(num("embedding_length")? / heads))?;
    let head_v = num("attention.value_length").unwrap_or(head_k);
    let (k, v) = kv.element_bytes();
    Some(layers * heads_kv * (head_k * k + head_v * v))
}

/// This process's resident memory, in bytes (`VmRSS`).
fn resident_bytes() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024.0)
}

/// The memory limit of this process's cgroup, if it has one: v2's
/// `memory.max` (systemd's `MemoryMax`), or v1's `memory.limit_in_bytes`.
fn cgroup_limit_bytes() -> Option<f64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    own.lines().find_map(|line| {
        let (file, path) = if let Some(path) = line.strip_prefix("0::") {
            ("memory.max", format!("/sys/fs/cgroup{path}"))
        } else {
            let (_, rest) = line.split_once(':')?;
            let path = rest.strip_prefix("memory:")?;
            (
                "memory.limit_in_bytes",
                format!("/sys/fs/cgroup/memory{path}"),
            )
        };
        parse_memory_max(&std::fs::read_to_string(format!("{path}/{file}")).ok()?)
    })
}

/// Above this a limit is none (v1 writes "no limit" as 2^63 rounded down
/// to a page).
const LIMIT_NONE_BYTES: u64 = 1 << 62;

/// A limit file's text: a byte count, or `max` / a huge number (no limit).
pub fn parse_memory_max(text: &str) -> Option<f64> {
    let bytes = text.trim().parse::<u64>().ok()?;
    (bytes < LIMIT_NONE_BYTES).then_some(bytes as f64)
}

/// What start-up says of memory: the bound's parts, and a warning when it is
/// over the cgroup's limit.
pub struct Bound {
    pub resident: f64,
    pub kv_cells: usize,
    pub kv_bytes_per_cell: Option<f64>,
    pub prefix_cache: f64,
    pub limit: Option<f64>,
}

impl Bound {
    pub fn total(&self) -> Option<f64> {
        Some(self.resident + self.kv_cells as f64 * self.kv_bytes_per_cell? + self.prefix_cache)
    }

    pub fn lines(&self) -> Vec<String> {
        let limit = match self.limit {
            Some(l) => format!(
                "this cgroup's memory limit (MemoryMax) is {:.0} MiB",
                l / MIB
            ),
            None => "no cgroup memory limit".into(),
        };
        let Some(total) = self.total() else {
            return vec![format!(
                "sluice: memory: {:.0} MiB resident after start, prefix cache up to {:.0} MiB, \
                 KV cells ({}) not estimated (the GGUF lacks the head sizes); {limit}",
                self.resident / MIB,
                self.prefix_cache / MIB,
                self.kv_cells
            )];
        };
        let per_cell = self.kv_bytes_per_cell.unwrap_or(0.0);
        let mut lines = vec![format!(
            "sluice: memory: {:.0} MiB resident after start (weights, buffers, tables), KV cells up \
             to {:.0} MiB ({} cells x {:.0} bytes, resident as they are written), prefix cache up \
             to {:.0} MiB: at most about {:.0} MiB; {limit}",
            self.resident / MIB,
            self.kv_cells as f64 * per_cell / MIB,
            self.kv_cells,
            per_cell,
            self.prefix_cache / MIB,
            total / MIB
        )];
        if let Some(l) = self.limit.filter(|&l| total > l) {
            lines.push(format!(
                "sluice: warning: up to {:.0} MiB may be needed but the memory limit is {:.0} MiB: \
                 the kernel will kill sluice when the KV cells fill up. Raise MemoryMax \
                 (systemctl edit sluice), or lower --parallel, --ctx or --prefix-cache-mb",
                total / MIB,
                l / MIB
            ));
        }
        lines
    }
}

/// The bound for this model and these cells, measured now.
pub fn bound(model: &Model, kv: KvType, kv_cells: usize, prefix_cache_mb: usize) -> Bound {
    Bound {
        resident: resident_bytes().unwrap_or(0.0),
        kv_cells,
        kv_bytes_per_cell: kv_bytes_per_cell(|k| model.meta(k), kv),
        prefix_cache: prefix_cache_mb as f64 * MIB,
        limit: cgroup_limit_bytes(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn smollm2() -> HashMap<String, String> {
        [
            ("general.architecture", "llama"),
            ("llama.block_count", "30"),
            ("llama.attention.head_count", "9"),
            ("llama.attention.head_count_kv", "3"),
            ("llama.embedding_length", "576"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    #[test]
    fn a_cell_of_smollm2_takes_what_the_readme_says() {
        let m = smollm2();
        let per = |kv| kv_bytes_per_cell(|k| m.get(k).cloned(), kv).unwrap();
        assert_eq!(per(KvType::F16), 23_040.0);
        assert_eq!(per(KvType::Q8_0KeysF16Values), 17_640.0);
        assert_eq!(per(KvType::Q8_0), 12_240.0);
    }

    #[test]
    fn explicit_head_sizes_win_over_embedding_over_heads() {
        // Gemma 3 270M: 18 layers, 4 heads of 256 over a 640 embedding, 1 KV head.
        let m: HashMap<String, String> = [
            ("general.architecture", "gemma3"),
            ("gemma3.block_count", "18"),
            ("gemma3.attention.head_count", "4"),
            ("gemma3.attention.head_count_kv", "1"),
            ("gemma3.attention.key_length", "256"),
            ("gemma3.attention.value_length", "256"),
            ("gemma3.embedding_length", "640"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let per = kv_bytes_per_cell(|k| m.get(k).cloned(), KvType::F16).unwrap();
        assert_eq!(per, 18.0 * 256.0 * 4.0);
        let mut none = m.clone();
        none.remove("gemma3.block_count");
        assert_eq!(
            kv_bytes_per_cell(|k| none.get(k).cloned(), KvType::F16),
            None
        );
    }

    #[test]
    fn over_the_limit_is_a_warning_naming_the_way_out() {
        let mut b = Bound {
            resident: 200.0 * MIB,
            kv_cells: 4 * 8448,
            kv_bytes_per_cell: Some(12_240.0),
            prefix_cache: 96.0 * MIB,
            limit: Some(2048.0 * MIB),
        };
        assert_eq!(b.total().map(|t| (t / MIB).round()), Some(690.0));
        assert_eq!(b.lines().len(), 1, "{:?}", b.lines());
        b.limit = Some(512.0 * MIB);
        let lines = b.lines();
        assert_eq!(lines.len(), 2);
        assert!(lines[1].contains("MemoryMax") && lines[1].contains("--parallel"));
        assert_eq!(parse_memory_max("max\n"), None);
        assert_eq!(parse_memory_max("2147483648\n"), Some(2147483648.0));
        assert_eq!(parse_memory_max("9223372036854771712\n"), None);
    }
}
