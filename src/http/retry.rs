//! Clients that come back before their Retry-After: the return time each
//! client refused for overload was given (`RetryLedger`), and a holder that
//! answers an early retry only after a wait (`Tarpit`).
//!
//! A refusal at the door is cheap (nothing read past the head, nothing
//! tokenized), but a client that retries at once, in a loop, still costs a
//! head parse, a handler's turn and a write per try, and on a 2-core box that
//! is CPU the engine does not get. So a client that comes back early is
//! refused again with a longer wait (doubling per early try, at most
//! `PENALTY_MS_MAX`), and that refusal is held back for half that wait, up to
//! `HOLD_MS_MAX`, before it is written: a client that waits for its answer before trying
//! again (every HTTP client does, on one connection) tries at most once per
//! hold instead of thousands of times a second. Held refusals wait on one
//! thread, not on handlers; at most `HELD_REFUSALS_MAX` at once (beyond
//! them the refusal goes out at once). Only a request that would be refused
//! anyway is judged early: one that finds room in the queue is served.
//!
//! What counts as a retry: the same request body from the same client (its
//! API key, or its address), which is what a retrying client sends (the SDKs
//! re-send the same body). A different request is judged afresh, even on the
//! same pooled connection: an app server's many users, behind one address and
//! one connection pool, do not wait for one another. The body is not parsed
//! for this, only hashed (it was read whole before the handler got it).

use super::error::ApiError;
use crate::ratelimit::ClientId;
use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender};
use std::collections::{BinaryHeap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tiny_http::Request;

/// Clients whose promised return time is kept; beyond it, the one due
/// soonest makes room.
pub const RETRY_LEDGER_CLIENTS_MAX: usize = 4096;
/// Early refusals held at once.
pub const HELD_REFUSALS_MAX: usize = 256;
/// Longest an early refusal is held before it is written.
pub const HOLD_MS_MAX: u64 = 2_000;
/// Longest wait an early retry is told.
pub const PENALTY_MS_MAX: u64 = 60_000;
/// A wait told is spread down to 0.9 of the promise (`ApiError::wait_ms`):
/// a client is early only before this share of it.
const EARLY_SHARE: f64 = 0.85;

/// A request a promised return time was given to: its client and a hash
/// of its body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Caller {
    client: ClientId,
    body: u64,
}

