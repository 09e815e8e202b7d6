//! One-pass compare-and-update of a mirror: records what changed between the mirror and new bytes, as an
//! ordinary `TensorDelta`, and writes the new bits into the mirror in the same pass.
//!
//! A tensor may arrive in several chunks (as from a staging buffer): `MirrorTensor::update` takes each chunk
//! at its element offset, in ascending order, and appends its changes to the tensor's streams; `finish` hands
//! them out. Streams are canonical, so the result equals `diff::diff` of the same old and new bytes whatever the
//! chunking.
//!
//! The base identity (core::base) of a whole tensor is hashed from the mirror's bytes by each task's scan, stripe by
//! stripe before it compares and overwrites them (core::scan); tasks start at block boundaries, and a block cut by
//! a chunk boundary is copied before the scan and carried to the next chunk. A shard, which sees only part of the
//! tensor, records no base; it gets the identity of the range it mirrors instead (`finish_shard`, blocks counted from
//! the range's first element), which the joiner checks against the same range of the whole state it holds.
//!
//! With the compact codec each task's changes are kept apart until `finish`, which re-encodes them as `diff::diff`
//! does (codec::plan::smallest_streams); a shard keeps `varint` streams.

use std::sync::Mutex;

use rayon::prelude::*;

use crate::core::base::{self, BlockHasher};
use crate::core::codec::ranges::{self, Changes, InOrder, Joined};
use crate::core::codec::{plan, Codec, PositionCodec, ValueCodec};
use crate::core::delta::TensorDelta;
use crate::core::dtype::{self, Dtype};
use crate::core::error::{Error, Result};
use crate::core::scan;
use crate::core::stream::Stream;

/// Elements scanned by one rayon task: whole base identity blocks at every width.
const TASK_ELEMENTS: usize = 1 << 18;
const _: () = assert!(TASK_ELEMENTS.is_multiple_of(base::BLOCK_BYTES));
/// A tensor being compared against its mirror chunk by chunk.
pub struct MirrorTensor {
    name: String,
    dtype: Dtype,
    shape: Vec<u64>,
    width: usize,
    numel: u64,
    codec: ValueCodec,
    /// Elements before this one have been seen (or skipped); chunks must start at or after it.
    next_element: u64,
    /// The streams of the chunks compared so far.
    joined: Joined,
    /// With the compact (or context) codec, the changes of every task so far instead (`joined` stays empty).
    compact_ranges: Option<Vec<Changes>>,
    /// The stream family asked for.
    family: Codec,
    /// The first element of the first chunk with elements: where the hashed range starts.
    origin: Option<u64>,
    /// The base identity of the bytes before the chunks compared so far, while they are contiguous from `origin`.
    base: Option<BlockHasher>,
}

/// What a shard's mirror held before a step, over the elements it mirrors: `[first, first + elements)` of the whole
/// tensor, and the base identity (core::base) of those bytes, as if they were a tensor of their own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RangeBase {
    pub first: u64,
    pub elements: u64,
    pub identity: u64,
}

impl MirrorTensor {
    /// Starts a tensor of `shape` and `dtype`; no chunk has been compared yet.
    pub fn begin(name: &str, dtype: Dtype, shape: &[u64], codec: ValueCodec) -> Result<Self> {
        crate::core::format::check_tensor_name(name)?;
        let width = dtype::width_of(dtype).map_err(|e| Error::invalid(format!("tensor {name:?}: {e}")))?;
        let numel = dtype::numel(shape)
            .filter(|n| n.checked_mul(width as u64).is_some())
            .ok_or_else(|| Error::invalid(format!("tensor {name:?}: shape overflows")))?;
        Ok(MirrorTensor {
            name: name.to_owned(),
            dtype,
            shape: shape.to_vec(),
            width,
            numel,
            codec,
            next_element: 0,
            joined: Joined::default(),
            compact_ranges: None,
            family: Codec::Varint,
            origin: None,
            base: Some(BlockHasher::default()),
        })
    }

