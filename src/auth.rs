//! API keys (`--api-key-file`): who may use the server, and each key's own
//! rate limit.
//!
//! The file has one key per line: a name (what logs and errors say; the key
//! itself is never logged), the key, and optional per-key overrides of the
//! client rate limit:
//!
//! ```text
//! # name      key                                    overrides
//! alice       sk-alice-7f3a9c1e5b2d4f6a8c0e          rate=200 burst=20000
//! nightly     sk-nightly-0b1c2d3e4f5a6b7c8d9e
//! ```
//!
//! A presented key is compared with every known key in time that depends on
//! neither (both are copied into fixed-size buffers and compared in full, with
//! no early exit), so response times do not reveal how much of a key was right.

use crate::ratelimit::Limit;
use std::path::Path;

/// Shortest key accepted: shorter ones can be guessed.
pub const KEY_BYTES_MIN: usize = 16;
/// Longest key accepted (the size of the comparison buffers).
pub const KEY_BYTES_MAX: usize = 256;
/// Most keys in a file: every presented key is compared with all of them.
pub const KEYS_MAX: usize = 1024;

/// One key of the file.
#[derive(Clone)]
pub struct ApiKey {
    pub name: String,
    key: [u8; KEY_BYTES_MAX],
    len: usize,
    /// Overrides of `--client-rate` / `--client-burst` for this key.
    pub rate_tok_s: Option<f64>,
    pub burst: Option<u64>,
}

impl std::fmt::Debug for ApiKey {
    // The key itself never reaches a log.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKey")
            .field("name", &self.name)
            .field("rate_tok_s", &self.rate_tok_s)
            .field("burst", &self.burst)
            .finish_non_exhaustive()
    }
}

impl ApiKey {
    /// The key itself, for a request sluice makes on its holder's behalf
    /// (a batch line); never for a log.
    pub fn secret(&self) -> &str {
        std::str::from_utf8(&self.key[..self.len]).unwrap_or("")
    }

    /// This key's bucket: its overrides over the server's default, or none if
    /// neither sets a rate.
    pub fn limit(&self, default: Option<Limit>) -> Option<Limit> {
        let rate = self.rate_tok_s.or(default.map(|d| d.rate_tok_s))?;
        let burst = self
            .burst
            .or(default
                .filter(|_| self.rate_tok_s.is_none())
                .map(|d| d.burst))
            .unwrap_or_else(|| default_burst(rate));
        Some(Limit {
            rate_tok_s: rate,
            burst,
        })
    }
}

/// A bucket's default size: a minute of its rate.
pub fn default_burst(rate_tok_s: f64) -> u64 {
    (rate_tok_s * 60.0).ceil().max(1.0) as u64
}

#[derive(Debug, Clone)]
pub struct KeyFile {
    keys: Vec<ApiKey>,
}

/// Compares two fixed buffers in full: no branch or exit depends on their bytes.
fn same(a: &[u8; KEY_BYTES_MAX], b: &[u8; KEY_BYTES_MAX]) -> bool {
    let diff = a.iter().zip(b.iter()).fold(0u8, |d, (x, y)| d | (x ^ y));
    std::hint::black_box(diff) == 0
}

impl KeyFile {
    pub fn load(path: &Path) -> Result<KeyFile, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("--api-key-file {}: {e}", path.display()))?;
        KeyFile::parse(&text).map_err(|e| format!("--api-key-file {}: {e}", path.display()))
    }

    pub fn parse(text: &str) -> Result<KeyFile, String> {
        let mut keys: Vec<ApiKey> = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let n = n + 1;
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut words = line.split_whitespace();
            let name = words.next().expect("a non-empty line has a word");
            let valid_name = name.len() <= 64
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.@".contains(c));
            if !valid_name {
                return Err(format!(
                    "line {n}: the name '{name}' must be 1 to 64 letters, digits or -_.@"
                ));
            }
            let key = words
                .next()
                .ok_or_else(|| format!("line {n}: '{name}' has no key"))?;
            if key.len() < KEY_BYTES_MIN || key.len() > KEY_BYTES_MAX {
                return Err(format!(
                    "line {n}: the key of '{name}' has {} bytes; it must have {KEY_BYTES_MIN} to {KEY_BYTES_MAX}",
                    key.len()
                ));
            }
            let mut k = ApiKey {
                name: name.to_string(),
                key: [0; KEY_BYTES_MAX],
                len: key.len(),
                rate_tok_s: None,
                burst: None,
            };
            k.key[..key.len()].copy_from_slice(key.as_bytes());
            for opt in words {
                let bad = || {
                    format!(
                        "line {n}: '{opt}' is not rate=<tokens/s> or burst=<tokens> (a positive number)"
                    )
                };
                match opt.split_once('=') {
                    Some(("rate", v)) => {
                        let r: f64 = v.parse().map_err(|_| bad())?;
                        if !(r.is_finite() && r > 0.0) {
                            return Err(bad());
                        }
                        k.rate_tok_s = Some(r);
                    }
                    Some(("burst", v)) => {
                        k.burst = Some(v.parse().ok().filter(|&b: &u64| b > 0).ok_or_else(bad)?);
                    }
                    _ => return Err(bad()),
                }
            }
            if keys.iter().any(|o| o.name == k.name) {
                return Err(format!("line {n}: the name '{name}' is used twice"));
            }
            if keys.iter().any(|o| o.len == k.len && same(&o.key, &k.key)) {
                return Err(format!(
                    "line {n}: the key of '{name}' is also another name's"
                ));
            }
            keys.push(k);
        }
        if keys.is_empty() {
            return Err("it holds no key (a line is '<name> <key> [rate=N] [burst=N]')".into());
        }
        if keys.len() > KEYS_MAX {
            return Err(format!(
                "it holds {} keys; the most is {KEYS_MAX}",
                keys.len()
            ));
        }
        Ok(KeyFile { keys })
    }

    /// The index of the key `presented`, comparing it with every key in full.
    pub fn find(&self, presented: &str) -> Option<usize> {
        let p = presented.as_bytes();
        if p.is_empty() || p.len() > KEY_BYTES_MAX {
            return None;
        }
        let mut buf = [0u8; KEY_BYTES_MAX];
        buf[..p.len()].copy_from_slice(p);
        let mut found = None;
        for (i, k) in self.keys.iter().enumerate() {
            // Both comparisons always run; only the result decides.
            let equal = same(&buf, &k.key) & (k.len == p.len());
            if equal {
                found = Some(i);
            }
        }
        found
    }

    pub fn key(&self, index: usize) -> &ApiKey {
        &self.keys[index]
    }

    /// The key named `name` (names are unique in a file).
    pub fn by_name(&self, name: &str) -> Option<&ApiKey> {
        self.keys.iter().find(|k| k.name == name)
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }
}

