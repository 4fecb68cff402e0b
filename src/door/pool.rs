//! Threads for connections, reused: a connection goes to a thread that is
//! idle and waiting for one, or else a new thread starts. A thread that has
//! waited `IDLE` for another connection ends. Threads are bounded by the
//! connections open (the door's bound) plus those idle.
//!
//! The hand-off is a rendezvous channel: `try_send` succeeds only if a thread
//! is blocked in `recv` at that moment, so a burst is never queued behind
//! threads that have not yet woken (tiny_http's own pool counted idle threads
//! and queued a burst behind a handful of them, some of which then blocked on
//! idle keep-alive connections).

use std::thread;
use std::time::Duration;

use crossbeam_channel::{bounded, Receiver, Sender, TrySendError};

/// How long a thread with no connection waits for one before it ends.
const IDLE: Duration = Duration::from_secs(5);

pub(super) type Task = Box<dyn FnOnce() + Send + 'static>;

pub(super) struct Pool {
    name: &'static str,
    tx: Sender<Task>,
    rx: Receiver<Task>,
}

impl Pool {
    pub fn new(name: &'static str) -> Pool {
        let (tx, rx) = bounded(0);
        Pool { name, tx, rx }
    }

    /// Runs `task` on an idle thread, or on a new one; false if no thread
    /// could be started (the task is dropped unrun).
    pub fn run(&self, task: Task) -> bool {
        let task = match self.tx.try_send(task) {
            Ok(()) => return true,
            Err(TrySendError::Full(t) | TrySendError::Disconnected(t)) => t,
        };
        let rx = self.rx.clone();
        thread::Builder::new()
            .name(self.name.into())
            .spawn(move || {
                task();
                while let Ok(next) = rx.recv_timeout(IDLE) {
                    next();
                }
            })
            .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Barrier};

    #[test]
    fn a_burst_gets_a_thread_each_and_idle_threads_are_reused() {
        let pool = Pool::new("test-pool");
        let n = 8;
        // Every task blocks until all n run at once: only possible with a
        // thread each.
        let all = Arc::new(Barrier::new(n + 1));
        for _ in 0..n {
            let all = Arc::clone(&all);
            assert!(pool.run(Box::new(move || {
                all.wait();
            })));
        }
        all.wait();
        // Now idle: a later task runs on one of them (or a new thread if none
        // is back in recv yet); either way it runs.
        let ran = Arc::new(AtomicUsize::new(0));
        let (done_tx, done_rx) = bounded(1);
        let r = Arc::clone(&ran);
        assert!(pool.run(Box::new(move || {
            r.fetch_add(1, Ordering::SeqCst);
            let _ = done_tx.send(());
        })));
        done_rx.recv().unwrap();
        assert_eq!(ran.load(Ordering::SeqCst), 1);
    }
}
