//! sluice patch 5: one connection's whole life, on its own thread.
//!
//! Replaces upstream's `ClientConnection`, which parsed the next request as
//! soon as the previous body was taken and chained every response behind the
//! one before it with no deadline: one client that pipelined and never read
//! held every handler. Here:
//!
//! - a connection has at most one request in flight: the next one is not read
//!   until the previous response is written (or failed);
//! - the request head must arrive whole within `header_timeout`, the body
//!   within `body_timeout`, and an idle keep-alive connection is closed after
//!   `keep_alive`; every read is bounded by what is left of its deadline;
//! - the body is read here, whole, before a handler sees the request;
//! - framing is strict (RFC 9112 §6.3), and every refusal is written here with
//!   `Connection: close`, followed by a lingering close (the write side shut,
//!   input discarded for a bounded time and byte count) so that the client
//!   reads the answer rather than a reset;
//! - the queue to the handlers is bounded; when it is full the request gets a
//!   503 at once from here.

use std::collections::BTreeMap;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender};

use crate::common::{HTTPVersion, Header, Method};
use crate::connection::Connection;
use crate::{ConnectionLimits, Request};

/// Counters of the front, for the server's metrics.
#[derive(Debug, Default)]
pub struct FrontStats {
    /// Connections open now (accepted, not yet closed).
    pub open: AtomicUsize,
    /// Connections refused at accept: at `max_connections` with none to close
    /// for room, or no thread for them.
    pub refused_connections: AtomicU64,
    /// Connections closed to make room for a new one (the longest waiting on
    /// their client).
    pub evicted: AtomicU64,
    /// Requests read whole and not yet answered: waiting for a handler, or in
    /// one's hands.
    pub in_handlers: AtomicUsize,
    /// Requests refused because every handler was busy and `queue_depth`
    /// waited for one.
    pub refused_queue_full: AtomicU64,
    /// Connections closed because a head or body did not arrive in time.
    pub timed_out: AtomicU64,
    /// Requests refused for their framing or syntax (400, 414, 417, 431, 505).
    pub malformed: AtomicU64,
    /// Requests refused for a body over `body_bytes_max` (413).
    pub too_large: AtomicU64,
    /// Responses whose writing failed (the client left, or did not read in time).
    pub write_failed: AtomicU64,
    /// Accepts that failed and were waited out (out of descriptors or
    /// memory, a connection reset before it was accepted), and the OS error
    /// code of the last one.
    pub accept_errors: AtomicU64,
    pub last_accept_errno: std::sync::atomic::AtomicI32,
}

/// What the connection thread shares with the accept thread.
pub(crate) struct Shared {
    pub limits: ConnectionLimits,
    pub queue: Sender<Request>,
    pub stats: Arc<FrontStats>,
    pub waiting: Waiting,
}

/// The connections waiting on their client (idle between requests, or still
/// sending a head or body), oldest first. At `max_connections`, the accept
/// thread closes the oldest of them to make room for a new connection rather
/// than refusing it: a connection whose request is in a handler's hands is
/// never closed for room, and idle or trickling clients cannot lock everyone
/// else out. Only when none waits is a new connection refused.
#[derive(Default)]
pub(crate) struct Waiting {
    next: AtomicU64,
    conns: Mutex<BTreeMap<u64, Arc<Connection>>>,
}

impl Waiting {
    pub(crate) fn enter(&self, conn: &Arc<Connection>) -> u64 {
        let ticket = self.next.fetch_add(1, Ordering::Relaxed);
        self.lock().insert(ticket, Arc::clone(conn));
        ticket
    }

    pub(crate) fn leave(&self, ticket: u64) {
        self.lock().remove(&ticket);
    }