/// The key in an `Authorization` header value: `Bearer <key>`.
pub fn bearer(header: &str) -> Option<&str> {
    let (scheme, key) = header.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(key.trim())
        .filter(|k| !k.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "# keys\n\
        alice  sk-alice-0123456789abcdef  rate=200 burst=5000\n\
        \n\
        bob    sk-bob-0123456789abcdef0\n";

    #[test]
    fn keys_are_found_by_their_full_value_only() {
        let f = KeyFile::parse(FILE).unwrap();
        assert_eq!(f.len(), 2);
        assert_eq!(f.find("sk-alice-0123456789abcdef"), Some(0));
        assert_eq!(f.find("sk-bob-0123456789abcdef0"), Some(1));
        assert_eq!(f.find("sk-bob-0123456789abcdef"), None, "a prefix");
        assert_eq!(f.find("sk-bob-0123456789abcdef00"), None, "longer");
        assert_eq!(f.find(""), None);
        assert_eq!(f.find(&"x".repeat(300)), None);
        assert_eq!(f.key(0).name, "alice");
        assert!(
            !format!("{:?}", f.key(0)).contains("sk-alice"),
            "never printed"
        );
    }

    #[test]
    fn bad_files_are_refused_with_the_line() {
        for (text, says) in [
            ("alice short", "line 1: the key of 'alice' has 5 bytes"),
            ("alice", "has no key"),
            ("a sk-aaaaaaaaaaaaaaaaaa rate=fast", "'rate=fast'"),
            ("a sk-aaaaaaaaaaaaaaaaaa burst=0", "'burst=0'"),
            ("a sk-aaaaaaaaaaaaaaaaaa\nb sk-aaaaaaaaaaaaaaaaaa", "line 2"),
            (
                "a sk-aaaaaaaaaaaaaaaaaa\na sk-bbbbbbbbbbbbbbbbbb",
                "used twice",
            ),
            ("# nothing\n", "holds no key"),
            ("al/ice sk-aaaaaaaaaaaaaaaaaa", "the name 'al/ice'"),
        ] {
            let e = KeyFile::parse(text).unwrap_err();
            assert!(e.contains(says), "{text:?}: {e}");
        }
    }

    #[test]
    fn per_key_overrides_fall_back_to_the_server_limit() {
        let f = KeyFile::parse(FILE).unwrap();
        let server = Limit {
            rate_tok_s: 10.0,
            burst: 400,
        };
        let alice = Limit {
            rate_tok_s: 200.0,
            burst: 5000,
        };
        assert_eq!(f.key(0).limit(Some(server)), Some(alice));
        assert_eq!(f.key(0).limit(None), Some(alice));
        assert_eq!(f.key(1).limit(Some(server)), Some(server));
        assert_eq!(f.key(1).limit(None), None, "no limit anywhere");
        let rate_only = KeyFile::parse("c sk-cccccccccccccccccc rate=5").unwrap();
        assert_eq!(
            rate_only.key(0).limit(Some(server)).unwrap().burst,
            300,
            "its own rate, and a minute of it, not the server's burst of 400"
        );
    }

    #[test]
    fn bearer_keys_are_read_from_the_header() {
        assert_eq!(bearer("Bearer sk-1"), Some("sk-1"));
        assert_eq!(bearer("bearer   sk-1 "), Some("sk-1"));
        assert_eq!(bearer("Basic abc"), None);
        assert_eq!(bearer("Bearer "), None);
    }
}
