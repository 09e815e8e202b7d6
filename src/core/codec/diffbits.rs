//! The `diffbits` value codec: wrapping bit-pattern differences in a bit-packed prefix code, 2 bits for ±1 and 3
//! for ±2, else 2 bits before the byte-aligned `diff` code of the value (docs/format.md §6). Bits as in `bits`.

use rayon::prelude::*;

use super::bits::{BitReader, BitWriter, Window};
use super::elements::{mask, sign_extend};
use super::ranges::Changes;
use super::values::{self, ESCAPE};
use super::with_width;

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
            if width == 1 || values::fits_one_byte(signed) {
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

/// The `diffbits` stream of a tensor's ranges (scanned as `diff`), re-encoded side by side.
pub fn diffbits_stream(ranges: &[Changes], width: usize) -> Vec<u8> {
    let parts: Vec<(Vec<u8>, u64)> = ranges
        .par_iter()
        .map(|range| {
            let mut values = BitWriter::with_capacity(range.values.len() / 2);
            let (stream, count) = (&range.values[..], range.count);
            with_width!(width, W => diff_to_diffbits::<W>(stream, count, &mut values));
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
        Ok(values::short_value::<W>(first as u8))
    }
}

impl Window<'_> {
    /// The next `diffbits` value of a `W`-byte element, not consumed: (value, length). None as for `peek_rice`
    /// (an escaped 8-byte value is longer than a window).
    #[inline(always)]
    pub(super) fn peek_difference<const W: usize>(&mut self) -> Option<(u64, u32)> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(check_diffbits::<W>(&stream, differences.len() as u64), Ok(()));
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

    // Pins the final `bits.is_exhausted()` of `check_diffbits`,
    // the load-time check of `diffbits` values beside `varint`, `context` or `all` positions (`rice` + `diffbits`
    // is checked by pairs::check_rice_diffbits instead). A stream with bytes after its last value must be refused
    // at load: accepted there, the apply's walk finds them only after writing every change, and fails with the
    // target already written (a checked tensor's writes are not taken back).
    #[test]
    fn check_diffbits_refuses_bytes_after_the_last_value() {
        let mut out = BitWriter::with_capacity(0);
        for d in [1u64, u64::MAX, 300, 1, 1] {
            put_difference(&mut out, d & mask(2), 2);
        }
        let stream = out.finish();
        assert_eq!(check_diffbits::<2>(&stream, 5), Ok(()));
        for tail in [&[0u8][..], &[0xff], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]] {
            let longer = [&stream[..], tail].concat();
            assert!(check_diffbits::<2>(&longer, 5).is_err(), "{} bytes after the last value", tail.len());
        }
        assert!(check_diffbits::<2>(&stream, 4).is_err(), "a value after the last change");
    }
}
