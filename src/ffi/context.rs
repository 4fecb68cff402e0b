//! A llama context: KV cache, compute graph and the persistent pinned
//! threadpool (shared with a context made beside it); the batch it decodes;
//! llama.cpp's sampler chain.

use super::model::{Model, Token};
use llama_cpp_sys_2 as sys;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;

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

/// Flash attention (`--flash-attn`; by default measured once per machine, see
/// `startup::measure_attention`).
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

    /// Bytes a K element and a V element take in the cache (q8_0: 34 bytes a
    /// block of 32).
    pub fn element_bytes(self) -> (f64, f64) {
        let size = |t| match t {
            sys::GGML_TYPE_Q8_0 => 34.0 / 32.0,
            _ => 2.0,
        };
        (size(self.ggml_k()), size(self.ggml_v()))
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

/// Most tokens llama.cpp computes in one graph pass (its `n_ubatch`) without
/// flash attention; a longer `decode` runs in passes of this many. Without
/// flash attention a pass materializes its query-by-cell scores (tokens x
/// cells x heads floats), and at 512 tokens they outgrow the caches: on a
/// 2-core AMD EPYC (Zen 4, AVX-512), flash attention off with K in q8_0, a
/// lone 521-token prompt took 2.0-2.6 s in 512-token passes, 1.8-2.2 s in
/// 256 or 128 (llama-server, flash attention on: 1.8-2.0 s); a 2,000-token
/// prompt 10.2-10.3 s against 9.4-10.8 s. It also halves the compute buffer
/// those scores are reserved in. With flash attention the scores are never
/// whole, and a pass stays at the batch size.
pub const UBATCH_WITHOUT_FLASH_ATTN: u32 = 256;

/// ggml's persistent threadpool, shared by the contexts made on it
/// (`Context::beside`): freed when the last of them is.
struct Pool(NonNull<sys::ggml_threadpool>);

// SAFETY: the pool is used from the engine thread only, one pass at a time.
unsafe impl Send for Pool {}
unsafe impl Sync for Pool {}

impl Drop for Pool {
    fn drop(&mut self) {
        // SAFETY: made in `Context::new`, freed once, after every context that
        // used it (each holds an `Arc` to it, dropped after `llama_free`).
        unsafe { sys::ggml_threadpool_free(self.0.as_ptr()) }
    }
}

/// A llama context: KV cache, compute graph, and the persistent threadpool.
pub struct Context {
    ptr: NonNull<sys::llama_context>,
    pool: Arc<Pool>,
    n_batch: usize,
    n_vocab: usize,
    /// Floats in one token's embedding.
    n_embd: usize,
    /// Whether `decode` outputs embeddings (`set_embeddings`).
    embeddings: bool,
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

/// # Safety
/// `data` is the `AbortWatch` the context registered, which lives as long as
/// the context (`Context::abort`).
unsafe extern "C" fn abort_callback(data: *mut c_void) -> bool {
    let watch = &*(data as *const AbortWatch);
    let abort = watch.should_abort();
    if abort {
        super::model::ABORTING.store(true, Ordering::Relaxed);
    }
    abort
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
        // SAFETY: plain C calls on values made here; every pointer llama.cpp returns
        // is checked for NULL before use, and what fails is freed before returning.
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
            let pool = Arc::new(Pool(pool));
            Context::on_pool(model, p, pool, Arc::new(AbortWatch::default()))
        }
    }

    /// Another context on the same model, its own KV cache and compute
    /// buffers, run by this one's threadpool and stopped by its abort
    /// handle. The two are used one after the other, from the one thread.
    pub fn beside(&self, p: &ContextParams) -> Result<Context, String> {
        Context::on_pool(
            Arc::clone(&self._model),
            p,
            Arc::clone(&self.pool),
            Arc::clone(&self.abort),
        )
    }

    fn on_pool(
        model: Arc<Model>,
        p: &ContextParams,
        pool: Arc<Pool>,
        abort: Arc<AbortWatch>,
    ) -> Result<Context, String> {
        let n_threads = p.cpus.len() as i32;
        // SAFETY: plain C calls on values made here; the context is checked for
        // NULL before use; the pool lives as long as the context holds it.
        unsafe {
            let mut cp = sys::llama_context_default_params();
            cp.n_ctx = p.n_ctx;
            cp.n_batch = p.n_batch;
            cp.n_ubatch = match p.flash_attn {
                FlashAttn::Off => p.n_batch.min(UBATCH_WITHOUT_FLASH_ATTN),
                FlashAttn::On | FlashAttn::Auto => p.n_batch,
            };
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
            // Embeddings are pooled by sluice, over chunks as the engine
            // prefills them (`Context::embedding`): llama.cpp's own pooling
            // would need a sequence whole in one pass.
            cp.pooling_type = sys::LLAMA_POOLING_TYPE_NONE;
            cp.embeddings = false;
            let ptr = match NonNull::new(sys::llama_init_from_model(model.ptr.as_ptr(), cp)) {
                Some(ptr) => ptr,
                None => {
                    return Err(
                        "llama.cpp could not create a context (reason in the log above)".into(),
                    );
                }
            };
            sys::llama_attach_threadpool(ptr.as_ptr(), pool.0.as_ptr(), pool.0.as_ptr());
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
                n_embd: model.n_embd(),
                embeddings: false,
                abort,
                _model: model,
            })
        }
    }

    pub fn n_batch(&self) -> usize {
        self.n_batch
    }

    /// Most tokens llama.cpp computes in one graph pass; a `decode` of more
    /// runs in several (`UBATCH_WITHOUT_FLASH_ATTN`).
    pub fn n_ubatch(&self) -> usize {
        // SAFETY: a live context.
        unsafe { sys::llama_n_ubatch(self.ptr.as_ptr()) as usize }
    }

    /// Cells one sequence may hold: all of them (unified), or its stream's.
    pub fn n_ctx_seq(&self) -> usize {
        // SAFETY: `ptr` is a live context (freed only in Drop).
        unsafe { sys::llama_n_ctx_seq(self.ptr.as_ptr()) as usize }
    }

    pub fn n_ctx(&self) -> usize {
        // SAFETY: `ptr` is a live context.
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

    /// How many `llama_decode` passes reused the previous pass's compute graph
    /// instead of building one (llama.cpp reuses it when the pass has the
    /// same shape: tokens, sequences, outputs, attention span).
    pub fn graphs_reused(&self) -> u64 {
        // SAFETY: a live context; the call only reads its counters.
        let data = unsafe { sys::llama_perf_context(self.ptr.as_ptr()) };
        u64::try_from(data.n_reused).unwrap_or(0)
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
        // SAFETY: a live context, and a batch within n_batch (asserted) whose
        // arrays llama_batch_init sized for its capacity.
        let rc = unsafe { sys::llama_decode(self.ptr.as_ptr(), batch.raw) };
        super::model::ABORTING.store(false, Ordering::Relaxed);
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
        // SAFETY: entry `i` asked for logits in the last decode (asserted), so
        // llama.cpp holds a row of n_vocab floats for it until the next decode,
        // which needs `&mut self`: the slice cannot outlive it.
        unsafe {
            let p = sys::llama_get_logits_ith(self.ptr.as_ptr(), i as i32);
            assert!(!p.is_null(), "llama.cpp has no logits for entry {i}");
            std::slice::from_raw_parts(p, self.n_vocab)
        }
    }

    /// Whether the next `decode` outputs each token's embedding (the hidden
    /// state after the last norm). While on, llama.cpp outputs every token of
    /// a pass, logits included.
    pub fn set_embeddings(&mut self, on: bool) {
        if on != self.embeddings {
            // SAFETY: a live context.
            unsafe { sys::llama_set_embeddings(self.ptr.as_ptr(), on) };
            self.embeddings = on;
        }
    }

    /// The embedding of batch entry `i` of the last `decode`, which ran with
    /// `set_embeddings(true)`: `n_embd` floats.
    pub fn embedding(&mut self, batch: &Batch, i: usize) -> &[f32] {
        assert!(self.embeddings, "embeddings were not requested");
        assert!(i < batch.len(), "entry {i} is not in the batch");
        // SAFETY: the last decode output every entry's embedding (embeddings
        // on, pooling none), a row of n_embd floats that lives until the next
        // decode, which needs `&mut self`.
        unsafe {
            let p = sys::llama_get_embeddings_ith(self.ptr.as_ptr(), i as i32);
            assert!(!p.is_null(), "llama.cpp has no embedding for entry {i}");
            std::slice::from_raw_parts(p, self.n_embd)
        }
    }

    /// The logits row of batch entry `i`, to change before sampling from it
    /// (a `ChainSampler` reads the row as changed).
    pub fn logits_mut(&mut self, batch: &Batch, i: usize) -> &mut [f32] {
        assert!(
            batch.wants_logits(i),
            "logits of entry {i} were not requested"
        );
        // SAFETY: as `logits`; writing the floats is what llama.cpp's own
        // samplers do, and `&mut self` keeps any other slice of the row away.
        unsafe {
            let p = sys::llama_get_logits_ith(self.ptr.as_ptr(), i as i32);
            assert!(!p.is_null(), "llama.cpp has no logits for entry {i}");
            std::slice::from_raw_parts_mut(p, self.n_vocab)
        }
    }

    /// Frees every KV cell of every sequence and clears the cache's buffers,
    /// which gives their pages back to the kernel (`lazy_zero`).
    pub fn clear_all_cells(&mut self) {
        // SAFETY: a live context; its memory lives as long as it.
        unsafe {
            let mem = sys::llama_get_memory(self.ptr.as_ptr());
            sys::llama_memory_clear(mem, true);
        }
    }

    /// Frees every KV cell of `seq`.
    pub fn clear_sequence(&mut self, seq: i32) {
        // SAFETY: a live context; any sequence id is accepted.
        unsafe {
            let mem = sys::llama_get_memory(self.ptr.as_ptr());
            sys::llama_memory_seq_rm(mem, seq, -1, -1);
        }
    }

    /// Gives `dst` the cells `src` holds at positions `p0..p1` (-1: to the
    /// end). In the unified cache the cells are shared, not copied: each is
    /// freed when no sequence holds it any more.
    pub fn share_cells(&mut self, src: i32, dst: i32, p0: i32, p1: i32) {
        // SAFETY: a live context; llama.cpp checks the ids and positions.
        unsafe {
            let mem = sys::llama_get_memory(self.ptr.as_ptr());
            sys::llama_memory_seq_cp(mem, src, dst, p0, p1);
        }
    }

    /// Frees the cells of `seq` at positions `from..`.
    pub fn truncate_sequence(&mut self, seq: i32, from: i32) {
        // SAFETY: a live context; llama.cpp checks the id and positions.
        unsafe {
            let mem = sys::llama_get_memory(self.ptr.as_ptr());
            sys::llama_memory_seq_rm(mem, seq, from, -1);
        }
    }

    /// A copy of what `seq`'s KV cells hold (positions and contents), for
    /// [`Context::restore_sequence`]: about `2 · layers · kv_width` values a token.
    /// Bytes `save_sequence(seq)` would take.
    pub fn sequence_state_size(&mut self, seq: i32) -> usize {
        // SAFETY: a live context.
        unsafe { sys::llama_state_seq_get_size_ext(self.ptr.as_ptr(), seq, 0) }
    }

    pub fn save_sequence(&mut self, seq: i32) -> Vec<u8> {
        // SAFETY: the buffer is exactly the size llama.cpp asked for, and it
        // writes at most `n` bytes.
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
        // SAFETY: llama.cpp reads at most `state.len()` bytes and validates them.
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

    /// Puts the compute threads to sleep now instead of letting them poll for
    /// the next pass (`ContextParams::poll`); the next `decode` wakes them.
    /// For a context that leaves the CPUs to another one for a while.
    pub fn pause_threads(&mut self) {
        // SAFETY: the pool is live while the context is; ggml resumes a paused
        // pool when the next graph is computed.
        unsafe { sys::ggml_threadpool_pause(self.pool.0.as_ptr()) }
    }

    /// The highest position `seq` holds in the KV cache, or -1 when it holds none.
    pub fn sequence_pos_max(&self, seq: i32) -> i32 {
        // SAFETY: a live context.
        unsafe {
            let mem = sys::llama_get_memory(self.ptr.as_ptr());
            sys::llama_memory_seq_pos_max(mem, seq)
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the context was made in `on_pool` and is freed once, here;
        // the pool it used is freed after it (the `pool` field drops after
        // this body), once no other context holds it.
        unsafe {
            sys::llama_detach_threadpool(self.ptr.as_ptr());
            sys::llama_free(self.ptr.as_ptr());
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
        // SAFETY: allocates arrays for `capacity` tokens with one sequence id each.
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
        // SAFETY: `i < capacity` (asserted) and llama_batch_init allocated every
        // array, and each token's one seq_id slot, for `capacity` entries.
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
        // SAFETY: `i < len <= capacity`, within the logits array.
        i < self.len() && unsafe { *self.raw.logits.add(i) != 0 }
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        // SAFETY: made by llama_batch_init in `new`, freed once.
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
        // SAFETY: the chain takes ownership of each sampler added to it.
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
        // SAFETY: a live chain and context; entry `i` has logits (asserted).
        unsafe { sys::llama_sampler_sample(self.0.as_ptr(), ctx.ptr.as_ptr(), i as i32) }
    }
}

impl Drop for ChainSampler {
    fn drop(&mut self) {
        // SAFETY: made in `new`, freed once (with the samplers it owns).
        unsafe { sys::llama_sampler_free(self.0.as_ptr()) }
    }
}
