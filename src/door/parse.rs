//! Reading a request's head and body off the wire, strictly (RFC 9112): lines
//! end in CRLF, the request line and header fields are exactly what the
//! grammar allows, the body's framing is unambiguous, and every limit has its
//! status (414, 431, 413, 505). Pure over `BufRead`: the connection's thread
//! gives it a reader whose every read is bounded by a deadline.

use std::io::{self, BufRead, Read};

use tiny_http::{HTTPVersion, Header, Method};

use super::refusal::Refusal;
use super::ConnectionLimits;

/// How reading part of a request ended, when it did not succeed.
#[derive(Debug)]
pub(super) enum ReadFail {
    /// The client closed, or the socket failed: nobody to answer.
    Gone,
    /// The deadline passed.
    TimedOut,
    /// The request is refused with this answer.
    Refused(Refusal),
}

impl From<io::Error> for ReadFail {
    fn from(e: io::Error) -> ReadFail {
        match e.kind() {
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => ReadFail::TimedOut,
            _ => ReadFail::Gone,
        }
    }
}

/// The request line and header fields, parsed.
#[derive(Debug)]
pub(super) struct Head {
    pub method: Method,
    pub target: String,
    pub version: HTTPVersion,
    pub headers: Vec<Header>,
}

/// How the request's body is delimited (RFC 9112 §6.3).
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Framing {
    None,
    Length(u64),
    Chunked,
}

/// Reads one line ending in CRLF into `out` (without the CRLF). A bare LF,
/// or a CR not followed by LF, is refused; so is a line over `max` bytes
/// (with `too_long`).
fn read_line<R: BufRead>(
    rd: &mut R,
    max: usize,
    too_long: &Refusal,
    out: &mut Vec<u8>,
) -> Result<(), ReadFail> {
    out.clear();
    loop {
        let available = match rd.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        };
        if available.is_empty() {
            return Err(ReadFail::Gone);
        }
        let (take, found) = match available.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (available.len(), false),
        };
        if out.len() + take > max + 2 {
            return Err(ReadFail::Refused(Refusal::new(
                too_long.status,
                too_long.code,
                too_long.message.clone(),
            )));
        }
        out.extend_from_slice(&available[..take]);
        rd.consume(take);
        if found {
            out.pop(); // LF
            if out.pop() != Some(b'\r') {
                return Err(ReadFail::Refused(Refusal::bad(
                    "a line ends in a bare LF; HTTP lines end in CRLF",
                )));
            }
            if out.contains(&b'\r') {
                return Err(ReadFail::Refused(Refusal::bad("a bare CR inside a line")));
            }
            return Ok(());
        }
    }
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// `method SP request-target SP HTTP-version` (RFC 9112 §3), exactly.
pub(super) fn parse_request_line(line: &[u8]) -> Result<(Method, String, HTTPVersion), Refusal> {
    let bad = || Refusal::bad("the request line is not 'METHOD target HTTP/1.x'");
    let mut parts = line.split(|&b| b == b' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad());
    };
    if method.is_empty() || !method.iter().all(|&b| is_tchar(b)) {
        return Err(bad());
    }
    if target.is_empty() || !target.iter().all(|&b| (0x21..0x7f).contains(&b)) {
        return Err(bad());
    }
    let version = match version {
        b"HTTP/1.1" => HTTPVersion(1, 1),
        b"HTTP/1.0" => HTTPVersion(1, 0),
        v if v.len() == 8 && v.starts_with(b"HTTP/") && v[5].is_ascii_digit() => {
            return Err(Refusal::new(
                505,
                "http_version_not_supported",
                "this server speaks HTTP/1.0 and HTTP/1.1",
            ))
        }
        _ => return Err(bad()),
    };
    let method = std::str::from_utf8(method)
        .ok()
        .and_then(|m| m.parse().ok())
        .ok_or_else(bad)?;
    let target = String::from_utf8(target.to_vec()).map_err(|_| bad())?;
    Ok((method, target, version))
}

