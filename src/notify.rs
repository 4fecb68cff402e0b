//! systemd's notify protocol: one datagram per state change to the Unix socket
//! named by `$NOTIFY_SOCKET` (`READY=1`, `STATUS=…`, `WATCHDOG=1`,
//! `STOPPING=1`). Without the variable (not run by systemd), every call is a
//! no-op. Written on std's `UnixDatagram`: the protocol is one `sendto`.

use std::os::unix::net::UnixDatagram;
use std::time::Duration;

pub struct Notifier {
    socket: Option<(UnixDatagram, std::os::unix::net::SocketAddr)>,
    /// `$WATCHDOG_USEC`: systemd restarts the service if no `WATCHDOG=1` comes
    /// within this.
    pub watchdog: Option<Duration>,
}

impl Notifier {
    /// From the environment systemd sets (`NOTIFY_SOCKET`, `WATCHDOG_USEC`,
    /// `WATCHDOG_PID`). A path starting with `@` is an abstract socket.
    pub fn from_env() -> Notifier {
        let socket = std::env::var("NOTIFY_SOCKET").ok().and_then(|path| {
            let addr = if let Some(name) = path.strip_prefix('@') {
                use std::os::linux::net::SocketAddrExt;
                std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).ok()?
            } else {
                std::os::unix::net::SocketAddr::from_pathname(&path).ok()?
            };
            Some((UnixDatagram::unbound().ok()?, addr))
        });
        let for_us = std::env::var("WATCHDOG_PID")
            .ok()
            .and_then(|p| p.parse::<u32>().ok())
            .is_none_or(|p| p == std::process::id());
        let watchdog = std::env::var("WATCHDOG_USEC")
            .ok()
            .and_then(|u| u.parse::<u64>().ok())
            .filter(|&u| u > 0 && for_us)
            .map(Duration::from_micros);
        Notifier { socket, watchdog }
    }

    /// Sends `state` (newline-separated `KEY=value` lines). Failures are
    /// ignored: systemd not listening must not stop the server.
    pub fn notify(&self, state: &str) {
        if let Some((sock, addr)) = &self.socket {
            let _ = sock.send_to_addr(state.as_bytes(), addr);
        }
    }
}
