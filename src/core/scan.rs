//! The bit-compare kernel shared by `diff` and `mirror`: finds the differing elements of one range of a tensor
//! and writes their gap varints and values.
//!
//! The range is read in 64-byte blocks. Each block gives a 64-bit mask of differing bytes (one AVX-512BW
//! compare, two AVX2 compares or four SSE2 compares, picked at run time; plain word XORs elsewhere), which is
//! folded to one bit per element and walked with `trailing_zeros`. Streams are written through raw stores
//! after one capacity check per block that has changes, by the codec's inline encoders (`varint::put`,
//! `values::put_diff`), so a change costs a few instructions and no branch that depends on the data except the
//! rare long gap and value escape.

use crate::core::base;
use crate::core::codec::elements::{load_const, store_const};
use crate::core::codec::ranges::Changes;
use crate::core::codec::{values, varint, with_width, ValueCodec, WordSink};
use crate::core::xxh3;

/// Bytes compared at once.
pub const BLOCK_BYTES: usize = 64;

/// Appends through unaligned 8-byte stores: `open` makes room and takes the write position into a local pointer
/// (so that no store to the buffer makes the compiler reload the vector's length), `close` sets the length.
struct Sink<'a> {
    buf: &'a mut Vec<u8>,
    at: *mut u8,
}

impl<'a> Sink<'a> {
    fn new(buf: &'a mut Vec<u8>) -> Self {
        Sink { buf, at: std::ptr::null_mut() }
    }

    #[inline(always)]
    fn open(&mut self, room: usize) {
        self.buf.reserve(room);
        // SAFETY: `len <= capacity`.
        self.at = unsafe { self.buf.as_mut_ptr().add(self.buf.len()) };
    }

    /// # Safety
    /// After `open`, with every put within the room.
    #[inline(always)]
    unsafe fn close(&mut self) {
        let len = self.at.offset_from(self.buf.as_ptr()) as usize;
        debug_assert!(len <= self.buf.capacity());
        self.buf.set_len(len);
    }
}

impl WordSink for Sink<'_> {
    /// Safe between `open` and `close`, with the room asked for not yet used up, 8 bytes of overhang included.
    #[inline(always)]
    unsafe fn put(&mut self, word: u64, len: usize) {
        std::ptr::write_unaligned(self.at.cast::<u64>(), word.to_le());
        self.at = self.at.add(len);
    }
}

/// Differing-byte mask of one 64-byte block: bit `i` is set iff byte `i` differs.
trait BlockMask {
    /// # Safety
    /// `old` and `new` point at 64 readable bytes, and the CPU has the kernel's features.
    unsafe fn mask(old: *const u8, new: *const u8) -> u64;

    /// True when the kernel hashes the base identity blocks of `old` stripe by stripe as it compares them
    /// (`accumulate`, `scramble`: core::xxh3); the others hash them with `base::block_hash` before the compare.
    const FUSED_HASH: bool = false;

    /// Adds the 64-byte stripe at `data` to XXH3's accumulators, with the secret's key at `key`.
    ///
    /// # Safety
    /// 64 readable bytes at both, and the CPU has the kernel's features.
    #[inline(always)]
    unsafe fn accumulate(_acc: &mut [u64; 8], _data: *const u8, _key: *const u8) {
        unreachable!("only kernels with FUSED_HASH accumulate")
    }

    /// XXH3's scramble of the accumulators after a round.
    ///
    /// # Safety
    /// The CPU has the kernel's features.
    #[inline(always)]
    unsafe fn scramble(_acc: &mut [u64; 8]) {
        unreachable!("only kernels with FUSED_HASH scramble")
    }
}

const _: () = assert!(xxh3::STRIPE == BLOCK_BYTES);

/// Word XORs; any target.
struct Portable;

