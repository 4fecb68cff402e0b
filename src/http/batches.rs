//! OpenAI's Batch API over the store (`batch::Store`): `/v1/files` (upload,
//! list, get, content, delete) and `/v1/batches` (create, list, get,
//! cancel), in OpenAI's shapes. A batch's lines run later, on capacity the
//! interactive traffic leaves (`batch_runner`).
//!
//! With `--api-key-file`, files and batches belong to the key that made
//! them (by its name) and no other key sees them; without, to everyone.

use super::batch_input::{self, too_many_lines};
use super::error::ApiError;
use super::{header, intake, log_refusal, respond_error, respond_json, AppState};
use crate::batch::{Batch, FileMeta, NewBatch, Refusal, Store};
use serde_json::{json, Value};
use std::sync::Arc;
use tiny_http::{Method, Request, Response};

/// The endpoints a batch may name.
pub const ENDPOINTS: [&str; 3] = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"];
/// The completion window a batch may give (OpenAI takes only this one).
pub const COMPLETION_WINDOW: &str = "24h";
const COMPLETION_WINDOW_S: i64 = 24 * 3600;
/// Most objects a list returns, and how many without `limit`.
const LIST_MAX: usize = 100;
const LIST_DEFAULT: usize = 20;
/// Paths whose bodies may be as large as `--batch-file-bytes-max`.
pub const UPLOAD_PATHS: &[&str] = &["/v1/files"];
/// Room for a multipart body's boundaries and part headers around the file.
pub const UPLOAD_OVERHEAD_BYTES: usize = 64 * 1024;
/// Uploads read at once (each held in memory until stored).
pub const UPLOADS_AT_ONCE: usize = 2;

/// The Batch API's store, and the runner's wake-up (a batch was created).
pub struct BatchApi {
    pub store: Arc<Store>,
    pub wake: crossbeam_channel::Sender<()>,
    /// The lines in flight, which give way to interactive requests.
    pub preemption: super::batch_runner::Preemption,
}

pub(super) fn is_route(path: &str) -> bool {
    ["/v1/files", "/v1/batches"]
        .iter()
        .any(|p| path == *p || path.strip_prefix(p).is_some_and(|r| r.starts_with('/')))
}

enum Reply {
    Json(u16, Value),
    Bytes(Vec<u8>),
}

/// Answers one request to `/v1/files...` or `/v1/batches...`.
pub(super) fn handle(state: &AppState, mut req: Request, method: &Method, path: &str) {
    match reply(state, &mut req, method, path) {
        Ok(Reply::Json(status, body)) => respond_json(req, status, &body),
        Ok(Reply::Bytes(bytes)) => {
            let resp = Response::from_data(bytes)
                .with_header(header("Content-Type", "application/octet-stream"));
            let _ = req.respond(resp);
        }
        Err(e) => {
            log_refusal(&req, &e);
            respond_error(req, &e);
        }
    }
}

fn off() -> ApiError {
    ApiError::Batch {
        status: 404,
        code: "batch_api_off",
        message: "the Batch API is off on this server (--data-dir off)".into(),
    }
}

fn missing(what: &str, id: &str) -> ApiError {
    ApiError::Batch {
        status: 404,
        code: "not_found",
        message: format!("no {what} '{id}'"),
    }
}

impl From<Refusal> for ApiError {
    fn from(r: Refusal) -> ApiError {
        match r {
            Refusal::StorageFull { stored, max } => ApiError::Batch {
                status: 429,
                code: "storage_full",
                message: format!(
                    "the server keeps {stored} bytes of files and may keep {max} (--data-bytes-max); \
                     delete files, or wait for old ones to be removed"
                ),
            },
            Refusal::TooManyBatches { max } => ApiError::Batch {
                status: 429,
                code: "too_many_batches",
                message: format!(
                    "{max} batches have not ended, the most this server holds (--batches-max); \
                     retry when one has"
                ),
            },
            Refusal::Failed(e) => ApiError::Batch {
                status: 500,
                code: "storage_error",
                message: format!("the batch store failed: {e}"),
            },
        }
    }
}

