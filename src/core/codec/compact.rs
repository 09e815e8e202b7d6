//! The `compact` codec: Golomb-Rice coded gaps (`rice` positions) and a bit-packed prefix code of bit-pattern
//! differences (`diffbits` values). Bits are packed least significant first into little-endian bytes (docs/format.md §5, §6).

use rayon::prelude::*;

use super::rans::{self, Tokens, MAX_TOKENS};
use super::values::{mask, ESCAPE};
use super::{varint, PositionCodec, ValueCodec};
use crate::core::scan::{self, Changes};

/// Largest Rice parameter a stream may declare: keeps `quotient << k` below 2^62 and every read within one word.
pub const MAX_RICE_K: u32 = 56;
/// A unary run of this many one bits (with no terminating zero) is the escape: the gap follows in 64 bits.
const ESCAPE_ONES: u32 = 64;

/// Appends bits, least significant first, to a byte vector.
pub struct BitWriter {
    /// Whole bytes written so far.
    out: Vec<u8>,
    /// The bits of the byte in progress (fewer than 8).
    pending: u64,
    pending_bits: u32,
}

impl BitWriter {
    pub fn with_capacity(bytes: usize) -> Self {
        BitWriter { out: Vec::with_capacity(bytes + 8), pending: 0, pending_bits: 0 }
    }

    /// Appends the low `bits` bits of `value`; `bits <= 56`. No branch on the data: the bits at hand are stored
    /// as one 8-byte word past the whole bytes, which advance by as many as were completed.
    #[inline(always)]
    pub fn put(&mut self, value: u64, bits: u32) {
        debug_assert!(bits <= 56 && (bits == 56 || value >> bits == 0));
        let word = self.pending | (value << self.pending_bits);
        let total = self.pending_bits + bits;
        self.out.reserve(8);
        let len = self.out.len();
        // SAFETY: `reserve(8)` leaves room for the 8-byte store at `len`; the bytes it writes past the new
        // length are spare capacity, rewritten by the next store.
        unsafe {
            std::ptr::write_unaligned(self.out.as_mut_ptr().add(len).cast::<u64>(), word.to_le());
            self.out.set_len(len + (total / 8) as usize);
        }
        // total <= 63, so the shift is at most 56.
        self.pending = word >> (total & !7);
        self.pending_bits = total & 7;
    }

    /// Appends all 64 bits of `value`.
    #[inline]
    pub fn put_u64(&mut self, value: u64) {
        self.put(value & 0xffff_ffff, 32);
        self.put(value >> 32, 32);
    }

    /// Bits written so far.
    pub fn bit_len(&self) -> u64 {
        self.out.len() as u64 * 8 + u64::from(self.pending_bits)
    }

    /// Appends the first `bits` bits of `bytes` (as written by another `BitWriter`).
    pub fn append(&mut self, bytes: &[u8], bits: u64) {
        if self.pending_bits == 0 {
            let whole = (bits / 8) as usize;
            self.out.extend_from_slice(&bytes[..whole]);
            let rest = (bits % 8) as u32;
            if rest > 0 {
                self.put(u64::from(bytes[whole]) & mask_bits(rest), rest);
            }
            return;
        }
        let mut at = 0usize;
        let mut left = bits;
        while left >= 56 {
            let mut word = [0u8; 8];
            word[..7].copy_from_slice(&bytes[at..at + 7]);
            self.put(u64::from_le_bytes(word), 56);
            at += 7;
            left -= 56;
        }
        if left > 0 {
            let mut word = [0u8; 8];
            let tail = &bytes[at..at + (left as usize).div_ceil(8)];
            word[..tail.len()].copy_from_slice(tail);
            self.put(u64::from_le_bytes(word) & mask_bits(left as u32), left as u32);
        }
    }

    /// Appends `count` one bits.
    #[inline(always)]
    fn put_ones(&mut self, mut count: u32) {
        while count > 0 {
            let run = count.min(32);
            self.put((1u64 << run) - 1, run);
            count -= run;
        }
    }

    /// The bytes, the last one padded with zero bits.
    pub fn finish(mut self) -> Vec<u8> {
        if self.pending_bits > 0 {
            self.out.push(self.pending as u8);
        }
        self.out
    }
}

/// Reads bits, least significant first, checking every read against the end of the stream.
pub struct BitReader<'a> {
    bytes: &'a [u8],
    bit: usize,
    total_bits: usize,
}

