//! The safe wrapper over llama.cpp (llama-cpp-sys-2) and the two OS calls sluice
//! needs. This is the only module with `unsafe` code; everything it hands out is
//! safe to use from the rest of the crate.
//!
//! Why the raw bindings and not llama-cpp-2: sluice attaches one persistent,
//! pinned ggml threadpool to its context (`llama_attach_threadpool`) and installs
//! an abort callback (`llama_set_abort_callback`); the safe crate hides the raw
//! context pointer that both need.
//!
//! Ownership: a [`Model`] is shared (`Arc`) between the engine thread, which owns
//! the only [`Context`], and the HTTP handler threads, which only tokenize.
//! Tokenization reads the vocabulary and is what llama.cpp's own server does from
//! many threads at once. A `Context` is `Send` but not `Sync`: it stays on the
//! engine thread.

use llama_cpp_sys_2 as sys;
use std::ffi::{c_char, c_void, CStr, CString};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Once};

pub type Token = i32;

/// Longest piece a single token can render to; llama.cpp's longest pieces are a
/// few dozen bytes, and `token_piece` retries with the size it is told if not.
const PIECE_BYTES_START: usize = 64;

static BACKEND_INIT: Once = Once::new();
/// 0 = warnings and errors only, 1 = everything llama.cpp says.
static LOG_VERBOSE: AtomicU8 = AtomicU8::new(0);

/// Initialises llama.cpp once per process and routes its log to stderr.
/// Warnings and errors stay visible: the real reason for a failed decode is only
/// in llama.cpp's log.
pub fn backend_init(verbose: bool) {
    LOG_VERBOSE.store(u8::from(verbose), Ordering::Relaxed);
    BACKEND_INIT.call_once(|| unsafe {
        sys::llama_log_set(Some(log_callback), std::ptr::null_mut());
        sys::llama_backend_init();
        if !lazy_zero::install() {
            eprintln!(
                "sluice: ggml's CPU buffers are not laid out as expected; KV memory is cleared by writing it (all of it resident)"
            );
        }
    });
}

/// Clearing a large CPU buffer to zero gives its pages back to the kernel
/// instead of writing them.
///
/// llama.cpp clears its KV buffers when it makes them (and on
/// `llama_memory_clear`), and writing zeros makes every page resident: with a
/// stream of `--ctx` cells per sequence, 750 MB at defaults before the first
/// request. ggml's CPU buffers come from `posix_memalign`; `MADV_DONTNEED` on
/// a private anonymous page makes its next read a zero page, so the buffer
/// reads as cleared and only the cells written later become resident.
///
/// ggml has no hook for it: this wraps the CPU buffer type's `alloc_buffer`
/// (a function pointer in a static struct of ggml's) and replaces each new
/// buffer's `clear`. The structs below mirror `ggml-backend-impl.h` of the
/// pinned llama-cpp-sys-2; `install` checks the mirror against ggml's public
/// accessors and leaves everything as it was if they disagree.
mod lazy_zero {
    use super::sys;
    use std::ffi::{c_char, c_void, CStr};
    use std::sync::atomic::{AtomicUsize, Ordering};

    type AllocFn = unsafe extern "C" fn(*mut c_void, usize) -> *mut Buffer;
    type ClearFn = unsafe extern "C" fn(*mut Buffer, u8);

    /// `struct ggml_backend_buffer_type_i`, then `device` and `context`.
    #[repr(C)]
    struct BufferType {
        get_name: Option<unsafe extern "C" fn(*mut c_void) -> *const c_char>,
        alloc_buffer: Option<AllocFn>,
        rest: [*mut c_void; 6],
        device: *mut c_void,
        context: *mut c_void,
    }

    /// `struct ggml_backend_buffer`: `iface` (11 function pointers, `clear`
    /// the tenth), `buft`, `context` (the CPU buffer's allocation), `size`.
    #[repr(C)]
    struct Buffer {
        head: [*mut c_void; 9],
        clear: Option<ClearFn>,
        reset: *mut c_void,
        buft: *mut c_void,
        context: *mut c_void,
        size: usize,
    }

    /// Buffers smaller than this are cleared by writing them.
    const LAZY_BYTES_MIN: usize = 1 << 20;

    static ORIGINAL_ALLOC: AtomicUsize = AtomicUsize::new(0);
    static ORIGINAL_CLEAR: AtomicUsize = AtomicUsize::new(0);