impl BlockMask for Portable {
    #[inline(always)]
    unsafe fn mask(old: *const u8, new: *const u8) -> u64 {
        const LOW7: u64 = 0x7f7f_7f7f_7f7f_7f7f;
        const HIGH: u64 = 0x8080_8080_8080_8080;
        let mut mask = 0u64;
        for k in 0..BLOCK_BYTES / 8 {
            let x = std::ptr::read_unaligned(old.add(8 * k).cast::<u64>())
                ^ std::ptr::read_unaligned(new.add(8 * k).cast::<u64>());
            let x = u64::from_le(x);
            // High bit of each byte set iff the byte is non-zero, then gather the eight high bits.
            let nonzero = (((x & LOW7) + LOW7) | x) & HIGH;
            mask |= ((nonzero >> 7).wrapping_mul(0x0102_0408_1020_4080) >> 56) << (8 * k);
        }
        mask
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// SSE2 is part of x86-64, so this kernel needs no detection.
    pub struct Sse2;
    pub struct Avx2;
    pub struct Avx512;

    impl super::BlockMask for Sse2 {
        #[inline(always)]
        unsafe fn mask(old: *const u8, new: *const u8) -> u64 {
            let mut mask = 0u64;
            for k in 0..4 {
                let a = _mm_loadu_si128(old.add(16 * k).cast());
                let b = _mm_loadu_si128(new.add(16 * k).cast());
                let equal = _mm_movemask_epi8(_mm_cmpeq_epi8(a, b)) as u32 as u64;
                mask |= (!equal & 0xffff) << (16 * k);
            }
            mask
        }
    }

    impl super::BlockMask for Avx2 {
        #[inline(always)]
        unsafe fn mask(old: *const u8, new: *const u8) -> u64 {
            avx2_mask(old, new)
        }

        const FUSED_HASH: bool = true;

        #[inline(always)]
        unsafe fn accumulate(acc: &mut [u64; 8], data: *const u8, key: *const u8) {
            crate::core::xxh3::x86::accumulate_avx2(acc, data, key)
        }

        #[inline(always)]
        unsafe fn scramble(acc: &mut [u64; 8]) {
            crate::core::xxh3::x86::scramble_avx2(acc)
        }
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn avx2_mask(old: *const u8, new: *const u8) -> u64 {
        let low =
            _mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_loadu_si256(old.cast()), _mm256_loadu_si256(new.cast())));
        let high = _mm256_movemask_epi8(_mm256_cmpeq_epi8(
            _mm256_loadu_si256(old.add(32).cast()),
            _mm256_loadu_si256(new.add(32).cast()),
        ));
        !((low as u32 as u64) | ((high as u32 as u64) << 32))
    }

    impl super::BlockMask for Avx512 {
        #[inline(always)]
        unsafe fn mask(old: *const u8, new: *const u8) -> u64 {
            avx512_mask(old, new)
        }

        const FUSED_HASH: bool = true;

        #[inline(always)]
        unsafe fn accumulate(acc: &mut [u64; 8], data: *const u8, key: *const u8) {
            crate::core::xxh3::x86::accumulate_avx512(acc, data, key)
        }

        #[inline(always)]
        unsafe fn scramble(acc: &mut [u64; 8]) {
            crate::core::xxh3::x86::scramble_avx512(acc)
        }
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn avx512_mask(old: *const u8, new: *const u8) -> u64 {
        _mm512_cmpneq_epi8_mask(_mm512_loadu_si512(old.cast()), _mm512_loadu_si512(new.cast()))
    }

