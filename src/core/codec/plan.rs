//! The `compact` codec's choice for one tensor: from the scan's ranges (`varint` positions, `abs` or `diff`
//! values), the smallest position and value streams, each re-encoded only where it wins.

use rayon::prelude::*;

use super::bits::BitWriter;
use super::diffbits::diffbits_stream;
use super::ranges::{self, Changes};
use super::rans::{self, Tokens, MAX_TOKENS};
use super::rice::{put_rice, rice_k};
use super::{varint, with_width, PositionCodec, ValueCodec};

/// A tensor's two streams and their codecs, as `smallest_streams` picks them.
pub struct TensorStreams {
    pub positions_codec: PositionCodec,
    pub values_codec: ValueCodec,
    pub positions: Vec<u8>,
    pub values: Vec<u8>,
}

/// True when a tensor's streams, `streams_len` bytes in all, are kept: storing the tensor whole (`dense_len` bytes,
/// positions `all`, values `abs`) is larger. The rule of both codec families.
#[inline]
pub fn streams_win(streams_len: usize, dense_len: usize) -> bool {
    streams_len < dense_len
}

/// A range's changes re-encoded in the compact codec: Rice codes of its gaps (its first gap included) and, for
/// differences, their `rans` tokens.
struct CompactRange {
    positions: Vec<u8>,
    position_bits: u64,
    /// The differences as `rans` tokens, and how often each token occurs.
    tokens: Tokens,
    histogram: [u64; MAX_TOKENS],
    /// The positions of the range's changes that the `context` writer samples (`Sample`).
    sampled: Vec<u64>,
}

/// Which of a tensor's changes to gather the positions of while its ranges are re-encoded: every `step`-th (number
/// 0, `step`, 2 × `step`, ... over the whole tensor; `context::sample_step`), as `context::worth_walking_sampled`
/// takes them. A step of 0 gathers none.
#[derive(Clone, Copy)]
pub struct Sample {
    pub step: u64,
}

/// How a tensor's gaps are coded: its Rice parameter, and where each range's first gap starts.
fn rice_plan(ranges: &[Changes]) -> (u32, Vec<u64>) {
    let mut previous_ends = Vec::with_capacity(ranges.len());
    let (mut previous_end, mut count, mut gap_sum) = (0u64, 0u64, 0u64);
    for range in ranges {
        previous_ends.push(previous_end);
        if range.count > 0 {
            count += range.count;
            gap_sum += range.last_position + 1 - previous_end - range.count;
            previous_end = range.last_position + 1;
        }
    }
    (rice_k(count, gap_sum), previous_ends)
}

/// Re-encodes one range in the compact codec; `previous_end` is the position after the previous range's last change,
/// `first_index` the number of the range's first change in the tensor (for `sample`).
fn compact_range<const SAMPLE: bool>(
    range: &Changes,
    k: u32,
    (previous_end, first_index): (u64, u64),
    width: usize,
    differences: bool,
    sample: Sample,
) -> CompactRange {
    let mut positions = BitWriter::with_capacity(range.positions.len());
    let mut sampled = Vec::new();
    if range.count > 0 {
        let mut position = range.first_position;
        put_rice(&mut positions, position - previous_end, k);
        // Changes left to pass before the next sampled one.
        let mut left = if SAMPLE { (sample.step - first_index % sample.step) % sample.step } else { 0 };
        let (stream, mut at) = (&range.positions[..], 0);
        loop {
            if SAMPLE {
                if left == 0 {
                    sampled.push(position);
                    left = sample.step;
                }
                left -= 1;
            }
            if at >= stream.len() {
                break;
            }
            let gap = varint::read_gap(stream, &mut at).expect("written by the scan");
            put_rice(&mut positions, gap, k);
            position += 1 + gap;
        }
    }
    let mut histogram = [0u64; MAX_TOKENS];
    let mut tokens = Tokens::default();
    if differences {
        let (stream, count) = (&range.values[..], range.count);
        tokens = with_width!(width, W => rans::tokenize_diff::<W>(stream, count, &mut histogram));
    }
    let position_bits = positions.bit_len();
    CompactRange { positions: positions.finish(), position_bits, tokens, histogram, sampled }
}