    /// Wraps the CPU buffer type's allocator. Once per process, before any
    /// buffer is made (backend_init). False if the mirror does not fit.
    pub fn install() -> bool {
        // SAFETY: the CPU buffer type is a static struct that lives for the
        // process; it is read through the mirror only after its name, read
        // through the mirror, matched ggml's own accessor; one allocation
        // through it is checked against ggml's accessors before the hook is
        // written, on one thread, before any other ggml use.
        unsafe {
            let buft = sys::ggml_backend_cpu_buffer_type();
            if buft.is_null() {
                return false;
            }
            let t = &mut *(buft as *mut BufferType);
            let (Some(get_name), Some(alloc)) = (t.get_name, t.alloc_buffer) else {
                return false;
            };
            let name = get_name(buft as *mut c_void);
            if name.is_null()
                || CStr::from_ptr(name) != CStr::from_ptr(sys::ggml_backend_buft_name(buft))
            {
                return false;
            }
            // One small buffer, to check the buffer mirror.
            let probe = alloc(buft as *mut c_void, 4096);
            if probe.is_null() {
                return false;
            }
            let b = &*probe;
            let fits = b.size
                == sys::ggml_backend_buffer_get_size(probe as sys::ggml_backend_buffer_t)
                && b.buft == buft as *mut c_void
                && (b.context as usize).next_multiple_of(64)
                    == sys::ggml_backend_buffer_get_base(probe as sys::ggml_backend_buffer_t)
                        as usize
                && b.clear.is_some();
            if fits {
                ORIGINAL_CLEAR.store(b.clear.expect("checked") as usize, Ordering::Relaxed);
            }
            sys::ggml_backend_buffer_free(probe as sys::ggml_backend_buffer_t);
            if !fits {
                return false;
            }
            ORIGINAL_ALLOC.store(alloc as usize, Ordering::Relaxed);
            t.alloc_buffer = Some(alloc_buffer);
            true
        }
    }

    unsafe extern "C" fn alloc_buffer(buft: *mut c_void, size: usize) -> *mut Buffer {
        // SAFETY: set in `install` from the original function pointer.
        let original: AllocFn = std::mem::transmute(ORIGINAL_ALLOC.load(Ordering::Relaxed));
        let buffer = original(buft, size);
        if !buffer.is_null() {
            (*buffer).clear = Some(clear);
        }
        buffer
    }

    unsafe extern "C" fn clear(buffer: *mut Buffer, value: u8) {
        let b = &*buffer;
        let start = b.context as usize;
        let end = start + b.size;
        let page = page_size();
        let (a, z) = (start.next_multiple_of(page), end / page * page);
        if value == 0 && z > a && z - a >= LAZY_BYTES_MIN {
            // SAFETY: [start, end) is the buffer's own allocation; the pages
            // [a, z) lie inside it (glibc's chunk header is before `start`).
            libc::memset(b.context, 0, a - start);
            libc::memset(z as *mut c_void, 0, end - z);
            if libc::madvise(a as *mut c_void, z - a, libc::MADV_DONTNEED) == 0 {
                return;
            }
        }
        // SAFETY: set in `install` from the buffer interface's own clear.
        let original: ClearFn = std::mem::transmute(ORIGINAL_CLEAR.load(Ordering::Relaxed));
        original(buffer, value);
    }

    fn page_size() -> usize {
        // SAFETY: sysconf has no preconditions.
        let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if n > 0 {
            n as usize
        } else {
            4096
        }
    }
}

unsafe extern "C" fn log_callback(level: sys::ggml_log_level, text: *const c_char, _: *mut c_void) {
    if text.is_null() {
        return;
    }
    let important = level == sys::GGML_LOG_LEVEL_WARN || level == sys::GGML_LOG_LEVEL_ERROR;
    // CONT lines continue the previous message; show them only in verbose mode.
    if important || LOG_VERBOSE.load(Ordering::Relaxed) == 1 {
        let msg = CStr::from_ptr(text).to_string_lossy();
        eprint!("llama.cpp: {msg}");
    }
}

/// What llama.cpp was compiled with ("CPU : SSE3 = 1 | AVX = 1 | ...").
pub fn system_info() -> String {
    unsafe {
        let p = sys::llama_print_system_info();
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().trim().to_string()
        }
    }
}

