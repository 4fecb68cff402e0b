//! Per-client rate limits: a token bucket per client, in tokens of work.
//!
//! Admission bounds protect the box from its total load; a bucket protects the
//! other clients from one of them. A request costs its prompt plus its
//! `max_tokens` (the work it may ask for), charged before admission; tokens it
//! was not given back are returned when it ends (a request that stops after 10
//! of its 500 tokens costs its prompt and 10), and the whole charge is returned
//! when the admission gate refuses it (overload is not the client's spending).
//! A client whose bucket holds less than the request costs gets 429
//! `rate_limit_exceeded` with the seconds until it refills enough.
//!
//! The table of buckets is bounded (`--client-table-max`), so a flood of new
//! source addresses cannot grow memory: when it is full, a new client takes the
//! place of a bucket that has refilled (it holds no state a new one would not
//! have), or else of the one used longest ago.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Clients refused within this window count as rate-limited in `/metrics`.
pub const LIMITED_WINDOW: Duration = Duration::from_secs(60);

/// Who a request comes from: a verified API key (its index in the key file),
/// or, without one, the fairness id a trusted gateway names
/// (`x-gateway-inference-fairness-id`, hashed), or the address it connects
/// from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClientId {
    Key(usize),
    Fairness(u64),
    Addr(IpAddr),
}

/// A bucket's size and refill rate, in tokens of work.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limit {
    pub rate_tok_s: f64,
    pub burst: u64,
}

/// Why a charge was refused.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Refused {
    /// Tokens the bucket holds now (rounded down).
    pub available: u64,
    /// Seconds until it holds the cost; `None` when the cost is over the burst.
    pub retry_after_s: Option<u64>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    level: f64,
    at: Instant,
    /// Use counter at the last charge (for least-recently-used eviction).
    used: u64,
    limited_at: Option<Instant>,
}

impl Bucket {
    fn refill(&mut self, limit: Limit, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + dt * limit.rate_tok_s).min(limit.burst as f64);
        self.at = now;
    }
}

/// The bounded table of buckets; pure (time is passed in).
#[derive(Debug)]
pub struct Buckets {
    table: HashMap<ClientId, Bucket>,
    max: usize,
    uses: u64,
    evictions: u64,
}

impl Buckets {
    pub fn new(max: usize) -> Buckets {
        assert!(max >= 1);
        Buckets {
            table: HashMap::with_capacity(max),
            max,
            uses: 0,
            evictions: 0,
        }
    }

    /// Takes `cost` tokens from `id`'s bucket, or says how long until it could.
    pub fn charge(
        &mut self,
        id: ClientId,
        limit: Limit,
        cost: u64,
        now: Instant,
    ) -> Result<(), Refused> {
        if cost > limit.burst {
            let available = self.table.get_mut(&id).map_or(limit.burst, |b| {
                b.refill(limit, now);
                b.limited_at = Some(now);
                b.level as u64
            });
            return Err(Refused {
                available,
                retry_after_s: None,
            });
        }
        if !self.table.contains_key(&id) && self.table.len() >= self.max {
            self.evict(limit, now);
        }
        self.uses += 1;
        let used = self.uses;
        let b = self.table.entry(id).or_insert(Bucket {
            level: limit.burst as f64,
            at: now,
            used,
            limited_at: None,
        });
        b.refill(limit, now);
        b.used = used;
        if b.level >= cost as f64 {
            b.level -= cost as f64;
            return Ok(());
        }
        b.limited_at = Some(now);
        let short = cost as f64 - b.level;
        Err(Refused {
            available: b.level as u64,
            retry_after_s: Some((short / limit.rate_tok_s).ceil().max(1.0) as u64),
        })
    }

    /// Gives `tokens` back to `id`'s bucket (work charged and not done).
    pub fn refund(&mut self, id: ClientId, limit: Limit, tokens: u64, now: Instant) {
        if let Some(b) = self.table.get_mut(&id) {
            b.refill(limit, now);
            b.level = (b.level + tokens as f64).min(limit.burst as f64);
        }
    }

    /// Takes `tokens` more from `id`'s bucket for work that cost more than its
    /// charge said (a prompt expected in the prefix cache was not): the level
    /// may fall below zero, a debt the refill pays before the next charge.
    pub fn debit(&mut self, id: ClientId, limit: Limit, tokens: u64, now: Instant) {
        if let Some(b) = self.table.get_mut(&id) {
            b.refill(limit, now);
            b.level -= tokens as f64;
        }
    }

    /// Drops one bucket: one that has refilled to its burst (the default limit's,
    /// a cheap and safe test), or else the one used longest ago.
    fn evict(&mut self, limit: Limit, now: Instant) {
        let full = self.table.iter().find(|(_, b)| {
            let mut b = **b;
            b.refill(limit, now);
            b.level >= limit.burst as f64
        });
        let victim = full
            .or_else(|| self.table.iter().min_by_key(|(_, b)| b.used))
            .map(|(id, _)| *id);
        if let Some(id) = victim {
            self.table.remove(&id);
            self.evictions += 1;
        }
    }