    #[target_feature(enable = "avx2,bmi1")]
    pub unsafe fn scan_avx2<const W: usize, const COPY: bool>(
        old: *mut u8,
        new: *const u8,
        len: usize,
        first_element: u64,
        codec: super::ValueCodec,
        hashes: &mut [u64],
        out: &mut super::Changes,
    ) {
        super::scan_blocks::<W, COPY, Avx2>(old, new, len, first_element, codec, hashes, out)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx2,bmi1")]
    pub unsafe fn scan_avx512<const W: usize, const COPY: bool>(
        old: *mut u8,
        new: *const u8,
        len: usize,
        first_element: u64,
        codec: super::ValueCodec,
        hashes: &mut [u64],
        out: &mut super::Changes,
    ) {
        super::scan_blocks::<W, COPY, Avx512>(old, new, len, first_element, codec, hashes, out)
    }
}

/// One bit per element, at the element's first byte, from a differing-byte mask.
#[inline(always)]
fn element_bits<const W: usize>(bytes: u64) -> u64 {
    match W {
        1 => bytes,
        2 => (bytes | bytes >> 1) & 0x5555_5555_5555_5555,
        4 => {
            let t = bytes | bytes >> 1;
            (t | t >> 2) & 0x1111_1111_1111_1111
        }
        _ => {
            let t = bytes | bytes >> 1;
            let t = t | t >> 2;
            (t | t >> 4) & 0x0101_0101_0101_0101
        }
    }
}

/// Changes collected before they are encoded: the byte offsets of up to this many (plus one block's worth).
const BATCH: usize = 64;
/// Blocks with changes noted before their changes are gathered.
const MARKS: usize = 16;

/// Room for one batch's gaps: at most ten bytes each, plus the 8-byte store's overhang.
const fn positions_room<const W: usize>() -> usize {
    (BATCH + BLOCK_BYTES / W) * 10 + 8
}

/// Room for one batch's values: at most 1 + W bytes each, plus the overhang.
const fn values_room<const W: usize>() -> usize {
    (BATCH + BLOCK_BYTES / W) * (1 + W) + 8
}

/// The range being scanned: its two buffers, the element at their start, and the value codec.
#[derive(Clone, Copy)]
struct Range {
    old: *mut u8,
    new: *const u8,
    first_element: u64,
    codec: ValueCodec,
}

/// Where an encoding pass stands: changes so far, the first one's position, and the position after the last.
#[derive(Clone, Copy)]
struct Cursor {
    count: u64,
    first: u64,
    next_expected: u64,
}

/// Encodes the changes at byte offsets `batch` (ascending) of the range starting at element `first_element`:
/// gap varints and values, and with `COPY` the new bits into `old`. Only the rare long gap and (for 8-byte
/// elements) value escape branch on the data. `ahead` (0 for none) is where prefetching of the lines still to be
/// compared goes on meanwhile.
#[inline(always)]
unsafe fn encode_batch<const W: usize, const COPY: bool>(
    batch: &[u32],
    ahead: usize,
    range: Range,
    cursor: &mut Cursor,
    positions: &mut Sink<'_>,
    values: &mut Sink<'_>,
) {
    let Range { old, new, first_element, codec } = range;
    positions.open(positions_room::<W>());
    values.open(values_room::<W>());
    let Cursor { mut count, mut first, mut next_expected } = *cursor;
    for (index, &offset) in batch.iter().enumerate() {
        // Keep memory busy while encoding too: one block further ahead of the compare per two changes.
        if ahead != 0 && index % 2 == 0 {
            let at = ahead + BLOCK_BYTES * (index / 2);
            prefetch(old.wrapping_add(at));
            prefetch(new.wrapping_add(at));
        }
        let offset = offset as usize;
        let position = first_element + (offset / W) as u64;
        if count == 0 {
            first = position;
        } else {
            varint::put(positions, position - next_expected);
        }
        next_expected = position + 1;
        count += 1;
        let new_bits = load_const::<W>(std::slice::from_raw_parts(new.add(offset), W));
        match codec {
            ValueCodec::Abs => values::put_abs::<W, _>(values, new_bits),
            ValueCodec::Diff | ValueCodec::DiffBits | ValueCodec::Rans | ValueCodec::RansClasses => {
                let old_bits = load_const::<W>(std::slice::from_raw_parts(old.add(offset), W));
                values::put_diff::<W, _>(values, old_bits, new_bits);
            }
        }
        if COPY {
            // The bits just encoded, not `new` read again: were the caller's state written by another thread
            // meanwhile, the mirror still ends where the delta leads (a torn step, but one its delta reaches).
            store_const::<W>(std::slice::from_raw_parts_mut(old.add(offset), W), new_bits);
        }
    }
    *cursor = Cursor { count, first, next_expected };
    positions.close();
    values.close();
}

/// How far ahead of the compare the two ranges are prefetched. The hardware streamer stops at page boundaries
/// and waits while changes are encoded; asking for the lines a few pages ahead keeps memory busy meanwhile.
const PREFETCH_BYTES: usize = 2048;

/// A hint to start loading the line at `p`; never faults, so it may point past the end of the range.
#[inline(always)]
unsafe fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// The scan proper, for one element width, with or without copying the changed elements of `new` into `old`.
///
/// The blocks are walked first, writing the byte offset of each change into a small batch; the batch is then
/// encoded in a loop whose trip count is known, so a block costs no mispredicted loop exit.
///
/// `hashes` receives the XXH3-64 (`base::block_hash`) of the first `hashes.len()` whole base identity blocks of
/// `old`, as they were before the scan: kernels with `FUSED_HASH` hash each stripe just before comparing it (and
/// before any change in it is copied), so the range is read once for both.
#[inline(always)]
unsafe fn scan_blocks<const W: usize, const COPY: bool, K: BlockMask>(
    old: *mut u8,
    new: *const u8,
    len: usize,
    first_element: u64,
    codec: ValueCodec,
    hashes: &mut [u64],
    out: &mut Changes,
) {
    debug_assert!(len <= u32::MAX as usize);
    debug_assert!(hashes.len() * base::BLOCK_BYTES <= len);
    let range = Range { old, new, first_element, codec };
    let mut cursor = Cursor {
        count: out.count,
        first: out.first_position,
        next_expected: if out.count > 0 { out.last_position + 1 } else { first_element },
    };
    let mut positions = Sink::new(&mut out.positions);
    let mut values = Sink::new(&mut out.values);
    let mut batch = [0u32; BATCH + BLOCK_BYTES];
    let mut pending = 0usize;
    // Blocks with changes, noted without a branch: (element bits, byte offset).
    let mut marks = [(0u64, 0u32); MARKS + 1];
    let mut marked = 0usize;
    macro_rules! drain_marks {
        ($scanned:expr) => {
            for (ahead, &(mut bits, base)) in marks[..marked].iter().enumerate() {
                // Keep memory busy while the cores encode: one more block ahead of the compare per block drained.
                let at = $scanned + PREFETCH_BYTES + BLOCK_BYTES * (ahead + 1);
                prefetch(old.wrapping_add(at));
                prefetch(new.wrapping_add(at));
                let found = bits.count_ones() as usize;
                // Four offsets unconditionally (slots past `found` are overwritten later), the rest in a loop
                // that dense blocks alone enter.
                for slot in 0..4 {
                    *batch.get_unchecked_mut(pending + slot) = base + bits.trailing_zeros();
                    bits &= bits.wrapping_sub(1);
                }
                let mut slot = pending + 4;
                while bits != 0 {
                    *batch.get_unchecked_mut(slot) = base + bits.trailing_zeros();
                    bits &= bits - 1;
                    slot += 1;
                }
                pending += found;
                if pending >= BATCH {
                    encode_batch::<W, COPY>(
                        &batch[..pending],
                        $scanned + PREFETCH_BYTES + BLOCK_BYTES * (marked + 1),
                        range,
                        &mut cursor,
                        &mut positions,
                        &mut values,
                    );
                    pending = 0;
                }
            }
        };
    }
    let blocks_end = len / BLOCK_BYTES * BLOCK_BYTES;
    let mut offset = 0;
    macro_rules! compare_block {
        () => {
            prefetch(old.wrapping_add(offset + PREFETCH_BYTES));
            prefetch(new.wrapping_add(offset + PREFETCH_BYTES));
            let bits = element_bits::<W>(K::mask(old.add(offset), new.add(offset)));
            *marks.get_unchecked_mut(marked) = (bits, offset as u32);
            marked += usize::from(bits != 0);
            if marked == MARKS {
                drain_marks!(offset);
                marked = 0;
            }
            offset += BLOCK_BYTES;
        };
    }
    if K::FUSED_HASH {
        let secret = xxh3::SECRET.as_ptr();
        for slot in hashes.iter_mut() {
            let mut acc = xxh3::INIT;
            for round in 0..xxh3::ROUNDS {
                for stripe in 0..xxh3::STRIPES {
                    // Before the compare: the drain it may start copies changes into this stripe.
                    K::accumulate(&mut acc, old.add(offset), secret.add(xxh3::key_offset(round, stripe)));
                    compare_block!();
                }
                if round + 1 < xxh3::ROUNDS {
                    K::scramble(&mut acc);
                }
            }
            *slot = xxh3::merge(&acc);
        }
    } else {
        // Every block is hashed before the compare copies any change into it.
        for (index, slot) in hashes.iter_mut().enumerate() {
            *slot = base::block_hash(std::slice::from_raw_parts(old.add(index * base::BLOCK_BYTES), base::BLOCK_BYTES));
        }
    }
    while offset < blocks_end {
        compare_block!();
    }
    drain_marks!(offset);
    while offset < len {
        if std::slice::from_raw_parts(old.add(offset), W) != std::slice::from_raw_parts(new.add(offset), W) {
            batch[pending] = offset as u32;
            pending += 1;
        }
        offset += W;
    }
    encode_batch::<W, COPY>(&batch[..pending], 0, range, &mut cursor, &mut positions, &mut values);
    if cursor.count > out.count {
        out.last_position = cursor.next_expected - 1;
    }
    out.count = cursor.count;
    out.first_position = cursor.first;
}

/// A `take` that keeps a copy of the changes.
pub fn owned(changes: &Changes, _hashes: &[u64]) -> Changes {
    changes.clone()
}

/// Batches hold 32-bit offsets: longer ranges are scanned piece by piece.
const PIECE_BYTES: usize = 1 << 30;

/// Scans in pieces of at most `piece` bytes and hands the joined changes to `take`. A range of one piece is
/// scanned into this thread's scratch `Changes`, whose streams keep their capacity from call to call, so that
/// the encoder writes into lines already in cache and streams never grow by reallocation; `take` copies out what
/// it keeps.
#[allow(clippy::too_many_arguments)]
fn scan_pieces_then<const W: usize, const COPY: bool, R>(
    old: *mut u8,
    new: *const u8,
    len: usize,
    first_element: u64,
    codec: ValueCodec,
    hashes: &mut [u64],
    piece: usize,
    take: impl FnOnce(&Changes, &[u64]) -> R,
) -> R {
    if len > piece {
        debug_assert!(hashes.is_empty() || piece.is_multiple_of(base::BLOCK_BYTES));
        let mut out = Changes::default();
        let mut start = 0;
        while start < len {
            // SAFETY: `start < len`, inside both ranges.
            let (old, new) = unsafe { (old.add(start), new.add(start)) };
            let piece_len = (len - start).min(piece);
            let first_hash = (start / base::BLOCK_BYTES).min(hashes.len());
            let last_hash = ((start + piece_len) / base::BLOCK_BYTES).min(hashes.len());
            let part = scan_pieces_then::<W, COPY, _>(
                old,
                new,
                piece_len,
                first_element + (start / W) as u64,
                codec,
                &mut hashes[first_hash..last_hash],
                piece,
                owned,
            );
            out.append(part);
            start += piece;
        }
        return take(&out, hashes);
    }
    thread_local! {
        static SCRATCH: std::cell::RefCell<Changes> = std::cell::RefCell::new(Changes::default());
    }
    // SAFETY (both calls): the callers pass two ranges of `len` bytes (the first writable when COPY), and each
    // kernel runs only where the CPU reports its features.
    SCRATCH.with(|cell| {
        let Ok(mut scratch) = cell.try_borrow_mut() else {
            // Only if `take` itself scans on this thread: use a fresh buffer.
            let mut out = Changes::default();
            unsafe { dispatch::<W, COPY>(old, new, len, first_element, codec, hashes, &mut out) };
            return take(&out, hashes);
        };
        scratch.count = 0;
        scratch.positions.clear();
        scratch.values.clear();
        unsafe { dispatch::<W, COPY>(old, new, len, first_element, codec, hashes, &mut scratch) };
        let result = take(&scratch, hashes);
        if scratch.positions.capacity() + scratch.values.capacity() > SCRATCH_KEEP_BYTES {
            *scratch = Changes::default();
        }
        result
    })
}

/// Scratch streams kept beyond this many bytes of capacity are given back after use.
const SCRATCH_KEEP_BYTES: usize = 8 << 20;

/// Appends the changes of one range of at most `PIECE_BYTES` to `out`, with the best kernel.
///
/// # Safety
/// As `scan_blocks`.
unsafe fn dispatch<const W: usize, const COPY: bool>(
    old: *mut u8,
    new: *const u8,
    len: usize,
    first_element: u64,
    codec: ValueCodec,
    hashes: &mut [u64],
    out: &mut Changes,
) {
    #[cfg(target_arch = "x86_64")]
    match kernel() {
        Kernel::Avx512 => x86::scan_avx512::<W, COPY>(old, new, len, first_element, codec, hashes, out),
        Kernel::Avx2 => x86::scan_avx2::<W, COPY>(old, new, len, first_element, codec, hashes, out),
        Kernel::Sse2 => scan_blocks::<W, COPY, x86::Sse2>(old, new, len, first_element, codec, hashes, out),
        Kernel::Portable => scan_blocks::<W, COPY, Portable>(old, new, len, first_element, codec, hashes, out),
    }
    #[cfg(not(target_arch = "x86_64"))]
    scan_blocks::<W, COPY, Portable>(old, new, len, first_element, codec, hashes, out);
}

/// Which block kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    Portable,
    Sse2,
    Avx2,
    Avx512,
}

impl Kernel {
    /// Every kernel, slowest first.
    pub const ALL: [Kernel; 4] = [Kernel::Portable, Kernel::Sse2, Kernel::Avx2, Kernel::Avx512];