/// Names the calling thread (as seen in `/proc/<pid>/task/*/comm`, top, gdb).
/// Threads created afterwards by this thread inherit the name; sluice uses that
/// to name the threads that ggml and tiny_http create.
pub fn set_current_thread_name(name: &str) {
    // The kernel keeps 15 bytes plus the terminator.
    let mut bytes: Vec<u8> = name.bytes().filter(|&b| b != 0).take(15).collect();
    bytes.push(0);
    unsafe {
        libc::prctl(libc::PR_SET_NAME, bytes.as_ptr() as libc::c_ulong, 0, 0, 0);
    }
}

/// Sets TCP_NODELAY on a listening socket; Linux copies it to accepted sockets.
pub fn set_tcp_nodelay(listener: &std::net::TcpListener) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let one: libc::c_int = 1;
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

/// Sets the send timeout and the send buffer of a listening socket; Linux
/// copies both to accepted sockets. The timeout makes a write to a peer that
/// takes nothing fail instead of holding its thread; the small buffer keeps the
/// kernel from holding much of a slow reader's stream (Linux doubles it).
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
    let rc = unsafe { libc::poll(&mut p, 1, 0) };
    rc > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// SIGTERM and SIGINT received since `catch_stop_signals`.
static STOP_SIGNALS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
/// Exit status when a second stop signal cuts a drain short.
pub const EXIT_SECOND_SIGNAL: i32 = 2;

extern "C" fn on_stop_signal(_: libc::c_int) {
    // Only async-signal-safe work here: an atomic add, and `_exit`.
    if STOP_SIGNALS.fetch_add(1, Ordering::SeqCst) >= 1 {
        unsafe { libc::_exit(EXIT_SECOND_SIGNAL) };
    }
}

/// From now on, SIGTERM and SIGINT are counted instead of killing the process
/// (the caller drains on the first); a second one exits at once with
/// `EXIT_SECOND_SIGNAL`. Returns the count.
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

/// A loaded GGUF model: weights and vocabulary.
pub struct Model {
    ptr: NonNull<sys::llama_model>,
    vocab: NonNull<sys::llama_vocab>,
}

// SAFETY: the model is immutable after loading. The context reads the weights,
// and tokenization/detokenization only read the vocabulary (llama.cpp's server
// tokenizes from many threads at once).
unsafe impl Send for Model {}
unsafe impl Sync for Model {}

impl Model {
    /// Loads a GGUF file. The caller checks the file first (see `engine::load_model`)
    /// so that the common mistakes get a clear message; anything llama.cpp itself
    /// rejects is reported here, with its reason in the log above.
    /// `mmap`: map the file (llama.cpp's default) rather than read it into
    /// buffers.
    pub fn load(path: &Path, mmap: bool) -> Result<Model, String> {
        let cpath = CString::new(path.to_string_lossy().as_bytes())
            .map_err(|_| format!("model path {} contains a NUL byte", path.display()))?;
        unsafe {
            let mut params = sys::llama_model_default_params();
            params.load_mode = if mmap {
                sys::LLAMA_LOAD_MODE_MMAP
            } else {
                sys::LLAMA_LOAD_MODE_NONE
            };
            let ptr = NonNull::new(sys::llama_model_load_from_file(cpath.as_ptr(), params))
                .ok_or_else(|| {
                    format!(
                        "llama.cpp could not load {} (its reason is in the log above)",
                        path.display()
                    )
                })?;
            let vocab = sys::llama_model_get_vocab(ptr.as_ptr());
            let Some(vocab) = NonNull::new(vocab as *mut sys::llama_vocab) else {
                sys::llama_model_free(ptr.as_ptr());
                return Err(format!("{} has no vocabulary", path.display()));
            };
            Ok(Model { ptr, vocab })
        }
    }

    pub fn n_ctx_train(&self) -> u32 {
        unsafe { sys::llama_model_n_ctx_train(self.ptr.as_ptr()).max(0) as u32 }
    }

    pub fn n_vocab(&self) -> usize {
        unsafe { sys::llama_vocab_n_tokens(self.vocab.as_ptr()).max(0) as usize }
    }

