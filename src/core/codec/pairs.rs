//! The `rice` + `diffbits` pair (the compact codec's usual tensor) decoded in one loop: the two streams'
//! dependency chains (shift, count, shift) run side by side, for checking a tensor and for reading it in batches.

use super::bits::{BitReader, Window};
use super::diffbits::read_difference;
use super::rice::RiceReader;

/// Decodes up to `n` (gap, value) pairs of a `rice` position stream with parameter `k` and a `diffbits` value
/// stream, starting at the given bits, in one loop. Stops early where fewer than 16 bytes remain in either stream
/// or a code does not fit in a window. Returns how many pairs were decoded and the new bit positions;
/// `sink(gap, value)` takes each pair.
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
/// and returns the last position.
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
    position_reader.resume(position_bit, done, sum, carried)?;
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