    /// Writes the tensor in the stream family `codec` (`varint` unless told). `context` needs `diff` values (the
    /// base's bits of a changed element are then its new bits less the difference).
    pub fn with_codec(mut self, codec: Codec) -> Result<Self> {
        if codec == Codec::Context && self.codec != ValueCodec::Diff {
            return Err(Error::invalid(format!(
                "tensor {:?}: the context codec from a mirror needs values \"diff\"",
                self.name
            )));
        }
        self.compact_ranges = (codec != Codec::Varint).then(Vec::new);
        self.family = codec;
        Ok(self)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Compares the chunk of elements starting at `first_element`: `mirror` holds their previous bytes and
    /// receives `new`. Chunks come in ascending, non-overlapping order; elements no chunk covers count as
    /// unchanged. Runs in the deltasync pool.
    pub fn update(&mut self, mirror: &mut [u8], new: &[u8], first_element: u64) -> Result<()> {
        let name = &self.name;
        if mirror.len() != new.len() || !new.len().is_multiple_of(self.width) {
            return Err(Error::mismatch(format!(
                "tensor {name:?}: a chunk of {} new bytes for {} mirror bytes of {}-byte elements",
                new.len(),
                mirror.len(),
                self.width
            )));
        }
        let elements = (new.len() / self.width) as u64;
        if first_element < self.next_element || first_element.checked_add(elements).is_none_or(|end| end > self.numel) {
            return Err(Error::invalid(format!(
                "tensor {name:?}: chunk of {elements} elements at {first_element} is out of order or outside \
                 [{}, {})",
                self.next_element, self.numel
            )));
        }
        if elements > 0 && self.origin.is_none() {
            self.origin = Some(first_element);
        }
        let origin = self.origin.unwrap_or(first_element);
        if self.base.as_ref().is_some_and(|hasher| hasher.consumed() != (first_element - origin) * self.width as u64) {
            // Elements were skipped: their bytes are not seen, so no base identity can be made.
            self.base = None;
        }
        self.next_element = first_element + elements;
        let (width, codec) = (self.width, self.codec);
        if new.is_empty() {
            return Ok(());
        }
        // Tasks start at block boundaries counted from the origin (element 0 for a whole tensor): a head that
        // completes the block the previous chunk cut, then `TASK_ELEMENTS` elements at a time; the last task may end
        // inside a block (the tail).
        let task_bytes = TASK_ELEMENTS * width;
        let offset = (first_element - origin) as usize * width;
        let head = ((base::BLOCK_BYTES - offset % base::BLOCK_BYTES) % base::BLOCK_BYTES).min(new.len());
        let tail = (new.len() - head) % base::BLOCK_BYTES;
        let mut block_hashes = vec![0u64; (new.len() - head) / base::BLOCK_BYTES];
        if let Some(hasher) = &mut self.base {
            // The head and the tail are hashed with bytes of other chunks: keep a copy before they are overwritten.
            hasher.take(&mirror[..head]);
        }
        let tail_copy = self.base.is_some().then(|| mirror[new.len() - tail..].to_vec());
        let mut pieces = Vec::with_capacity(2 + new.len() / task_bytes);
        let (mut old_rest, mut new_rest, mut hashes_rest) = (mirror, new, &mut block_hashes[..]);
        let mut at = 0;
        while !new_rest.is_empty() {
            let len = if at == 0 && head > 0 { head } else { task_bytes.min(new_rest.len()) };
            let (old, old_after) = old_rest.split_at_mut(len);
            let (new, new_after) = new_rest.split_at(len);
            let blocks = if at < head { 0 } else { len / base::BLOCK_BYTES };
            let (hashes, hashes_after) = hashes_rest.split_at_mut(blocks);
            pieces.push((old, new, first_element + (at / width) as u64, hashes));
            (old_rest, new_rest, hashes_rest) = (old_after, new_after, hashes_after);
            at += len;
        }
        // The scan hashes the blocks of the mirror before it updates them (none where no base identity is made).
        let hash = self.base.is_some();
        if let Some(ranges) = &mut self.compact_ranges {
            let scanned: Vec<Changes> = crate::core::pool::install(|| {
                pieces
                    .into_par_iter()
                    .map(|(old, new, first, hashes)| {
                        let hashes = if hash { hashes } else { &mut [] };
                        scan::scan_update_then(old, new, first, width, codec, hashes, scan::owned)
                    })
                    .collect()
            });
            ranges.extend(scanned);
        } else {
            // Each task's changes are appended to the tensor's streams as soon as the tasks before it are done.
            let order =
                Mutex::new(InOrder::new(std::mem::take(&mut self.joined), pieces.len(), self.numel as usize * width));
            let joined = crate::core::pool::install(|| {
                pieces
                    .into_par_iter()
                    .enumerate()
                    .filter_map(|(task, (old, new, first, hashes))| {
                        let hashes = if hash { hashes } else { &mut [] };
                        scan::scan_update_then(old, new, first, width, codec, hashes, |changes, _| {
                            order.lock().unwrap_or_else(|e| e.into_inner()).add(task, changes)
                        })
                    })
                    .reduce_with(|a, _| a)
            });
            self.joined = joined.expect("the last task completes the streams");
        }
        if let (Some(hasher), Some(tail_copy)) = (&mut self.base, tail_copy) {
            hasher.take_hashed(&block_hashes, block_hashes.len() * base::BLOCK_BYTES);
            hasher.take(&tail_copy);
        }
        Ok(())
    }

    /// Joins the chunks into the tensor's streams. `whole_mirror` is the mirror of the whole tensor (now
    /// holding the new bits): given, the tensor is stored whole when that is no larger, as `diff::diff` does, and
    /// the record gets the base identity; without it (a shard that mirrors only part of the tensor) the streams
    /// are kept and no base is recorded. With the compact codec a whole tensor's streams are re-encoded as `diff::diff`
    /// does; a shard's stay `varint`.
    pub fn finish(mut self, whole_mirror: Option<&[u8]>) -> Result<TensorDelta> {
        let compact_ranges = self.compact_ranges.take();
        if let Some(ranges) = &compact_ranges {
            self.joined.count = ranges.iter().map(|r| r.count).sum();
            self.joined.last_position = ranges.iter().rev().find(|r| r.count > 0).map(|r| r.last_position);
        }
        let mut tensor = TensorDelta {
            name: self.name,
            dtype: self.dtype,
            shape: Some(self.shape),
            changed: self.joined.count,
            positions_codec: PositionCodec::Varint,
            values_codec: self.codec,
            positions: Stream::empty(),
            values: Stream::empty(),
            last_position: self.joined.last_position,
            base: None,
            differing: None,
            unchecked: false,
        };
        if let Some(whole) = whole_mirror {
            let dense_len = self.numel as usize * self.width;
            if whole.len() != dense_len {
                return Err(Error::mismatch(format!(
                    "tensor {:?}: the whole mirror has {} bytes, expected {dense_len}",
                    tensor.name,
                    whole.len()
                )));
            }
            // A whole tensor's identity counts blocks from element 0: none when the chunks started later.
            let from_start = self.origin.is_none_or(|origin| origin == 0);
            tensor.base = self.base.filter(|_| from_start).map(|mut hasher| {
                // Elements after the last chunk were not compared: the mirror still holds their base bytes.
                hasher.take(&whole[hasher.consumed() as usize..]);
                hasher.finish()
            });
            if let (Some(ranges), true) = (&compact_ranges, tensor.changed > 0) {
                let (width, codec, family, dtype) = (self.width, self.codec, self.family, self.dtype);
                return Ok(
                    match crate::core::pool::install(|| plan::smallest_streams(ranges, width, codec, dense_len)) {
                        None => tensor.into_whole(whole),
                        // The mirror now holds the new bits; the ranges' differences give the base's back.
                        Some(streams) if family == Codec::Context && tensor.base.is_some() => {
                            tensor.with_streams(plan::with_context_from_new(streams, ranges, dtype, whole))
                        }
                        Some(streams) => tensor.with_streams(streams),
                    },
                );
            }
            if tensor.changed > 0
                && !plan::streams_win(self.joined.positions.len() + self.joined.values.len(), dense_len)
            {
                return Ok(tensor.into_whole(whole));
            }
        }
        if tensor.changed == 0 {
            return Ok(tensor);
        }
        let (positions, values) = match compact_ranges {
            Some(ranges) => ranges::join_streams(&ranges),
            None => self.joined.into_streams(),
        };
        Ok(TensorDelta { positions: positions.into(), values: values.into(), ..tensor })
    }
}

impl MirrorTensor {
    /// `finish(None)` for a shard, with the identity of what its mirror held over the elements its chunks covered
    /// (None when no chunk had elements, or when chunks skipped elements in between).
    pub fn finish_shard(mut self) -> Result<(TensorDelta, Option<RangeBase>)> {
        let width = self.width as u64;
        let range = match (self.origin, self.base.take()) {
            (Some(first), Some(hasher)) => {
                Some(RangeBase { first, elements: hasher.consumed() / width, identity: hasher.finish() })
            }
            _ => None,
        };
        Ok((self.finish(None)?, range))
    }
}

/// One whole tensor to advance: its mirror (previous bytes, receives the new ones) and its new bytes.
pub struct MirrorInput<'a> {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub mirror: &'a mut [u8],
    pub new: &'a [u8],
}