fn reply(
    state: &AppState,
    req: &mut Request,
    method: &Method,
    path: &str,
) -> Result<Reply, ApiError> {
    let api = state.batches.as_ref().ok_or_else(off)?;
    let client = intake::authenticate(state, req)?;
    let owner = match state.cfg.api_keys {
        Some(_) => client.label,
        None => String::new(),
    };
    let query = req.url().split_once('?').map_or("", |(_, q)| q).to_string();
    let parts: Vec<&str> = path.trim_start_matches("/v1/").split('/').collect();
    let store = &api.store;
    let json = |v| Ok(Reply::Json(200, v));
    match (method, parts.as_slice()) {
        (Method::Post, ["files"]) => json(file_json(&upload(store, &owner, req)?)),
        (Method::Get, ["files"]) => {
            let purpose = param(&query, "purpose");
            let files = store.files(&owner, purpose.as_deref(), limit(&query)?);
            json(list_json(files.iter().map(file_json).collect()))
        }
        (Method::Get, ["files", id]) => json(file_json(
            &store.file(&owner, id).ok_or_else(|| missing("file", id))?,
        )),
        (Method::Get, ["files", id, "content"]) => Ok(Reply::Bytes(
            store
                .file_content(&owner, id)
                .ok_or_else(|| missing("file", id))?,
        )),
        (Method::Delete, ["files", id]) => match store.delete_file(&owner, id)? {
            true => json(json!({"id": id, "object": "file", "deleted": true})),
            false => Err(missing("file", id)),
        },
        (Method::Post, ["batches"]) => {
            let b = create(state, api, &owner, req)?;
            Ok(Reply::Json(200, batch_json(&b)))
        }
        (Method::Get, ["batches"]) => {
            let after = param(&query, "after");
            let batches = store.batches(&owner, after.as_deref(), limit(&query)?);
            json(list_json(batches.iter().map(batch_json).collect()))
        }
        (Method::Get, ["batches", id]) => json(batch_json(
            &store
                .batch(&owner, id)
                .ok_or_else(|| missing("batch", id))?,
        )),
        (Method::Post, ["batches", id, "cancel"]) => {
            let b = store
                .cancel(&owner, id)?
                .ok_or_else(|| missing("batch", id))?;
            let _ = api.wake.try_send(());
            json(batch_json(&b))
        }
        _ => Err(ApiError::MethodNotAllowed {
            method: method.to_string(),
            path: path.to_string(),
        }),
    }
}

fn param(query: &str, key: &str) -> Option<String> {
    query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v.to_string())
}

fn limit(query: &str) -> Result<usize, ApiError> {
    match param(query, "limit") {
        None => Ok(LIST_DEFAULT),
        Some(v) => v
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=LIST_MAX).contains(n))
            .ok_or_else(|| ApiError::invalid("limit", format!("limit must be 1 to {LIST_MAX}"))),
    }
}

/// `POST /v1/files`: a multipart body with `purpose` (batch) and `file`.
fn upload(store: &Store, owner: &str, req: &mut Request) -> Result<FileMeta, ApiError> {
    let content_type = req
        .headers()
        .iter()
        .find(|h| h.field.equiv("Content-Type"))
        .map(|h| h.value.as_str().to_string())
        .unwrap_or_default();
    let boundary = batch_input::boundary(&content_type)?;
    let mut body = Vec::new();
    req.as_reader()
        .read_to_end(&mut body)
        .map_err(|e| ApiError::invalid("file", format!("the body could not be read: {e}")))?;
    let parts = batch_input::parts(&body, &boundary)?;
    let field = |name: &str| parts.iter().find(|p| p.name == name);
    let purpose = field("purpose").map(|p| String::from_utf8_lossy(p.data).into_owned());
    if purpose.as_deref() != Some("batch") {
        return Err(ApiError::invalid("purpose", "purpose must be \"batch\""));
    }
    let file = field("file").ok_or_else(|| ApiError::invalid("file", "no file part"))?;
    let limits = store.limits();
    if file.data.len() > limits.file_bytes_max {
        return Err(ApiError::Batch {
            status: 413,
            code: "file_too_large",
            message: format!(
                "the file has {} bytes; the most a file may have is {} (--batch-file-bytes-max)",
                file.data.len(),
                limits.file_bytes_max
            ),
        });
    }
    if file
        .data
        .split(|&b| b == b'\n')
        .filter(|l| !l.trim_ascii().is_empty())
        .count()
        > limits.lines_max
    {
        return Err(too_many_lines(limits.lines_max));
    }
    let name = file
        .filename
        .clone()
        .unwrap_or_else(|| "upload.jsonl".into());
    Ok(store.add_file(owner, "batch", &name, file.data, None)?)
}