impl<'a> BitReader<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        BitReader { bytes, bit: 0, total_bits: bytes.len() * 8 }
    }

    /// The next bits without consuming them: at least 57 are meaningful, zeros past the end of the stream.
    #[inline(always)]
    fn peek(&self) -> u64 {
        let byte = self.bit >> 3;
        let word = match self.bytes.get(byte..byte + 8) {
            Some(eight) => u64::from_le_bytes(eight.try_into().expect("8 bytes")),
            None => {
                let mut buf = [0u8; 8];
                let tail = self.bytes.get(byte..).unwrap_or(&[]);
                buf[..tail.len()].copy_from_slice(tail);
                u64::from_le_bytes(buf)
            }
        };
        word >> (self.bit & 7)
    }

    #[inline(always)]
    fn consume(&mut self, bits: u32) -> Result<(), String> {
        self.bit += bits as usize;
        if self.bit > self.total_bits {
            return Err("stream ends early".to_owned());
        }
        Ok(())
    }

    /// Reads `bits <= 56` bits.
    #[inline(always)]
    pub fn read(&mut self, bits: u32) -> Result<u64, String> {
        let value = self.peek() & ((1u64 << bits) - 1);
        self.consume(bits)?;
        Ok(value)
    }

    #[inline]
    pub fn read_u64(&mut self) -> Result<u64, String> {
        let low = self.read(32)?;
        Ok(low | (self.read(32)? << 32))
    }

    /// True when every bit has been read and the padding of the last byte is zero.
    pub fn is_exhausted(&self) -> bool {
        let used_bytes = self.bit.div_ceil(8);
        used_bytes == self.bytes.len()
            && (self.bit.is_multiple_of(8) || self.bytes[used_bytes - 1] >> (self.bit % 8) == 0)
    }

    /// Counts one bits up to a zero (consumed too), or returns None after `ESCAPE_ONES` ones.
    #[inline(always)]
    fn read_unary(&mut self) -> Result<Option<u32>, String> {
        let mut ones = 0;
        loop {
            let run = (!self.peek()).trailing_zeros().min(32);
            if ones + run >= ESCAPE_ONES {
                self.consume(ESCAPE_ONES - ones)?;
                return Ok(None);
            }
            if run < 32 {
                self.consume(run + 1)?;
                return Ok(Some(ones + run));
            }
            self.consume(32)?;
            ones += 32;
        }
    }
}

/// The Rice parameter for `count` gaps summing to `sum`, treating them as geometric with that mean
/// (Kiely's rule, `k = max(0, 1 + floor(log2(ln(phi - 1) / ln(theta))))` with `theta = mean / (mean + 1)`).
pub fn rice_k(count: u64, sum: u64) -> u32 {
    if count == 0 || sum == 0 {
        return 0;
    }
    let mean = sum as f64 / count as f64;
    let theta = mean / (mean + 1.0);
    let golden_minus_one = (5f64.sqrt() - 1.0) / 2.0;
    let ratio = golden_minus_one.ln() / theta.ln();
    if ratio.is_nan() || ratio < 1.0 {
        return 0;
    }
    (1.0 + ratio.log2().floor()).min(f64::from(MAX_RICE_K)) as u32
}

/// Appends the Rice code of `gap` with parameter `k`.
#[inline(always)]
pub fn put_rice(out: &mut BitWriter, gap: u64, k: u32) {
    let quotient = gap >> k;
    if quotient + 1 + u64::from(k) <= 56 {
        // The usual case: ones, the terminating zero and the remainder in one write.
        let quotient = quotient as u32;
        out.put(((1u64 << quotient) - 1) | ((gap & mask_bits(k)) << (quotient + 1)), quotient + 1 + k);
    } else if quotient < u64::from(ESCAPE_ONES) {
        out.put_ones(quotient as u32);
        // The terminating zero and the remainder in one write when they fit.
        if k < 56 {
            out.put((gap & mask_bits(k)) << 1, k + 1);
        } else {
            out.put(0, 1);
            out.put(gap & mask_bits(k), k);
        }
    } else {
        out.put_ones(ESCAPE_ONES);
        out.put_u64(gap);
    }
}

/// Encodes gaps as a `rice` position stream: one byte holding `k`, then one Rice code per gap.
pub fn write_rice(gaps: impl Iterator<Item = u64>, k: u32) -> Vec<u8> {
    assert!(k <= MAX_RICE_K, "Rice parameter {k} over {MAX_RICE_K}");
    let mut out = BitWriter::with_capacity(0);
    out.put(u64::from(k), 8);
    for gap in gaps {
        put_rice(&mut out, gap, k);
    }
    out.finish()
}

#[inline(always)]
fn mask_bits(bits: u32) -> u64 {
    (1u64 << bits) - 1
}

/// Decodes a `rice` position stream one position at a time, checking each against `numel`.
pub struct RiceReader<'a> {
    bits: BitReader<'a>,
    k: u32,
    next_allowed: u64,
    numel: u64,
}

impl<'a> RiceReader<'a> {
    /// An empty stream is accepted here (a tensor with no change); reading a position from it fails.
    pub fn new(bytes: &'a [u8], numel: u64) -> Result<Self, String> {
        let mut bits = BitReader::new(bytes);
        let k = if bytes.is_empty() { 0 } else { bits.read(8)? as u32 };
        if k > MAX_RICE_K {
            return Err(format!("Rice parameter {k} is over {MAX_RICE_K}"));
        }
        Ok(RiceReader { bits, k, next_allowed: 0, numel })
    }

