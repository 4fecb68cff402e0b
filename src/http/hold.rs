//! Streamed tokens decoded ahead of their pace, held until their time.
//!
//! Before a long prompt's large chunk the engine decodes streams ahead and
//! stamps each such token with `not_before` (`engine::ahead`). A streaming
//! reply sends it no sooner; what its choice's channel brings meanwhile is
//! taken behind it, in order, so that the engine's channel stays free for the
//! tokens it decodes ahead. A JSON reply waits for the whole answer anyway
//! and holds nothing.

use crate::stream::{ErrorKind, Event};
use crossbeam_channel::{Receiver, TryRecvError};
use std::collections::VecDeque;
use std::time::Instant;

/// Most events a choice holds behind a token decoded ahead: the engine
/// decodes a few seconds ahead at most (`engine::ahead`); past this the
/// channel fills and the engine pauses the sequence, as for a slow reader.
pub(super) const HELD_EVENTS_MAX: usize = 64;

/// Per choice, the events taken from its channel behind a held token.
pub(super) struct Hold {
    /// Streaming: tokens are held until their `not_before`.
    paced: bool,
    held: Vec<VecDeque<Event>>,
}

/// What one choice has for its reply now.
#[derive(Debug)]
pub(super) enum Next {
    Event(Event),
    /// A token held until then.
    At(Instant),
    Nothing,
}

/// Why a choice has no more events: the engine's refusal or failure, or a
/// channel let go of before its `End`.
#[derive(Debug, PartialEq)]
pub(super) enum Failed {
    Error { kind: ErrorKind, message: String },
    Closed,
}

impl Hold {
    /// For `n` choices, holding nothing until `set_paced`.
    pub(super) fn new(n: usize) -> Hold {
        Hold {
            paced: false,
            held: vec![VecDeque::new(); n],
        }
    }

    /// Whether tokens are held until their `not_before` (streaming).
    pub(super) fn set_paced(&mut self, paced: bool) {
        self.paced = paced;
    }

    /// Choice `i`'s next event from `rx` if it is due at `now`, or when its
    /// held token is. While a token is held, what the channel brings is taken
    /// behind it (up to `HELD_EVENTS_MAX`); otherwise one event at a time (a
    /// slow reader fills the channel and pauses its sequence). An error
    /// comes at once, ahead of what is held: the request fails either way.
    pub(super) fn next_of(
        &mut self,
        i: usize,
        rx: &Receiver<Event>,
        now: Instant,
    ) -> Result<Next, Failed> {
        let held = &mut self.held[i];
        loop {
            if let Some(front) = held.front() {
                match not_before(front).filter(|&at| at > now) {
                    None => return Ok(Next::Event(held.pop_front().expect("a front"))),
                    Some(at) if held.len() >= HELD_EVENTS_MAX => return Ok(Next::At(at)),
                    Some(at) => match rx.try_recv() {
                        Ok(Event::Error { kind, message }) => {
                            return Err(Failed::Error { kind, message })
                        }
                        Ok(event) => held.push_back(event),
                        // A closed channel is read once the held events are.
                        Err(_) => return Ok(Next::At(at)),
                    },
                }
                continue;
            }
            return match rx.try_recv() {
                Ok(Event::Error { kind, message }) => Err(Failed::Error { kind, message }),
                Ok(event) if self.paced && not_before(&event).is_some_and(|at| at > now) => {
                    held.push_back(event);
                    continue;
                }
                Ok(event) => Ok(Next::Event(event)),
                Err(TryRecvError::Empty) => Ok(Next::Nothing),
                Err(TryRecvError::Disconnected) => Err(Failed::Closed),
            };
        }
    }
}

