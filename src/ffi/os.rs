//! The OS calls sluice makes: thread names, socket options, a peer's close
//! (TCP_INFO), the stop signals, malloc's mmap threshold, the open-files limit.

use std::ffi::c_void;
use std::sync::atomic::Ordering;

/// Names the calling thread (as seen in `/proc/<pid>/task/*/comm`, top, gdb).
/// Threads created afterwards by this thread inherit the name; sluice uses that
/// to name the threads that ggml and tiny_http create.
pub fn set_current_thread_name(name: &str) {
    // The kernel keeps 15 bytes plus the terminator.
    let mut bytes: Vec<u8> = name.bytes().filter(|&b| b != 0).take(15).collect();
    bytes.push(0);
    // SAFETY: a NUL-terminated name of at most 16 bytes.
    unsafe {
        libc::prctl(libc::PR_SET_NAME, bytes.as_ptr() as libc::c_ulong, 0, 0, 0);
    }
}

/// Sets TCP_NODELAY on a listening socket; Linux copies it to accepted sockets.
pub fn set_tcp_nodelay(listener: &std::net::TcpListener) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let one: libc::c_int = 1;
    // SAFETY: an open socket and a c_int option of the size given.
    let rc = unsafe {
        libc::setsockopt(
            listener.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY,
            &one as *const libc::c_int as *const c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Sets the accept queue of a listening socket to `backlog` connections (the
/// kernel caps it at `net.core.somaxconn`). Rust's `TcpListener::bind` asks for
/// 128; a burst beyond that drops the clients' SYNs, and each dropped client
/// waits a whole second for its retransmit while the server is idle.
pub fn set_listen_backlog(listener: &std::net::TcpListener, backlog: u32) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let backlog = libc::c_int::try_from(backlog).unwrap_or(libc::c_int::MAX);
    // SAFETY: listen(2) on an open socket that is already listening only
    // changes its queue's length.
    let rc = unsafe { libc::listen(listener.as_raw_fd(), backlog) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Sets the send timeout and the send buffer of a listening socket; Linux
/// copies both to accepted sockets. The timeout makes a write to a peer that
/// takes nothing fail instead of holding its thread (tiny_http narrows it, for
/// each write, to what is left of the response's deadline); the small buffer
/// keeps the kernel from holding much of a slow reader's stream (Linux
/// doubles it).
pub fn set_send_limits(
    listener: &std::net::TcpListener,
    timeout: std::time::Duration,
    buffer_bytes: usize,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let tv = libc::timeval {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_usec: timeout.subsec_micros() as libc::suseconds_t,
    };
    let bytes = buffer_bytes.min(libc::c_int::MAX as usize) as libc::c_int;
    let fd = listener.as_raw_fd();
    // SAFETY: an open socket and options of the sizes given.
    let rc = unsafe {
        let a = libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_SNDTIMEO,
            &tv as *const libc::timeval as *const c_void,
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        );
        let b = libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            &bytes as *const libc::c_int as *const c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
        a.min(b)
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Whether the peer of a connected socket has closed or reset it, without
/// waiting. For TCP this reads the connection's state (`TCP_INFO`): the peer's
/// FIN moves it to CLOSE_WAIT, a reset to CLOSE. (`poll` with `POLLRDHUP`
/// cannot tell a peer's close from tiny_http shutting down its own read side
/// after a `Connection: close` request.) Other sockets fall back to `poll`.
pub fn peer_closed(fd: &std::os::fd::OwnedFd) -> bool {
    use std::os::fd::AsRawFd;
    // tcp_info starts with the state byte (linux/tcp.h); its states, from
    // include/net/tcp_states.h, in which the peer has closed or reset:
    const TCP_TIME_WAIT: u8 = 6;
    const TCP_CLOSE: u8 = 7;
    const TCP_CLOSE_WAIT: u8 = 8;
    const TCP_LAST_ACK: u8 = 9;
    const TCP_CLOSING: u8 = 11;
    let mut info = std::mem::MaybeUninit::<libc::tcp_info>::zeroed();
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `info`.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            info.as_mut_ptr() as *mut c_void,
            &mut len,
        )
    };
    if rc == 0 && len >= 1 {
        // SAFETY: the kernel filled at least the first `len` bytes; the rest
        // stayed zeroed, a valid tcp_info.
        let state = unsafe { info.assume_init() }.tcpi_state;
        return matches!(
            state,
            TCP_TIME_WAIT | TCP_CLOSE | TCP_CLOSE_WAIT | TCP_LAST_ACK | TCP_CLOSING
        );
    }
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one pollfd, no wait.
    let rc = unsafe { libc::poll(&mut p, 1, 0) };
    rc > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// SIGTERM and SIGINT received since `catch_stop_signals`.
static STOP_SIGNALS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
/// Exit status when a second SIGINT cuts a drain short.
pub const EXIT_SECOND_SIGNAL: i32 = 2;

extern "C" fn on_stop_signal(sig: libc::c_int) {
    // Only async-signal-safe work here: an atomic add, and `_exit`. A SIGTERM
    // during the drain is only counted: supervisors send one after their own
    // stop hook (Kubernetes after a preStop that started the drain).
    if STOP_SIGNALS.fetch_add(1, Ordering::SeqCst) >= 1 && sig == libc::SIGINT {
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(EXIT_SECOND_SIGNAL) };
    }
}

/// From now on, SIGTERM and SIGINT are counted instead of killing the process
/// (the caller drains on the first); a SIGINT after the first signal (Ctrl-C
/// again) exits at once with `EXIT_SECOND_SIGNAL`. Returns the count.
pub fn catch_stop_signals() -> &'static std::sync::atomic::AtomicU32 {
    // SAFETY: a zeroed sigaction is valid; the handler is async-signal-safe.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_stop_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        libc::sigemptyset(&mut sa.sa_mask);
        sa.sa_flags = libc::SA_RESTART;
        libc::sigaction(libc::SIGTERM, &sa, std::ptr::null_mut());
        libc::sigaction(libc::SIGINT, &sa, std::ptr::null_mut());
    }
    &STOP_SIGNALS
}

/// Allocations of at least `bytes` get pages of their own from the kernel and
/// give them back when freed (glibc's `M_MMAP_THRESHOLD`, fixed: glibc would
/// otherwise raise it to the size of the largest block freed, and serve the
/// prefix cache's multi-megabyte entries from its heap, where freed space
/// stays resident). Measured at defaults after a closed loop and a
/// conversation: 556 MB resident without, 510 MB with.
pub fn return_large_blocks_to_the_kernel(bytes: usize) {
    // SAFETY: mallopt only sets an allocator parameter; any value is valid.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, bytes.min(i32::MAX as usize) as i32);
    }
}

