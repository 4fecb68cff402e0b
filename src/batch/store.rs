//! Files, batches and their lines in SQLite (`rusqlite`, its bundled
//! library): WAL, every commit synced (`synchronous = FULL`), so what a
//! client was told exists survives a SIGKILL or a power cut.
//!
//! One connection behind a mutex: the handlers (uploads, lookups, scrapes)
//! and the batch runner take it for one statement or one transaction at a
//! time, never across a request's compute.

use super::{now_s, Batch, FileMeta, Line, NewBatch, Refusal, Status, StoreLimits, Stored};
use rusqlite::{params, Connection, OptionalExtension};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The database file's name under `--data-dir`.
pub const DB_FILE: &str = "sluice.db";

pub struct Store {
    conn: Mutex<Connection>,
    limits: StoreLimits,
    path: PathBuf,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, purpose TEXT NOT NULL,
    filename TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL,
    expires_at INTEGER, content BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, input_file_id TEXT NOT NULL,
    endpoint TEXT NOT NULL, completion_window TEXT NOT NULL, status TEXT NOT NULL,
    metadata TEXT, created_at INTEGER NOT NULL, in_progress_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL, finalizing_at INTEGER, completed_at INTEGER,
    cancelling_at INTEGER, cancelled_at INTEGER, expired_at INTEGER,
    output_file_id TEXT, error_file_id TEXT, total INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL,
    body TEXT NOT NULL, state TEXT NOT NULL, result TEXT,
    PRIMARY KEY (batch_id, line), UNIQUE (batch_id, custom_id));
CREATE INDEX IF NOT EXISTS lines_by_state ON lines (state, batch_id, line);
";

const BATCH_COLUMNS: &str = "id, input_file_id, endpoint, completion_window, status, metadata, \
    created_at, in_progress_at, expires_at, finalizing_at, completed_at, cancelling_at, \
    cancelled_at, expired_at, output_file_id, error_file_id, total, \
    (SELECT COUNT(*) FROM lines l WHERE l.batch_id = b.id AND l.state = 'done'), \
    (SELECT COUNT(*) FROM lines l WHERE l.batch_id = b.id AND l.state = 'failed')";

fn batch_row(r: &rusqlite::Row) -> rusqlite::Result<Batch> {
    Ok(Batch {
        id: r.get(0)?,
        input_file_id: r.get(1)?,
        endpoint: r.get(2)?,
        completion_window: r.get(3)?,
        status: Status::parse(&r.get::<_, String>(4)?),
        metadata: r.get(5)?,
        created_at: r.get(6)?,
        in_progress_at: r.get(7)?,
        expires_at: r.get(8)?,
        finalizing_at: r.get(9)?,
        completed_at: r.get(10)?,
        cancelling_at: r.get(11)?,
        cancelled_at: r.get(12)?,
        expired_at: r.get(13)?,
        output_file_id: r.get(14)?,
        error_file_id: r.get(15)?,
        total: r.get::<_, i64>(16)? as u64,
        completed: r.get::<_, i64>(17)? as u64,
        failed: r.get::<_, i64>(18)? as u64,
    })
}

fn file_row(r: &rusqlite::Row) -> rusqlite::Result<FileMeta> {
    Ok(FileMeta {
        id: r.get(0)?,
        purpose: r.get(1)?,
        filename: r.get(2)?,
        bytes: r.get::<_, i64>(3)? as u64,
        created_at: r.get(4)?,
        expires_at: r.get(5)?,
    })
}

/// A line still to run, with its batch's endpoint and owner.
const LINE_COLUMNS: &str = "SELECT l.batch_id, l.line, l.custom_id, b.endpoint, b.owner, l.body \
    FROM lines l JOIN batches b ON b.id = l.batch_id";

fn line_row(r: &rusqlite::Row) -> rusqlite::Result<Line> {
    Ok(Line {
        batch_id: r.get(0)?,
        line: r.get(1)?,
        custom_id: r.get(2)?,
        endpoint: r.get(3)?,
        owner: r.get(4)?,
        body: r.get(5)?,
    })
}

/// Every row `sql` gives, mapped by `row`; none if the query fails (a
/// lookup that fails answers as if nothing were stored).
fn rows<T>(
    conn: &Connection,
    sql: &str,
    params: impl rusqlite::Params,
    row: impl FnMut(&rusqlite::Row) -> rusqlite::Result<T>,
) -> Vec<T> {
    let Ok(mut st) = conn.prepare(sql) else {
        return Vec::new();
    };
    st.query_map(params, row)
        .map(|rows| rows.filter_map(Result::ok).collect())
        .unwrap_or_default()
}

fn failed(e: rusqlite::Error) -> Refusal {
    Refusal::Failed(e.to_string())
}

