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
//! Pure bookkeeping: the engine copies the states in and out, and sends the
//! entries' tokens to admission when they change (`take_changed`), whose copy
//! (`admission::prefixes`) estimates a new request's reuse, to charge it only
//! for the prompt tokens that will really be prefilled.

use crate::ffi::Token;
use std::sync::Arc;

/// Host memory the entries may take by default, in MiB: ~4,300 tokens of the
/// default model's state (three 1,500-token conversations). With 256, sluice's
/// RSS after a closed loop and a conversation at defaults was 561-633 MB
/// against llama-server's 497-502 (bench/results/2026-12-01-vm/rss-at-defaults-256).
pub const PREFIX_CACHE_MB_DEFAULT: usize = 96;
pub use crate::admission::prefixes::{common_prefix, reusable, REUSE_TOKENS_MIN};

/// An entry's key: stable while it is cached.
pub type EntryId = u64;

#[derive(Debug)]
struct Entry {
    id: EntryId,
    tokens: Arc<[Token]>,
    state: Vec<u8>,
    used_at: u64,
    /// The context the state was saved from (`contexts`): it restores only
    /// there.
    home: usize,
}

/// What `insert` or `make_room` removed: tokens of the entries evicted for
/// room (the ones the new entry covers are not counted: it holds them all),
/// and whether the room was made (not when only the held entry could give
/// it: the state is then not kept).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Inserted {
    pub evicted_tokens: usize,
    pub room: bool,
}

#[derive(Debug)]
pub struct PrefixCache {
    entries: Vec<Entry>,
    bytes: usize,
    bytes_max: usize,
    clock: u64,
    /// The entry a request being placed is about to restore (`hold`): no
    /// room is made from it until `take_use` takes it.
    held: Option<EntryId>,
    /// The entries changed since `take_changed` last said.
    changed: bool,
}

impl PrefixCache {
    /// A cache of at most `bytes_max` bytes of state (0: no cache).
    pub fn new(bytes_max: usize) -> PrefixCache {
        PrefixCache {
            entries: Vec::new(),
            bytes: 0,
            bytes_max,
            clock: 0,
            held: None,
            changed: false,
        }
    }

    /// The entries' tokens, if they changed since the last call.
    pub fn take_changed(&mut self) -> Option<Vec<Arc<[Token]>>> {
        if !std::mem::take(&mut self.changed) {
            return None;
        }
        Some(self.entries.iter().map(|e| Arc::clone(&e.tokens)).collect())
    }

    pub fn is_enabled(&self) -> bool {
        self.bytes_max > 0
    }

