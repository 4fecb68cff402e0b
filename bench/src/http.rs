//! A minimal HTTP/1.1 client over `TcpStream`, with Server-Sent Events.
//!
//! Why not a client library: the harness (and sluice's tests) must read a stream
//! event by event as it arrives, read it slowly or stop in the middle, hold idle
//! connections, and see exactly what the server framed. HTTP client crates hide
//! or buffer all of that. Plain `http://` only; every call has a read timeout.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

/// Largest response head (status line + headers) accepted, in bytes.
const HEAD_BYTES_MAX: usize = 64 * 1024;
/// Largest non-streamed body accepted, in bytes.
const BODY_BYTES_MAX: usize = 256 * 1024 * 1024;

#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }

    pub fn json(&self) -> io::Result<serde_json::Value> {
        serde_json::from_slice(&self.body)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// Parses `http://host:port[/prefix]` into a socket address and a path prefix.
pub fn parse_url(url: &str) -> io::Result<(SocketAddr, String)> {
    let rest = url.strip_prefix("http://").ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{url}: only http:// URLs are supported"),
        )
    })?;
    let (hostport, path) = match rest.find('/') {
        Some(i) => (&rest[..i], rest[i..].trim_end_matches('/').to_string()),
        None => (rest, String::new()),
    };
    let hostport = if hostport.contains(':') {
        hostport.to_string()
    } else {
        format!("{hostport}:80")
    };
    let addr = hostport
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("{url}: no address")))?;
    Ok((addr, path))
}

pub fn connect(addr: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    let s = TcpStream::connect_timeout(&addr, timeout)?;
    configure(s, timeout)
}

/// A TCP socket for `addr`'s family, to set options on before it connects.
fn tcp_socket(addr: SocketAddr) -> io::Result<socket2::Socket> {
    socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )
}

/// Connects with a receive buffer of about `rcvbuf_bytes` (set before the
/// connection, so the window is small from the start; Linux doubles it): a
/// slow reader whose kernel does not read ahead for it.
pub fn connect_with_rcvbuf(
    addr: SocketAddr,
    timeout: Duration,
    rcvbuf_bytes: usize,
) -> io::Result<TcpStream> {
    let sock = tcp_socket(addr)?;
    sock.set_recv_buffer_size(rcvbuf_bytes)?;
    sock.connect_timeout(&addr.into(), timeout)?;
    configure(sock.into(), timeout)
}

/// Connects from the local address `source` (any of 127.0.0.0/8 on Linux's
/// loopback): another client, as the server sees it.
pub fn connect_from(
    addr: SocketAddr,
    source: std::net::IpAddr,
    timeout: Duration,
) -> io::Result<TcpStream> {
    let sock = tcp_socket(addr)?;
    sock.bind(&SocketAddr::new(source, 0).into())?;
    sock.connect_timeout(&addr.into(), timeout)?;
    configure(sock.into(), timeout)
}

/// The receive buffer the kernel gave a socket, in bytes.
pub fn recv_buffer_bytes(s: &TcpStream) -> io::Result<usize> {
    socket2::SockRef::from(s).recv_buffer_size()
}

fn configure(s: TcpStream, timeout: Duration) -> io::Result<TcpStream> {
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.set_nodelay(true)?;
    Ok(s)
}

pub fn write_request(
    s: &mut TcpStream,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    headers: &[(&str, &str)],
) -> io::Result<()> {
    // The address connected to, as a browser or curl would send it (a server
    // that guards against DNS rebinding answers only to names it knows).
    let host = s
        .peer_addr()
        .map_or_else(|_| "localhost".to_string(), |a| a.to_string());
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        head.push_str(&format!("Content-Length: {}\r\n", b.len()));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes())?;
    if let Some(b) = body {
        s.write_all(b)?;
    }
    s.flush()
}

/// One request on a new connection; the whole response.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    headers: &[(&str, &str)],
    timeout: Duration,
) -> io::Result<Response> {
    request_on(connect(addr, timeout)?, method, path, body, headers)
}

/// One request on a connection of the caller's; the whole response.
pub fn request_on(
    mut s: TcpStream,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    headers: &[(&str, &str)],
) -> io::Result<Response> {
    write_request(&mut s, method, path, body, headers)?;
    let mut r = BufReader::new(s);
    let (status, headers) = read_head(&mut r)?;
    let body = read_body(&mut r, &headers)?;
    Ok(Response {
        status,
        headers,
        body,
    })
}