impl Store {
    /// Opens (or creates) the database in `dir`, which is created if missing.
    pub fn open(dir: &Path, limits: StoreLimits) -> Result<Store, String> {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create the data directory {}: {e}", dir.display()))?;
        let path = dir.join(DB_FILE);
        let conn =
            Connection::open(&path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        conn.execute_batch(
            "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL; PRAGMA busy_timeout = 5000;",
        )
        .and_then(|()| conn.execute_batch(SCHEMA))
        .map_err(|e| format!("cannot set up {}: {e}", path.display()))?;
        Ok(Store {
            conn: Mutex::new(conn),
            limits,
            path,
        })
    }

    pub fn limits(&self) -> &StoreLimits {
        &self.limits
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        // A panic while holding it leaves SQLite consistent (transactions
        // roll back when dropped): the lock is still good.
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn stored_bytes(conn: &Connection) -> rusqlite::Result<u64> {
        conn.query_row("SELECT COALESCE(SUM(bytes), 0) FROM files", [], |r| {
            r.get::<_, i64>(0)
        })
        .map(|b| b as u64)
    }

    /// Keeps a file for `owner`; refused when it would pass `stored_bytes_max`.
    pub fn add_file(
        &self,
        owner: &str,
        purpose: &str,
        filename: &str,
        content: &[u8],
        expires_at: Option<i64>,
    ) -> Result<FileMeta, Refusal> {
        let conn = self.conn();
        add_file(
            &conn,
            self.limits.stored_bytes_max,
            owner,
            purpose,
            filename,
            content,
            expires_at,
        )
    }

    pub fn file(&self, owner: &str, id: &str) -> Option<FileMeta> {
        self.conn()
            .query_row(
                "SELECT id, purpose, filename, bytes, created_at, expires_at FROM files \
                 WHERE id = ?1 AND owner = ?2",
                params![id, owner],
                file_row,
            )
            .optional()
            .ok()
            .flatten()
    }

    pub fn file_content(&self, owner: &str, id: &str) -> Option<Vec<u8>> {
        self.conn()
            .query_row(
                "SELECT content FROM files WHERE id = ?1 AND owner = ?2",
                params![id, owner],
                |r| r.get(0),
            )
            .optional()
            .ok()
            .flatten()
    }

    /// Removes a file; false if `owner` has no such file.
    pub fn delete_file(&self, owner: &str, id: &str) -> Result<bool, Refusal> {
        self.conn()
            .execute(
                "DELETE FROM files WHERE id = ?1 AND owner = ?2",
                params![id, owner],
            )
            .map(|n| n > 0)
            .map_err(failed)
    }

    /// `owner`'s files, newest first, at most `limit`.
    pub fn files(&self, owner: &str, purpose: Option<&str>, limit: usize) -> Vec<FileMeta> {
        rows(
            &self.conn(),
            "SELECT id, purpose, filename, bytes, created_at, expires_at FROM files \
             WHERE owner = ?1 AND (?2 IS NULL OR purpose = ?2) \
             ORDER BY created_at DESC, rowid DESC LIMIT ?3",
            params![owner, purpose, limit as i64],
            file_row,
        )
    }

    /// Accepts a batch: its lines pending, in progress at once. Refused when
    /// `batches_max` batches have not ended.
    pub fn create_batch(&self, owner: &str, new: &NewBatch) -> Result<Batch, Refusal> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(failed)?;
        let open: i64 = tx
            .query_row(
                "SELECT COUNT(*) FROM batches WHERE status NOT IN ('completed', 'expired', 'cancelled')",
                [],
                |r| r.get(0),
            )
            .map_err(failed)?;
        if open as usize >= self.limits.batches_max {
            return Err(Refusal::TooManyBatches {
                max: self.limits.batches_max,
            });
        }
        let id = super::new_id("batch_");
        let now = now_s();
        tx.execute(
            "INSERT INTO batches (id, owner, input_file_id, endpoint, completion_window, status, \
             metadata, created_at, in_progress_at, expires_at, total) \
             VALUES (?1, ?2, ?3, ?4, ?5, 'in_progress', ?6, ?7, ?7, ?8, ?9)",
            params![
                id,
                owner,
                new.input_file_id,
                new.endpoint,
                new.completion_window,
                new.metadata,
                now,
                now + new.window_s,
                new.lines.len() as i64
            ],
        )
        .map_err(failed)?;
        {
            let mut ins = tx
                .prepare(
                    "INSERT INTO lines (batch_id, line, custom_id, body, state) \
                     VALUES (?1, ?2, ?3, ?4, 'pending')",
                )
                .map_err(failed)?;
            for (i, (custom_id, body)) in new.lines.iter().enumerate() {
                ins.execute(params![id, i as i64 + 1, custom_id, body])
                    .map_err(failed)?;
            }
        }
        tx.commit().map_err(failed)?;
        drop(conn);
        self.batch(owner, &id)
            .ok_or_else(|| Refusal::Failed("the batch vanished".into()))
    }

    pub fn batch(&self, owner: &str, id: &str) -> Option<Batch> {
        self.conn()
            .query_row(
                &format!("SELECT {BATCH_COLUMNS} FROM batches b WHERE id = ?1 AND owner = ?2"),
                params![id, owner],
                batch_row,
            )
            .optional()
            .ok()
            .flatten()
    }

    /// `owner`'s batches, newest first, after the one named `after` (for
    /// paging), at most `limit`.
    pub fn batches(&self, owner: &str, after: Option<&str>, limit: usize) -> Vec<Batch> {
        let sql = format!(
            "SELECT {BATCH_COLUMNS} FROM batches b WHERE owner = ?1 AND \
             (?2 IS NULL OR rowid < (SELECT rowid FROM batches WHERE id = ?2)) \
             ORDER BY rowid DESC LIMIT ?3"
        );
        rows(
            &self.conn(),
            &sql,
            params![owner, after, limit as i64],
            batch_row,
        )
    }

    /// Asks a batch in progress to stop: `cancelling` until its lines
    /// running now end, then `cancelled`. `None` if `owner` has no such batch.
    pub fn cancel(&self, owner: &str, id: &str) -> Result<Option<Batch>, Refusal> {
        self.conn()
            .execute(
                "UPDATE batches SET status = 'cancelling', cancelling_at = ?3 \
                 WHERE id = ?1 AND owner = ?2 AND status = 'in_progress'",
                params![id, owner, now_s()],
            )
            .map_err(failed)?;
        Ok(self.batch(owner, id))
    }

    /// Up to `n` pending lines of batches in progress, oldest batch first and
    /// in file order, leaving out those in `running`.
    pub fn pending(&self, running: &[(String, i64)], n: usize) -> Vec<Line> {
        let sql = format!(
            "{LINE_COLUMNS} WHERE l.state = 'pending' AND b.status = 'in_progress' \
             ORDER BY b.rowid, l.line LIMIT ?1"
        );
        let lines = rows(
            &self.conn(),
            &sql,
            params![(n + running.len()) as i64],
            line_row,
        );
        lines
            .into_iter()
            .filter(|l| {
                !running
                    .iter()
                    .any(|(b, n)| *b == l.batch_id && *n == l.line)
            })
            .take(n)
            .collect()
    }

    /// A line's result (`ok`: the output file's line, else the error file's),
    /// kept only if the line was still pending: true if it was. So a line has
    /// one result, whatever ran it twice.
    pub fn record(&self, batch_id: &str, line: i64, ok: bool, result: &str) -> bool {
        let state = if ok { "done" } else { "failed" };
        self.conn()
            .execute(
                "UPDATE lines SET state = ?3, result = ?4 \
                 WHERE batch_id = ?1 AND line = ?2 AND state = 'pending'",
                params![batch_id, line, state, result],
            )
            .is_ok_and(|n| n == 1)
    }

    /// Batches that must move on: cancelling, past their window, or in
    /// progress with no line pending. With the lines still pending of the
    /// first two (which the caller fails, then finalizes).
    pub fn to_settle(&self, now: i64) -> Vec<(Batch, Vec<Line>)> {
        let ids: Vec<(String, String)> = rows(
            &self.conn(),
            "SELECT id, owner FROM batches b WHERE status = 'cancelling' \
             OR (status = 'in_progress' AND (expires_at <= ?1 OR NOT EXISTS \
             (SELECT 1 FROM lines l WHERE l.batch_id = b.id AND l.state = 'pending')))",
            params![now],
            |r| Ok((r.get(0)?, r.get(1)?)),
        );
        ids.into_iter()
            .filter_map(|(id, owner)| {
                let b = self.batch(&owner, &id)?;
                let sql = format!(
                    "{LINE_COLUMNS} WHERE l.batch_id = ?1 AND l.state = 'pending' ORDER BY l.line"
                );
                let lines = rows(&self.conn(), &sql, params![b.id], line_row);
                Some((b, lines))
            })
            .collect()
    }

    /// Ends a batch none of whose lines is pending: its results become its
    /// output file (lines that ran) and error file (lines that failed), in
    /// input order, and its status `end` (completed, cancelled or expired).
    /// Done in one transaction: a crash leaves it unfinalized, to be done again.
    pub fn finalize(&self, batch_id: &str, end: Status) -> Result<(), Refusal> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(failed)?;
        let owner: String = tx
            .query_row(
                "SELECT owner FROM batches WHERE id = ?1",
                params![batch_id],
                |r| r.get(0),
            )
            .map_err(failed)?;
        let mut files = [None, None];
        for (slot, (state, name)) in [("done", "output"), ("failed", "error")]
            .into_iter()
            .enumerate()
        {
            let mut text = String::new();
            {
                let mut st = tx
                    .prepare(
                        "SELECT result FROM lines WHERE batch_id = ?1 AND state = ?2 ORDER BY line",
                    )
                    .map_err(failed)?;
                let rows = st
                    .query_map(params![batch_id, state], |r| r.get::<_, String>(0))
                    .map_err(failed)?;
                for r in rows {
                    text.push_str(&r.map_err(failed)?);
                    text.push('\n');
                }
            }
            if !text.is_empty() {
                // Results are kept whatever the byte bound says: the work is done.
                let f = add_file(
                    &tx,
                    u64::MAX,
                    &owner,
                    "batch_output",
                    &format!("{batch_id}_{name}.jsonl"),
                    text.as_bytes(),
                    Some(now_s() + self.limits.retention_s),
                )?;
                files[slot] = Some(f.id);
            }
        }
        let now = now_s();
        let column = match end {
            Status::Cancelled => "cancelled_at",
            Status::Expired => "expired_at",
            _ => "completed_at",
        };
        tx.execute(
            &format!(
                "UPDATE batches SET status = ?2, finalizing_at = ?3, {column} = ?3, \
                 output_file_id = ?4, error_file_id = ?5 WHERE id = ?1"
            ),
            params![batch_id, end.name(), now, files[0], files[1]],
        )
        .map_err(failed)?;
        tx.commit().map_err(failed)
    }

