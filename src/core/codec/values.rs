//! Value coding for changed elements: `abs` (new raw bytes) and `diff` (wrapping bit-pattern difference).
//!
//! `diff` writes one signed byte for differences in [-127, 127]. Anything else is the escape byte 0x80
//! followed by the full-width wrapping difference, little-endian. One-byte dtypes have no escape: the
//! byte is the whole difference.

use super::compact::{read_difference, BitReader};
use super::rans::RansReader;
use super::ValueCodec;

/// The escape byte of the `diff` codec for elements wider than one byte.
pub const ESCAPE: u8 = 0x80;

/// Mask of the low `width` bytes.
#[inline]
pub fn mask(width: usize) -> u64 {
    if width >= 8 {
        u64::MAX
    } else {
        (1u64 << (8 * width)) - 1
    }
}

/// Loads a little-endian element of `width` bytes.
#[inline]
pub fn load(bytes: &[u8], width: usize) -> u64 {
    let mut buf = [0u8; 8];
    buf[..width].copy_from_slice(&bytes[..width]);
    u64::from_le_bytes(buf)
}

/// Loads a little-endian element of a width known at compile time.
#[inline(always)]
pub fn load_const<const W: usize>(bytes: &[u8]) -> u64 {
    let bytes: [u8; W] = bytes[..W].try_into().expect("W bytes");
    match W {
        1 => u64::from(bytes[0]),
        2 => u64::from(u16::from_le_bytes(bytes[..2].try_into().expect("2 bytes"))),
        4 => u64::from(u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes"))),
        _ => u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")),
    }
}

/// Stores the low `W` bytes of `value`, little-endian.
#[inline(always)]
pub fn store_const<const W: usize>(out: &mut [u8], value: u64) {
    out[..W].copy_from_slice(&value.to_le_bytes()[..W]);
}

/// Stores the low `width` bytes of `value`, little-endian.
#[inline]
pub fn store(out: &mut [u8], value: u64, width: usize) {
    out[..width].copy_from_slice(&value.to_le_bytes()[..width]);
}

/// Appends the value of one changed element of a width known at compile time. Differences are always written
/// byte-coded (`diff`); `diffbits` streams are re-encoded from these (see `compact`).
#[inline(always)]
pub fn write_const<const W: usize>(out: &mut Vec<u8>, codec: ValueCodec, old: &[u8], new: &[u8]) {
    match codec {
        ValueCodec::Abs => out.extend_from_slice(&new[..W]),
        ValueCodec::Diff | ValueCodec::DiffBits | ValueCodec::Rans => {
            let difference = load_const::<W>(new).wrapping_sub(load_const::<W>(old)) & mask(W);
            write_difference(out, difference, W);
        }
    }
}

/// Appends a wrapping difference in the `diff` codec.
#[inline(always)]
pub fn write_difference(out: &mut Vec<u8>, difference: u64, width: usize) {
    if width == 1 {
        out.push(difference as u8);
        return;
    }
    let signed = sign_extend(difference, width);
    if (-127..=127).contains(&signed) {
        out.push(signed as i8 as u8);
    } else {
        out.push(ESCAPE);
        out.extend_from_slice(&difference.to_le_bytes()[..width]);
    }
}

/// The low `width` bytes of `value` read as a signed integer.
#[inline(always)]
pub fn sign_extend(value: u64, width: usize) -> i64 {
    let shift = 64 - 8 * width as u32;
    ((value << shift) as i64) >> shift
}

/// Reads values one by one: the raw new bits (`abs`) or the wrapping difference (`diff`).
pub struct ValueReader<'a, const W: usize> {
    bytes: &'a [u8],
    at: usize,
    codec: ValueCodec,
    /// Used by `diffbits` only.
    bits: BitReader<'a>,
    /// Used by `rans` only.
    rans: Option<RansReader<'a>>,
}

