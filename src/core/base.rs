//! Base identities (docs/format.md §3): a 64-bit hash of a tensor's bytes before a change, which a delta records
//! so that it is never applied to another base, or twice.
//!
//! The bytes are hashed in blocks of `BLOCK_BYTES` (XXH3-64 each), and the identity is the XXH3-64 of the block
//! hashes, little-endian: blocks can be hashed in parallel, or by the diff's scan as it compares them (core::xxh3).

use std::hash::Hasher;

use rayon::prelude::*;
use twox_hash::XxHash3_64;

use crate::core::apply::check_target;
use crate::core::delta::{Delta, TensorDelta};
use crate::core::error::{Error, Result};

/// Bytes per hashed block; the last block of a tensor may be shorter.
pub const BLOCK_BYTES: usize = 1 << 18;

/// The hash of one block.
pub fn block_hash(block: &[u8]) -> u64 {
    XxHash3_64::oneshot(block)
}

/// The identity of a tensor from the hashes of its blocks, in order.
pub fn combine(block_hashes: &[u64]) -> u64 {
    let mut hasher = XxHash3_64::new();
    for hash in block_hashes {
        hasher.write(&hash.to_le_bytes());
    }
    hasher.finish()
}

/// The hash of each block of `bytes` (the last one may be shorter; none for no bytes), in order, hashed in
/// parallel in the deltasync pool: `combine` of them is the identity of `bytes`. Readers that each hold part of a
/// tensor hash the blocks they hold whole this way and combine everyone's.
pub fn block_hashes(bytes: &[u8]) -> Vec<u64> {
    if bytes.len() <= BLOCK_BYTES {
        bytes.chunks(BLOCK_BYTES).map(block_hash).collect()
    } else {
        crate::core::pool::install(|| bytes.par_chunks(BLOCK_BYTES).map(block_hash).collect())
    }
}

/// The identity of `bytes`, its blocks hashed in parallel in the deltasync pool.
pub fn identity(bytes: &[u8]) -> u64 {
    combine(&block_hashes(bytes))
}

/// The identities of several runs of bytes at once, as `identity` of each: all their blocks are hashed side by side
/// in the deltasync pool, so that many small runs (a model's tensors, or their shards) keep every core busy.
pub fn identities(runs: &[&[u8]]) -> Vec<u64> {
    runs_block_hashes(runs).iter().map(|hashes| combine(hashes)).collect()
}

/// `block_hashes` of several runs of bytes at once, all their blocks hashed side by side in the deltasync pool.
pub fn runs_block_hashes(runs: &[&[u8]]) -> Vec<Vec<u64>> {
    let blocks: Vec<&[u8]> = runs.iter().flat_map(|run| run.chunks(BLOCK_BYTES)).collect();
    let hashes: Vec<u64> = crate::core::pool::install(|| blocks.par_iter().map(|block| block_hash(block)).collect());
    let mut at = 0;
    runs.iter()
        .map(|run| {
            let count = run.len().div_ceil(BLOCK_BYTES);
            at += count;
            hashes[at - count..at].to_vec()
        })
        .collect()
}

/// The identity of the concatenation of `pieces` (any lengths, empty ones included), as `identity` of their
/// bytes laid end to end, without laying them out: a block that lies in one piece is hashed where it is, one cut
/// by a piece boundary is gathered first. Blocks are hashed in parallel in the deltasync pool.
pub fn identity_of_pieces(pieces: &[&[u8]]) -> u64 {
    let total: usize = pieces.iter().map(|piece| piece.len()).sum();
    combine(&block_hashes_of_pieces(pieces, 0..total.div_ceil(BLOCK_BYTES)))
}