fn bad(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

pub fn read_head(r: &mut impl BufRead) -> io::Result<(u16, Vec<(String, String)>)> {
    let mut total = 0;
    let mut line = String::new();
    total += r.read_line(&mut line)?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad(format!("bad status line {line:?}")))?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        let n = r.read_line(&mut line)?;
        total += n;
        if n == 0 || total > HEAD_BYTES_MAX {
            return Err(bad("response head cut short or too large".into()));
        }
        let l = line.trim_end();
        if l.is_empty() {
            return Ok((status, headers));
        }
        let (k, v) = l
            .split_once(':')
            .ok_or_else(|| bad(format!("bad header {l:?}")))?;
        headers.push((k.trim().to_string(), v.trim().to_string()));
    }
}

pub fn is_chunked(headers: &[(String, String)]) -> bool {
    header(headers, "transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked"))
}

fn read_body(r: &mut impl BufRead, headers: &[(String, String)]) -> io::Result<Vec<u8>> {
    let mut body = Vec::new();
    if is_chunked(headers) {
        while let Some(chunk) = read_chunk(r)? {
            body.extend(chunk);
            if body.len() > BODY_BYTES_MAX {
                return Err(bad("body too large".into()));
            }
        }
    } else if let Some(n) = header(headers, "content-length") {
        let n: usize = n
            .parse()
            .map_err(|_| bad(format!("bad Content-Length {n:?}")))?;
        if n > BODY_BYTES_MAX {
            return Err(bad("body too large".into()));
        }
        body.resize(n, 0);
        r.read_exact(&mut body)?;
    } else {
        r.take(BODY_BYTES_MAX as u64).read_to_end(&mut body)?;
    }
    Ok(body)
}

/// Reads one chunk of a chunked body; `None` at the final zero-length chunk.
pub fn read_chunk(r: &mut impl BufRead) -> io::Result<Option<Vec<u8>>> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed inside a chunked body",
        ));
    }
    let size_text = line.trim().split(';').next().unwrap_or("");
    let size = usize::from_str_radix(size_text, 16)
        .map_err(|_| bad(format!("bad chunk size line {line:?}")))?;
    if size > BODY_BYTES_MAX {
        return Err(bad("chunk too large".into()));
    }
    let mut data = vec![0; size];
    r.read_exact(&mut data)?;
    let mut crlf = [0; 2];
    r.read_exact(&mut crlf)?;
    if &crlf != b"\r\n" {
        return Err(bad("chunk not followed by CRLF".into()));
    }
    Ok((size > 0).then_some(data))
}

/// Splits SSE events out of a byte buffer as they complete.
#[derive(Default)]
pub struct SseParser {
    pending: Vec<u8>,
    /// Events that were only comments (`: keep-alive`), skipped so far.
    pub comments: usize,
}

impl SseParser {
    pub fn push(&mut self, bytes: &[u8]) {
        self.pending.extend_from_slice(bytes);
    }

    /// The data of the next complete event (multi-line `data:` joined by `\n`);
    /// comments and other fields are skipped.
    pub fn next_event(&mut self) -> Option<String> {
        loop {
            let end = find_event_end(&self.pending)?;
            let event: Vec<u8> = self.pending.drain(..end.0 + end.1).collect();
            let text = String::from_utf8_lossy(&event[..end.0]);
            let data: Vec<&str> = text
                .lines()
                .filter_map(|l| {
                    l.strip_prefix("data:")
                        .map(|d| d.strip_prefix(' ').unwrap_or(d))
                })
                .collect();
            if !data.is_empty() {
                return Some(data.join("\n"));
            }
            if text.lines().any(|l| l.starts_with(':')) {
                self.comments += 1;
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.pending.iter().all(|b| b.is_ascii_whitespace())
    }
}

/// Position and length of the first blank-line event terminator.
fn find_event_end(b: &[u8]) -> Option<(usize, usize)> {
    let lf = b.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = b.windows(4).position(|w| w == b"\r\n\r\n").map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(c)) => Some(if a.0 <= c.0 { a } else { c }),
        (a, c) => a.or(c),
    }
}

/// A streaming response read event by event.
pub struct Sse {
    reader: BufReader<TcpStream>,
    pub status: u16,
    pub headers: Vec<(String, String)>,
    parser: SseParser,
    chunked: bool,
    finished: bool,
}

impl Sse {
    pub fn open(addr: SocketAddr, path: &str, body: &[u8], timeout: Duration) -> io::Result<Sse> {
        Sse::open_on(connect(addr, timeout)?, path, body)
    }

