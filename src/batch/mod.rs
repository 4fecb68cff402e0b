//! Offline work kept on disk: uploaded files and batches of requests, in one
//! SQLite database under `--data-dir` (`store`). This floor knows rows and
//! states, not HTTP: `http::batches` gives them OpenAI's shapes, and
//! `http::batch_runner` runs the lines through the same handlers, admission
//! and engine as every other request, in the batch class.
//!
//! What makes a batch safe to kill: a line's result is written in the same
//! transaction that marks it done, and only if it was still pending, so a
//! line cut off mid-run (SIGKILL, a power cut) is pending at the next start
//! and runs again, and no line ever gets two results. A batch's output and
//! error files are built from those rows once none is pending.

pub mod store;
#[cfg(test)]
mod tests;

pub use store::Store;

/// Every bound on what the store holds.
#[derive(Debug, Clone, Copy)]
pub struct StoreLimits {
    /// Largest uploaded file (`--batch-file-bytes-max`).
    pub file_bytes_max: usize,
    /// Most lines in a batch's input file (`--batch-lines-max`).
    pub lines_max: usize,
    /// Most batches not yet ended (`--batches-max`).
    pub batches_max: usize,
    /// Most bytes of files kept, uploads and results together
    /// (`--data-bytes-max`).
    pub stored_bytes_max: u64,
    /// How long files and ended batches are kept, in seconds
    /// (`--batch-retention-hours`).
    pub retention_s: i64,
}

/// A batch's state, OpenAI's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    InProgress,
    Finalizing,
    Completed,
    Expired,
    Cancelling,
    Cancelled,
}

impl Status {
    pub const ALL: [Status; 6] = [
        Status::InProgress,
        Status::Finalizing,
        Status::Completed,
        Status::Expired,
        Status::Cancelling,
        Status::Cancelled,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Status::InProgress => "in_progress",
            Status::Finalizing => "finalizing",
            Status::Completed => "completed",
            Status::Expired => "expired",
            Status::Cancelling => "cancelling",
            Status::Cancelled => "cancelled",
        }
    }

    fn parse(s: &str) -> Status {
        Status::ALL
            .into_iter()
            .find(|st| st.name() == s)
            .unwrap_or(Status::InProgress)
    }

    /// Nothing more happens to an ended batch.
    pub fn ended(self) -> bool {
        matches!(
            self,
            Status::Completed | Status::Expired | Status::Cancelled
        )
    }
}

/// An uploaded or generated file, without its content.
#[derive(Debug, Clone, PartialEq)]
pub struct FileMeta {
    pub id: String,
    pub purpose: String,
    pub filename: String,
    pub bytes: u64,
    pub created_at: i64,
    pub expires_at: Option<i64>,
}

/// What a new batch holds: its input, validated, one entry per line.
#[derive(Debug, Clone)]
pub struct NewBatch {
    pub input_file_id: String,
    pub endpoint: String,
    pub completion_window: String,
    pub window_s: i64,
    /// JSON text of the batch's `metadata`, or none.
    pub metadata: Option<String>,
    /// `(custom_id, request body as JSON text)`, in the file's order.
    pub lines: Vec<(String, String)>,
}

/// A batch as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub id: String,
    pub input_file_id: String,
    pub endpoint: String,
    pub completion_window: String,
    pub status: Status,
    pub metadata: Option<String>,
    pub created_at: i64,
    pub in_progress_at: i64,
    pub expires_at: i64,
    pub finalizing_at: Option<i64>,
    pub completed_at: Option<i64>,
    pub cancelling_at: Option<i64>,
    pub cancelled_at: Option<i64>,
    pub expired_at: Option<i64>,
    pub output_file_id: Option<String>,
    pub error_file_id: Option<String>,
    pub total: u64,
    pub completed: u64,
    pub failed: u64,
}

/// A line still to run.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    pub batch_id: String,
    /// Its line number in the input file, from 1.
    pub line: i64,
    pub custom_id: String,
    pub endpoint: String,
    /// The key name of the batch's owner ("" without API keys).
    pub owner: String,
    pub body: String,
}

/// Why the store said no.
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal {
    /// `--data-bytes-max` would be passed.
    StorageFull { stored: u64, max: u64 },
    /// `--batches-max` batches have not ended.
    TooManyBatches { max: usize },
    /// The database failed (disk full, ...).
    Failed(String),
}

/// What the store holds, for `/metrics` and the status page.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stored {
    /// Batches per status, in `Status::ALL`'s order.
    pub batches: [u64; 6],
    pub lines_pending: u64,
    pub lines_done: u64,
    pub lines_failed: u64,
    pub files: u64,
    pub bytes: u64,
}

/// Seconds since the Unix epoch, as OpenAI's objects count time.
pub fn now_s() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// A fresh id with OpenAI's prefixes (`file-`, `batch_`, `batch_req_`): 24
/// random characters, unique enough for one box's lifetime of uploads.
pub fn new_id(prefix: &str) -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let mut rng = fastrand::Rng::new();
    let tail: String = (0..24)
        .map(|_| ALPHABET[rng.usize(..ALPHABET.len())] as char)
        .collect();
    format!("{prefix}{tail}")
}
