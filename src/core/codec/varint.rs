//! The `varint` position codec: LEB128 gaps of strictly increasing positions, both directions, and LEB128 itself
//! (the record list's numbers use it too).

use super::WordSink;

/// Appends `value` as an unsigned LEB128 varint.
#[inline]
pub fn write(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// Appends `gap` as a LEB128 varint through raw stores, as the scan kernel writes: one or two bytes (gaps below
/// 2^14, nearly all) without a branch on which, longer ones a byte at a time.
///
/// # Safety
/// As `WordSink::put`, with room for ten bytes and the store's overhang.
#[inline(always)]
pub unsafe fn put<S: WordSink>(out: &mut S, gap: u64) {
    if gap < 1 << 14 {
        let long = gap >= 0x80;
        let word = if long { (gap & 0x7f) | 0x80 | ((gap >> 7) << 8) } else { gap };
        out.put(word, 1 + usize::from(long));
    } else {
        let mut rest = gap;
        while rest >= 0x80 {
            out.put((rest & 0x7f) | 0x80, 1);
            rest >>= 7;
        }
        out.put(rest, 1);
    }
}

/// Encoded length of `value` in bytes.
#[inline]
pub fn len(value: u64) -> usize {
    let bits = 64 - (value | 1).leading_zeros() as usize;
    bits.div_ceil(7)
}

/// Why a varint could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadError {
    /// The stream ended inside or before the varint.
    Truncated,
    /// More than 64 bits, or more than ten bytes.
    Overflow,
}

/// Reads one varint from `bytes` at `*at`, advancing `*at`.
#[inline]
pub fn read(bytes: &[u8], at: &mut usize) -> Result<u64, ReadError> {
    let mut value = 0u64;
    let mut shift = 0u32;
    loop {
        let Some(&byte) = bytes.get(*at) else {
            return Err(ReadError::Truncated);
        };
        *at += 1;
        let payload = u64::from(byte & 0x7f);
        if shift == 63 && payload > 1 {
            return Err(ReadError::Overflow);
        }
        value |= payload << shift;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
        shift += 7;
        if shift > 63 {
            return Err(ReadError::Overflow);
        }
    }
}

/// Reads a whole stream of varints without decoding them one by one: how many there are and the sum of their
/// values (`None` where the sum passes 2^64). Fails where a varint runs past ten bytes or over 64 bits, or the
/// stream ends inside one, exactly where `read` would fail on some varint of the stream.
///
/// A branch-free pass over the bytes: the shift a byte's payload takes is carried from byte to byte.
pub fn count_and_sum(bytes: &[u8]) -> Result<(u64, Option<u64>), ReadError> {
    if let Some(short) = count_and_sum_short(bytes) {
        return Ok(short);
    }
    count_and_sum_any(bytes)
}

/// `count_and_sum` of a stream whose varints all take one or two bytes (gaps below 2^14: nearly every stream), or
/// None. A byte's weight is 128 when the byte before it continues a varint, else 1, so each byte is summed on
/// its own, and the loop vectorises.
fn count_and_sum_short(bytes: &[u8]) -> Option<(u64, Option<u64>)> {
    let (&first, _) = bytes.split_first()?;
    if bytes[bytes.len() - 1] >= 0x80 {
        return None;
    }
    let (mut sum, mut ends, mut chained) = (u64::from(first & 0x7f), u64::from(first < 0x80), 0u8);
    // 32-bit lanes over pieces small enough not to overflow them (each byte adds under 2^14).
    let mut start = 1;
    while start < bytes.len() {
        let end = (start + (1 << 16)).min(bytes.len());
        let (mut piece_sum, mut piece_ends) = (0u32, 0u32);
        for (&before, &byte) in bytes[start - 1..end - 1].iter().zip(&bytes[start..end]) {
            piece_sum += u32::from(byte & 0x7f) << (7 * (before >> 7));
            piece_ends += u32::from(!byte >> 7);
            chained |= before & byte;
        }
        sum += u64::from(piece_sum);
        ends += u64::from(piece_ends);
        start = end;
    }
    (chained < 0x80).then_some((ends, Some(sum)))
}

