//! Parallel bit-compare of old and new tensors, encoding the changed positions and values in one pass.
//!
//! Each tensor is cut into chunks that rayon scans independently. A chunk's position stream omits its
//! first gap, which depends on the previous chunk's last change; assembly writes that gap in.

use rayon::prelude::*;

use crate::core::codec::{values, varint, PositionCodec, ValueCodec};
use crate::core::delta::TensorDelta;
use crate::core::dtype::{self, Dtype};
use crate::core::error::{Error, Result};
use crate::core::stream::Stream;

/// Elements per chunk: big enough to amortise scheduling, small enough to balance two to many threads.
const CHUNK_ELEMENTS: usize = 1 << 18;
/// Bytes compared at once before looking at single elements.
const BLOCK_BYTES: usize = 64;

/// One tensor to compare: its raw little-endian bytes before and after.
pub struct DiffInput<'a> {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub old: &'a [u8],
    pub new: &'a [u8],
}

/// One tensor to store whole (an anchor).
pub struct FullInput<'a> {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub data: &'a [u8],
}

#[derive(Default)]
struct ChunkChanges {
    count: u64,
    first_position: u64,
    last_position: u64,
    /// Gap varints after the first change of the chunk.
    positions: Vec<u8>,
    values: Vec<u8>,
}

fn check_len(name: &str, dtype: Dtype, shape: &[u64], lens: &[usize]) -> Result<usize> {
    let width = dtype::width_of(dtype).map_err(|e| Error::invalid(format!("tensor {name:?}: {e}")))?;
    let numel = dtype::numel(shape).ok_or_else(|| Error::invalid(format!("tensor {name:?}: shape overflows")))?;
    let expected = numel.checked_mul(width as u64);
    for &len in lens {
        if expected != Some(len as u64) {
            return Err(Error::mismatch(format!(
                "tensor {name:?}: {len} bytes given for shape {shape:?} of {}",
                dtype::name_of(dtype)
            )));
        }
    }
    Ok(width)
}

fn check_name(name: &str) -> Result<()> {
    if name.ends_with(crate::core::format::POSITIONS_SUFFIX) || name.ends_with(crate::core::format::VALUES_SUFFIX) {
        return Err(Error::invalid(format!(
            "tensor {name:?}: names ending in {:?} or {:?} are reserved for delta streams",
            crate::core::format::POSITIONS_SUFFIX,
            crate::core::format::VALUES_SUFFIX
        )));
    }
    Ok(())
}

/// XOR of one block's 8-byte little-endian words: byte `i` of word `k` is non-zero iff byte `8k + i` differs.
#[inline(always)]
fn block_xor(old: &[u8], new: &[u8]) -> [u64; BLOCK_BYTES / 8] {
    let mut words = [0u64; BLOCK_BYTES / 8];
    for (k, word) in words.iter_mut().enumerate() {
        let a = u64::from_le_bytes(old[k * 8..k * 8 + 8].try_into().expect("8 bytes"));
        let b = u64::from_le_bytes(new[k * 8..k * 8 + 8].try_into().expect("8 bytes"));
        *word = a ^ b;
    }
    words
}

fn scan_chunk<const W: usize>(old: &[u8], new: &[u8], first_element: u64, codec: ValueCodec) -> ChunkChanges {
    let mut out = ChunkChanges::default();
    let mut next_expected = first_element;
    let mut record = |out: &mut ChunkChanges, byte_offset: usize| {
        let position = first_element + (byte_offset / W) as u64;
        if out.count == 0 {
            out.first_position = position;
        } else {
            varint::write(&mut out.positions, position - next_expected);
        }
        next_expected = position + 1;
        out.last_position = position;
        out.count += 1;
        values::write_const::<W>(&mut out.values, codec, &old[byte_offset..], &new[byte_offset..]);
    };
    let element_mask: u64 = if W == 8 { u64::MAX } else { (1u64 << (8 * W)) - 1 };
    let blocks_end = old.len() / BLOCK_BYTES * BLOCK_BYTES;
    let mut offset = 0;
    while offset < blocks_end {
        let words = block_xor(&old[offset..offset + BLOCK_BYTES], &new[offset..offset + BLOCK_BYTES]);
        if words.iter().any(|&w| w != 0) {
            for (k, mut word) in words.into_iter().enumerate() {
                // Jump from one differing element to the next through the XOR's set bits.
                while word != 0 {
                    let element = (word.trailing_zeros() as usize / 8) / W;
                    record(&mut out, offset + k * 8 + element * W);
                    word &= !(element_mask << (8 * W * element));
                }
            }
        }
        offset += BLOCK_BYTES;
    }
    for element in (blocks_end..old.len()).step_by(W) {
        if old[element..element + W] != new[element..element + W] {
            record(&mut out, element);
        }
    }
    out
}