    /// Removes files past their `expires_at`, and ended batches (with their
    /// lines) ended more than the retention ago. Returns how many of each.
    pub fn remove_expired(&self, now: i64) -> (usize, usize) {
        let conn = self.conn();
        let files = conn
            .execute(
                "DELETE FROM files WHERE expires_at IS NOT NULL AND expires_at <= ?1",
                params![now],
            )
            .unwrap_or(0);
        let before = now - self.limits.retention_s;
        let _ = conn.execute(
            "DELETE FROM lines WHERE batch_id IN (SELECT id FROM batches WHERE \
             COALESCE(completed_at, cancelled_at, expired_at) <= ?1)",
            params![before],
        );
        let batches = conn
            .execute(
                "DELETE FROM batches WHERE COALESCE(completed_at, cancelled_at, expired_at) <= ?1",
                params![before],
            )
            .unwrap_or(0);
        (files, batches)
    }

    /// What is stored, by status and state.
    pub fn stored(&self) -> Stored {
        let conn = self.conn();
        let mut s = Stored::default();
        if let Ok(mut st) = conn.prepare("SELECT status, COUNT(*) FROM batches GROUP BY status") {
            let rows = st.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)));
            for (status, n) in rows.into_iter().flatten().flatten() {
                let i = Status::ALL
                    .iter()
                    .position(|st| st.name() == status)
                    .unwrap_or(0);
                s.batches[i] += n as u64;
            }
        }
        if let Ok(mut st) = conn.prepare("SELECT state, COUNT(*) FROM lines GROUP BY state") {
            let rows = st.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)));
            for (state, n) in rows.into_iter().flatten().flatten() {
                match state.as_str() {
                    "pending" => s.lines_pending = n as u64,
                    "done" => s.lines_done = n as u64,
                    _ => s.lines_failed += n as u64,
                }
            }
        }
        s.files = conn
            .query_row("SELECT COUNT(*) FROM files", [], |r| r.get::<_, i64>(0))
            .unwrap_or(0) as u64;
        s.bytes = Self::stored_bytes(&conn).unwrap_or(0);
        s
    }
}

/// Inserts a file on `conn` (a connection or a transaction), if the bytes
/// stored stay within `max`.
fn add_file(
    conn: &Connection,
    max: u64,
    owner: &str,
    purpose: &str,
    filename: &str,
    content: &[u8],
    expires_at: Option<i64>,
) -> Result<FileMeta, Refusal> {
    let stored = Store::stored_bytes(conn).map_err(failed)?;
    if stored.saturating_add(content.len() as u64) > max {
        return Err(Refusal::StorageFull { stored, max });
    }
    let meta = FileMeta {
        id: super::new_id("file-"),
        purpose: purpose.to_string(),
        filename: filename.to_string(),
        bytes: content.len() as u64,
        created_at: now_s(),
        expires_at,
    };
    conn.execute(
        "INSERT INTO files (id, owner, purpose, filename, bytes, created_at, expires_at, content) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
        params![
            meta.id,
            owner,
            meta.purpose,
            meta.filename,
            meta.bytes as i64,
            meta.created_at,
            meta.expires_at,
            content
        ],
    )
    .map_err(failed)?;
    Ok(meta)
}
