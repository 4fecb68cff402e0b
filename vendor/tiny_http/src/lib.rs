//! # Simple usage
//!
//! ## Creating the server
//!
//! The easiest way to create a server is to call `Server::http()`.
//!
//! The `http()` function returns an `IoResult<Server>` which will return an error
//! in the case where the server creation fails (for example if the listening port is already
//! occupied).
//!
//! ```no_run
//! let server = tiny_http::Server::http("0.0.0.0:0").unwrap();
//! ```
//!
//! A newly-created `Server` will immediately start listening for incoming connections and HTTP
//! requests.
//!
//! ## Receiving requests
//!
//! Calling `server.recv()` will block until the next request is available.
//! This function returns an `IoResult<Request>`, so you need to handle the possible errors.
//!
//! ```no_run
//! # let server = tiny_http::Server::http("0.0.0.0:0").unwrap();
//!
//! loop {
//!     // blocks until the next request is received
//!     let request = match server.recv() {
//!         Ok(rq) => rq,
//!         Err(e) => { println!("error: {}", e); break }
//!     };
//!
//!     // do something with the request
//!     // ...
//! }
//! ```
//!
//! In a real-case scenario, you will probably want to spawn multiple worker tasks and call
//! `server.recv()` on all of them. Like this:
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use std::thread;
//! # let server = tiny_http::Server::http("0.0.0.0:0").unwrap();
//! let server = Arc::new(server);
//! let mut guards = Vec::with_capacity(4);
//!
//! for _ in (0 .. 4) {
//!     let server = server.clone();
//!
//!     let guard = thread::spawn(move || {
//!         loop {
//!             let rq = server.recv().unwrap();
//!
//!             // ...
//!         }
//!     });
//!
//!     guards.push(guard);
//! }
//! ```
//!
//! If you don't want to block, you can call `server.try_recv()` instead.
//!
//! ## Handling requests
//!
//! The `Request` object returned by `server.recv()` contains informations about the client's request.
//! The most useful methods are probably `request.method()` and `request.url()` which return
//! the requested method (`GET`, `POST`, etc.) and url.
//!
//! To handle a request, you need to create a `Response` object. See the docs of this object for
//! more infos. Here is an example of creating a `Response` from a file:
//!
//! ```no_run
//! # use std::fs::File;
//! # use std::path::Path;
//! let response = tiny_http::Response::from_file(File::open(&Path::new("image.png")).unwrap());
//! ```
//!
//! All that remains to do is call `request.respond()`:
//!
//! ```no_run
//! # use std::fs::File;
//! # use std::path::Path;
//! # let server = tiny_http::Server::http("0.0.0.0:0").unwrap();
//! # let request = server.recv().unwrap();
//! # let response = tiny_http::Response::from_file(File::open(&Path::new("image.png")).unwrap());
//! let _ = request.respond(response);
//! ```
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]
#![allow(clippy::match_like_matches_macro)]

use std::error::Error;
use std::io::Error as IoError;
use std::io::ErrorKind as IoErrorKind;
use std::io::Result as IoResult;
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use connection::Connection;

pub use common::{HTTPVersion, Header, HeaderField, Method, StatusCode};
pub use conn::{Completion, FrontStats};
pub use connection::{ConfigListenAddr, ListenAddr, Listener};
pub use request::{ReadWrite, Request};
pub use response::{Response, ResponseBox};
pub use test::TestRequest;

mod common;
mod conn;
mod connection;
mod request;
mod response;
mod test;
mod util;

/// sluice patch: what a client may send, and how long it may take, enforced on
/// the connection's own thread (never on the threads that handle requests).
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
            max_connections: 512,
            handlers: 4,
            queue_depth: 64,
            linger: Duration::from_secs(5),
            linger_bytes_max: 64 * 1024 * 1024,
        }
    }
}

/// The main class of this library.
///
/// Destroying this object will immediately close the listening socket and the reading
///  part of all the client's connections. Requests that have already been returned by
///  the `recv()` function will not close and the responses will be transferred to the client.
pub struct Server {
    // sluice patch: false once the accept thread has stopped for good
    accepting: Arc<AtomicBool>,

    // should be false as long as the server exists
    // when set to true, all the subtasks will close within a few hundreds ms
    close: Arc<AtomicBool>,

    // sluice patch: the bounded queue of requests read whole, for the handlers
    messages: crossbeam_channel::Receiver<Request>,

    // sluice patch: counters of the front
    stats: Arc<FrontStats>,

    // result of TcpListener::local_addr()
    listening_addr: ListenAddr,
}

// this trait is to make sure that Server implements Share and Send
#[doc(hidden)]
const _: fn() = || {
    fn must_be_share<T: Sync + Send>() {}
    must_be_share::<Server>();
};

pub struct IncomingRequests<'a> {
    server: &'a Server,
}

/// Represents the parameters required to create a server.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The addresses to try to listen to.
    pub addr: ConfigListenAddr,

    /// If `Some`, then the server will use SSL to encode the communications.
    pub ssl: Option<SslConfig>,
}