/// Bits of the `diffbits` stream of these differences, from their `rans` token counts (tokens 1 to 4 are ±1 and ±2)
/// and how many of them the `diff` stream escapes.
fn diffbits_bits(histogram: &[u64; MAX_TOKENS], escapes: u64, width: usize) -> u64 {
    let (ones, twos) = (histogram[1] + histogram[2], histogram[3] + histogram[4]);
    let others = histogram.iter().sum::<u64>() - ones - twos;
    2 * ones + 3 * twos + 10 * others + 8 * width as u64 * escapes
}

/// The `rans` stream of a tensor's differences where it is smaller than `smaller_than` bytes.
fn rans_stream(compacts: &[CompactRange], histogram: &[u64; MAX_TOKENS], smaller_than: usize) -> Option<Vec<u8>> {
    if histogram.iter().all(|&c| c == 0) {
        return None;
    }
    let freqs = rans::normalise(histogram);
    // The estimate is within a few bytes of the length: skip the encoding where it cannot win.
    if rans::estimated_len(histogram, &freqs) > smaller_than as f64 + 64.0 {
        return None;
    }
    let parts: Vec<&Tokens> = compacts.iter().map(|c| &c.tokens).collect();
    let stream = rans::encode(&parts, &freqs);
    (stream.len() < smaller_than).then_some(stream)
}

/// The `compact` codec's choice for one tensor, made by every writer of it (core::diff, core::mirror, core::shards):
/// from the scan's changes of the tensor's consecutive ranges (values scanned as `abs` or `diff`), `rice` positions
/// kept only where smaller than `varint`, and the smallest of `diff`, `diffbits` and `rans` values (the older on a
/// tie); None when the tensor stored whole, `dense_len` bytes, is no larger. Ranges are re-encoded side by side in
/// the rayon pool; codes are appended code by code, so the bytes do not depend on how the tensor was cut into ranges.
pub fn smallest_streams(
    ranges: &[Changes],
    width: usize,
    scanned_values: ValueCodec,
    dense_len: usize,
) -> Option<TensorStreams> {
    smallest_streams_sampling(ranges, width, scanned_values, dense_len, Sample { step: 0 }).0
}

/// `smallest_streams`, with the positions of the changes `sample` names, gathered in the same pass (also where the
/// tensor is stored whole).
pub fn smallest_streams_sampling(
    ranges: &[Changes],
    width: usize,
    scanned_values: ValueCodec,
    dense_len: usize,
    sample: Sample,
) -> (Option<TensorStreams>, Vec<u64>) {
    let (varint_len, byte_values_len) = ranges::joined_lens(ranges);
    let differences = scanned_values == ValueCodec::Diff;
    let (k, previous_ends) = rice_plan(ranges);
    let first_indices = ranges.iter().scan(0u64, |index, range| {
        *index += range.count;
        Some(*index - range.count)
    });
    let starts: Vec<(u64, u64)> = previous_ends.into_iter().zip(first_indices).collect();
    let compacts: Vec<CompactRange> = ranges
        .par_iter()
        .zip(starts)
        .map(|(range, start)| match sample.step {
            0 => compact_range::<false>(range, k, start, width, differences, sample),
            _ => compact_range::<true>(range, k, start, width, differences, sample),
        })
        .collect();
    let sampled: Vec<u64> = compacts.iter().flat_map(|c| c.sampled.iter().copied()).collect();
    let (mut rice, mut bit_values) = (None, None);
    let position_bits = 8 + compacts.iter().map(|c| c.position_bits).sum::<u64>();
    if position_bits.div_ceil(8) < varint_len as u64 {
        let mut out = BitWriter::with_capacity(position_bits.div_ceil(8) as usize);
        out.put(u64::from(k), 8);
        for c in &compacts {
            out.append(&c.positions, c.position_bits);
        }
        rice = Some(out.finish());
    }
    let mut values_codec = scanned_values;
    if differences {
        let mut histogram = [0u64; MAX_TOKENS];
        let mut escapes = 0;
        for c in &compacts {
            for (total, count) in histogram.iter_mut().zip(&c.histogram) {
                *total += count;
            }
            escapes += c.tokens.escapes;
        }
        // Only the stream that is kept is encoded: `diffbits`'s length follows from the token counts.
        let diffbits_len = diffbits_bits(&histogram, escapes, width).div_ceil(8) as usize;
        if let Some(stream) = rans_stream(&compacts, &histogram, diffbits_len.min(byte_values_len)) {
            bit_values = Some(stream);
            values_codec = ValueCodec::Rans;
        } else if diffbits_len < byte_values_len {
            let stream = diffbits_stream(ranges, width);
            assert_eq!(stream.len(), diffbits_len, "diffbits length counted from the tokens");
            bit_values = Some(stream);
            values_codec = ValueCodec::DiffBits;
        }
    }
    let positions_len = rice.as_ref().map_or(varint_len, Vec::len);
    let values_len = bit_values.as_ref().map_or(byte_values_len, Vec::len);
    if !streams_win(positions_len + values_len, dense_len) {
        return (None, sampled);
    }
    let positions_codec = if rice.is_some() { PositionCodec::Rice } else { PositionCodec::Varint };
    let (positions, values) = match (rice, bit_values) {
        (Some(positions), Some(values)) => (positions, values),
        (rice, bit_values) => {
            let (varint_positions, byte_values) = ranges::join_streams(ranges);
            (rice.unwrap_or(varint_positions), bit_values.unwrap_or(byte_values))
        }
    };
    (Some(TensorStreams { positions_codec, values_codec, positions, values }), sampled)
}

