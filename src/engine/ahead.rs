//! Decoding ahead of a long prompt's large chunk.
//!
//! Beside running streams, the ITL target cuts a prompt into chunks small
//! enough that a step with every stream's decode token stays within it. Deep
//! in a long prompt such chunks are where flash attention with an f16 cache
//! (llama-server's pairing) is at its slowest: ggml's tiled kernel needs 64
//! queries a pass, and llama-server prefills in 512-token passes while its
//! streams wait seconds. So with `--decode-ahead-ms`, a prompt first in the
//! planner's order that could go in chunks several times larger than the
//! target allows goes in chunks of up to that many milliseconds, each
//! alone in its step, and the streams are fed through them by tokens decoded
//! ahead: steps of decode tokens only until every stream has tokens to send
//! for as long as the chunk's forecast (its *cover*), then the chunk. A
//! stream's tokens then go out one `pace` apart (`release_at`; the reply
//! holds each until its `not_before`), so a client sees a steady stream at
//! the target's pace, not a burst and then a pause.
//!
//! Pure: no clock of its own, no model; `Engine::ahead_step` applies it.

use std::time::{Duration, Instant};

/// A large chunk goes only if it holds at least this many times the prompt
/// tokens the ITL target would give the prompt in a step, and at least
/// `CHUNK_MIN_TOKENS`: otherwise the target's chunks are as good.
pub const CHUNK_GAIN_MIN: usize = 4;
/// The smallest large chunk: ggml's tiled flash attention takes 64 queries a
/// pass.
pub const CHUNK_MIN_TOKENS: usize = 64;
/// The chunk's forecast is stretched by this much for the cover it needs,
/// beyond what the chunks so far ran over theirs (`stretch_after`). Chunks
/// run over by different amounts from one to the next: five runs of the
/// ~6,300-token prompt beside two chats on the Zen 4's native build, 232
/// chunks, took a median 1.04-1.07 times their forecast, but 1.1-1.44 times
/// in 58 of them, a large one also after chunks that had brought the
/// learned stretch down to 1.03 (one gap of 432 ms at 1.1). Replayed on
/// those chunks, 1.1 leaves a worst gap of 463 ms, 1.3 259 ms, 1.4 156 ms.
/// The cover costs no compute (the tokens decoded ahead are the streams'
/// next ones); a stream only sends them later, at the pace, after the
/// prompt: by this share more.
pub const COVER_STRETCH: f64 = 1.4;
/// The stretch before any chunk has run. A prompt's first chunk is
/// forecast at the fresh-prompt cost per token, measured on small chunks,
/// its later ones at the prompt's own: the two run over by different
/// amounts, so each has a stretch of its own (`Stretches`). On the Zen 4's
/// AVX2 build a ~6,300-token prompt's first 1 s chunk ran ~1.4x over its
/// forecast, the later ones a few per cent.
pub const STRETCH_INITIAL: f64 = 1.5;

/// The learned stretches: of a prompt's first large chunk, and of its later
/// ones.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stretches {
    pub first: f64,
    pub later: f64,
}

impl Default for Stretches {
    fn default() -> Stretches {
        Stretches {
            first: STRETCH_INITIAL,
            later: STRETCH_INITIAL,
        }
    }
}

impl Stretches {
    /// The stretch of a chunk, the first of its prompt or not.
    pub fn of(&self, first: bool) -> f64 {
        if first {
            self.first
        } else {
            self.later
        }
    }

    /// After such a chunk took `ratio` times its forecast.
    pub fn after(&mut self, first: bool, ratio: f64) {
        let s = if first {
            &mut self.first
        } else {
            &mut self.later
        };
        *s = stretch_after(*s, ratio);
    }
}
/// The learned stretch at most: one chunk preempted for ten times its
/// forecast does not make the streams decode ten chunks ahead.
pub const STRETCH_MAX: f64 = 3.0;
/// How fast the learned stretch comes down after chunks that ran within
/// their forecast (it goes up at once).
const STRETCH_DECAY: f64 = 0.2;
/// A stream's cover grows by the pace less a decode step's time with each
/// step of decode tokens: ahead only while a decode step takes at most this
/// share of the pace.
pub const DECODE_SHARE_MAX: f64 = 0.5;

