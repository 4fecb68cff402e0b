//! Admission: the bounded queue between the HTTP handlers and the engine.
//!
//! Handlers only ever `try_send`: a full queue is answered at once with 429 and
//! `Retry-After`, never by blocking a handler thread. The bound is `--queue-depth`
//! for now; deriving it from the measured service rate (Little's law) and
//! bounding queued prompt tokens is the admission-control issue's work.

use crate::engine::Job;
use crate::http::error::ApiError;
use crate::metrics::Metrics;
use crossbeam_channel::{bounded, Receiver, Sender, TrySendError};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Shortest wait a refused client is told to observe.
const RETRY_AFTER_S_MIN: u64 = 1;

pub struct Admission {
    tx: Sender<Job>,
    queue_depth_max: usize,
    metrics: Arc<Metrics>,
}

impl Admission {
    /// Creates the queue; the receiver goes to the engine.
    pub fn new(queue_depth_max: usize, metrics: Arc<Metrics>) -> (Admission, Receiver<Job>) {
        assert!(queue_depth_max >= 1);
        let (tx, rx) = bounded(queue_depth_max);
        (
            Admission {
                tx,
                queue_depth_max,
                metrics,
            },
            rx,
        )
    }

    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        match self.tx.try_send(job) {
            Ok(()) => {
                self.metrics.accepted.fetch_add(1, Ordering::Relaxed);
                self.metrics
                    .queue_depth
                    .store(self.tx.len(), Ordering::Relaxed);
                Ok(())
            }
            Err(TrySendError::Full(_)) => {
                self.metrics
                    .rejected_queue_full
                    .fetch_add(1, Ordering::Relaxed);
                Err(ApiError::QueueFull {
                    depth: self.queue_depth_max,
                    retry_after_s: RETRY_AFTER_S_MIN,
                })
            }
            Err(TrySendError::Disconnected(_)) => Err(ApiError::Engine {
                message: "the engine has stopped".into(),
            }),
        }
    }
}
