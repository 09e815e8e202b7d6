//! Value coding for changed elements: `abs` (new raw bytes) and `diff` (wrapping bit-pattern difference).
//!
//! `diff` writes one signed byte for differences in [-127, 127]. Anything else is the escape byte 0x80
//! followed by the full-width wrapping difference, little-endian. One-byte dtypes have no escape: the
//! byte is the whole difference.

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

/// Stores the low `width` bytes of `value`, little-endian.
#[inline]
pub fn store(out: &mut [u8], value: u64, width: usize) {
    out[..width].copy_from_slice(&value.to_le_bytes()[..width]);
}

/// Appends the value of one changed element.
#[inline]
pub fn write(out: &mut Vec<u8>, codec: ValueCodec, old: &[u8], new: &[u8], width: usize) {
    match codec {
        ValueCodec::Abs => out.extend_from_slice(&new[..width]),
        ValueCodec::Diff => {
            let difference = load(new, width).wrapping_sub(load(old, width)) & mask(width);
            write_difference(out, difference, width);
        }
    }
}

/// Appends a wrapping difference in the `diff` codec.
#[inline]
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

#[inline]
fn sign_extend(value: u64, width: usize) -> i64 {
    let shift = 64 - 8 * width as u32;
    ((value << shift) as i64) >> shift
}

/// Reads values one by one: the raw new bits (`abs`) or the wrapping difference (`diff`).
pub struct ValueReader<'a> {
    bytes: &'a [u8],
    at: usize,
    codec: ValueCodec,
    width: usize,
}

impl<'a> ValueReader<'a> {
    pub fn new(bytes: &'a [u8], codec: ValueCodec, width: usize) -> Self {
        ValueReader { bytes, at: 0, codec, width }
    }

    /// The next value as `width` low bytes of a u64.
    #[inline]
    pub fn next_value(&mut self) -> Result<u64, String> {
        let width = self.width;
        let take = |at: &mut usize, n: usize| -> Result<u64, String> {
            let end = at.checked_add(n).filter(|&end| end <= self.bytes.len());
            let end = end.ok_or_else(|| "value stream ends early".to_owned())?;
            let value = load(&self.bytes[*at..end], n);
            *at = end;
            Ok(value)
        };
        match self.codec {
            ValueCodec::Abs => take(&mut self.at, width),
            ValueCodec::Diff => {
                let first = take(&mut self.at, 1)? as u8;
                if width == 1 {
                    Ok(u64::from(first))
                } else if first == ESCAPE {
                    take(&mut self.at, width)
                } else {
                    Ok((i64::from(first as i8) as u64) & mask(width))
                }
            }
        }
    }

    /// True once every byte has been consumed.
    pub fn is_exhausted(&self) -> bool {
        self.at == self.bytes.len()
    }
}

/// Applies one decoded value to the element bytes `target`.
#[inline]
pub fn apply(target: &mut [u8], codec: ValueCodec, value: u64, width: usize) {
    let new = match codec {
        ValueCodec::Abs => value,
        ValueCodec::Diff => load(target, width).wrapping_add(value),
    };
    store(target, new, width);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(old: u64, new: u64, width: usize) {
        let (mut o, mut n) = ([0u8; 8], [0u8; 8]);
        store(&mut o, old, width);
        store(&mut n, new, width);
        for codec in [ValueCodec::Abs, ValueCodec::Diff] {
            let mut out = Vec::new();
            write(&mut out, codec, &o, &n, width);
            let mut reader = ValueReader::new(&out, codec, width);
            let value = reader.next_value().unwrap();
            assert!(reader.is_exhausted());
            let mut target = o;
            apply(&mut target, codec, value, width);
            assert_eq!(load(&target, width), new & mask(width), "{codec:?} {old} -> {new} width {width}");
        }
    }

    #[test]
    fn diff_roundtrips_all_widths() {
        for width in [1, 2, 4, 8] {
            let m = mask(width);
            for (old, new) in [(0, 1), (1, 0), (5, 132), (132, 5), (0, m), (m, 0), (m / 2, m / 2 + 1), (7, 7 + 127), (7 + 128, 7)] {
                roundtrip(old & m, new & m, width);
            }
        }
    }

    #[test]
    fn small_differences_take_one_byte() {
        let mut out = Vec::new();
        write(&mut out, ValueCodec::Diff, &[10, 0], &[9, 0], 2);
        write(&mut out, ValueCodec::Diff, &[10, 0], &[137, 0], 2);
        assert_eq!(out, vec![0xff, 127]);
        out.clear();
        write(&mut out, ValueCodec::Diff, &[0, 0], &[128, 0], 2);
        assert_eq!(out, vec![ESCAPE, 128, 0]);
    }
}