    pub fn len(&self) -> usize {
        self.table.len()
    }

    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Clients refused within `LIMITED_WINDOW` before `now`.
    pub fn limited(&self, now: Instant) -> usize {
        self.table
            .values()
            .filter(|b| {
                b.limited_at
                    .is_some_and(|t| now.saturating_duration_since(t) < LIMITED_WINDOW)
            })
            .count()
    }
}

/// The buckets behind a lock, shared by the handlers.
pub struct RateLimiter {
    buckets: Mutex<Buckets>,
    max: usize,
}

impl RateLimiter {
    pub fn new(max: usize) -> RateLimiter {
        RateLimiter {
            buckets: Mutex::new(Buckets::new(max)),
            max,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Buckets> {
        self.buckets.lock().expect("rate limiter lock")
    }

    pub fn charge(&self, id: ClientId, limit: Limit, cost: u64) -> Result<(), Refused> {
        self.lock().charge(id, limit, cost, Instant::now())
    }

    pub fn refund(&self, id: ClientId, limit: Limit, tokens: u64) {
        if tokens > 0 {
            self.lock().refund(id, limit, tokens, Instant::now());
        }
    }

    pub fn debit(&self, id: ClientId, limit: Limit, tokens: u64) {
        if tokens > 0 {
            self.lock().debit(id, limit, tokens, Instant::now());
        }
    }

    pub fn gauges(&self) -> crate::metrics::RateLimitGauges {
        let b = self.lock();
        crate::metrics::RateLimitGauges {
            clients: b.len(),
            clients_max: self.max,
            clients_limited: b.limited(Instant::now()),
            evictions: b.evictions(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    const LIMIT: Limit = Limit {
        rate_tok_s: 10.0,
        burst: 100,
    };

    fn addr(n: u32) -> ClientId {
        ClientId::Addr(IpAddr::V4(Ipv4Addr::from(0x7f00_0000 + n)))
    }

    #[test]
    fn a_bucket_spends_its_burst_then_refills_at_its_rate() {
        let mut b = Buckets::new(10);
        let t0 = Instant::now();
        assert!(b.charge(addr(1), LIMIT, 60, t0).is_ok());
        let r = b.charge(addr(1), LIMIT, 60, t0).unwrap_err();
        assert_eq!(r.available, 40);
        assert_eq!(r.retry_after_s, Some(2), "20 short at 10 tok/s");
        let t2 = t0 + Duration::from_secs(2);
        assert!(b.charge(addr(1), LIMIT, 60, t2).is_ok(), "refilled 20");
        assert!(
            b.charge(addr(2), LIMIT, 100, t2).is_ok(),
            "another client has its own bucket"
        );
        let t60 = t0 + Duration::from_secs(60);
        assert!(
            b.charge(addr(1), LIMIT, 100, t60).is_ok(),
            "never above burst"
        );
        assert!(b.charge(addr(1), LIMIT, 1, t60).is_err());
    }

    #[test]
    fn a_cost_over_the_burst_is_refused_for_good() {
        let mut b = Buckets::new(10);
        let r = b.charge(addr(1), LIMIT, 101, Instant::now()).unwrap_err();
        assert_eq!(r.retry_after_s, None);
        assert_eq!(r.available, 100);
        assert_eq!(b.len(), 0, "no bucket for a request no bucket can hold");
    }

    #[test]
    fn refunds_return_unused_work_up_to_the_burst() {
        let mut b = Buckets::new(10);
        let t0 = Instant::now();
        b.charge(addr(1), LIMIT, 90, t0).unwrap();
        b.refund(addr(1), LIMIT, 50, t0);
        assert!(b.charge(addr(1), LIMIT, 60, t0).is_ok(), "10 + 50 back");
        b.refund(addr(1), LIMIT, 1000, t0);
        assert!(b.charge(addr(1), LIMIT, 101, t0).is_err());
        assert!(b.charge(addr(1), LIMIT, 100, t0).is_ok(), "capped at burst");
    }

    #[test]
    fn the_table_stays_within_its_bound_and_keeps_the_clients_in_debt() {
        let mut b = Buckets::new(100);
        let t0 = Instant::now();
        // Client 0 spends its bucket; 10,000 new clients arrive, one request each.
        b.charge(addr(0), LIMIT, 100, t0).unwrap();
        for n in 1..=10_000 {
            b.charge(addr(n), LIMIT, 1, t0).unwrap();
            assert!(b.len() <= 100);
        }
        assert_eq!(b.len(), 100);
        assert_eq!(b.evictions(), 10_000 - 99);
        assert!(
            b.charge(addr(0), LIMIT, 1, t0).is_ok(),
            "LRU: with every bucket in debt, the oldest goes"
        );
        // Refilled buckets go before any in debt.
        let mut b = Buckets::new(3);
        b.charge(addr(1), LIMIT, 100, t0).unwrap();
        b.charge(addr(2), LIMIT, 1, t0).unwrap();
        b.charge(addr(3), LIMIT, 100, t0).unwrap();
        let later = t0 + Duration::from_secs(1);
        b.charge(addr(4), LIMIT, 1, later).unwrap();
        assert!(
            b.charge(addr(1), LIMIT, 20, later).is_err(),
            "client 1 kept its debt: client 2's refilled bucket went instead"
        );
        assert_eq!(b.limited(later), 1);
        assert_eq!(b.limited(later + LIMITED_WINDOW), 0);
    }
}
