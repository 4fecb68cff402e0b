//! The front door: HTTP/1.1 connections, sluice's way, on tiny_http's message
//! types. tiny_http (vendored, `vendor/tiny_http`) supplies `Request`,
//! `Response` and headers; everything about connections is here: the accept
//! loop and its bound on connections (`Door`), one thread per connection
//! with one request in flight, deadlines and strict framing (`conn`,
//! `parse`), the bounded queue to the handlers, and the refusals written
//! before any handler sees a request (`refusal`, which `http::error` shares).

mod conn;
mod parse;
mod pool;
pub mod refusal;

use std::io;
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use tiny_http::Request;

/// What a client may send, and how long it may take, enforced on the
/// connection's own thread (never on the threads that handle requests).
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// The whole request head must arrive within this, counted from accept
    /// (first request) or from its first byte (later ones).
    pub header_timeout: Duration,
    /// The whole body must arrive within this, counted from the end of the head.
    pub body_timeout: Duration,
    /// An idle keep-alive connection is closed after this.
    pub keep_alive: Duration,
    /// Each flush of a response (the whole of a plain one, each event of a
    /// stream) must be written within this.
    pub write_timeout: Duration,
    /// Longest request line (414 over it) or header line (431 over it).
    pub header_line_bytes_max: usize,
    /// Most header lines (431 over it).
    pub headers_max: usize,
    /// Most bytes of header lines in all (431 over it).
    pub header_bytes_max: usize,
    /// Largest body (413 over it).
    pub body_bytes_max: usize,
    /// Paths whose body may be larger (file uploads), how large, and how
    /// many such bodies may be read at once (a 503 beyond: each is held in
    /// memory until its handler is done).
    pub uploads: Uploads,
    /// Most connections open at once; a connection over it gets a 503.
    pub max_connections: usize,
    /// Threads that call `recv()` (the handlers).
    pub handlers: usize,
    /// Most requests read and waiting for a handler while every handler is
    /// busy; over it, a 503.
    pub queue_depth: usize,
    /// After a refusal, discard what the client still sends for at most this long...
    pub linger: Duration,
    /// ...and at most this many bytes, so that it reads the refusal, not a reset.
    pub linger_bytes_max: usize,
}

/// Bodies larger than `body_bytes_max` that some paths take.
#[derive(Debug, Clone, Copy, Default)]
pub struct Uploads {
    pub paths: &'static [&'static str],
    pub bytes_max: usize,
    pub at_once: usize,
}

#[cfg(test)]
impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(10),
            keep_alive: Duration::from_secs(5),
            write_timeout: Duration::from_secs(30),
            header_line_bytes_max: 8 * 1024,
            headers_max: 100,
            header_bytes_max: 32 * 1024,
            body_bytes_max: 1024 * 1024,
            uploads: Uploads::default(),
            max_connections: 512,
            handlers: 4,
            queue_depth: 64,
            linger: Duration::from_secs(5),
            linger_bytes_max: 64 * 1024 * 1024,
        }
    }
}

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
    pub last_accept_errno: AtomicI32,
}

/// The open front door: connections accepted and read on their own threads,
/// requests read whole waiting in a bounded queue for the handlers.
pub struct Door {
    /// False once the accept thread has stopped for good.
    accepting: Arc<AtomicBool>,
    queue: Receiver<Request>,
    stats: Arc<FrontStats>,
}

impl Door {
    /// Starts the accept thread (`sluice-accept`) on `listener`; connections
    /// get threads named `sluice-conn`.
    pub fn open(listener: TcpListener, limits: ConnectionLimits) -> io::Result<Door> {
        let accepting = Arc::new(AtomicBool::new(true));
        let stats = Arc::new(FrontStats::default());
        let (queue_tx, queue) =
            crossbeam_channel::bounded((limits.handlers + limits.queue_depth).max(1));
        let shared = Arc::new(conn::Shared {
            limits,
            uploading: Arc::default(),
            queue: queue_tx,
            stats: Arc::clone(&stats),
            waiting: conn::Waiting::default(),
        });
        let flag = Arc::clone(&accepting);
        thread::Builder::new()
            .name("sluice-accept".into())
            .spawn(move || {
                // However this thread ends (a panic included), the door says
                // it no longer accepts.
                let _accepting = Accepting(flag);
                accept_loop(&listener, &shared);
            })?;
        Ok(Door {
            accepting,
            queue,
            stats,
        })
    }

