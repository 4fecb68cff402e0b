use std::io::Read;
use std::io::Result as IoResult;
use std::sync::mpsc::sync_channel;
use std::sync::mpsc::{Receiver, SyncSender};

/// sluice patch: the most of an unread body that is drained to keep a
/// connection alive.
const DRAIN_BYTES_MAX: usize = 1024 * 1024;
/// Buffer used to read and discard an unread body (sluice patch).
const DRAIN_BUFFER_BYTES: usize = 64 * 1024;

/// A `Reader` that reads exactly the number of bytes from a sub-reader.
///
/// If the limit is reached, it returns EOF. If the limit is not reached
/// when the destructor is called, the remaining bytes will be read and
/// thrown away.
pub struct EqualReader<R>
where
    R: Read,
{
    reader: R,
    size: usize,
    // sluice patch: bounded (upstream's was an unbounded channel); a signal
    // nobody has room for is dropped, never waited for.
    last_read_signal: SyncSender<IoResult<()>>,
}

impl<R> EqualReader<R>
where
    R: Read,
{
    pub fn new(reader: R, size: usize) -> (EqualReader<R>, Receiver<IoResult<()>>) {
        let (tx, rx) = sync_channel(1);

        let r = EqualReader {
            reader,
            size,
            last_read_signal: tx,
        };

        (r, rx)
    }
}

impl<R> Read for EqualReader<R>
where
    R: Read,
{
    fn read(&mut self, buf: &mut [u8]) -> IoResult<usize> {
        if self.size == 0 {
            return Ok(0);
        }

        let buf = if buf.len() < self.size {
            buf
        } else {
            &mut buf[..self.size]
        };

        match self.reader.read(buf) {
            Ok(len) => {
                self.size -= len;
                Ok(len)
            }
            err @ Err(_) => err,
        }
    }
}

impl<R> Drop for EqualReader<R>
where
    R: Read,
{
    fn drop(&mut self) {
        let mut remaining_to_read = self.size;
        // sluice patch: a body too large to be worth reading (one the server
        // refused from its Content-Length) is not drained at all: the connection
        // is closed instead, so a client cannot hold the thread by sending it.
        if remaining_to_read > DRAIN_BYTES_MAX {
            let e = std::io::Error::new(std::io::ErrorKind::Other, "request body not drained");
            self.last_read_signal.try_send(Err(e)).ok();
            return;
        }
        // sluice patch: drain through a fixed buffer. Upstream allocated the whole
        // remaining declared length at once, so one request declaring a huge
        // Content-Length made the server allocate that much when it was refused.
        let mut buf = vec![0; remaining_to_read.min(DRAIN_BUFFER_BYTES)];

        while remaining_to_read > 0 {
            let want = remaining_to_read.min(buf.len());
            let buf = &mut buf[..want];

            match self.reader.read(buf) {
                Err(e) => {
                    self.last_read_signal.try_send(Err(e)).ok();
                    break;
                }
                Ok(0) => {
                    self.last_read_signal.try_send(Ok(())).ok();
                    break;
                }
                Ok(other) => {
                    remaining_to_read -= other;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::EqualReader;
    use std::io::Read;

    #[test]
    fn test_limit() {
        use std::io::Cursor;

        let mut org_reader = Cursor::new("hello world".to_string().into_bytes());

        {
            let (mut equal_reader, _) = EqualReader::new(org_reader.by_ref(), 5);

            let mut string = String::new();
            equal_reader.read_to_string(&mut string).unwrap();
            assert_eq!(string, "hello");
        }

        let mut string = String::new();
        org_reader.read_to_string(&mut string).unwrap();
        assert_eq!(string, " world");
    }

    #[test]
    fn test_not_enough() {
        use std::io::Cursor;

        let mut org_reader = Cursor::new("hello world".to_string().into_bytes());

        {
            let (mut equal_reader, _) = EqualReader::new(org_reader.by_ref(), 5);

            let mut vec = [0];
            equal_reader.read_exact(&mut vec).unwrap();
            assert_eq!(vec[0], b'h');
        }

        let mut string = String::new();
        org_reader.read_to_string(&mut string).unwrap();
        assert_eq!(string, " world");
    }
}