    /// Closes the connection that has waited longest; false if none waits.
    pub(crate) fn evict_oldest(&self) -> bool {
        let oldest = self.lock().pop_first();
        match oldest {
            Some((_, conn)) => {
                let _ = conn.shutdown(Shutdown::Both);
                true
            }
            None => false,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<Connection>>> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Marks a response complete: the connection may then carry another request.
/// `Request::respond` marks it itself; a caller that writes a response by hand
/// through `Request::into_writer` marks it once the last byte is written. A
/// writer dropped before that closes the connection, since the client could
/// not tell where the response ended.
#[derive(Clone, Debug, Default)]
pub struct Completion(Arc<AtomicBool>);

impl Completion {
    pub fn done(&self) {
        self.0.store(true, Ordering::Release);
    }

    pub fn is_done(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// The write side handed back to the connection thread when a response ends.
pub(crate) struct Returned {
    conn: Connection,
    reusable: bool,
}

/// The writer a request's response goes through. Each flush (a whole response,
/// or one event of a stream) must be written within `timeout`: a client that
/// does not read holds this writer no longer than that.
pub(crate) struct ResponseWriter {
    conn: Option<Connection>,
    buf: Vec<u8>,
    timeout: Duration,
    deadline: Option<Instant>,
    failed: bool,
    completion: Completion,
    back: Option<Sender<Returned>>,
    stats: Arc<FrontStats>,
    /// Counted in `FrontStats::in_handlers` until this response ends.
    counted: bool,
}

const WRITE_BUFFER_BYTES: usize = 8 * 1024;

impl ResponseWriter {
    fn send_buffered(&mut self) -> io::Result<()> {
        if self.failed {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, "response failed"));
        }
        let timeout = self.timeout;
        let deadline = *self
            .deadline
            .get_or_insert_with(|| Instant::now() + timeout);
        let Some(conn) = self.conn.as_mut() else {
            return Err(io::Error::new(io::ErrorKind::NotConnected, "no connection"));
        };
        if let Err(e) = write_by(conn, &self.buf, deadline) {
            self.failed = true;
            self.stats.write_failed.fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
        self.buf.clear();
        Ok(())
    }
}

impl Write for ResponseWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.failed {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, "response failed"));
        }
        self.buf.extend_from_slice(data);
        if self.buf.len() >= WRITE_BUFFER_BYTES {
            self.send_buffered()?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.send_buffered()?;
        self.deadline = None;
        Ok(())
    }
}

impl Drop for ResponseWriter {
    fn drop(&mut self) {
        if !self.failed && !self.buf.is_empty() {
            let _ = self.send_buffered();
        }
        // The response has ended: its place is free at once (not when the
        // connection's thread next runs).
        if self.counted {
            self.stats.in_handlers.fetch_sub(1, Ordering::AcqRel);
        }
        if let (Some(conn), Some(back)) = (self.conn.take(), self.back.take()) {
            let reusable = !self.failed && self.completion.is_done();
            let _ = back.send(Returned { conn, reusable });
        }
    }
}

/// Reads from the socket within a deadline: every read waits at most what is
/// left of it, so a client trickling bytes cannot stretch it.
struct TimedReader {
    conn: Arc<Connection>,
    deadline: Instant,
}

impl Read for TimedReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
        }
        self.conn
            .set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
        match (&*self.conn).read(buf) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"))
            }
            r => r,
        }
    }
}

/// Why a request was refused before a handler saw it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub status: u16,
    pub code: &'static str,
    pub message: String,
}

impl Refusal {
    fn new(status: u16, code: &'static str, message: impl Into<String>) -> Refusal {
        Refusal {
            status,
            code,
            message: message.into(),
        }
    }

    fn bad(message: impl Into<String>) -> Refusal {
        Refusal::new(400, "bad_request", message)
    }
}

/// How reading part of a request ended, when it did not succeed.
#[derive(Debug)]
enum ReadFail {
    /// The client closed, or the socket failed: nobody to answer.
    Gone,
    /// The deadline passed.
    TimedOut,
    /// The request is refused with this answer.
    Refused(Refusal),
}

impl From<io::Error> for ReadFail {
    fn from(e: io::Error) -> ReadFail {
        match e.kind() {
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => ReadFail::TimedOut,
            _ => ReadFail::Gone,
        }
    }
}

/// The request line and header fields, parsed.
#[derive(Debug)]
pub(crate) struct Head {
    pub method: Method,
    pub target: String,
    pub version: HTTPVersion,
    pub headers: Vec<Header>,
}

/// How the request's body is delimited (RFC 9112 §6.3).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Framing {
    None,
    Length(u64),
    Chunked,
}

/// Reads one line ending in CRLF into `out` (without the CRLF). A bare LF,
/// or a CR not followed by LF, is refused; so is a line over `max` bytes
/// (with `too_long`).
fn read_line<R: BufRead>(
    rd: &mut R,
    max: usize,
    too_long: &Refusal,
    out: &mut Vec<u8>,
) -> Result<(), ReadFail> {
    out.clear();
    loop {
        let available = match rd.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        };
        if available.is_empty() {
            return Err(ReadFail::Gone);
        }
        let (take, found) = match available.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (available.len(), false),
        };
        if out.len() + take > max + 2 {
            return Err(ReadFail::Refused(Refusal::new(
                too_long.status,
                too_long.code,
                too_long.message.clone(),
            )));
        }
        out.extend_from_slice(&available[..take]);
        rd.consume(take);
        if found {
            out.pop(); // LF
            if out.pop() != Some(b'\r') {
                return Err(ReadFail::Refused(Refusal::bad(
                    "a line ends in a bare LF; HTTP lines end in CRLF",
                )));
            }
            if out.contains(&b'\r') {
                return Err(ReadFail::Refused(Refusal::bad("a bare CR inside a line")));
            }
            return Ok(());
        }
    }
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// `method SP request-target SP HTTP-version` (RFC 9112 §3), exactly.
pub(crate) fn parse_request_line(line: &[u8]) -> Result<(Method, String, HTTPVersion), Refusal> {
    let bad = || Refusal::bad("the request line is not 'METHOD target HTTP/1.x'");
    let mut parts = line.split(|&b| b == b' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad());
    };
    if method.is_empty() || !method.iter().all(|&b| is_tchar(b)) {
        return Err(bad());
    }
    if target.is_empty() || !target.iter().all(|&b| (0x21..0x7f).contains(&b)) {
        return Err(bad());
    }
    let version = match version {
        b"HTTP/1.1" => HTTPVersion(1, 1),
        b"HTTP/1.0" => HTTPVersion(1, 0),
        v if v.len() == 8 && v.starts_with(b"HTTP/") && v[5].is_ascii_digit() => {
            return Err(Refusal::new(
                505,
                "http_version_not_supported",
                "this server speaks HTTP/1.0 and HTTP/1.1",
            ))
        }
        _ => return Err(bad()),
    };
    let method = std::str::from_utf8(method)
        .ok()
        .and_then(|m| m.parse().ok())
        .ok_or_else(bad)?;
    let target = String::from_utf8(target.to_vec()).map_err(|_| bad())?;
    Ok((method, target, version))
}

