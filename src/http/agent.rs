//! HAProxy's agent check (`agent-check` on a `server` line): HAProxy connects
//! to `--agent-port` every `agent-inter` and reads one line, which sets the
//! replica's weight as a share of its configured weight, so new work moves
//! to the replicas with room *before* one is saturated (its `/readyz` flips
//! only once requests wait past the sojourn target):
//!
//! - `drain`: sluice is stopping; HAProxy sends it nothing new.
//! - `ready N%`: its headroom, the smallest of the request places, the
//!   queued-token budget and the KV cells left (`weight_percent`), at least
//!   1 % (0 would take it out: that is `/readyz`'s and `drain`'s to say).
//!
//! One thread (`sluice-agent`) answers the connections one at a time with a
//! line of a few bytes that fits any socket buffer, and closes them; a
//! client that never reads costs it one write.

use super::AppState;
use crate::priority::Class;
use std::io::Write;
use std::net::TcpListener;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// A write that cannot go out at once is given up after this.
const WRITE_TIMEOUT: Duration = Duration::from_secs(1);

/// How much of something is in use: `used` of `of`.
#[derive(Debug, Clone, Copy)]
pub struct Use {
    pub used: usize,
    pub of: usize,
}

impl Use {
    fn left(self) -> f64 {
        1.0 - self.used as f64 / self.of.max(1) as f64
    }
}

/// The weight, in percent: the least left of the places (requests in a slot
/// or waiting, of the slots + the interactive L_max), the queued-token
/// budget and the KV cells; 1 while requests wait past the sojourn target.
pub fn weight_percent(places: Use, tokens: Use, cells: Use, sojourn_above_target: bool) -> u32 {
    if sojourn_above_target {
        return 1;
    }
    let headroom = places.left().min(tokens.left()).min(cells.left());
    (headroom * 100.0).round().clamp(1.0, 100.0) as u32
}

/// What the agent says now.
pub(super) fn line(state: &AppState) -> String {
    if state.stopping.load(Ordering::Relaxed) {
        return "drain\n".into();
    }
    let (_, bounds) = state.queue.snapshot();
    let interactive = bounds[Class::Interactive.index()];
    let held = Class::ALL.map(|c| state.queue.holds(c)).iter().sum();
    let tokens = Class::ALL
        .map(|c| state.queue.queued_tokens(c))
        .iter()
        .sum();
    let weight = weight_percent(
        Use {
            used: held,
            of: state.cfg.parallel + interactive.queue_depth_max,
        },
        Use {
            used: tokens,
            of: interactive.queued_tokens_max,
        },
        Use {
            used: state.metrics.engine_now().kv_cells_reserved,
            of: state.n_ctx,
        },
        state.metrics.sojourn_above_target.load(Ordering::Relaxed),
    );
    format!("ready {weight}%\n")
}

/// Starts the agent on `listener`.
pub fn start(state: Arc<AppState>, listener: TcpListener) -> Result<(), String> {
    std::thread::Builder::new()
        .name("sluice-agent".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                let _ = conn.set_write_timeout(Some(WRITE_TIMEOUT));
                let _ = conn.write_all(line(&state).as_bytes());
            }
        })
        .map(|_| ())
        .map_err(|e| format!("cannot start the agent thread: {e}"))
}

#[cfg(test)]
mod tests {
    use super::{weight_percent, Use};

    fn w(places: usize, tokens: usize, cells: usize, sojourn: bool) -> u32 {
        let u = |used, of| Use { used, of };
        weight_percent(u(places, 6), u(tokens, 1000), u(cells, 8000), sojourn)
    }

    #[test]
    fn the_weight_is_the_least_headroom_left_in_places_tokens_and_cells() {
        assert_eq!(w(0, 0, 0, false), 100);
        assert_eq!(w(2, 0, 0, false), 67);
        assert_eq!(w(2, 900, 0, false), 10);
        assert_eq!(w(2, 0, 6000, false), 25);
        assert_eq!(w(6, 0, 0, false), 1, "never 0");
        assert_eq!(w(9, 0, 0, false), 1);
        assert_eq!(w(0, 0, 0, true), 1);
    }
}