    #[inline(always)]
    pub fn next_position(&mut self) -> Result<u64, String> {
        let early = |e: String| format!("position {e}");
        let gap = match self.bits.read_unary().map_err(early)? {
            Some(quotient) => (u64::from(quotient) << self.k) | self.bits.read(self.k).map_err(early)?,
            None => self.bits.read_u64().map_err(early)?,
        };
        super::next_position(&mut self.next_allowed, gap, self.numel)
    }

    pub fn is_exhausted(&self) -> bool {
        self.bits.is_exhausted()
    }
}

/// A window of up to 57 bits of a stream, refilled with one unchecked 8-byte load while 16 bytes remain.
struct Window<'a> {
    bytes: &'a [u8],
    /// Stream position of the window's first bit.
    bit: usize,
    word: u64,
    left: u32,
    safe_bits: usize,
}

impl<'a> Window<'a> {
    fn new(bytes: &'a [u8], bit: usize) -> Self {
        Window { bytes, bit, word: 0, left: 0, safe_bits: bytes.len().saturating_sub(16) * 8 }
    }

    /// Reloads the window at `bit`; false once fewer than 16 bytes remain (the checked readers take over).
    #[inline(always)]
    fn refill(&mut self) -> bool {
        if self.bit >= self.safe_bits {
            return false;
        }
        // SAFETY: `bit < safe_bits` leaves at least 16 bytes from `bit / 8` on.
        let word = unsafe { std::ptr::read_unaligned(self.bytes.as_ptr().add(self.bit >> 3).cast::<u64>()) };
        self.word = u64::from_le(word) >> (self.bit & 7);
        self.left = 57;
        true
    }

    #[inline(always)]
    fn take(&mut self, length: u32) {
        self.word >>= length;
        self.left -= length;
        self.bit += length as usize;
    }

    /// The next Rice code with parameter `k`, not consumed: (gap, length). None where fewer than 16 bytes remain
    /// or the code is longer than a window: the checked reader takes it.
    #[inline(always)]
    fn peek_rice(&mut self, k: u32) -> Option<(u64, u32)> {
        let mut quotient = (!self.word).trailing_zeros();
        if quotient + 1 + k > self.left {
            if !self.refill() {
                return None;
            }
            quotient = (!self.word).trailing_zeros();
            if quotient + 1 + k > self.left {
                return None;
            }
        }
        let gap = (u64::from(quotient) << k) | ((self.word >> (quotient + 1)) & mask_bits(k));
        Some((gap, quotient + 1 + k))
    }

    /// The next `diffbits` value of a `W`-byte element, not consumed: (value, length). None as for `peek_rice`
    /// (an escaped 8-byte value is longer than a window).
    #[inline(always)]
    fn peek_difference<const W: usize>(&mut self) -> Option<(u64, u32)> {
        loop {
            // Every code but the escape in one table lookup on its first ten bits.
            let (difference, mut length) = VALUE_CODES[(self.word & 0x3ff) as usize];
            let mut value = (i64::from(difference) as u64) & mask(W);
            if length == 0 {
                // `11` and the escape byte: for one-byte elements the byte itself, else the full width follows.
                (value, length) = if W == 1 { (0x80, 10) } else { ((self.word >> 10) & mask(W), 10 + 8 * W as u8) };
            }
            if u32::from(length) <= self.left {
                return Some((value, u32::from(length)));
            }
            if self.left == 57 || !self.refill() {
                return None;
            }
        }
    }
}

/// Where a fast pass over a `rice` stream left off: the next allowed position after `decoded` codes whose gaps
/// sum to `sum` (`wrapped` if that sum passed 2^64). Sets the reader to go on from there.
fn resume_rice(reader: &mut RiceReader<'_>, bit: usize, decoded: u64, sum: u64, wrapped: bool) -> Result<(), String> {
    // Each position is the previous one plus one plus its gap.
    let next = sum.checked_add(decoded).filter(|&end| !wrapped && end <= reader.numel);
    let Some(next) = next else {
        return Err(format!("position out of range (tensor has {} elements)", reader.numel));
    };
    reader.bits.bit = bit;
    reader.next_allowed = next;
    Ok(())
}

/// The `diffbits` code starting each 10-bit pattern: (signed difference, length in bits); length 0 for `11` and
/// the escape byte, whose meaning depends on the element width.
static VALUE_CODES: [(i16, u8); 1024] = {
    let mut table = [(0i16, 0u8); 1024];
    let mut bits = 0;
    while bits < 1024 {
        table[bits] = if bits & 1 == 0 {
            (if bits & 2 == 0 { 1 } else { -1 }, 2)
        } else if bits & 2 == 0 {
            (if bits & 4 == 0 { 2 } else { -2 }, 3)
        } else if (bits >> 2) & 0xff == ESCAPE as usize {
            (0, 0)
        } else {
            (((bits >> 2) & 0xff) as u8 as i8 as i16, 10)
        };
        bits += 1;
    }
    table
};

