//! Clearing a large CPU buffer to zero gives its pages back to the kernel
//! instead of writing them.
//!
//! llama.cpp clears its KV buffers when it makes them (and on
//! `llama_memory_clear`), and writing zeros makes every page resident: with a
//! stream of `--ctx` cells per sequence, 750 MB at defaults before the first
//! request. ggml's CPU buffers come from `posix_memalign`; `MADV_DONTNEED` on
//! a private anonymous page makes its next read a zero page, so the buffer
//! reads as cleared and only the cells written later become resident.
//!
//! ggml has no hook for it: this wraps the CPU buffer type's `alloc_buffer`
//! (a function pointer in a static struct of ggml's) and replaces each new
//! buffer's `clear`. The structs below mirror `ggml-backend-impl.h` of the
//! pinned llama-cpp-sys-2; `install` checks the mirror against ggml's public
//! accessors and leaves everything as it was if they disagree.

use llama_cpp_sys_2 as sys;
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
        let fits = b.size == sys::ggml_backend_buffer_get_size(probe as sys::ggml_backend_buffer_t)
            && b.buft == buft as *mut c_void
            && (b.context as usize).next_multiple_of(64)
                == sys::ggml_backend_buffer_get_base(probe as sys::ggml_backend_buffer_t) as usize
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

/// # Safety
/// Called by ggml as the CPU buffer type's `alloc_buffer`, after `install`.
unsafe extern "C" fn alloc_buffer(buft: *mut c_void, size: usize) -> *mut Buffer {
    // SAFETY: set in `install` from the original function pointer.
    let original: AllocFn = std::mem::transmute(ORIGINAL_ALLOC.load(Ordering::Relaxed));
    let buffer = original(buft, size);
    if !buffer.is_null() {
        (*buffer).clear = Some(clear);
    }
    buffer
}

/// # Safety
/// Called by ggml as a CPU buffer's `clear`, with a buffer `alloc_buffer` made.
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
