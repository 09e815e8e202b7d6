//! Parallel bit-compare of old and new tensors, encoding the changed positions and values in one pass.
//!
//! Each tensor is cut into chunks that rayon scans independently. A chunk's position stream omits its
//! first gap, which depends on the previous chunk's last change; joining the chunks writes that gap in.
//!
//! A chunk also hashes the base identity blocks (core::base) of its old bytes: the scan's AVX2 and AVX-512 kernels
//! hash each 64-byte stripe as they compare it (core::xxh3), so the old bytes are read once and the hash's compute
//! hides under the compare's memory time; other kernels hash the chunk's blocks just before comparing them. A chunk
//! of `CHUNK_ELEMENTS` elements always covers whole blocks, but at a tensor's end, whose cut block is hashed apart.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use rayon::prelude::*;

use crate::core::base;
use crate::core::codec::plan;
use crate::core::codec::ranges::{Changes, InOrder, Joined};
use crate::core::codec::{Codec, PositionCodec, ValueCodec};
use crate::core::delta::TensorDelta;
use crate::core::dtype::{self, Dtype};
use crate::core::error::{Error, Result};
use crate::core::scan;
use crate::core::stream::Stream;

/// Elements per chunk: big enough to amortise scheduling, small enough to balance two to many threads. A multiple
/// of `base::BLOCK_BYTES` bytes at every width.
const CHUNK_ELEMENTS: usize = 1 << 18;
const _: () = assert!(CHUNK_ELEMENTS.is_multiple_of(base::BLOCK_BYTES));

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

/// Joins a tensor's chunks into the compact codec's streams (codec::plan::smallest_streams), or stores it whole
/// when that is no larger.
fn assemble(
    input: &DiffInput<'_>,
    chunks: &[Changes],
    width: usize,
    scanned_values: ValueCodec,
    base: u64,
    codec: Codec,
) -> TensorDelta {
    let changed: u64 = chunks.iter().map(|c| c.count).sum();
    let last_position = chunks.iter().rev().find(|c| c.count > 0).map(|c| c.last_position);
    let tensor = tensor_shell(input, scanned_values, changed, last_position, base);
    if changed == 0 {
        return tensor;
    }
    let dense_len = input.new.len();
    let streams = match codec {
        Codec::Context => plan::context_streams(chunks, input.dtype, width, scanned_values, input.old, dense_len),
        _ => plan::smallest_streams(chunks, width, scanned_values, dense_len),
    };
    match streams {
        None => tensor.into_whole(input.new),
        Some(streams) => tensor.with_streams(streams),
    }
}