fn scan(old: &[u8], new: &[u8], first_element: u64, width: usize, codec: ValueCodec) -> ChunkChanges {
    match width {
        1 => scan_chunk::<1>(old, new, first_element, codec),
        2 => scan_chunk::<2>(old, new, first_element, codec),
        4 => scan_chunk::<4>(old, new, first_element, codec),
        _ => scan_chunk::<8>(old, new, first_element, codec),
    }
}

/// Joins a tensor's chunks into its two streams, or stores it whole when that is no larger.
fn assemble(input: &DiffInput<'_>, width: usize, chunks: Vec<ChunkChanges>, codec: ValueCodec) -> TensorDelta {
    let changed: u64 = chunks.iter().map(|c| c.count).sum();
    let mut previous_end = 0u64; // position after the previous change
    let mut positions_len = 0usize;
    for chunk in chunks.iter().filter(|c| c.count > 0) {
        positions_len += varint::len(chunk.first_position - previous_end) + chunk.positions.len();
        previous_end = chunk.last_position + 1;
    }
    let values_len: usize = chunks.iter().map(|c| c.values.len()).sum();
    let dense_len = input.new.len();
    let mut tensor = TensorDelta {
        name: input.name.clone(),
        dtype: input.dtype,
        shape: Some(input.shape.clone()),
        changed,
        positions_codec: PositionCodec::Varint,
        values_codec: codec,
        positions: Stream::empty(),
        values: Stream::empty(),
        last_position: chunks.iter().rev().find(|c| c.count > 0).map(|c| c.last_position),
    };
    if changed == 0 {
        return tensor;
    }
    if positions_len + values_len >= dense_len {
        tensor.positions_codec = PositionCodec::All;
        tensor.values_codec = ValueCodec::Abs;
        tensor.changed = (dense_len / width) as u64;
        tensor.values = input.new.to_vec().into();
        tensor.last_position = tensor.changed.checked_sub(1);
        return tensor;
    }
    let mut positions = Vec::with_capacity(positions_len);
    let mut values = Vec::with_capacity(values_len);
    previous_end = 0;
    for chunk in chunks.into_iter().filter(|c| c.count > 0) {
        varint::write(&mut positions, chunk.first_position - previous_end);
        positions.extend_from_slice(&chunk.positions);
        values.extend_from_slice(&chunk.values);
        previous_end = chunk.last_position + 1;
    }
    tensor.positions = positions.into();
    tensor.values = values.into();
    tensor
}

