//! The `rice` position codec: Golomb-Rice codes of the gaps `p[k] - p[k-1] - 1`, after one byte holding the
//! per-tensor parameter `k` (docs/format.md §5). Bits as in `bits`.

use super::bits::{mask_bits, BitReader, BitWriter, Window};

/// Largest Rice parameter a stream may declare: keeps `quotient << k` below 2^62 and every read within one word.
pub const MAX_RICE_K: u32 = 56;
/// A unary run of this many one bits (with no terminating zero) is the escape: the gap follows in 64 bits.
const ESCAPE_ONES: u32 = 64;

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

/// Counts one bits up to a zero (consumed too), or returns None after `ESCAPE_ONES` ones.
#[inline(always)]
fn read_unary(bits: &mut BitReader<'_>) -> Result<Option<u32>, String> {
    let mut ones = 0;
    loop {
        let run = (!bits.peek()).trailing_zeros().min(32);
        if ones + run >= ESCAPE_ONES {
            bits.consume(ESCAPE_ONES - ones)?;
            return Ok(None);
        }
        if run < 32 {
            bits.consume(run + 1)?;
            return Ok(Some(ones + run));
        }
        bits.consume(32)?;
        ones += 32;
    }
}

/// Reads one Rice code with parameter `k`, or an escape and its 64-bit gap.
#[inline(always)]
pub fn read_gap(bits: &mut BitReader<'_>, k: u32) -> Result<u64, String> {
    Ok(match read_unary(bits)? {
        Some(quotient) => (u64::from(quotient) << k) | bits.read(k)?,
        None => bits.read_u64()?,
    })
}

/// Decodes a `rice` position stream one position at a time, checking each against `numel`.
pub struct RiceReader<'a> {
    pub(super) bits: BitReader<'a>,
    pub(super) k: u32,
    pub(super) next_allowed: u64,
    pub(super) numel: u64,
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
        let gap = read_gap(&mut self.bits, self.k).map_err(|e| format!("position {e}"))?;
        super::next_position(&mut self.next_allowed, gap, self.numel)
    }

    pub fn is_exhausted(&self) -> bool {
        self.bits.is_exhausted()
    }

    /// Goes on after a fast pass over the stream that stopped at `bit`, having decoded `decoded` codes whose gaps
    /// sum to `sum` (`wrapped` if that sum passed 2^64): checks that the last of them lies in the tensor.
    pub(super) fn resume(&mut self, bit: usize, decoded: u64, sum: u64, wrapped: bool) -> Result<(), String> {
        // Each position is the previous one plus one plus its gap.
        let next = sum.checked_add(decoded).filter(|&end| !wrapped && end <= self.numel);
        let Some(next) = next else {
            return Err(format!("position out of range (tensor has {} elements)", self.numel));
        };
        self.bits.bit = bit;
        self.next_allowed = next;
        Ok(())
    }
}

impl Window<'_> {
    /// The next Rice code with parameter `k`, not consumed: (gap, length). None where fewer than 16 bytes remain
    /// or the code is longer than a window: the checked reader takes it.
    #[inline(always)]
    pub(super) fn peek_rice(&mut self, k: u32) -> Option<(u64, u32)> {
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
    reader.resume(window.bit, read, sum, carried)?;
    let mut last = reader.next_allowed.checked_sub(1);
    for _ in read..changed {
        last = Some(reader.next_position()?);
    }
    if !reader.is_exhausted() {
        return Err("position stream has bytes after the last change".to_owned());
    }
    Ok(last)
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

    // Pins `out[filled - 1] >= reader.numel` in `read_positions`
    // (the bulk reader that decodes an unchecked `rice` + `rans` tensor during the apply): a position equal to the
    // element count must be refused; with `>` it is handed out, and core::apply indexes one element past the target.
    #[test]
    fn read_positions_refuses_a_position_at_the_element_count() {
        // k = 2, gaps 3 then 0s: positions 3, 4, 5, ... Hundreds of codes follow, so that the bulk reader (which
        // runs while 16 bytes or more are left) decodes the first ones, not the checked one-by-one reader.
        let stream = write_rice(std::iter::once(3u64).chain(std::iter::repeat_n(0, 400)), 2);
        let read = |numel: u64, len: usize| {
            let mut reader = RiceReader::new(&stream, numel).unwrap();
            let mut out = vec![0u64; len];
            read_positions(&mut reader, &mut out).map(|()| out)
        };
        assert_eq!(read(5, 2), Ok(vec![3, 4]));
        assert_eq!(read(64, 8), Ok((3..11).collect::<Vec<u64>>()));
        assert!(read(4, 2).is_err(), "position 4 of a tensor of 4 elements");
        assert!(read(3, 1).is_err(), "position 3 of a tensor of 3 elements");
        assert!(read(10, 8).is_err(), "position 10 of a tensor of 10 elements");
    }
}