/// `field-name ":" OWS field-value OWS` (RFC 9112 §5): no space before the
/// colon, no line folding, no control characters in the value.
pub(crate) fn parse_header_line(line: &[u8]) -> Result<Header, Refusal> {
    if line.first().is_some_and(|&b| b == b' ' || b == b'\t') {
        return Err(Refusal::bad("obsolete line folding in a header field"));
    }
    let colon = line
        .iter()
        .position(|&b| b == b':')
        .ok_or_else(|| Refusal::bad("a header line without a colon"))?;
    let (name, value) = (&line[..colon], &line[colon + 1..]);
    if name.is_empty() || !name.iter().all(|&b| is_tchar(b)) {
        return Err(Refusal::bad("a header field name that is not a token"));
    }
    let ows = |b: &u8| *b == b' ' || *b == b'\t';
    let start = value.iter().position(|b| !ows(b)).unwrap_or(value.len());
    let end = value.iter().rposition(|b| !ows(b)).map_or(start, |i| i + 1);
    let value = &value[start..end];
    if !value
        .iter()
        .all(|&b| b == b'\t' || (0x20..0x7f).contains(&b))
    {
        return Err(Refusal::bad(
            "a header field value with control or non-ASCII bytes",
        ));
    }
    Header::from_bytes(name, value).map_err(|()| Refusal::bad("an invalid header field"))
}

/// The body's framing from the header fields (RFC 9112 §6.3), strictly:
/// Transfer-Encoding other than exactly `chunked`, Transfer-Encoding beside
/// Content-Length, more than one Content-Length, or one that is not a plain
/// decimal number, are refused: a proxy in front could read them differently.
pub(crate) fn framing(version: &HTTPVersion, headers: &[Header]) -> Result<Framing, Refusal> {
    let te: Vec<&str> = headers
        .iter()
        .filter(|h| h.field.equiv("Transfer-Encoding"))
        .map(|h| h.value.as_str())
        .collect();
    let cl: Vec<&str> = headers
        .iter()
        .filter(|h| h.field.equiv("Content-Length"))
        .map(|h| h.value.as_str())
        .collect();
    if !te.is_empty() {
        if !cl.is_empty() {
            return Err(Refusal::bad(
                "both Transfer-Encoding and Content-Length; send one",
            ));
        }
        if *version < HTTPVersion(1, 1) {
            return Err(Refusal::bad("Transfer-Encoding in an HTTP/1.0 request"));
        }
        if te.len() != 1 || !te[0].eq_ignore_ascii_case("chunked") {
            return Err(Refusal::bad(format!(
                "Transfer-Encoding is '{}'; only 'chunked' is accepted",
                te.join(", ")
            )));
        }
        return Ok(Framing::Chunked);
    }
    match cl.as_slice() {
        [] => Ok(Framing::None),
        [v] => {
            let ok = !v.is_empty() && v.len() <= 19 && v.bytes().all(|b| b.is_ascii_digit());
            match v.parse::<u64>() {
                Ok(n) if ok => Ok(Framing::Length(n)),
                _ => Err(Refusal::bad(format!(
                    "Content-Length is '{v}'; it must be a decimal number of bytes"
                ))),
            }
        }
        _ => Err(Refusal::bad("more than one Content-Length")),
    }
}

