//! Anchors at scale: written from the caller's tensors straight into a file, hashed (SHA-256) on the way, and read
//! back through a memory map, so neither side holds a second copy of the whole state.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::core::diff::{self, FullInput};
use crate::core::digest;
use crate::core::error::{Error, Result};
use crate::core::format;
use crate::core::stream::{Backing, Stream};
use crate::core::Delta;

/// Bytes hashed on one thread while the other writes them.
const CHUNK_BYTES: usize = 8 << 20;

/// What `write_anchor` wrote: the file's size and SHA-256, and the state digest of its tensors (core::digest).
pub struct Written {
    pub size: u64,
    pub sha256: [u8; 32],
    pub state_digest: String,
}

/// A caller's bytes lent to a `Delta` that never outlives `write_anchor`'s call, so that `format::encode` lays out
/// the very file `to_bytes` would give without copying a tensor.
struct Lent {
    ptr: *const u8,
    len: usize,
}

// SAFETY: `Lent` is only read, and only while `write_anchor` holds the `&[u8]` it was made from.
unsafe impl Send for Lent {}
unsafe impl Sync for Lent {}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: made from a live `&[u8]` of this length, which outlives every use (see `write_anchor`).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// A writer that hashes what it writes with SHA-256, and each tensor's bytes with its state-digest hash when they
/// pass whole (`write_to` hands over each piece as the very slice it was lent, before any buffering); large writes
/// are hashed and written side by side, chunk by chunk.
struct Hashing<'a, 'b, W: Write> {
    inner: W,
    sha256: Sha256,
    size: u64,
    inputs: &'a [FullInput<'b>],
    /// Tensors not yet seen, by the address and length of their bytes (aliased tensors queue under one key).
    pending: HashMap<(usize, usize), Vec<usize>>,
    tensor_hashes: Vec<Option<u128>>,
}