    /// e.g. "llama 135M Q4_1".
    pub fn description(&self) -> String {
        let mut buf = vec![0u8; 256];
        let n = unsafe {
            sys::llama_model_desc(
                self.ptr.as_ptr(),
                buf.as_mut_ptr() as *mut c_char,
                buf.len(),
            )
        };
        buf.truncate(n.clamp(0, 255) as usize);
        String::from_utf8_lossy(&buf).into_owned()
    }

    /// The chat template stored in the GGUF, if any.
    pub fn chat_template(&self) -> Option<String> {
        unsafe {
            let p = sys::llama_model_chat_template(self.ptr.as_ptr(), std::ptr::null());
            if p.is_null() {
                None
            } else {
                Some(CStr::from_ptr(p).to_string_lossy().into_owned())
            }
        }
    }

    pub fn is_eog(&self, token: Token) -> bool {
        unsafe { sys::llama_vocab_is_eog(self.vocab.as_ptr(), token) }
    }

    /// Tokenizes `text`. `add_special` adds BOS/EOS as the model asks;
    /// `parse_special` turns "<|im_start|>" and the like into their tokens.
    pub fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<Token>, String> {
        let len = i32::try_from(text.len()).map_err(|_| "text too long to tokenize".to_string())?;
        // A token is at least one byte, plus room for BOS/EOS.
        let mut tokens: Vec<Token> = vec![0; text.len() + 2];
        let n = unsafe {
            sys::llama_tokenize(
                self.vocab.as_ptr(),
                text.as_ptr() as *const c_char,
                len,
                tokens.as_mut_ptr(),
                tokens.len() as i32,
                add_special,
                parse_special,
            )
        };
        if n < 0 {
            return Err(format!("tokenizer failed ({n})"));
        }
        tokens.truncate(n as usize);
        Ok(tokens)
    }

    /// The raw bytes a token renders to (may be part of a UTF-8 character).
    pub fn token_piece(&self, token: Token, special: bool) -> Vec<u8> {
        let mut buf = vec![0u8; PIECE_BYTES_START];
        for _ in 0..2 {
            let n = unsafe {
                sys::llama_token_to_piece(
                    self.vocab.as_ptr(),
                    token,
                    buf.as_mut_ptr() as *mut c_char,
                    buf.len() as i32,
                    0,
                    special,
                )
            };
            if n >= 0 {
                buf.truncate(n as usize);
                return buf;
            }
            buf.resize((-n) as usize, 0);
        }
        Vec::new()
    }

    /// Renders a chat with llama.cpp's built-in template matcher. `None` when the
    /// template is not one llama.cpp recognises (it matches by substring, not Jinja).
    pub fn apply_chat_template(&self, template: &str, messages: &[(&str, &str)]) -> Option<String> {
        let tmpl = CString::new(template).ok()?;
        let owned: Vec<(CString, CString)> = messages
            .iter()
            .map(|(r, c)| Some((CString::new(*r).ok()?, CString::new(*c).ok()?)))
            .collect::<Option<_>>()?;
        let chat: Vec<sys::llama_chat_message> = owned
            .iter()
            .map(|(r, c)| sys::llama_chat_message {
                role: r.as_ptr(),
                content: c.as_ptr(),
            })
            .collect();
        let content_bytes: usize = messages.iter().map(|(r, c)| r.len() + c.len()).sum();
        let mut buf = vec![0u8; 2 * content_bytes + 1024];
        for _ in 0..2 {
            let n = unsafe {
                sys::llama_chat_apply_template(
                    tmpl.as_ptr(),
                    chat.as_ptr(),
                    chat.len(),
                    true,
                    buf.as_mut_ptr() as *mut c_char,
                    i32::try_from(buf.len()).ok()?,
                )
            };
            if n < 0 {
                return None;
            }
            if (n as usize) <= buf.len() {
                buf.truncate(n as usize);
                return String::from_utf8(buf).ok();
            }
            buf.resize(n as usize, 0);
        }
        None
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        unsafe { sys::llama_model_free(self.ptr.as_ptr()) }
    }
}

/// What a context is built with.
#[derive(Debug, Clone)]
pub struct ContextParams {
    /// KV cells: shared by all sequences (unified), or `n_ctx / n_seq_max`
    /// for each sequence's stream (per sequence).
    pub n_ctx: u32,
    pub kv_layout: KvLayout,
    /// Most tokens in one `decode` call; llama.cpp aborts the process above it.
    pub n_batch: u32,
    pub n_seq_max: u32,
    /// CPUs the compute threads are pinned to, one thread per entry; the calling
    /// thread becomes worker 0 and is pinned to the first.
    pub cpus: Vec<usize>,
    /// ggml's hybrid polling level (0 = sleep at once after a pass, 100 = spin long).
    pub poll: u32,
    pub flash_attn: FlashAttn,
    pub kv_type: KvType,
}