    /// Like `open`, on a socket of the caller's (e.g. one with a small receive
    /// buffer).
    pub fn open_on(s: TcpStream, path: &str, body: &[u8]) -> io::Result<Sse> {
        Sse::open_with(s, path, body, &[])
    }

    /// Like `open_on`, with more request headers.
    pub fn open_with(
        mut s: TcpStream,
        path: &str,
        body: &[u8],
        extra_headers: &[(&str, &str)],
    ) -> io::Result<Sse> {
        let mut headers = vec![
            ("Content-Type", "application/json"),
            ("Accept", "text/event-stream"),
        ];
        headers.extend_from_slice(extra_headers);
        write_request(&mut s, "POST", path, Some(body), &headers)?;
        let mut reader = BufReader::new(s);
        let (status, headers) = read_head(&mut reader)?;
        let chunked = is_chunked(&headers);
        Ok(Sse {
            reader,
            status,
            headers,
            parser: SseParser::default(),
            chunked,
            finished: false,
        })
    }

    /// The rest of a non-200 response body.
    pub fn error_body(mut self) -> io::Result<Vec<u8>> {
        read_body(&mut self.reader, &self.headers)
    }

    /// Comment-only events (`: keep-alive`) read so far.
    pub fn comments(&self) -> usize {
        self.parser.comments
    }

    /// The next event's data (`[DONE]` included); `None` when the body ended.
    pub fn next_data(&mut self) -> io::Result<Option<String>> {
        loop {
            if let Some(data) = self.parser.next_event() {
                return Ok(Some(data));
            }
            if self.finished {
                if !self.parser.is_empty() {
                    return Err(bad("trailing bytes in the event stream".into()));
                }
                return Ok(None);
            }
            if self.chunked {
                match read_chunk(&mut self.reader)? {
                    Some(c) => self.parser.push(&c),
                    None => self.finished = true,
                }
            } else {
                let buf = self.reader.fill_buf()?;
                if buf.is_empty() {
                    self.finished = true;
                } else {
                    let n = buf.len();
                    self.parser.push(buf);
                    self.reader.consume(n);
                }
            }
        }
    }

    /// The next event as JSON; `None` at `[DONE]` or at the end of the body.
    pub fn next_json(&mut self) -> io::Result<Option<serde_json::Value>> {
        match self.next_data()? {
            None => Ok(None),
            Some(d) if d == "[DONE]" => Ok(None),
            Some(d) => serde_json::from_str(&d)
                .map(Some)
                .map_err(|e| bad(format!("event is not JSON ({e}): {d}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_split_across_chunks_are_reassembled() {
        let mut p = SseParser::default();
        p.push(b"data: {\"a\"");
        assert_eq!(p.next_event(), None);
        p.push(b":1}\n");
        assert_eq!(p.next_event(), None);
        p.push(b"\ndata: [DONE]\n\n");
        assert_eq!(p.next_event().as_deref(), Some("{\"a\":1}"));
        assert_eq!(p.next_event().as_deref(), Some("[DONE]"));
        assert!(p.is_empty());
    }

    #[test]
    fn multi_line_events_comments_and_crlf() {
        let mut p = SseParser::default();
        p.push(b": keep-alive\n\ndata: line1\ndata:line2\r\n\r\nevent: x\ndata: y\n\n");
        assert_eq!(p.next_event().as_deref(), Some("line1\nline2"));
        assert_eq!(p.comments, 1, "the keep-alive was counted");
        assert_eq!(p.next_event().as_deref(), Some("y"));
        assert_eq!(p.next_event(), None);
    }

    #[test]
    fn chunked_bodies_are_decoded() {
        let raw = b"5\r\nhello\r\n1;ext=1\r\n!\r\n0\r\n\r\n";
        let mut r = BufReader::new(&raw[..]);
        assert_eq!(read_chunk(&mut r).unwrap(), Some(b"hello".to_vec()));
        assert_eq!(read_chunk(&mut r).unwrap(), Some(b"!".to_vec()));
        assert_eq!(read_chunk(&mut r).unwrap(), None);
    }

    #[test]
    fn urls_are_parsed() {
        let (addr, path) = parse_url("http://127.0.0.1:8080").unwrap();
        assert_eq!(addr.port(), 8080);
        assert_eq!(path, "");
        let (_, path) = parse_url("http://127.0.0.1:9/api/").unwrap();
        assert_eq!(path, "/api");
        assert!(parse_url("https://x").is_err());
    }
}