    pub fn name(self) -> &'static str {
        match self {
            Kernel::Portable => "portable",
            Kernel::Sse2 => "sse2",
            Kernel::Avx2 => "avx2",
            Kernel::Avx512 => "avx512",
        }
    }
}

/// The fastest kernel this CPU has, unless `DELTASYNC_SCAN_KERNEL` (portable, sse2, avx2, avx512) asks for a
/// slower one; read once per process.
pub fn kernel() -> Kernel {
    // An atomic, not a `OnceLock`: a fork() while another thread ran the `OnceLock`'s initialiser left the child
    // waiting for it forever (tests/test_fork.py). Threads that race here compute the same kernel.
    static KERNEL: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(u8::MAX);
    let cached = KERNEL.load(std::sync::atomic::Ordering::Relaxed);
    if let Some(&kernel) = Kernel::ALL.iter().find(|k| **k as u8 == cached) {
        return kernel;
    }
    let best = best_kernel();
    let wanted = std::env::var("DELTASYNC_SCAN_KERNEL").unwrap_or_default();
    let asked = Kernel::ALL.into_iter().find(|k| k.name() == wanted.trim()).unwrap_or(best);
    // Never more than the CPU has.
    let kernel = if (asked as u8) <= (best as u8) { asked } else { best };
    KERNEL.store(kernel as u8, std::sync::atomic::Ordering::Relaxed);
    kernel
}