/// Decodes up to `n` (gap, value) pairs of a `rice` position stream with parameter `k` and a `diffbits` value
/// stream, starting at the given bits, in one loop: the two streams' dependency chains (shift, count, shift) run
/// side by side. Stops early where fewer than 16 bytes remain in either stream or a code does not fit in a
/// window. Returns how many pairs were decoded and the new bit positions; `sink(gap, value)` takes each pair.
#[inline(always)]
fn pairs_fast<const W: usize>(
    positions: &[u8],
    position_bit: usize,
    k: u32,
    values: &[u8],
    value_bit: usize,
    n: u64,
    mut sink: impl FnMut(u64, u64),
) -> (u64, usize, usize) {
    let (mut p, mut v) = (Window::new(positions, position_bit), Window::new(values, value_bit));
    let mut done = 0u64;
    while done < n {
        let Some((gap, position_length)) = p.peek_rice(k) else { break };
        let Some((value, value_length)) = v.peek_difference::<W>() else { break };
        p.take(position_length);
        v.take(value_length);
        sink(gap, value);
        done += 1;
    }
    (done, p.bit, v.bit)
}

/// Checks a `rice` position stream and a `diffbits` value stream of `changed` changes together, as the walk would,
/// and returns the last position: the two streams' decoding chains overlap in one loop.
pub fn check_rice_diffbits<const W: usize>(
    positions: &[u8],
    values: &[u8],
    changed: u64,
    numel: u64,
) -> Result<Option<u64>, String> {
    let mut position_reader = RiceReader::new(positions, numel)?;
    let mut value_bits = BitReader::new(values);
    let (mut sum, mut carried) = (0u64, false);
    let (done, position_bit, value_bit) =
        pairs_fast::<W>(positions, position_reader.bits.bit, position_reader.k, values, 0, changed, |gap, _| {
            let (total, wrapped) = sum.overflowing_add(gap);
            sum = total;
            carried |= wrapped;
        });
    resume_rice(&mut position_reader, position_bit, done, sum, carried)?;
    value_bits.bit = value_bit;
    let mut last = position_reader.next_allowed.checked_sub(1);
    for _ in done..changed {
        last = Some(position_reader.next_position()?);
        read_difference::<W>(&mut value_bits)?;
    }
    if !position_reader.is_exhausted() {
        return Err("position stream has bytes after the last change".to_owned());
    }
    if !value_bits.is_exhausted() {
        return Err("value stream has bytes after the last change".to_owned());
    }
    Ok(last)
}

/// Fills `positions_out` and `values_out` (the same length) with the next changes of a `rice` + `diffbits` tensor,
/// as the readers would one by one, decoding both streams in one loop.
pub fn read_pairs<const W: usize>(
    position_reader: &mut RiceReader<'_>,
    value_bits: &mut BitReader<'_>,
    positions_out: &mut [u64],
    values_out: &mut [u64],
) -> Result<(), String> {
    let n = positions_out.len();
    let mut next = position_reader.next_allowed;
    let mut filled = 0usize;
    let (done, position_bit, value_bit) = pairs_fast::<W>(
        position_reader.bits.bytes,
        position_reader.bits.bit,
        position_reader.k,
        value_bits.bytes,
        value_bits.bit,
        n as u64,
        |gap, value| {
            // Saturating: a position past the tensor is caught below, before it is handed out.
            let position = next.saturating_add(gap);
            next = position.saturating_add(1);
            positions_out[filled] = position;
            values_out[filled] = value;
            filled += 1;
        },
    );
    debug_assert_eq!(done as usize, filled);
    position_reader.bits.bit = position_bit;
    value_bits.bit = value_bit;
    if filled > 0 && positions_out[filled - 1] >= position_reader.numel {
        return Err(format!("position out of range (tensor has {} elements)", position_reader.numel));
    }
    position_reader.next_allowed = next;
    for i in filled..n {
        positions_out[i] = position_reader.next_position()?;
        values_out[i] = read_difference::<W>(value_bits)?;
    }
    Ok(())
}

/// Fills `out` with the next positions of a `rice` stream, as `RiceReader::next_position` would one by one. The bulk
/// is read without bounds checks while 16 bytes remain.
pub fn read_positions(reader: &mut RiceReader<'_>, out: &mut [u64]) -> Result<(), String> {
    let mut window = Window::new(reader.bits.bytes, reader.bits.bit);
    let mut next = reader.next_allowed;
    let mut filled = 0usize;
    while filled < out.len() {
        let Some((gap, length)) = window.peek_rice(reader.k) else { break };
        window.take(length);
        // Saturating: a position past the tensor is caught below, before it is handed out.
        let position = next.saturating_add(gap);
        next = position.saturating_add(1);
        out[filled] = position;
        filled += 1;
    }
    reader.bits.bit = window.bit;
    if filled > 0 && out[filled - 1] >= reader.numel {
        return Err(format!("position out of range (tensor has {} elements)", reader.numel));
    }
    reader.next_allowed = next;
    for slot in &mut out[filled..] {
        *slot = reader.next_position()?;
    }
    Ok(())
}