/// Flash attention (`--flash-attn`; by default measured at start-up, see
/// `app::measure_flash_attn`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlashAttn {
    /// llama.cpp decides (on where the CPU backend supports it).
    Auto,
    On,
    Off,
}

/// How sequences' KV cells are laid out (`--kv-layout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvLayout {
    /// One stream of cells per sequence id: a sequence's attention spans
    /// its own cells only. llama.cpp runs a batch's sequences in passes of
    /// consecutive sequence ids.
    PerSequence,
    /// One pool of cells: sequences share cells by metadata, and every
    /// sequence's attention spans the pool's highest used cell.
    Unified,
}

/// The types KV cells are stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvType {
    /// K and V in f16.
    F16,
    /// K in q8_0, V in f16 (`q8_0/f16`): without flash attention V is stored
    /// transposed and must stay f16, but K may be quantized. About three
    /// quarters of the f16 memory; attention reads K as q8_0 with the query
    /// quantized to q8_0 too, which on the development VM made a small chunk
    /// at depth 6,000 ~40 % cheaper.
    Q8_0KeysF16Values,
    /// K and V in q8_0: about half the memory; a quantized V cache needs flash
    /// attention.
    Q8_0,
}

impl KvType {
    fn ggml_k(self) -> sys::ggml_type {
        match self {
            KvType::F16 => sys::GGML_TYPE_F16,
            KvType::Q8_0KeysF16Values | KvType::Q8_0 => sys::GGML_TYPE_Q8_0,
        }
    }

    fn ggml_v(self) -> sys::ggml_type {
        match self {
            KvType::F16 | KvType::Q8_0KeysF16Values => sys::GGML_TYPE_F16,
            KvType::Q8_0 => sys::GGML_TYPE_Q8_0,
        }
    }

    /// Whether it needs flash attention (a quantized V cache).
    pub fn needs_flash_attn(self) -> bool {
        self.ggml_v() != sys::GGML_TYPE_F16
    }

    /// The `--kv-type` spelling: K's type, then V's after a slash when they
    /// differ.
    pub fn name(self) -> &'static str {
        match self {
            KvType::F16 => "f16",
            KvType::Q8_0KeysF16Values => "q8_0/f16",
            KvType::Q8_0 => "q8_0",
        }
    }

    pub fn from_name(v: &str) -> Option<KvType> {
        [KvType::F16, KvType::Q8_0KeysF16Values, KvType::Q8_0]
            .into_iter()
            .find(|k| k.name() == v)
    }
}

/// The one llama context: KV cache, compute graph, and the persistent threadpool.
pub struct Context {
    ptr: NonNull<sys::llama_context>,
    pool: NonNull<sys::ggml_threadpool>,
    n_batch: usize,
    n_vocab: usize,
    /// What the abort callback reads (through a raw pointer), so it must live
    /// as long as the context.
    abort: Arc<AbortWatch>,
    // Keeps the weights alive for as long as the context reads them. Declared last
    // so it is dropped after the context (fields drop in order).
    _model: Arc<Model>,
}

// SAFETY: llama contexts may move between threads; sluice keeps it on one.
unsafe impl Send for Context {}

/// What makes a running `decode` stop early: every sequence in its batch
/// cancelled (their flags are non-zero), or shutdown (the drain's deadline
/// passed). ggml asks between graph
/// nodes, many times per pass, so the check is a few atomic loads.
#[derive(Default)]
pub struct AbortWatch {
    shutdown: AtomicBool,
    watched: std::sync::Mutex<Vec<Arc<AtomicU8>>>,
}

impl AbortWatch {
    /// Stops the running pass and every later one: the server is shutting down.
    pub fn shutdown(&self) {
        self.shutdown.store(true, Ordering::Relaxed);
    }

    pub fn is_shutdown(&self) -> bool {
        self.shutdown.load(Ordering::Relaxed)
    }

