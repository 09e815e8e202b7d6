//! Bit streams of the bit-packed codecs (`rice`, `diffbits`): bits packed least significant first into
//! little-endian bytes (docs/format.md §5, §6). A checked reader, and an unchecked window for the bulk of a stream.

/// Mask of the low `bits` bits (`bits < 64`).
#[inline(always)]
pub fn mask_bits(bits: u32) -> u64 {
    (1u64 << bits) - 1
}

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

    /// Appends `count` one bits.
    #[inline(always)]
    pub fn put_ones(&mut self, mut count: u32) {
        while count > 0 {
            let run = count.min(32);
            self.put((1u64 << run) - 1, run);
            count -= run;
        }
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
    pub(super) bytes: &'a [u8],
    /// The next bit to read.
    pub(super) bit: usize,
    total_bits: usize,
}

impl<'a> BitReader<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        BitReader { bytes, bit: 0, total_bits: bytes.len() * 8 }
    }

    /// The next bits without consuming them: at least 57 are meaningful, zeros past the end of the stream.
    #[inline(always)]
    pub(super) fn peek(&self) -> u64 {
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
    pub(super) fn consume(&mut self, bits: u32) -> Result<(), String> {
        self.bit += bits as usize;
        if self.bit > self.total_bits {
            return Err("stream ends early".to_owned());
        }
        Ok(())
    }

    /// Reads `bits <= 56` bits.
    #[inline(always)]
    pub fn read(&mut self, bits: u32) -> Result<u64, String> {
        let value = self.peek() & mask_bits(bits);
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
}

/// A window of up to 57 bits of a stream, refilled with one unchecked 8-byte load while 16 bytes remain. The
/// codes' own peeks (`rice`, `diffbits`) read it; where it gives up, a `BitReader` takes over at `bit`.
pub(super) struct Window<'a> {
    bytes: &'a [u8],
    /// Stream position of the window's first bit.
    pub(super) bit: usize,
    pub(super) word: u64,
    pub(super) left: u32,
    safe_bits: usize,
}

impl<'a> Window<'a> {
    pub(super) fn new(bytes: &'a [u8], bit: usize) -> Self {
        Window { bytes, bit, word: 0, left: 0, safe_bits: bytes.len().saturating_sub(16) * 8 }
    }

    /// Reloads the window at `bit`; false once fewer than 16 bytes remain (the checked readers take over).
    #[inline(always)]
    pub(super) fn refill(&mut self) -> bool {
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
    pub(super) fn take(&mut self, length: u32) {
        self.word >>= length;
        self.left -= length;
        self.bit += length as usize;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