impl<'a, const W: usize> ValueReader<'a, W> {
    /// Fails where a `rans` stream's table or initial state is bad.
    pub fn new(bytes: &'a [u8], codec: ValueCodec) -> Result<Self, String> {
        let rans = if codec == ValueCodec::Rans { Some(RansReader::new(bytes, W)?) } else { None };
        Ok(ValueReader { bytes, at: 0, codec, bits: BitReader::new(bytes), rans })
    }

    #[inline(always)]
    fn take<const N: usize>(&mut self) -> Result<u64, String> {
        match self.bytes.get(self.at..self.at + N) {
            Some(raw) => {
                self.at += N;
                Ok(load_const::<N>(raw))
            }
            None => Err("value stream ends early".to_owned()),
        }
    }

    /// The next value as `W` low bytes of a u64.
    #[inline(always)]
    pub fn next_value(&mut self) -> Result<u64, String> {
        match self.codec {
            ValueCodec::Abs => self.take::<W>(),
            ValueCodec::Diff => {
                let first = self.take::<1>()? as u8;
                if W == 1 {
                    Ok(u64::from(first))
                } else if first == ESCAPE {
                    self.take::<W>()
                } else {
                    Ok((i64::from(first as i8) as u64) & mask(W))
                }
            }
            ValueCodec::DiffBits => read_difference::<W>(&mut self.bits),
            ValueCodec::Rans => self.rans.as_mut().expect("made with the codec").next_value::<W>(),
        }
    }

    /// True once every byte has been consumed (for `diffbits`: every bit, with zero padding; for `rans`: with the
    /// state back at its start).
    pub fn is_exhausted(&self) -> bool {
        match self.codec {
            ValueCodec::DiffBits => self.bits.is_exhausted(),
            ValueCodec::Rans => self.rans.as_ref().is_some_and(RansReader::is_exhausted),
            _ => self.at == self.bytes.len(),
        }
    }
}

/// Applies one decoded value to the element bytes `target`.
#[inline(always)]
pub fn apply<const W: usize>(target: &mut [u8], codec: ValueCodec, value: u64) {
    let new = if codec.holds_differences() { load_const::<W>(target).wrapping_add(value) } else { value };
    store_const::<W>(target, new);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(old: u64, new: u64, width: usize) {
        match width {
            1 => roundtrip_const::<1>(old, new),
            2 => roundtrip_const::<2>(old, new),
            4 => roundtrip_const::<4>(old, new),
            _ => roundtrip_const::<8>(old, new),
        }
    }

    fn roundtrip_const<const W: usize>(old: u64, new: u64) {
        let width = W;
        let (mut o, mut n) = ([0u8; 8], [0u8; 8]);
        store(&mut o, old, width);
        store(&mut n, new, width);
        for codec in [ValueCodec::Abs, ValueCodec::Diff] {
            let mut out = Vec::new();
            write_const::<W>(&mut out, codec, &o, &n);
            let mut reader = ValueReader::<W>::new(&out, codec).unwrap();
            let value = reader.next_value().unwrap();
            assert!(reader.is_exhausted());
            let mut target = o;
            apply::<W>(&mut target, codec, value);
            assert_eq!(load(&target, width), new & mask(width), "{codec:?} {old} -> {new} width {width}");
        }
    }

    #[test]
    fn diff_roundtrips_all_widths() {
        for width in [1, 2, 4, 8] {
            let m = mask(width);
            for (old, new) in
                [(0, 1), (1, 0), (5, 132), (132, 5), (0, m), (m, 0), (m / 2, m / 2 + 1), (7, 7 + 127), (7 + 128, 7)]
            {
                roundtrip(old & m, new & m, width);
            }
        }
    }

    #[test]
    fn small_differences_take_one_byte() {
        let mut out = Vec::new();
        write_const::<2>(&mut out, ValueCodec::Diff, &[10, 0], &[9, 0]);
        write_const::<2>(&mut out, ValueCodec::Diff, &[10, 0], &[137, 0]);
        assert_eq!(out, vec![0xff, 127]);
        out.clear();
        write_const::<2>(&mut out, ValueCodec::Diff, &[0, 0], &[128, 0]);
        assert_eq!(out, vec![ESCAPE, 128, 0]);
    }
}