/// Compares each tensor's old and new bytes and encodes what changed.
pub fn diff(inputs: &[DiffInput<'_>], codec: ValueCodec) -> Result<Vec<TensorDelta>> {
    let mut widths = Vec::with_capacity(inputs.len());
    let mut tasks = Vec::new();
    for (index, input) in inputs.iter().enumerate() {
        check_name(&input.name)?;
        let width = check_len(&input.name, input.dtype, &input.shape, &[input.old.len(), input.new.len()])?;
        widths.push(width);
        let elements = input.old.len() / width;
        for start in (0..elements).step_by(CHUNK_ELEMENTS) {
            tasks.push((index, start, (start + CHUNK_ELEMENTS).min(elements)));
        }
    }
    crate::core::pool::install(|| {
        let mut scanned: Vec<(usize, ChunkChanges)> = tasks
            .par_iter()
            .map(|&(index, start, end)| {
                let (input, width) = (&inputs[index], widths[index]);
                let bytes = start * width..end * width;
                (index, scan(&input.old[bytes.clone()], &input.new[bytes], start as u64, width, codec))
            })
            .collect();
        let mut per_tensor: Vec<Vec<ChunkChanges>> = (0..inputs.len()).map(|_| Vec::new()).collect();
        for (index, chunk) in scanned.drain(..) {
            per_tensor[index].push(chunk);
        }
        Ok(per_tensor
            .into_par_iter()
            .enumerate()
            .map(|(index, chunks)| assemble(&inputs[index], widths[index], chunks, codec))
            .collect())
    })
}

/// Stores each tensor whole: positions `all`, values `abs`.
pub fn full(inputs: &[FullInput<'_>]) -> Result<Vec<TensorDelta>> {
    inputs
        .iter()
        .map(|input| {
            check_name(&input.name)?;
            let width = check_len(&input.name, input.dtype, &input.shape, &[input.data.len()])?;
            let numel = (input.data.len() / width) as u64;
            Ok(TensorDelta {
                name: input.name.clone(),
                dtype: input.dtype,
                shape: Some(input.shape.clone()),
                changed: numel,
                positions_codec: PositionCodec::All,
                values_codec: ValueCodec::Abs,
                positions: Stream::empty(),
                values: input.data.to_vec().into(),
                last_position: numel.checked_sub(1),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input<'a>(old: &'a [u8], new: &'a [u8], dtype: Dtype, shape: Vec<u64>) -> DiffInput<'a> {
        DiffInput { name: "t".into(), dtype, shape, old, new }
    }

    fn changes(tensor: &TensorDelta) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        tensor.for_each_change(|p, v| out.push((p, v))).unwrap();
        out
    }

    #[test]
    fn finds_changes_across_chunks_and_blocks() {
        let n = CHUNK_ELEMENTS * 2 + 37;
        let old = vec![0u8; n * 2];
        let mut new = old.clone();
        let touched = [0usize, 15, 16, 17, CHUNK_ELEMENTS - 1, CHUNK_ELEMENTS, CHUNK_ELEMENTS * 2 + 36];
        for &p in &touched {
            new[p * 2] = 1;
        }
        let out = diff(&[input(&old, &new, Dtype::BF16, vec![n as u64])], ValueCodec::Diff).unwrap();
        let found: Vec<u64> = changes(&out[0]).iter().map(|c| c.0).collect();
        assert_eq!(found, touched.iter().map(|&p| p as u64).collect::<Vec<_>>());
        assert!(changes(&out[0]).iter().all(|c| c.1 == 1));
        assert_eq!(out[0].last_position, Some((CHUNK_ELEMENTS * 2 + 36) as u64));
    }

    #[test]
    fn no_change_and_empty() {
        let data = vec![3u8; 64];
        let out = diff(&[input(&data, &data, Dtype::F32, vec![4, 4])], ValueCodec::Diff).unwrap();
        assert_eq!(out[0].changed, 0);
        assert_eq!(out[0].nbytes(), 0);
        let out = diff(&[input(&[], &[], Dtype::F32, vec![0, 3])], ValueCodec::Abs).unwrap();
        assert_eq!(out[0].changed, 0);
    }

    #[test]
    fn full_change_goes_dense() {
        let old = vec![0u8; 256];
        let new: Vec<u8> = (0..=255u8).collect();
        let out = diff(&[input(&old, &new, Dtype::U8, vec![256])], ValueCodec::Diff).unwrap();
        assert!(out[0].is_dense());
        assert_eq!(&*out[0].values, &new[..]);
    }

    #[test]
    fn rejects_length_mismatch() {
        let err = diff(&[input(&[0; 4], &[0; 6], Dtype::BF16, vec![2])], ValueCodec::Diff).unwrap_err();
        assert!(err.to_string().contains("\"t\""), "{err}");
    }
}