/// When a stream's next token may go out, `now` being when it was sampled
/// and `last` when its previous one goes out: at once, unless the engine is
/// decoding ahead (`ahead`) or the stream still has tokens decoded ahead to
/// send; then one `pace` after the previous one, or at once if that is past.
pub fn release_at(now: Instant, last: Option<Instant>, ahead: bool, pace: Duration) -> Instant {
    match last {
        Some(last) if ahead || last > now => (last + pace).max(now),
        _ => now,
    }
}

/// Seconds a stream has tokens to send for, at `now`: until its last token
/// decoded ahead goes out.
pub fn cover_s(now: Instant, last: Option<Instant>) -> f64 {
    last.map_or(0.0, |t| t.saturating_duration_since(now).as_secs_f64())
}

/// Tokens of the large chunk for a prompt with `remaining` tokens to
/// prefill at `s_per_token`: what `chunk_max_s` holds, within llama.cpp's
/// `n_batch`; `None` when that is not `CHUNK_GAIN_MIN` times what the ITL
/// target gives it in a step (`target_chunk`; or half `n_batch`, on a CPU
/// fast enough that the target's chunks are large) or under
/// `CHUNK_MIN_TOKENS`.
/// The prompt's last tokens go in a chunk whatever their number.
pub fn chunk_tokens(
    remaining: usize,
    s_per_token: f64,
    chunk_max_s: f64,
    n_batch: usize,
    target_chunk: usize,
) -> Option<usize> {
    if s_per_token.is_nan() || s_per_token <= 0.0 || chunk_max_s <= 0.0 {
        return None;
    }
    let fits = (chunk_max_s / s_per_token).floor() as usize;
    let n = fits.min(n_batch);
    let worth = CHUNK_MIN_TOKENS.max((CHUNK_GAIN_MIN * target_chunk).min(n_batch / 2));
    if n < worth || remaining < worth {
        return None;
    }
    Some(n.min(remaining))
}

/// The cover every stream needs before a chunk whose forecast is `chunk_s`
/// goes: then the first token after it is decoded (in `decode_s`) and sent
/// one `pace_s` after the last one sent before it, at the latest, were the
/// chunk to run `stretch` times its forecast (learned, `stretch_after`) and
/// `COVER_STRETCH` more. A stream with that much is not decoded further
/// meanwhile: no stream runs further ahead than this and a step.
pub fn cover_needed_s(chunk_s: f64, stretch: f64, decode_s: f64, pace_s: f64) -> f64 {
    COVER_STRETCH * stretch * chunk_s + decode_s - pace_s
}