/// Checks a whole `rice` position stream of `changed` codes, as reading them one by one with `RiceReader` would,
/// and returns the last position. The bulk is read without bounds checks while 16 bytes remain.
pub fn check_rice(bytes: &[u8], changed: u64, numel: u64) -> Result<Option<u64>, String> {
    let mut reader = RiceReader::new(bytes, numel)?;
    let mut window = Window::new(bytes, reader.bits.bit);
    let (mut read, mut sum, mut carried) = (0u64, 0u64, false);
    while read < changed {
        let Some((gap, length)) = window.peek_rice(reader.k) else { break };
        window.take(length);
        let (total, wrapped) = sum.overflowing_add(gap);
        sum = total;
        carried |= wrapped;
        read += 1;
    }
    resume_rice(&mut reader, window.bit, read, sum, carried)?;
    let mut last = reader.next_allowed.checked_sub(1);
    for _ in read..changed {
        last = Some(reader.next_position()?);
    }
    if !reader.is_exhausted() {
        return Err("position stream has bytes after the last change".to_owned());
    }
    Ok(last)
}

/// Checks that a `diffbits` value stream of `W`-byte elements holds exactly `changed` values, as reading them one
/// by one would. Values are skipped by their lengths, unchecked while 16 bytes remain.
pub fn check_diffbits<const W: usize>(bytes: &[u8], changed: u64) -> Result<(), String> {
    let mut window = Window::new(bytes, 0);
    let mut read = 0u64;
    while read < changed {
        let Some((_, length)) = window.peek_difference::<W>() else { break };
        window.take(length);
        read += 1;
    }
    let mut bits = BitReader::new(bytes);
    bits.bit = window.bit;
    for _ in read..changed {
        read_difference::<W>(&mut bits)?;
    }
    if bits.is_exhausted() {
        Ok(())
    } else {
        Err("value stream has bytes after the last change".to_owned())
    }
}

#[inline(always)]
fn sign_extend(value: u64, width: usize) -> i64 {
    let shift = 64 - 8 * width as u32;
    ((value << shift) as i64) >> shift
}

/// Appends one wrapping difference of a `width`-byte element in the `diffbits` code:
/// `0s` for ±1, `10s` for ±2 (s = 1 for minus; read least significant bit first), else `11` and the value as the
/// byte-aligned `diff` codec would write it, in 8 or 8 + 8W bits.
#[inline(always)]
pub fn put_difference(out: &mut BitWriter, difference: u64, width: usize) {
    match sign_extend(difference, width) {
        1 => out.put(0b00, 2),
        -1 => out.put(0b10, 2),
        2 => out.put(0b001, 3),
        -2 => out.put(0b101, 3),
        signed => {
            out.put(0b11, 2);
            if width == 1 || (-127..=127).contains(&signed) {
                out.put(u64::from(signed as u8), 8);
            } else {
                out.put(u64::from(ESCAPE), 8);
                if width == 8 {
                    out.put_u64(difference);
                } else {
                    out.put(difference, 8 * width as u32);
                }
            }
        }
    }
}

/// Re-encodes a byte-coded `diff` value stream of `count` values as a `diffbits` stream. The one-byte ±1 and ±2 of
/// wide elements, nearly every value of a training step, map straight to their short codes.
pub fn diff_to_diffbits<const W: usize>(diff_stream: &[u8], count: u64, out: &mut BitWriter) {
    if W == 1 {
        for &byte in &diff_stream[..count as usize] {
            put_difference(out, u64::from(byte), 1);
        }
        return;
    }
    let mut at = 0;
    while let Some(&byte) = diff_stream.get(at) {
        at += 1;
        if byte == ESCAPE {
            let raw = &diff_stream[at..at + W];
            at += W;
            let mut word = [0u8; 8];
            word[..W].copy_from_slice(raw);
            put_difference(out, u64::from_le_bytes(word), W);
        } else {
            // A table lookup, not a branch: ±1 comes in either sign at random.
            let (code, bits) = SHORT_CODES[usize::from(byte)];
            out.put(u64::from(code), u32::from(bits));
        }
    }
}

/// The `diffbits` code of each one-byte `diff` value (the escape byte excepted): `0s`, `10s`, or `11` and the byte.
static SHORT_CODES: [(u16, u8); 256] = {
    let mut table = [(0u16, 0u8); 256];
    let mut byte = 0;
    while byte < 256 {
        table[byte] = match byte {
            0x01 => (0b00, 2),
            0xff => (0b10, 2),
            0x02 => (0b001, 3),
            0xfe => (0b101, 3),
            _ => (0b11 | ((byte as u16) << 2), 10),
        };
        byte += 1;
    }
    table
};