/// The hashes of blocks `blocks` (by index) of the concatenation of `pieces`, as `identity_of_pieces` hashes them,
/// in parallel in the deltasync pool when there are several: a caller can hash a long run a window at a time.
pub fn block_hashes_of_pieces(pieces: &[&[u8]], blocks: std::ops::Range<usize>) -> Vec<u64> {
    let mut starts = Vec::with_capacity(pieces.len());
    let mut total = 0usize;
    for piece in pieces {
        starts.push(total);
        total += piece.len();
    }
    let hash = |block: usize| -> u64 {
        let begin = block * BLOCK_BYTES;
        let end = (begin + BLOCK_BYTES).min(total);
        // The last piece starting at or before `begin` holds it (an empty one there is followed by the one that does).
        let first = starts.partition_point(|&start| start <= begin) - 1;
        let offset = begin - starts[first];
        if offset + (end - begin) <= pieces[first].len() {
            return block_hash(&pieces[first][offset..offset + (end - begin)]);
        }
        let mut gathered = Vec::with_capacity(end - begin);
        gathered.extend_from_slice(&pieces[first][offset..]);
        for piece in &pieces[first + 1..] {
            let take = piece.len().min(end - begin - gathered.len());
            gathered.extend_from_slice(&piece[..take]);
            if gathered.len() == end - begin {
                break;
            }
        }
        block_hash(&gathered)
    };
    if blocks.len() <= 1 {
        blocks.map(hash).collect()
    } else {
        crate::core::pool::install(|| blocks.into_par_iter().map(hash).collect())
    }
}

/// An identity as written in a record: 16 lowercase hex digits.
pub fn to_hex(identity: u64) -> String {
    format!("{identity:016x}")
}

/// Parses a record's `base`: exactly 16 lowercase hex digits.
pub fn parse_hex(text: &str) -> Option<u64> {
    let valid = text.len() == 16 && text.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    valid.then(|| u64::from_str_radix(text, 16).ok()).flatten()
}

/// The identity of a tensor read in consecutive pieces of any length: full blocks are hashed as they come, a
/// block cut by a piece boundary is kept until the next piece completes it.
#[derive(Default)]
pub struct BlockHasher {
    hashes: Vec<u64>,
    partial: Vec<u8>,
    consumed: u64,
}

impl BlockHasher {
    /// Bytes taken so far.
    pub fn consumed(&self) -> u64 {
        self.consumed
    }

    /// How many bytes at the start of the next piece complete the block cut by the previous one (0 if none was cut).
    pub fn head_len(&self) -> usize {
        (BLOCK_BYTES - self.consumed as usize % BLOCK_BYTES) % BLOCK_BYTES
    }

    /// Takes the next bytes, any number of them.
    pub fn take(&mut self, mut piece: &[u8]) {
        self.consumed += piece.len() as u64;
        if !self.partial.is_empty() {
            let fill = piece.len().min(BLOCK_BYTES - self.partial.len());
            self.partial.extend_from_slice(&piece[..fill]);
            piece = &piece[fill..];
            if self.partial.len() < BLOCK_BYTES {
                return;
            }
            self.hashes.push(block_hash(&self.partial));
            self.partial.clear();
        }
        let whole = piece.len() / BLOCK_BYTES * BLOCK_BYTES;
        self.hashes.extend(piece[..whole].chunks(BLOCK_BYTES).map(block_hash));
        self.partial.extend_from_slice(&piece[whole..]);
    }

    /// Takes the hashes of `bytes` full blocks hashed elsewhere (`hashes`), at a block boundary (none at all may
    /// come while a block is still cut, as after a chunk too short to complete it).
    pub fn take_hashed(&mut self, hashes: &[u64], bytes: usize) {
        debug_assert!(bytes == hashes.len() * BLOCK_BYTES && (hashes.is_empty() || self.partial.is_empty()));
        self.hashes.extend_from_slice(hashes);
        self.consumed += bytes as u64;
    }

    /// The identity of everything taken.
    pub fn finish(mut self) -> u64 {
        if !self.partial.is_empty() {
            self.hashes.push(block_hash(&self.partial));
        }
        combine(&self.hashes)
    }
}