    /// The next request read whole; None once the door has stopped.
    pub fn recv(&self) -> Option<Request> {
        self.queue.recv().ok()
    }

    /// False once the accept thread has stopped (the listener failed for
    /// good): no new connection will be accepted.
    pub fn is_accepting(&self) -> bool {
        self.accepting.load(Relaxed)
    }

    /// The door's counters (connections open, refusals).
    pub fn stats(&self) -> &FrontStats {
        &self.stats
    }

    /// Requests read whole and waiting for a handler.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }
}

struct Accepting(Arc<AtomicBool>);

impl Drop for Accepting {
    fn drop(&mut self) {
        self.0.store(false, Relaxed);
    }
}

/// Counts a connection open from accept until its thread ends (or its task
/// is dropped unrun).
struct Open(Arc<FrontStats>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Relaxed);
    }
}

/// Accepts until the listener fails for good. Errors that pass (out of
/// descriptors or memory for now, a connection reset before it was accepted)
/// are waited out and counted; any other ends the loop, visibly
/// (`Door::is_accepting`).
fn accept_loop(listener: &TcpListener, shared: &Arc<conn::Shared>) {
    let pool = pool::Pool::new("sluice-conn");
    loop {
        match listener.accept() {
            Ok((sock, remote_addr)) => {
                if !room_for_one_more(shared) {
                    shared.stats.refused_connections.fetch_add(1, Relaxed);
                    conn::refuse_at_accept(sock);
                    continue;
                }
                let stats = &shared.stats;
                stats.open.fetch_add(1, Relaxed);
                let open = Open(Arc::clone(stats));
                let sock = Arc::new(sock);
                let ticket = shared.waiting.enter(&sock);
                let inside = Arc::clone(shared);
                let spawned = pool.run(Box::new(move || {
                    conn::serve(sock, ticket, Some(remote_addr), &inside);
                    drop(open);
                }));
                if !spawned {
                    // No thread for it (the task, and the socket with it,
                    // was dropped): refused, never a panic.
                    shared.waiting.leave(ticket);
                    stats.refused_connections.fetch_add(1, Relaxed);
                    thread::sleep(Duration::from_millis(10));
                }
            }
            Err(e) if accept_error_passes(&e) => {
                let stats = &shared.stats;
                stats
                    .last_accept_errno
                    .store(e.raw_os_error().unwrap_or(0), Relaxed);
                stats.accept_errors.fetch_add(1, Relaxed);
                thread::sleep(Duration::from_millis(50));
            }
            Err(_) => return,
        }
    }
}

/// A bound on connections, so on threads. At the bound, the connection that
/// has waited longest on its client is closed for room; false when none
/// waits (the new one is then refused).
fn room_for_one_more(shared: &conn::Shared) -> bool {
    let stats = &shared.stats;
    let max = shared.limits.max_connections;
    if stats.open.load(Relaxed) < max {
        return true;
    }
    // A connection closed for room ends at once (its read returns); one that
    // has just answered its last request is ending too. Wait for that,
    // briefly, so that threads stay within the bound: polled finely, since the
    // thread usually ends within tens of microseconds and the accept loop, not
    // the clients, must not set the pace of a connection flood.
    let grace = if shared.waiting.evict_oldest() {
        stats.evicted.fetch_add(1, Relaxed);
        Duration::from_millis(50)
    } else {
        Duration::from_millis(5)
    };
    let waited = Instant::now();
    while stats.open.load(Relaxed) >= max && waited.elapsed() < grace {
        thread::sleep(Duration::from_micros(20));
    }
    stats.open.load(Relaxed) < max
}

/// Accept errors that pass (a connection reset before it was accepted,
/// descriptors or memory exhausted for now, a signal).
fn accept_error_passes(e: &io::Error) -> bool {
    use std::io::ErrorKind as K;
    if matches!(
        e.kind(),
        K::ConnectionAborted | K::ConnectionReset | K::Interrupted | K::WouldBlock | K::TimedOut
    ) {
        return true;
    }
    // EMFILE 24, ENFILE 23, ENOBUFS 105, ENOMEM 12, EPROTO 71, EPERM 1 (Linux)
    matches!(e.raw_os_error(), Some(24 | 23 | 105 | 12 | 71 | 1))
}