    fn should_abort(&self) -> bool {
        if self.shutdown.load(Ordering::Relaxed) {
            return true;
        }
        // Only the engine thread locks it, before and after a pass; never wait.
        match self.watched.try_lock() {
            Ok(w) => !w.is_empty() && w.iter().all(|f| f.load(Ordering::Relaxed) != 0),
            Err(_) => false,
        }
    }
}

unsafe extern "C" fn abort_callback(data: *mut c_void) -> bool {
    let watch = &*(data as *const AbortWatch);
    watch.should_abort()
}

#[derive(Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// No KV slot for the batch; nothing was computed.
    KvFull,
    /// The abort flag stopped the pass.
    Aborted,
    /// Invalid batch or an internal failure (reason in llama.cpp's log).
    Failed(i32),
}

impl Context {
    /// Creates the context and its threadpool. Call it on the thread that will
    /// run `decode`: that thread is ggml's worker 0 and is pinned here.
    pub fn new(model: Arc<Model>, p: &ContextParams) -> Result<Context, String> {
        assert!(!p.cpus.is_empty(), "at least one compute thread");
        let n_threads = p.cpus.len() as i32;
        unsafe {
            let mut tp = sys::ggml_threadpool_params_default(n_threads);
            assert!(
                p.cpus.len() <= tp.cpumask.len(),
                "more threads than ggml supports"
            );
            for &cpu in &p.cpus {
                if cpu < tp.cpumask.len() {
                    tp.cpumask[cpu] = true;
                }
            }
            tp.strict_cpu = true;
            tp.poll = p.poll;
            let pool = NonNull::new(sys::ggml_threadpool_new(&mut tp))
                .ok_or("ggml could not create its threadpool")?;

            let mut cp = sys::llama_context_default_params();
            cp.n_ctx = p.n_ctx;
            cp.n_batch = p.n_batch;
            cp.n_ubatch = p.n_batch;
            cp.n_seq_max = p.n_seq_max;
            cp.n_threads = n_threads;
            cp.n_threads_batch = n_threads;
            cp.kv_unified = p.kv_layout == KvLayout::Unified;
            cp.no_perf = true;
            cp.flash_attn_type = match p.flash_attn {
                FlashAttn::Auto => sys::LLAMA_FLASH_ATTN_TYPE_AUTO,
                FlashAttn::On => sys::LLAMA_FLASH_ATTN_TYPE_ENABLED,
                FlashAttn::Off => sys::LLAMA_FLASH_ATTN_TYPE_DISABLED,
            };
            cp.type_k = p.kv_type.ggml_k();
            cp.type_v = p.kv_type.ggml_v();
            let ptr = match NonNull::new(sys::llama_init_from_model(model.ptr.as_ptr(), cp)) {
                Some(ptr) => ptr,
                None => {
                    sys::ggml_threadpool_free(pool.as_ptr());
                    return Err(
                        "llama.cpp could not create a context (reason in the log above)".into(),
                    );
                }
            };
            sys::llama_attach_threadpool(ptr.as_ptr(), pool.as_ptr(), pool.as_ptr());
            let abort = Arc::new(AbortWatch::default());
            sys::llama_set_abort_callback(
                ptr.as_ptr(),
                Some(abort_callback),
                Arc::as_ptr(&abort) as *mut c_void,
            );
            let n_batch = sys::llama_n_batch(ptr.as_ptr()) as usize;
            Ok(Context {
                ptr,
                pool,
                n_batch,
                n_vocab: model.n_vocab(),
                abort,
                _model: model,
            })
        }
    }

    pub fn n_batch(&self) -> usize {
        self.n_batch
    }

    /// Cells one sequence may hold: all of them (unified), or its stream's.
    pub fn n_ctx_seq(&self) -> usize {
        unsafe { sys::llama_n_ctx_seq(self.ptr.as_ptr()) as usize }
    }

    pub fn n_ctx(&self) -> usize {
        unsafe { sys::llama_n_ctx(self.ptr.as_ptr()) as usize }
    }

    /// Decodes `batch`, aborting the pass as soon as every flag in `watch` is
    /// set (the sequences it serves were all cancelled). With `Aborted`, the
    /// batch's new KV entries are removed again (llama.cpp does it).
    pub fn decode_watching(
        &mut self,
        batch: &Batch,
        watch: &[Arc<AtomicU8>],
    ) -> Result<(), DecodeError> {
        *self.abort.watched.lock().expect("abort watch") = watch.to_vec();
        let result = self.decode(batch);
        self.abort.watched.lock().expect("abort watch").clear();
        result
    }