/// `field-name ":" OWS field-value OWS` (RFC 9112 §5): no space before the
/// colon, no line folding, no control characters in the value.
pub(super) fn parse_header_line(line: &[u8]) -> Result<Header, Refusal> {
    if line.first().is_some_and(|&b| b == b' ' || b == b'\t') {
        return Err(Refusal::bad("obsolete line folding in a header field"));
    }
    let colon = line
        .iter()
        .position(|&b| b == b':')
        .ok_or_else(|| Refusal::bad("a header line without a colon"))?;
    let (name, value) = (&line[..colon], &line[colon + 1..]);
    if name.is_empty() || !name.iter().all(|&b| is_tchar(b)) {
        return Err(Refusal::bad("a header field name that is not a token"));
    }
    let ows = |b: &u8| *b == b' ' || *b == b'\t';
    let start = value.iter().position(|b| !ows(b)).unwrap_or(value.len());
    let end = value.iter().rposition(|b| !ows(b)).map_or(start, |i| i + 1);
    let value = &value[start..end];
    if !value
        .iter()
        .all(|&b| b == b'\t' || (0x20..0x7f).contains(&b))
    {
        return Err(Refusal::bad(
            "a header field value with control or non-ASCII bytes",
        ));
    }
    Header::from_bytes(name, value).map_err(|()| Refusal::bad("an invalid header field"))
}

/// The body's framing from the header fields (RFC 9112 §6.3), strictly:
/// Transfer-Encoding other than exactly `chunked`, Transfer-Encoding beside
/// Content-Length, more than one Content-Length, or one that is not a plain
/// decimal number, are refused: a proxy in front could read them differently.
pub(super) fn framing(version: &HTTPVersion, headers: &[Header]) -> Result<Framing, Refusal> {
    let te: Vec<&str> = headers
        .iter()
        .filter(|h| h.field.equiv("Transfer-Encoding"))
        .map(|h| h.value.as_str())
        .collect();
    let cl: Vec<&str> = headers
        .iter()
        .filter(|h| h.field.equiv("Content-Length"))
        .map(|h| h.value.as_str())
        .collect();
    if !te.is_empty() {
        if !cl.is_empty() {
            return Err(Refusal::bad(
                "both Transfer-Encoding and Content-Length; send one",
            ));
        }
        if *version < HTTPVersion(1, 1) {
            return Err(Refusal::bad("Transfer-Encoding in an HTTP/1.0 request"));
        }
        if te.len() != 1 || !te[0].eq_ignore_ascii_case("chunked") {
            return Err(Refusal::bad(format!(
                "Transfer-Encoding is '{}'; only 'chunked' is accepted",
                te.join(", ")
            )));
        }
        return Ok(Framing::Chunked);
    }
    match cl.as_slice() {
        [] => Ok(Framing::None),
        [v] => {
            let ok = !v.is_empty() && v.len() <= 19 && v.bytes().all(|b| b.is_ascii_digit());
            match v.parse::<u64>() {
                Ok(n) if ok => Ok(Framing::Length(n)),
                _ => Err(Refusal::bad(format!(
                    "Content-Length is '{v}'; it must be a decimal number of bytes"
                ))),
            }
        }
        _ => Err(Refusal::bad("more than one Content-Length")),
    }
}