fn count_and_sum_any(bytes: &[u8]) -> Result<(u64, Option<u64>), ReadError> {
    let (mut count, mut sum, mut carried) = (0u64, 0u64, false);
    let (mut shift, mut overflow) = (0u32, false);
    for &byte in bytes {
        let payload = u64::from(byte & 0x7f);
        // Ten bytes hold 64 bits: the tenth (shift 63) may carry one bit, and an eleventh is an overflow.
        overflow |= shift > 63 || (shift == 63 && payload > 1);
        let (total, wrapped) = sum.overflowing_add(payload << shift.min(63));
        sum = total;
        carried |= wrapped;
        let more = byte >= 0x80;
        count += u64::from(!more);
        shift = if more { (shift + 7).min(70) } else { 0 };
    }
    if overflow {
        return Err(ReadError::Overflow);
    }
    if bytes.last().is_some_and(|&b| b >= 0x80) {
        return Err(ReadError::Truncated);
    }
    Ok((count, (!carried).then_some(sum)))
}

/// `read` for gaps: one or two bytes, nearly every gap, without a branch on which; longer ones by `read`.
#[inline(always)]
pub fn read_gap(bytes: &[u8], at: &mut usize) -> Result<u64, ReadError> {
    match bytes.get(*at..*at + 2).map(|two| u16::from_le_bytes([two[0], two[1]])) {
        Some(pair) if pair & 0x8080 != 0x8080 => {
            let long = pair & 0x80 != 0;
            *at += 1 + usize::from(long);
            Ok(u64::from(pair & 0x7f) | if long { u64::from(pair >> 8) << 7 } else { 0 })
        }
        _ => read(bytes, at),
    }
}

/// Checks a whole `varint` position stream of `changed` gaps, as reading them one by one with `PositionReader`
/// would, and returns the last position; the gaps are summed without decoding them one by one (`count_and_sum`).
pub fn check_varint(bytes: &[u8], changed: u64, numel: u64) -> Result<Option<u64>, String> {
    let (count, sum) = count_and_sum(bytes).map_err(|e| match e {
        ReadError::Truncated => "position stream ends early".to_owned(),
        ReadError::Overflow => "a position varint overflows 64 bits".to_owned(),
    })?;
    match count.cmp(&changed) {
        std::cmp::Ordering::Less => return Err("position stream ends early".to_owned()),
        std::cmp::Ordering::Greater => return Err("position stream has bytes after the last change".to_owned()),
        std::cmp::Ordering::Equal => {}
    }
    // Each position is the previous one plus one plus its gap.
    let last = sum.and_then(|sum| sum.checked_add(count)).filter(|&end| end <= numel);
    match last {
        Some(end) => Ok(end.checked_sub(1)),
        None => Err(format!("position out of range (tensor has {numel} elements)")),
    }
}

/// Decodes gap-coded positions one by one, checking each against `numel`.
pub struct PositionReader<'a> {
    bytes: &'a [u8],
    at: usize,
    next_allowed: u64,
    numel: u64,
}

impl<'a> PositionReader<'a> {
    pub fn new(bytes: &'a [u8], numel: u64) -> Self {
        PositionReader { bytes, at: 0, next_allowed: 0, numel }
    }

    /// The next position, or a message saying why the stream is bad.
    #[inline(always)]
    pub fn next_position(&mut self) -> Result<u64, String> {
        let gap = read_gap(self.bytes, &mut self.at).map_err(|e| match e {
            ReadError::Truncated => "position stream ends early".to_owned(),
            ReadError::Overflow => format!("position varint at byte {} overflows 64 bits", self.at),
        })?;
        super::next_position(&mut self.next_allowed, gap, self.numel)
    }

