//! The floor: the safe wrapper over llama.cpp (llama-cpp-sys-2) and the OS
//! calls sluice makes. The only module with `unsafe` code, and it imports
//! nothing else of the crate; everything it hands out is safe to use.
//!
//! Why the raw bindings and not llama-cpp-2: sluice attaches one persistent,
//! pinned ggml threadpool to its contexts (`llama_attach_threadpool`) and installs
//! an abort callback (`llama_set_abort_callback`); the safe crate hides the raw
//! context pointer that both need.
//!
//! Ownership: a [`Model`] is shared (`Arc`) between the engine thread, which owns
//! the [`Context`]s (the main one, and one made beside it for short requests,
//! on the same threadpool), and the HTTP handler threads, which only tokenize.
//! Tokenization reads the vocabulary and is what llama.cpp's own server does from
//! many threads at once. A `Context` is `Send` but not `Sync`: it stays on the
//! engine thread.

//!
//! - `model.rs`: the backend's set-up and log, a loaded [`Model`].
//! - `context.rs`: a [`Context`] (KV cache, threadpool, abort callback),
//!   [`Batch`], [`ChainSampler`].
//! - `lazy_zero.rs`: ggml's CPU buffers cleared by giving pages back.
//! - `os.rs`: sockets, signals, limits, thread names.

mod context;
mod lazy_zero;
mod model;
mod os;

pub use context::*;
pub use model::*;
pub use os::*;