/// Reads a chunked body (RFC 9112 §7.1) of at most `max` bytes into `out`.
pub(super) fn read_chunked<R: BufRead>(
    rd: &mut R,
    max: usize,
    out: &mut Vec<u8>,
) -> Result<(), ReadFail> {
    let too_long = Refusal::bad("a chunk-size line is too long");
    let mut line = Vec::new();
    loop {
        read_line(rd, 1024, &too_long, &mut line)?;
        let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
        if digits == 0 {
            return Err(ReadFail::Refused(Refusal::bad(
                "a chunk size is not hexadecimal",
            )));
        }
        let rest = &line[digits..];
        let rest_ok = rest.is_empty()
            || rest
                .iter()
                .position(|&b| b != b' ' && b != b'\t')
                .is_some_and(|i| rest[i] == b';');
        if !rest_ok {
            return Err(ReadFail::Refused(Refusal::bad(
                "a malformed chunk-size line",
            )));
        }
        let size = std::str::from_utf8(&line[..digits])
            .ok()
            .and_then(|s| u64::from_str_radix(s, 16).ok())
            .ok_or_else(|| ReadFail::Refused(Refusal::bad("a chunk size overflows")))?;
        if size == 0 {
            // Trailer fields, ignored, then the empty line.
            let too_long = Refusal::new(431, "headers_too_large", "a trailer field is too long");
            for _ in 0..64 {
                read_line(rd, 8 * 1024, &too_long, &mut line)?;
                if line.is_empty() {
                    return Ok(());
                }
            }
            return Err(ReadFail::Refused(too_long));
        }
        if size > (max - out.len()) as u64 {
            return Err(ReadFail::Refused(too_large(max)));
        }
        let start = out.len();
        out.resize(start + size as usize, 0);
        read_exact(rd, &mut out[start..])?;
        let mut crlf = [0u8; 2];
        read_exact(rd, &mut crlf)?;
        if &crlf != b"\r\n" {
            return Err(ReadFail::Refused(Refusal::bad(
                "chunk data not followed by CRLF",
            )));
        }
    }
}

