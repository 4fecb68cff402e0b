//! Threads for connections, reused: a connection goes to a thread that is
//! idle, or else a new thread starts. A thread that has waited `IDLE` for
//! another connection ends. Threads are bounded by the connections open (the
//! door's bound) plus those idle.
//!
//! A connection is queued for the idle threads only while more threads are
//! idle than connections already queued for them, counted under the queue's
//! lock, so a burst is never queued behind threads that will not take it
//! (tiny_http's own pool counted a thread idle only once it had taken a task,
//! and queued a burst behind a handful of threads that then blocked on idle
//! keep-alive connections). So the queue never holds more than the idle
//! threads, and a thread that times out takes a connection queued meanwhile
//! before it ends.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::Duration;

/// How long a thread with no connection waits for one before it ends.
const IDLE: Duration = Duration::from_secs(5);

pub(super) type Task = Box<dyn FnOnce() + Send + 'static>;

#[derive(Default)]
struct Queue {
    tasks: VecDeque<Task>,
    /// Threads waiting for a task.
    idle: usize,
}

struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
    /// How long a thread waits for a task before it ends (`IDLE`).
    idle: Duration,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The next task, waiting at most `idle` for one; None: time to end.
    fn next(&self) -> Option<Task> {
        let mut q = self.lock();
        loop {
            if let Some(t) = q.tasks.pop_front() {
                return Some(t);
            }
            q.idle += 1;
            let (g, waited) = self
                .wake
                .wait_timeout(q, self.idle)
                .unwrap_or_else(|e| e.into_inner());
            q = g;
            q.idle -= 1;
            if waited.timed_out() && q.tasks.is_empty() {
                return None;
            }
        }
    }
}

pub(super) struct Pool {
    name: &'static str,
    shared: Arc<Shared>,
}

impl Pool {
    pub fn new(name: &'static str) -> Pool {
        Pool::with_idle(name, IDLE)
    }

    fn with_idle(name: &'static str, idle: Duration) -> Pool {
        let shared = Shared {
            queue: Mutex::default(),
            wake: Condvar::new(),
            idle,
        };
        Pool {
            name,
            shared: Arc::new(shared),
        }
    }

    /// Runs `task` on an idle thread, or on a new one; false if no thread
    /// could be started (the task is dropped unrun).
    pub fn run(&self, task: Task) -> bool {
        {
            let mut q = self.shared.lock();
            if q.idle > q.tasks.len() {
                q.tasks.push_back(task);
                self.shared.wake.notify_one();
                return true;
            }
        }
        let shared = Arc::clone(&self.shared);
        thread::Builder::new()
            .name(self.name.into())
            .spawn(move || {
                task();
                while let Some(next) = shared.next() {
                    next();
                }
            })
            .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crossbeam_channel::bounded;
    use std::sync::Barrier;

    #[test]
    fn a_burst_gets_a_thread_each_and_idle_threads_are_reused() {
        // Threads never time out here, however slow the box: the test
        // waits for all of them to be idle.
        let pool = Pool::with_idle("test-pool", Duration::from_secs(3600));
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
        // Once they wait for work, later tasks run on them: no new thread.
        while pool.shared.lock().idle < n {
            thread::yield_now();
        }
        let (done_tx, done_rx) = bounded(n);
        for _ in 0..n {
            let done = done_tx.clone();
            assert!(pool.run(Box::new(move || {
                let _ = done.send(thread::current().id());
            })));
        }
        let ran: Vec<_> = (0..n).map(|_| done_rx.recv().unwrap()).collect();
        assert_eq!(ran.len(), n);
        assert!(pool.shared.lock().tasks.is_empty());
    }
}