/// Reads one `diffbits` value of a `W`-byte element: the wrapping difference in the low `W` bytes.
#[inline(always)]
pub fn read_difference<const W: usize>(bits: &mut BitReader<'_>) -> Result<u64, String> {
    let early = |e: String| format!("value {e}");
    let word = bits.peek();
    if word & 1 == 0 {
        bits.consume(2).map_err(early)?;
        return Ok(if word & 2 == 0 { 1 } else { mask(W) });
    }
    if word & 2 == 0 {
        bits.consume(3).map_err(early)?;
        return Ok(if word & 4 == 0 { 2 } else { mask(W) - 1 });
    }
    bits.consume(2).map_err(early)?;
    let first = bits.read(8).map_err(early)?;
    if W == 1 {
        Ok(first)
    } else if first == u64::from(ESCAPE) {
        if W == 8 { bits.read_u64() } else { bits.read(8 * W as u32) }.map_err(early)
    } else {
        Ok((i64::from(first as u8 as i8) as u64) & mask(W))
    }
}

/// A tensor's two streams and their codecs, as `smallest_streams` picks them.
pub struct TensorStreams {
    pub positions_codec: PositionCodec,
    pub values_codec: ValueCodec,
    pub positions: Vec<u8>,
    pub values: Vec<u8>,
}

/// A range's changes re-encoded in the compact codec: Rice codes of its gaps (its first gap included) and, for
/// differences, `diffbits`.
struct CompactRange {
    positions: Vec<u8>,
    position_bits: u64,
    /// The differences as `rans` tokens, and how often each token occurs.
    tokens: Tokens,
    histogram: [u64; MAX_TOKENS],
}

/// How a tensor's gaps are coded: its Rice parameter, and where each range's first gap starts.
fn rice_plan(ranges: &[Changes]) -> (u32, Vec<u64>) {
    let mut previous_ends = Vec::with_capacity(ranges.len());
    let (mut previous_end, mut count, mut gap_sum) = (0u64, 0u64, 0u64);
    for range in ranges {
        previous_ends.push(previous_end);
        if range.count > 0 {
            count += range.count;
            gap_sum += range.last_position + 1 - previous_end - range.count;
            previous_end = range.last_position + 1;
        }
    }
    (rice_k(count, gap_sum), previous_ends)
}

/// Re-encodes one range in the compact codec; `previous_end` is the position after the previous range's last change.
fn compact_range(range: &Changes, k: u32, previous_end: u64, width: usize, differences: bool) -> CompactRange {
    let mut positions = BitWriter::with_capacity(range.positions.len());
    if range.count > 0 {
        put_rice(&mut positions, range.first_position - previous_end, k);
        let mut at = 0;
        let stream = &range.positions;
        while at < stream.len() {
            // Gaps of one or two bytes (all but the rarest) without a branch on their length.
            let pair = u16::from_le_bytes([stream[at], stream.get(at + 1).copied().unwrap_or(0)]);
            let long = pair & 0x80 != 0;
            let gap = if pair & 0x8080 == 0x8080 {
                varint::read(stream, &mut at).expect("written by the scan")
            } else {
                at += 1 + usize::from(long);
                u64::from(pair & 0x7f) | if long { u64::from(pair >> 8) << 7 } else { 0 }
            };
            put_rice(&mut positions, gap, k);
        }
    }
    let mut histogram = [0u64; MAX_TOKENS];
    let mut tokens = Tokens::default();
    if differences {
        let (stream, count) = (&range.values[..], range.count);
        tokens = match width {
            1 => rans::tokenize_diff::<1>(stream, count, &mut histogram),
            2 => rans::tokenize_diff::<2>(stream, count, &mut histogram),
            4 => rans::tokenize_diff::<4>(stream, count, &mut histogram),
            _ => rans::tokenize_diff::<8>(stream, count, &mut histogram),
        };
    }
    let position_bits = positions.bit_len();
    CompactRange { positions: positions.finish(), position_bits, tokens, histogram }
}

/// Bits of the `diffbits` stream of these differences, from their `rans` token counts (tokens 1 to 4 are ±1 and ±2)
/// and how many of them the `diff` stream escapes.
fn diffbits_bits(histogram: &[u64; MAX_TOKENS], escapes: u64, width: usize) -> u64 {
    let (ones, twos) = (histogram[1] + histogram[2], histogram[3] + histogram[4]);
    let others = histogram.iter().sum::<u64>() - ones - twos;
    2 * ones + 3 * twos + 10 * others + 8 * width as u64 * escapes
}