pub(crate) fn mismatch(tensor: &TensorDelta, expected: u64, found: u64) -> Error {
    Error::mismatch(format!(
        "tensor {:?}: the target is not the base this delta was made for (base identity {} expected, {} found); \
         was it applied already, or to another step?",
        tensor.name,
        to_hex(expected),
        to_hex(found)
    ))
}

/// Checks a target's identity (`found`, computed by the caller) against the record's `base`; a record without
/// one fits any base.
pub fn check_identity(tensor: &TensorDelta, found: u64) -> Result<()> {
    match tensor.base {
        Some(expected) if expected != found => Err(mismatch(tensor, expected, found)),
        _ => Ok(()),
    }
}

/// Checks that `target` is the base `tensor` was made for: its size fits, and its identity is the record's
/// `base` (a record without one fits any base).
pub fn check_base(tensor: &TensorDelta, target: &[u8]) -> Result<()> {
    check_target(tensor, tensor.dtype, None, target.len())?;
    match tensor.base {
        Some(_) => check_identity(tensor, identity(target)),
        None => Ok(()),
    }
}

/// `check_base` for the tensors named by index, in parallel; the error is that of the first failing target in
/// the order given.
pub fn check_bases(delta: &Delta, targets: &[(usize, &[u8])]) -> Result<()> {
    for (index, _) in targets {
        if *index >= delta.tensors.len() {
            return Err(Error::invalid(format!("no tensor number {index} in this delta")));
        }
    }
    let results: Vec<Result<()>> = crate::core::pool::install(|| {
        targets.par_iter().map(|&(index, target)| check_base(&delta.tensors[index], target)).collect()
    });
    results.into_iter().collect()
}