/// Reads a chunked body (RFC 9112 §7.1) of at most `max` bytes into `out`.
fn read_chunked<R: BufRead>(rd: &mut R, max: usize, out: &mut Vec<u8>) -> Result<(), ReadFail> {
    let too_long = Refusal::bad("a chunk-size line is too long");
    let mut line = Vec::new();
    loop {
        read_line(rd, 1024, &too_long, &mut line)?;
        let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
        if digits == 0 {
            return Err(ReadFail::Refused(Refusal::bad(
                "a chunk size is not hexadecimal",
            )));
        }
        let rest = &line[digits..];
        let rest_ok = rest.is_empty()
            || rest
                .iter()
                .position(|&b| b != b' ' && b != b'\t')
                .is_some_and(|i| rest[i] == b';');
        if !rest_ok {
            return Err(ReadFail::Refused(Refusal::bad(
                "a malformed chunk-size line",
            )));
        }
        let size = std::str::from_utf8(&line[..digits])
            .ok()
            .and_then(|s| u64::from_str_radix(s, 16).ok())
            .ok_or_else(|| ReadFail::Refused(Refusal::bad("a chunk size overflows")))?;
        if size == 0 {
            // Trailer fields, ignored, then the empty line.
            let too_long = Refusal::new(431, "headers_too_large", "a trailer field is too long");
            for _ in 0..64 {
                read_line(rd, 8 * 1024, &too_long, &mut line)?;
                if line.is_empty() {
                    return Ok(());
                }
            }
            return Err(ReadFail::Refused(too_long));
        }
        if size > (max - out.len()) as u64 {
            return Err(ReadFail::Refused(too_large(max)));
        }
        let start = out.len();
        out.resize(start + size as usize, 0);
        read_exact(rd, &mut out[start..])?;
        let mut crlf = [0u8; 2];
        read_exact(rd, &mut crlf)?;
        if &crlf != b"\r\n" {
            return Err(ReadFail::Refused(Refusal::bad(
                "chunk data not followed by CRLF",
            )));
        }
    }
}