/// Configuration of the server for SSL.
#[derive(Debug, Clone)]
pub struct SslConfig {
    /// Contains the public certificate to send to clients.
    pub certificate: Vec<u8>,
    /// Contains the ultra-secret private key used to decode communications.
    pub private_key: Vec<u8>,
}

impl Server {
    /// Shortcut for a simple server on a specific address.
    #[inline]
    pub fn http<A>(addr: A) -> Result<Server, Box<dyn Error + Send + Sync + 'static>>
    where
        A: ToSocketAddrs,
    {
        Server::new(ServerConfig {
            addr: ConfigListenAddr::from_socket_addrs(addr)?,
            ssl: None,
        })
    }

    #[cfg(unix)]
    #[inline]
    /// Shortcut for a UNIX socket server at a specific path
    pub fn http_unix(
        path: &std::path::Path,
    ) -> Result<Server, Box<dyn Error + Send + Sync + 'static>> {
        Server::new(ServerConfig {
            addr: ConfigListenAddr::unix_from_path(path),
            ssl: None,
        })
    }

    /// Builds a new server that listens on the specified address.
    pub fn new(config: ServerConfig) -> Result<Server, Box<dyn Error + Send + Sync + 'static>> {
        let listener = config.addr.bind()?;
        Self::from_listener(listener, config.ssl)
    }

    /// Builds a new server using the specified TCP listener.
    ///
    /// This is useful if you've constructed TcpListener using some less usual method
    /// such as from systemd. For other cases, you probably want the `new()` function.
    pub fn from_listener<L: Into<Listener>>(
        listener: L,
        ssl_config: Option<SslConfig>,
    ) -> Result<Server, Box<dyn Error + Send + Sync + 'static>> {
        Server::from_listener_with_limits(listener, ssl_config, ConnectionLimits::default())
    }

    /// sluice patch: `from_listener` with limits on what clients may send.
    pub fn from_listener_with_limits<L: Into<Listener>>(
        listener: L,
        ssl_config: Option<SslConfig>,
        limits: ConnectionLimits,
    ) -> Result<Server, Box<dyn Error + Send + Sync + 'static>> {
        let listener = listener.into();
        let accepting = Arc::new(AtomicBool::new(true));
        let inside_accepting = Arc::clone(&accepting);
        // building the "close" variable
        let close_trigger = Arc::new(AtomicBool::new(false));

        // building the TcpListener
        let (server, local_addr) = {
            let local_addr = listener.local_addr()?;
            log::debug!("Server listening on {}", local_addr);
            (listener, local_addr)
        };

        // sluice patch: TLS support removed; a proxy in front terminates TLS.
        if ssl_config.is_some() {
            return Err("this tiny_http (patched for sluice) serves plain HTTP only".into());
        }
        let stats = Arc::new(FrontStats::default());
        let (queue_tx, queue_rx) =
            crossbeam_channel::bounded((limits.handlers + limits.queue_depth).max(1));
        let shared = Arc::new(conn::Shared {
            limits,
            queue: queue_tx,
            stats: Arc::clone(&stats),
            waiting: conn::Waiting::default(),
        });

        let inside_close_trigger = close_trigger.clone();
        thread::spawn(move || {
            // sluice patch: however this thread ends (a panic included), the
            // server says it no longer accepts.
            struct Accepting(Arc<AtomicBool>);
            impl Drop for Accepting {
                fn drop(&mut self) {
                    self.0.store(false, Relaxed);
                }
            }
            let _accepting = Accepting(inside_accepting);

            // a tasks pool is used to dispatch the connections into threads
            let tasks_pool = util::TaskPool::new();

            // sluice patch: counts a connection open from accept until its
            // thread ends (or its task is dropped unrun).
            struct Open(Arc<FrontStats>);
            impl Drop for Open {
                fn drop(&mut self) {
                    self.0.open.fetch_sub(1, Relaxed);
                }
            }

            log::debug!("Running accept thread");
            while !inside_close_trigger.load(Relaxed) {
                match server.accept() {
                    Ok((sock, remote_addr)) => {
                        // sluice patch: a bound on connections, so on threads.
                        // At the bound, the connection that has waited longest on
                        // its client is closed for room; with none waiting, the
                        // new one is refused.
                        let stats = &shared.stats;
                        let max = shared.limits.max_connections;
                        if stats.open.load(Relaxed) >= max {
                            // A connection closed for room ends at once (its
                            // read returns); one that has just answered its
                            // last request is ending too. Wait for that,
                            // briefly, so that threads stay within the bound:
                            // polled finely, since the thread usually ends
                            // within tens of microseconds and the accept
                            // loop, not the clients, must not set the pace
                            // of a connection flood.
                            let evicted = shared.waiting.evict_oldest();
                            let grace = if evicted {
                                stats.evicted.fetch_add(1, Relaxed);
                                Duration::from_millis(50)
                            } else {
                                Duration::from_millis(5)
                            };
                            let waited = std::time::Instant::now();
                            while stats.open.load(Relaxed) >= max && waited.elapsed() < grace {
                                thread::sleep(Duration::from_micros(20));
                            }
                            if stats.open.load(Relaxed) >= max {
                                stats.refused_connections.fetch_add(1, Relaxed);
                                conn::refuse_at_accept(sock);
                                continue;
                            }
                        }
                        stats.open.fetch_add(1, Relaxed);
                        let open = Open(Arc::clone(stats));
                        let sock = Arc::new(sock);
                        let ticket = shared.waiting.enter(&sock);
                        let inside_shared = Arc::clone(&shared);
                        let mut task = Some((sock, open));
                        let spawned = tasks_pool.spawn(Box::new(move || {
                            if let Some((sock, open)) = task.take() {
                                conn::serve(sock, ticket, remote_addr, &inside_shared);
                                drop(open);
                            }
                        }));
                        if !spawned {
                            // No thread for it (the task, and the socket with
                            // it, was dropped): refused, never a panic.
                            shared.waiting.leave(ticket);
                            stats.refused_connections.fetch_add(1, Relaxed);
                            thread::sleep(Duration::from_millis(10));
                        }
                    }

                    // sluice patch: upstream ended the accept thread on any error
                    // (e.g. out of file descriptors), leaving a live server that
                    // accepts nothing. Errors that pass are waited out; the others
                    // end it visibly (`Server::is_accepting`).
                    Err(e) if accept_error_passes(&e) => {
                        log::error!("Error accepting new client (retrying): {}", e);
                        let stats = &shared.stats;
                        stats
                            .last_accept_errno
                            .store(e.raw_os_error().unwrap_or(0), Relaxed);
                        stats.accept_errors.fetch_add(1, Relaxed);
                        thread::sleep(Duration::from_millis(50));
                    }
                    Err(e) => {
                        log::error!("Error accepting new client: {}", e);
                        break;
                    }
                }
            }
            log::debug!("Terminating accept thread");
        });

        // result
        Ok(Server {
            accepting,
            messages: queue_rx,
            stats,
            close: close_trigger,
            listening_addr: local_addr,
        })
    }

    /// sluice patch: false once the accept thread has stopped (the listener
    /// failed for good, or the server is closing): no new connection will be
    /// accepted.
    pub fn is_accepting(&self) -> bool {
        self.accepting.load(Relaxed)
    }

    /// Returns an iterator for all the incoming requests.
    ///
    /// The iterator will return `None` if the server socket is shutdown.
    #[inline]
    pub fn incoming_requests(&self) -> IncomingRequests<'_> {
        IncomingRequests { server: self }
    }

    /// Returns the address the server is listening to.
    #[inline]
    pub fn server_addr(&self) -> ListenAddr {
        self.listening_addr.clone()
    }

    /// Returns the number of clients currently connected to the server.
    /// sluice patch: the front's counters (connections open, refusals).
    pub fn stats(&self) -> &FrontStats {
        &self.stats
    }

    /// sluice patch: requests read whole and waiting for a handler.
    pub fn queued(&self) -> usize {
        self.messages.len()
    }

    pub fn recv(&self) -> IoResult<Request> {
        self.messages
            .recv()
            .map_err(|_| IoError::new(IoErrorKind::Other, "the server has stopped"))
    }

    pub fn recv_timeout(&self, timeout: Duration) -> IoResult<Option<Request>> {
        match self.messages.recv_timeout(timeout) {
            Ok(rq) => Ok(Some(rq)),
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => Ok(None),
            Err(e) => Err(IoError::new(IoErrorKind::Other, e)),
        }
    }

    pub fn try_recv(&self) -> IoResult<Option<Request>> {
        match self.messages.try_recv() {
            Ok(rq) => Ok(Some(rq)),
            Err(crossbeam_channel::TryRecvError::Empty) => Ok(None),
            Err(e) => Err(IoError::new(IoErrorKind::Other, e)),
        }
    }
}

impl Iterator for IncomingRequests<'_> {
    type Item = Request;
    fn next(&mut self) -> Option<Request> {
        self.server.recv().ok()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.close.store(true, Relaxed);
        // Connect briefly to ourselves to unblock the accept thread
        let maybe_stream = match &self.listening_addr {
            ListenAddr::IP(addr) => TcpStream::connect(addr).map(Connection::from),
            #[cfg(unix)]
            ListenAddr::Unix(addr) => {
                // TODO: use connect_addr when its stabilized.
                let path = addr.as_pathname().unwrap();
                std::os::unix::net::UnixStream::connect(path).map(Connection::from)
            }
        };
        if let Ok(stream) = maybe_stream {
            let _ = stream.shutdown(Shutdown::Both);
        }

        #[cfg(unix)]
        if let ListenAddr::Unix(addr) = &self.listening_addr {
            if let Some(path) = addr.as_pathname() {
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

/// sluice patch: accept errors that pass (a connection reset before it was
/// accepted, descriptors or memory exhausted for now, a signal).
fn accept_error_passes(e: &IoError) -> bool {
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