/// Compares each tensor's old and new bytes and encodes what changed: values as new bits (`Abs`) or
/// differences (`Diff`; `DiffBits` asks for the same), in the stream family `codec`.
pub fn diff(inputs: &[DiffInput<'_>], values_codec: ValueCodec, codec: Codec) -> Result<Vec<TensorDelta>> {
    diff_with(inputs, values_codec, codec, &|_, _| {})
}

/// `diff`, calling `compared(input, byte_range)` as soon as each chunk of an input has been compared, so that a
/// caller reading mapped files can hand those pages back while the rest of the tensor is still being compared.
pub fn diff_with(
    inputs: &[DiffInput<'_>],
    values_codec: ValueCodec,
    codec: Codec,
    compared: &(dyn Fn(usize, std::ops::Range<usize>) + Sync),
) -> Result<Vec<TensorDelta>> {
    let scanned_values = if values_codec == ValueCodec::Abs { ValueCodec::Abs } else { ValueCodec::Diff };
    let mut widths = Vec::with_capacity(inputs.len());
    let mut tasks = Vec::new();
    // The base identity blocks of every input, one after another, filled in by the tasks.
    let mut first_block = Vec::with_capacity(inputs.len() + 1);
    first_block.push(0);
    for (index, input) in inputs.iter().enumerate() {
        crate::core::format::check_tensor_name(&input.name)?;
        let width = check_len(&input.name, input.dtype, &input.shape, &[input.old.len(), input.new.len()])?;
        widths.push(width);
        first_block.push(first_block[index] + input.old.len().div_ceil(base::BLOCK_BYTES));
        let elements = input.old.len() / width;
        for start in (0..elements).step_by(CHUNK_ELEMENTS) {
            tasks.push((index, start, (start + CHUNK_ELEMENTS).min(elements)));
        }
    }
    let mut first_task = vec![0usize; inputs.len()];
    let mut chunk_counts = vec![0usize; inputs.len()];
    for (task, &(index, _, _)) in tasks.iter().enumerate().rev() {
        first_task[index] = task;
        chunk_counts[index] += 1;
    }
    let block_hashes: Vec<AtomicU64> = (0..first_block[inputs.len()]).map(|_| AtomicU64::new(0)).collect();
    // Each task stores its blocks' hashes before it hands its changes on (under a lock, or with an AcqRel count),
    // so the task that assembles a tensor sees them all. The scan hashes a chunk's whole blocks (`hashes`, in the
    // same pass as its compare); the block a tensor's end cuts is hashed here.
    let store_hashes = |index: usize, bytes: &std::ops::Range<usize>, hashes: &[u64]| {
        let first = first_block[index] + bytes.start / base::BLOCK_BYTES;
        for (slot, hash) in block_hashes[first..].iter().zip(hashes) {
            slot.store(*hash, Ordering::Relaxed);
        }
        let cut = &inputs[index].old[bytes.start + hashes.len() * base::BLOCK_BYTES..bytes.end];
        if !cut.is_empty() {
            block_hashes[first + hashes.len()].store(base::block_hash(cut), Ordering::Relaxed);
        }
    };
    let whole_blocks = |bytes: &std::ops::Range<usize>| vec![0u64; bytes.len() / base::BLOCK_BYTES];
    let tensor_base = |index: usize| {
        let hashes: Vec<u64> = block_hashes[first_block[index]..first_block[index + 1]]
            .iter()
            .map(|h| h.load(Ordering::Relaxed))
            .collect();
        base::combine(&hashes)
    };
    let results: Vec<Mutex<Option<TensorDelta>>> = inputs.iter().map(|_| Mutex::new(None)).collect();
    let store =
        |index: usize, tensor: TensorDelta| *results[index].lock().unwrap_or_else(|e| e.into_inner()) = Some(tensor);
    if codec == Codec::Varint {
        // Chunks are appended to their tensor's streams straight from the scan's buffer as soon as every chunk
        // before them is in (a thread mostly takes a tensor's chunks in order); a chunk that finishes early waits
        // as a copy. The task that appends a tensor's last chunk assembles it.
        let builds: Vec<Mutex<InOrder>> = chunk_counts
            .iter()
            .zip(inputs)
            .map(|(&n, input)| Mutex::new(InOrder::new(Joined::default(), n, input.new.len())))
            .collect();
        crate::core::pool::install(|| {
            tasks.par_iter().enumerate().for_each(|(task, &(index, start, end))| {
                let (input, width) = (&inputs[index], widths[index]);
                let bytes = start * width..end * width;
                let chunk = task - first_task[index];
                let mut hashes = whole_blocks(&bytes);
                let complete = scan::scan_then(
                    &input.old[bytes.clone()],
                    &input.new[bytes.clone()],
                    start as u64,
                    width,
                    scanned_values,
                    &mut hashes,
                    |changes, hashes| {
                        store_hashes(index, &bytes, hashes);
                        builds[index].lock().unwrap_or_else(|e| e.into_inner()).add(chunk, changes)
                    },
                );
                compared(index, bytes);
                if let Some(joined) = complete {
                    store(index, assemble_joined(input, joined, scanned_values, tensor_base(index)));
                }
            });
        });
    } else {
        // The compact codec needs every chunk of a tensor before it can pick the tensor's Rice parameter: the task
        // that compares a tensor's last chunk assembles it, and the tensor's chunk streams are freed then.
        let remaining: Vec<AtomicUsize> = chunk_counts.iter().map(|&n| AtomicUsize::new(n)).collect();
        let slots: Vec<Mutex<Option<Changes>>> = tasks.iter().map(|_| Mutex::new(None)).collect();
        let lock = |m: &'_ Mutex<Option<Changes>>| m.lock().unwrap_or_else(|e| e.into_inner()).take();
        crate::core::pool::install(|| {
            tasks.par_iter().enumerate().for_each(|(task, &(index, start, end))| {
                let (input, width) = (&inputs[index], widths[index]);
                let bytes = start * width..end * width;
                let mut hashes = whole_blocks(&bytes);
                let changes = scan::scan_then(
                    &input.old[bytes.clone()],
                    &input.new[bytes.clone()],
                    start as u64,
                    width,
                    scanned_values,
                    &mut hashes,
                    scan::owned,
                );
                store_hashes(index, &bytes, &hashes);
                compared(index, bytes);
                *slots[task].lock().unwrap_or_else(|e| e.into_inner()) = Some(changes);
                if remaining[index].fetch_sub(1, Ordering::AcqRel) != 1 {
                    return;
                }
                let chunks: Vec<Changes> = (first_task[index]..first_task[index] + chunk_counts[index])
                    .map(|slot| lock(&slots[slot]).expect("every chunk of the tensor is in"))
                    .collect();
                store(index, assemble(input, &chunks, width, scanned_values, tensor_base(index), codec));
            });
        });
    }
    Ok(results
        .into_iter()
        .enumerate()
        .map(|(index, result)| {
            // A tensor without elements has no chunk, hence no task.
            result.into_inner().unwrap_or_else(|e| e.into_inner()).unwrap_or_else(|| {
                assemble(&inputs[index], &[], widths[index], scanned_values, base::combine(&[]), codec)
            })
        })
        .collect())
}

/// A tensor's fields but its streams, for `changed` changes ending at `last_position`, made against the base
/// of identity `base`.
fn tensor_shell(
    input: &DiffInput<'_>,
    scanned_values: ValueCodec,
    changed: u64,
    last_position: Option<u64>,
    base: u64,
) -> TensorDelta {
    TensorDelta {
        name: input.name.clone(),
        dtype: input.dtype,
        shape: Some(input.shape.clone()),
        changed,
        positions_codec: PositionCodec::Varint,
        values_codec: scanned_values,
        positions: Stream::empty(),
        values: Stream::empty(),
        last_position,
        base: Some(base),
        differing: None,
        unchecked: false,
    }
}

/// A `varint` tensor from its joined streams, or stored whole when that is no larger.
fn assemble_joined(input: &DiffInput<'_>, joined: Joined, scanned_values: ValueCodec, base: u64) -> TensorDelta {
    let tensor = tensor_shell(input, scanned_values, joined.count, joined.last_position, base);
    if joined.count == 0 {
        return tensor;
    }
    if !plan::streams_win(joined.positions.len() + joined.values.len(), input.new.len()) {
        return tensor.into_whole(input.new);
    }
    let (positions, values) = joined.into_streams();
    TensorDelta { positions: positions.into(), values: values.into(), ..tensor }
}

/// Stores each tensor whole: positions `all`, values `abs`.
pub fn full(inputs: &[FullInput<'_>]) -> Result<Vec<TensorDelta>> {
    inputs.iter().map(|input| whole(input, input.data.to_vec().into())).collect()
}

/// One tensor stored whole, holding `values`: a copy of `input.data`, or a window that lends exactly those bytes
/// (core::anchors writes an anchor straight from the caller's tensors that way).
pub fn whole(input: &FullInput<'_>, values: Stream) -> Result<TensorDelta> {
    crate::core::format::check_tensor_name(&input.name)?;
    let width = check_len(&input.name, input.dtype, &input.shape, &[input.data.len()])?;
    debug_assert_eq!(values.len(), input.data.len());
    let numel = (input.data.len() / width) as u64;
    Ok(TensorDelta {
        name: input.name.clone(),
        dtype: input.dtype,
        shape: Some(input.shape.clone()),
        changed: numel,
        positions_codec: PositionCodec::All,
        values_codec: ValueCodec::Abs,
        positions: Stream::empty(),
        values,
        last_position: numel.checked_sub(1),
        base: None,
        differing: None,
        unchecked: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input<'a>(old: &'a [u8], new: &'a [u8], dtype: Dtype, shape: Vec<u64>) -> DiffInput<'a> {
        DiffInput { name: "t".into(), dtype, shape, old, new }
    }

    #[test]
    fn chunks_in_any_order_join_as_in_order() {
        // Nine chunks of 1000 two-byte elements; some empty, the fourth dense.
        let n = 1000usize;
        let old: Vec<u8> = (0..9 * n * 2).map(|i| (i * 31 % 251) as u8).collect();
        let mut new = old.clone();
        for (chunk, every) in [(0usize, 7usize), (1, 0), (2, 13), (3, 1), (4, 0), (5, 0), (6, 97), (7, 3), (8, 500)] {
            if every > 0 {
                for element in (chunk * n..(chunk + 1) * n).step_by(every) {
                    new[element * 2] ^= 0x11;
                }
            }
        }
        let chunks: Vec<Changes> = (0..9)
            .map(|c| {
                scan::scan(
                    &old[c * n * 2..(c + 1) * n * 2],
                    &new[c * n * 2..(c + 1) * n * 2],
                    (c * n) as u64,
                    2,
                    ValueCodec::Diff,
                )
            })
            .collect();
        let want = crate::core::codec::ranges::join_streams(&chunks);
        let orders: [[usize; 9]; 4] = [
            [0, 1, 2, 3, 4, 5, 6, 7, 8],
            [8, 7, 6, 5, 4, 3, 2, 1, 0],
            [4, 0, 8, 2, 6, 1, 3, 7, 5],
            [1, 2, 3, 4, 5, 6, 7, 8, 0],
        ];
        for order in orders {
            let mut build = InOrder::new(Joined::default(), 9, old.len());
            let mut finished = None;
            for (seen, &chunk) in order.iter().enumerate() {
                let got = build.add(chunk, &chunks[chunk]);
                assert_eq!(got.is_some(), seen == 8, "{order:?}: the tensor completes with its last chunk only");
                finished = finished.or(got);
            }
            let joined = finished.unwrap();
            assert_eq!((&joined.positions, &joined.values), (&want.0, &want.1), "{order:?}");
            assert_eq!(joined.count, chunks.iter().map(|c| c.count).sum::<u64>());
            assert_eq!(joined.last_position, chunks.iter().rev().find(|c| c.count > 0).map(|c| c.last_position));
        }
    }

    fn changes(tensor: &TensorDelta) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        tensor.for_each_change(|p, v| out.push((p, v))).unwrap();
        // In batches (apply's path, with its own decoders for the bit codecs) too.
        let mut batched = Vec::new();
        tensor.for_each_batch(None, |ps, vs| batched.extend(ps.iter().copied().zip(vs.iter().copied()))).unwrap();
        assert_eq!(batched, out);
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
        let out = diff(&[input(&old, &new, Dtype::BF16, vec![n as u64])], ValueCodec::Diff, Codec::Varint).unwrap();
        let found: Vec<u64> = changes(&out[0]).iter().map(|c| c.0).collect();
        assert_eq!(found, touched.iter().map(|&p| p as u64).collect::<Vec<_>>());
        assert!(changes(&out[0]).iter().all(|c| c.1 == 1));
        assert_eq!(out[0].last_position, Some((CHUNK_ELEMENTS * 2 + 36) as u64));
    }

    #[test]
    fn no_change_and_empty() {
        let data = vec![3u8; 64];
        let out = diff(&[input(&data, &data, Dtype::F32, vec![4, 4])], ValueCodec::Diff, Codec::Varint).unwrap();
        assert_eq!(out[0].changed, 0);
        assert_eq!(out[0].nbytes(), 0);
        let out = diff(&[input(&[], &[], Dtype::F32, vec![0, 3])], ValueCodec::Abs, Codec::Varint).unwrap();
        assert_eq!(out[0].changed, 0);
    }

    #[test]
    fn full_change_goes_dense() {
        let old = vec![0u8; 256];
        let new: Vec<u8> = (0..=255u8).collect();
        let out = diff(&[input(&old, &new, Dtype::U8, vec![256])], ValueCodec::Diff, Codec::Varint).unwrap();
        assert!(out[0].is_dense());
        assert_eq!(&*out[0].values, &new[..]);
    }

    #[test]
    fn compact_is_smaller_where_it_can_be_and_never_larger() {
        // Sparse ±1 changes of a bf16 tensor: Rice positions and entropy-coded values win.
        let n = CHUNK_ELEMENTS + 5000;
        let old: Vec<u8> =
            (0..n as u32).flat_map(|i| ((i.wrapping_mul(2654435761) >> 16) as u16 & 0x3fff).to_le_bytes()).collect();
        let mut new = old.clone();
        let (mut p, mut k, mut state) = (0usize, 0usize, 1u64);
        while p < n {
            new[p * 2] = if k % 2 == 0 { old[p * 2].wrapping_add(1) } else { old[p * 2].wrapping_sub(1) };
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            p += 1 + (state >> 56) as usize; // gaps spread over 0..255
            k += 1;
        }
        let shape = vec![n as u64];
        let varint = diff(&[input(&old, &new, Dtype::BF16, shape.clone())], ValueCodec::Diff, Codec::Varint).unwrap();
        let compact = diff(&[input(&old, &new, Dtype::BF16, shape.clone())], ValueCodec::Diff, Codec::Compact).unwrap();
        assert_eq!((compact[0].positions_codec, compact[0].values_codec), (PositionCodec::Rice, ValueCodec::Rans));
        assert!(compact[0].nbytes() * 10 < varint[0].nbytes() * 7, "{} vs {}", compact[0].nbytes(), varint[0].nbytes());
        assert_eq!(changes(&compact[0]), changes(&varint[0]));
        // A few changes: the rANS table costs more than it saves, so the 2-bit codes stay.
        let mut few = old.clone();
        for p in [3usize, 900, 4000, 70_000] {
            few[p * 2] = old[p * 2].wrapping_add(1);
        }
        few[5000 * 2] = old[5000 * 2].wrapping_sub(2);
        let compact = diff(&[input(&old, &few, Dtype::BF16, shape.clone())], ValueCodec::Diff, Codec::Compact).unwrap();
        assert_eq!(compact[0].values_codec, ValueCodec::DiffBits);
        let varint = diff(&[input(&old, &few, Dtype::BF16, shape.clone())], ValueCodec::Diff, Codec::Varint).unwrap();
        assert_eq!(changes(&compact[0]), changes(&varint[0]));
        // A few arbitrary f32 changes: neither bit code wins over `diff`'s escapes, so `diff` stays. (With many, the
        // rANS codes beat the escape byte.)
        let old32: Vec<u8> = (0..4096u32).flat_map(|i| i.wrapping_mul(2654435761).to_le_bytes()).collect();
        let new32: Vec<u8> = old32
            .chunks(4)
            .enumerate()
            .flat_map(|(i, c)| {
                let v = u32::from_le_bytes(c.try_into().unwrap());
                (if i % 1000 == 0 { v ^ 0x5a5a_0000 } else { v }).to_le_bytes()
            })
            .collect();
        let compact = diff(&[input(&old32, &new32, Dtype::F32, vec![4096])], ValueCodec::Diff, Codec::Compact).unwrap();
        let varint = diff(&[input(&old32, &new32, Dtype::F32, vec![4096])], ValueCodec::Diff, Codec::Varint).unwrap();
        assert_eq!(compact[0].values_codec, ValueCodec::Diff);
        assert!(compact[0].nbytes() <= varint[0].nbytes());
        assert_eq!(changes(&compact[0]), changes(&varint[0]));
        // Everything changed at random: stored whole, as with varint.
        let all_new: Vec<u8> =
            old.iter().enumerate().map(|(i, b)| b ^ (1 | (i as u32).wrapping_mul(2654435761) >> 24) as u8).collect();
        let compact = diff(&[input(&old, &all_new, Dtype::BF16, shape)], ValueCodec::Diff, Codec::Compact).unwrap();
        assert!(compact[0].is_dense());
    }

    #[test]
    fn rejects_length_mismatch() {
        let err = diff(&[input(&[0; 4], &[0; 6], Dtype::BF16, vec![2])], ValueCodec::Diff, Codec::Varint).unwrap_err();
        assert!(err.to_string().contains("\"t\""), "{err}");
    }
}
