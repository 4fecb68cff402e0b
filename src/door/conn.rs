//! One connection's whole life, on its own thread.
//!
//! - A connection has at most one request in flight: the next one is not read
//!   until the previous response is written (or failed); pipelined bytes wait
//!   in the kernel.
//! - The request head must arrive whole within `header_timeout`, the body
//!   within `body_timeout`, and an idle keep-alive connection is closed after
//!   `keep_alive`; every read is bounded by what is left of its deadline.
//! - The body is read here, whole, before a handler sees the request.
//! - Every refusal is written here with `Connection: close`, followed by a
//!   lingering close (the write side shut, input discarded for a bounded time
//!   and byte count) so that the client reads the answer rather than a reset.
//! - The handlers' queue is bounded; when it is full the request gets a 503
//!   at once from here.

use std::collections::BTreeMap;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender};
use tiny_http::{Completion, Request};

use super::parse::{framing, Framing, Head, ReadFail};
use super::parse::{read_chunked, read_exact, read_head, too_large, wants_close};
use super::refusal::Refusal;
use super::{ConnectionLimits, FrontStats};

/// What a connection's thread shares with the accept thread.
pub(super) struct Shared {
    pub limits: ConnectionLimits,
    /// Bodies over `body_bytes_max` being read or handled now (`Uploads`).
    pub uploading: Arc<AtomicUsize>,
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
pub(super) struct Waiting {
    next: AtomicU64,
    conns: Mutex<BTreeMap<u64, Arc<TcpStream>>>,
}

impl Waiting {
    pub(super) fn enter(&self, conn: &Arc<TcpStream>) -> u64 {
        let ticket = self.next.fetch_add(1, Ordering::Relaxed);
        self.lock().insert(ticket, Arc::clone(conn));
        ticket
    }

    pub(super) fn leave(&self, ticket: u64) {
        self.lock().remove(&ticket);
    }

