//! Server-Sent Events written by hand over the raw socket writer.
//!
//! tiny_http's `respond()` buffers 8 KiB chunks and swallows EPIPE/ECONNRESET, so
//! it can neither stream one token at a time nor notice that the client left.
//! `Request::into_writer()` gives the socket back: sluice writes the status line,
//! the headers and each chunk frame itself, flushes after every event, and sees a
//! write error at once.

use std::io::{self, Write};

/// The response head for an SSE stream, with `extra` headers (CORS).
/// `Connection` and `Transfer-Encoding` are written here because tiny_http's
/// `add_header` drops them.
pub fn head(extra: &[tiny_http::Header]) -> Vec<u8> {
    let mut out = b"HTTP/1.1 200 OK\r\n\
      Content-Type: text/event-stream\r\n\
      Cache-Control: no-cache\r\n\
      Connection: keep-alive\r\n\
      X-Accel-Buffering: no\r\n\
      Transfer-Encoding: chunked\r\n"
        .to_vec();
    for h in extra {
        out.extend_from_slice(format!("{}: {}\r\n", h.field, h.value).as_bytes());
    }
    out.extend_from_slice(b"\r\n");
    out
}

/// One SSE event (`data: ...`), framed as one HTTP chunk.
pub fn frame_event(data: &str) -> Vec<u8> {
    debug_assert!(!data.contains('\n'), "JSON events are single-line");
    let payload_len = "data: ".len() + data.len() + 2;
    let mut out = Vec::with_capacity(payload_len + 16);
    out.extend_from_slice(format!("{payload_len:x}\r\n").as_bytes());
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(data.as_bytes());
    out.extend_from_slice(b"\n\n\r\n");
    out
}

/// An SSE comment line (`: text`), framed as one HTTP chunk: clients ignore
/// it, proxies and read timeouts see bytes.
pub fn frame_comment(text: &str) -> Vec<u8> {
    debug_assert!(!text.contains('\n'));
    let payload_len = ": ".len() + text.len() + 2;
    let mut out = format!("{payload_len:x}\r\n: {text}\n\n\r\n").into_bytes();
    out.shrink_to_fit();
    out
}

/// The zero-length chunk that ends a chunked body.
pub const END_OF_BODY: &[u8] = b"0\r\n\r\n";

/// An SSE stream over a socket writer; every call writes and flushes.
pub struct SseWriter {
    out: Box<dyn Write + Send>,
    /// Marked once the body has ended, so that the connection may carry
    /// another request (else it is closed after the stream).
    completion: Option<tiny_http::Completion>,
}

impl SseWriter {
    pub fn start(
        mut out: Box<dyn Write + Send>,
        extra: &[tiny_http::Header],
        completion: Option<tiny_http::Completion>,
    ) -> io::Result<SseWriter> {
        out.write_all(&head(extra))?;
        out.flush()?;
        Ok(SseWriter { out, completion })
    }

    pub fn event(&mut self, data: &str) -> io::Result<()> {
        self.out.write_all(&frame_event(data))?;
        self.out.flush()
    }

    /// Sends `: keep-alive`.
    pub fn keep_alive(&mut self) -> io::Result<()> {
        self.out.write_all(&frame_comment("keep-alive"))?;
        self.out.flush()
    }

    /// Sends `data: [DONE]` and ends the body.
    pub fn done(mut self) -> io::Result<()> {
        self.event("[DONE]")?;
        self.end()
    }

    /// Ends the body without `[DONE]`: the stream stopped on an error.
    pub fn end(mut self) -> io::Result<()> {
        self.out.write_all(END_OF_BODY)?;
        self.out.flush()?;
        if let Some(c) = &self.completion {
            c.done();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decodes a chunked body, checking every frame's length.
    fn dechunk(mut raw: &[u8]) -> Vec<u8> {
        let mut body = Vec::new();
        loop {
            let line_end = raw
                .windows(2)
                .position(|w| w == b"\r\n")
                .expect("chunk size line");
            let size =
                usize::from_str_radix(std::str::from_utf8(&raw[..line_end]).unwrap(), 16).unwrap();
            raw = &raw[line_end + 2..];
            if size == 0 {
                assert_eq!(raw, b"\r\n");
                return body;
            }
            body.extend_from_slice(&raw[..size]);
            assert_eq!(&raw[size..size + 2], b"\r\n");
            raw = &raw[size + 2..];
        }
    }

    #[test]
    fn events_are_framed_as_exact_chunks() {
        let mut raw = frame_event(r#"{"a":"é"}"#);
        raw.extend(frame_comment("keep-alive"));
        raw.extend(frame_event("[DONE]"));
        raw.extend_from_slice(END_OF_BODY);
        let body = dechunk(&raw);
        assert_eq!(
            String::from_utf8(body).unwrap(),
            "data: {\"a\":\"é\"}\n\n: keep-alive\n\ndata: [DONE]\n\n"
        );
    }

    #[test]
    fn writer_sends_head_events_and_end() {
        #[derive(Clone, Default)]
        struct Shared(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl Write for Shared {
            fn write(&mut self, b: &[u8]) -> io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let sink = Shared::default();
        let cors = tiny_http::Header::from_bytes(&b"Vary"[..], &b"Origin"[..]).unwrap();
        let completion = tiny_http::Completion::default();
        let mut w =
            SseWriter::start(Box::new(sink.clone()), &[cors], Some(completion.clone())).unwrap();
        w.event("{}").unwrap();
        w.done().unwrap();
        let all = sink.0.lock().unwrap().clone();
        let split = all.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
        assert!(all.starts_with(b"HTTP/1.1 200 OK\r\n"));
        assert!(String::from_utf8_lossy(&all[..split]).contains("\r\nVary: Origin\r\n"));
        assert!(
            completion.is_done(),
            "the ended stream leaves the connection reusable"
        );
        assert_eq!(dechunk(&all[split..]), b"data: {}\n\ndata: [DONE]\n\n");
    }
}