/// Raises the soft open-files limit to the hard limit; returns the new soft limit.
pub fn raise_nofile_limit() -> u64 {
    // SAFETY: getrlimit/setrlimit with valid rlimit structs.
    unsafe {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 0;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                return raised.rlim_cur;
            }
        }
        lim.rlim_cur
    }
}

/// The local time formatted by C's `strftime` (what Python's `strftime` calls),
/// or `None` for a format that is empty, has a NUL or formats to over 256 bytes.
pub fn strftime_now(format: &str) -> Option<String> {
    let fmt = std::ffi::CString::new(format).ok()?;
    let mut buf = [0u8; 256];
    // SAFETY: `time` with a null pointer only returns; `localtime_r` writes the
    // `tm` given; `strftime` writes at most `buf.len()` bytes and returns how
    // many (0 when it did not fit), reading a NUL-terminated format.
    let n = unsafe {
        let now = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&now, &mut tm).is_null() {
            return None;
        }
        libc::strftime(
            buf.as_mut_ptr() as *mut libc::c_char,
            buf.len(),
            fmt.as_ptr(),
            &tm,
        )
    };
    (n > 0).then(|| String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// CPUID leaf `leaf`, sub-leaf `sub`: EAX, EBX, ECX, EDX. (Safe to call on
/// every x86-64 CPU; the intrinsic is marked `unsafe` in the older Rust
/// releases sluice still builds with.)
#[cfg(target_arch = "x86_64")]
#[allow(unused_unsafe)]
pub fn cpuid(leaf: u32, sub: u32) -> [u32; 4] {
    // SAFETY: CPUID exists on every x86-64 CPU and only reads.
    let r = unsafe { std::arch::x86_64::__cpuid_count(leaf, sub) };
    [r.eax, r.ebx, r.ecx, r.edx]
}