/// Checks that `next`, a delta read to follow the anchor `anchor`, was made against the tensors `anchor` holds:
/// for each record of `next` that names a base identity, `anchor` must hold a tensor of that name stored whole,
/// of the record's dtype and shape (checked from the header alone, for every record), and where `usable` accepts
/// that tensor (by its index in `anchor`: a reader that read the others only in part leaves them out) the
/// identity of its bytes must be the record's. A reader that has the anchor in hand can so refuse a wrong anchor
/// before writing anything, rather than applying it and the deltas after it. Returns how many records' bytes were
/// compared; the tensors are hashed side by side in the deltasync pool, and the error is that of the first mismatch
/// in `next`'s order.
pub fn check_follows(anchor: &Delta, next: &Delta, usable: impl Fn(usize) -> bool) -> Result<usize> {
    let by_name: std::collections::HashMap<&str, usize> =
        anchor.tensors.iter().enumerate().map(|(index, tensor)| (tensor.name.as_str(), index)).collect();
    let mut pairs = Vec::new();
    for record in next.tensors.iter().filter(|record| record.base.is_some()) {
        let Some(&index) = by_name.get(record.name.as_str()) else {
            return Err(Error::mismatch(format!(
                "tensor {:?}: the delta was made against a base of it, and the anchor holds no such tensor",
                record.name
            )));
        };
        let held = &anchor.tensors[index];
        if !held.is_dense() || held.dtype != record.dtype || (record.shape.is_some() && held.shape != record.shape) {
            return Err(Error::mismatch(format!(
                "tensor {:?}: the delta was made for a {} tensor of shape {:?}, and the anchor holds {} of shape {:?}{}",
                record.name,
                crate::core::dtype::name_of(record.dtype),
                record.shape.as_deref().unwrap_or_default(),
                crate::core::dtype::name_of(held.dtype),
                held.shape.as_deref().unwrap_or_default(),
                if held.is_dense() { "" } else { ", not stored whole" }
            )));
        }
        if usable(index) {
            pairs.push((record, &held.values[..]));
        }
    }
    let runs: Vec<&[u8]> = pairs.iter().map(|(_, bytes)| *bytes).collect();
    for ((record, _), found) in pairs.iter().zip(identities(&runs)) {
        if let Some(expected) = record.base.filter(|expected| *expected != found) {
            return Err(Error::mismatch(format!(
                "tensor {:?}: the delta was made against base identity {}, and the anchor holds {}",
                record.name,
                to_hex(expected),
                to_hex(found)
            )));
        }
    }
    Ok(pairs.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::codec::{Codec, ValueCodec};
    use crate::core::diff::{diff, DiffInput};
    use crate::core::dtype::Dtype;

    use xxhash_rust::xxh3::xxh3_64;

    /// The definition, literally (with a second XXH3 implementation): hash each block, concatenate the hashes
    /// little-endian, hash that.
    fn reference(bytes: &[u8]) -> u64 {
        let mut concatenated = Vec::new();
        for block in bytes.chunks(1 << 18) {
            concatenated.extend_from_slice(&xxh3_64(block).to_le_bytes());
        }
        xxh3_64(&concatenated)
    }

    fn bytes(len: usize, seed: u64) -> Vec<u8> {
        let mut next = crate::core::testing::xorshift(seed | 1);
        (0..len).map(|_| next() as u8).collect()
    }

    const SIZES: [usize; 6] = [0, 1, BLOCK_BYTES - 1, BLOCK_BYTES, BLOCK_BYTES + 1, 3 * BLOCK_BYTES + 5];

    #[test]
    fn identity_matches_the_definition() {
        for len in SIZES {
            let data = bytes(len, len as u64);
            assert_eq!(identity(&data), reference(&data), "{len} bytes");
        }
        assert_eq!(identity(&[]), xxh3_64(&[]));
    }

    #[test]
    fn block_hashes_are_each_blocks_hash_and_combine_to_the_identity() {
        for len in SIZES {
            let data = bytes(len, len as u64 + 7);
            let hashes = block_hashes(&data);
            let expected: Vec<u64> = data.chunks(1 << 18).map(xxh3_64).collect();
            assert_eq!(hashes, expected, "{len} bytes");
            assert_eq!(combine(&hashes), reference(&data), "{len} bytes");
        }
    }

    #[test]
    fn identity_of_pieces_matches_the_definition_of_their_concatenation() {
        let data = bytes(3 * BLOCK_BYTES + 5, 9);
        // Cuts inside blocks, on block boundaries, empty pieces, pieces spanning several blocks, a tiny tail.
        let cut_sets: [&[usize]; 6] = [
            &[],
            &[0, 0, 7],
            &[BLOCK_BYTES],
            &[1, BLOCK_BYTES - 1, BLOCK_BYTES, BLOCK_BYTES, 2 * BLOCK_BYTES + 3],
            &[5, 5, 5, 2 * BLOCK_BYTES, 3 * BLOCK_BYTES + 4, 3 * BLOCK_BYTES + 5, 3 * BLOCK_BYTES + 5],
            &[100, 200, 300, 400, 500],
        ];
        for cuts in cut_sets {
            let mut pieces: Vec<&[u8]> = Vec::new();
            let mut at = 0;
            for &cut in cuts.iter().chain([data.len()].iter()) {
                pieces.push(&data[at..cut]);
                at = cut;
            }
            assert_eq!(identity_of_pieces(&pieces), reference(&data), "cuts {cuts:?}");
        }
        assert_eq!(identity_of_pieces(&[]), xxh3_64(&[]));
        assert_eq!(identity_of_pieces(&[&[], &[]]), xxh3_64(&[]));
    }

    #[test]
    fn pieces_of_any_length_give_the_same_identity() {
        let data = bytes(3 * BLOCK_BYTES + 5, 7);
        for piece in [1usize, 1000, BLOCK_BYTES - 1, BLOCK_BYTES, BLOCK_BYTES + 3, 2 * BLOCK_BYTES + 11, data.len()] {
            let mut hasher = BlockHasher::default();
            for part in data.chunks(piece) {
                let head = hasher.head_len().min(part.len());
                hasher.take(&part[..head]);
                hasher.take(&part[head..]);
            }
            assert_eq!(hasher.consumed(), data.len() as u64);
            assert_eq!(hasher.finish(), reference(&data), "pieces of {piece}");
        }
    }

    #[test]
    fn identities_of_many_runs_are_each_runs_identity() {
        let data: Vec<u8> = (0..3 * BLOCK_BYTES + 77).map(|i| (i * 7 % 251) as u8).collect();
        let cuts = [0, 0, 5, BLOCK_BYTES, BLOCK_BYTES + 1, 2 * BLOCK_BYTES + 3, data.len()];
        let runs: Vec<&[u8]> = cuts.windows(2).map(|w| &data[w[0]..w[1]]).chain([&data[..]]).collect();
        let want: Vec<u64> = runs.iter().map(|run| identity(run)).collect();
        assert_eq!(identities(&runs), want);
        assert_eq!(identities(&[]), Vec::<u64>::new());
    }

    #[test]
    fn hex_is_sixteen_lowercase_digits() {
        assert_eq!(to_hex(0x0123_4567_89ab_cdef), "0123456789abcdef");
        assert_eq!(parse_hex("0123456789abcdef"), Some(0x0123_4567_89ab_cdef));
        for bad in
            ["0123456789ABCDEF", "0123456789abcde", "0123456789abcdef0", "0123456789abcdeg", "+123456789abcdef", ""]
        {
            assert_eq!(parse_hex(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn diff_bases_are_checked_for_every_size_and_width() {
        for (dtype, width) in [(Dtype::U8, 1usize), (Dtype::BF16, 2), (Dtype::F32, 4), (Dtype::I64, 8)] {
            for len in SIZES {
                let len = len / width * width;
                let old = bytes(len, 3);
                let mut new = old.clone();
                if len > 0 {
                    new[len / 2] ^= 1;
                }
                for (values, codec) in [
                    (ValueCodec::Diff, Codec::Varint),
                    (ValueCodec::Abs, Codec::Varint),
                    (ValueCodec::Diff, Codec::Compact),
                    (ValueCodec::Abs, Codec::Compact),
                ] {
                    let input =
                        DiffInput { name: "w".into(), dtype, shape: vec![(len / width) as u64], old: &old, new: &new };
                    let tensor = diff(&[input], values, codec).unwrap().remove(0);
                    let what = format!("{len} bytes of {width}, {values:?} {codec:?}");
                    if tensor.is_dense() {
                        assert_eq!(tensor.base, None, "{what}");
                        continue;
                    }
                    assert_eq!(tensor.base, Some(reference(&old)), "{what}");
                    check_base(&tensor, &old).unwrap();
                    if len == 0 {
                        continue;
                    }
                    let err = check_base(&tensor, &new).unwrap_err();
                    assert!(matches!(err, Error::BaseMismatch { .. }), "{what}");
                    assert!(
                        err.to_string().contains("tensor \"w\"") && err.to_string().contains("applied already"),
                        "{err}"
                    );
                    let mut flipped = old.clone();
                    flipped[len - 1] ^= 0x80;
                    assert!(matches!(check_base(&tensor, &flipped), Err(Error::BaseMismatch { .. })), "{what}");
                }
            }
        }
    }

    #[test]
    fn check_bases_reports_the_first_failing_target() {
        let (a, b) = (bytes(1000, 1), bytes(3000, 2));
        let (mut a2, mut b2) = (a.clone(), b.clone());
        a2[5] ^= 1;
        b2[7] ^= 1;
        let tensors = diff(
            &[
                DiffInput { name: "a".into(), dtype: Dtype::U8, shape: vec![1000], old: &a, new: &a2 },
                DiffInput { name: "b".into(), dtype: Dtype::U8, shape: vec![3000], old: &b, new: &b2 },
            ],
            ValueCodec::Diff,
            Codec::Varint,
        )
        .unwrap();
        let delta = Delta { tensors, ..Default::default() };
        check_bases(&delta, &[(0, &a), (1, &b)]).unwrap();
        let err = check_bases(&delta, &[(1, &b2), (0, &a2)]).unwrap_err();
        assert!(err.to_string().contains("tensor \"b\""), "{err}");
        assert!(matches!(check_bases(&delta, &[(0, &b)]), Err(Error::BaseMismatch { .. })));
        assert!(matches!(check_bases(&delta, &[(2, &b)]), Err(Error::InvalidInput { .. })));
    }

    #[test]
    fn a_delta_follows_only_the_anchor_it_was_made_against() {
        use crate::core::diff::{full, FullInput};
        let (a, b) = (bytes(3 * BLOCK_BYTES + 10, 1), bytes(3000, 2));
        let (mut a2, mut b2) = (a.clone(), b.clone());
        a2[5] ^= 1;
        b2[7] ^= 1;
        let changes = |a: &[u8], b: &[u8], a2: &[u8], b2: &[u8]| Delta {
            tensors: diff(
                &[
                    DiffInput { name: "a".into(), dtype: Dtype::U8, shape: vec![a.len() as u64], old: a, new: a2 },
                    DiffInput { name: "b".into(), dtype: Dtype::U8, shape: vec![3000], old: b, new: b2 },
                ],
                ValueCodec::Diff,
                Codec::Compact,
            )
            .unwrap(),
            ..Default::default()
        };
        let anchor = |a: &[u8], b: &[u8], b_dtype: Dtype| Delta {
            tensors: full(&[
                FullInput { name: "b".into(), dtype: b_dtype, shape: vec![3000 / b_dtype_width(b_dtype)], data: b },
                FullInput { name: "a".into(), dtype: Dtype::U8, shape: vec![a.len() as u64], data: a },
            ])
            .unwrap(),
            ..Default::default()
        };
        fn b_dtype_width(dtype: Dtype) -> u64 {
            crate::core::dtype::width_of(dtype).unwrap() as u64
        }
        let next = changes(&a, &b, &a2, &b2);
        assert_eq!(check_follows(&anchor(&a, &b, Dtype::U8), &next, |_| true).unwrap(), 2);
        // The anchor of another state: each tensor named, by the anchor's bytes it holds.
        let err = check_follows(&anchor(&a2, &b, Dtype::U8), &next, |_| true).unwrap_err();
        assert!(matches!(err, Error::BaseMismatch { .. }) && err.to_string().contains("tensor \"a\""), "{err}");
        let err = check_follows(&anchor(&a, &b2, Dtype::U8), &next, |_| true).unwrap_err();
        assert!(err.to_string().contains("tensor \"b\""), "{err}");
        // A tensor the reader did not read whole (by the anchor's index) is not hashed.
        assert_eq!(check_follows(&anchor(&a, &b2, Dtype::U8), &next, |index| index != 0).unwrap(), 1);
        // Another dtype (or shape) is a mismatch whatever its bytes, read or not.
        for usable in [true, false] {
            let err = check_follows(&anchor(&a, &b, Dtype::BF16), &next, |_| usable).unwrap_err();
            assert!(matches!(err, Error::BaseMismatch { .. }) && err.to_string().contains("tensor \"b\""), "{err}");
        }
        // So is a tensor with a base that the anchor lacks; records without a base are not checked.
        let only_a = Delta {
            tensors: full(&[FullInput { name: "a".into(), dtype: Dtype::U8, shape: vec![a.len() as u64], data: &a }])
                .unwrap(),
            ..Default::default()
        };
        let err = check_follows(&only_a, &next, |_| false).unwrap_err();
        assert!(err.to_string().contains("tensor \"b\"") && err.to_string().contains("no such tensor"), "{err}");
        let mut lone = Delta { tensors: vec![next.tensors[1].clone()], ..Default::default() };
        lone.tensors[0].base = None;
        assert_eq!(check_follows(&only_a, &lone, |_| true).unwrap(), 0);
        let mut unbased = next.clone();
        unbased.tensors.iter_mut().for_each(|tensor| tensor.base = None);
        assert_eq!(check_follows(&anchor(&a2, &b2, Dtype::U8), &unbased, |_| true).unwrap(), 0);
    }
}