/// `POST /v1/batches`: the input file checked line by line, then the batch
/// kept with every line pending.
fn create(
    state: &AppState,
    api: &BatchApi,
    owner: &str,
    req: &mut Request,
) -> Result<Batch, ApiError> {
    if state.stopping.load(std::sync::atomic::Ordering::Relaxed) {
        return Err(ApiError::Draining);
    }
    let body = intake::json_body(state, req)?;
    let v: Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::invalid("body", format!("not JSON: {e}")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| ApiError::invalid("body", "not a JSON object"))?;
    if let Some(k) = obj.keys().find(|k| {
        !["input_file_id", "endpoint", "completion_window", "metadata"].contains(&k.as_str())
    }) {
        return Err(ApiError::invalid(
            k.as_str(),
            format!("unknown field '{k}'"),
        ));
    }
    let text = |k: &str| obj.get(k).and_then(Value::as_str).unwrap_or("");
    let endpoint = text("endpoint");
    if !ENDPOINTS.contains(&endpoint) {
        return Err(ApiError::invalid(
            "endpoint",
            format!("endpoint must be one of {ENDPOINTS:?}"),
        ));
    }
    if text("completion_window") != COMPLETION_WINDOW {
        return Err(ApiError::invalid(
            "completion_window",
            "completion_window must be \"24h\"",
        ));
    }
    let metadata = match obj.get("metadata") {
        None | Some(Value::Null) => None,
        Some(m @ Value::Object(o)) if o.values().all(Value::is_string) && o.len() <= 16 => {
            Some(m.to_string())
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "metadata",
                "metadata is up to 16 string values",
            ))
        }
    };
    let input = text("input_file_id");
    let content = api
        .store
        .file_content(owner, input)
        .ok_or_else(|| missing("file", input))?;
    let lines = batch_input::lines(
        &content,
        endpoint,
        api.store.limits().lines_max,
        state.n_embd,
    )?;
    let new = NewBatch {
        input_file_id: input.to_string(),
        endpoint: endpoint.to_string(),
        completion_window: COMPLETION_WINDOW.to_string(),
        window_s: COMPLETION_WINDOW_S,
        metadata,
        lines,
    };
    let b = api.store.create_batch(owner, &new)?;
    let _ = api.wake.try_send(());
    Ok(b)
}

fn list_json(data: Vec<Value>) -> Value {
    json!({
        "object": "list",
        "first_id": data.first().map(|d| d["id"].clone()),
        "last_id": data.last().map(|d| d["id"].clone()),
        "has_more": false,
        "data": data,
    })
}

fn file_json(f: &FileMeta) -> Value {
    json!({
        "id": f.id, "object": "file", "bytes": f.bytes, "created_at": f.created_at,
        "expires_at": f.expires_at, "filename": f.filename, "purpose": f.purpose,
        "status": "processed", "status_details": null,
    })
}

pub(super) fn batch_json(b: &Batch) -> Value {
    let metadata = b
        .metadata
        .as_deref()
        .and_then(|m| serde_json::from_str::<Value>(m).ok());
    json!({
        "id": b.id, "object": "batch", "endpoint": b.endpoint, "errors": null,
        "input_file_id": b.input_file_id, "completion_window": b.completion_window,
        "status": b.status.name(), "output_file_id": b.output_file_id,
        "error_file_id": b.error_file_id, "created_at": b.created_at,
        "in_progress_at": b.in_progress_at, "expires_at": b.expires_at,
        "finalizing_at": b.finalizing_at, "completed_at": b.completed_at,
        "failed_at": null, "expired_at": b.expired_at, "cancelling_at": b.cancelling_at,
        "cancelled_at": b.cancelled_at,
        "request_counts": {"total": b.total, "completed": b.completed, "failed": b.failed},
        "metadata": metadata,
    })
}