    /// The handle the main thread uses to stop the engine at the end of a drain.
    pub fn abort_handle(&self) -> Arc<AbortWatch> {
        Arc::clone(&self.abort)
    }

    pub fn decode(&mut self, batch: &Batch) -> Result<(), DecodeError> {
        assert!(batch.len() <= self.n_batch, "batch over n_batch");
        if batch.is_empty() {
            return Ok(());
        }
        let rc = unsafe { sys::llama_decode(self.ptr.as_ptr(), batch.raw) };
        match rc {
            0 => Ok(()),
            1 => Err(DecodeError::KvFull),
            2 => Err(DecodeError::Aborted),
            rc => Err(DecodeError::Failed(rc)),
        }
    }

    /// Logits for the batch entry `i`, which must have been added with `logits = true`
    /// to the batch of the last successful `decode`.
    pub fn logits(&mut self, batch: &Batch, i: usize) -> &[f32] {
        assert!(
            batch.wants_logits(i),
            "logits of entry {i} were not requested"
        );
        unsafe {
            let p = sys::llama_get_logits_ith(self.ptr.as_ptr(), i as i32);
            assert!(!p.is_null(), "llama.cpp has no logits for entry {i}");
            std::slice::from_raw_parts(p, self.n_vocab)
        }
    }

    /// Frees every KV cell of every sequence and clears the cache's buffers,
    /// which gives their pages back to the kernel (`lazy_zero`).
    pub fn clear_all_cells(&mut self) {
        unsafe {
            let mem = sys::llama_get_memory(self.ptr.as_ptr());
            sys::llama_memory_clear(mem, true);
        }
    }

    /// Frees every KV cell of `seq`.
    pub fn clear_sequence(&mut self, seq: i32) {
        unsafe {
            let mem = sys::llama_get_memory(self.ptr.as_ptr());
            sys::llama_memory_seq_rm(mem, seq, -1, -1);
        }
    }

    /// Gives `dst` the cells `src` holds at positions `p0..p1` (-1: to the
    /// end). In the unified cache the cells are shared, not copied: each is
    /// freed when no sequence holds it any more.
    pub fn share_cells(&mut self, src: i32, dst: i32, p0: i32, p1: i32) {
        unsafe {
            let mem = sys::llama_get_memory(self.ptr.as_ptr());
            sys::llama_memory_seq_cp(mem, src, dst, p0, p1);
        }
    }

    /// Frees the cells of `seq` at positions `from..`.
    pub fn truncate_sequence(&mut self, seq: i32, from: i32) {
        unsafe {
            let mem = sys::llama_get_memory(self.ptr.as_ptr());
            sys::llama_memory_seq_rm(mem, seq, from, -1);
        }
    }

    /// A copy of what `seq`'s KV cells hold (positions and contents), for
    /// [`Context::restore_sequence`]: about `2 · layers · kv_width` values a token.
    /// Bytes `save_sequence(seq)` would take.
    pub fn sequence_state_size(&mut self, seq: i32) -> usize {
        unsafe { sys::llama_state_seq_get_size_ext(self.ptr.as_ptr(), seq, 0) }
    }

    pub fn save_sequence(&mut self, seq: i32) -> Vec<u8> {
        unsafe {
            let n = sys::llama_state_seq_get_size_ext(self.ptr.as_ptr(), seq, 0);
            let mut buf = vec![0u8; n];
            let written =
                sys::llama_state_seq_get_data_ext(self.ptr.as_ptr(), buf.as_mut_ptr(), n, seq, 0);
            buf.truncate(written);
            buf
        }
    }

    /// Writes a saved state into `seq` (its cells are replaced), in free cells
    /// anywhere in the cache. False when llama.cpp refused it (not enough free
    /// cells, or a state from another model); `seq` then holds nothing.
    pub fn restore_sequence(&mut self, seq: i32, state: &[u8]) -> bool {
        if state.is_empty() {
            return false;
        }
        let read = unsafe {
            sys::llama_state_seq_set_data_ext(
                self.ptr.as_ptr(),
                state.as_ptr(),
                state.len(),
                seq,
                0,
            )
        };
        if read == 0 {
            self.clear_sequence(seq);
        }
        read != 0
    }