/// The positions of a tensor's changes, ascending, from the scan's ranges.
fn positions_of(ranges: &[Changes]) -> Vec<u64> {
    let mut out = Vec::with_capacity(ranges.iter().map(|r| r.count as usize).sum());
    for range in ranges.iter().filter(|r| r.count > 0) {
        let mut position = range.first_position;
        out.push(position);
        let (stream, mut at) = (&range.positions[..], 0);
        while at < stream.len() {
            position += 1 + varint::read_gap(stream, &mut at).expect("written by the scan");
            out.push(position);
        }
    }
    out
}

/// The `context` codec's streams for one tensor, or None to store it whole: its `compact` streams
/// (`smallest_streams`), with the positions coded against the base's classes (codec::context) where that is
/// smaller. Tensors whose dtype has no exponent keep `compact`'s streams.
pub fn context_streams(
    ranges: &[Changes],
    dtype: crate::core::dtype::Dtype,
    width: usize,
    scanned_values: ValueCodec,
    base: &[u8],
    dense_len: usize,
) -> Option<TensorStreams> {
    let Some(field) = super::context::Exponent::of(dtype) else {
        return smallest_streams(ranges, width, scanned_values, dense_len);
    };
    let changes = ranges.iter().map(|r| r.count).sum();
    // The sample of the changes that decides whether to walk is gathered while the positions are re-encoded.
    let sample = Sample { step: super::context::sample_step(changes) as u64 };
    let (streams, sampled) = smallest_streams_sampling(ranges, field.width, scanned_values, dense_len, sample);
    let streams = streams?;
    let Some(walk) =
        super::context::worth_walking_sampled(base, None, &[], field, &sampled, changes, streams.positions.len())
    else {
        return Some(streams);
    };
    let differences = (streams.values_codec != ValueCodec::Abs).then(|| differences_of(ranges, field.width));
    Some(smaller_of(streams, &walk, field, base, &positions_of(ranges), None, differences.as_deref()))
}

/// The changes `context::worth_walking` samples (number 0, `sample_step`, 2 × that, ...) of the `changes` in
/// `ranges` (ranges of `diff` values), read from the scan's ranges without gathering the others: their positions,
/// their differences and, as `worth_walking_sampled`'s `patches`, the base bits of the changed elements among those
/// its tensor samples take, from `new`, the tensor's new bits.
fn sampled_changes(
    ranges: &[Changes],
    changes: u64,
    width: usize,
    new: &[u8],
) -> (Vec<u64>, Vec<u64>, Vec<(u64, u64)>) {
    let step = super::context::sample_step(changes) as u64;
    let strides = super::context::sample_strides(new.len() / width).map(|s| s as u64);
    let mask = if width == 8 { u64::MAX } else { (1u64 << (8 * width)) - 1 };
    let (mut positions, mut sampled_differences, mut patches) = (Vec::new(), Vec::new(), Vec::new());
    // Each tensor sample's run (first element, end) at or after the last change: a change finds the next sampled
    // run only once it is past this one's end.
    let run = super::context::SAMPLE_RUN;
    let mut windows = [(0u64, run); 2];
    // Changes left to pass before the next sampled one (a count down, not a division per change).
    let mut left = 0u64;
    for range in ranges.iter().filter(|r| r.count > 0) {
        let (mut position, mut gap_at, mut value_at) = (range.first_position, 0usize, 0usize);
        for k in 0..range.count {
            if k > 0 {
                position += 1 + varint::read_gap(&range.positions, &mut gap_at).expect("written by the scan");
            }
            let sampled_change = left == 0;
            left = if sampled_change { step - 1 } else { left - 1 };
            let difference = with_width!(width, W => super::values::read_diff::<W>(&range.values, &mut value_at))
                .expect("written by the scan");
            if sampled_change {
                positions.push(position);
                sampled_differences.push(difference);
            }
            let mut sampled = false;
            for (window, stride) in windows.iter_mut().zip(strides) {
                if position >= window.1 {
                    let first = (position / run).next_multiple_of(stride) * run;
                    *window = (first, first + run);
                }
                sampled |= position >= window.0;
            }
            if sampled {
                let bits = super::elements::load(&new[position as usize * width..], width);
                patches.push((position, bits.wrapping_sub(difference) & mask));
            }
        }
    }
    (positions, sampled_differences, patches)
}

