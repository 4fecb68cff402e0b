//! Turns a sequence's token pieces into text a client can be sent.
//!
//! Two things make this more than string concatenation:
//! - `llama_token_to_piece` returns raw bytes, and a multi-byte character can be
//!   split across tokens. Bytes are buffered until they form valid UTF-8, so a
//!   client never receives half a character.
//! - Stop strings can span tokens. Text that could still turn out to be the start
//!   of a stop string is held back until it cannot, so a stop string is never
//!   streamed and then "taken back".

/// The result of feeding one token's piece.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Fed {
    /// Text that is now final and may be sent.
    pub text: String,
    /// A stop string was found; generation ends (the stop string is not emitted).
    pub stopped: bool,
}

#[derive(Debug)]
pub struct TextAssembler {
    /// Bytes that do not (yet) form a complete UTF-8 character.
    pending_bytes: Vec<u8>,
    /// Decoded text held back because it may begin a stop string.
    held: String,
    stops: Vec<String>,
    /// Bytes longer than the longest stop string can never be its start.
    hold_bytes_max: usize,
}

/// The longest invalid-UTF-8 tail that can still become valid (a 4-byte character
/// missing its last byte). Anything longer is garbage and is replaced.
const UTF8_PARTIAL_BYTES_MAX: usize = 3;

impl TextAssembler {
    pub fn new(stops: Vec<String>) -> Self {
        let hold_bytes_max = stops.iter().map(String::len).max().unwrap_or(0);
        TextAssembler {
            pending_bytes: Vec::new(),
            held: String::new(),
            stops,
            hold_bytes_max,
        }
    }

    /// Feeds one token's piece.
    pub fn feed(&mut self, piece: &[u8]) -> Fed {
        self.pending_bytes.extend_from_slice(piece);
        let decoded = take_valid_utf8(&mut self.pending_bytes);
        self.held.push_str(&decoded);

        if let Some(at) = self.find_stop() {
            let text = self.held[..at].to_string();
            self.held.clear();
            self.pending_bytes.clear();
            return Fed {
                text,
                stopped: true,
            };
        }

        // Release everything except the longest suffix that is a prefix of a stop.
        let keep = self.longest_stop_prefix_suffix();
        let release_to = self.held.len() - keep;
        let text = self.held[..release_to].to_string();
        self.held.drain(..release_to);
        Fed {
            text,
            stopped: false,
        }
    }

    /// Ends the sequence: whatever is held is final (an incomplete character
    /// at the very end becomes U+FFFD, as a lossy decoder would make it).
    pub fn finish(&mut self) -> String {
        let mut text = std::mem::take(&mut self.held);
        if !self.pending_bytes.is_empty() {
            text.push_str(&String::from_utf8_lossy(&self.pending_bytes));
            self.pending_bytes.clear();
        }
        text
    }

    fn find_stop(&self) -> Option<usize> {
        self.stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
    }

    fn longest_stop_prefix_suffix(&self) -> usize {
        if self.hold_bytes_max == 0 {
            return 0;
        }
        let held = self.held.as_str();
        let mut best = 0;
        for stop in &self.stops {
            let max = stop.len().min(held.len());
            for n in (best + 1..=max).rev() {
                let start = held.len() - n;
                if held.is_char_boundary(start)
                    && stop.as_bytes().starts_with(&held.as_bytes()[start..])
                {
                    best = n;
                    break;
                }
            }
        }
        best
    }
}