fn read_exact<R: Read>(rd: &mut R, buf: &mut [u8]) -> Result<(), ReadFail> {
    let mut filled = 0;
    while filled < buf.len() {
        match rd.read(&mut buf[filled..]) {
            Ok(0) => return Err(ReadFail::Gone),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

fn too_large(max: usize) -> Refusal {
    Refusal::new(
        413,
        "body_too_large",
        format!("the request body is over {max} bytes"),
    )
}

/// Reads a request head: the request line and the header fields, within the
/// limits. Empty lines before the request line are skipped (RFC 9112 §2.2).
fn read_head<R: BufRead>(rd: &mut R, limits: &ConnectionLimits) -> Result<Head, ReadFail> {
    let line_max = limits.header_line_bytes_max;
    let uri_too_long = Refusal::new(414, "uri_too_long", "the request line is too long");
    let field_too_long = Refusal::new(431, "headers_too_large", "a header line is too long");
    let mut line = Vec::new();
    let mut skipped = 0;
    loop {
        read_line(rd, line_max, &uri_too_long, &mut line)?;
        if !line.is_empty() {
            break;
        }
        skipped += 1;
        if skipped > 4 {
            return Err(ReadFail::Refused(Refusal::bad("empty lines, no request")));
        }
    }
    let (method, target, version) = parse_request_line(&line).map_err(ReadFail::Refused)?;
    let mut headers = Vec::new();
    let mut bytes = 0;
    loop {
        read_line(rd, line_max, &field_too_long, &mut line)?;
        if line.is_empty() {
            break;
        }
        bytes += line.len();
        if headers.len() >= limits.headers_max || bytes > limits.header_bytes_max {
            return Err(ReadFail::Refused(Refusal::new(
                431,
                "headers_too_large",
                "too many header fields, or too many bytes of them",
            )));
        }
        headers.push(parse_header_line(&line).map_err(ReadFail::Refused)?);
    }
    let hosts = headers.iter().filter(|h| h.field.equiv("Host")).count();
    if hosts > 1 || (hosts == 0 && version >= HTTPVersion(1, 1)) {
        return Err(ReadFail::Refused(Refusal::bad(
            "an HTTP/1.1 request needs exactly one Host header",
        )));
    }
    Ok(Head {
        method,
        target,
        version,
        headers,
    })
}

/// Whether the client asked that the connection end after this request.
fn wants_close(head: &Head) -> bool {
    let tokens: Vec<String> = head
        .headers
        .iter()
        .filter(|h| h.field.equiv("Connection"))
        .flat_map(|h| {
            h.value
                .as_str()
                .split(',')
                .map(|t| t.trim().to_ascii_lowercase())
                .collect::<Vec<_>>()
        })
        .collect();
    if tokens.iter().any(|t| t == "close" || t == "upgrade") {
        return true;
    }
    head.version < HTTPVersion(1, 1) && !tokens.iter().any(|t| t == "keep-alive")
}

/// A complete response, written by the connection itself, that closes it.
pub(crate) fn refusal_bytes(r: &Refusal, retry_after_s: Option<u64>, close: bool) -> Vec<u8> {
    // sluice patch: the type sluice's own handlers give an overload refusal.
    let kind = match r.status {
        503 => "overloaded_error",
        _ => "invalid_request_error",
    };
    let body = format!(
        "{{\"error\":{{\"message\":{},\"type\":\"{kind}\",\"code\":\"{}\",\"param\":null}}}}",
        json_string(&r.message),
        r.code
    );
    let reason = crate::StatusCode(r.status).default_reason_phrase();
    let mut out = format!(
        "HTTP/1.1 {} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        r.status,
        body.len()
    );
    if close {
        out.push_str("Connection: close\r\n");
    }
    if let Some(s) = retry_after_s {
        let (s, ms) = jittered_wait(s);
        out.push_str(&format!("Retry-After: {s}\r\nretry-after-ms: {ms}\r\n"));
    }
    out.push_str("\r\n");
    out.push_str(&body);
    out.into_bytes()
}

/// sluice patch: a refusal's wait spread over [0.5, 1.5) x `retry_after_s` (whole ms, rounded down),
/// so clients refused together do not come back together: (`Retry-After` in
/// whole seconds, never earlier than the milliseconds; `retry-after-ms`, which
/// the OpenAI SDKs read first). The spread comes from the clock's nanoseconds.
pub(crate) fn jittered_wait(retry_after_s: u64) -> (u64, u64) {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    // A multiplicative hash, so that calls close in time spread too.
    let u = f64::from(nanos.wrapping_mul(2_654_435_761) >> 8) / f64::from(1u32 << 24);
    let ms = (retry_after_s as f64 * 1000.0 * (0.5 + u)).floor() as u64;
    (ms.div_ceil(1000).max(1), ms)
}

fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The 503 a connection over `max_connections` gets, written at once from the
/// accept thread without blocking it.
pub(crate) fn refuse_at_accept(conn: Connection) {
    let r = Refusal::new(
        503,
        "too_many_connections",
        "the server holds as many connections as it may; retry shortly",
    );
    let bytes = refusal_bytes(&r, Some(1), true);
    if conn.set_nonblocking(true).is_ok() {
        let mut conn = conn;
        let _ = conn.write(&bytes);
        // What the client already sent, so that closing does not reset the
        // connection and destroy the 503 (best effort: nothing waits here).
        let mut sink = [0u8; 4096];
        for _ in 0..16 {
            match conn.read(&mut sink) {
                Ok(n) if n > 0 => {}
                _ => break,
            }
        }
        let _ = conn.shutdown(Shutdown::Write);
    }
}

/// Shuts the write side (the answer then ends with a FIN) and discards what the
/// client still sends, for at most `linger` and `linger_bytes_max`, so that
/// closing does not reset the connection while the answer is in flight.
fn linger(rd: &mut BufReader<TimedReader>, conn: &Connection, limits: &ConnectionLimits) {
    let _ = conn.shutdown(Shutdown::Write);
    rd.get_mut().deadline = Instant::now() + limits.linger;
    let mut discarded = rd.buffer().len();
    let len = rd.buffer().len();
    rd.consume(len);
    let mut sink = vec![0u8; 64 * 1024];
    while discarded <= limits.linger_bytes_max {
        match rd.get_mut().read(&mut sink) {
            Ok(0) => break,
            Ok(n) => discarded += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
}

/// Writes all of `bytes` by `deadline`: each write waits at most what is left.
fn write_by(conn: &mut Connection, bytes: &[u8], deadline: Instant) -> io::Result<()> {
    let mut written = 0;
    while written < bytes.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "write deadline passed",
            ));
        }
        conn.set_write_timeout(Some(left.max(Duration::from_millis(1))))?;
        match conn.write(&bytes[written..]) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "peer closed")),
            Ok(n) => written += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "write deadline passed",
                ))
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn write_refusal(conn: &mut Connection, limits: &ConnectionLimits, bytes: &[u8]) -> bool {
    write_by(conn, bytes, Instant::now() + limits.write_timeout).is_ok()
}

/// A connection's place among those waiting on their client, while it has one.
struct WaitTicket<'a> {
    waiting: &'a Waiting,
    ticket: u64,
}

impl Drop for WaitTicket<'_> {
    fn drop(&mut self) {
        self.waiting.leave(self.ticket);
    }
}

