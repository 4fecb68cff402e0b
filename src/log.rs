//! Log lines on stderr: plain text (journald stamps each line itself), or
//! with `--log-format json` one JSON object a line (`time`, `msg`, and for a
//! request its fields), for shippers such as journald's JSON export, Loki or
//! Vector. Writing never panics: a closed stderr loses the line, nothing else.

use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

static JSON: AtomicBool = AtomicBool::new(false);

/// `--log-format json`: from now on, every line is a JSON object.
pub fn set_json(on: bool) {
    JSON.store(on, Ordering::Relaxed);
}

pub fn is_json() -> bool {
    JSON.load(Ordering::Relaxed)
}

/// One line of text (what `say!` writes).
pub fn line(text: std::fmt::Arguments<'_>) {
    if is_json() {
        let msg = text.to_string();
        let v = serde_json::json!({"time": now_rfc3339(), "msg": msg});
        write_line(&v.to_string());
    } else {
        let mut s = String::new();
        let _ = s.write_fmt(text);
        write_line(&s);
    }
}

/// A line about one request: `text` as plain text, or its `fields` (and
/// `text` as `msg`) as JSON.
pub fn request(text: &str, fields: serde_json::Map<String, serde_json::Value>) {
    if is_json() {
        let mut v = serde_json::Map::new();
        v.insert("time".into(), now_rfc3339().into());
        v.insert("msg".into(), text.into());
        v.extend(fields);
        write_line(&serde_json::Value::Object(v).to_string());
    } else {
        write_line(text);
    }
}

fn write_line(s: &str) {
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(s.as_bytes());
    let _ = err.write_all(b"\n");
}

/// Now in UTC, `2026-12-02T03:04:05.678Z`.
pub fn now_rfc3339() -> String {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    rfc3339(d.as_secs(), d.subsec_millis())
}

fn rfc3339(unix_s: u64, millis: u32) -> String {
    let days = (unix_s / 86_400) as i64;
    let rem = unix_s % 86_400;
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// The proleptic Gregorian date of a day count since 1970-01-01 (Howard
/// Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_utc_rfc3339() {
        assert_eq!(rfc3339(0, 0), "1970-01-01T00:00:00.000Z");
        // 2000-02-29 (a leap day) 12:34:56.
        assert_eq!(rfc3339(951_827_696, 7), "2000-02-29T12:34:56.007Z");
        assert_eq!(rfc3339(1_796_180_645, 999), "2026-12-02T03:04:05.999Z");
    }
}