    /// Closes the connection that has waited longest; false if none waits.
    pub(super) fn evict_oldest(&self) -> bool {
        let oldest = self.lock().pop_first();
        match oldest {
            Some((_, conn)) => {
                let _ = conn.shutdown(Shutdown::Both);
                true
            }
            None => false,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<TcpStream>>> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The write side handed back to the connection thread when a response ends.
pub(super) struct Returned {
    conn: TcpStream,
    reusable: bool,
}

/// The writer a request's response goes through. Each flush (a whole response,
/// or one event of a stream) must be written within `timeout`: a client that
/// does not read holds this writer no longer than that.
pub(super) struct ResponseWriter {
    conn: Option<TcpStream>,
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
    conn: Arc<TcpStream>,
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

/// The 503 a connection over `max_connections` gets, written at once from the
/// accept thread without blocking it.
pub(super) fn refuse_at_accept(conn: TcpStream) {
    let r = Refusal::new(
        503,
        "too_many_connections",
        "the server holds as many connections as it may; retry shortly",
    );
    let bytes = r.to_bytes(Some(1), true);
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
fn linger(rd: &mut BufReader<TimedReader>, conn: &TcpStream, limits: &ConnectionLimits) {
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
fn write_by(conn: &mut TcpStream, bytes: &[u8], deadline: Instant) -> io::Result<()> {
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

fn write_refusal(conn: &mut TcpStream, limits: &ConnectionLimits, bytes: &[u8]) -> bool {
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
pub(super) fn serve(
    conn: Arc<TcpStream>,
    ticket: u64,
    remote_addr: Option<SocketAddr>,
    shared: &Shared,
) {
    let limits = &shared.limits;
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
        let mut request = match read_request(&mut rd, &mut writer, first, shared) {
            Some(r) => r,
            None => return,
        };
        first = false;
        let close_after = wants_close(&request.head);
        drop(waiting);
        let _upload = request.upload.take();

        // Hand the request to a handler; the response comes back through
        // `back_rx` before anything more is read from this connection.
        let Some(handed) = hand_over(request, &conn, writer, &back_tx, remote_addr, shared) else {
            return;
        };
        writer = match handed {
            Handed::ToHandler => {
                let Ok(returned) = back_rx.recv() else {
                    return;
                };
                if !returned.reusable {
                    return;
                }
                returned.conn
            }
            Handed::Refused(writer) => writer,
        };
        if close_after {
            let _ = writer.shutdown(Shutdown::Write);
            return;
        }
    }
}

/// Where a request read whole went.
enum Handed {
    /// To the handlers' queue: its response comes back through the writer.
    ToHandler,
    /// Answered here with a 503 (every handler busy and the queue full); the
    /// connection stays usable.
    Refused(TcpStream),
}

/// Hands a request to the handlers, or refuses it when `handlers +
/// queue_depth` requests are already between their connection and their
/// complete answers (with every handler busy, `queue_depth` wait; a bound on
/// the channel alone would refuse a burst that idle handlers had not yet
/// woken to take). None when the connection is to close.
fn hand_over(
    request: ReadRequest,
    conn: &TcpStream,
    mut writer: TcpStream,
    back: &Sender<Returned>,
    remote_addr: Option<SocketAddr>,
    shared: &Shared,
) -> Option<Handed> {
    let (limits, stats) = (&shared.limits, &shared.stats);
    let limit = limits.handlers + limits.queue_depth;
    let admitted = stats
        .in_handlers
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < limit).then_some(n + 1)
        })
        .is_ok();
    if !admitted {
        stats.refused_queue_full.fetch_add(1, Ordering::Relaxed);
        let r = Refusal::new(
            503,
            "server_busy",
            "every HTTP handler is busy and their queue is full; retry shortly",
        );
        return write_refusal(&mut writer, limits, &r.to_bytes(Some(1), false))
            .then_some(Handed::Refused(writer));
    }
    let completion = Completion::default();
    let response_writer = ResponseWriter {
        conn: Some(writer),
        buf: Vec::with_capacity(1024),
        timeout: limits.write_timeout,
        deadline: None,
        failed: false,
        completion: completion.clone(),
        back: Some(back.clone()),
        stats: Arc::clone(stats),
        counted: true,
    };
    let head = request.head;
    let mut request = Request::from_parts(
        head.method,
        head.target,
        head.version,
        head.headers,
        remote_addr,
        request.body,
        Box::new(response_writer),
        completion,
    );
    request.set_peer_socket(conn.try_clone().ok().map(std::os::fd::OwnedFd::from));
    // The channel holds `limit`, so it is not full: if this fails the server
    // has stopped (the request, dropped, answered 500).
    shared
        .queue
        .try_send(request)
        .ok()
        .map(|()| Handed::ToHandler)
}

/// A request read whole from its connection.
struct ReadRequest {
    head: Head,
    body: Vec<u8>,
    /// Held while a large body is in memory, until its answer is written.
    upload: Option<UploadPermit>,
}

/// Waits for the next request and reads it whole: its first byte within the
/// header deadline (first request, counted from accept) or the keep-alive
/// (later ones), its head within the header deadline, its body within the body
/// deadline. None when the connection is to close: the client closed or was
/// too slow, or the request was refused (answered here).
fn read_request(
    rd: &mut BufReader<TimedReader>,
    writer: &mut TcpStream,
    first: bool,
    shared: &Shared,
) -> Option<ReadRequest> {
    let limits = &shared.limits;
    if rd.buffer().is_empty() && !await_request(rd, first, shared) {
        return None;
    }
    if !first {
        rd.get_mut().deadline = Instant::now() + limits.header_timeout;
    }
    match read_whole(rd, writer, shared) {
        Ok(r) => Some(r),
        Err((part, fail)) => {
            answer_failure(part, fail, rd, writer, shared);
            None
        }
    }
}

/// Waits for a request's first byte; false when the connection is to close
/// (closed by the client, an idle keep-alive, or a client that sent nothing).
fn await_request(rd: &mut BufReader<TimedReader>, first: bool, shared: &Shared) -> bool {
    if !first {
        rd.get_mut().deadline = Instant::now() + shared.limits.keep_alive;
    }
    match rd.fill_buf() {
        Ok([]) => false,
        Ok(_) => true,
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
            ) =>
        {
            if first {
                shared.stats.timed_out.fetch_add(1, Ordering::Relaxed);
            }
            false
        }
        Err(_) => false,
    }
}

/// Reads a head and its body within their deadlines; on failure, which part
/// ("head" or "body") and how.
fn read_whole(
    rd: &mut BufReader<TimedReader>,
    writer: &mut TcpStream,
    shared: &Shared,
) -> Result<ReadRequest, (&'static str, ReadFail)> {
    let limits = &shared.limits;
    let in_head = |f| ("head", f);
    let head = read_head(rd, limits).map_err(in_head)?;
    let framing =
        framing(&head.version, &head.headers).map_err(|r| in_head(ReadFail::Refused(r)))?;
    let mut max = limits.body_bytes_max;
    let mut upload = None;
    if let Framing::Length(n) = framing {
        let path = head.target.split('?').next().unwrap_or("");
        if n > max as u64 && limits.uploads.paths.contains(&path) {
            max = limits.uploads.bytes_max;
            if n <= max as u64 {
                upload = Some(
                    UploadPermit::take(&shared.uploading, limits.uploads.at_once)
                        .ok_or_else(|| in_head(ReadFail::Refused(uploads_busy())))?,
                );
            }
        }
        if n > max as u64 {
            return Err(in_head(ReadFail::Refused(too_large(max))));
        }
    }
    expect_continue(&head, &framing, writer, limits).map_err(in_head)?;

    rd.get_mut().deadline = Instant::now() + limits.body_timeout;
    let mut body = Vec::new();
    match framing {
        Framing::None => Ok(()),
        Framing::Length(n) => {
            body.resize(n as usize, 0);
            read_exact(rd, &mut body)
        }
        Framing::Chunked => read_chunked(rd, max, &mut body),
    }
    .map_err(|f| ("body", f))?;
    Ok(ReadRequest { head, body, upload })
}

/// One of the `Uploads::at_once` large bodies that may be held at once,
/// released when its request is answered (dropped with it).
pub(super) struct UploadPermit(Arc<AtomicUsize>);

impl UploadPermit {
    fn take(uploading: &Arc<AtomicUsize>, at_once: usize) -> Option<UploadPermit> {
        let prev = uploading.fetch_add(1, Ordering::AcqRel);
        if prev >= at_once {
            uploading.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(UploadPermit(Arc::clone(uploading)))
    }
}

impl Drop for UploadPermit {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

fn uploads_busy() -> Refusal {
    Refusal::new(
        503,
        "server_busy",
        "other large uploads are being read; retry shortly",
    )
}

/// `Expect: 100-continue` is answered before a body is read; any other
/// expectation is refused (417).
fn expect_continue(
    head: &Head,
    framing: &Framing,
    writer: &mut TcpStream,
    limits: &ConnectionLimits,
) -> Result<(), ReadFail> {
    let expect = head
        .headers
        .iter()
        .find(|h| h.field.equiv("Expect"))
        .map(|h| h.value.as_str().to_ascii_lowercase());
    match expect.as_deref() {
        None => Ok(()),
        Some("100-continue") => {
            let has_body = !matches!(framing, Framing::None | Framing::Length(0));
            if has_body && !write_refusal(writer, limits, b"HTTP/1.1 100 Continue\r\n\r\n") {
                return Err(ReadFail::Gone);
            }
            Ok(())
        }
        Some(_) => Err(ReadFail::Refused(Refusal::new(
            417,
            "expectation_failed",
            "only 'Expect: 100-continue' is understood",
        ))),
    }
}

/// A request that did not arrive in time gets 408; a refused one its answer
/// and a lingering close; one whose client left, nothing.
fn answer_failure(
    part: &str,
    fail: ReadFail,
    rd: &mut BufReader<TimedReader>,
    writer: &mut TcpStream,
    shared: &Shared,
) {
    let (limits, stats) = (&shared.limits, &shared.stats);
    match fail {
        ReadFail::Gone => {}
        ReadFail::TimedOut => {
            stats.timed_out.fetch_add(1, Ordering::Relaxed);
            let r = Refusal::new(
                408,
                "request_timeout",
                format!("the request {part} did not arrive in time"),
            );
            write_refusal(writer, limits, &r.to_bytes(None, true));
        }
        ReadFail::Refused(r) => {
            let counter = if r.status == 413 {
                &stats.too_large
            } else {
                &stats.malformed
            };
            counter.fetch_add(1, Ordering::Relaxed);
            if write_refusal(writer, limits, &r.to_bytes(None, true)) {
                linger(rd, writer, limits);
            }
        }
    }
}
