//! llama.cpp's process-wide set-up (backend, log) and a loaded model:
//! weights, vocabulary, tokenization, chat template.

use super::lazy_zero;
use llama_cpp_sys_2 as sys;
use std::ffi::{c_char, c_void, CStr, CString};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Once;

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
    // SAFETY: once per process, before any model or context exists; the log
    // callback is a plain function that lives for the whole process.
    BACKEND_INIT.call_once(|| unsafe {
        sys::llama_log_set(Some(log_callback), std::ptr::null_mut());
        sys::llama_backend_init();
        if !lazy_zero::install() {
            crate::say!(
                "sluice: ggml's CPU buffers are not laid out as expected; KV memory is cleared by writing it (all of it resident)"
            );
        }
    });
}

/// Set from the moment sluice's abort callback stops a pass until its
/// `llama_decode` returns (`Context::decode`). llama.cpp reports such a pass
/// in four lines, as errors and a warning: the graph's compute "failed" with
/// ggml's status 1 (`GGML_STATUS_ABORTED`), the batch's KV entries were
/// removed, and `llama_decode` failed with 2 (its abort). All are what sluice
/// asked for, when every client of the batch left, and
/// `sluice_decodes_aborted_total` counts them.
pub(super) static ABORTING: AtomicBool = AtomicBool::new(false);

/// Whether a line of llama.cpp's log only reports a pass that was aborted.
fn reports_our_abort(text: &str) -> bool {
    let text = text.trim_end();
    text.ends_with("ggml_backend_sched_graph_compute_async failed with error 1")
        || text.ends_with("failed to compute graph, compute status: 1")
        || text.contains("removing memory module entries for seq_id")
        || text.ends_with("llama_decode: failed to decode, ret = 2")
}

/// # Safety
/// `text` is NULL or a NUL-terminated string, as ggml promises its log callback.
unsafe extern "C" fn log_callback(level: sys::ggml_log_level, text: *const c_char, _: *mut c_void) {
    if text.is_null() {
        return;
    }
    let important = level == sys::GGML_LOG_LEVEL_WARN || level == sys::GGML_LOG_LEVEL_ERROR;
    // CONT lines continue the previous message; show them only in verbose mode.
    if important || LOG_VERBOSE.load(Ordering::Relaxed) == 1 {
        // Through `say!`: never a panic across this C frame on a closed
        // stderr, and a JSON line with --log-format json.
        let msg = CStr::from_ptr(text).to_string_lossy();
        // A client leaving mid-prefill is not an error to show the operator.
        if ABORTING.load(Ordering::Relaxed) && reports_our_abort(&msg) {
            return;
        }
        crate::say!("llama.cpp: {}", msg.trim_end_matches('\n'));
    }
}

/// What llama.cpp was compiled with ("CPU : SSE3 = 1 | AVX = 1 | ...").
pub fn system_info() -> String {
    // SAFETY: returns NULL or a static NUL-terminated string.
    unsafe {
        let p = sys::llama_print_system_info();
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().trim().to_string()
        }
    }
}

/// A loaded GGUF model: weights and vocabulary.
pub struct Model {
    pub(super) ptr: NonNull<sys::llama_model>,
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
        // SAFETY: `cpath` is NUL-terminated and outlives the call; the model and
        // vocabulary pointers are checked for NULL.
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
        // SAFETY: a live model (freed only in Drop).
        unsafe { sys::llama_model_n_ctx_train(self.ptr.as_ptr()).max(0) as u32 }
    }

    pub fn n_vocab(&self) -> usize {
        // SAFETY: a live vocabulary (it lives as long as the model).
        unsafe { sys::llama_vocab_n_tokens(self.vocab.as_ptr()).max(0) as usize }
    }

    /// Floats in one token's output embedding.
    pub fn n_embd(&self) -> usize {
        // SAFETY: a live model.
        unsafe { sys::llama_model_n_embd_out(self.ptr.as_ptr()).max(0) as usize }
    }

    /// A GGUF metadata value as text (`general.architecture`,
    /// `llama.context_length`, ...), if the file has the key.
    pub fn meta(&self, key: &str) -> Option<String> {
        let key = CString::new(key).ok()?;
        let mut buf = vec![0u8; 256];
        for _ in 0..2 {
            // SAFETY: llama.cpp writes at most `buf.len()` bytes, NUL included,
            // and returns the length the whole value needs (-1: no such key).
            let n = unsafe {
                sys::llama_model_meta_val_str(
                    self.ptr.as_ptr(),
                    key.as_ptr(),
                    buf.as_mut_ptr() as *mut c_char,
                    buf.len(),
                )
            };
            if n < 0 {
                return None;
            }
            let n = n as usize;
            if n < buf.len() {
                buf.truncate(n);
                return Some(String::from_utf8_lossy(&buf).into_owned());
            }
            buf.resize(n + 1, 0);
        }
        None
    }

    /// e.g. "llama 135M Q4_1".
    pub fn description(&self) -> String {
        let mut buf = vec![0u8; 256];
        // SAFETY: llama.cpp writes at most `buf.len()` bytes.
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
        // SAFETY: NULL or a NUL-terminated string owned by the model.
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
        // SAFETY: a live vocabulary; any token id is accepted.
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
        // SAFETY: `text` is `len` bytes; llama.cpp writes at most `tokens.len()`
        // tokens and says how many it needed if that is too few.
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
            // SAFETY: llama.cpp writes at most `buf.len()` bytes.
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

    /// The beginning-of-sequence token, if the vocabulary has one.
    pub fn bos(&self) -> Option<Token> {
        // SAFETY: a live vocabulary.
        let t = unsafe { sys::llama_vocab_bos(self.vocab.as_ptr()) };
        (t >= 0).then_some(t)
    }

    /// The end-of-sequence token, if the vocabulary has one.
    pub fn eos(&self) -> Option<Token> {
        // SAFETY: a live vocabulary.
        let t = unsafe { sys::llama_vocab_eos(self.vocab.as_ptr()) };
        (t >= 0).then_some(t)
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        // SAFETY: loaded in `load`, freed once.
        unsafe { sys::llama_model_free(self.ptr.as_ptr()) }
    }
}

#[cfg(test)]
mod tests {
    use super::reports_our_abort;

    #[test]
    fn only_the_lines_of_an_aborted_pass_are_recognised() {
        // What an aborted pass logs (seen in tests/it/flow.rs's departure).
        for line in [
            "graph_compute: ggml_backend_sched_graph_compute_async failed with error 1\n",
            "process_ubatch: failed to compute graph, compute status: 1\n",
            "decode: removing memory module entries for seq_id = 0, pos = [512, +inf)\n",
            "llama_decode: failed to decode, ret = 2\n",
        ] {
            assert!(reports_our_abort(line), "{line}");
        }
        // Other failures stay in the log, with their codes.
        for line in [
            "graph_compute: ggml_backend_sched_graph_compute_async failed with error -1\n",
            "graph_compute: ggml_backend_sched_graph_compute_async failed with error 10\n",
            "process_ubatch: failed to compute graph, compute status: -2\n",
            "llama_decode: failed to decode, ret = -3\n",
            "decode: failed to find a memory slot for batch of size 512\n",
        ] {
            assert!(!reports_our_abort(line), "{line}");
        }
    }
}