/// Removes and returns the longest valid UTF-8 prefix of `bytes`. Invalid bytes
/// that cannot start a character are replaced with U+FFFD rather than kept forever.
fn take_valid_utf8(bytes: &mut Vec<u8>) -> String {
    let mut out = String::new();
    loop {
        match std::str::from_utf8(bytes) {
            Ok(s) => {
                out.push_str(s);
                bytes.clear();
                return out;
            }
            Err(e) => {
                let valid = e.valid_up_to();
                // The prefix is valid by construction.
                out.push_str(&String::from_utf8_lossy(&bytes[..valid]));
                match e.error_len() {
                    // An incomplete character at the end: wait for more bytes.
                    None if bytes.len() - valid <= UTF8_PARTIAL_BYTES_MAX => {
                        bytes.drain(..valid);
                        return out;
                    }
                    // A byte sequence that can never be valid: replace it and go on.
                    Some(bad) => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        bytes.drain(..valid + bad);
                    }
                    None => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        bytes.clear();
                        return out;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed_all(asm: &mut TextAssembler, pieces: &[&[u8]]) -> (Vec<String>, bool) {
        let mut out = Vec::new();
        for p in pieces {
            let fed = asm.feed(p);
            out.push(fed.text);
            if fed.stopped {
                return (out, true);
            }
        }
        (out, false)
    }

    #[test]
    fn plain_ascii_passes_through_at_once() {
        let mut asm = TextAssembler::new(vec![]);
        let (out, stopped) = feed_all(&mut asm, &[b"Hel", b"lo"]);
        assert_eq!(out, vec!["Hel", "lo"]);
        assert!(!stopped);
    }

    #[test]
    fn a_character_split_across_tokens_is_emitted_whole() {
        // "é" is C3 A9; "🙂" is F0 9F 99 82.
        let mut asm = TextAssembler::new(vec![]);
        let (out, _) = feed_all(&mut asm, &[b"caf\xC3", b"\xA9 \xF0\x9F", b"\x99", b"\x82!"]);
        assert_eq!(out, vec!["caf", "é ", "", "🙂!"]);
    }

    #[test]
    fn invalid_bytes_become_replacement_characters_not_a_stuck_buffer() {
        let mut asm = TextAssembler::new(vec![]);
        assert_eq!(asm.feed(b"a\xFFb").text, "a\u{FFFD}b");
        // A truncated character at the end of generation is flushed lossily.
        assert_eq!(asm.feed(b"\xE2\x82").text, "");
        assert_eq!(asm.finish(), "\u{FFFD}");
    }

    #[test]
    fn a_stop_string_inside_one_piece_cuts_the_text() {
        let mut asm = TextAssembler::new(vec!["END".into()]);
        let fed = asm.feed(b"abcENDxyz");
        assert_eq!(
            fed,
            Fed {
                text: "abc".into(),
                stopped: true
            }
        );
    }

    #[test]
    fn a_stop_string_across_pieces_is_never_emitted() {
        let mut asm = TextAssembler::new(vec!["\n\nUser:".into()]);
        let (out, stopped) = feed_all(&mut asm, &[b"Hi.", b"\n", b"\nUs", b"er:", b"more"]);
        assert!(stopped);
        assert_eq!(out.concat(), "Hi.");
    }

    #[test]
    fn held_text_that_turns_out_not_to_be_a_stop_is_released() {
        let mut asm = TextAssembler::new(vec!["STOP".into()]);
        let (out, stopped) = feed_all(&mut asm, &[b"ST", b"OCK"]);
        assert!(!stopped);
        assert_eq!(out, vec!["", "STOCK"]);
        assert_eq!(asm.finish(), "");
    }

    #[test]
    fn held_text_is_flushed_at_the_end() {
        let mut asm = TextAssembler::new(vec!["STOP".into()]);
        assert_eq!(asm.feed(b"end ST").text, "end ");
        assert_eq!(asm.finish(), "ST");
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        let mut asm = TextAssembler::new(vec!["b".into(), "a".into()]);
        assert_eq!(asm.feed(b"xxab").text, "xx");
    }

    #[test]
    fn multibyte_stop_strings_hold_on_char_boundaries() {
        let mut asm = TextAssembler::new(vec!["éé".into()]);
        assert_eq!(asm.feed("aé".as_bytes()).text, "a");
        let fed = asm.feed("é".as_bytes());
        assert!(fed.stopped);
        assert_eq!(fed.text, "");
    }
}