/// Advances whole tensors at once: each one's delta from its mirror to its new bytes, with the mirrors
/// updated, in the stream family `codec`. Every length is checked before the first write.
pub fn advance(inputs: Vec<MirrorInput<'_>>, values: ValueCodec, codec: Codec) -> Result<Vec<TensorDelta>> {
    advance_then(inputs, values, codec, |tensor, mirror| tensor.finish(Some(mirror)))
}

/// `advance` without the `finish`: the mirrors are moved to the new bytes and every tensor's changes are kept, to be
/// encoded later by `complete` (the compact codec's re-encoding, the choice to store a tensor whole), off the path of
/// whoever waits for the mirror to move. Every length is checked before the first write.
pub fn advance_deferred(inputs: Vec<MirrorInput<'_>>, values: ValueCodec, codec: Codec) -> Result<Vec<MirrorTensor>> {
    advance_then(inputs, values, codec, |tensor, _| Ok(tensor))
}

/// Updates every input's mirror, then hands each tensor and its (updated) mirror to `then`, tensor by tensor.
fn advance_then<T: Send>(
    inputs: Vec<MirrorInput<'_>>,
    values: ValueCodec,
    codec: Codec,
    then: impl Fn(MirrorTensor, &[u8]) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let mut tensors = Vec::with_capacity(inputs.len());
    for input in &inputs {
        tensors.push(begin_whole(input, values, codec)?);
    }
    // Small tensors are many; advance them side by side, and let big ones spread over the pool themselves.
    crate::core::pool::install(|| {
        tensors
            .into_par_iter()
            .zip(inputs.into_par_iter())
            .map(|(mut tensor, input)| {
                tensor.update(input.mirror, input.new, 0)?;
                then(tensor, input.mirror)
            })
            .collect()
    })
}

/// Finishes tensors whose encoding was deferred, side by side: each with the mirror of the whole tensor, which must
/// still hold the bytes its last update wrote (the tensor's new state; elements no chunk covered, their base). The
/// bytes are those `finish` would have given right after the updates.
pub fn complete(tensors: Vec<(MirrorTensor, &[u8])>) -> Result<Vec<TensorDelta>> {
    crate::core::pool::install(|| tensors.into_par_iter().map(|(tensor, whole)| tensor.finish(Some(whole))).collect())
}