/// When a token decoded ahead may go out.
fn not_before(event: &Event) -> Option<Instant> {
    match event {
        Event::Token { not_before, .. } => *not_before,
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::{FinishReason, Usage};
    use crossbeam_channel::bounded;
    use std::time::Duration;

    fn token(t: i32, not_before: Option<Instant>) -> Event {
        Event::Token {
            token: t,
            text: format!("t{t}"),
            logprob: None,
            not_before,
        }
    }

    /// A streaming reply's hold for `n` choices.
    fn paced(n: usize) -> Hold {
        let mut hold = Hold::new(n);
        hold.set_paced(true);
        hold
    }

    fn end() -> Event {
        Event::End {
            finish: FinishReason::Length,
            usage: Usage::default(),
        }
    }

    /// The token id of a `Next::Event` of a token; panics on anything else.
    fn token_of(next: Result<Next, Failed>) -> i32 {
        match next {
            Ok(Next::Event(Event::Token { token, .. })) => token,
            other => panic!("expected a token, got {other:?}"),
        }
    }

    #[test]
    fn a_token_due_or_unstamped_goes_at_once() {
        let (tx, rx) = bounded(8);
        let now = Instant::now();
        let mut hold = paced(1);
        tx.send(token(1, None)).unwrap();
        tx.send(token(2, Some(now))).unwrap();
        tx.send(token(3, Some(now - Duration::from_millis(5))))
            .unwrap();
        assert_eq!(token_of(hold.next_of(0, &rx, now)), 1);
        assert_eq!(token_of(hold.next_of(0, &rx, now)), 2);
        assert_eq!(token_of(hold.next_of(0, &rx, now)), 3);
        assert!(matches!(hold.next_of(0, &rx, now), Ok(Next::Nothing)));
    }

    #[test]
    fn a_held_token_comes_at_its_time_and_what_follows_it_after_it_in_order() {
        let (tx, rx) = bounded(8);
        let now = Instant::now();
        let (a, b) = (
            now + Duration::from_millis(150),
            now + Duration::from_millis(300),
        );
        let mut hold = paced(1);
        for event in [token(1, Some(a)), token(2, Some(b)), token(3, None), end()] {
            tx.send(event).unwrap();
        }
        drop(tx);
        // Everything behind the held token is taken from the channel, and
        // the closed channel is not read while events are held.
        assert!(matches!(hold.next_of(0, &rx, now), Ok(Next::At(at)) if at == a));
        assert!(rx.is_empty());
        assert!(matches!(
            hold.next_of(0, &rx, a),
            Ok(Next::Event(Event::Token { token: 1, .. }))
        ));
        assert!(matches!(hold.next_of(0, &rx, a), Ok(Next::At(at)) if at == b));
        assert_eq!(token_of(hold.next_of(0, &rx, b)), 2);
        // The unstamped token behind a held one waited for it, then goes.
        assert_eq!(token_of(hold.next_of(0, &rx, b)), 3);
        assert!(matches!(
            hold.next_of(0, &rx, b),
            Ok(Next::Event(Event::End { .. }))
        ));
        assert_eq!(hold.next_of(0, &rx, b).unwrap_err(), Failed::Closed);
    }

    #[test]
    fn a_json_reply_holds_nothing() {
        let (tx, rx) = bounded(8);
        let now = Instant::now();
        let mut hold = Hold::new(1);
        tx.send(token(1, Some(now + Duration::from_secs(60))))
            .unwrap();
        assert_eq!(token_of(hold.next_of(0, &rx, now)), 1);
    }

    #[test]
    fn at_most_held_events_max_are_taken_so_the_channel_fills_behind_them() {
        let n = HELD_EVENTS_MAX + 5;
        let (tx, rx) = bounded(n);
        let now = Instant::now();
        let later = now + Duration::from_secs(1);
        let mut hold = paced(1);
        for t in 0..n as i32 {
            tx.send(token(t, Some(later))).unwrap();
        }
        assert!(matches!(hold.next_of(0, &rx, now), Ok(Next::At(at)) if at == later));
        assert_eq!(rx.len(), n - HELD_EVENTS_MAX);
        // Due: they come in the order sent, the held ones first.
        for t in 0..n as i32 {
            assert_eq!(token_of(hold.next_of(0, &rx, later)), t);
        }
    }

    #[test]
    fn an_error_behind_a_held_token_fails_the_choice_at_once() {
        let (tx, rx) = bounded(8);
        let now = Instant::now();
        let mut hold = paced(1);
        tx.send(token(1, Some(now + Duration::from_secs(1))))
            .unwrap();
        tx.send(Event::Error {
            kind: ErrorKind::Engine,
            message: "boom".into(),
        })
        .unwrap();
        assert_eq!(
            hold.next_of(0, &rx, now).unwrap_err(),
            Failed::Error {
                kind: ErrorKind::Engine,
                message: "boom".into()
            }
        );
    }

    #[test]
    fn choices_hold_apart() {
        let (tx0, rx0) = bounded(8);
        let (tx1, rx1) = bounded(8);
        let now = Instant::now();
        let mut hold = paced(2);
        tx0.send(token(1, Some(now + Duration::from_secs(1))))
            .unwrap();
        tx1.send(token(2, None)).unwrap();
        assert!(matches!(hold.next_of(0, &rx0, now), Ok(Next::At(_))));
        assert_eq!(token_of(hold.next_of(1, &rx1, now)), 2);
        drop(tx0);
    }
}