impl<W: Write + Send> Write for Hashing<'_, '_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let tensor = self.pending.get_mut(&(buf.as_ptr() as usize, buf.len())).and_then(Vec::pop);
        let mut tensor_hasher = tensor.map(|index| {
            let input = &self.inputs[index];
            digest::tensor_hasher(input.dtype, &input.shape)
        });
        for chunk in buf.chunks(CHUNK_BYTES) {
            let (sha256, inner, hasher) = (&mut self.sha256, &mut self.inner, &mut tensor_hasher);
            let hash = || {
                sha256.update(chunk);
                if let Some(hasher) = hasher.as_mut() {
                    hasher.update(chunk);
                }
            };
            let ((), written) = rayon::join(hash, || inner.write_all(chunk));
            written?;
        }
        if let (Some(index), Some(hasher)) = (tensor, tensor_hasher) {
            self.tensor_hashes[index] = Some(hasher.digest128());
        }
        self.size += buf.len() as u64;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Writes the anchor of `inputs` (the bytes `format::to_bytes` gives for `diff::full(inputs)` with this step and
/// metadata) into the file at `path`, truncating it, and returns its size, SHA-256 and state digest, all three
/// hashed in the same pass. Each tensor is copied once, from its own memory into the file; nothing the size of the
/// state is allocated. The caller keeps `inputs` unchanged until this returns, and makes the file durable (fsync)
/// where it needs to.
pub fn write_anchor(
    inputs: &[FullInput<'_>],
    step: Option<u64>,
    metadata: &BTreeMap<String, String>,
    path: &Path,
) -> Result<Written> {
    let tensors = inputs
        .iter()
        .map(|input| {
            let lent = Backing::Borrowed(Box::new(Lent { ptr: input.data.as_ptr(), len: input.data.len() }));
            diff::whole(input, Stream::Shared { backing: Arc::new(lent), range: 0..input.data.len() })
        })
        .collect::<Result<Vec<_>>>()?;
    let delta = Delta { tensors, step, base_step: None, metadata: metadata.clone(), packed: false };
    let encoded = format::encode(&delta)?;
    let file = std::fs::OpenOptions::new().write(true).truncate(true).open(path).map_err(|e| Error::io(path, e))?;
    let mut pending: HashMap<(usize, usize), Vec<usize>> = HashMap::new();
    for (index, input) in inputs.iter().enumerate() {
        pending.entry((input.data.as_ptr() as usize, input.data.len())).or_default().push(index);
    }
    let mut writer = Hashing {
        inner: std::io::BufWriter::with_capacity(1 << 20, file),
        sha256: Sha256::new(),
        size: 0,
        inputs,
        pending,
        tensor_hashes: vec![None; inputs.len()],
    };
    crate::core::pool::install(|| encoded.write_to(&mut writer).and_then(|()| writer.flush()))
        .map_err(|e| Error::io(path, e))?;
    // `delta` (and the lent windows in it) ends here, while `inputs` is still borrowed.
    drop(encoded);
    drop(delta);
    // Empty tensors are never written, so never seen: their hash is their dtype and shape alone.
    let named: Vec<(&str, u128)> = inputs
        .iter()
        .zip(&writer.tensor_hashes)
        .map(|(input, hash)| {
            let hash = hash.unwrap_or_else(|| {
                let mut hasher = digest::tensor_hasher(input.dtype, &input.shape);
                hasher.update(input.data);
                hasher.digest128()
            });
            (input.name.as_str(), hash)
        })
        .collect();
    Ok(Written { size: writer.size, sha256: writer.sha256.finalize().into(), state_digest: digest::combine(&named) })
}

/// Reads and validates a delta file through a read-only memory map: a tensor stored whole stays a window onto the
/// file, and core::apply drops its pages as it copies them, so applying an anchor holds little of it at a time.
/// The file must not change while the delta lives (give it a private copy, e.g. one already checked by SHA-256).
pub fn load_mapped(path: &Path) -> Result<Delta> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: read-only mapping of a file the caller keeps unchanged (see above).
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    format::read(Arc::new(Backing::Mapped(map)), &path.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::dtype::Dtype;

    fn inputs(data: &[Vec<u8>]) -> Vec<FullInput<'_>> {
        data.iter()
            .enumerate()
            .map(|(i, bytes)| FullInput {
                name: format!("t{i}"),
                dtype: if i % 2 == 0 { Dtype::BF16 } else { Dtype::F32 },
                shape: vec![(bytes.len() / if i % 2 == 0 { 2 } else { 4 }) as u64],
                data: bytes,
            })
            .collect()
    }

    #[test]
    fn same_bytes_as_to_bytes_and_hash_matches() {
        let data: Vec<Vec<u8>> = [8usize, 4000, 3 * CHUNK_BYTES + 12]
            .iter()
            .map(|&n| (0..n).map(|i| (i * 7 % 251) as u8).collect())
            .collect();
        let inputs = inputs(&data);
        let metadata = BTreeMap::from([("who".to_owned(), "test".to_owned())]);
        let expected = format::to_bytes(&Delta {
            tensors: diff::full(&inputs).unwrap(),
            step: Some(7),
            base_step: None,
            metadata: metadata.clone(),
            packed: false,
        })
        .unwrap();
        let folder = tempfile::tempdir().unwrap();
        let path = folder.path().join("anchor");
        std::fs::write(&path, b"old, longer content that must be truncated away").unwrap();
        let written = write_anchor(&inputs, Some(7), &metadata, &path).unwrap();
        let file = std::fs::read(&path).unwrap();
        assert_eq!(file, expected);
        assert_eq!(written.size, expected.len() as u64);
        assert_eq!(written.sha256, <[u8; 32]>::from(Sha256::digest(&expected)));
        let digest_inputs: Vec<digest::DigestInput<'_>> = inputs
            .iter()
            .map(|i| digest::DigestInput { name: &i.name, dtype: i.dtype, shape: &i.shape, data: i.data })
            .collect();
        assert_eq!(written.state_digest, digest::state_digest(&digest_inputs));

        let mapped = load_mapped(&path).unwrap();
        assert!(mapped.is_anchor());
        let mut target = vec![0u8; data[2].len()];
        let index = mapped.position_of("t2").unwrap();
        crate::core::apply::apply(&mapped, vec![(index, &mut target[..])]).unwrap();
        assert_eq!(target, data[2]);
    }

    #[test]
    fn refuses_bad_names_before_writing() {
        let data = vec![vec![0u8; 4]];
        let mut inputs = inputs(&data);
        inputs[0].name = "x:pos".into();
        let folder = tempfile::tempdir().unwrap();
        let path = folder.path().join("anchor");
        std::fs::write(&path, b"kept").unwrap();
        assert!(write_anchor(&inputs, None, &BTreeMap::new(), &path).is_err());
        assert_eq!(std::fs::read(&path).unwrap(), b"kept");
    }
}