    /// Whether a state of `bytes` could be kept at all: no larger than the
    /// whole bound. One that is not is never copied out of the KV cache.
    pub fn could_keep(&self, bytes: usize) -> bool {
        self.is_enabled() && bytes <= self.bytes_max
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Bytes of state the entries hold.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The entry of context `home` sharing the longest prefix with `prompt`:
    /// (its id, tokens shared, its length). The most recently used wins a tie.
    pub fn best(&self, prompt: &[Token], home: usize) -> Option<(EntryId, usize, usize)> {
        self.entries
            .iter()
            .filter(|e| e.home == home)
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

    /// Keeps entry `id` until `take_use`: a request placed in a slot that
    /// holds a parked sequence saves that one first, and the entry it is
    /// about to restore, often the least recently used, must not be the one
    /// that makes room (in the side-by-side of session 49 it was, 1-5 times
    /// a round: those prompts were prefilled whole).
    pub fn hold(&mut self, id: EntryId) {
        self.held = Some(id);
    }

    /// The state of entry `id`, now the most recently used (and no longer
    /// held).
    pub fn take_use(&mut self, id: EntryId) -> Option<&[u8]> {
        self.held = None;
        self.clock += 1;
        let e = self.entries.iter_mut().find(|e| e.id == id)?;
        e.used_at = self.clock;
        Some(&e.state)
    }

    /// Keeps `tokens` and their KV `state` as a new entry. Entries the new one
    /// covers (their tokens are a prefix of its own) go; then the least
    /// recently used, while the bytes would pass the bound. A state larger
    /// than the whole bound is not kept. `home`: the context it came from.
    pub fn insert(&mut self, tokens: Vec<Token>, state: Vec<u8>, home: usize) -> Inserted {
        if tokens.is_empty() || state.len() > self.bytes_max {
            return Inserted::default();
        }
        let out = self.make_room(&tokens, state.len(), home);
        if !out.room {
            return out;
        }
        self.clock += 1;
        self.bytes += state.len();
        self.entries.push(Entry {
            id: self.clock,
            tokens: tokens.into(),
            state,
            used_at: self.clock,
            home,
        });
        self.publish();
        out
    }

    /// Before an entry of `tokens` and `bytes` of state is made in context
    /// `home`: drops the entries of that context it covers (one of the other
    /// context still serves the requests placed there), then the least
    /// recently used while the bytes would
    /// pass the bound, so that the state is allocated into room already made
    /// (the process's peak memory stays within the bound).
    pub fn make_room(&mut self, tokens: &[Token], bytes: usize, home: usize) -> Inserted {
        let mut out = Inserted::default();
        if tokens.is_empty() || bytes > self.bytes_max {
            return out;
        }
        let covered: Vec<EntryId> = self
            .entries
            .iter()
            .filter(|e| e.home == home && Some(e.id) != self.held)
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
        out.room = self.bytes + bytes <= self.bytes_max;
        out
    }

    /// Removes the least recently used entry but the held one; its tokens.
    fn evict_lru(&mut self) -> Option<usize> {
        let id = self
            .entries
            .iter()
            .filter(|e| Some(e.id) != self.held)
            .min_by_key(|e| e.used_at)?
            .id;
        self.remove(id)
    }

    fn remove(&mut self, id: EntryId) -> Option<usize> {
        let i = self.entries.iter().position(|e| e.id == id)?;
        let e = self.entries.swap_remove(i);
        self.bytes -= e.state.len();
        self.publish();
        Some(e.tokens.len())
    }

    fn publish(&mut self) {
        self.changed = true;
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
        c.insert(vec![1, 2, 3], state(40), 0);
        c.insert(vec![4, 5, 6], state(40), 0);
        // 60 more bytes: the least recently used entry goes first, so that the
        // new state's allocation never takes the cache past its bound.
        let made = c.make_room(&[7, 8, 9], 60, 0);
        assert_eq!(made.evicted_tokens, 3);
        assert_eq!(c.bytes(), 40);
        let kept = c.insert(vec![7, 8, 9], state(60), 0);
        assert_eq!(kept.evicted_tokens, 0, "the room was made already");
        assert_eq!(c.bytes(), 100);
        // A state larger than the whole bound evicts nothing.
        assert_eq!(c.make_room(&[1], 101, 0).evicted_tokens, 0);
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn the_entry_about_to_be_restored_never_makes_room() {
        let mut c = PrefixCache::new(100);
        c.insert(vec![1, 2, 3], state(40), 0);
        c.insert(vec![4, 5, 6], state(40), 0);
        let (held, _, _) = c.best(&[1, 2, 3, 9], 0).unwrap();
        c.hold(held);
        // The held entry is the least recently used: the other goes instead.
        let made = c.make_room(&[7, 8, 9], 40, 0);
        assert_eq!((made.evicted_tokens, made.room), (3, true));
        assert_eq!(c.entry_tokens(held), 3);
        // Nor is it covered away by a longer entry of its tokens.
        c.insert(vec![1, 2, 3, 4], state(40), 0);
        assert_eq!(c.entry_tokens(held), 3);
        assert_eq!(c.len(), 2);
        // Room only it could make is not made, and the state is not kept.
        let kept = c.insert(vec![8], state(70), 0);
        assert_eq!(kept.evicted_tokens, 4);
        assert!(!kept.room);
        assert_eq!((c.len(), c.bytes()), (1, 40));
        assert!(c.take_use(held).is_some());
        // Used, it is an entry like any other.
        let made = c.make_room(&[8], 70, 0);
        assert_eq!((made.evicted_tokens, made.room), (3, true));
    }

    #[test]
    fn the_longest_prefix_wins_then_the_most_recent() {
        let mut c = PrefixCache::new(1000);
        c.insert(vec![1, 2, 3, 4], state(10), 0);
        c.insert(vec![1, 2, 9], state(10), 0);
        let (a, n, len) = c.best(&[1, 2, 3, 4, 5], 0).unwrap();
        assert_eq!((n, len), (4, 4));
        let (b, n, _) = c.best(&[1, 2, 9, 9], 0).unwrap();
        assert_eq!(n, 3);
        assert_eq!(c.best(&[1, 2, 7], 0).unwrap().0, b, "a tie: the newer");
        assert!(c.take_use(a).is_some());
        assert_eq!(c.best(&[1, 2, 7], 0).unwrap().0, a, "a was used since");
        assert_eq!(c.best(&[7], 0), None);
        assert_eq!(c.bytes(), 20);
    }

    #[test]
    fn entries_past_the_byte_bound_go_least_recently_used_first() {
        let mut c = PrefixCache::new(100);
        c.insert(vec![1, 1], state(40), 0);
        c.insert(vec![2, 2, 2], state(40), 0);
        let a = c.best(&[1, 1], 0).unwrap().0;
        c.take_use(a);
        let i = c.insert(vec![3], state(40), 0);
        assert_eq!(i.evicted_tokens, 3, "[2, 2, 2] was used longest ago");
        assert_eq!(c.len(), 2);
        assert_eq!(c.bytes(), 80);
        assert!(c.best(&[2, 2, 2], 0).is_none());
        let i = c.insert(vec![4], state(100), 0);
        assert_eq!(i.evicted_tokens, 3, "both others go for the whole bound");
        assert_eq!(c.bytes(), 100);
        let i = c.insert(vec![5], state(101), 0);
        assert_eq!(i, Inserted::default(), "larger than the bound: not kept");
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn an_entry_covered_by_a_longer_one_goes() {
        let mut c = PrefixCache::new(1000);
        c.insert(vec![1, 2, 3], state(30), 0);
        c.insert(vec![1, 5], state(20), 0);
        let i = c.insert(vec![1, 2, 3, 4, 5], state(50), 0);
        assert_eq!(i.evicted_tokens, 0, "turn 2 holds all of turn 1");
        assert_eq!(c.len(), 2);
        assert_eq!(c.bytes(), 70);
        assert_eq!(c.best(&[1, 5], 0).unwrap().1, 2);
    }

    #[test]
    fn an_entry_restores_only_into_the_context_it_came_from() {
        let mut c = PrefixCache::new(1000);
        c.insert(vec![1, 2, 3], state(10), 1);
        assert_eq!(c.best(&[1, 2, 3, 4], 0), None, "saved from the other one");
        assert_eq!(c.best(&[1, 2, 3, 4], 1).map(|b| b.1), Some(3));
        // A longer entry of the other context does not cover it: a request
        // placed in context 1 could not use that one.
        c.insert(vec![1, 2, 3, 4], state(10), 0);
        assert_eq!(c.len(), 2);
        assert_eq!(c.best(&[1, 2, 3], 1).map(|b| b.1), Some(3));
        assert_eq!(c.best(&[1, 2, 3, 4], 0).map(|b| b.1), Some(4));
        // One of its own does.
        c.insert(vec![1, 2, 3, 4, 5], state(10), 1);
        assert_eq!(c.len(), 2);
        assert_eq!(c.best(&[1, 2, 3], 1).map(|b| b.1), Some(3));
    }

    #[test]
    fn a_cache_of_no_bytes_keeps_nothing() {
        let mut c = PrefixCache::new(0);
        assert!(!c.is_enabled());
        c.insert(vec![1, 2], state(1), 0);
        assert_eq!(c.best(&[1, 2], 0), None);
    }

    #[test]
    fn changes_are_told_once() {
        let mut c = PrefixCache::new(1000);
        assert_eq!(c.take_changed(), None);
        c.insert(vec![1, 2, 3], state(10), 0);
        let told = c.take_changed().expect("an entry came");
        assert_eq!(&told[0][..], &[1, 2, 3]);
        assert_eq!(c.take_changed(), None, "told already");
    }

    #[test]
    fn a_state_larger_than_the_whole_bound_could_not_be_kept() {
        let c = PrefixCache::new(100);
        assert!(c.could_keep(100));
        assert!(!c.could_keep(101));
        assert!(!PrefixCache::new(0).could_keep(1), "no cache keeps nothing");
    }
}
