//! The prefix cache: KV cells of finished sequences kept for the next request
//! that starts with the same tokens.
//!
//! A multi-turn chat re-sends its whole history every turn, and an application
//! sends the same system prompt with every request. Without a cache each of
//! them is prefilled again from its first token. Here, a sequence that ends
//! (complete, or its client gone) leaves its cells in the KV cache as an
//! *entry*: its own llama.cpp sequence id (above the slots' ids) and the tokens
//! those cells hold. A new request looks for the longest common token prefix
//! among the entries and the prompts of the sequences running now, shares those
//! cells (`llama_memory_seq_cp` inside the one unified cache: metadata only, no
//! copy) and prefills only the rest.
//!
//! Entries are evicted least recently used first: when a new entry needs an id,
//! and whenever a starting request needs cells that entries hold. An entry never
//! makes a request wait and never fails one: the engine's KV bound counts a
//! running sequence's whole reservation (prompt + max_tokens, shared cells
//! included), and an entry's cells on top, so evicting every entry always makes
//! room for what the running sequences alone would leave.
//!
//! Pure bookkeeping: the engine carries out the llama.cpp calls it decides.
//! [`PrefixIndex`] is the copy the HTTP handlers read, to charge a request only
//! for the prompt tokens that will really be prefilled.

use super::ffi::Token;
use std::sync::{Arc, Mutex};

/// Entries kept at most by default; each is one llama.cpp sequence id beside
/// the slots' (llama.cpp allows 256 in all).
pub const PREFIX_CACHE_ENTRIES_DEFAULT: usize = 16;

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

#[derive(Debug)]
struct Entry {
    seq: i32,
    tokens: Arc<[Token]>,
    used_at: u64,
}

/// What `insert` decided, for the engine to carry out.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Inserted {
    /// The sequence id the new entry's cells are copied to.
    pub seq: i32,
    /// Entries removed to make room, least recently used first: (seq id, tokens).
    pub evicted: Vec<(i32, usize)>,
    /// Entries removed because the new one holds all their tokens.
    pub covered: Vec<i32>,
}

#[derive(Debug)]
pub struct PrefixCache {
    entries: Vec<Entry>,
    /// Sequence ids no entry holds.
    free: Vec<i32>,
    clock: u64,
    index: Arc<PrefixIndex>,
}

impl PrefixCache {
    /// A cache of at most `capacity` entries, using sequence ids
    /// `first_seq..first_seq + capacity`.
    pub fn new(first_seq: i32, capacity: usize) -> PrefixCache {
        let free = (0..capacity as i32).rev().map(|i| first_seq + i).collect();
        PrefixCache {
            entries: Vec::with_capacity(capacity),
            free,
            clock: 0,
            index: Arc::new(PrefixIndex::default()),
        }
    }

    /// The handlers' view, kept up to date by this cache.
    pub fn index(&self) -> Arc<PrefixIndex> {
        Arc::clone(&self.index)
    }