fn best_kernel() -> Kernel {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("bmi1")
        {
            return Kernel::Avx512;
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("bmi1") {
            return Kernel::Avx2;
        }
        Kernel::Sse2
    }
    #[cfg(not(target_arch = "x86_64"))]
    Kernel::Portable
}

fn check(old: usize, new: usize, width: usize, hashes: usize) {
    assert!(old == new && old.is_multiple_of(width), "scan of {old} and {new} bytes of {width}-byte elements");
    assert!(hashes <= old / base::BLOCK_BYTES, "{hashes} block hashes asked of {old} bytes");
}

/// `scan_pieces_then` for an element width known at run time, over the whole range.
fn scan_width<const COPY: bool, R>(
    old: *mut u8,
    new: &[u8],
    first_element: u64,
    width: usize,
    codec: ValueCodec,
    hashes: &mut [u64],
    take: impl FnOnce(&Changes, &[u64]) -> R,
) -> R {
    let (new, len) = (new.as_ptr(), new.len());
    with_width!(width, W => scan_pieces_then::<W, COPY, R>(old, new, len, first_element, codec, hashes, PIECE_BYTES, take))
}

/// The changes from `old` to `new` (element `first_element` at their start), handed to `take` before their
/// buffer is reused: `scan` without the copy, for a caller that appends them somewhere at once. `hashes` receives
/// `base::block_hash` of each of the first `hashes.len()` whole base identity blocks of `old` (empty for none):
/// on CPUs with AVX2 they are hashed in the same pass as the compare; `take` sees them too.
pub fn scan_then<R>(
    old: &[u8],
    new: &[u8],
    first_element: u64,
    width: usize,
    codec: ValueCodec,
    hashes: &mut [u64],
    take: impl FnOnce(&Changes, &[u64]) -> R,
) -> R {
    check(old.len(), new.len(), width, hashes.len());
    // `COPY` is false: nothing is written through this pointer.
    scan_width::<false, R>(old.as_ptr().cast_mut(), new, first_element, width, codec, hashes, take)
}

