//! Priority classes: which waiting request gets the next free slot.
//!
//! A request is `interactive` (the default: a person waits for its first token)
//! or `batch` (a job that tolerates a longer wait). Each class has its own
//! bounded admission queue with its own W_max (`admission`), and the engine
//! takes the higher class first. Strict priority alone would starve batch work
//! for as long as interactive traffic keeps a request waiting, so the `Picker`
//! guarantees batch a small share: of the slot starts made while both classes
//! wait and a batch request may start, at least one in `batch_every` goes to
//! batch. Under an interactive flood batch therefore still moves, at a known
//! minimum rate; with no interactive request waiting, batch takes every start.
//!
//! Batch work may also never hold every slot: `--interactive-slots` slots (and
//! their share of the KV cache) stay free for interactive requests, so an
//! interactive request that arrives while batch work fills the box starts at
//! once instead of waiting for a batch request to finish. The engine enforces
//! that; the rule is here so that it is stated once.

/// A request's priority class. The order is the priority: `Interactive` first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    Interactive = 0,
    Batch = 1,
}

impl Class {
    pub const ALL: [Class; 2] = [Class::Interactive, Class::Batch];
    pub const COUNT: usize = 2;

    /// Index into per-class arrays.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The name a client sends (`X-Priority`) and metrics label with.
    pub fn as_str(self) -> &'static str {
        match self {
            Class::Interactive => "interactive",
            Class::Batch => "batch",
        }
    }

    /// Parses a client's `X-Priority` value (case-insensitive).
    pub fn parse(s: &str) -> Option<Class> {
        let s = s.trim();
        Class::ALL
            .into_iter()
            .find(|c| c.as_str().eq_ignore_ascii_case(s))
    }
}

/// The anti-starvation rule, a pure state machine: which class the next free
/// slot goes to, given which classes have a request waiting.
#[derive(Debug, Clone)]
pub struct Picker {
    batch_every: u32,
    /// Interactive starts in a row made while a batch request could have started.
    passed_over: u32,
}

impl Picker {
    /// `batch_every` ≥ 1: at least one start in `batch_every` goes to a waiting
    /// batch request (1 makes the two classes alternate).
    pub fn new(batch_every: u32) -> Picker {
        assert!(batch_every >= 1, "batch_every must be at least 1");
        Picker {
            batch_every,
            passed_over: 0,
        }
    }

    /// The class to start next. `batch_may_start` is false while batch work
    /// holds every slot it may use: then a waiting batch request is not being
    /// passed over, it is at its limit.
    pub fn pick(
        &self,
        interactive_waiting: bool,
        batch_waiting: bool,
        batch_may_start: bool,
    ) -> Option<Class> {
        let batch = batch_waiting && batch_may_start;
        match (interactive_waiting, batch) {
            (false, false) => None,
            (true, false) => Some(Class::Interactive),
            (false, true) => Some(Class::Batch),
            (true, true) if self.passed_over + 1 >= self.batch_every => Some(Class::Batch),
            (true, true) => Some(Class::Interactive),
        }
    }

    /// A request of `class` got a slot; `batch_could_have` says whether a batch
    /// request was waiting and allowed to start when it did.
    pub fn started(&mut self, class: Class, batch_could_have: bool) {
        match class {
            Class::Batch => self.passed_over = 0,
            Class::Interactive if batch_could_have => self.passed_over += 1,
            Class::Interactive => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_parse_from_their_names() {
        assert_eq!(Class::parse("interactive"), Some(Class::Interactive));
        assert_eq!(Class::parse(" Batch "), Some(Class::Batch));
        assert_eq!(Class::parse("urgent"), None);
        assert!(Class::Interactive < Class::Batch, "interactive is first");
    }

    /// Runs the picker over `starts` slot starts with both classes always
    /// waiting, and returns the classes started.
    fn flood(batch_every: u32, starts: usize) -> Vec<Class> {
        let mut p = Picker::new(batch_every);
        (0..starts)
            .map(|_| {
                let c = p.pick(true, true, true).expect("both wait");
                p.started(c, true);
                c
            })
            .collect()
    }

    #[test]
    fn interactive_goes_first_and_batch_gets_its_guaranteed_share() {
        let picks = flood(4, 12);
        let batch: Vec<usize> = (0..12).filter(|&i| picks[i] == Class::Batch).collect();
        assert_eq!(batch, vec![3, 7, 11], "one in four goes to batch");
        for w in picks.windows(4) {
            assert!(w.contains(&Class::Batch), "never 4 starts without batch");
        }
        assert_eq!(
            flood(1, 4),
            vec![Class::Batch; 4],
            "1: batch whenever it waits"
        );
        let two = flood(2, 4);
        assert_eq!(
            two,
            vec![
                Class::Interactive,
                Class::Batch,
                Class::Interactive,
                Class::Batch
            ]
        );
    }

    #[test]
    fn a_lone_class_takes_every_start() {
        let mut p = Picker::new(8);
        assert_eq!(p.pick(false, false, true), None);
        assert_eq!(p.pick(false, true, true), Some(Class::Batch));
        assert_eq!(p.pick(true, false, true), Some(Class::Interactive));
        for _ in 0..20 {
            p.started(Class::Interactive, false);
        }
        assert_eq!(
            p.pick(true, true, true),
            Some(Class::Interactive),
            "starts made while no batch request waited do not count"
        );
    }

    #[test]
    fn batch_at_its_slot_limit_is_not_passed_over() {
        let mut p = Picker::new(2);
        assert_eq!(p.pick(true, true, false), Some(Class::Interactive));
        p.started(Class::Interactive, false);
        assert_eq!(p.pick(false, true, false), None, "no batch slot free");
        assert_eq!(p.pick(true, true, true), Some(Class::Interactive));
        p.started(Class::Interactive, true);
        assert_eq!(p.pick(true, true, true), Some(Class::Batch));
    }
}
