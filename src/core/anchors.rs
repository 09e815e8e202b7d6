//! Anchors at scale: written from the caller's tensors straight into a file, hashed (SHA-256) on the way, and read
//! back through a memory map, so neither side holds a second copy of the whole state.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use rayon::prelude::*;
use sha2::{Digest, Sha256};

use crate::core::diff::{self, FullInput};
use crate::core::digest;
use crate::core::error::{Error, Result};
use crate::core::format;
use crate::core::stream::{Backing, Stream};
use crate::core::Delta;

/// Bytes hashed on one thread while the other writes them.
const CHUNK_BYTES: usize = 8 << 20;
/// The smallest and largest piece sizes `write_anchor` hashes (docs/format.md §10, anchor pieces).
pub const MIN_PIECE_BYTES: usize = 1 << 10;
pub const MAX_PIECE_BYTES: usize = 1 << 30;
/// Below this many bytes a write's pieces are hashed on the calling thread.
const PARALLEL_PIECES_BYTES: usize = 1 << 20;

/// What `write_anchor` wrote: the file's size and SHA-256, the state digest of its tensors (core::digest), and the
/// SHA-256 of each `piece_bytes` piece of the file in order (the last may be shorter; none when not asked for).
pub struct Written {
    pub size: u64,
    pub sha256: [u8; 32],
    pub state_digest: String,
    pub pieces: Vec<[u8; 32]>,
}

/// SHA-256 of consecutive fixed-size pieces of a byte stream fed in arbitrary slices; whole pieces inside one
/// slice are hashed in parallel.
struct Pieces {
    piece_bytes: usize,
    current: Sha256,
    filled: usize,
    done: Vec<[u8; 32]>,
}

impl Pieces {
    fn new(piece_bytes: usize) -> Self {
        Self { piece_bytes, current: Sha256::new(), filled: 0, done: Vec::new() }
    }

    fn update(&mut self, mut data: &[u8]) {
        if self.piece_bytes == 0 {
            return;
        }
        if self.filled > 0 {
            let take = data.len().min(self.piece_bytes - self.filled);
            self.current.update(&data[..take]);
            self.filled += take;
            data = &data[take..];
            if self.filled == self.piece_bytes {
                self.done.push(std::mem::take(&mut self.current).finalize().into());
                self.filled = 0;
            }
        }
        let whole = data.len() / self.piece_bytes * self.piece_bytes;
        let (full, tail) = data.split_at(whole);
        if full.len() >= PARALLEL_PIECES_BYTES {
            let hashed: Vec<[u8; 32]> =
                full.par_chunks_exact(self.piece_bytes).map(|piece| Sha256::digest(piece).into()).collect();
            self.done.extend(hashed);
        } else {
            self.done.extend(full.chunks_exact(self.piece_bytes).map(|piece| <[u8; 32]>::from(Sha256::digest(piece))));
        }
        if !tail.is_empty() {
            self.current.update(tail);
            self.filled = tail.len();
        }
    }

    fn finish(mut self) -> Vec<[u8; 32]> {
        if self.filled > 0 {
            self.done.push(self.current.finalize().into());
        }
        self.done
    }
}

/// The SHA-256 of each `piece_bytes` piece of `data` (the last may be shorter): what `write_anchor` records.
pub fn piece_hashes(data: &[u8], piece_bytes: usize) -> Vec<[u8; 32]> {
    let mut pieces = Pieces::new(piece_bytes);
    pieces.update(data);
    pieces.finish()
}

/// The SHA-256 of each `piece_bytes` piece of the file at `path`, hashed in parallel in the deltasync pool: a reader
/// checks a whole anchor against its pieces sidecar this way, on every core, where one SHA-256 of the whole file
/// runs on one. Each task reads its group of pieces with `pread` into a buffer of its own (about `READ_BYTES`), so
/// the file is never mapped and its pages never count towards this process's resident memory. The file must not
/// change meanwhile (a private copy).
pub fn file_piece_hashes(path: &Path, piece_bytes: usize) -> Result<Vec<[u8; 32]>> {
    use std::os::unix::fs::FileExt;

    const READ_BYTES: usize = 8 << 20;
    if piece_bytes == 0 {
        return Err(Error::invalid("piece_bytes must be at least 1"));
    }
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let pieces = len.div_ceil(piece_bytes as u64);
    let per_read = (READ_BYTES / piece_bytes).max(1) as u64;
    let groups: Vec<Vec<[u8; 32]>> = crate::core::pool::install(|| {
        (0..pieces.div_ceil(per_read))
            .into_par_iter()
            .map_init(Vec::new, |buffer, group| {
                let start = group * per_read * piece_bytes as u64;
                let end = len.min(start + per_read * piece_bytes as u64);
                buffer.resize((end - start) as usize, 0);
                file.read_exact_at(buffer, start).map_err(|e| Error::io(path, e))?;
                Ok(buffer.chunks(piece_bytes).map(|piece| Sha256::digest(piece).into()).collect())
            })
            .collect::<Result<_>>()
    })?;
    Ok(groups.into_iter().flatten().collect())
}