/// The stretch after a chunk that took `ratio` times its forecast: up to
/// it at once, down towards it slowly, within 1..=`STRETCH_MAX`. (A chunk's forecast
/// is its prompt's last chunk's cost per token, and each chunk is deeper,
/// so they run over by a steady few per cent; a busy box, by more.)
pub fn stretch_after(stretch: f64, ratio: f64) -> f64 {
    if !ratio.is_finite() {
        return stretch;
    }
    let next = if ratio > stretch {
        ratio
    } else {
        stretch + STRETCH_DECAY * (ratio - stretch)
    };
    next.clamp(1.0, STRETCH_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PACE: Duration = Duration::from_millis(120);

    #[test]
    fn tokens_go_out_at_once_unless_decoded_ahead() {
        let t0 = Instant::now();
        let later = t0 + Duration::from_millis(30);
        assert_eq!(release_at(t0, None, true, PACE), t0, "a first token");
        assert_eq!(release_at(later, Some(t0), false, PACE), later);
        // Decoding ahead: one pace after the one before.
        let first = release_at(later, Some(t0), true, PACE);
        assert_eq!(first, t0 + PACE);
        let second = release_at(later + Duration::from_millis(20), Some(first), true, PACE);
        assert_eq!(second, t0 + 2 * PACE);
        // No longer decoding ahead, the tokens still to send keep the pace...
        let third = release_at(later + Duration::from_millis(40), Some(second), false, PACE);
        assert_eq!(third, t0 + 3 * PACE);
        // ...until they are sent.
        let much_later = t0 + Duration::from_secs(1);
        assert_eq!(release_at(much_later, Some(third), false, PACE), much_later);
        // A token sampled after its pace goes at once.
        assert_eq!(release_at(much_later, Some(third), true, PACE), much_later);
    }

    #[test]
    fn cover_is_the_time_until_the_last_token_goes_out() {
        let t0 = Instant::now();
        assert_eq!(cover_s(t0, None), 0.0);
        assert_eq!(cover_s(t0 + Duration::from_secs(1), Some(t0)), 0.0);
        let cover = cover_s(t0, Some(t0 + Duration::from_millis(1500)));
        assert!((cover - 1.5).abs() < 1e-9);
    }

    #[test]
    fn a_large_chunk_only_where_it_holds_several_target_chunks() {
        // 10 ms a token, 2 s: 200 tokens.
        assert_eq!(chunk_tokens(6000, 0.010, 2.0, 512, 10), Some(200));
        // Within n_batch.
        assert_eq!(chunk_tokens(6000, 0.001, 2.0, 512, 10), Some(512));
        // The prompt's last tokens.
        assert_eq!(chunk_tokens(150, 0.010, 2.0, 512, 10), Some(150));
        // Not four times the target's chunk.
        assert_eq!(chunk_tokens(6000, 0.010, 2.0, 512, 60), None);
        // But n_batch is as large as a chunk gets: half of it will do.
        assert_eq!(chunk_tokens(6000, 0.001, 2.0, 512, 100), Some(512));
        assert_eq!(chunk_tokens(6000, 0.008, 2.0, 512, 100), None);
        // Under the tiled kernel's 64 queries.
        assert_eq!(chunk_tokens(6000, 0.050, 2.0, 512, 1), None);
        // A prompt that short goes the ordinary way.
        assert_eq!(chunk_tokens(50, 0.010, 2.0, 512, 10), None);
        assert_eq!(chunk_tokens(6000, 0.010, 0.0, 512, 10), None, "off");
        assert_eq!(chunk_tokens(6000, f64::NAN, 2.0, 512, 10), None);
    }

    #[test]
    fn a_chunk_needs_the_cover_of_its_stretched_forecast_less_one_pace() {
        // A 1 s chunk, 20 ms of decode after it, a 120 ms pace: 1.4 + 0.02
        // - 0.12 = 1.3 s of cover.
        assert!((cover_needed_s(1.0, 1.0, 0.02, 0.12) - 1.3).abs() < 1e-9);
        // Chunks ran 20 % over: 1.68 + 0.02 - 0.12 = 1.58 s.
        assert!((cover_needed_s(1.0, 1.2, 0.02, 0.12) - 1.58).abs() < 1e-9);
    }

    #[test]
    fn the_stretch_follows_an_overrun_at_once_and_comes_down_slowly() {
        assert_eq!(stretch_after(1.0, 1.3), 1.3);
        let down = stretch_after(1.3, 1.0);
        assert!(down < 1.3 && down > 1.2, "{down}");
        assert_eq!(stretch_after(1.0, 0.5), 1.0, "never under 1");
        assert_eq!(stretch_after(1.0, 10.0), STRETCH_MAX);
        assert_eq!(stretch_after(1.2, f64::NAN), 1.2);
    }

    #[test]
    fn a_prompts_first_chunk_and_its_later_ones_learn_apart() {
        let mut s = Stretches::default();
        assert_eq!(
            (s.of(true), s.of(false)),
            (STRETCH_INITIAL, STRETCH_INITIAL)
        );
        for _ in 0..30 {
            s.after(false, 1.05);
        }
        assert!((s.of(false) - 1.05).abs() < 0.01, "{s:?}");
        assert_eq!(
            s.of(true),
            STRETCH_INITIAL,
            "later chunks leave the first's"
        );
        s.after(true, 1.4);
        assert!(s.of(true) < STRETCH_INITIAL);
        s.after(true, 1.8);
        assert_eq!(s.of(true), 1.8);
        assert!((s.of(false) - 1.05).abs() < 0.01);
    }
}