    /// True once every byte has been consumed.
    pub fn is_exhausted(&self) -> bool {
        self.at == self.bytes.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_edges() {
        for value in [0, 1, 127, 128, 16383, 16384, u64::from(u32::MAX), u64::MAX - 1, u64::MAX] {
            let mut out = Vec::new();
            write(&mut out, value);
            assert_eq!(out.len(), len(value), "len of {value}");
            let mut at = 0;
            assert_eq!(read(&out, &mut at), Ok(value));
            assert_eq!(at, out.len());
        }
    }

    #[test]
    fn rejects_bad_varints() {
        let mut at = 0;
        assert_eq!(read(&[0x80, 0x80], &mut at), Err(ReadError::Truncated));
        let mut at = 0;
        assert_eq!(read(&[0xff; 11], &mut at), Err(ReadError::Overflow));
        let mut at = 0;
        // ten bytes whose last carries more than the one bit left
        let mut bytes = vec![0xff; 9];
        bytes.push(0x02);
        assert_eq!(read(&bytes, &mut at), Err(ReadError::Overflow));
    }

    #[test]
    fn count_and_sum_agrees_with_read() {
        let mut bytes = Vec::new();
        let values = [0u64, 1, 127, 128, 300, 16384, 1 << 40, u64::MAX];
        for &v in &values {
            write(&mut bytes, v);
        }
        let (count, sum) = count_and_sum(&bytes[..bytes.len() - len(u64::MAX)]).unwrap();
        assert_eq!((count, sum), (7, Some(values[..7].iter().sum())));
        assert_eq!(count_and_sum(&bytes).unwrap(), (8, None));
        assert_eq!(count_and_sum(&[]).unwrap(), (0, Some(0)));
        // Short varints only (the fast path) against the general loop.
        let mut short = Vec::new();
        for v in [0u64, 5, 127, 128, 129, 16383, 77, 200] {
            write(&mut short, v);
        }
        assert_eq!(count_and_sum_short(&short), Some((8, Some(5 + 127 + 128 + 129 + 16383 + 77 + 200))));
        assert_eq!(count_and_sum_any(&short).unwrap(), count_and_sum_short(&short).unwrap());
        assert_eq!(count_and_sum_short(&[0x80, 0x80, 0x01]), None);
        assert_eq!(count_and_sum_short(&[0x05, 0x80]), None);
        assert_eq!(count_and_sum(&[0x80, 0x80]), Err(ReadError::Truncated));
        assert_eq!(count_and_sum(&[0xff; 11]), Err(ReadError::Overflow));
        assert_eq!(count_and_sum(&[0xff; 30]), Err(ReadError::Overflow));
        let mut bytes = vec![0xff; 9];
        bytes.push(0x02);
        assert_eq!(count_and_sum(&bytes), Err(ReadError::Overflow));
        bytes[9] = 0x01;
        assert_eq!(count_and_sum(&bytes), Ok((1, Some(u64::MAX))));
    }

    #[test]
    fn positions_check_range() {
        let mut bytes = Vec::new();
        write(&mut bytes, 2);
        write(&mut bytes, 0);
        let mut reader = PositionReader::new(&bytes, 4);
        assert_eq!(reader.next_position(), Ok(2));
        assert_eq!(reader.next_position(), Ok(3));
        assert!(reader.is_exhausted());
        let mut reader = PositionReader::new(&bytes, 3);
        assert_eq!(reader.next_position(), Ok(2));
        assert!(reader.next_position().is_err());
    }

    // Pins `end <= numel` in `check_varint` at its boundary: the
    // last position must be below the element count; `end <= numel + 1` would let a file whose last position is the
    // element count load (it is refused only later, at the apply, as a target mismatch).
    #[test]
    fn check_varint_refuses_a_last_position_equal_to_the_element_count() {
        assert_eq!(check_varint(&[0, 0], 2, 2), Ok(Some(1)));
        assert!(check_varint(&[0, 0], 2, 1).is_err(), "positions 0 and 1 of 1 element");
        assert_eq!(check_varint(&[4], 1, 5), Ok(Some(4)));
        assert!(check_varint(&[5], 1, 5).is_err(), "position 5 of 5 elements");
    }
}