/// Serves one connection until it closes.
///
/// `ticket` is its place among the connections waiting on their client, taken
/// at accept (a connection waits on its client from its first moment).
pub(crate) fn serve(
    conn: Arc<Connection>,
    ticket: u64,
    remote_addr: Option<SocketAddr>,
    shared: &Shared,
) {
    let limits = &shared.limits;
    let stats = &shared.stats;
    let mut first_ticket = Some(ticket);
    let Ok(mut writer) = conn.try_clone() else {
        shared.waiting.leave(ticket);
        return;
    };
    let accepted = Instant::now();
    let mut rd = BufReader::with_capacity(
        8 * 1024,
        TimedReader {
            conn: Arc::clone(&conn),
            deadline: accepted + limits.header_timeout,
        },
    );
    let (back_tx, back_rx): (Sender<Returned>, Receiver<Returned>) = bounded(1);
    let mut first = true;
    loop {
        let waiting = WaitTicket {
            waiting: &shared.waiting,
            ticket: first_ticket
                .take()
                .unwrap_or_else(|| shared.waiting.enter(&conn)),
        };
        let request = match read_request(&mut rd, &mut writer, first, shared) {
            Some(r) => r,
            None => return,
        };
        first = false;
        let close_after = wants_close(&request.head);
        drop(waiting);

        // Hand the request to a handler; the response comes back through
        // `back_rx` before anything more is read from this connection.
        // At most `handlers + queue_depth` requests between here and their
        // complete answers: with every handler busy, `queue_depth` wait. (A
        // bound on the channel alone would refuse a burst that idle handlers
        // had not yet woken to take.)
        let limit = limits.handlers + limits.queue_depth;
        let admitted = stats
            .in_handlers
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .is_ok();
        let completion = Completion::default();
        let response_writer = ResponseWriter {
            conn: Some(writer),
            buf: Vec::with_capacity(1024),
            timeout: limits.write_timeout,
            deadline: None,
            failed: false,
            completion: completion.clone(),
            back: Some(back_tx.clone()),
            stats: Arc::clone(stats),
            counted: admitted,
        };
        let head = request.head;
        #[allow(unused_mut)]
        let mut request = crate::request::preread_request(
            head.method,
            head.target,
            head.version,
            head.headers,
            remote_addr,
            request.body,
            response_writer,
            completion,
        );
        #[cfg(unix)]
        request.set_peer_socket(conn.dup_fd());
        if !admitted {
            stats.refused_queue_full.fetch_add(1, Ordering::Relaxed);
            request.refuse_queue_full();
        } else if shared.queue.try_send(request).is_err() {
            // The channel holds `limit`, so it is not full: the server has
            // stopped (the request, dropped, answered 500).
            return;
        }
        let returned = back_rx.recv();
        let Ok(returned) = returned else {
            return;
        };
        writer = returned.conn;
        if !returned.reusable {
            return;
        }
        if close_after {
            let _ = writer.shutdown(Shutdown::Write);
            return;
        }
    }
}

/// A request read whole from its connection.
struct ReadRequest {
    head: Head,
    body: Vec<u8>,
}