    /// The highest position `seq` holds in the KV cache, or -1 when it holds none.
    pub fn sequence_pos_max(&self, seq: i32) -> i32 {
        unsafe {
            let mem = sys::llama_get_memory(self.ptr.as_ptr());
            sys::llama_memory_seq_pos_max(mem, seq)
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        unsafe {
            sys::llama_detach_threadpool(self.ptr.as_ptr());
            sys::llama_free(self.ptr.as_ptr());
            sys::ggml_threadpool_free(self.pool.as_ptr());
        }
    }
}

/// A batch of tokens for one `decode`, with capacity fixed at creation.
pub struct Batch {
    raw: sys::llama_batch,
    capacity: usize,
}

// SAFETY: the batch owns its buffers; it moves with the engine.
unsafe impl Send for Batch {}

impl Batch {
    pub fn new(capacity: usize) -> Batch {
        assert!(capacity > 0);
        let mut raw = unsafe { sys::llama_batch_init(capacity as i32, 0, 1) };
        raw.n_tokens = 0;
        Batch { raw, capacity }
    }

    pub fn len(&self) -> usize {
        self.raw.n_tokens as usize
    }

    pub fn is_empty(&self) -> bool {
        self.raw.n_tokens == 0
    }

    pub fn clear(&mut self) {
        self.raw.n_tokens = 0;
    }

    /// Adds a token of sequence `seq` at position `pos`; returns its batch index.
    pub fn push(&mut self, token: Token, pos: i32, seq: i32, logits: bool) -> usize {
        let i = self.raw.n_tokens as usize;
        assert!(
            i < self.capacity,
            "batch capacity {} exceeded",
            self.capacity
        );
        unsafe {
            *self.raw.token.add(i) = token;
            *self.raw.pos.add(i) = pos;
            *self.raw.n_seq_id.add(i) = 1;
            *(*self.raw.seq_id.add(i)) = seq;
            *self.raw.logits.add(i) = i8::from(logits);
        }
        self.raw.n_tokens += 1;
        i
    }

    fn wants_logits(&self, i: usize) -> bool {
        i < self.len() && unsafe { *self.raw.logits.add(i) != 0 }
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        unsafe { sys::llama_batch_free(self.raw) }
    }
}

/// How one sequence picks its next token.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax); the other fields are then ignored.
    pub temperature: f32,
    pub top_k: i32,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: u32,
}

/// A llama.cpp sampler chain (top-k, top-p, min-p, temperature, then a draw
/// from the distribution), for the sampling parameters that need candidates
/// in order (`engine::sample` handles the others).
pub struct ChainSampler(NonNull<sys::llama_sampler>);

// SAFETY: a sampler chain is plain state owned by one sequence on the engine thread.
unsafe impl Send for ChainSampler {}

impl ChainSampler {
    pub fn new(p: &SamplingParams) -> ChainSampler {
        assert!(p.temperature > 0.0, "a chain samples at a temperature");
        unsafe {
            let chain = sys::llama_sampler_chain_init(sys::llama_sampler_chain_default_params());
            if p.top_k > 0 {
                sys::llama_sampler_chain_add(chain, sys::llama_sampler_init_top_k(p.top_k));
            }
            if p.top_p < 1.0 {
                sys::llama_sampler_chain_add(chain, sys::llama_sampler_init_top_p(p.top_p, 1));
            }
            if p.min_p > 0.0 {
                sys::llama_sampler_chain_add(chain, sys::llama_sampler_init_min_p(p.min_p, 1));
            }
            sys::llama_sampler_chain_add(chain, sys::llama_sampler_init_temp(p.temperature));
            sys::llama_sampler_chain_add(chain, sys::llama_sampler_init_dist(p.seed));
            ChainSampler(NonNull::new(chain).expect("llama_sampler_chain_init returned NULL"))
        }
    }

    /// Samples from the logits of batch entry `i` of the last decode, and records
    /// the choice in the chain's state.
    pub fn sample(&mut self, ctx: &mut Context, batch: &Batch, i: usize) -> Token {
        assert!(batch.wants_logits(i), "sampling entry {i} without logits");
        unsafe { sys::llama_sampler_sample(self.0.as_ptr(), ctx.ptr.as_ptr(), i as i32) }
    }
}

impl Drop for ChainSampler {
    fn drop(&mut self) {
        unsafe { sys::llama_sampler_free(self.0.as_ptr()) }
    }
}