    pub fn is_enabled(&self) -> bool {
        !(self.entries.is_empty() && self.free.is_empty())
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// KV cells the entries hold at most (shared cells counted once per entry).
    pub fn cells(&self) -> usize {
        self.entries.iter().map(|e| e.tokens.len()).sum()
    }

    /// The entry sharing the longest prefix with `prompt`: (seq id, tokens
    /// shared). The most recently used wins a tie.
    pub fn best(&self, prompt: &[Token]) -> Option<(i32, usize)> {
        self.entries
            .iter()
            .map(|e| (e.seq, common_prefix(&e.tokens, prompt), e.used_at))
            .filter(|&(_, n, _)| n > 0)
            .max_by_key(|&(_, n, used_at)| (n, used_at))
            .map(|(seq, n, _)| (seq, n))
    }

    /// The entry `seq` was used: it is the last to be evicted.
    pub fn touch(&mut self, seq: i32) {
        self.clock += 1;
        if let Some(e) = self.entries.iter_mut().find(|e| e.seq == seq) {
            e.used_at = self.clock;
        }
    }

    /// Keeps `tokens` as a new entry (the caller copies the cells to
    /// `Inserted::seq`). Entries the new one covers (their tokens are a prefix
    /// of its own) go; the least recently used goes if no id is free. `None`
    /// when the cache holds no entries at all, or `tokens` is empty.
    pub fn insert(&mut self, tokens: Vec<Token>) -> Option<Inserted> {
        if tokens.is_empty() || !self.is_enabled() {
            return None;
        }
        let mut out = Inserted::default();
        let mut i = 0;
        while i < self.entries.len() {
            let e = &self.entries[i];
            if e.tokens.len() <= tokens.len() && tokens.starts_with(&e.tokens) {
                let e = self.entries.swap_remove(i);
                out.covered.push(e.seq);
                self.free.push(e.seq);
            } else {
                i += 1;
            }
        }
        if self.free.is_empty() {
            let (seq, n) = self.evict_lru().expect("a full cache has entries");
            out.evicted.push((seq, n));
        }
        let seq = self.free.pop().expect("an id is free");
        self.clock += 1;
        self.entries.push(Entry {
            seq,
            tokens: tokens.into(),
            used_at: self.clock,
        });
        out.seq = seq;
        self.publish();
        Some(out)
    }

    /// Removes the least recently used entry: (its seq id, its tokens).
    pub fn evict_lru(&mut self) -> Option<(i32, usize)> {
        let i = self
            .entries
            .iter()
            .enumerate()
            .min_by_key(|(_, e)| e.used_at)
            .map(|(i, _)| i)?;
        let e = self.entries.swap_remove(i);
        self.free.push(e.seq);
        self.publish();
        Some((e.seq, e.tokens.len()))
    }

    fn publish(&self) {
        let tokens = self.entries.iter().map(|e| Arc::clone(&e.tokens)).collect();
        self.index.set_cached(tokens);
    }
}

/// What the handlers see of the KV cache: the entries' tokens and the prompts
/// of running sequences, to estimate before admission how much of a prompt
/// will be reused (the engine decides again when the request starts).
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
        let mut c = PrefixCache::new(4, 3);
        let a = c.insert(vec![1, 2, 3, 4]).unwrap().seq;
        let b = c.insert(vec![1, 2, 9]).unwrap().seq;
        assert_eq!(c.best(&[1, 2, 3, 4, 5]), Some((a, 4)));
        assert_eq!(c.best(&[1, 2, 9, 9]), Some((b, 3)));
        assert_eq!(c.best(&[1, 2, 7]), Some((b, 2)), "a tie: the newer");
        c.touch(a);
        assert_eq!(c.best(&[1, 2, 7]), Some((a, 2)), "a was used since");
        assert_eq!(c.best(&[7]), None);
        assert_eq!(c.cells(), 7);
    }

    #[test]
    fn a_full_cache_evicts_the_least_recently_used() {
        let mut c = PrefixCache::new(10, 2);
        let a = c.insert(vec![1, 1]).unwrap().seq;
        let b = c.insert(vec![2, 2, 2]).unwrap().seq;
        assert!((10..12).contains(&a) && (10..12).contains(&b) && a != b);
        c.touch(a);
        let i = c.insert(vec![3]).unwrap();
        assert_eq!(i.evicted, vec![(b, 3)], "b is the least recently used");
        assert_eq!(i.seq, b, "its id is reused");
        assert_eq!(c.len(), 2);
        assert_eq!(c.evict_lru(), Some((a, 2)));
        assert_eq!(c.evict_lru(), Some((b, 1)));
        assert_eq!(c.evict_lru(), None);
        assert_eq!(c.cells(), 0);
    }

    #[test]
    fn an_entry_covered_by_a_longer_one_goes() {
        let mut c = PrefixCache::new(0, 4);
        let turn1 = c.insert(vec![1, 2, 3]).unwrap().seq;
        let other = c.insert(vec![1, 5]).unwrap().seq;
        let i = c.insert(vec![1, 2, 3, 4, 5]).unwrap();
        assert_eq!(i.covered, vec![turn1], "turn 2 holds all of turn 1");
        assert!(i.evicted.is_empty());
        assert_eq!(c.len(), 2);
        assert_eq!(c.best(&[1, 5]), Some((other, 2)));
        assert_eq!(c.cells(), 7);
    }

    #[test]
    fn a_cache_of_no_entries_keeps_nothing() {
        let mut c = PrefixCache::new(4, 0);
        assert!(!c.is_enabled());
        assert_eq!(c.insert(vec![1, 2]), None);
        assert_eq!(c.best(&[1, 2]), None);
    }

    #[test]
    fn the_index_follows_the_cache_and_the_running_prompts() {
        let mut c = PrefixCache::new(4, 2);
        let index = c.index();
        assert_eq!(index.reusable(&[1, 2, 3]), 0);
        c.insert(vec![1, 2, 3, 4]);
        assert_eq!(index.reusable(&[1, 2, 3, 4, 5]), 4);
        assert_eq!(index.reusable(&[1, 2, 3, 4]), 3, "not the last token");
        index.set_running(0, vec![1, 2, 3, 4, 5, 6].into());
        assert_eq!(index.reusable(&[1, 2, 3, 4, 5, 6, 7]), 6);
        index.clear_running(0);
        c.evict_lru();
        assert_eq!(index.reusable(&[1, 2, 3, 4, 5]), 0);
    }
}