/// Waits for the next request and reads it whole: its first byte within the
/// header deadline (first request, counted from accept) or the keep-alive
/// (later ones), its head within the header deadline, its body within the body
/// deadline. None when the connection is to close: the client closed or was
/// too slow, or the request was refused (answered here).
fn read_request(
    rd: &mut BufReader<TimedReader>,
    writer: &mut Connection,
    first: bool,
    shared: &Shared,
) -> Option<ReadRequest> {
    let limits = &shared.limits;
    let stats = &shared.stats;
    if rd.buffer().is_empty() {
        if !first {
            rd.get_mut().deadline = Instant::now() + limits.keep_alive;
        }
        match rd.fill_buf() {
            Ok([]) => return None, // closed by the client
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
                ) =>
            {
                if first {
                    stats.timed_out.fetch_add(1, Ordering::Relaxed);
                }
                return None; // an idle keep-alive, or a client that sent nothing
            }
            Err(_) => return None,
        }
    }
    if !first {
        rd.get_mut().deadline = Instant::now() + limits.header_timeout;
    }
    let timed_out = |writer: &mut Connection, what: &str| {
        stats.timed_out.fetch_add(1, Ordering::Relaxed);
        let r = Refusal::new(
            408,
            "request_timeout",
            format!("the request {what} did not arrive in time"),
        );
        write_refusal(writer, limits, &refusal_bytes(&r, None, true));
    };
    let refuse = |r: Refusal, rd: &mut BufReader<TimedReader>, writer: &mut Connection| {
        if r.status == 413 {
            stats.too_large.fetch_add(1, Ordering::Relaxed);
        } else {
            stats.malformed.fetch_add(1, Ordering::Relaxed);
        }
        if write_refusal(writer, limits, &refusal_bytes(&r, None, true)) {
            linger(rd, writer, limits);
        }
    };

    let head = match read_head(rd, limits) {
        Ok(h) => h,
        Err(ReadFail::Gone) => return None,
        Err(ReadFail::TimedOut) => {
            timed_out(writer, "head");
            return None;
        }
        Err(ReadFail::Refused(r)) => {
            refuse(r, rd, writer);
            return None;
        }
    };
    let framing = match framing(&head.version, &head.headers) {
        Ok(f) => f,
        Err(r) => {
            refuse(r, rd, writer);
            return None;
        }
    };
    let max = limits.body_bytes_max;
    if let Framing::Length(n) = framing {
        if n > max as u64 {
            refuse(too_large(max), rd, writer);
            return None;
        }
    }
    let expect = head
        .headers
        .iter()
        .find(|h| h.field.equiv("Expect"))
        .map(|h| h.value.as_str().to_ascii_lowercase());
    match expect.as_deref() {
        None => {}
        Some("100-continue") => {
            let has_body = !matches!(framing, Framing::None | Framing::Length(0));
            if has_body && !write_refusal(writer, limits, b"HTTP/1.1 100 Continue\r\n\r\n") {
                return None;
            }
        }
        Some(_) => {
            let r = Refusal::new(
                417,
                "expectation_failed",
                "only 'Expect: 100-continue' is understood",
            );
            refuse(r, rd, writer);
            return None;
        }
    }

    rd.get_mut().deadline = Instant::now() + limits.body_timeout;
    let mut body = Vec::new();
    let read = match framing {
        Framing::None => Ok(()),
        Framing::Length(n) => {
            body.resize(n as usize, 0);
            read_exact(rd, &mut body)
        }
        Framing::Chunked => read_chunked(rd, max, &mut body),
    };
    match read {
        Ok(()) => Some(ReadRequest { head, body }),
        Err(ReadFail::Gone) => None,
        Err(ReadFail::TimedOut) => {
            timed_out(writer, "body");
            None
        }
        Err(ReadFail::Refused(r)) => {
            refuse(r, rd, writer);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ConnectionLimits {
        ConnectionLimits::default()
    }

    fn head_of(bytes: &[u8]) -> Result<Head, ReadFail> {
        read_head(&mut io::BufReader::new(bytes), &limits())
    }

    fn status_of(bytes: &[u8]) -> Option<u16> {
        match head_of(bytes) {
            Ok(_) => None,
            Err(ReadFail::Refused(r)) => Some(r.status),
            Err(e) => panic!("{:?}", e),
        }
    }

    fn framing_of(fields: &[(&str, &str)]) -> Result<Framing, u16> {
        let headers: Vec<Header> = fields
            .iter()
            .map(|(n, v)| Header::from_bytes(n.as_bytes(), v.as_bytes()).unwrap())
            .collect();
        framing(&HTTPVersion(1, 1), &headers).map_err(|r| r.status)
    }

    #[test]
    fn a_plain_request_parses() {
        let h =
            head_of(b"\r\nPOST /v1/x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\n").unwrap();
        assert_eq!(h.method, Method::Post);
        assert_eq!(h.target, "/v1/x");
        assert_eq!(h.headers.len(), 2);
        assert_eq!(framing(&h.version, &h.headers).unwrap(), Framing::Length(5));
    }

    #[test]
    fn lines_must_end_in_crlf() {
        assert_eq!(status_of(b"GET / HTTP/1.1\nHost: a\r\n\r\n"), Some(400));
        assert_eq!(status_of(b"GET / HTTP/1.1\r\nHost: a\n\r\n"), Some(400));
        assert_eq!(
            status_of(b"GET / HTTP/1.1\r\nHost: a\rb\r\n\r\n"),
            Some(400)
        );
    }

    #[test]
    fn request_lines_are_strict() {
        assert_eq!(status_of(b"GET  / HTTP/1.1\r\nHost: a\r\n\r\n"), Some(400));
        assert_eq!(status_of(b"GET / HTTP/1.1 x\r\nHost: a\r\n\r\n"), Some(400));
        assert_eq!(status_of(b"GET / HTTP/2.0\r\nHost: a\r\n\r\n"), Some(505));
        assert_eq!(status_of(b"G(T / HTTP/1.1\r\nHost: a\r\n\r\n"), Some(400));
        assert_eq!(status_of(b"GET / http/1.1\r\nHost: a\r\n\r\n"), Some(400));
        let long = format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(20_000));
        let mut l = limits();
        l.header_line_bytes_max = 8192;
        match read_head(&mut io::BufReader::new(long.as_bytes()), &l) {
            Err(ReadFail::Refused(r)) => assert_eq!(r.status, 414),
            other => panic!("{:?}", other),
        }
    }

    #[test]
    fn header_fields_are_strict() {
        assert_eq!(status_of(b"GET / HTTP/1.1\r\nHost : a\r\n\r\n"), Some(400));
        assert_eq!(
            status_of(b"GET / HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n"),
            Some(400)
        );
        assert_eq!(
            status_of(b"GET / HTTP/1.1\r\nX: a\x01b\r\nHost: a\r\n\r\n"),
            Some(400)
        );
        assert_eq!(status_of(b"GET / HTTP/1.1\r\nnocolon\r\n\r\n"), Some(400));
        // Host: exactly one in HTTP/1.1; none is fine in HTTP/1.0.
        assert_eq!(status_of(b"GET / HTTP/1.1\r\n\r\n"), Some(400));
        assert_eq!(
            status_of(b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"),
            Some(400)
        );
        assert_eq!(status_of(b"GET / HTTP/1.0\r\n\r\n"), None);
    }

    #[test]
    fn too_many_header_bytes_are_431() {
        let mut l = limits();
        l.headers_max = 3;
        let req = b"GET / HTTP/1.1\r\nHost: a\r\nA: 1\r\nB: 2\r\nC: 3\r\n\r\n";
        match read_head(&mut io::BufReader::new(&req[..]), &l) {
            Err(ReadFail::Refused(r)) => assert_eq!(r.status, 431),
            other => panic!("{:?}", other),
        }
    }

    #[test]
    fn framing_is_strict() {
        assert_eq!(framing_of(&[]), Ok(Framing::None));
        assert_eq!(
            framing_of(&[("Content-Length", "0")]),
            Ok(Framing::Length(0))
        );
        assert_eq!(
            framing_of(&[("Transfer-Encoding", "Chunked")]),
            Ok(Framing::Chunked)
        );
        for bad in [
            vec![("Content-Length", "5"), ("Content-Length", "5")],
            vec![("Content-Length", "+5")],
            vec![("Content-Length", "-5")],
            vec![("Content-Length", "5, 5")],
            vec![("Content-Length", "0x5")],
            vec![("Content-Length", "")],
            vec![("Content-Length", "99999999999999999999999")],
            vec![("Content-Length", "18446744073709551616")],
            vec![("Transfer-Encoding", "gzip")],
            vec![("Transfer-Encoding", "gzip, chunked")],
            vec![
                ("Transfer-Encoding", "chunked"),
                ("Transfer-Encoding", "chunked"),
            ],
            vec![("Transfer-Encoding", "chunked"), ("Content-Length", "5")],
        ] {
            assert_eq!(framing_of(&bad), Err(400), "{:?}", bad);
        }
        let h = [Header::from_bytes(&b"Transfer-Encoding"[..], &b"chunked"[..]).unwrap()];
        assert!(framing(&HTTPVersion(1, 0), &h).is_err());
    }

    fn chunked(bytes: &[u8], max: usize) -> Result<Vec<u8>, Option<u16>> {
        let mut out = Vec::new();
        match read_chunked(&mut io::BufReader::new(bytes), max, &mut out) {
            Ok(()) => Ok(out),
            Err(ReadFail::Refused(r)) => Err(Some(r.status)),
            Err(_) => Err(None),
        }
    }

    #[test]
    fn chunked_bodies_are_strict() {
        assert_eq!(chunked(b"5\r\nhello\r\n0\r\n\r\n", 100).unwrap(), b"hello");
        assert_eq!(
            chunked(b"5;ext=1\r\nhello\r\n0\r\nT: x\r\n\r\n", 100).unwrap(),
            b"hello"
        );
        assert_eq!(chunked(b"10000000000000000\r\n", 100), Err(Some(400)));
        assert_eq!(chunked(b"fffffffffffffffff\r\n", 100), Err(Some(400)));
        assert_eq!(chunked(b"zz\r\n", 100), Err(Some(400)));
        assert_eq!(chunked(b"5 x\r\nhello\r\n0\r\n\r\n", 100), Err(Some(400)));
        assert_eq!(chunked(b"5\nhello\r\n0\r\n\r\n", 100), Err(Some(400)));
        assert_eq!(chunked(b"5\r\nhelloXX0\r\n\r\n", 100), Err(Some(400)));
        assert_eq!(chunked(b"65\r\n", 100), Err(Some(413)));
        assert_eq!(chunked(b"5\r\nhel", 100), Err(None));
    }

    #[test]
    fn connection_close_is_read_from_the_tokens() {
        let h =
            head_of(b"GET / HTTP/1.1\r\nHost: a\r\nConnection: keep-alive, Close\r\n\r\n").unwrap();
        assert!(wants_close(&h));
        let h = head_of(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n").unwrap();
        assert!(!wants_close(&h));
        let h = head_of(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        assert!(wants_close(&h));
        let h = head_of(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n").unwrap();
        assert!(!wants_close(&h));
    }

    #[test]
    fn refusal_waits_spread_over_half_to_one_and_a_half_times_and_round_up() {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..200 {
            let (s, ms) = jittered_wait(2);
            assert!((1000..3000).contains(&ms), "{}", ms);
            assert_eq!(s, (ms + 999) / 1000);
            seen.insert(ms);
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
        assert!(seen.len() > 20, "spread: {} distinct waits", seen.len());
    }

    #[test]
    fn refusals_are_complete_responses_that_close() {
        let r = Refusal::new(413, "body_too_large", "over \"1\" byte");
        let text = String::from_utf8(refusal_bytes(&r, Some(2), true)).unwrap();
        assert!(
            text.starts_with("HTTP/1.1 413 Payload Too Large\r\n"),
            "{}",
            text
        );
        assert!(text.contains("\r\nConnection: close\r\n"));
        assert!(text.contains("\r\nRetry-After: "));
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.contains(&format!("Content-Length: {}", body.len())));
        assert!(body.contains(r#""message":"over \"1\" byte""#), "{}", body);
    }
}
