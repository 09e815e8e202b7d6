//! Decode and scatter: writes a delta's changes into caller-owned buffers, all-or-nothing.

use rayon::prelude::*;

use crate::core::base;
use crate::core::codec::decode::{ContextChanges, BATCH};
use crate::core::codec::{elements, values, with_width};
use crate::core::delta::{Delta, TensorDelta};
use crate::core::digest;
use crate::core::dtype;
use crate::core::error::{Error, Result};

/// Bytes of a tensor stored whole copied (and, from a mapped file, released) at a time.
const DENSE_PIECE_BYTES: usize = 32 << 20;

/// Checks that a target of `len` bytes, `dtype` and `shape` can take this tensor's changes.
pub fn check_target(tensor: &TensorDelta, dtype: dtype::Dtype, shape: Option<&[u64]>, len: usize) -> Result<()> {
    let name = &tensor.name;
    if dtype != tensor.dtype {
        return Err(Error::mismatch(format!(
            "tensor {name:?}: delta is {} but the target is {}",
            dtype::name_of(tensor.dtype),
            dtype::name_of(dtype)
        )));
    }
    if let (Some(expected), Some(actual)) = (tensor.shape.as_deref(), shape) {
        if expected != actual {
            return Err(Error::mismatch(format!(
                "tensor {name:?}: delta has shape {expected:?} but the target has {actual:?}"
            )));
        }
    }
    let width = tensor.width();
    let elements = (len / width) as u64;
    if !len.is_multiple_of(width) || tensor.numel().is_some_and(|numel| numel != elements) {
        return Err(Error::mismatch(format!(
            "tensor {name:?}: target holds {len} bytes, which does not fit the delta"
        )));
    }
    if let Some(last) = tensor.last_position {
        if last >= elements {
            return Err(Error::mismatch(format!(
                "tensor {name:?}: delta changes position {last} but the target has {elements} elements"
            )));
        }
    }
    Ok(())
}

/// The byte length of a target of `dtype` and `shape`, or a BaseMismatch naming the tensor when it overflows.
pub fn target_len(tensor: &TensorDelta, dtype: dtype::Dtype, shape: &[u64]) -> Result<usize> {
    dtype::numel(shape)
        .and_then(|n| n.checked_mul(dtype::width_of(dtype).ok()? as u64))
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| Error::mismatch(format!("tensor {:?}: target shape {shape:?} overflows", tensor.name)))
}

/// Refuses targets whose memory overlaps, given as (tensor index, address, byte length): sorted by address, each
/// must end before the next begins (O(n log n); comparing every pair took seconds at 160k tensors). An empty target
/// writes nothing and overlaps nothing. Writing two tensors through one buffer would leave a result that depends on
/// the order of the writes.
pub fn check_disjoint(delta: &Delta, targets: &[(usize, usize, usize)]) -> Result<()> {
    let mut spans: Vec<(usize, usize, usize)> = targets
        .iter()
        .filter(|(_, _, len)| *len > 0)
        .map(|&(index, start, len)| (start, start.saturating_add(len), index))
        .collect();
    spans.sort_unstable();
    for pair in spans.windows(2) {
        let ((_, end, first), (start, _, second)) = (pair[0], pair[1]);
        if start < end {
            let name = |index: usize| delta.tensors.get(index).map_or("?", |t| t.name.as_str()).to_owned();
            return Err(Error::invalid(format!(
                "target of tensor {:?} overlaps the target of tensor {:?}",
                name(second),
                name(first)
            )));
        }
    }
    Ok(())
}

/// Writes one tensor's changes into `target`, which `check_target` has accepted. A `context` tensor needs its
/// changes decoded beforehand (`TensorDelta::context_changes`), from the target before any write.
pub fn apply_tensor(tensor: &TensorDelta, target: &mut [u8], decoded: Option<&ContextChanges>) -> Result<()> {
    if tensor.is_dense() {
        // In pieces, each dropped once copied when it is mapped from a file: an anchor's pages never pile up.
        for (index, piece) in target.chunks_mut(DENSE_PIECE_BYTES).enumerate() {
            let start = index * DENSE_PIECE_BYTES;
            piece.copy_from_slice(&tensor.values[start..start + piece.len()]);
            tensor.values.release(start..start + piece.len());
        }
        return Ok(());
    }
    with_width!(tensor.width(), W => scatter::<W>(tensor, target, decoded))
        .map_err(|message| tensor.format_error(message))
}

