//! The model file: checked for the usual mistakes before llama.cpp loads it.

use crate::ffi::Model;

/// GGUF files start with these four bytes.
const GGUF_MAGIC: &[u8; 4] = b"GGUF";
/// Smaller than any real GGUF header plus tensor data.
const GGUF_BYTES_MIN: u64 = 1024;

/// Checks the model file for the usual mistakes (missing, not GGUF, cut short),
/// with a message that says which, then loads it.
pub fn load_model(path: &std::path::Path, mmap: bool) -> Result<Model, String> {
    use std::io::Read;
    let meta = std::fs::metadata(path).map_err(|e| {
        format!(
            "model file {}: {e}. Fetch the default model with 'models/fetch', or pass --model PATH",
            path.display()
        )
    })?;
    if !meta.is_file() {
        return Err(format!("model path {} is not a file", path.display()));
    }
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .map_err(|e| format!("cannot read model file {}: {e}", path.display()))?;
    if &magic != GGUF_MAGIC {
        return Err(format!(
            "{} is not a GGUF file (it starts with {:02x?}, not \"GGUF\")",
            path.display(),
            magic
        ));
    }
    if meta.len() < GGUF_BYTES_MIN {
        return Err(format!(
            "{} has only {} bytes: the file is truncated",
            path.display(),
            meta.len()
        ));
    }
    Model::load(path, mmap).map_err(|e| format!("{e}; the file may be truncated or corrupt"))
}