/// The wrapping differences of a tensor's changes, in order, from ranges whose values are `diff` differences.
fn differences_of(ranges: &[Changes], width: usize) -> Vec<u64> {
    let mut out = Vec::with_capacity(ranges.iter().map(|r| r.count as usize).sum());
    for range in ranges.iter().filter(|r| r.count > 0) {
        let mut at = 0usize;
        for _ in 0..range.count {
            out.push(
                with_width!(width, W => super::values::read_diff::<W>(&range.values, &mut at))
                    .expect("written by the scan"),
            );
        }
    }
    out
}

/// `context_streams` for a writer that holds the tensor's new bits `new` instead of its base (the mirror, updated in
/// the same pass as the compare), from ranges whose values are `diff` differences: a changed element's base bits
/// are its new bits less its difference, and the others are the same in both.
pub fn with_context_from_new(
    streams: TensorStreams,
    ranges: &[Changes],
    dtype: crate::core::dtype::Dtype,
    new: &[u8],
) -> TensorStreams {
    let Some(field) = super::context::Exponent::of(dtype) else { return streams };
    let width = field.width;
    let mask = if width == 8 { u64::MAX } else { (1u64 << (8 * width)) - 1 };
    let base_bits = |position: u64, difference: u64| {
        super::elements::load(&new[position as usize * width..], width).wrapping_sub(difference) & mask
    };
    let changes = ranges.iter().map(|r| r.count).sum();
    let (sampled, sampled_differences, patches) = sampled_changes(ranges, changes, width, new);
    // The sampled changes lie far apart, a cache line each: their loads are asked for a few ahead.
    let sampled_old: Vec<u64> = (0..sampled.len())
        .map(|j| {
            if let Some(&later) = sampled.get(j + 16) {
                super::elements::prefetch(new, later as usize * width);
            }
            base_bits(sampled[j], sampled_differences[j])
        })
        .collect();
    let Some(walk) = super::context::worth_walking_sampled(
        new,
        Some(&sampled_old),
        &patches,
        field,
        &sampled,
        changes,
        streams.positions.len(),
    ) else {
        return streams;
    };
    let positions = positions_of(ranges);
    let differences = differences_of(ranges, width);
    let old: Vec<u64> = positions.iter().zip(&differences).map(|(&p, &d)| base_bits(p, d)).collect();
    smaller_of(streams, &walk, field, new, &positions, Some(&old), Some(&differences))
}