/// Memory as (address, byte length).
pub type Span = (usize, usize);

/// The entry whose mirror shares memory with anything else of an `advance` call, or None: `entries` are each
/// entry's (mirror, new bytes) as (address, byte length). A mirror is written while every entry's new bytes are
/// read, side by side, so it must overlap no other mirror, no entry's new bytes and not its own; new bytes may
/// overlap each other (both only read). Empty spans overlap nothing. One sort of the spans, so that the check of
/// a state of many tensors is not quadratic in their number; where several entries overlap, which one is named is
/// unspecified.
pub fn overlapping_mirror(entries: &[(Span, Span)]) -> Option<usize> {
    let mut spans: Vec<(usize, usize, bool, usize)> = Vec::with_capacity(entries.len() * 2);
    for (index, &((mirror, mirror_len), (new, new_len))) in entries.iter().enumerate() {
        if mirror_len > 0 {
            spans.push((mirror, mirror.saturating_add(mirror_len), true, index));
        }
        if new_len > 0 {
            spans.push((new, new.saturating_add(new_len), false, index));
        }
    }
    spans.sort_unstable();
    // The furthest end reached so far by any span, and by a mirror (with its entry).
    let (mut any_end, mut mirror_end, mut mirror_entry) = (0usize, 0usize, 0usize);
    for (start, end, is_mirror, index) in spans {
        if start < mirror_end {
            return Some(mirror_entry);
        }
        if is_mirror && start < any_end {
            return Some(index);
        }
        any_end = any_end.max(end);
        if is_mirror && end > mirror_end {
            (mirror_end, mirror_entry) = (end, index);
        }
    }
    None
}

