//! The prefix cache: the KV state of finished sequences, kept in memory for the
//! next request that starts with the same tokens.
//!
//! A multi-turn chat re-sends its whole history every turn, and an application
//! sends the same system prompt with every request. Without a cache each of
//! them is prefilled again from its first token. Here, a sequence that ends
//! (complete, or its client gone) leaves an *entry*: the tokens its KV cells
//! held, and those cells' contents (llama.cpp's per-sequence state), copied out
//! of the KV cache. A new request looks for the longest common token prefix
//! among the entries (and the sequences running now, whose cells it can share
//! in place), restores that state into its own sequence, drops what follows
//! the common prefix, and prefills only the rest.
//!
//! Why in host memory, not as cells left in the KV cache: in the one unified
//! cache, attention's range is the highest used cell, so cells kept for later
//! would make every running sequence's attention scan them (measured here: a
//! single stream's decode fell from 110 to 82 tok/s with 16 such entries).
//! Out of the KV cache, an entry costs memory and a copy when it is used
//! (tens of microseconds per 100 tokens), never a step.
//!
//! Entries are evicted least recently used first when their bytes would pass
//! `--prefix-cache-mb`. They hold no KV cells, so they never make a request
//! wait for cells, and a restore that cannot be done (it would need more cells
//! than the request reserved) only means the prompt is prefilled.
//!
//! Pure bookkeeping: the engine copies the states in and out.
//! [`PrefixIndex`] is the copy the HTTP handlers read, to charge a request only
//! for the prompt tokens that will really be prefilled.

use crate::ffi::Token;
use std::sync::{Arc, Mutex};

/// Host memory the entries may take by default, in MiB: ~4,300 tokens of the
/// default model's state (three 1,500-token conversations). With 256, sluice's
/// RSS after a closed loop and a conversation at defaults was 561-633 MB
/// against llama-server's 497-502 (bench/results/2026-12-01-vm/rss-at-defaults-256).
pub const PREFIX_CACHE_MB_DEFAULT: usize = 96;
/// Fewest tokens worth restoring an entry for: below this, prefilling them
/// costs about what copying the entry's whole state back would.
pub const REUSE_TOKENS_MIN: usize = 16;

/// Tokens two sequences share from their first.
pub fn common_prefix(a: &[Token], b: &[Token]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// How much of `prompt` may be reused from a source that shares `common` tokens
/// with it: its last token is always decoded again, since the first generated
/// token is sampled from its logits.
pub fn reusable(common: usize, prompt_tokens: usize) -> usize {
    common.min(prompt_tokens.saturating_sub(1))
}

/// An entry's key: stable while it is cached.
pub type EntryId = u64;

#[derive(Debug)]
struct Entry {
    id: EntryId,
    tokens: Arc<[Token]>,
    state: Vec<u8>,
    used_at: u64,
}

/// What `insert` removed: tokens of the entries evicted for room (the ones
/// the new entry covers are not counted: it holds them all).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Inserted {
    pub evicted_tokens: usize,
}

#[derive(Debug)]
pub struct PrefixCache {
    entries: Vec<Entry>,
    bytes: usize,
    bytes_max: usize,
    clock: u64,
    index: Arc<PrefixIndex>,
}

impl PrefixCache {
    /// A cache of at most `bytes_max` bytes of state (0: no cache).
    pub fn new(bytes_max: usize) -> PrefixCache {
        PrefixCache {
            entries: Vec::new(),
            bytes: 0,
            bytes_max,
            clock: 0,
            index: Arc::new(PrefixIndex::default()),
        }
    }

    /// The handlers' view, kept up to date by this cache.
    pub fn index(&self) -> Arc<PrefixIndex> {
        Arc::clone(&self.index)
    }