/// The changes from `old` to `new` (element `first_element` at their start).
pub fn scan(old: &[u8], new: &[u8], first_element: u64, width: usize, codec: ValueCodec) -> Changes {
    scan_then(old, new, first_element, width, codec, &mut [], owned)
}

/// `scan`, also copying `new` into `mirror` wherever they differ, so that `mirror` ends equal to `new`, handing the
/// changes to `take` before their buffer is reused, as `scan_then`; `hashes` are of the mirror's blocks before the
/// update.
pub fn scan_update_then<R>(
    mirror: &mut [u8],
    new: &[u8],
    first_element: u64,
    width: usize,
    codec: ValueCodec,
    hashes: &mut [u64],
    take: impl FnOnce(&Changes, &[u64]) -> R,
) -> R {
    check(mirror.len(), new.len(), width, hashes.len());
    scan_width::<true, R>(mirror.as_mut_ptr(), new, first_element, width, codec, hashes, take)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::codec::elements;

    /// The obvious element-by-element scan.
    fn reference(old: &[u8], new: &[u8], width: usize, codec: ValueCodec) -> Changes {
        let mut out = Changes::default();
        for (index, (a, b)) in old.chunks_exact(width).zip(new.chunks_exact(width)).enumerate() {
            if a == b {
                continue;
            }
            let position = index as u64;
            if out.count == 0 {
                out.first_position = position;
            } else {
                varint::write(&mut out.positions, position - out.last_position - 1);
            }
            out.last_position = position;
            out.count += 1;
            match codec {
                ValueCodec::Abs => out.values.extend_from_slice(b),
                _ => {
                    let difference =
                        elements::load(b, width).wrapping_sub(elements::load(a, width)) & elements::mask(width);
                    values::write_difference(&mut out.values, difference, width);
                }
            }
        }
        out
    }

    fn kernels() -> Vec<Kernel> {
        let best = best_kernel();
        Kernel::ALL.into_iter().filter(|k| *k as u8 <= best as u8).collect()
    }

    /// Scans with one kernel; `copy` scans a copy of `old` as a mirror. Returns the changes and that copy.
    fn run(kernel: Kernel, old: &[u8], new: &[u8], width: usize, codec: ValueCodec, copy: bool) -> (Changes, Vec<u8>) {
        let (changes, mirror, _) = run_hashed(kernel, old, new, width, codec, copy, 0);
        (changes, mirror)
    }

    /// `run`, also hashing the first `blocks` base identity blocks of `old`.
    fn run_hashed(
        kernel: Kernel,
        old: &[u8],
        new: &[u8],
        width: usize,
        codec: ValueCodec,
        copy: bool,
        blocks: usize,
    ) -> (Changes, Vec<u8>, Vec<u64>) {
        let mut hashes = vec![0u64; blocks];
        macro_rules! go {
            ($w:ident, $copy:literal) => {{
                let mut mirror = old.to_vec();
                let mut out = Changes::default();
                let (target, source, len) = (mirror.as_mut_ptr(), new.as_ptr(), old.len());
                let (h, o) = (&mut hashes[..], &mut out);
                unsafe {
                    match kernel {
                        Kernel::Portable => scan_blocks::<$w, $copy, Portable>(target, source, len, 0, codec, h, o),
                        #[cfg(target_arch = "x86_64")]
                        Kernel::Sse2 => scan_blocks::<$w, $copy, x86::Sse2>(target, source, len, 0, codec, h, o),
                        #[cfg(target_arch = "x86_64")]
                        Kernel::Avx2 => x86::scan_avx2::<$w, $copy>(target, source, len, 0, codec, h, o),
                        #[cfg(target_arch = "x86_64")]
                        Kernel::Avx512 => x86::scan_avx512::<$w, $copy>(target, source, len, 0, codec, h, o),
                        #[cfg(not(target_arch = "x86_64"))]
                        _ => unreachable!(),
                    }
                }
                (out, mirror, hashes)
            }};
        }
        if copy {
            with_width!(width, W => go!(W, true))
        } else {
            with_width!(width, W => go!(W, false))
        }
    }

    #[test]
    fn every_kernel_matches_the_reference() {
        let mut next = crate::core::testing::xorshift(0x9e37_79b9_7f4a_7c15);
        for width in [1usize, 2, 4, 8] {
            for &len_elements in &[0usize, 1, 7, 31, 32, 33, 64, 1000, 4099] {
                for density in [0u64, 3, 40, 100] {
                    let len = len_elements * width;
                    let old: Vec<u8> = (0..len).map(|_| next() as u8).collect();
                    let mut new = old.clone();
                    for element in 0..len_elements {
                        if next() % 100 < density {
                            // Small differences, escapes, long gaps and single-byte flips in any byte.
                            let byte = element * width + (next() as usize % width);
                            new[byte] = new[byte].wrapping_add(match next() % 4 {
                                0 => 1,
                                1 => 255,
                                2 => 0x80,
                                _ => (next() as u8) | 1,
                            });
                        }
                    }
                    for codec in [ValueCodec::Abs, ValueCodec::Diff] {
                        let want = reference(&old, &new, width, codec);
                        for kernel in kernels() {
                            for copy in [false, true] {
                                let (got, mirror) = run(kernel, &old, &new, width, codec, copy);
                                let what =
                                    format!("{kernel:?} width {width} len {len_elements} density {density} {codec:?}");
                                assert_eq!(got.count, want.count, "{what}");
                                if want.count > 0 {
                                    assert_eq!(
                                        (got.first_position, got.last_position),
                                        (want.first_position, want.last_position),
                                        "{what}"
                                    );
                                }
                                assert_eq!(got.positions, want.positions, "{what}");
                                assert_eq!(got.values, want.values, "{what}");
                                assert_eq!(&mirror, if copy { &new } else { &old }, "{what}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn unaligned_ranges() {
        let old: Vec<u8> = (0..5000u32).map(|i| (i * 13 % 256) as u8).collect();
        let mut new = old.clone();
        for i in (3..new.len()).step_by(29) {
            new[i] = new[i].wrapping_add(1);
        }
        for (skip, width) in [(1usize, 1usize), (3, 1), (2, 2), (6, 2), (4, 4), (8, 8), (2, 4)] {
            let end = skip + (old.len() - skip) / width * width;
            let (a, b) = (&old[skip..end], &new[skip..end]);
            for codec in [ValueCodec::Abs, ValueCodec::Diff] {
                let (got, want) = (scan(a, b, 0, width, codec), reference(a, b, width, codec));
                assert_eq!(
                    (got.count, &got.positions, &got.values),
                    (want.count, &want.positions, &want.values),
                    "{skip} {width}"
                );
            }
        }
    }

    #[test]
    fn every_kernel_hashes_the_blocks_as_they_were() {
        // Two and a half base identity blocks; changes everywhere, in the first and last stripes of each block too.
        let len = base::BLOCK_BYTES * 5 / 2;
        let mut next = crate::core::testing::xorshift(0x51ed_270b_1234_5678);
        let old: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        for (width, density) in [(2usize, 1u64), (2, 60), (4, 10), (1, 100), (8, 5)] {
            let mut new = old.clone();
            for element in 0..len / width {
                let edge = element * width % base::BLOCK_BYTES < 64 || (element + 1) * width % base::BLOCK_BYTES < 64;
                if next() % 100 < density || (edge && next().is_multiple_of(4)) {
                    new[element * width] ^= 1 + (next() % 255) as u8;
                }
            }
            let want_hashes: Vec<u64> = old.chunks_exact(base::BLOCK_BYTES).map(base::block_hash).collect();
            for codec in [ValueCodec::Abs, ValueCodec::Diff] {
                let want = reference(&old, &new, width, codec);
                for kernel in kernels() {
                    for copy in [false, true] {
                        for blocks in [0, 1, 2] {
                            let (got, mirror, hashes) = run_hashed(kernel, &old, &new, width, codec, copy, blocks);
                            let what = format!("{kernel:?}, width {width}, copy {copy}, {blocks} blocks");
                            assert_eq!(hashes[..], want_hashes[..blocks], "{what}");
                            assert_eq!(
                                (got.count, &got.positions, &got.values),
                                (want.count, &want.positions, &want.values),
                                "{what}"
                            );
                            assert_eq!(&mirror, if copy { &new } else { &old }, "{what}");
                        }
                    }
                }
            }
        }
        // Through the public entry points, which cut nothing at this size.
        let mut new = old.clone();
        new[3] ^= 1;
        let mut hashes = [0u64; 2];
        let mut mirror = old.clone();
        scan_update_then(&mut mirror, &new, 0, 2, ValueCodec::Diff, &mut hashes, |_, _| ());
        assert_eq!(hashes[..], want_hashes_of(&old)[..2]);
        assert_eq!(mirror, new);
        let mut again = [0u64; 1];
        scan_then(&old, &new, 0, 2, ValueCodec::Diff, &mut again, |_, _| ());
        assert_eq!(again[0], want_hashes_of(&old)[0]);
        // Cut into pieces of one block (the 1 GiB pieces of longer ranges), each piece hashing its own block.
        let mut mirror = old.clone();
        let got = scan_pieces_then::<2, true, _>(
            mirror.as_mut_ptr(),
            new.as_ptr(),
            old.len(),
            0,
            ValueCodec::Diff,
            &mut hashes,
            base::BLOCK_BYTES,
            owned,
        );
        assert_eq!(hashes[..], want_hashes_of(&old)[..2]);
        assert_eq!((got.count, mirror), (1, new));
    }

    fn want_hashes_of(bytes: &[u8]) -> Vec<u64> {
        bytes.chunks_exact(base::BLOCK_BYTES).map(base::block_hash).collect()
    }

    #[test]
    fn pieces_join_to_the_whole() {
        let n = 50_000usize;
        let old: Vec<u8> = (0..n * 2).map(|i| (i * 7 % 251) as u8).collect();
        let mut new = old.clone();
        for p in [0usize, 1, 63, 64, 2047, 2048, 2049, 9000, 30_000, n - 1] {
            new[p * 2] ^= 0x21;
        }
        for codec in [ValueCodec::Abs, ValueCodec::Diff] {
            let whole = reference(&old, &new, 2, codec);
            for piece in [64usize, 4096, 1 << 16] {
                let mut mirror = old.clone();
                let got = scan_pieces_then::<2, true, _>(
                    mirror.as_mut_ptr(),
                    new.as_ptr(),
                    old.len(),
                    0,
                    codec,
                    &mut [],
                    piece,
                    owned,
                );
                assert_eq!(
                    (got.count, got.first_position, got.last_position),
                    (whole.count, whole.first_position, whole.last_position)
                );
                assert_eq!((&got.positions, &got.values), (&whole.positions, &whole.values), "piece {piece}");
                assert_eq!(mirror, new);
            }
        }
    }

    #[test]
    fn long_gaps_take_full_varints() {
        let n = 1 << 16;
        let old = vec![0u8; n * 2];
        let mut new = old.clone();
        for p in [5usize, 5 + 200, 5 + 200 + 20_000, n - 1] {
            new[p * 2 + 1] = 0x40;
        }
        let got = scan(&old, &new, 0, 2, ValueCodec::Diff);
        let want = reference(&old, &new, 2, ValueCodec::Diff);
        assert_eq!((got.count, got.positions, got.values), (want.count, want.positions, want.values));
    }
}