/// A whole tensor's `MirrorTensor`, after checking its input's lengths.
fn begin_whole(input: &MirrorInput<'_>, values: ValueCodec, codec: Codec) -> Result<MirrorTensor> {
    let tensor = MirrorTensor::begin(&input.name, input.dtype, &input.shape, values)?.with_codec(codec)?;
    let expected = tensor.numel as usize * tensor.width;
    if input.mirror.len() != expected || input.new.len() != expected {
        return Err(Error::mismatch(format!(
            "tensor {:?}: {} mirror bytes and {} new bytes given for shape {:?} of {}",
            input.name,
            input.mirror.len(),
            input.new.len(),
            input.shape,
            dtype::name_of(input.dtype)
        )));
    }
    Ok(tensor)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::diff::{diff, DiffInput};
    use crate::core::testing::xorshift;
    use proptest::prelude::*;

    /// `overlapping_mirror` against the pairwise check it replaces, on random layouts of few addresses (so that
    /// spans often touch, nest and coincide).
    #[test]
    fn overlapping_mirror_finds_what_a_pairwise_check_finds() {
        let overlap = |(a, a_len): (usize, usize), (b, b_len): (usize, usize)| {
            a_len > 0 && b_len > 0 && a < b + b_len && b < a + a_len
        };
        let mut random = xorshift(11);
        let mut next = |bound: u64| (random() % bound) as usize;
        for _ in 0..20_000 {
            let count = 1 + next(5);
            let entries: Vec<(Span, Span)> = (0..count).map(|_| ((next(40), next(6)), (next(40), next(6)))).collect();
            let clash = |i: usize| {
                let (mirror, new) = entries[i];
                overlap(mirror, new)
                    || entries.iter().enumerate().any(|(j, &(other_mirror, other_new))| {
                        j != i && (overlap(mirror, other_mirror) || overlap(mirror, other_new))
                    })
            };
            match overlapping_mirror(&entries) {
                Some(i) => assert!(clash(i), "{entries:?}: entry {i} named, but its mirror overlaps nothing"),
                None => assert!(!(0..count).any(clash), "{entries:?}: an overlap was missed"),
            }
        }
        // An empty mirror overlaps nothing, spans that touch do not overlap, and another entry's new bytes count.
        assert_eq!(overlapping_mirror(&[((0, 0), (0, 8)), ((8, 8), (16, 8))]), None);
        assert_eq!(overlapping_mirror(&[((0, 0), (0, 8)), ((4, 8), (16, 8))]), Some(1));
    }

    fn same(a: &TensorDelta, b: &TensorDelta) {
        assert_eq!(a.name, b.name);
        assert_eq!(a.changed, b.changed);
        assert_eq!(a.positions_codec, b.positions_codec);
        assert_eq!(a.values_codec, b.values_codec);
        assert_eq!(&a.positions[..], &b.positions[..]);
        assert_eq!(&a.values[..], &b.values[..]);
        assert_eq!(a.last_position, b.last_position);
        assert_eq!(a.base, b.base);
    }

    fn chunked(
        old: &[u8],
        new: &[u8],
        dtype: Dtype,
        chunk_elements: usize,
        codec: ValueCodec,
    ) -> (TensorDelta, Vec<u8>) {
        chunked_in(old, new, dtype, chunk_elements, codec, Codec::Varint)
    }

    fn chunked_in(
        old: &[u8],
        new: &[u8],
        dtype: Dtype,
        chunk_elements: usize,
        codec: ValueCodec,
        family: Codec,
    ) -> (TensorDelta, Vec<u8>) {
        let width = dtype::width_of(dtype).unwrap();
        let numel = (old.len() / width) as u64;
        let mut mirror = old.to_vec();
        let mut tensor = MirrorTensor::begin("t", dtype, &[numel], codec).unwrap().with_codec(family).unwrap();
        let step = chunk_elements.max(1) * width;
        let mut start = 0;
        while start < mirror.len() {
            let end = (start + step).min(mirror.len());
            tensor.update(&mut mirror[start..end], &new[start..end], (start / width) as u64).unwrap();
            start = end;
        }
        (tensor.finish(Some(&mirror)).unwrap(), mirror)
    }

    fn reference(old: &[u8], new: &[u8], dtype: Dtype, codec: ValueCodec) -> TensorDelta {
        reference_in(old, new, dtype, codec, Codec::Varint)
    }

    fn reference_in(old: &[u8], new: &[u8], dtype: Dtype, codec: ValueCodec, family: Codec) -> TensorDelta {
        let numel = (old.len() / dtype::width_of(dtype).unwrap()) as u64;
        let input = DiffInput { name: "t".into(), dtype, shape: vec![numel], old, new };
        diff(&[input], codec, family).unwrap().remove(0)
    }

    #[test]
    fn compact_matches_diff_across_tasks_chunks_and_widths() {
        // Sparse small steps (Rice and rans win), a dense patch, and escapes, over several tasks.
        for (dtype, width) in [(Dtype::U8, 1usize), (Dtype::BF16, 2), (Dtype::F32, 4), (Dtype::F64, 8)] {
            let n = TASK_ELEMENTS * 2 + 4099;
            let old: Vec<u8> = (0..n * width).map(|i| (i * 131 % 251) as u8).collect();
            let mut new = old.clone();
            for (k, p) in (0..n).step_by(89).enumerate() {
                new[p * width] = new[p * width].wrapping_add([1u8, 255, 2, 254, 77][k % 5]);
            }
            for p in TASK_ELEMENTS - 50..TASK_ELEMENTS + 50 {
                new[p * width + width - 1] ^= 0x40;
            }
            for values in [ValueCodec::Diff, ValueCodec::Abs] {
                let want = reference_in(&old, &new, dtype, values, Codec::Compact);
                if values == ValueCodec::Diff {
                    assert_eq!(
                        (want.positions_codec, want.values_codec),
                        (PositionCodec::Rice, ValueCodec::Rans),
                        "width {width}"
                    );
                }
                // (Chunks of a few elements are in `compact_equals_diff_compact`.)
                for chunk in [n, 4097, 65_537, TASK_ELEMENTS + 3] {
                    let (tensor, mirror) = chunked_in(&old, &new, dtype, chunk, values, Codec::Compact);
                    same(&tensor, &want);
                    assert_eq!(mirror, new);
                }
                let steps = [(old.clone(), new.clone())];
                let want = TensorDelta { name: "t0".into(), ..want }; // as `whole_inputs` names it
                let mut mirrors = vec![old.clone()];
                same(&advance(whole_inputs(&mut mirrors, &steps, dtype), values, Codec::Compact).unwrap()[0], &want);
                // Deferred: the mirror moves at once, the same tensor comes out of `complete`.
                let mut mirrors = vec![old.clone()];
                let pending =
                    advance_deferred(whole_inputs(&mut mirrors, &steps, dtype), values, Codec::Compact).unwrap();
                assert_eq!(mirrors[0], new);
                let done = complete(pending.into_iter().map(|t| (t, &mirrors[0][..])).collect()).unwrap();
                same(&done[0], &want);
            }
        }
    }

    /// One whole-tensor input per mirror, named `t0`, `t1`, ..., with the new bytes of `steps`.
    fn whole_inputs<'a>(
        mirrors: &'a mut [Vec<u8>],
        steps: &'a [(Vec<u8>, Vec<u8>)],
        dtype: Dtype,
    ) -> Vec<MirrorInput<'a>> {
        let width = dtype::width_of(dtype).unwrap();
        mirrors
            .iter_mut()
            .zip(steps)
            .enumerate()
            .map(|(i, (mirror, (_, new)))| MirrorInput {
                name: format!("t{i}"),
                dtype,
                shape: vec![(new.len() / width) as u64],
                mirror,
                new,
            })
            .collect()
    }

    #[test]
    fn a_compact_shard_keeps_varint() {
        let mut mirror = vec![0u8; 1000];
        let mut new = mirror.clone();
        for p in (0..1000).step_by(7) {
            new[p] = 1;
        }
        let mut tensor =
            MirrorTensor::begin("t", Dtype::U8, &[2000], ValueCodec::Diff).unwrap().with_codec(Codec::Compact).unwrap();
        tensor.update(&mut mirror, &new, 500).unwrap();
        let tensor = tensor.finish(None).unwrap();
        assert_eq!((tensor.positions_codec, tensor.values_codec), (PositionCodec::Varint, ValueCodec::Diff));
        let mut seen = Vec::new();
        tensor.for_each_change(|p, v| seen.push((p, v))).unwrap();
        assert_eq!(seen, (0..1000u64).step_by(7).map(|p| (500 + p, 1)).collect::<Vec<_>>());
    }

    #[test]
    fn matches_diff_across_tasks_and_chunks() {
        let n = TASK_ELEMENTS * 2 + 37;
        let old = vec![0u8; n * 2];
        let mut new = old.clone();
        for p in [0usize, 15, 16, 17, TASK_ELEMENTS - 1, TASK_ELEMENTS, TASK_ELEMENTS * 2 + 36] {
            new[p * 2] = 1;
        }
        new[100 * 2 + 1] = 0x40; // a difference that needs the escape
        for chunk in [n, 1000, TASK_ELEMENTS + 3] {
            let (tensor, mirror) = chunked(&old, &new, Dtype::BF16, chunk, ValueCodec::Diff);
            same(&tensor, &reference(&old, &new, Dtype::BF16, ValueCodec::Diff));
            assert_eq!(mirror, new);
        }
    }

    #[test]
    fn odd_chunks_give_the_base_identity_of_diff() {
        // Chunks of byte counts that cut blocks anywhere, each tensor over several blocks and tasks.
        for (dtype, width) in [(Dtype::U8, 1usize), (Dtype::BF16, 2), (Dtype::F32, 4), (Dtype::F64, 8)] {
            let n = (3 * base::BLOCK_BYTES + 5 * 8) / width;
            let old: Vec<u8> = (0..n * width).map(|i| (i * 131 % 251) as u8).collect();
            let mut new = old.clone();
            for p in (0..n).step_by(997) {
                new[p * width] ^= 1;
            }
            let want = reference(&old, &new, dtype, ValueCodec::Diff);
            assert_eq!(want.base, Some(base::identity(&old)));
            for chunk in [4099usize, 65_537, base::BLOCK_BYTES / width + 3, TASK_ELEMENTS + 11, n] {
                let (tensor, mirror) = chunked(&old, &new, dtype, chunk, ValueCodec::Diff);
                same(&tensor, &want);
                assert_eq!(mirror, new);
            }
            // Elements after the last chunk count as unchanged, their base bytes read from the whole mirror.
            let mut mirror = old.clone();
            let mut tensor = MirrorTensor::begin("t", dtype, &[n as u64], ValueCodec::Diff).unwrap();
            let end = (base::BLOCK_BYTES + 3 * width) / width * width;
            tensor.update(&mut mirror[..end], &new[..end], 0).unwrap();
            let tensor = tensor.finish(Some(&mirror)).unwrap();
            assert_eq!(tensor.base, Some(base::identity(&old)), "width {width}");
            // Skipped elements before a chunk leave no base identity.
            let mut mirror = old.clone();
            let mut tensor = MirrorTensor::begin("t", dtype, &[n as u64], ValueCodec::Diff).unwrap();
            tensor.update(&mut mirror[width..], &new[width..], 1).unwrap();
            assert_eq!(tensor.finish(Some(&mirror)).unwrap().base, None);
        }
    }

    #[test]
    fn dense_when_no_smaller_and_sparse_without_whole_mirror() {
        let old = vec![0u8; 256];
        let new: Vec<u8> = (0..=255u8).collect();
        let (tensor, _) = chunked(&old, &new, Dtype::U8, 100, ValueCodec::Diff);
        assert!(tensor.is_dense());
        same(&tensor, &reference(&old, &new, Dtype::U8, ValueCodec::Diff));
        let mut mirror = old.clone();
        let mut part = MirrorTensor::begin("t", Dtype::U8, &[256], ValueCodec::Diff).unwrap();
        part.update(&mut mirror, &new, 0).unwrap();
        let part = part.finish(None).unwrap();
        assert!(!part.is_dense());
        assert_eq!(part.changed, 255);
        assert_eq!(part.base, None, "a shard records no base");
    }

    #[test]
    fn a_shard_maps_positions_into_the_whole_tensor() {
        // A rank mirrors elements [100, 200) of a 300-element tensor.
        let mut mirror = vec![0u8; 100 * 4];
        let mut new = mirror.clone();
        new[5 * 4] = 7;
        let mut tensor = MirrorTensor::begin("t", Dtype::F32, &[3, 100], ValueCodec::Abs).unwrap();
        tensor.update(&mut mirror, &new, 100).unwrap();
        let tensor = tensor.finish(None).unwrap();
        assert_eq!(tensor.base, None);
        let mut seen = Vec::new();
        tensor.for_each_change(|p, v| seen.push((p, v))).unwrap();
        assert_eq!(seen, vec![(105, 7)]);
    }

    #[test]
    fn a_shard_proves_the_range_it_mirrored() {
        // A rank mirrors elements [first, first + len) of a larger tensor, in chunks that cut blocks anywhere; the
        // range's identity is that of its old bytes as a tensor of their own, and the streams are unchanged by it.
        for (dtype, width) in [(Dtype::U8, 1usize), (Dtype::BF16, 2), (Dtype::F32, 4)] {
            let len = (2 * base::BLOCK_BYTES + 77 * 8) / width;
            let old: Vec<u8> = (0..len * width).map(|i| (i * 131 % 251) as u8).collect();
            let mut new = old.clone();
            for p in (3..len).step_by(501) {
                new[p * width] ^= 1;
            }
            for first in [0u64, 1, 12_345, (base::BLOCK_BYTES / width) as u64 + 1] {
                let numel = first + len as u64 + 9;
                for chunk in [4099usize, base::BLOCK_BYTES / width + 3, TASK_ELEMENTS + 11, len] {
                    let mut mirror = old.clone();
                    let mut tensor = MirrorTensor::begin("t", dtype, &[numel], ValueCodec::Diff).unwrap();
                    for start in (0..len).step_by(chunk) {
                        let end = (start + chunk).min(len);
                        let (m, n) = (&mut mirror[start * width..end * width], &new[start * width..end * width]);
                        tensor.update(m, n, first + start as u64).unwrap();
                    }
                    let (part, range) = tensor.finish_shard().unwrap();
                    let want = RangeBase { first, elements: len as u64, identity: base::identity(&old) };
                    assert_eq!(range, Some(want), "width {width}, first {first}, chunk {chunk}");
                    assert_eq!(mirror, new);
                    assert_eq!(part.base, None, "a shard records no whole-tensor base");
                    let mut seen = Vec::new();
                    part.for_each_change(|p, _| seen.push(p)).unwrap();
                    let want: Vec<u64> = (3..len).step_by(501).map(|p| first + p as u64).collect();
                    assert_eq!(seen, want);
                }
            }
            // Skipped elements between chunks, or no elements at all, prove nothing.
            let mut mirror = old.clone();
            let mut tensor = MirrorTensor::begin("t", dtype, &[len as u64], ValueCodec::Diff).unwrap();
            tensor.update(&mut mirror[..width], &new[..width], 0).unwrap();
            tensor.update(&mut mirror[2 * width..], &new[2 * width..], 2).unwrap();
            assert_eq!(tensor.finish_shard().unwrap().1, None);
            let tensor = MirrorTensor::begin("t", dtype, &[len as u64], ValueCodec::Diff).unwrap();
            assert_eq!(tensor.finish_shard().unwrap().1, None);
        }
    }

    #[test]
    fn rejects_bad_chunks_naming_the_tensor() {
        let mut tensor = MirrorTensor::begin("w", Dtype::BF16, &[8], ValueCodec::Diff).unwrap();
        let mut mirror = vec![0u8; 8];
        let err = tensor.update(&mut mirror, &[0u8; 6], 0).unwrap_err();
        assert!(err.to_string().contains("\"w\""), "{err}");
        tensor.update(&mut mirror, &[0u8; 8], 4).unwrap();
        let err = tensor.update(&mut mirror, &[0u8; 8], 2).unwrap_err();
        assert!(err.to_string().contains("\"w\""), "{err}");
        let err = tensor.update(&mut mirror[..2], &[0u8; 2], 8).unwrap_err();
        assert!(err.to_string().contains("outside"), "{err}");
        for reserved in ["x:pos", "x:val", "__metadata__"] {
            let Err(err) = MirrorTensor::begin(reserved, Dtype::BF16, &[1], ValueCodec::Diff) else {
                panic!("{reserved} accepted")
            };
            assert!(err.to_string().contains(&format!("{reserved:?}")), "{err}");
        }
    }

    #[test]
    fn advance_checks_before_writing() {
        let mut first = vec![0u8; 4];
        let mut second = vec![0u8; 4];
        let inputs = vec![
            MirrorInput {
                name: "a".into(),
                dtype: Dtype::BF16,
                shape: vec![2],
                mirror: &mut first,
                new: &[1, 0, 0, 0],
            },
            MirrorInput {
                name: "b".into(),
                dtype: Dtype::BF16,
                shape: vec![3],
                mirror: &mut second,
                new: &[1, 0, 0, 0],
            },
        ];
        let err = advance(inputs, ValueCodec::Diff, Codec::Varint).unwrap_err();
        assert!(err.to_string().contains("\"b\""), "{err}");
        assert_eq!(first, vec![0u8; 4]);
    }

    /// `numel` random elements of `width` bytes, and a copy in which each element changes with probability
    /// `density`, as `change(element bytes, a random number)` says.
    fn random_step(
        width: usize,
        numel: usize,
        seed: u64,
        density: f64,
        change: impl Fn(&mut [u8], u64),
    ) -> (Vec<u8>, Vec<u8>) {
        let mut next = xorshift(seed | 1);
        let old: Vec<u8> = (0..numel * width).map(|_| next() as u8).collect();
        let mut new = old.clone();
        for element in new.chunks_mut(width.max(1)) {
            if (next() % 1000) as f64 / 1000.0 < density {
                change(element, next());
            }
        }
        (old, new)
    }

    fn dtype_of(width: usize) -> Dtype {
        match width {
            1 => Dtype::U8,
            2 => Dtype::BF16,
            4 => Dtype::F32,
            _ => Dtype::F64,
        }
    }

    proptest! {
        #[test]
        fn equals_diff_and_leaves_the_new_state(
            width in prop::sample::select(vec![1usize, 2, 4, 8]),
            numel in 0usize..600,
            seed in any::<u64>(),
            density in 0.0f64..1.0,
            chunk in 1usize..300,
            abs in any::<bool>(),
        ) {
            // One byte of the element moves by 1 to 3.
            let (old, new) = random_step(width, numel, seed, density, |element, random| {
                let byte = random as usize % element.len();
                element[byte] = element[byte].wrapping_add(1 + (random >> 8) as u8 % 3);
            });
            let codec = if abs { ValueCodec::Abs } else { ValueCodec::Diff };
            let dtype = dtype_of(width);
            let (tensor, mirror) = chunked(&old, &new, dtype, chunk, codec);
            same(&tensor, &reference(&old, &new, dtype, codec));
            prop_assert_eq!(mirror, new);
        }

        #[test]
        fn compact_equals_diff_compact(
            width in prop::sample::select(vec![1usize, 2, 4, 8]),
            numel in 0usize..600,
            seed in any::<u64>(),
            density in 0.0f64..1.0,
            chunk in 1usize..300,
            abs in any::<bool>(),
        ) {
            // The low byte moves by +-1, +-2 or 9: the differences the compact value codes are made for.
            let (old, new) = random_step(width, numel, seed, density, |element, random| {
                element[0] = element[0].wrapping_add([1u8, 255, 2, 254, 9][(random % 5) as usize]);
            });
            let codec = if abs { ValueCodec::Abs } else { ValueCodec::Diff };
            let dtype = dtype_of(width);
            let (tensor, mirror) = chunked_in(&old, &new, dtype, chunk, codec, Codec::Compact);
            same(&tensor, &reference_in(&old, &new, dtype, codec, Codec::Compact));
            prop_assert_eq!(mirror, new);
        }

        #[test]
        fn context_equals_diff_context(
            wide in any::<bool>(),
            numel in 1usize..5000,
            seed in any::<u64>(),
            density in 0.0f64..1.0,
            step in 0.001f32..0.05,
            chunk in 1usize..3000,
        ) {
            // Weights as initialised (uniform in +-1/8) and an optimizer step of about `step` on a share `density`
            // of them: where most elements change, the base's exponent classes differ from the new bits', which
            // the writer's choice to code positions by class must not see (the mirror holds the new bits, `diff`
            // the base).
            let width = if wide { 4 } else { 2 };
            let mut next = xorshift(seed | 1);
            let mut uniform = move || (next() >> 11) as f32 / (1u64 << 53) as f32;
            let (mut old, mut new) = (Vec::with_capacity(numel * width), Vec::with_capacity(numel * width));
            for _ in 0..numel {
                let before = (uniform() - 0.5) / 4.0;
                let after = if f64::from(uniform()) < density {
                    before + if uniform() < 0.5 { step } else { -step }
                } else {
                    before
                };
                for (out, value) in [(&mut old, before), (&mut new, after)] {
                    out.extend_from_slice(&value.to_le_bytes()[4 - width..]);
                }
            }
            let dtype = dtype_of(width);
            let want = reference_in(&old, &new, dtype, ValueCodec::Diff, Codec::Context);
            let (tensor, mirror) = chunked_in(&old, &new, dtype, chunk, ValueCodec::Diff, Codec::Context);
            same(&tensor, &want);
            prop_assert_eq!(mirror, new);
        }

        #[test]
        fn deferred_equals_advance(
            width in prop::sample::select(vec![1usize, 2, 4, 8]),
            numels in prop::collection::vec(0usize..600, 1..4),
            seed in any::<u64>(),
            density in 0.0f64..1.0,
            abs in any::<bool>(),
        ) {
            let codec = if abs { ValueCodec::Abs } else { ValueCodec::Diff };
            let dtype = dtype_of(width);
            let steps: Vec<(Vec<u8>, Vec<u8>)> = numels
                .iter()
                .enumerate()
                .map(|(i, &numel)| {
                    random_step(width, numel, seed ^ i as u64, density, |element, random| {
                        element[0] = element[0].wrapping_add([1u8, 255, 2, 254, 9][(random % 5) as usize]);
                    })
                })
                .collect();
            let families: &[Codec] =
                if abs { &[Codec::Varint, Codec::Compact] } else { &[Codec::Varint, Codec::Compact, Codec::Context] };
            for &family in families {
                let mut now: Vec<Vec<u8>> = steps.iter().map(|(old, _)| old.clone()).collect();
                let mut later = now.clone();
                let want = advance(whole_inputs(&mut now, &steps, dtype), codec, family).unwrap();
                let pending = advance_deferred(whole_inputs(&mut later, &steps, dtype), codec, family).unwrap();
                prop_assert_eq!(&later, &now, "the mirrors move before the encoding");
                let got = complete(pending.into_iter().zip(&later).map(|(t, m)| (t, &m[..])).collect()).unwrap();
                prop_assert_eq!(got.len(), want.len());
                for (got, want) in got.iter().zip(&want) {
                    same(got, want);
                }
            }
        }
    }
}
