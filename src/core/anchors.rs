//! Anchors at scale: written from the caller's tensors straight into a file, hashed (SHA-256, and each piece with
//! BLAKE3 or SHA-256) on the way, and read back through a memory map or straight into the target's memory, every
//! piece checked first, so neither side holds a second copy of the whole state.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::sync::Arc;

use rayon::prelude::*;
use sha2::{Digest, Sha256};

use crate::core::base::{self, BlockHasher};
use crate::core::diff::{self, FullInput};
use crate::core::digest;
use crate::core::error::{Error, Result};
use crate::core::format::{self, Checksum};
use crate::core::stream::{Backing, Stream};
use crate::core::Delta;

/// Bytes hashed on one thread while the other writes them. Larger chunks mean fewer, larger writes: on the test
/// machine the anchor's write pass took a median 0.55 s per GB with 32 MiB chunks against 0.91 s with 8 MiB and over
/// 2 s with 2 MiB (docs/benchmarks.md).
const CHUNK_BYTES: usize = 32 << 20;
/// The smallest and largest piece sizes `write_anchor` hashes (docs/format.md §10, anchor pieces).
pub const MIN_PIECE_BYTES: usize = 1 << 10;
pub const MAX_PIECE_BYTES: usize = 1 << 30;
/// Below this many bytes a write's pieces are hashed on the calling thread.
const PARALLEL_PIECES_BYTES: usize = 1 << 20;

/// The hash of each piece of an anchor (docs/format.md §10, anchor pieces); the pieces sidecar's magic names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PieceHash {
    /// `DSPIECE1` sidecars.
    Sha256,
    /// `DSPIECE2` sidecars: about 2.5 times SHA-256's speed with SHA extensions, far more without.
    Blake3,
}

impl PieceHash {
    /// The hash named `name` ("sha256" or "blake3").
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "sha256" => Ok(Self::Sha256),
            "blake3" => Ok(Self::Blake3),
            other => Err(Error::invalid(format!("piece hash {other:?}: must be \"sha256\" or \"blake3\""))),
        }
    }

    /// The hash of one piece.
    pub fn digest(self, piece: &[u8]) -> [u8; 32] {
        match self {
            Self::Sha256 => Sha256::digest(piece).into(),
            Self::Blake3 => *blake3::hash(piece).as_bytes(),
        }
    }

    fn running(self) -> Running {
        match self {
            Self::Sha256 => Running::Sha256(Sha256::new()),
            Self::Blake3 => Running::Blake3(Box::default()),
        }
    }
}

/// A piece being hashed as its bytes arrive.
enum Running {
    Sha256(Sha256),
    Blake3(Box<blake3::Hasher>),
}

impl Running {
    fn update(&mut self, data: &[u8]) {
        match self {
            Self::Sha256(hasher) => hasher.update(data),
            Self::Blake3(hasher) => {
                hasher.update(data);
            }
        }
    }

    fn finish(self) -> [u8; 32] {
        match self {
            Self::Sha256(hasher) => hasher.finalize().into(),
            Self::Blake3(hasher) => *hasher.finalize().as_bytes(),
        }
    }
}

/// What `write_anchor` wrote: the file's size and SHA-256 (when asked for), its checksum (docs/format.md §2.1), the
/// state digest of its tensors (core::digest), and the hash of each `piece_bytes` piece of the file in order (the
/// last may be shorter; none when not asked for).
pub struct Written {
    pub size: u64,
    pub sha256: Option<[u8; 32]>,
    pub checksum: u64,
    pub state_digest: String,
    pub pieces: Vec<[u8; 32]>,
}

/// The hashes of consecutive fixed-size pieces of a byte stream fed in arbitrary slices; whole pieces inside one
/// slice are hashed in parallel.
struct Pieces {
    piece_bytes: usize,
    kind: PieceHash,
    current: Running,
    filled: usize,
    done: Vec<[u8; 32]>,
}

impl Pieces {
    fn new(piece_bytes: usize, kind: PieceHash) -> Self {
        Self { piece_bytes, kind, current: kind.running(), filled: 0, done: Vec::new() }
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
                self.done.push(std::mem::replace(&mut self.current, self.kind.running()).finish());
                self.filled = 0;
            }
        }
        let whole = data.len() / self.piece_bytes * self.piece_bytes;
        let (full, tail) = data.split_at(whole);
        let kind = self.kind;
        if full.len() >= PARALLEL_PIECES_BYTES {
            let hashed: Vec<[u8; 32]> =
                full.par_chunks_exact(self.piece_bytes).map(|piece| kind.digest(piece)).collect();
            self.done.extend(hashed);
        } else {
            self.done.extend(full.chunks_exact(self.piece_bytes).map(|piece| kind.digest(piece)));
        }
        if !tail.is_empty() {
            self.current.update(tail);
            self.filled = tail.len();
        }
    }

    fn finish(mut self) -> Vec<[u8; 32]> {
        if self.filled > 0 {
            self.done.push(self.current.finish());
        }
        self.done
    }
}

/// The hash of each `piece_bytes` piece of `data` (the last may be shorter): what `write_anchor` records.
pub fn piece_hashes(data: &[u8], piece_bytes: usize, kind: PieceHash) -> Vec<[u8; 32]> {
    let mut pieces = Pieces::new(piece_bytes, kind);
    pieces.update(data);
    pieces.finish()
}

/// Bytes of a source read with `pread` (into a buffer of the reading task's own) and checked at a time.
const READ_BYTES: usize = 8 << 20;

/// `work` on each of `items`, in order, in parallel on the current rayon pool, each task with a read buffer of its
/// own, kept for the next task once done: (a fresh buffer per rayon job, as `map_init` makes them, is allocated,
/// faulted in and zeroed again many times a call; on a first call in a process that cost about as much as the
/// hashing).
fn with_buffers<I: Sync, T: Send>(items: &[I], work: impl Fn(&mut Vec<u8>, &I) -> Result<T> + Sync) -> Result<Vec<T>> {
    struct Kept<'a> {
        free: &'a std::sync::Mutex<Vec<Vec<u8>>>,
        buffer: Vec<u8>,
    }
    impl Drop for Kept<'_> {
        fn drop(&mut self) {
            if let Ok(mut free) = self.free.lock() {
                free.push(std::mem::take(&mut self.buffer));
            }
        }
    }
    let free = std::sync::Mutex::new(Vec::new());
    let lend = || Kept { free: &free, buffer: free.lock().ok().and_then(|mut free| free.pop()).unwrap_or_default() };
    items.par_iter().map_init(lend, |lent, item| work(&mut lent.buffer, item)).collect()
}

