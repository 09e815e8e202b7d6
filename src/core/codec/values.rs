//! The byte-aligned value codecs, both directions: `abs` (the new raw bytes) and `diff` (the wrapping bit-pattern
//! difference), and how a decoded value of any value codec is applied to an element.
//!
//! `diff` writes one signed byte for differences in [-127, 127]. Anything else is the escape byte 0x80
//! followed by the full-width wrapping difference, little-endian. One-byte dtypes have no escape: the
//! byte is the whole difference.

use super::elements::{load_const, mask, sign_extend, store_const};
use super::{ValueCodec, WordSink};

/// The escape byte of the `diff` codec for elements wider than one byte.
pub const ESCAPE: u8 = 0x80;

/// True when a difference (sign-extended) takes one byte of the `diff` codec, not the escape.
#[inline(always)]
pub fn fits_one_byte(signed: i64) -> bool {
    signed.wrapping_add(127) as u64 <= 254
}

/// The difference of a `W`-byte element that one `diff` byte other than the escape stands for.
#[inline(always)]
pub fn short_value<const W: usize>(byte: u8) -> u64 {
    (i64::from(byte as i8) as u64) & mask(W)
}

/// Appends a wrapping difference in the `diff` codec.
#[inline(always)]
pub fn write_difference(out: &mut Vec<u8>, difference: u64, width: usize) {
    if width == 1 {
        out.push(difference as u8);
        return;
    }
    let signed = sign_extend(difference, width);
    if fits_one_byte(signed) {
        out.push(signed as i8 as u8);
    } else {
        out.push(ESCAPE);
        out.extend_from_slice(&difference.to_le_bytes()[..width]);
    }
}

/// Appends the `abs` value of a `W`-byte element (its new bits) through raw stores, as the scan kernel writes.
///
/// # Safety
/// As `WordSink::put`.
#[inline(always)]
pub unsafe fn put_abs<const W: usize, S: WordSink>(out: &mut S, new_bits: u64) {
    out.put(new_bits, W);
}

/// Appends the `diff` value of a `W`-byte element that went from `old_bits` to `new_bits` through raw stores, as
/// the scan kernel writes: only the escape of 8-byte elements branches on the data.
///
/// # Safety
/// As `WordSink::put`, with room for `1 + W` bytes and the store's overhang.
#[inline(always)]
pub unsafe fn put_diff<const W: usize, S: WordSink>(out: &mut S, old_bits: u64, new_bits: u64) {
    let difference = new_bits.wrapping_sub(old_bits) & mask(W);
    if W == 1 {
        out.put(difference, 1);
        return;
    }
    let signed = sign_extend(difference, W);
    let small = fits_one_byte(signed);
    if W == 8 {
        if small {
            out.put(signed as u64 & 0xff, 1);
        } else {
            out.put(u64::from(ESCAPE), 1);
            out.put(difference, 8);
        }
    } else {
        let word = if small { signed as u64 & 0xff } else { u64::from(ESCAPE) | (difference << 8) };
        out.put(word, if small { 1 } else { 1 + W });
    }
}

/// Reads one `abs` value of a `W`-byte element at `*at`, advancing `*at`: the new bits.
#[inline(always)]
pub fn read_abs<const W: usize>(bytes: &[u8], at: &mut usize) -> Result<u64, String> {
    let raw = bytes.get(*at..*at + W).ok_or(EARLY)?;
    *at += W;
    Ok(load_const::<W>(raw))
}

/// Reads one `diff` value of a `W`-byte element at `*at`, advancing `*at`: the wrapping difference.
#[inline(always)]
pub fn read_diff<const W: usize>(bytes: &[u8], at: &mut usize) -> Result<u64, String> {
    let &first = bytes.get(*at).ok_or(EARLY)?;
    *at += 1;
    if W == 1 {
        Ok(u64::from(first))
    } else if first == ESCAPE {
        read_abs::<W>(bytes, at)
    } else {
        Ok(short_value::<W>(first))
    }
}

const EARLY: &str = "value stream ends early";

/// Checks that an `abs` or `diff` value stream of `W`-byte elements holds exactly `changed` values, without
/// decoding them: `abs` by its length, `diff` by jumping from escape to escape.
pub fn check_bytes<const W: usize>(bytes: &[u8], codec: ValueCodec, changed: u64) -> Result<(), String> {
    let end = match codec {
        ValueCodec::Abs => {
            changed.checked_mul(W as u64).map_or(usize::MAX, |n| usize::try_from(n).unwrap_or(usize::MAX))
        }
        _ if W == 1 => changed.try_into().unwrap_or(usize::MAX),
        _ => {
            // Every byte between escapes is a whole value.
            let (mut at, mut seen) = (0usize, 0u64);
            while seen < changed {
                let Some(&first) = bytes.get(at) else {
                    return Err(EARLY.to_owned());
                };
                if first == ESCAPE {
                    at += 1 + W;
                    seen += 1;
                    continue;
                }
                let run = memchr::memchr(ESCAPE, &bytes[at..]).unwrap_or(bytes.len() - at);
                let take = (run as u64).min(changed - seen);
                at += take as usize;
                seen += take;
            }
            at
        }
    };
    match end.cmp(&bytes.len()) {
        std::cmp::Ordering::Greater => Err(EARLY.to_owned()),
        std::cmp::Ordering::Less => Err("value stream has bytes after the last change".to_owned()),
        std::cmp::Ordering::Equal => Ok(()),
    }
}

/// Applies one decoded value of any value codec to the element bytes `target`.
#[inline(always)]
pub fn apply<const W: usize>(target: &mut [u8], codec: ValueCodec, value: u64) {
    let new = if codec.holds_differences() { load_const::<W>(target).wrapping_add(value) } else { value };
    store_const::<W>(target, new);
}

#[cfg(test)]
mod tests {
    use super::super::elements::{load, store};
    use super::*;

    fn roundtrip<const W: usize>(old: u64, new: u64) {
        let width = W;
        let (mut o, mut n) = ([0u8; 8], [0u8; 8]);
        store(&mut o, old, width);
        store(&mut n, new, width);
        for codec in [ValueCodec::Abs, ValueCodec::Diff] {
            let mut out = Vec::new();
            if codec == ValueCodec::Abs {
                out.extend_from_slice(&n[..W]);
            } else {
                write_difference(&mut out, new.wrapping_sub(old) & mask(W), W);
            }
            let mut at = 0;
            let value =
                if codec == ValueCodec::Abs { read_abs::<W>(&out, &mut at) } else { read_diff::<W>(&out, &mut at) };
            let value = value.unwrap();
            assert_eq!(at, out.len());
            assert_eq!(check_bytes::<W>(&out, codec, 1), Ok(()));
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
                crate::core::codec::with_width!(width, W => roundtrip::<W>(old & m, new & m));
            }
        }
    }

    #[test]
    fn small_differences_take_one_byte() {
        let mut out = Vec::new();
        write_difference(&mut out, 9u64.wrapping_sub(10) & 0xffff, 2);
        write_difference(&mut out, 137 - 10, 2);
        assert_eq!(out, vec![0xff, 127]);
        out.clear();
        write_difference(&mut out, 128, 2);
        assert_eq!(out, vec![ESCAPE, 128, 0]);
    }
}
