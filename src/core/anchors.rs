//! Anchors at scale: written from the caller's tensors straight into a file, hashed (SHA-256) on the way, and read
//! back through a memory map, so neither side holds a second copy of the whole state.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::core::diff::{self, FullInput};
use crate::core::error::{Error, Result};
use crate::core::format;
use crate::core::stream::{Backing, Stream};
use crate::core::Delta;

/// Bytes hashed on one thread while the other writes them.
const CHUNK_BYTES: usize = 8 << 20;

/// What `write_anchor` wrote: the file's size and SHA-256.
pub struct Written {
    pub size: u64,
    pub sha256: [u8; 32],
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

/// A writer that hashes what it writes; large writes are hashed and written side by side, chunk by chunk.
struct Hashing<W: Write> {
    inner: W,
    hasher: Sha256,
    size: u64,
}

impl<W: Write + Send> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        for chunk in buf.chunks(CHUNK_BYTES) {
            let (hasher, inner) = (&mut self.hasher, &mut self.inner);
            let ((), written) = rayon::join(|| hasher.update(chunk), || inner.write_all(chunk));
            written?;
        }
        self.size += buf.len() as u64;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Writes the anchor of `inputs` (the bytes `format::to_bytes` gives for `diff::full(inputs)` with this step and
/// metadata) into the file at `path`, truncating it, and returns its size and SHA-256. Each tensor is copied once,
/// from its own memory into the file; nothing the size of the state is allocated. The caller keeps `inputs`
/// unchanged until this returns, and makes the file durable (fsync) where it needs to.
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
    let delta = Delta { tensors, step, base_step: None, metadata: metadata.clone() };
    let encoded = format::encode(&delta)?;
    let file = std::fs::OpenOptions::new().write(true).truncate(true).open(path).map_err(|e| Error::io(path, e))?;
    let mut writer =
        Hashing { inner: std::io::BufWriter::with_capacity(1 << 20, file), hasher: Sha256::new(), size: 0 };
    crate::core::pool::install(|| encoded.write_to(&mut writer).and_then(|()| writer.flush()))
        .map_err(|e| Error::io(path, e))?;
    // `delta` (and the lent windows in it) ends here, while `inputs` is still borrowed.
    drop(encoded);
    drop(delta);
    Ok(Written { size: writer.size, sha256: writer.hasher.finalize().into() })
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