/// The hash of each `piece_bytes` piece of the file at `path`, hashed in parallel in the deltasync pool: a reader
/// checks a whole anchor against its pieces sidecar this way, on every core, where one SHA-256 of the whole file
/// runs on one. Each task reads its group of pieces with `pread` into a buffer of its own (about `READ_BYTES`), so
/// the file is never mapped and its pages never count towards this process's resident memory. The file must not
/// change meanwhile (a private copy).
pub fn file_piece_hashes(path: &Path, piece_bytes: usize, kind: PieceHash) -> Result<Vec<[u8; 32]>> {
    use std::os::unix::fs::FileExt;

    if piece_bytes == 0 {
        return Err(Error::invalid("piece_bytes must be at least 1"));
    }
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let pieces = len.div_ceil(piece_bytes as u64);
    let per_read = (READ_BYTES / piece_bytes).max(1) as u64;
    let groups: Vec<u64> = (0..pieces.div_ceil(per_read)).collect();
    let groups: Vec<Vec<[u8; 32]>> = crate::core::pool::install(|| {
        with_buffers(&groups, |buffer, &group| {
            let start = group * per_read * piece_bytes as u64;
            let end = len.min(start + per_read * piece_bytes as u64);
            buffer.resize((end - start) as usize, 0);
            file.read_exact_at(buffer, start).map_err(|e| Error::io(path, e))?;
            Ok(buffer.chunks(piece_bytes).map(|piece| kind.digest(piece)).collect())
        })
    })?;
    Ok(groups.into_iter().flatten().collect())
}

/// A file checked piece by piece as it is read: `size` bytes in pieces of `piece_bytes` (the last may be shorter),
/// each of which must have the hash (`kind`) that `expected` lists for it.
#[derive(Clone, Copy, Debug)]
pub struct CheckedSource<'a> {
    pub path: &'a Path,
    pub size: u64,
    pub piece_bytes: usize,
    pub kind: PieceHash,
    pub expected: &'a [[u8; 32]],
}

/// One run of bytes that a checked copy copies: `len` bytes at offset `from` of the source, written at offset `to`
/// of the destination (a file), or into target `to` (memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub from: u64,
    pub len: u64,
    pub to: u64,
}

/// Why a checked copy copied nothing more: the source's size, or the first piece whose hash differs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unchecked {
    Size(u64),
    Piece(usize),
}

/// Writes a checked segment's bytes: the segment, the offset of the bytes in it, the bytes.
type SegmentWrite<'a> = dyn Fn(&Segment, u64, &[u8]) -> Result<()> + Sync + 'a;

