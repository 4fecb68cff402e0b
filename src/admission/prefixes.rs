//! What admission knows of the prefix cache: the tokens of its entries and
//! the prompts of the sequences running now (whose cells a new request may
//! share), to estimate before admission how much of a prompt will be reused,
//! so that a request is charged (and counted against the queued-token
//! budget) only for what will be prefilled. The engine owns the cache and
//! decides again when the request starts; it reports the changes
//! (`Reporter::prefix_*`), which the gate applies (`QueueGauge`).
//!
//! And the rules of reuse both sides apply.

use crate::ffi::Token;
use std::sync::Arc;

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

/// The gate's copy of the prefixes a request could reuse.
#[derive(Debug, Default)]
pub(super) struct PrefixIndex {
    cached: Vec<Arc<[Token]>>,
    running: Vec<(usize, Arc<[Token]>)>,
}

impl PrefixIndex {
    /// The prefix cache's entries now.
    pub(super) fn set_cached(&mut self, tokens: Vec<Arc<[Token]>>) {
        self.cached = tokens;
    }

    /// A running sequence in `slot` has its whole prompt in the KV cache.
    pub(super) fn set_running(&mut self, slot: usize, prompt: Arc<[Token]>) {
        self.running.retain(|(s, _)| *s != slot);
        self.running.push((slot, prompt));
    }

    /// The sequence in `slot` ended.
    pub(super) fn clear_running(&mut self, slot: usize) {
        self.running.retain(|(s, _)| *s != slot);
    }

    /// Prompt tokens of `prompt` that would be reused if it started now.
    pub(super) fn reusable(&self, prompt: &[Token]) -> usize {
        let cached = self
            .cached
            .iter()
            .map(|t| common_prefix(t, prompt))
            .filter(|&n| n >= REUSE_TOKENS_MIN)
            .max()
            .unwrap_or(0);
        let running = self
            .running
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
    fn prefixes_are_shared_from_the_first_token_but_the_last_is_decoded_again() {
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4]), 2);
        assert_eq!(common_prefix(&[1, 2], &[1, 2, 4]), 2);
        assert_eq!(common_prefix(&[5], &[1]), 0);
        assert_eq!(reusable(3, 3), 2, "the same prompt again");
        assert_eq!(reusable(2, 10), 2);
        assert_eq!(reusable(0, 1), 0);
    }

    #[test]
    fn the_index_follows_the_entries_and_the_running_prompts() {
        let mut index = PrefixIndex::default();
        let long: Vec<Token> = (0..40).collect();
        assert_eq!(index.reusable(&long), 0);
        index.set_cached(vec![long[..30].into()]);
        assert_eq!(index.reusable(&long), 30);
        assert_eq!(index.reusable(&long[..30]), 29, "not the last token");
        assert_eq!(
            index.reusable(&long[..10]),
            0,
            "under REUSE_TOKENS_MIN: not restored"
        );
        index.set_cached(Vec::new());
        index.set_running(0, long[..10].into());
        assert_eq!(index.reusable(&long[..12]), 10, "shared in place");
        index.clear_running(0);
        assert_eq!(index.reusable(&long[..12]), 0);
    }
}