/// One run of bytes that `copy_checked_pieces` copies: `len` bytes at offset `from` of the source, written at
/// offset `to` of the destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub from: u64,
    pub len: u64,
    pub to: u64,
}

/// Why `copy_checked_pieces` copied nothing more: the source's size, or the first piece whose SHA-256 differs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unchecked {
    Size(u64),
    Piece(usize),
}

/// Copies the `segments` of the file at `source` into the existing file at `dest`, every byte checked first: the
/// source must be `size` bytes, and each of its `piece_bytes` pieces (the last may be shorter) that a segment touches
/// must have the SHA-256 `expected` lists for it before any byte of it is written. Those pieces are read whole and
/// checked in parallel groups (about `READ_BYTES` each, read with `pread` into a buffer per task: the source is never
/// mapped and its pages never count towards this process's resident memory). This is a verified download and a copy
/// in one read of the source, where checking a private copy costs a second read and a second write of the file.
///
/// Returns `Ok(Some(..))` for a source of another size (nothing written) or, after checking every touched piece,
/// the first one that differs (the destination then holds the checked pieces' segments only, and is the caller's to
/// discard). Segments must lie within `size` bytes of the source and not overlap there; they may come in any order.
pub fn copy_checked_pieces(
    source: &Path,
    size: u64,
    piece_bytes: usize,
    expected: &[[u8; 32]],
    dest: &Path,
    segments: &[Segment],
) -> Result<Option<Unchecked>> {
    use std::os::unix::fs::FileExt;

    const READ_BYTES: usize = 8 << 20;
    if piece_bytes == 0 {
        return Err(Error::invalid("piece_bytes must be at least 1"));
    }
    if expected.len() as u64 != size.div_ceil(piece_bytes as u64) {
        return Err(Error::invalid(format!(
            "{}: {} piece hashes for {size} bytes in pieces of {piece_bytes}",
            source.display(),
            expected.len()
        )));
    }
    let mut order: Vec<Segment> = segments.iter().copied().filter(|segment| segment.len > 0).collect();
    for segment in &order {
        if segment.from.checked_add(segment.len).is_none_or(|end| end > size)
            || segment.to.checked_add(segment.len).is_none()
        {
            return Err(Error::invalid(format!(
                "{}: segment {segment:?} lies outside its {size} bytes",
                source.display()
            )));
        }
    }
    order.sort_by_key(|segment| segment.from);
    if let Some(pair) = order.windows(2).find(|pair| pair[0].from + pair[0].len > pair[1].from) {
        return Err(Error::invalid(format!("{}: segments {:?} and {:?} overlap", source.display(), pair[0], pair[1])));
    }
    let file = std::fs::File::open(source).map_err(|e| Error::io(source, e))?;
    let actual = file.metadata().map_err(|e| Error::io(source, e))?.len();
    if actual != size {
        return Ok(Some(Unchecked::Size(actual)));
    }
    let out = std::fs::OpenOptions::new().write(true).open(dest).map_err(|e| Error::io(dest, e))?;
    // The runs of pieces the segments touch, cut into read groups of at most `per_read` pieces.
    let piece = piece_bytes as u64;
    let per_read = (READ_BYTES / piece_bytes).max(1) as u64;
    let mut groups: Vec<(u64, u64)> = Vec::new(); // [first, last) piece indices
    for segment in &order {
        let (first, last) = (segment.from / piece, (segment.from + segment.len).div_ceil(piece));
        let first = match groups.last() {
            Some(&(_, end)) if end > first => end,
            _ => first,
        };
        for start in (first..last).step_by(per_read as usize) {
            groups.push((start, last.min(start + per_read)));
        }
    }
    let bad: Vec<Option<usize>> = crate::core::pool::install(|| {
        groups
            .into_par_iter()
            .map_init(Vec::new, |buffer, (first, last)| {
                let start = first * piece;
                let end = size.min(last * piece);
                buffer.resize((end - start) as usize, 0);
                file.read_exact_at(buffer, start).map_err(|e| Error::io(source, e))?;
                for (i, bytes) in buffer.chunks(piece_bytes).enumerate() {
                    if <[u8; 32]>::from(Sha256::digest(bytes)) != expected[first as usize + i] {
                        return Ok(Some(first as usize + i));
                    }
                }
                let mut at = order.partition_point(|s| s.from + s.len <= start);
                while let Some(segment) = order.get(at).filter(|s| s.from < end) {
                    let lo = segment.from.max(start);
                    let hi = (segment.from + segment.len).min(end);
                    if hi > lo {
                        let bytes = &buffer[(lo - start) as usize..(hi - start) as usize];
                        out.write_all_at(bytes, segment.to + (lo - segment.from)).map_err(|e| Error::io(dest, e))?;
                    }
                    at += 1;
                }
                Ok(None)
            })
            .collect::<Result<_>>()
    })?;
    Ok(bad.into_iter().flatten().min().map(Unchecked::Piece))
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
    pieces: Pieces,
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
            let (sha256, pieces, inner, hasher) =
                (&mut self.sha256, &mut self.pieces, &mut self.inner, &mut tensor_hasher);
            let hash = || {
                sha256.update(chunk);
                if let Some(hasher) = hasher.as_mut() {
                    hasher.update(chunk);
                }
            };
            let (_, written) = rayon::join(|| rayon::join(hash, || pieces.update(chunk)), || inner.write_all(chunk));
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
/// where it needs to. With `piece_bytes` (a power of two from MIN_PIECE_BYTES to MAX_PIECE_BYTES; 0: none) it also
/// returns the SHA-256 of each piece of that size, hashed in the same pass.
pub fn write_anchor(
    inputs: &[FullInput<'_>],
    step: Option<u64>,
    metadata: &BTreeMap<String, String>,
    path: &Path,
    piece_bytes: usize,
) -> Result<Written> {
    if piece_bytes != 0
        && (!piece_bytes.is_power_of_two() || !(MIN_PIECE_BYTES..=MAX_PIECE_BYTES).contains(&piece_bytes))
    {
        return Err(Error::invalid(format!(
            "piece size {piece_bytes}: must be a power of two from {MIN_PIECE_BYTES} to {MAX_PIECE_BYTES} bytes"
        )));
    }
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
        pieces: Pieces::new(piece_bytes),
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
    Ok(Written {
        size: writer.size,
        sha256: writer.sha256.finalize().into(),
        state_digest: digest::combine(&named),
        pieces: writer.pieces.finish(),
    })
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
        let written = write_anchor(&inputs, Some(7), &metadata, &path, 0).unwrap();
        assert!(written.pieces.is_empty());
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
        assert!(write_anchor(&inputs, None, &BTreeMap::new(), &path, 0).is_err());
        assert_eq!(std::fs::read(&path).unwrap(), b"kept");
    }

    #[test]
    fn file_piece_hashes_match_one_pass_hashing() {
        let dir = std::env::temp_dir().join(format!("deltasync-pieces-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("file");
        for len in [0usize, 1, 1023, 1024, 1025, 5000, 3 << 20, (20 << 20) + 5] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 1024) as u8).collect();
            std::fs::write(&path, &data).unwrap();
            for piece_bytes in [1024usize, 4096, 1 << 20] {
                let expected: Vec<[u8; 32]> = data.chunks(piece_bytes).map(|p| Sha256::digest(p).into()).collect();
                assert_eq!(file_piece_hashes(&path, piece_bytes).unwrap(), expected, "{len} {piece_bytes}");
            }
        }
        assert!(file_piece_hashes(&path, 0).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn pieces_hash_each_piece_of_the_file_whatever_the_write_sizes() {
        let data: Vec<Vec<u8>> = [4usize, 5000, 2 * CHUNK_BYTES + 778, 1 << 20]
            .iter()
            .map(|&n| (0..n).map(|i| (i * 13 % 253) as u8).collect())
            .collect();
        let inputs = inputs(&data);
        let folder = tempfile::tempdir().unwrap();
        let path = folder.path().join("anchor");
        std::fs::write(&path, b"").unwrap();
        for piece_bytes in [MIN_PIECE_BYTES, 1 << 16, 1 << 20, 32 << 20] {
            let written = write_anchor(&inputs, Some(3), &BTreeMap::new(), &path, piece_bytes).unwrap();
            let file = std::fs::read(&path).unwrap();
            let expected: Vec<[u8; 32]> = file.chunks(piece_bytes).map(|p| Sha256::digest(p).into()).collect();
            assert_eq!(written.pieces, expected, "piece size {piece_bytes}");
            assert_eq!(written.pieces, piece_hashes(&file, piece_bytes));
            assert_eq!(written.sha256, <[u8; 32]>::from(Sha256::digest(&file)));
        }
        for bad in [1usize, 512, 3 << 10, 2 << 30] {
            assert!(write_anchor(&inputs, None, &BTreeMap::new(), &path, bad).is_err(), "piece size {bad}");
        }
    }

    #[test]
    fn copy_checked_pieces_copies_checked_segments_and_names_the_first_bad_piece() {
        let folder = tempfile::tempdir().unwrap();
        let (source, dest) = (folder.path().join("source"), folder.path().join("dest"));
        let data: Vec<u8> = (0..(9 << 20) + 77).map(|i: usize| (i * 31 + i / 4096) as u8).collect();
        std::fs::write(&source, &data).unwrap();
        let piece_bytes = 1 << 16;
        let hashes: Vec<[u8; 32]> = data.chunks(piece_bytes).map(|p| Sha256::digest(p).into()).collect();
        // Segments out of order, one crossing the 8 MiB read groups and piece edges, one ending at the file's end.
        let segments = [
            Segment { from: (8 << 20) - 100, len: 300, to: 0 },
            Segment { from: 5, len: 70_000, to: 300 },
            Segment { from: data.len() as u64 - 50, len: 50, to: 70_300 },
        ];
        std::fs::write(&dest, vec![0u8; 70_350]).unwrap();
        let size = data.len() as u64;
        assert_eq!(copy_checked_pieces(&source, size, piece_bytes, &hashes, &dest, &segments).unwrap(), None);
        let mut expected = data[(8 << 20) - 100..(8 << 20) + 200].to_vec();
        expected.extend_from_slice(&data[5..70_005]);
        expected.extend_from_slice(&data[data.len() - 50..]);
        assert_eq!(std::fs::read(&dest).unwrap(), expected);

        // A source of another size is refused before anything is read; so are hashes that do not count its pieces.
        std::fs::write(&dest, b"").unwrap();
        let outcome = copy_checked_pieces(&source, size + 1, piece_bytes, &hashes, &dest, &segments[..1]).unwrap();
        assert_eq!(outcome, Some(Unchecked::Size(size)));
        assert!(std::fs::read(&dest).unwrap().is_empty());
        assert!(copy_checked_pieces(&source, size, piece_bytes, &hashes[1..], &dest, &[]).is_err());
        // Changed bytes in pieces the segments touch: each touched piece is checked and the first bad one named.
        let mut tampered = data.clone();
        tampered[piece_bytes + 9] ^= 1;
        tampered[data.len() - 1] ^= 1;
        std::fs::write(&source, &tampered).unwrap();
        std::fs::write(&dest, vec![0u8; 70_350]).unwrap();
        let outcome = copy_checked_pieces(&source, size, piece_bytes, &hashes, &dest, &segments).unwrap();
        assert_eq!(outcome, Some(Unchecked::Piece(1)));
        // Nothing of the bad piece's read group was written (here: pieces 0 and 1, the second segment's).
        assert!(std::fs::read(&dest).unwrap()[300..70_300].iter().all(|&b| b == 0));

        // Only the pieces the segments touch are read: a bad piece elsewhere is not this copy's concern.
        let untouched = [Segment { from: 4 * piece_bytes as u64, len: 100, to: 0 }];
        assert_eq!(copy_checked_pieces(&source, size, piece_bytes, &hashes, &dest, &untouched).unwrap(), None);
        assert_eq!(std::fs::read(&dest).unwrap()[..100], tampered[4 * piece_bytes..4 * piece_bytes + 100]);

        // Bad arguments are refused before anything is read.
        assert!(copy_checked_pieces(&source, size, 0, &hashes, &dest, &[]).is_err());
        let outside = [Segment { from: size - 1, len: 2, to: 0 }];
        assert!(copy_checked_pieces(&source, size, piece_bytes, &hashes, &dest, &outside).is_err());
        let overlapping = [Segment { from: 0, len: 10, to: 0 }, Segment { from: 9, len: 1, to: 20 }];
        assert!(copy_checked_pieces(&source, size, piece_bytes, &hashes, &dest, &overlapping).is_err());
    }
}