impl CheckedSource<'_> {
    /// Opens the source, or tells its size when it is not the expected one; checks the arguments and `segments`
    /// (within the source, not overlapping there), which it returns sorted by source offset.
    fn open(&self, segments: &[Segment]) -> Result<std::result::Result<(std::fs::File, Vec<Segment>), Unchecked>> {
        let (source, size, piece_bytes) = (self.path, self.size, self.piece_bytes);
        if piece_bytes == 0 {
            return Err(Error::invalid("piece_bytes must be at least 1"));
        }
        if self.expected.len() as u64 != size.div_ceil(piece_bytes as u64) {
            return Err(Error::invalid(format!(
                "{}: {} piece hashes for {size} bytes in pieces of {piece_bytes}",
                source.display(),
                self.expected.len()
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
            return Err(Error::invalid(format!(
                "{}: segments {:?} and {:?} overlap",
                source.display(),
                pair[0],
                pair[1]
            )));
        }
        let file = std::fs::File::open(source).map_err(|e| Error::io(source, e))?;
        let actual = file.metadata().map_err(|e| Error::io(source, e))?.len();
        if actual != size {
            return Ok(Err(Unchecked::Size(actual)));
        }
        Ok(Ok((file, order)))
    }

    /// Reads the pieces that `order` (sorted, from `open`) touches in parallel groups of about `READ_BYTES`, checks
    /// each group's pieces, then hands `write` each segment's bytes in that group (the segment, the offset of the
    /// bytes in it, the bytes). Returns the first piece that differs: nothing of its group was handed over.
    fn walk(&self, file: &std::fs::File, order: &[Segment], write: &SegmentWrite<'_>) -> Result<Option<usize>> {
        use std::os::unix::fs::FileExt;

        let (size, piece_bytes) = (self.size, self.piece_bytes);
        let piece = piece_bytes as u64;
        let per_read = (READ_BYTES / piece_bytes).max(1) as u64;
        let mut groups: Vec<(u64, u64)> = Vec::new(); // [first, last) piece indices
        for segment in order {
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
            with_buffers(&groups, |buffer, &(first, last)| {
                let start = first * piece;
                let end = size.min(last * piece);
                buffer.resize((end - start) as usize, 0);
                file.read_exact_at(buffer, start).map_err(|e| Error::io(self.path, e))?;
                for (i, bytes) in buffer.chunks(piece_bytes).enumerate() {
                    if self.kind.digest(bytes) != self.expected[first as usize + i] {
                        return Ok(Some(first as usize + i));
                    }
                }
                let mut at = order.partition_point(|s| s.from + s.len <= start);
                while let Some(segment) = order.get(at).filter(|s| s.from < end) {
                    let lo = segment.from.max(start);
                    let hi = (segment.from + segment.len).min(end);
                    if hi > lo {
                        write(segment, lo - segment.from, &buffer[(lo - start) as usize..(hi - start) as usize])?;
                    }
                    at += 1;
                }
                Ok(None)
            })
        })?;
        Ok(bad.into_iter().flatten().min())
    }
}

/// Copies the `segments` of `source` into the existing file at `dest`, every byte checked first: the source must be
/// its size, and each piece that a segment touches must have its expected hash before any byte of it is written.
/// Those pieces are read whole and checked in parallel groups (read with `pread` into a buffer per task: the source
/// is never mapped and its pages never count towards this process's resident memory). This is a verified download
/// and a copy in one read of the source, where checking a private copy costs a second read and a second write.
///
/// Returns `Ok(Some(..))` for a source of another size (nothing written) or, after checking every touched piece,
/// the first one that differs (the destination then holds the checked pieces' segments only, and is the caller's to
/// discard). Segments must lie within the source and not overlap there; they may come in any order.
pub fn copy_checked_pieces(source: &CheckedSource<'_>, dest: &Path, segments: &[Segment]) -> Result<Option<Unchecked>> {
    use std::os::unix::fs::FileExt;

    let (file, order) = match source.open(segments)? {
        Ok(opened) => opened,
        Err(unchecked) => return Ok(Some(unchecked)),
    };
    let out = std::fs::OpenOptions::new().write(true).open(dest).map_err(|e| Error::io(dest, e))?;
    let write = |segment: &Segment, offset: u64, bytes: &[u8]| {
        out.write_all_at(bytes, segment.to + offset).map_err(|e| Error::io(dest, e))
    };
    Ok(source.walk(&file, &order, &write)?.map(Unchecked::Piece))
}

/// A target's memory, written by several tasks at once, each at bytes no other task writes.
struct Shared {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: `fill_checked` hands each byte of a target to exactly one task (its segments do not overlap in the
// source, and each target has one segment), so no two tasks write the same byte.
unsafe impl Sync for Shared {}

/// Fills each target with the bytes of `source` at its offset in `fills` ((offset, target index) pairs; a target
/// takes as many bytes as it is long), reading the pieces they touch in parallel groups and checking each group
/// before its bytes are copied into the targets: no byte is used unchecked, and nothing of the source is copied
/// anywhere else (no temporary file, no buffer beyond one group per task). Returns the source's size when it is not
/// the expected one (nothing written), or the first piece that differs: the targets then hold the bytes of the
/// groups that matched. A caller that must write all or nothing checks the source first (`file_piece_hashes`),
/// so that a piece differing here means the source changed in between: a loud error, never an unchecked byte.
pub fn fill_checked(
    source: &CheckedSource<'_>,
    targets: &mut [&mut [u8]],
    fills: &[(u64, usize)],
) -> Result<Option<Unchecked>> {
    let mut segments = Vec::with_capacity(fills.len());
    let mut seen = vec![false; targets.len()];
    for &(from, target) in fills {
        let Some(taken) = seen.get_mut(target) else {
            return Err(Error::invalid(format!(
                "{}: fill of target {target} of {}",
                source.path.display(),
                targets.len()
            )));
        };
        if std::mem::replace(taken, true) {
            return Err(Error::invalid(format!("{}: target {target} is filled twice", source.path.display())));
        }
        segments.push(Segment { from, len: targets[target].len() as u64, to: target as u64 });
    }
    let (file, order) = match source.open(&segments)? {
        Ok(opened) => opened,
        Err(unchecked) => return Ok(Some(unchecked)),
    };
    let shared: Vec<Shared> =
        targets.iter_mut().map(|target| Shared { ptr: target.as_mut_ptr(), len: target.len() }).collect();
    let write = |segment: &Segment, offset: u64, bytes: &[u8]| {
        let target = &shared[segment.to as usize];
        let offset = offset as usize;
        assert!(offset + bytes.len() <= target.len, "a segment's bytes lie within its target");
        // SAFETY: within the target (asserted), which `targets` borrows mutably for this call; no other task
        // writes these bytes (see `Shared`).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), target.ptr.add(offset), bytes.len()) };
        Ok(())
    };
    Ok(source.walk(&file, &order, &write)?.map(Unchecked::Piece))
}

/// A caller's bytes lent to a `Delta` that never outlives `write_anchor`'s call, so that `format::encode_with` lays
/// out the very file it would give in memory without copying a tensor.
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

/// A writer that hashes what it writes with SHA-256 (when it has a hasher for it), and each tensor's bytes with its
/// state-digest hash when they pass whole (`write_to` hands over each piece as the very slice it was lent, before any
/// buffering); large writes are hashed and written side by side, chunk by chunk.
struct Hashing<'a, 'b, W: Write> {
    /// First, so that it is dropped (its thread joined) before `inner` closes the file it starts writeback of.
    writeback: Option<Writeback>,
    inner: W,
    sha256: Option<Sha256>,
    /// The file's checksum (§2.1), hashed as it is written, when the header holds its placeholder.
    checksum: Option<BlockHasher>,
    pieces: Pieces,
    size: u64,
    inputs: &'a [FullInput<'b>],
    /// Tensors not yet seen, by the address and length of their bytes (aliased tensors queue under one key).
    pending: HashMap<(usize, usize), Vec<usize>>,
    tensor_hashes: Vec<Option<u128>>,
}

/// Starts the kernel's writeback of what the pass has written so far (every `WRITEBACK_BYTES`, with
/// `sync_file_range(SYNC_FILE_RANGE_WRITE)`) on a thread of its own, so that the disk writes the file while the pass
/// goes on, the caller's fsync finds less left to write, and fewer dirty pages pile up. The writing thread never
/// waits for it: submitting writeback can block on a busy disk, which inline in the pass made some anchors slower.
struct Writeback {
    kicks: Option<std::sync::mpsc::Sender<u64>>,
    thread: Option<std::thread::JoinHandle<()>>,
    kicked: u64,
}

impl Writeback {
    #[cfg(target_os = "linux")]
    fn start(file: &std::fs::File) -> Option<Writeback> {
        use std::os::fd::AsRawFd;
        let fd = file.as_raw_fd();
        let (kicks, ends) = std::sync::mpsc::channel::<u64>();
        let thread = std::thread::Builder::new()
            .name("deltasync-writeback".into())
            .spawn(move || {
                let mut from = 0u64;
                for end in ends {
                    // SAFETY: `fd` stays open until this thread is joined (`Writeback`'s drop, before `Hashing`
                    // drops the file); SYNC_FILE_RANGE_WRITE only starts writeback of dirty pages in the range.
                    unsafe {
                        libc::sync_file_range(fd, from as i64, (end - from) as i64, libc::SYNC_FILE_RANGE_WRITE);
                    }
                    from = end;
                }
            })
            .ok()?;
        Some(Writeback { kicks: Some(kicks), thread: Some(thread), kicked: 0 })
    }

    /// Elsewhere the caller's fsync writes everything, as before.
    #[cfg(not(target_os = "linux"))]
    fn start(_file: &std::fs::File) -> Option<Writeback> {
        None
    }

    fn written(&mut self, through: u64) {
        if through >= self.kicked + WRITEBACK_BYTES {
            self.kicked = through;
            if let Some(kicks) = &self.kicks {
                let _ = kicks.send(through);
            }
        }
    }
}

impl Drop for Writeback {
    /// Closes the channel, so the thread's loop ends, and waits for it.
    fn drop(&mut self) {
        self.kicks = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

const WRITEBACK_BYTES: u64 = 64 << 20;
const WRITE_BUFFER: usize = 1 << 20;

impl<W: Write + Send> Write for Hashing<'_, '_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let tensor = self.pending.get_mut(&(buf.as_ptr() as usize, buf.len())).and_then(Vec::pop);
        let mut tensor_hasher = tensor.map(|index| {
            let input = &self.inputs[index];
            digest::tensor_hasher(input.dtype, &input.shape)
        });
        let mut through = self.size;
        for chunk in buf.chunks(CHUNK_BYTES) {
            let (sha256, checksum, pieces, inner, hasher) =
                (&mut self.sha256, &mut self.checksum, &mut self.pieces, &mut self.inner, &mut tensor_hasher);
            let hash = || {
                if let Some(sha256) = sha256.as_mut() {
                    sha256.update(chunk);
                }
                if let Some(checksum) = checksum.as_mut() {
                    checksum.take(chunk);
                }
                if let Some(hasher) = hasher.as_mut() {
                    hasher.update(chunk);
                }
            };
            let (_, written) = rayon::join(|| rayon::join(hash, || pieces.update(chunk)), || inner.write_all(chunk));
            written?;
            through += chunk.len() as u64;
            if let Some(writeback) = self.writeback.as_mut() {
                writeback.written(through.saturating_sub(WRITE_BUFFER as u64));
            }
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

/// How `write_anchor` writes and hashes an anchor.
#[derive(Clone, Copy, Debug)]
pub struct AnchorOptions {
    /// The size of the pieces hashed for ranged reads: a power of two from MIN_PIECE_BYTES to MAX_PIECE_BYTES; 0:
    /// no pieces.
    pub piece_bytes: usize,
    /// The pieces' hash.
    pub piece_hash: PieceHash,
    /// Also the whole file's SHA-256: one serial pass over the file, the slowest part of this one.
    pub whole_sha256: bool,
    /// Start the kernel's writeback of the file while it is written (`Writeback`; Linux only), for a caller that
    /// makes it durable next.
    pub early_writeback: bool,
}

/// Writes the anchor of `inputs` (the bytes `format::encode` gives for `diff::full(inputs)` with this step and
/// metadata, its checksum included) into the file at `path`, truncating it, and returns its size, SHA-256 (with
/// `whole_sha256`), checksum and state digest, all hashed in the same pass. Each tensor is copied once, from its own
/// memory into the file; nothing the size of the state is allocated. The caller keeps `inputs` unchanged until this
/// returns, and makes the file durable (fsync) where it needs to. With `piece_bytes` it also returns the hash of
/// each piece of that size, hashed in the same pass.
///
/// The header comes first in the file, and the checksum is in the header. Without `whole_sha256` the header is
/// written with the checksum's placeholder (the zeros the definition hashes in place of its digits, docs/format.md
/// §2.1), the checksum is hashed as the file is written, and its digits are written over the placeholder at the end;
/// the pieces they fall in are hashed again from the file. A whole-file SHA-256 cannot be mended that way, so with
/// `whole_sha256` the checksum is computed before the pass, from the tensors' memory (one more read of the state,
/// in parallel: about 0.03 s per GB of CPU); so it is for a destination that is not a regular file (a pipe) or that
/// this process may write but not read.
pub fn write_anchor(
    inputs: &[FullInput<'_>],
    step: Option<u64>,
    metadata: &BTreeMap<String, String>,
    aliases: &BTreeMap<String, String>,
    path: &Path,
    options: AnchorOptions,
) -> Result<Written> {
    let AnchorOptions { piece_bytes, piece_hash: kind, whole_sha256, early_writeback } = options;
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
    let delta = Delta { tensors, step, metadata: metadata.clone(), aliases: aliases.clone(), ..Delta::default() };
    let mut encoded = format::encode_with(&delta, Checksum::Placeholder)?;
    let digits = encoded.checksum_at()?;
    // The digits are written over the placeholder after the pass, through the same descriptor, into a regular file
    // that can be read back (for the pieces they fall in). A whole-file SHA-256 (hashed in the pass), a file that
    // cannot be rewritten in place (a pipe) or one this process may only write gets them before the pass instead.
    let open = |read: bool| std::fs::OpenOptions::new().read(read).write(true).truncate(true).open(path);
    let mut after = !whole_sha256 && std::fs::metadata(path).is_ok_and(|m| m.is_file());
    let file = match open(after) {
        Err(e) if after && e.kind() == std::io::ErrorKind::PermissionDenied => {
            after = false;
            open(false)
        }
        opened => opened,
    }
    .map_err(|e| Error::io(path, e))?;
    after = after && file.metadata().is_ok_and(|m| m.is_file());
    let sealed = (!after).then(|| crate::core::pool::install(|| encoded.seal(digits)));
    let mut pending: HashMap<(usize, usize), Vec<usize>> = HashMap::new();
    for (index, input) in inputs.iter().enumerate() {
        pending.entry((input.data.as_ptr() as usize, input.data.len())).or_default().push(index);
    }
    let writeback = if early_writeback { Writeback::start(&file) } else { None };
    let mut writer = Hashing {
        inner: std::io::BufWriter::with_capacity(WRITE_BUFFER, file),
        sha256: whole_sha256.then(Sha256::new),
        checksum: sealed.is_none().then(BlockHasher::default),
        pieces: Pieces::new(piece_bytes, kind),
        size: 0,
        inputs,
        pending,
        tensor_hashes: vec![None; inputs.len()],
        writeback,
    };
    crate::core::pool::install(|| encoded.write_to(&mut writer).and_then(|()| writer.flush()))
        .map_err(|e| Error::io(path, e))?;
    // `delta` (and the lent windows in it) ends here, while `inputs` is still borrowed.
    drop(encoded);
    drop(delta);
    let mut pieces = writer.pieces.finish();
    let checksum = match (sealed, writer.checksum.take()) {
        (Some(checksum), _) => checksum,
        (None, Some(hashed)) => {
            let checksum = hashed.finish();
            seal_written(writer.inner.get_ref(), digits, checksum, writer.size, piece_bytes, kind, &mut pieces)
                .map_err(|e| Error::io(path, e))?;
            checksum
        }
        (None, None) => unreachable!("the pass hashes the checksum wherever it was not sealed before"),
    };
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
        sha256: writer.sha256.map(|hasher| hasher.finalize().into()),
        checksum,
        state_digest: digest::combine(&named),
        pieces,
    })
}

/// Writes the digits of `checksum` over the placeholder at `at` in the anchor just written to `file` (`size` bytes),
/// and hashes again the pieces (of `piece_bytes`, hashed by `kind`) they fall in, from the file, a bounded buffer at
/// a time.
fn seal_written(
    mut file: &std::fs::File,
    at: usize,
    checksum: u64,
    size: u64,
    piece_bytes: usize,
    kind: PieceHash,
    pieces: &mut [[u8; 32]],
) -> std::io::Result<()> {
    let digits = base::to_hex(checksum);
    file.seek(SeekFrom::Start(at as u64))?;
    file.write_all(digits.as_bytes())?;
    if piece_bytes == 0 {
        return Ok(());
    }
    let mut buffer = vec![0u8; piece_bytes.min(READ_BYTES)];
    let (first, last) = (at / piece_bytes, (at + digits.len() - 1) / piece_bytes);
    for (index, hash) in pieces.iter_mut().enumerate().take(last + 1).skip(first) {
        let start = (index * piece_bytes) as u64;
        let mut left = (size - start).min(piece_bytes as u64) as usize;
        let mut running = kind.running();
        file.seek(SeekFrom::Start(start))?;
        while left > 0 {
            let take = left.min(buffer.len());
            file.read_exact(&mut buffer[..take])?;
            running.update(&buffer[..take]);
            left -= take;
        }
        *hash = running.finish();
    }
    Ok(())
}

/// Reads and validates a delta file through a read-only memory map: a tensor stored whole stays a window onto the
/// file, and core::apply drops its pages as it copies them, so applying an anchor holds little of it at a time.
/// The file must not change while the delta lives (give it a private copy, e.g. one already checked by SHA-256).
pub fn load_mapped(path: &Path) -> Result<Delta> {
    load_mapped_with(path, true)
}

/// `load_mapped`, with the file's checksum (docs/format.md §2.1) checked or not: not for a stand-in that holds an
/// anchor's checked header and zeros where its tensors are, read by ranges and checked piece by piece instead.
pub fn load_mapped_with(path: &Path, checksum: bool) -> Result<Delta> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: read-only mapping of a file the caller keeps unchanged (see above).
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    format::read_with(Arc::new(Backing::Mapped(map)), &path.display().to_string(), false, checksum)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::dtype::Dtype;

    /// Writeback started early in every test: the bytes written must not depend on it.
    fn options(piece_bytes: usize, piece_hash: PieceHash, whole_sha256: bool) -> AnchorOptions {
        AnchorOptions { piece_bytes, piece_hash, whole_sha256, early_writeback: true }
    }

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

    /// The anchor of `inputs` at `step`, laid out in memory.
    fn anchor_of(inputs: &[FullInput<'_>], step: u64, metadata: &BTreeMap<String, String>) -> Delta {
        let tensors = diff::full(inputs).unwrap();
        Delta { tensors, step: Some(step), metadata: metadata.clone(), ..Delta::default() }
    }

    #[test]
    fn same_bytes_as_to_bytes_and_hash_matches() {
        let data: Vec<Vec<u8>> = [8usize, 4000, 3 * CHUNK_BYTES + 12]
            .iter()
            .map(|&n| (0..n).map(|i| (i * 7 % 251) as u8).collect())
            .collect();
        let inputs = inputs(&data);
        let metadata = BTreeMap::from([("who".to_owned(), "test".to_owned())]);
        // A tied name, written under t0, travels in the header too.
        let aliases = BTreeMap::from([("head".to_owned(), "t0".to_owned())]);
        let anchor = Delta { aliases: aliases.clone(), ..anchor_of(&inputs, 7, &metadata) };
        // The very bytes `encode` lays out in memory, checksum included, whether that is computed before the pass
        // (with the whole-file SHA-256) or hashed in it and written at the end (without).
        let expected = format::encode(&anchor).unwrap().to_vec();
        assert!(format::from_bytes(expected.clone(), "expected").is_ok());
        let header = format::read_header(&expected, "expected").unwrap();
        let checksum = base::parse_hex(&header.metadata[format::CHECKSUM_KEY]).unwrap();
        let folder = tempfile::tempdir().unwrap();
        let path = folder.path().join("anchor");
        for (piece_bytes, whole_sha256) in [(0, true), (MIN_PIECE_BYTES, false), (MIN_PIECE_BYTES, true)] {
            std::fs::write(&path, b"old, longer content that must be truncated away").unwrap();
            let written = write_anchor(
                &inputs,
                Some(7),
                &metadata,
                &aliases,
                &path,
                options(piece_bytes, PieceHash::Blake3, whole_sha256),
            )
            .unwrap();
            let file = std::fs::read(&path).unwrap();
            assert!(file == expected, "pieces {piece_bytes}, whole SHA-256 {whole_sha256}");
            assert_eq!(written.size, expected.len() as u64);
            assert_eq!(written.checksum, checksum);
            assert_eq!(written.sha256, whole_sha256.then(|| <[u8; 32]>::from(Sha256::digest(&expected))));
            assert_eq!(written.pieces, piece_hashes(&expected, piece_bytes, PieceHash::Blake3));
            let digest_inputs: Vec<digest::DigestInput<'_>> = inputs
                .iter()
                .map(|i| digest::DigestInput { name: &i.name, dtype: i.dtype, shape: &i.shape, data: i.data })
                .collect();
            assert_eq!(written.state_digest, digest::state_digest(&digest_inputs));

            let mapped = load_mapped(&path).unwrap();
            assert!(mapped.is_anchor());
            assert_eq!(mapped.aliases, aliases);
            let mut target = vec![0u8; data[2].len()];
            let index = mapped.position_of("t2").unwrap();
            crate::core::apply::apply(&mapped, vec![(index, &mut target[..])]).unwrap();
            assert_eq!(target, data[2]);
        }
        // A damaged anchor file is refused as such when read directly.
        let mut damaged = expected.clone();
        let last = damaged.len() - 1;
        damaged[last] ^= 1;
        std::fs::write(&path, &damaged).unwrap();
        let err = load_mapped(&path).err().unwrap().to_string();
        assert!(err.contains("damaged"), "{err}");
        assert!(load_mapped_with(&path, false).is_ok());
    }

    #[test]
    fn the_checksum_digits_written_at_the_end_rehash_every_piece_they_fall_in() {
        // Caller metadata of every length from 940 to 1010 bytes moves the digits across the first 1 KiB piece
        // boundary (they come after it in the sorted header: "a" < "file_xxh3").
        let data = vec![vec![5u8; 3000], vec![9u8; 12]];
        let inputs = inputs(&data);
        let folder = tempfile::tempdir().unwrap();
        let path = folder.path().join("anchor");
        std::fs::write(&path, b"").unwrap();
        let mut straddled = 0;
        for length in 940..1010 {
            let metadata = BTreeMap::from([("a".to_owned(), "x".repeat(length))]);
            let written = write_anchor(
                &inputs,
                Some(1),
                &metadata,
                &BTreeMap::new(),
                &path,
                options(MIN_PIECE_BYTES, PieceHash::Sha256, false),
            )
            .unwrap();
            let file = std::fs::read(&path).unwrap();
            assert_eq!(written.pieces, piece_hashes(&file, MIN_PIECE_BYTES, PieceHash::Sha256), "length {length}");
            let anchor = anchor_of(&inputs, 1, &metadata);
            assert!(file == format::encode(&anchor).unwrap().to_vec(), "length {length}");
            let at = memchr::memmem::find(&file, base::to_hex(written.checksum).as_bytes()).unwrap();
            straddled += usize::from(at / MIN_PIECE_BYTES != (at + 15) / MIN_PIECE_BYTES);
            assert!(load_mapped(&path).is_ok());
        }
        assert_eq!(straddled, 15);
    }

    #[cfg(unix)]
    #[test]
    fn a_pipe_gets_the_checksum_before_the_pass() {
        // A pipe cannot be rewritten in place: its reader gets the whole anchor, checksum included, in one pass.
        let data = vec![vec![3u8; 5000], vec![4u8; 8]];
        let inputs = inputs(&data);
        let folder = tempfile::tempdir().unwrap();
        let path = folder.path().join("pipe");
        let name = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        let reader = {
            let path = path.clone();
            std::thread::spawn(move || std::fs::read(path).unwrap())
        };
        let written = write_anchor(
            &inputs,
            Some(2),
            &BTreeMap::new(),
            &BTreeMap::new(),
            &path,
            options(MIN_PIECE_BYTES, PieceHash::Blake3, false),
        )
        .unwrap();
        let received = reader.join().unwrap();
        let anchor = anchor_of(&inputs, 2, &BTreeMap::new());
        assert!(received == format::encode(&anchor).unwrap().to_vec());
        assert_eq!(written.pieces, piece_hashes(&received, MIN_PIECE_BYTES, PieceHash::Blake3));
        assert!(format::from_bytes(received, "pipe").is_ok());
    }

    #[test]
    fn a_file_whose_writer_stopped_before_the_checksum_says_so() {
        let data = vec![vec![3u8; 5000]];
        let inputs = inputs(&data);
        let anchor = anchor_of(&inputs, 2, &BTreeMap::new());
        let mut unsealed = format::encode_with(&anchor, Checksum::Placeholder).unwrap().to_vec();
        let err = format::from_bytes(unsealed.clone(), "unsealed").err().unwrap().to_string();
        assert!(err.contains("still the writer's placeholder"), "{err}");
        let last = unsealed.len() - 1;
        unsealed.truncate(last);
        let err = format::from_bytes(unsealed, "cut").err().unwrap().to_string();
        assert!(err.contains("still the writer's placeholder"), "{err}");
    }

    #[test]
    fn refuses_bad_names_before_writing() {
        let data = vec![vec![0u8; 4]];
        let mut inputs = inputs(&data);
        inputs[0].name = "x:pos".into();
        let folder = tempfile::tempdir().unwrap();
        let path = folder.path().join("anchor");
        std::fs::write(&path, b"kept").unwrap();
        assert!(write_anchor(
            &inputs,
            None,
            &BTreeMap::new(),
            &BTreeMap::new(),
            &path,
            options(0, PieceHash::Sha256, true)
        )
        .is_err());
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
                assert_eq!(file_piece_hashes(&path, piece_bytes, PieceHash::Sha256).unwrap(), expected);
                let expected: Vec<[u8; 32]> = data.chunks(piece_bytes).map(|p| *blake3::hash(p).as_bytes()).collect();
                assert_eq!(file_piece_hashes(&path, piece_bytes, PieceHash::Blake3).unwrap(), expected);
            }
        }
        assert!(file_piece_hashes(&path, 0, PieceHash::Blake3).is_err());
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
            for (kind, whole_sha256) in
                [(PieceHash::Sha256, true), (PieceHash::Blake3, true), (PieceHash::Blake3, false)]
            {
                let written = write_anchor(
                    &inputs,
                    Some(3),
                    &BTreeMap::new(),
                    &BTreeMap::new(),
                    &path,
                    options(piece_bytes, kind, whole_sha256),
                )
                .unwrap();
                let file = std::fs::read(&path).unwrap();
                let expected: Vec<[u8; 32]> = match kind {
                    PieceHash::Sha256 => file.chunks(piece_bytes).map(|p| Sha256::digest(p).into()).collect(),
                    PieceHash::Blake3 => file.chunks(piece_bytes).map(|p| *blake3::hash(p).as_bytes()).collect(),
                };
                assert_eq!(written.pieces, expected, "piece size {piece_bytes}, {kind:?}");
                assert_eq!(written.pieces, piece_hashes(&file, piece_bytes, kind));
                assert_eq!(written.sha256, whole_sha256.then(|| <[u8; 32]>::from(Sha256::digest(&file))));
            }
        }
        for bad in [1usize, 512, 3 << 10, 2 << 30] {
            let written = write_anchor(
                &inputs,
                None,
                &BTreeMap::new(),
                &BTreeMap::new(),
                &path,
                options(bad, PieceHash::Blake3, true),
            );
            assert!(written.is_err(), "piece size {bad}");
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
        let size = data.len() as u64;
        let checked = |size: u64, piece_bytes: usize, expected: &'static [[u8; 32]]| CheckedSource {
            path: Box::leak(source.clone().into_boxed_path()),
            size,
            piece_bytes,
            kind: PieceHash::Sha256,
            expected,
        };
        let hashes: &'static [[u8; 32]] = hashes.leak();
        // Segments out of order, one crossing the 8 MiB read groups and piece edges, one ending at the file's end.
        let segments = [
            Segment { from: (8 << 20) - 100, len: 300, to: 0 },
            Segment { from: 5, len: 70_000, to: 300 },
            Segment { from: data.len() as u64 - 50, len: 50, to: 70_300 },
        ];
        std::fs::write(&dest, vec![0u8; 70_350]).unwrap();
        assert_eq!(copy_checked_pieces(&checked(size, piece_bytes, hashes), &dest, &segments).unwrap(), None);
        let mut expected = data[(8 << 20) - 100..(8 << 20) + 200].to_vec();
        expected.extend_from_slice(&data[5..70_005]);
        expected.extend_from_slice(&data[data.len() - 50..]);
        assert_eq!(std::fs::read(&dest).unwrap(), expected);

        // A source of another size is refused before anything is read; so are hashes that do not count its pieces.
        std::fs::write(&dest, b"").unwrap();
        let outcome = copy_checked_pieces(&checked(size + 1, piece_bytes, hashes), &dest, &segments[..1]).unwrap();
        assert_eq!(outcome, Some(Unchecked::Size(size)));
        assert!(std::fs::read(&dest).unwrap().is_empty());
        assert!(copy_checked_pieces(&checked(size, piece_bytes, &hashes[1..]), &dest, &[]).is_err());
        // Changed bytes in pieces the segments touch: each touched piece is checked and the first bad one named.
        let mut tampered = data.clone();
        tampered[piece_bytes + 9] ^= 1;
        tampered[data.len() - 1] ^= 1;
        std::fs::write(&source, &tampered).unwrap();
        std::fs::write(&dest, vec![0u8; 70_350]).unwrap();
        let outcome = copy_checked_pieces(&checked(size, piece_bytes, hashes), &dest, &segments).unwrap();
        assert_eq!(outcome, Some(Unchecked::Piece(1)));
        // Nothing of the bad piece's read group was written (here: pieces 0 and 1, the second segment's).
        assert!(std::fs::read(&dest).unwrap()[300..70_300].iter().all(|&b| b == 0));

        // Only the pieces the segments touch are read: a bad piece elsewhere is not this copy's concern.
        let untouched = [Segment { from: 4 * piece_bytes as u64, len: 100, to: 0 }];
        assert_eq!(copy_checked_pieces(&checked(size, piece_bytes, hashes), &dest, &untouched).unwrap(), None);
        assert_eq!(std::fs::read(&dest).unwrap()[..100], tampered[4 * piece_bytes..4 * piece_bytes + 100]);

        // Bad arguments are refused before anything is read.
        assert!(copy_checked_pieces(&checked(size, 0, hashes), &dest, &[]).is_err());
        let outside = [Segment { from: size - 1, len: 2, to: 0 }];
        assert!(copy_checked_pieces(&checked(size, piece_bytes, hashes), &dest, &outside).is_err());
        let overlapping = [Segment { from: 0, len: 10, to: 0 }, Segment { from: 9, len: 1, to: 20 }];
        assert!(copy_checked_pieces(&checked(size, piece_bytes, hashes), &dest, &overlapping).is_err());
    }

    #[test]
    fn fill_checked_fills_targets_with_checked_bytes_only() {
        let folder = tempfile::tempdir().unwrap();
        let source = folder.path().join("source");
        let data: Vec<u8> = (0..(17 << 20) + 333).map(|i: usize| (i * 29 + i / 1000) as u8).collect();
        std::fs::write(&source, &data).unwrap();
        let piece_bytes = 1 << 18;
        for kind in [PieceHash::Sha256, PieceHash::Blake3] {
            let hashes = piece_hashes(&data, piece_bytes, kind);
            let checked =
                CheckedSource { path: &source, size: data.len() as u64, piece_bytes, kind, expected: &hashes };
            // Three targets that tile the file after a 1000-byte "header", given out of order; one is empty.
            let cuts = [1000usize, 1000, (9 << 20) + 7, data.len()];
            let mut buffers: Vec<Vec<u8>> = cuts.windows(2).map(|w| vec![0xAA; w[1] - w[0]]).collect();
            let fills = [(cuts[2] as u64, 2), (1000, 0), (1000, 1)];
            let mut targets: Vec<&mut [u8]> = buffers.iter_mut().map(|b| &mut b[..]).collect();
            assert_eq!(fill_checked(&checked, &mut targets, &fills).unwrap(), None);
            for (buffer, w) in buffers.iter().zip(cuts.windows(2)) {
                assert!(buffer[..] == data[w[0]..w[1]]);
            }
            // One changed byte: the first bad piece is named, and nothing of its read group is written (the
            // header's piece is checked too, though no target takes its first bytes).
            for at in [3usize, (9 << 20) + 5, data.len() - 1] {
                let mut tampered = data.clone();
                tampered[at] ^= 0x40;
                std::fs::write(&source, &tampered).unwrap();
                let mut buffer = vec![0xAA; data.len() - 1000];
                let mut targets: Vec<&mut [u8]> = vec![&mut buffer[..]];
                let outcome = fill_checked(&checked, &mut targets, &[(1000, 0)]).unwrap();
                assert_eq!(outcome, Some(Unchecked::Piece(at / piece_bytes)), "{kind:?} {at}");
                let group = at / READ_BYTES * READ_BYTES;
                let (lo, hi) = (group.max(1000) - 1000, (group + READ_BYTES).min(data.len()) - 1000);
                assert!(buffer[lo..hi].iter().all(|&b| b == 0xAA), "{kind:?} {at}: its group is not written");
                assert!(buffer[hi..] == data[hi + 1000..], "{kind:?} {at}: later groups are");
            }
            std::fs::write(&source, &data).unwrap();
            // A target filled twice, or one that does not exist, is refused; so is a fill past the file's end.
            let mut buffers = [vec![0u8; 10], vec![0u8; 10]];
            let mut targets: Vec<&mut [u8]> = buffers.iter_mut().map(|b| &mut b[..]).collect();
            assert!(fill_checked(&checked, &mut targets, &[(0, 0), (20, 0)]).is_err());
            assert!(fill_checked(&checked, &mut targets, &[(0, 2)]).is_err());
            assert!(fill_checked(&checked, &mut targets, &[(data.len() as u64 - 5, 1)]).is_err());
            let longer = [data.as_slice(), &[0]].concat();
            let hashes_longer = piece_hashes(&longer, piece_bytes, kind);
            let other_size = CheckedSource { size: longer.len() as u64, expected: &hashes_longer, ..checked };
            let outcome = fill_checked(&other_size, &mut targets, &[(0, 0)]).unwrap();
            assert_eq!(outcome, Some(Unchecked::Size(data.len() as u64)));
            assert!(buffers.iter().all(|b| b.iter().all(|&x| x == 0)));
        }
    }

    /// A small checked source: 5000 bytes in 1 KiB SHA-256 pieces.
    fn small_source(folder: &Path) -> (std::path::PathBuf, Vec<u8>, Vec<[u8; 32]>) {
        let path = folder.join("source");
        let data: Vec<u8> = (0..5000u32).map(|i| (i * 7 + i / 1024) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let hashes = piece_hashes(&data, MIN_PIECE_BYTES, PieceHash::Sha256);
        (path, data, hashes)
    }

    /// `small_source`'s file checked against its pieces.
    fn small_checked<'a>(path: &'a Path, data: &[u8], hashes: &'a [[u8; 32]]) -> CheckedSource<'a> {
        CheckedSource {
            path,
            size: data.len() as u64,
            piece_bytes: MIN_PIECE_BYTES,
            kind: PieceHash::Sha256,
            expected: hashes,
        }
    }

    #[test]
    fn segments_whose_ends_overflow_are_refused() {
        let folder = tempfile::tempdir().unwrap();
        let (path, data, hashes) = small_source(folder.path());
        let checked = small_checked(&path, &data, &hashes);
        // Its end in the source overflows: outside the source, never a wrapped (empty) range of pieces.
        assert!(checked.open(&[Segment { from: u64::MAX - 5, len: 10, to: 0 }]).is_err());
        // A fill at such an offset is an error, not Ok(None) with its target never written.
        let mut buffer = [0xAAu8; 10];
        let mut targets: Vec<&mut [u8]> = vec![&mut buffer[..]];
        assert!(fill_checked(&checked, &mut targets, &[(u64::MAX - 5, 0)]).is_err());
        assert!(buffer.iter().all(|&b| b == 0xAA));
        // Its end in the destination overflows: refused before anything is written at a wrapped offset.
        assert!(checked.open(&[Segment { from: 0, len: 10, to: u64::MAX - 5 }]).is_err());
        let dest = folder.path().join("dest");
        std::fs::write(&dest, b"").unwrap();
        let outcome = copy_checked_pieces(&checked, &dest, &[Segment { from: 0, len: 10, to: u64::MAX - 5 }]);
        assert!(outcome.is_err());
        assert!(std::fs::read(&dest).unwrap().is_empty());
    }

    #[test]
    fn a_source_that_grew_or_hashes_for_more_pieces_are_refused() {
        let folder = tempfile::tempdir().unwrap();
        let (path, data, hashes) = small_source(folder.path());
        let checked = small_checked(&path, &data, &hashes);
        // One hash more than the source has pieces: the hashes are not this source's.
        let extra = [hashes.as_slice(), &[[0u8; 32]]].concat();
        assert!(CheckedSource { expected: &extra, ..checked }.open(&[]).is_err());
        // A source longer than its expected size (it changed since): Size, and nothing written.
        std::fs::write(&path, [data.as_slice(), b"x"].concat()).unwrap();
        let dest = folder.path().join("dest");
        std::fs::write(&dest, vec![0u8; 10]).unwrap();
        let outcome = copy_checked_pieces(&checked, &dest, &[Segment { from: 0, len: 10, to: 0 }]).unwrap();
        assert_eq!(outcome, Some(Unchecked::Size(data.len() as u64 + 1)));
        assert_eq!(std::fs::read(&dest).unwrap(), vec![0u8; 10]);
        let mut buffer = [0xAAu8; 10];
        let mut targets: Vec<&mut [u8]> = vec![&mut buffer[..]];
        let outcome = fill_checked(&checked, &mut targets, &[(0, 0)]).unwrap();
        assert_eq!(outcome, Some(Unchecked::Size(data.len() as u64 + 1)));
        assert!(buffer.iter().all(|&b| b == 0xAA));
    }

    #[test]
    fn only_the_pieces_a_segment_touches_are_checked() {
        // A changed piece a read group could reach but no segment touches is not this copy's concern.
        let folder = tempfile::tempdir().unwrap();
        let (path, data, hashes) = small_source(folder.path());
        let mut changed = data.clone();
        changed[4 * MIN_PIECE_BYTES + 3] ^= 1;
        std::fs::write(&path, &changed).unwrap();
        let checked = small_checked(&path, &data, &hashes);
        let mut buffer = [0u8; 100];
        let mut targets: Vec<&mut [u8]> = vec![&mut buffer[..]];
        assert_eq!(fill_checked(&checked, &mut targets, &[(MIN_PIECE_BYTES as u64 + 5, 0)]).unwrap(), None);
        assert!(buffer[..] == data[MIN_PIECE_BYTES + 5..MIN_PIECE_BYTES + 105]);
        let mut buffer = [0u8; 100];
        let mut targets: Vec<&mut [u8]> = vec![&mut buffer[..]];
        let outcome = fill_checked(&checked, &mut targets, &[(4 * MIN_PIECE_BYTES as u64, 0)]).unwrap();
        assert_eq!(outcome, Some(Unchecked::Piece(4)));
    }
}