/// `streams` with `context` positions where they are smaller (callers first ask `worth_walking_sampled`): coded
/// against `bytes`, or, with `old`, against `bytes` holding the new bits and `old` the changed elements' base bits.
/// With the changes' `differences`, their values are coded by class too (`rans_classes`) where that is smaller.
fn smaller_of(
    streams: TensorStreams,
    walk: &super::context::WorthWalking,
    field: super::context::Exponent,
    bytes: &[u8],
    positions: &[u64],
    old: Option<&[u64]>,
    differences: Option<&[u64]>,
) -> TensorStreams {
    let stream = match old {
        Some(old) => walk.encode_from_new(bytes, field, positions, old),
        None => walk.encode(bytes, field, positions),
    };
    if stream.len() >= streams.positions.len() {
        return streams;
    }
    let mut chosen = TensorStreams { positions_codec: PositionCodec::Context, positions: stream, ..streams };
    if let Some(differences) = differences {
        let classes = match old {
            Some(old) => super::context::classes_of_bits(&chosen.positions, field, old.iter().copied()),
            None => super::context::classes_at(&chosen.positions, field, bytes, positions),
        }
        .expect("a context stream just written");
        if let Some(values) = super::classvalues::encode(&classes, differences, field.width) {
            if values.len() < chosen.values.len() {
                (chosen.values_codec, chosen.values) = (ValueCodec::RansClasses, values);
            }
        }
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::codec::ValueCodec;
    use crate::core::scan;
    use crate::core::testing::xorshift;

    /// The sample gathered while the ranges are re-encoded is every `step`-th change of the tensor, whatever the
    /// ranges it is cut into (some of them empty), and the streams are `smallest_streams`' bytes.
    #[test]
    fn sampled_while_re_encoding_are_every_step_th_change() {
        let mut next = xorshift(11);
        for (n, per_mille, range) in [(1000usize, 500u64, 100usize), (300_000, 20, 1 << 14), (200_000, 1, 4096)] {
            let old: Vec<u8> = (0..2 * n).map(|_| next() as u8).collect();
            let mut new = old.clone();
            for i in 0..n {
                // No change at all in the second quarter: empty ranges among full ones.
                if (i < n / 4 || i >= n / 2) && next() % 1000 < per_mille {
                    new[2 * i] = new[2 * i].wrapping_add(1 + (next() % 200) as u8);
                }
            }
            let ranges: Vec<Changes> = (0..n)
                .step_by(range)
                .map(|start| {
                    let end = (start + range).min(n);
                    scan::scan(&old[2 * start..2 * end], &new[2 * start..2 * end], start as u64, 2, ValueCodec::Diff)
                })
                .collect();
            let positions = positions_of(&ranges);
            for step in [1usize, 3, 64, super::super::context::sample_step(positions.len() as u64)] {
                let sample = Sample { step: step as u64 };
                let (streams, sampled) = smallest_streams_sampling(&ranges, 2, ValueCodec::Diff, usize::MAX, sample);
                let want: Vec<u64> = positions.iter().step_by(step).copied().collect();
                assert_eq!(sampled, want, "{n} elements, step {step}");
                let (streams, plain) = (streams.unwrap(), smallest_streams(&ranges, 2, ValueCodec::Diff, usize::MAX));
                let plain = plain.unwrap();
                assert_eq!((streams.positions, streams.values), (plain.positions, plain.values));
            }
        }
    }

    /// `sampled_changes` reads exactly the changes `worth_walking` would sample from all of them, across ranges.
    #[test]
    fn sampled_changes_are_every_step_th_change() {
        let mut next = xorshift(3);
        for (n, per_mille) in [(100usize, 500u64), (300_000, 20), (1_000_000, 30), (50, 0)] {
            let old: Vec<u8> = (0..2 * n).map(|_| next() as u8).collect();
            let mut new = old.clone();
            for i in 0..n {
                if next() % 1000 < per_mille {
                    new[2 * i] = new[2 * i].wrapping_add(1 + (next() % 200) as u8);
                }
            }
            let ranges: Vec<Changes> = (0..n)
                .step_by(1 << 16)
                .map(|start| {
                    let end = (start + (1 << 16)).min(n);
                    scan::scan(&old[2 * start..2 * end], &new[2 * start..2 * end], start as u64, 2, ValueCodec::Diff)
                })
                .collect();
            let positions = positions_of(&ranges);
            let differences = differences_of(&ranges, 2);
            let step = super::super::context::sample_step(positions.len() as u64);
            let changes = positions.len() as u64;
            let (sampled, sampled_differences, patches) = sampled_changes(&ranges, changes, 2, &new);
            assert_eq!(sampled, positions.iter().step_by(step).copied().collect::<Vec<_>>(), "{n} elements");
            assert_eq!(sampled_differences, differences.iter().step_by(step).copied().collect::<Vec<_>>());
            // The patches: every changed element the tensor's samples take, with its base bits.
            let strides = super::super::context::sample_strides(n);
            let want: Vec<(u64, u64)> = positions
                .iter()
                .filter(|&&p| strides.iter().any(|&s| super::super::context::in_sample(p, s as u64)))
                .map(|&p| (p, u64::from(u16::from_le_bytes([old[2 * p as usize], old[2 * p as usize + 1]]))))
                .collect();
            assert_eq!(patches, want, "{n} elements");
            // The same sample as the one `ds.diff`'s writer gathers while it re-encodes the positions.
            let (_, gathered) =
                smallest_streams_sampling(&ranges, 2, ValueCodec::Diff, usize::MAX, Sample { step: step as u64 });
            assert_eq!(gathered, sampled, "{n} elements");
        }
    }
}