    pub fn is_enabled(&self) -> bool {
        self.bytes_max > 0
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Bytes of state the entries hold.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The entry sharing the longest prefix with `prompt`: (its id, tokens
    /// shared, its length). The most recently used wins a tie.
    pub fn best(&self, prompt: &[Token]) -> Option<(EntryId, usize, usize)> {
        self.entries
            .iter()
            .map(|e| (e, common_prefix(&e.tokens, prompt)))
            .filter(|&(_, n)| n > 0)
            .max_by_key(|&(e, n)| (n, e.used_at))
            .map(|(e, n)| (e.id, n, e.tokens.len()))
    }

    /// The number of tokens entry `id` holds (0 if it is gone).
    pub fn entry_tokens(&self, id: EntryId) -> usize {
        self.entries
            .iter()
            .find(|e| e.id == id)
            .map_or(0, |e| e.tokens.len())
    }

    /// The state of entry `id`, now the most recently used.
    pub fn take_use(&mut self, id: EntryId) -> Option<&[u8]> {
        self.clock += 1;
        let e = self.entries.iter_mut().find(|e| e.id == id)?;
        e.used_at = self.clock;
        Some(&e.state)
    }

    /// Keeps `tokens` and their KV `state` as a new entry. Entries the new one
    /// covers (their tokens are a prefix of its own) go; then the least
    /// recently used, while the bytes would pass the bound. A state larger
    /// than the whole bound is not kept.
    pub fn insert(&mut self, tokens: Vec<Token>, state: Vec<u8>) -> Inserted {
        if tokens.is_empty() || state.len() > self.bytes_max {
            return Inserted::default();
        }
        let out = self.make_room(&tokens, state.len());
        self.clock += 1;
        self.bytes += state.len();
        self.entries.push(Entry {
            id: self.clock,
            tokens: tokens.into(),
            state,
            used_at: self.clock,
        });
        self.publish();
        out
    }

    /// Before an entry of `tokens` and `bytes` of state is made: drops the
    /// entries it covers, then the least recently used while the bytes would
    /// pass the bound, so that the state is allocated into room already made
    /// (the process's peak memory stays within the bound).
    pub fn make_room(&mut self, tokens: &[Token], bytes: usize) -> Inserted {
        let mut out = Inserted::default();
        if tokens.is_empty() || bytes > self.bytes_max {
            return out;
        }
        let covered: Vec<EntryId> = self
            .entries
            .iter()
            .filter(|e| e.tokens.len() <= tokens.len() && tokens.starts_with(&e.tokens))
            .map(|e| e.id)
            .collect();
        for id in covered {
            self.remove(id);
        }
        while self.bytes + bytes > self.bytes_max {
            match self.evict_lru() {
                Some(n) => out.evicted_tokens += n,
                None => break,
            }
        }
        out
    }

    /// Removes the least recently used entry; its tokens.
    fn evict_lru(&mut self) -> Option<usize> {
        let id = self.entries.iter().min_by_key(|e| e.used_at)?.id;
        self.remove(id)
    }

    fn remove(&mut self, id: EntryId) -> Option<usize> {
        let i = self.entries.iter().position(|e| e.id == id)?;
        let e = self.entries.swap_remove(i);
        self.bytes -= e.state.len();
        self.publish();
        Some(e.tokens.len())
    }

    fn publish(&self) {
        let tokens = self.entries.iter().map(|e| Arc::clone(&e.tokens)).collect();
        self.index.set_cached(tokens);
    }
}

/// What the handlers see of the cache: the entries' tokens and the prompts of
/// running sequences, to estimate before admission how much of a prompt will
/// be reused (the engine decides again when the request starts).
#[derive(Debug, Default)]
pub struct PrefixIndex {
    cached: Mutex<Vec<Arc<[Token]>>>,
    running: Mutex<Vec<(usize, Arc<[Token]>)>>,
}

impl PrefixIndex {
    fn set_cached(&self, tokens: Vec<Arc<[Token]>>) {
        *self.cached.lock().expect("prefix index") = tokens;
    }

    /// A running sequence in `slot` has its whole prompt in the KV cache.
    pub fn set_running(&self, slot: usize, prompt: Arc<[Token]>) {
        let mut r = self.running.lock().expect("prefix index");
        r.retain(|(s, _)| *s != slot);
        r.push((slot, prompt));
    }

    /// The sequence in `slot` ended.
    pub fn clear_running(&self, slot: usize) {
        self.running
            .lock()
            .expect("prefix index")
            .retain(|(s, _)| *s != slot);
    }

    /// Prompt tokens of `prompt` that would be reused if it started now.
    pub fn reusable(&self, prompt: &[Token]) -> usize {
        let cached = self
            .cached
            .lock()
            .expect("prefix index")
            .iter()
            .map(|t| common_prefix(t, prompt))
            .filter(|&n| n >= REUSE_TOKENS_MIN)
            .max()
            .unwrap_or(0);
        let running = self
            .running
            .lock()
            .expect("prefix index")
            .iter()
            .map(|(_, t)| common_prefix(t, prompt))
            .max()
            .unwrap_or(0);
        reusable(cached.max(running), prompt.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(bytes: usize) -> Vec<u8> {
        vec![0; bytes]
    }

    #[test]
    fn room_is_made_before_a_state_is_allocated() {
        let mut c = PrefixCache::new(100);
        c.insert(vec![1, 2, 3], state(40));
        c.insert(vec![4, 5, 6], state(40));
        // 60 more bytes: the least recently used entry goes first, so that the
        // new state's allocation never takes the cache past its bound.
        let made = c.make_room(&[7, 8, 9], 60);
        assert_eq!(made.evicted_tokens, 3);
        assert_eq!(c.bytes(), 40);
        let kept = c.insert(vec![7, 8, 9], state(60));
        assert_eq!(kept.evicted_tokens, 0, "the room was made already");
        assert_eq!(c.bytes(), 100);
        // A state larger than the whole bound evicts nothing.
        assert_eq!(c.make_room(&[1], 101).evicted_tokens, 0);
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn the_last_prompt_token_is_always_decoded_again() {
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4]), 2);
        assert_eq!(common_prefix(&[1, 2], &[1, 2, 4]), 2);
        assert_eq!(common_prefix(&[5], &[1]), 0);
        assert_eq!(reusable(3, 3), 2, "the same prompt again");
        assert_eq!(reusable(2, 10), 2);
        assert_eq!(reusable(0, 1), 0);
    }

    #[test]
    fn the_longest_prefix_wins_then_the_most_recent() {
        let mut c = PrefixCache::new(1000);
        c.insert(vec![1, 2, 3, 4], state(10));
        c.insert(vec![1, 2, 9], state(10));
        let (a, n, len) = c.best(&[1, 2, 3, 4, 5]).unwrap();
        assert_eq!((n, len), (4, 4));
        let (b, n, _) = c.best(&[1, 2, 9, 9]).unwrap();
        assert_eq!(n, 3);
        assert_eq!(c.best(&[1, 2, 7]).unwrap().0, b, "a tie: the newer");
        assert!(c.take_use(a).is_some());
        assert_eq!(c.best(&[1, 2, 7]).unwrap().0, a, "a was used since");
        assert_eq!(c.best(&[7]), None);
        assert_eq!(c.bytes(), 20);
    }

    #[test]
    fn entries_past_the_byte_bound_go_least_recently_used_first() {
        let mut c = PrefixCache::new(100);
        c.insert(vec![1, 1], state(40));
        c.insert(vec![2, 2, 2], state(40));
        let a = c.best(&[1, 1]).unwrap().0;
        c.take_use(a);
        let i = c.insert(vec![3], state(40));
        assert_eq!(i.evicted_tokens, 3, "[2, 2, 2] was used longest ago");
        assert_eq!(c.len(), 2);
        assert_eq!(c.bytes(), 80);
        assert!(c.best(&[2, 2, 2]).is_none());
        let i = c.insert(vec![4], state(100));
        assert_eq!(i.evicted_tokens, 3, "both others go for the whole bound");
        assert_eq!(c.bytes(), 100);
        let i = c.insert(vec![5], state(101));
        assert_eq!(i, Inserted::default(), "larger than the bound: not kept");
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn an_entry_covered_by_a_longer_one_goes() {
        let mut c = PrefixCache::new(1000);
        c.insert(vec![1, 2, 3], state(30));
        c.insert(vec![1, 5], state(20));
        let i = c.insert(vec![1, 2, 3, 4, 5], state(50));
        assert_eq!(i.evicted_tokens, 0, "turn 2 holds all of turn 1");
        assert_eq!(c.len(), 2);
        assert_eq!(c.bytes(), 70);
        assert_eq!(c.best(&[1, 5]).unwrap().1, 2);
    }

    #[test]
    fn a_cache_of_no_bytes_keeps_nothing() {
        let mut c = PrefixCache::new(0);
        assert!(!c.is_enabled());
        c.insert(vec![1, 2], state(1));
        assert_eq!(c.best(&[1, 2]), None);
    }

    #[test]
    fn the_index_follows_the_cache_and_the_running_prompts() {
        let mut c = PrefixCache::new(1000);
        let index = c.index();
        let long: Vec<Token> = (0..40).collect();
        assert_eq!(index.reusable(&long), 0);
        c.insert(long[..30].to_vec(), state(10));
        assert_eq!(index.reusable(&long), 30);
        assert_eq!(index.reusable(&long[..30]), 29, "not the last token");
        assert_eq!(
            index.reusable(&long[..10]),
            0,
            "under REUSE_TOKENS_MIN: not restored"
        );
        index.set_running(0, long[..10].into());
        assert_eq!(index.reusable(&long[..12]), 10, "shared in place");
        index.clear_running(0);
        assert_eq!(index.reusable(&long[..12]), 0);
    }
}