impl Caller {
    pub fn of(client: ClientId, body: &[u8]) -> Caller {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        body.hash(&mut h);
        Caller {
            client,
            body: h.finish(),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Promise {
    due: Instant,
    /// Early tries since the last refusal it waited out.
    strikes: u32,
}

/// The return time each refused client was given.
#[derive(Default)]
pub struct RetryLedger {
    table: Mutex<HashMap<Caller, Promise>>,
}

impl RetryLedger {
    /// A client was refused for overload and told to wait `wait`.
    pub fn promised(&self, id: Caller, wait: Duration, now: Instant) {
        let due = now + wait.mul_f64(EARLY_SHARE);
        let mut t = self.table.lock().expect("retry ledger lock");
        if !t.contains_key(&id) && t.len() >= RETRY_LEDGER_CLIENTS_MAX {
            t.retain(|_, p| p.due > now);
            if t.len() >= RETRY_LEDGER_CLIENTS_MAX {
                let soonest = t.iter().min_by_key(|(_, p)| p.due).map(|(k, _)| *k);
                if let Some(k) = soonest {
                    t.remove(&k);
                }
            }
        }
        let strikes = t.get(&id).map_or(0, |p| p.strikes);
        t.insert(id, Promise { due, strikes });
    }

    /// A request from `id` arrived: if it is before the client's promised
    /// return time, the longer wait it is told now (and the client's new
    /// return time); otherwise `None`, and what it was promised is forgotten.
    pub fn early(&self, id: Caller, now: Instant) -> Option<Duration> {
        let mut t = self.table.lock().expect("retry ledger lock");
        let p = t.get_mut(&id)?;
        if now >= p.due {
            t.remove(&id);
            return None;
        }
        p.strikes = p.strikes.saturating_add(1);
        let left = (p.due - now).max(Duration::from_secs(1));
        let factor = 1u32 << p.strikes.min(6);
        let wait = (left * factor).min(Duration::from_millis(PENALTY_MS_MAX));
        // Told exactly (not spread): due when it says.
        p.due = now + wait;
        Some(wait)
    }
}

struct Held {
    due: Instant,
    req: Request,
    error: ApiError,
}

impl PartialEq for Held {
    fn eq(&self, other: &Held) -> bool {
        self.due == other.due
    }
}
impl Eq for Held {}
impl PartialOrd for Held {
    fn partial_cmp(&self, other: &Held) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Held {
    /// The soonest due first (`BinaryHeap` is a max-heap).
    fn cmp(&self, other: &Held) -> std::cmp::Ordering {
        other.due.cmp(&self.due)
    }
}

/// One thread that writes held refusals when they are due.
pub struct Tarpit {
    tx: Sender<Held>,
}

impl Tarpit {
    pub fn start() -> Result<Tarpit, String> {
        let (tx, rx) = bounded::<Held>(HELD_REFUSALS_MAX);
        std::thread::Builder::new()
            .name("sluice-tarpit".into())
            .spawn(move || hold_until_due(rx))
            .map_err(|e| format!("cannot start the tarpit thread: {e}"))?;
        Ok(Tarpit { tx })
    }

    /// Answers `req` with `error` after half the `wait` it tells (at most
    /// `HOLD_MS_MAX`), or at once when `HELD_REFUSALS_MAX` are already held.
    /// Half: a client that tries again as soon as it is answered is still
    /// early, and its told wait keeps growing.
    pub fn hold(&self, req: Request, error: ApiError, wait: Duration) {
        let wait = (wait / 2).min(Duration::from_millis(HOLD_MS_MAX));
        let held = Held {
            due: Instant::now() + wait,
            req,
            error,
        };
        if let Err(e) = self.tx.try_send(held) {
            let held = e.into_inner();
            super::respond_error(held.req, &held.error);
        }
    }
}

/// The holder's loop: the soonest held refusal is written when due; when
/// the server stops (the sender is gone), the rest at once.
fn hold_until_due(rx: Receiver<Held>) {
    let mut heap: BinaryHeap<Held> = BinaryHeap::with_capacity(HELD_REFUSALS_MAX);
    loop {
        let now = Instant::now();
        while heap.peek().is_some_and(|h| h.due <= now) {
            let h = heap.pop().expect("peeked");
            super::respond_error(h.req, &h.error);
        }
        let next = match heap.peek() {
            Some(h) => rx.recv_timeout(h.due.saturating_duration_since(now)),
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        match next {
            Ok(h) => heap.push(h),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    for h in heap.into_vec() {
        super::respond_error(h.req, &h.error);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{IpAddr, Ipv4Addr};

    fn client(n: u8) -> Caller {
        Caller::of(
            ClientId::Addr(IpAddr::V4(Ipv4Addr::new(10, 0, 0, n))),
            b"{}",
        )
    }

    #[test]
    fn a_retry_is_the_same_body_from_the_same_client() {
        let ip = ClientId::Addr(IpAddr::V4(Ipv4Addr::LOCALHOST));
        assert_eq!(Caller::of(ip, b"{\"a\":1}"), Caller::of(ip, b"{\"a\":1}"));
        assert_ne!(
            Caller::of(ip, b"{\"a\":1}"),
            Caller::of(ip, b"{\"a\":2}"),
            "another request from the same address is judged afresh"
        );
        assert_ne!(
            Caller::of(ClientId::Key(1), b"{}"),
            Caller::of(ClientId::Key(2), b"{}")
        );
    }

    #[test]
    fn a_client_that_waits_its_retry_after_is_never_early() {
        let l = RetryLedger::default();
        let t0 = Instant::now();
        assert_eq!(l.early(client(1), t0), None, "never refused");
        l.promised(client(1), Duration::from_secs(4), t0);
        // Told 4 s, spread down to 3.6 s at the least: back after 3.6 s is on time.
        assert_eq!(l.early(client(1), t0 + Duration::from_millis(3600)), None);
        // And forgiven: the next try is judged afresh.
        assert_eq!(l.early(client(1), t0 + Duration::from_millis(3601)), None);
        // Another client's promise is its own.
        l.promised(client(2), Duration::from_secs(4), t0);
        assert_eq!(l.early(client(3), t0), None);
    }

    #[test]
    fn each_early_try_doubles_the_wait_up_to_the_cap() {
        let l = RetryLedger::default();
        let t0 = Instant::now();
        l.promised(client(1), Duration::from_secs(2), t0);
        // Due at 1.7 s; back at once: 1.7 s left, doubled.
        let w1 = l.early(client(1), t0).expect("early");
        assert_eq!(w1, Duration::from_millis(3400));
        let w2 = l.early(client(1), t0).expect("early again");
        assert!(w2 > w1 * 2 - Duration::from_millis(1), "{w1:?} then {w2:?}");
        let mut w = w2;
        for _ in 0..10 {
            w = l.early(client(1), t0).expect("still early");
        }
        assert_eq!(w, Duration::from_millis(PENALTY_MS_MAX));
        // Refused again after waiting it out: the strikes stay until it is on time.
        let later = t0 + Duration::from_secs(120);
        assert_eq!(l.early(client(1), later), None);
    }

    #[test]
    fn the_ledger_is_bounded_and_the_soonest_due_makes_room() {
        let l = RetryLedger::default();
        let t0 = Instant::now();
        for i in 0..RETRY_LEDGER_CLIENTS_MAX {
            let id = Caller::of(ClientId::Key(i), b"{}");
            l.promised(id, Duration::from_secs(10 + i as u64), t0);
        }
        let last = Caller::of(ClientId::Key(usize::MAX), b"{}");
        l.promised(last, Duration::from_secs(5), t0);
        let t = l.table.lock().unwrap();
        assert_eq!(t.len(), RETRY_LEDGER_CLIENTS_MAX);
        assert!(
            !t.contains_key(&Caller::of(ClientId::Key(0), b"{}")),
            "the soonest due went"
        );
        assert!(t.contains_key(&last));
    }
}