pub(super) fn read_exact<R: Read>(rd: &mut R, buf: &mut [u8]) -> Result<(), ReadFail> {
    let mut filled = 0;
    while filled < buf.len() {
        match rd.read(&mut buf[filled..]) {
            Ok(0) => return Err(ReadFail::Gone),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

pub(super) fn too_large(max: usize) -> Refusal {
    Refusal::new(
        413,
        "body_too_large",
        format!("the request body is over {max} bytes"),
    )
}

/// Reads a request head: the request line and the header fields, within the
/// limits. Empty lines before the request line are skipped (RFC 9112 §2.2).
pub(super) fn read_head<R: BufRead>(
    rd: &mut R,
    limits: &ConnectionLimits,
) -> Result<Head, ReadFail> {
    let line_max = limits.header_line_bytes_max;
    let uri_too_long = Refusal::new(414, "uri_too_long", "the request line is too long");
    let field_too_long = Refusal::new(431, "headers_too_large", "a header line is too long");
    let mut line = Vec::new();
    let mut skipped = 0;
    loop {
        read_line(rd, line_max, &uri_too_long, &mut line)?;
        if !line.is_empty() {
            break;
        }
        skipped += 1;
        if skipped > 4 {
            return Err(ReadFail::Refused(Refusal::bad("empty lines, no request")));
        }
    }
    let (method, target, version) = parse_request_line(&line).map_err(ReadFail::Refused)?;
    let mut headers = Vec::new();
    let mut bytes = 0;
    loop {
        read_line(rd, line_max, &field_too_long, &mut line)?;
        if line.is_empty() {
            break;
        }
        bytes += line.len();
        if headers.len() >= limits.headers_max || bytes > limits.header_bytes_max {
            return Err(ReadFail::Refused(Refusal::new(
                431,
                "headers_too_large",
                "too many header fields, or too many bytes of them",
            )));
        }
        headers.push(parse_header_line(&line).map_err(ReadFail::Refused)?);
    }
    let hosts = headers.iter().filter(|h| h.field.equiv("Host")).count();
    if hosts > 1 || (hosts == 0 && version >= HTTPVersion(1, 1)) {
        return Err(ReadFail::Refused(Refusal::bad(
            "an HTTP/1.1 request needs exactly one Host header",
        )));
    }
    Ok(Head {
        method,
        target,
        version,
        headers,
    })
}

/// Whether the client asked that the connection end after this request.
pub(super) fn wants_close(head: &Head) -> bool {
    let tokens: Vec<String> = head
        .headers
        .iter()
        .filter(|h| h.field.equiv("Connection"))
        .flat_map(|h| {
            h.value
                .as_str()
                .split(',')
                .map(|t| t.trim().to_ascii_lowercase())
                .collect::<Vec<_>>()
        })
        .collect();
    if tokens.iter().any(|t| t == "close" || t == "upgrade") {
        return true;
    }
    head.version < HTTPVersion(1, 1) && !tokens.iter().any(|t| t == "keep-alive")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ConnectionLimits {
        ConnectionLimits::default()
    }

    fn head_of(bytes: &[u8]) -> Result<Head, ReadFail> {
        read_head(&mut io::BufReader::new(bytes), &limits())
    }

    fn status_of(bytes: &[u8]) -> Option<u16> {
        match head_of(bytes) {
            Ok(_) => None,
            Err(ReadFail::Refused(r)) => Some(r.status),
            Err(e) => panic!("{:?}", e),
        }
    }

    fn framing_of(fields: &[(&str, &str)]) -> Result<Framing, u16> {
        let headers: Vec<Header> = fields
            .iter()
            .map(|(n, v)| Header::from_bytes(n.as_bytes(), v.as_bytes()).unwrap())
            .collect();
        framing(&HTTPVersion(1, 1), &headers).map_err(|r| r.status)
    }

    #[test]
    fn a_plain_request_parses() {
        let h =
            head_of(b"\r\nPOST /v1/x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\n").unwrap();
        assert_eq!(h.method, Method::Post);
        assert_eq!(h.target, "/v1/x");
        assert_eq!(h.headers.len(), 2);
        assert_eq!(framing(&h.version, &h.headers).unwrap(), Framing::Length(5));
    }

    #[test]
    fn lines_must_end_in_crlf() {
        assert_eq!(status_of(b"GET / HTTP/1.1\nHost: a\r\n\r\n"), Some(400));
        assert_eq!(status_of(b"GET / HTTP/1.1\r\nHost: a\n\r\n"), Some(400));
        assert_eq!(
            status_of(b"GET / HTTP/1.1\r\nHost: a\rb\r\n\r\n"),
            Some(400)
        );
    }

    #[test]
    fn request_lines_are_strict() {
        assert_eq!(status_of(b"GET  / HTTP/1.1\r\nHost: a\r\n\r\n"), Some(400));
        assert_eq!(status_of(b"GET / HTTP/1.1 x\r\nHost: a\r\n\r\n"), Some(400));
        assert_eq!(status_of(b"GET / HTTP/2.0\r\nHost: a\r\n\r\n"), Some(505));
        assert_eq!(status_of(b"G(T / HTTP/1.1\r\nHost: a\r\n\r\n"), Some(400));
        assert_eq!(status_of(b"GET / http/1.1\r\nHost: a\r\n\r\n"), Some(400));
        let long = format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(20_000));
        let mut l = limits();
        l.header_line_bytes_max = 8192;
        match read_head(&mut io::BufReader::new(long.as_bytes()), &l) {
            Err(ReadFail::Refused(r)) => assert_eq!(r.status, 414),
            other => panic!("{:?}", other),
        }
    }

    #[test]
    fn header_fields_are_strict() {
        assert_eq!(status_of(b"GET / HTTP/1.1\r\nHost : a\r\n\r\n"), Some(400));
        assert_eq!(
            status_of(b"GET / HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n"),
            Some(400)
        );
        assert_eq!(
            status_of(b"GET / HTTP/1.1\r\nX: a\x01b\r\nHost: a\r\n\r\n"),
            Some(400)
        );
        assert_eq!(status_of(b"GET / HTTP/1.1\r\nnocolon\r\n\r\n"), Some(400));
        // Host: exactly one in HTTP/1.1; none is fine in HTTP/1.0.
        assert_eq!(status_of(b"GET / HTTP/1.1\r\n\r\n"), Some(400));
        assert_eq!(
            status_of(b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"),
            Some(400)
        );
        assert_eq!(status_of(b"GET / HTTP/1.0\r\n\r\n"), None);
    }

    #[test]
    fn too_many_header_bytes_are_431() {
        let mut l = limits();
        l.headers_max = 3;
        let req = b"GET / HTTP/1.1\r\nHost: a\r\nA: 1\r\nB: 2\r\nC: 3\r\n\r\n";
        match read_head(&mut io::BufReader::new(&req[..]), &l) {
            Err(ReadFail::Refused(r)) => assert_eq!(r.status, 431),
            other => panic!("{:?}", other),
        }
    }

    #[test]
    fn framing_is_strict() {
        assert_eq!(framing_of(&[]), Ok(Framing::None));
        assert_eq!(
            framing_of(&[("Content-Length", "0")]),
            Ok(Framing::Length(0))
        );
        assert_eq!(
            framing_of(&[("Transfer-Encoding", "Chunked")]),
            Ok(Framing::Chunked)
        );
        for bad in [
            vec![("Content-Length", "5"), ("Content-Length", "5")],
            vec![("Content-Length", "+5")],
            vec![("Content-Length", "-5")],
            vec![("Content-Length", "5, 5")],
            vec![("Content-Length", "0x5")],
            vec![("Content-Length", "")],
            vec![("Content-Length", "99999999999999999999999")],
            vec![("Content-Length", "18446744073709551616")],
            vec![("Transfer-Encoding", "gzip")],
            vec![("Transfer-Encoding", "gzip, chunked")],
            vec![
                ("Transfer-Encoding", "chunked"),
                ("Transfer-Encoding", "chunked"),
            ],
            vec![("Transfer-Encoding", "chunked"), ("Content-Length", "5")],
        ] {
            assert_eq!(framing_of(&bad), Err(400), "{:?}", bad);
        }
        let h = [Header::from_bytes(&b"Transfer-Encoding"[..], &b"chunked"[..]).unwrap()];
        assert!(framing(&HTTPVersion(1, 0), &h).is_err());
    }

    fn chunked(bytes: &[u8], max: usize) -> Result<Vec<u8>, Option<u16>> {
        let mut out = Vec::new();
        match read_chunked(&mut io::BufReader::new(bytes), max, &mut out) {
            Ok(()) => Ok(out),
            Err(ReadFail::Refused(r)) => Err(Some(r.status)),
            Err(_) => Err(None),
        }
    }

    #[test]
    fn chunked_bodies_are_strict() {
        assert_eq!(chunked(b"5\r\nhello\r\n0\r\n\r\n", 100).unwrap(), b"hello");
        assert_eq!(
            chunked(b"5;ext=1\r\nhello\r\n0\r\nT: x\r\n\r\n", 100).unwrap(),
            b"hello"
        );
        assert_eq!(chunked(b"10000000000000000\r\n", 100), Err(Some(400)));
        assert_eq!(chunked(b"fffffffffffffffff\r\n", 100), Err(Some(400)));
        assert_eq!(chunked(b"zz\r\n", 100), Err(Some(400)));
        assert_eq!(chunked(b"5 x\r\nhello\r\n0\r\n\r\n", 100), Err(Some(400)));
        assert_eq!(chunked(b"5\nhello\r\n0\r\n\r\n", 100), Err(Some(400)));
        assert_eq!(chunked(b"5\r\nhelloXX0\r\n\r\n", 100), Err(Some(400)));
        assert_eq!(chunked(b"65\r\n", 100), Err(Some(413)));
        assert_eq!(chunked(b"5\r\nhel", 100), Err(None));
    }

    #[test]
    fn connection_close_is_read_from_the_tokens() {
        let h =
            head_of(b"GET / HTTP/1.1\r\nHost: a\r\nConnection: keep-alive, Close\r\n\r\n").unwrap();
        assert!(wants_close(&h));
        let h = head_of(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n").unwrap();
        assert!(!wants_close(&h));
        let h = head_of(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        assert!(wants_close(&h));
        let h = head_of(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n").unwrap();
        assert!(!wants_close(&h));
    }
}
