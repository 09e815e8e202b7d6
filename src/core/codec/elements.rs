//! Element words: little-endian loads and stores of 1-, 2-, 4- and 8-byte elements, and the integer views of
//! a wrapping difference (sign extension, zigzag) that every value codec shares.

/// Mask of the low `width` bytes.
#[inline]
pub const fn mask(width: usize) -> u64 {
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

/// The low `width` bytes of `value` read as a signed integer.
#[inline(always)]
pub const fn sign_extend(value: u64, width: usize) -> i64 {
    let shift = 64 - 8 * width as u32;
    ((value << shift) as i64) >> shift
}

/// The zigzag code of a wrapping difference of a `width`-byte element: 0, -1, 1, -2, 2, ... -> 0, 1, 2, 3, 4, ...
#[inline(always)]
pub const fn zigzag(difference: u64, width: usize) -> u64 {
    let signed = sign_extend(difference, width);
    ((signed << 1) ^ (signed >> 63)) as u64
}

/// The wrapping difference (all 64 bits; mask to the width) of a zigzag code.
#[inline(always)]
pub const fn unzigzag(u: u64) -> u64 {
    (u >> 1) ^ (u & 1).wrapping_neg()
}

/// A hint to load the cache line of `bytes[at]` (nothing where `at` is past the end): for loads spread over a large
/// tensor, each on a line of its own, asked for a few ahead so that their misses overlap.
#[inline(always)]
pub fn prefetch(bytes: &[u8], at: usize) {
    #[cfg(target_arch = "x86_64")]
    if at < bytes.len() {
        // SAFETY: a prefetch of an address inside the slice; it never faults and changes nothing.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(bytes.as_ptr().add(at).cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (bytes, at);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_extend_and_zigzag_every_width() {
        for width in [1usize, 2, 4, 8] {
            let top = 1u64 << (8 * width - 1);
            assert_eq!(sign_extend(mask(width), width), -1);
            assert_eq!(sign_extend(top, width), if width == 8 { i64::MIN } else { -(top as i64) });
            assert_eq!(sign_extend(top - 1, width), (top - 1) as i64);
            for difference in [0u64, 1, mask(width), 2, mask(width) - 1, top, top - 1] {
                assert_eq!(unzigzag(zigzag(difference, width)) & mask(width), difference, "width {width}");
            }
            assert_eq!(zigzag(mask(width), width), 1);
            assert_eq!(zigzag(1, width), 2);
        }
    }
}