/// The `diffbits` stream of a tensor's ranges, re-encoded side by side.
fn diffbits_stream(ranges: &[Changes], width: usize) -> Vec<u8> {
    let parts: Vec<(Vec<u8>, u64)> = ranges
        .par_iter()
        .map(|range| {
            let mut values = BitWriter::with_capacity(range.values.len() / 2);
            let (stream, count) = (&range.values[..], range.count);
            match width {
                1 => diff_to_diffbits::<1>(stream, count, &mut values),
                2 => diff_to_diffbits::<2>(stream, count, &mut values),
                4 => diff_to_diffbits::<4>(stream, count, &mut values),
                _ => diff_to_diffbits::<8>(stream, count, &mut values),
            }
            let bits = values.bit_len();
            (values.finish(), bits)
        })
        .collect();
    let mut out = BitWriter::with_capacity(parts.iter().map(|p| p.1).sum::<u64>().div_ceil(8) as usize);
    for (bytes, bits) in &parts {
        out.append(bytes, *bits);
    }
    out.finish()
}

/// The `rans` stream of a tensor's differences where it is smaller than `smaller_than` bytes.
fn rans_stream(compacts: &[CompactRange], histogram: &[u64; MAX_TOKENS], smaller_than: usize) -> Option<Vec<u8>> {
    if histogram.iter().all(|&c| c == 0) {
        return None;
    }
    let freqs = rans::normalise(histogram);
    // The estimate is within a few bytes of the length: skip the encoding where it cannot win.
    if rans::estimated_len(histogram, &freqs) > smaller_than as f64 + 64.0 {
        return None;
    }
    let parts: Vec<&Tokens> = compacts.iter().map(|c| &c.tokens).collect();
    let stream = rans::encode(&parts, &freqs);
    (stream.len() < smaller_than).then_some(stream)
}

