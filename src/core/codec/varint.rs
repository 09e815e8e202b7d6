//! LEB128 gap coding of strictly increasing positions.

/// Appends `value` as an unsigned LEB128 varint.
#[inline]
pub fn write(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
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
        let gap = match self.bytes.get(self.at) {
            Some(&byte) if byte < 0x80 => {
                self.at += 1;
                u64::from(byte)
            }
            _ => read(self.bytes, &mut self.at).map_err(|e| match e {
                ReadError::Truncated => "position stream ends early".to_owned(),
                ReadError::Overflow => format!("position varint at byte {} overflows 64 bits", self.at),
            })?,
        };
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
}