#[inline(always)]
fn prefetch(target: &[u8], at: usize) {
    #[cfg(target_arch = "x86_64")]
    if let Some(byte) = target.get(at) {
        // SAFETY: a prefetch is only a hint; the address is inside `target`, and SSE is baseline on x86_64.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(std::ptr::from_ref(byte).cast())
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (target, at);
}

fn scatter<const W: usize>(
    tensor: &TensorDelta,
    target: &mut [u8],
    decoded: Option<&ContextChanges>,
) -> std::result::Result<(), String> {
    scatter_with::<W>(tensor, target, decoded, |_, _| {})
}

/// Adds a tensor's changes to `target` batch by batch: each batch is written while the next one is decoded and its
/// lines prefetched. `before_write(positions, target)` runs before each non-empty batch is written.
fn scatter_with<const W: usize>(
    tensor: &TensorDelta,
    target: &mut [u8],
    decoded: Option<&ContextChanges>,
    mut before_write: impl FnMut(&[u64], &mut [u8]),
) -> std::result::Result<(), String> {
    let codec = tensor.values_codec;
    let (mut held_positions, mut held_values, mut held) = ([0u64; BATCH], [0u64; BATCH], 0usize);
    let mut write = |positions: &[u64], values: &[u64], target: &mut [u8]| {
        if !positions.is_empty() {
            before_write(positions, target);
        }
        for (&position, &value) in positions.iter().zip(values) {
            let at = position as usize * W;
            values::apply::<W>(&mut target[at..at + W], codec, value);
        }
    };
    tensor.for_each_batch(decoded, |positions, values| {
        for &position in positions {
            prefetch(target, position as usize * W);
        }
        write(&held_positions[..held], &held_values[..held], target);
        held = positions.len();
        held_positions[..held].copy_from_slice(positions);
        held_values[..held].copy_from_slice(values);
    })?;
    write(&held_positions[..held], &held_values[..held], target);
    Ok(())
}

/// Refuses an index out of range, a tensor named twice, and a target that cannot take its tensor's changes.
fn check_targets(delta: &Delta, targets: &[(usize, &mut [u8])]) -> Result<()> {
    let mut seen = vec![false; delta.tensors.len()];
    for (index, target) in targets {
        let tensor = delta
            .tensors
            .get(*index)
            .ok_or_else(|| Error::invalid(format!("no tensor number {index} in this delta")))?;
        if std::mem::replace(&mut seen[*index], true) {
            return Err(Error::invalid(format!("tensor {:?} given twice", tensor.name)));
        }
        check_target(tensor, tensor.dtype, None, target.len())?;
    }
    Ok(())
}

/// Applies the tensors named by index to their targets, in parallel, after checking every target; all or nothing.
///
/// Tensors whose streams were checked at load cannot fail once their targets are checked. Those loaded with the
/// check left to the apply (`TensorDelta::unchecked`) are written first, each change counted, and should one of
/// them turn out malformed, the changes written to all of them are taken back before the error is returned (they
/// are differences, added modulo 2^bits: subtracting them restores the bits exactly), and nothing else is written.
pub fn apply(delta: &Delta, targets: Vec<(usize, &mut [u8])>) -> Result<()> {
    check_targets(delta, &targets)?;
    let (mut unchecked, mut rest): (Vec<_>, Vec<_>) =
        targets.into_iter().partition(|(index, _)| delta.tensors[*index].unchecked);
    largest_first(delta, &mut rest);
    // `context` tensors are decoded (and checked) before anything is written.
    let decoded = decode_context(delta, &rest)?;
    write_or_take_back(delta, &mut unchecked)?;
    write_decoded(delta, rest, decoded)
}

/// Writes tensors whose changes are differences in parallel, counting the changes written to each; should any
/// stream turn out malformed, takes back every change written to all of them and returns the first error.
fn write_or_take_back(delta: &Delta, targets: &mut [(usize, &mut [u8])]) -> Result<()> {
    largest_first(delta, targets);
    let outcomes: Vec<(u64, std::result::Result<(), String>)> = crate::core::pool::install(|| {
        targets
            .par_iter_mut()
            .map(|(index, target)| {
                let tensor = &delta.tensors[*index];
                debug_assert!(tensor.values_codec.holds_differences() && !tensor.needs_base());
                let mut written = 0u64;
                let result = with_width!(tensor.width(), W => scatter_with::<W>(tensor, target, None, |positions, _| {
                    written += positions.len() as u64;
                }));
                (written, result)
            })
            .collect()
    });
    let failure = targets.iter().zip(&outcomes).find_map(|((index, _), (_, result))| {
        let message = result.as_ref().err()?;
        Some(delta.tensors[*index].format_error(message))
    });
    if let Some(error) = failure {
        take_back(delta, targets, outcomes.iter().map(|(written, _)| *written).collect());
        return Err(error);
    }
    Ok(())
}

/// Takes back the first `written[i]` changes written to `targets[i]`, in parallel (`unscatter`).
fn take_back(delta: &Delta, targets: &mut [(usize, &mut [u8])], written: Vec<u64>) {
    crate::core::pool::install(|| {
        targets.par_iter_mut().zip(written).for_each(|((index, target), count)| {
            let tensor = &delta.tensors[*index];
            with_width!(tensor.width(), W => unscatter::<W>(tensor, target, count));
        });
    });
}

/// Sorts targets by their tensor's changes, largest first, so the biggest tensor does not start last and leave one
/// thread working alone.
fn largest_first(delta: &Delta, targets: &mut [(usize, &mut [u8])]) {
    targets.sort_by_key(|(index, _)| std::cmp::Reverse(delta.tensors[*index].changed));
}

/// `apply` for targets that must each hold the exact base their tensor was made against (its record's `base`,
/// docs/format.md §3.1), else a BaseMismatch naming the first such tensor, with every target as it was.
///
/// A tensor whose changes are differences is hashed while it is written: each base identity block is hashed just
/// before the first change inside it is added, while the block is being brought into cache for those writes, so
/// the check costs no read of its own. Should a tensor turn out not to hold its base, the differences already
/// added to every such tensor are subtracted again (exactly: they were added modulo 2^bits) before the error is
/// returned, and nothing else has been written yet. Other tensors with a base (new values, `context` positions)
/// are checked before anything is written, as `base::check_bases` does.
///
/// With `digest`, each tensor hashed while written is also hashed after it, for the state digest
/// (core::digest::tensor_hasher: a block once its last change is written, while still in cache): returned as
/// (tensor index, hash) for those tensors whose record has a shape, so that a caller checking the state's digest
/// need not read them again.
pub fn apply_checked(delta: &Delta, targets: Vec<(usize, &mut [u8])>, digest: bool) -> Result<Vec<(usize, u128)>> {
    check_targets(delta, &targets)?;
    // Tensors whose streams are checked only as they are decoded are written the same way, hashed or not, so that
    // a malformed stream takes back their writes too.
    let (mut hashed, mut rest): (Vec<_>, Vec<_>) = targets.into_iter().partition(|(index, _)| {
        let tensor = &delta.tensors[*index];
        hashed_while_written(tensor) || tensor.unchecked
    });
    // `context` tensors are checked when their changes are decoded (below), before any write.
    let before: Vec<(usize, &[u8])> = rest
        .iter()
        .filter(|(index, _)| !delta.tensors[*index].needs_base())
        .map(|(index, target)| (*index, &**target))
        .collect();
    base::check_bases(delta, &before)?;
    drop(before);
    largest_first(delta, &mut rest);
    // `context` tensors' bases too, as their changes are decoded: all before the first write.
    let decoded = decode_context(delta, &rest)?;
    largest_first(delta, &mut hashed);
    let outcomes: Vec<Hashed> = crate::core::pool::install(|| {
        hashed
            .par_iter_mut()
            .map(|(index, target)| {
                let tensor = &delta.tensors[*index];
                let after = digest.then(|| tensor.shape.as_ref().map(|s| digest::tensor_hasher(tensor.dtype, s)));
                with_width!(tensor.width(), W => scatter_hashing::<W>(tensor, target, after.flatten()))
            })
            .collect()
    });
    let failure = hashed.iter().zip(&outcomes).find_map(|((index, _), outcome)| {
        let tensor = &delta.tensors[*index];
        match &outcome.result {
            Err(message) => Some(tensor.format_error(message)),
            Ok(found) => base::check_identity(tensor, *found).err(),
        }
    });
    if let Some(error) = failure {
        take_back(delta, &mut hashed, outcomes.iter().map(|outcome| outcome.written).collect());
        return Err(error);
    }
    write_decoded(delta, rest, decoded)?;
    Ok(hashed.iter().zip(outcomes).filter_map(|((index, _), outcome)| Some((*index, outcome.digest?))).collect())
}

/// True for a tensor `apply_checked` hashes while it writes it: one whose changes are differences (so that they
/// can be taken back exactly), against a recorded base, and whose positions do not need the base to decode.
fn hashed_while_written(tensor: &TensorDelta) -> bool {
    tensor.base.is_some() && tensor.values_codec.holds_differences() && !tensor.needs_base()
}

/// What `scatter_hashing` did to one target: how many changes it added, the base identity it found (or why it
/// stopped), and its hash for the state digest when asked.
struct Hashed {
    written: u64,
    result: std::result::Result<u64, String>,
    digest: Option<u128>,
}

/// `scatter` of a tensor whose values are differences, hashing the target's base identity blocks on the way when
/// the tensor records a base: each block is hashed before any change inside it is added, the rest after the last
/// change (without a base, the identity found is 0). With `after`, the tensor's digest hasher, each block is fed
/// to it once no change is left to write inside it.
fn scatter_hashing<const W: usize>(tensor: &TensorDelta, target: &mut [u8], mut after: Option<digest::Xxh3>) -> Hashed {
    debug_assert!(tensor.values_codec.holds_differences());
    let hash = tensor.base.is_some();
    let blocks = target.len().div_ceil(base::BLOCK_BYTES);
    let mut hashes: Vec<u64> = Vec::with_capacity(if hash { blocks } else { 0 });
    let hash_until = |hashes: &mut Vec<u64>, target: &[u8], end_block: usize| {
        while hash && hashes.len() < end_block {
            let start = hashes.len() * base::BLOCK_BYTES;
            hashes.push(base::block_hash(&target[start..(start + base::BLOCK_BYTES).min(target.len())]));
        }
    };
    let mut digested = 0usize; // blocks fed to `after`
    let mut digest_until = |after: &mut Option<digest::Xxh3>, target: &[u8], end_block: usize| {
        if let Some(hasher) = after.as_mut() {
            if end_block > digested {
                hasher.update(&target[digested * base::BLOCK_BYTES..(end_block * base::BLOCK_BYTES).min(target.len())]);
                digested = end_block;
            }
        }
    };
    let mut written = 0u64;
    let walked = scatter_with::<W>(tensor, target, None, |positions, target| {
        let (first, last) = (positions[0] as usize, positions[positions.len() - 1] as usize);
        // Positions ascend: blocks before the first one's have had all their changes.
        digest_until(&mut after, target, first * W / base::BLOCK_BYTES);
        hash_until(&mut hashes, target, last * W / base::BLOCK_BYTES + 1);
        written += positions.len() as u64;
    });
    let result = walked.map(|()| {
        hash_until(&mut hashes, target, blocks);
        if hash {
            base::combine(&hashes)
        } else {
            0
        }
    });
    digest_until(&mut after, target, blocks);
    let digest = result.is_ok().then(|| after.map(|hasher| hasher.digest128())).flatten();
    Hashed { written, result, digest }
}

/// Takes back the first `count` changes `scatter_hashing` added to `target` (differences: subtracted modulo
/// 2^bits, which restores the bits exactly).
fn unscatter<const W: usize>(tensor: &TensorDelta, target: &mut [u8], count: u64) {
    let mut left = count;
    // The same walk that wrote them, so it cannot fail before `count` changes.
    let _ = tensor.for_each_batch(None, |positions, values| {
        for (&position, &value) in positions.iter().zip(values) {
            if left == 0 {
                return;
            }
            let at = position as usize * W;
            let bits = elements::load_const::<W>(&target[at..]).wrapping_sub(value);
            elements::store_const::<W>(&mut target[at..at + W], bits);
            left -= 1;
        }
    });
}

/// The changes of the `context` tensors among `targets`, decoded from the targets before anything is written (each
/// checked to hold the exact base first), so that a wrong base or a bad stream leaves every target as it was.
fn decode_context(delta: &Delta, targets: &[(usize, &mut [u8])]) -> Result<Vec<Option<ContextChanges>>> {
    crate::core::pool::install(|| {
        targets.par_iter().map(|(index, target)| delta.tensors[*index].context_changes(target)).collect()
    })
}

/// Writes `targets`, their `context` changes decoded beforehand (`decode_context`), in parallel.
fn write_decoded(delta: &Delta, targets: Vec<(usize, &mut [u8])>, decoded: Vec<Option<ContextChanges>>) -> Result<()> {
    crate::core::pool::install(|| {
        targets
            .into_par_iter()
            .zip(decoded)
            .try_for_each(|((index, target), decoded)| apply_tensor(&delta.tensors[index], target, decoded.as_ref()))
    })
}

/// Decodes one tensor into flat int64 positions and `width`-byte values (new bits for `abs`, the
/// wrapping difference for `diff`), both little-endian, into buffers of exactly the right size.
/// Dense tensors walk every position; callers usually copy their values whole instead. A `context` tensor needs
/// `base`, its bytes before the change (checked against the record's base identity).
pub fn decode_into(
    tensor: &TensorDelta,
    base: Option<&[u8]>,
    positions_out: &mut [u8],
    values_out: &mut [u8],
) -> Result<()> {
    let width = tensor.width();
    let count = tensor.changed as usize;
    if positions_out.len() != count * 8 || values_out.len() != count * width {
        return Err(Error::invalid(format!("tensor {:?}: decode buffers have the wrong size", tensor.name)));
    }
    let decoded = match base {
        Some(base) => tensor.context_changes(base)?,
        None => None,
    };
    let mut k = 0usize;
    tensor
        .for_each_change_on(decoded.as_ref(), |position, value| {
            positions_out[k * 8..k * 8 + 8].copy_from_slice(&(position as i64).to_le_bytes());
            elements::store(&mut values_out[k * width..], value, width);
            k += 1;
        })
        .map_err(|message| tensor.format_error(message))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::codec::{Codec, ValueCodec};
    use crate::core::diff::{diff, DiffInput};
    use crate::core::dtype::Dtype;

    #[test]
    fn diff_then_apply_restores_new() {
        let old: Vec<u8> = (0..4000u32).flat_map(|i| (i.wrapping_mul(2654435761)).to_le_bytes()).collect();
        let mut new = old.clone();
        for i in (0..new.len()).step_by(37) {
            new[i] ^= 0x5a;
        }
        for codec in [ValueCodec::Abs, ValueCodec::Diff] {
            let tensors = diff(
                &[DiffInput { name: "w".into(), dtype: Dtype::F32, shape: vec![40, 100], old: &old, new: &new }],
                codec,
                Codec::Varint,
            )
            .unwrap();
            let delta = Delta { tensors, ..Default::default() };
            let mut target = old.clone();
            apply(&delta, vec![(0, &mut target[..])]).unwrap();
            assert_eq!(target, new, "{codec:?}");
        }
    }

    /// A compact delta of three tensors loaded with its checks left to the apply, the last value stream cut
    /// short (or a byte of the first position stream changed): `apply` and `apply_checked` (with and without base
    /// identities) fail naming the tensor, having taken back what they wrote to every target; whole, both apply.
    #[test]
    fn streams_checked_by_the_apply_are_taken_back_when_malformed() {
        let mut next = crate::core::testing::xorshift(11);
        let sizes = [70_000usize, 5_000, 30_000];
        let olds: Vec<Vec<u8>> = sizes.iter().map(|&n| (0..2 * n).map(|_| next() as u8).collect()).collect();
        let mut news = olds.clone();
        for (t, new) in news.iter_mut().enumerate() {
            for i in (0..new.len() / 2).step_by(37 + 11 * t) {
                new[2 * i] = new[2 * i].wrapping_add(if i % 3 == 0 { 2 } else { 1 });
            }
        }
        let inputs: Vec<DiffInput> = (0..3)
            .map(|t| DiffInput {
                name: format!("t{t}"),
                dtype: Dtype::BF16,
                shape: vec![sizes[t] as u64],
                old: &olds[t],
                new: &news[t],
            })
            .collect();
        let written = Delta {
            tensors: diff(&inputs, ValueCodec::Diff, Codec::Compact).unwrap(),
            packed: true,
            ..Default::default()
        };
        assert!(written.tensors.iter().all(TensorDelta::check_can_wait), "rice positions, bit-packed differences");
        let bytes = crate::core::format::to_bytes(&written).unwrap();
        let read = |bytes: Vec<u8>| {
            crate::core::format::read_checked(
                std::sync::Arc::new(crate::core::stream::Backing::Owned(bytes)),
                "t",
                true,
            )
        };
        // `delta` applied to fresh copies of `olds` with and without base identities, by `apply` and by
        // `apply_checked`: (bases, checked, result, targets after) for each.
        let outcomes = |delta: &Delta| {
            let mut out = Vec::new();
            for bases in [true, false] {
                let mut delta = delta.clone();
                delta.tensors.iter_mut().filter(|_| !bases).for_each(|t| t.base = None);
                for checked in [false, true] {
                    let mut targets = olds.clone();
                    let slices = targets.iter_mut().enumerate().map(|(i, t)| (i, &mut t[..])).collect();
                    let result =
                        if checked { apply_checked(&delta, slices, false).map(|_| ()) } else { apply(&delta, slices) };
                    out.push((bases, checked, result, targets));
                }
            }
            out
        };
        let whole = read(bytes.clone()).unwrap();
        assert!(whole.tensors.iter().all(|t| t.unchecked && t.last_position.is_none()));
        for (bases, checked, result, targets) in outcomes(&whole) {
            result.unwrap();
            assert_eq!(targets, news, "bases {bases} checked {checked}");
        }
        // The last tensor's value stream ends the packed streams: drop its last byte and the header still reads.
        let mut broken = read(bytes).unwrap();
        let last = broken.tensors.len() - 1;
        let values = broken.tensors[last].values.to_vec();
        broken.tensors[last].values = values[..values.len() - 1].to_vec().into();
        let mut flipped = whole.clone();
        let positions = flipped.tensors[0].positions.to_vec();
        flipped.tensors[0].positions =
            positions.iter().enumerate().map(|(i, b)| if i == 40 { !b } else { *b }).collect::<Vec<u8>>().into();
        for (delta, name) in [(&broken, "t2"), (&flipped, "t0")] {
            for (bases, checked, result, targets) in outcomes(delta) {
                match result {
                    Err(Error::Format { message, .. }) => {
                        assert!(message.contains(&format!("\"{name}\"")), "{message}")
                    }
                    other => panic!("{name} bases {bases} checked {checked}: {other:?}"),
                }
                assert_eq!(targets, olds, "{name} bases {bases} checked {checked}: left changed");
            }
        }
    }

    /// Three tensors (one over several base identity blocks, one stored whole, one of new values) through
    /// `apply_checked`: the new state when every target is its base; otherwise a BaseMismatch naming the first
    /// wrong tensor and every target as it was, wherever the wrong byte lies.
    #[test]
    fn apply_checked_is_all_or_nothing() {
        let mut next = crate::core::testing::xorshift(7);
        let sizes = [3 * base::BLOCK_BYTES + 10, 64, 4000];
        let olds: Vec<Vec<u8>> = sizes.iter().map(|&n| (0..n).map(|_| next() as u8).collect()).collect();
        let mut news = olds.clone();
        for i in (0..sizes[0]).step_by(997) {
            news[0][i] = news[0][i].wrapping_add(1);
        }
        news[1].iter_mut().for_each(|b| *b ^= 0xff); // every byte: stored whole
        news[2][100] ^= 1;
        for codec in [Codec::Varint, Codec::Compact] {
            let mut tensors = Vec::new();
            for (i, values) in [ValueCodec::Diff, ValueCodec::Diff, ValueCodec::Abs].into_iter().enumerate() {
                let input = DiffInput {
                    name: format!("t{i}"),
                    dtype: Dtype::U8,
                    shape: vec![sizes[i] as u64],
                    old: &olds[i],
                    new: &news[i],
                };
                tensors.extend(diff(&[input], values, codec).unwrap());
            }
            assert!(tensors[1].is_dense() && tensors[1].base.is_none());
            assert!(hashed_while_written(&tensors[0]) && !hashed_while_written(&tensors[2]));
            let delta = Delta { tensors, ..Default::default() };
            let run = |targets: &mut Vec<Vec<u8>>| {
                let slices = targets.iter_mut().enumerate().map(|(i, t)| (i, &mut t[..])).collect();
                apply_checked(&delta, slices, false).map(|_| ())
            };
            let mut targets = olds.clone();
            run(&mut targets).unwrap();
            assert_eq!(targets, news, "{codec:?}");
            assert!(matches!(run(&mut targets), Err(Error::BaseMismatch { .. })), "applied twice");
            assert_eq!(targets, news, "{codec:?}: taken back after a second application");
            for (tensor, at) in [(0, 0), (0, 5), (0, sizes[0] - 1), (0, 2 * base::BLOCK_BYTES), (2, 7)] {
                let mut targets = olds.clone();
                targets[tensor][at] ^= 0x10;
                let before = targets.clone();
                match run(&mut targets) {
                    Err(Error::BaseMismatch { message }) => assert!(message.contains(&format!("\"t{tensor}\""))),
                    other => panic!("{codec:?} byte {at} of t{tensor}: {other:?}"),
                }
                assert_eq!(targets, before, "{codec:?} byte {at} of t{tensor}: left changed");
            }
        }
    }

    /// The hashes `apply_checked` returns for the state digest are those of the targets after the write, whatever
    /// blocks the changes fall in.
    #[test]
    fn apply_checked_hashes_the_written_state() {
        let mut next = crate::core::testing::xorshift(11);
        let n = 2 * base::BLOCK_BYTES + 6; // u16 elements: the last block is cut
        let old: Vec<u8> = (0..2 * n).map(|_| next() as u8).collect();
        for changed in [vec![0usize], vec![n - 1], vec![3, base::BLOCK_BYTES / 2, n - 2], (0..n).step_by(500).collect()]
        {
            let mut new = old.clone();
            for &i in &changed {
                new[2 * i] = new[2 * i].wrapping_add(1);
            }
            for codec in [Codec::Varint, Codec::Compact] {
                let input = DiffInput {
                    name: "w".into(),
                    dtype: Dtype::BF16,
                    shape: vec![2, n as u64 / 2],
                    old: &old,
                    new: &new,
                };
                let delta = Delta { tensors: diff(&[input], ValueCodec::Diff, codec).unwrap(), ..Default::default() };
                let mut target = old.clone();
                let hashes = apply_checked(&delta, vec![(0, &mut target[..])], true).unwrap();
                assert_eq!(target, new);
                let expected = digest::tensor_hashes(&[digest::DigestInput {
                    name: "w",
                    dtype: Dtype::BF16,
                    shape: &[2, n as u64 / 2],
                    data: &new,
                }]);
                assert_eq!(
                    hashes,
                    vec![(0, expected[0])],
                    "{codec:?}, changes at {:?}",
                    &changed[..changed.len().min(3)]
                );
                let mut again = old.clone();
                assert!(apply_checked(&delta, vec![(0, &mut again[..])], false).unwrap().is_empty());
            }
        }
    }

    #[test]
    fn rejects_wrong_size_target_untouched() {
        let old = vec![0u8; 8];
        let mut new = old.clone();
        new[2] = 9;
        let tensors = diff(
            &[DiffInput { name: "w".into(), dtype: Dtype::BF16, shape: vec![4], old: &old, new: &new }],
            ValueCodec::Diff,
            Codec::Varint,
        )
        .unwrap();
        let delta = Delta { tensors, ..Default::default() };
        let mut small = vec![0u8; 6];
        assert!(matches!(apply(&delta, vec![(0, &mut small[..])]), Err(Error::BaseMismatch { .. })));
        assert_eq!(small, vec![0u8; 6]);
    }

    fn three_tensors() -> Delta {
        let old = vec![0u8; 8];
        let mut new = old.clone();
        new[2] = 9;
        let inputs: Vec<DiffInput<'_>> = ["a", "b", "c"]
            .iter()
            .map(|name| DiffInput { name: (*name).into(), dtype: Dtype::BF16, shape: vec![4], old: &old, new: &new })
            .collect();
        Delta { tensors: diff(&inputs, ValueCodec::Diff, Codec::Varint).unwrap(), ..Default::default() }
    }

    #[test]
    fn overlapping_targets_are_refused_by_name() {
        let delta = three_tensors();
        check_disjoint(&delta, &[(0, 100, 8), (1, 108, 8), (2, 92, 8)]).unwrap();
        check_disjoint(&delta, &[(0, 100, 0), (1, 100, 8), (2, 100, 0)]).unwrap(); // empty targets overlap nothing
        let error = check_disjoint(&delta, &[(0, 100, 8), (1, 120, 8), (2, 107, 2)]).unwrap_err().to_string();
        assert!(error.contains("\"c\" overlaps the target of tensor \"a\""), "{error}");
    }

    #[test]
    fn extend_refuses_duplicates_before_adding_any() {
        let mut delta = three_tensors();
        let again = three_tensors().tensors;
        assert!(delta.extend(vec![again[2].clone()]).is_err());
        let mut fresh = Delta::default();
        let twice = vec![again[0].clone(), again[1].clone(), again[0].clone()];
        assert!(fresh.extend(twice).unwrap_err().to_string().contains("\"a\" is already"));
        assert!(fresh.tensors.is_empty());
        assert!(delta.tensors[0].same_changes(&again[1]) && delta.tensors.len() == 3);
    }

    // Pins `&& self.numel().is_some()` in `TensorDelta::check_can_wait`
    // (src/core/delta.rs): a `rice` tensor whose record has no shape must be checked at load even with `defer`, so that
    // its last position is known and `check_target` refuses a target too short for it. Left to the apply, nothing
    // bounds its positions (the element count is taken as u64::MAX) and the scatter indexes past the target: a panic.
    #[test]
    fn a_tensor_of_unknown_shape_is_checked_at_load_and_bounded_by_its_target() {
        let old: Vec<u8> = vec![0; 2 * 1000];
        let mut new = old.clone();
        for i in (0..1000).step_by(7) {
            new[2 * i] = 1;
        }
        let input = DiffInput { name: "w".into(), dtype: Dtype::BF16, shape: vec![1000], old: &old, new: &new };
        let mut tensor = diff(&[input], ValueCodec::Diff, Codec::Compact).unwrap().remove(0);
        assert!(tensor.check_can_wait(), "rice positions, differences, a known shape");
        tensor.shape = None;
        assert!(!tensor.check_can_wait(), "without a shape nothing bounds the positions an apply decodes");
        tensor.validate("mem", true).unwrap();
        assert!(!tensor.unchecked);
        assert_eq!(tensor.last_position, Some(994));
        refused_untouched(tensor, 500);
    }

    // Pins `last >= elements` in `check_target`: for a tensor whose record
    // has no shape (a TRL import, or `"shape": null`), the only bound on its positions is the target's length; with
    // `last > elements` a target exactly one element too short is accepted and the scatter writes past it (a panic).
    #[test]
    fn a_target_one_element_short_of_the_last_position_is_refused_when_the_shape_is_unknown() {
        let old: Vec<u8> = vec![0; 2 * 1000];
        let mut new = old.clone();
        new[2 * 10] = 1;
        new[2 * 999] = 1;
        let input = DiffInput { name: "w".into(), dtype: Dtype::BF16, shape: vec![1000], old: &old, new: &new };
        let mut tensor = diff(&[input], ValueCodec::Diff, Codec::Varint).unwrap().remove(0);
        tensor.shape = None;
        tensor.validate("mem", false).unwrap();
        assert_eq!(tensor.last_position, Some(999));
        assert!(check_target(&tensor, Dtype::BF16, None, 2 * 1000).is_ok());
        assert!(check_target(&tensor, Dtype::BF16, None, 2 * 999).is_err(), "position 999 of 999 elements");
        refused_untouched(tensor, 999);
    }

    /// Applies the BF16 `tensor` to a zeroed target of `elements` elements, too short for its positions: refused
    /// with an error (not a panic writing past it), and nothing written.
    fn refused_untouched(tensor: TensorDelta, elements: usize) {
        let delta = Delta { tensors: vec![tensor], ..Default::default() };
        let mut short = vec![0u8; 2 * elements];
        let result =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| apply(&delta, vec![(0, &mut short[..])])));
        assert!(matches!(result, Ok(Err(_))), "a target too short for the positions is refused, not overrun");
        assert!(short.iter().all(|&b| b == 0), "nothing written");
    }
}