/// The `compact` codec's choice for one tensor, made by every writer of it (core::diff, core::mirror): from the
/// scan's changes of the tensor's consecutive ranges (values scanned as `abs` or `diff`), `rice` positions kept only
/// where smaller than `varint`, and the smallest of `diff`, `diffbits` and `rans` values (the older on a tie); None when the tensor stored
/// whole, `dense_len` bytes, is no larger. Ranges are re-encoded side by side in the rayon pool; codes are
/// appended code by code, so the bytes do not depend on how the tensor was cut into ranges.
pub fn smallest_streams(
    ranges: &[Changes],
    width: usize,
    scanned_values: ValueCodec,
    dense_len: usize,
) -> Option<TensorStreams> {
    let (varint_len, byte_values_len) = scan::joined_lens(ranges);
    let differences = scanned_values == ValueCodec::Diff;
    let (k, previous_ends) = rice_plan(ranges);
    let compacts: Vec<CompactRange> = ranges
        .par_iter()
        .zip(previous_ends)
        .map(|(range, previous_end)| compact_range(range, k, previous_end, width, differences))
        .collect();
    let (mut rice, mut bit_values) = (None, None);
    let position_bits = 8 + compacts.iter().map(|c| c.position_bits).sum::<u64>();
    if position_bits.div_ceil(8) < varint_len as u64 {
        let mut out = BitWriter::with_capacity(position_bits.div_ceil(8) as usize);
        out.put(u64::from(k), 8);
        for c in &compacts {
            out.append(&c.positions, c.position_bits);
        }
        rice = Some(out.finish());
    }
    let mut values_codec = scanned_values;
    if differences {
        let mut histogram = [0u64; MAX_TOKENS];
        let mut escapes = 0;
        for c in &compacts {
            for (total, count) in histogram.iter_mut().zip(&c.histogram) {
                *total += count;
            }
            escapes += c.tokens.escapes;
        }
        // Only the stream that is kept is encoded: `diffbits`'s length follows from the token counts.
        let diffbits_len = diffbits_bits(&histogram, escapes, width).div_ceil(8) as usize;
        if let Some(stream) = rans_stream(&compacts, &histogram, diffbits_len.min(byte_values_len)) {
            bit_values = Some(stream);
            values_codec = ValueCodec::Rans;
        } else if diffbits_len < byte_values_len {
            let stream = diffbits_stream(ranges, width);
            assert_eq!(stream.len(), diffbits_len, "diffbits length counted from the tokens");
            bit_values = Some(stream);
            values_codec = ValueCodec::DiffBits;
        }
    }
    let positions_len = rice.as_ref().map_or(varint_len, Vec::len);
    let values_len = bit_values.as_ref().map_or(byte_values_len, Vec::len);
    if positions_len + values_len >= dense_len {
        return None;
    }
    let positions_codec = if rice.is_some() { PositionCodec::Rice } else { PositionCodec::Varint };
    let (positions, values) = match (rice, bit_values) {
        (Some(positions), Some(values)) => (positions, values),
        (rice, bit_values) => {
            let (varint_positions, byte_values) = scan::join_streams(ranges);
            (rice.unwrap_or(varint_positions), bit_values.unwrap_or(byte_values))
        }
    };
    Some(TensorStreams { positions_codec, values_codec, positions, values })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bits taken by `gap` with Rice parameter `k`.
    fn rice_bits(gap: u64, k: u32) -> u64 {
        let quotient = gap >> k;
        if quotient < u64::from(ESCAPE_ONES) {
            quotient + 1 + u64::from(k)
        } else {
            u64::from(ESCAPE_ONES) + 64
        }
    }

    fn positions_from_gaps(gaps: &[u64]) -> Vec<u64> {
        let mut next = 0u64;
        gaps.iter()
            .map(|&g| {
                let p = next + g;
                next = p + 1;
                p
            })
            .collect()
    }

    #[test]
    fn rice_roundtrips_including_escapes() {
        let gaps = [0u64, 1, 2, 99, 100, 5000, 1 << 20, (1 << 40) + 3, 0, 7, 1 << 62];
        for k in [0, 1, 3, 6, 7, 20, MAX_RICE_K] {
            let stream = write_rice(gaps.iter().copied(), k);
            let mut reader = RiceReader::new(&stream, u64::MAX).unwrap();
            let decoded: Vec<u64> = gaps.iter().map(|_| reader.next_position().unwrap()).collect();
            assert_eq!(decoded, positions_from_gaps(&gaps), "k={k}");
            assert!(reader.is_exhausted(), "k={k}");
        }
    }

    #[test]
    fn rice_k_is_near_best_for_geometric_gaps() {
        for density in [0.001f64, 0.0025, 0.01, 0.05, 0.3, 0.9] {
            // Geometric gaps from a fixed LCG: count failures before a success of probability `density`.
            let mut state = 0x2545_f491_4f6c_dd1du64;
            let gaps: Vec<u64> = (0..20000)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let u = ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
                    (u.ln() / (1.0 - density).ln()).floor() as u64
                })
                .collect();
            let cost = |k| gaps.iter().map(|&g| rice_bits(g, k)).sum::<u64>();
            let best = (0..=MAX_RICE_K).map(cost).min().unwrap();
            let chosen = cost(rice_k(gaps.len() as u64, gaps.iter().sum()));
            assert!(chosen as f64 <= best as f64 * 1.01, "density {density}: {chosen} bits vs best {best}");
        }
    }

    #[test]
    fn appending_bit_streams_equals_writing_once() {
        let pieces: Vec<Vec<(u64, u32)>> =
            vec![vec![(1, 1), (0x1ff, 9)], vec![], vec![(0xabcdef, 24); 9], vec![(3, 2), (0, 5)]];
        let mut whole = BitWriter::with_capacity(0);
        let mut joined = BitWriter::with_capacity(0);
        joined.put(0b101, 3);
        whole.put(0b101, 3);
        for piece in &pieces {
            let mut part = BitWriter::with_capacity(0);
            for &(value, bits) in piece {
                part.put(value, bits);
                whole.put(value, bits);
            }
            let bits = part.bit_len();
            joined.append(&part.finish(), bits);
        }
        assert_eq!(joined.bit_len(), whole.bit_len());
        assert_eq!(joined.finish(), whole.finish());
    }

    #[test]
    fn rice_rejects_bad_streams() {
        assert!(RiceReader::new(&[MAX_RICE_K as u8 + 1], 10).is_err());
        // k = 0, then a unary run with no end.
        let mut reader = RiceReader::new(&[0, 0xff], 1000).unwrap();
        assert!(reader.next_position().is_err());
        // k = 0, gaps 0 then 0: positions 0, 1; the second is out of range for numel 1.
        let mut reader = RiceReader::new(&[0, 0b00], 1).unwrap();
        assert_eq!(reader.next_position(), Ok(0));
        assert!(reader.next_position().is_err());
        // Non-zero padding is not exhausted.
        let mut reader = RiceReader::new(&[0, 0b10], 10).unwrap();
        assert_eq!(reader.next_position(), Ok(0));
        assert!(!reader.is_exhausted());
        // An escape whose 64-bit gap is cut short.
        let mut reader = RiceReader::new(&[0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 1], u64::MAX).unwrap();
        assert!(reader.next_position().is_err());
    }

    fn diffbits_roundtrip<const W: usize>(differences: &[u64]) -> usize {
        let mut out = BitWriter::with_capacity(0);
        for &d in differences {
            put_difference(&mut out, d & mask(W), W);
        }
        let stream = out.finish();
        let mut reader = BitReader::new(&stream);
        for &d in differences {
            assert_eq!(read_difference::<W>(&mut reader), Ok(d & mask(W)), "W={W}");
        }
        assert!(reader.is_exhausted());
        stream.len()
    }

    #[test]
    fn diffbits_roundtrips_every_width() {
        let diffs: Vec<u64> = [1i64, -1, 2, -2, 3, -3, 127, -127, 128, -128, 300, 0, i64::MIN, i64::MAX]
            .iter()
            .map(|&d| d as u64)
            .collect();
        diffbits_roundtrip::<1>(&diffs);
        diffbits_roundtrip::<2>(&diffs);
        diffbits_roundtrip::<4>(&diffs);
        diffbits_roundtrip::<8>(&diffs);
        // ±1 take two bits each.
        assert_eq!(diffbits_roundtrip::<2>(&[1, u64::MAX, 1, 1]), 1);
    }
}
