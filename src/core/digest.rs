//! State digests: a 128-bit XXH3 hash per tensor, in parallel, combined into one digest of a whole state.
//! They detect corruption and divergence; authenticity comes from the manifest's HMAC (docs/format.md §10).

use rayon::prelude::*;
use twox_hash::XxHash3_128;

use crate::core::dtype::{self, Dtype};
use crate::core::error::{Error, Result};
use crate::core::xxh3;

/// One tensor of a state: its name, dtype, shape and raw little-endian bytes.
pub struct DigestInput<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [u64],
    pub data: &'a [u8],
}

/// A streaming XXH3-128 (twox-hash's, which uses AVX2 where the CPU has it).
#[derive(Default)]
pub struct Xxh3 {
    inner: XxHash3_128,
}

impl Xxh3 {
    pub fn new() -> Self {
        Self::default()
    }

    #[inline]
    pub fn update(&mut self, bytes: &[u8]) {
        self.inner.write(bytes);
    }

    pub fn digest128(&self) -> u128 {
        self.inner.finish_128()
    }
}

/// A tensor's hasher with its dtype and shape already fed: feed it the tensor's bytes, in order, then `digest128`.
pub fn tensor_hasher(dtype: Dtype, shape: &[u64]) -> Xxh3 {
    let mut hasher = Xxh3::new();
    hasher.update(&tensor_prefix(dtype, shape));
    hasher
}

/// What `tensor_hasher` feeds before a tensor's bytes: its dtype's name, a zero byte, its rank and its dims.
fn tensor_prefix(dtype: Dtype, shape: &[u64]) -> Vec<u8> {
    let mut prefix = dtype::name_of(dtype).as_bytes().to_vec();
    prefix.push(0);
    prefix.extend_from_slice(&(shape.len() as u64).to_le_bytes());
    for dim in shape {
        prefix.extend_from_slice(&dim.to_le_bytes());
    }
    prefix
}

/// A tensor's hash (`tensor_hasher`'s) from its bytes' XXH3 round sums made elsewhere (on a torch device): `head`
/// is the tensor's bytes up to the first summed round (the stream's rounds being 1,024 bytes of the prefix and
/// then the bytes), `rounds` what each following round adds to the eight accumulators, `tail` the bytes after the
/// last of them, and `last` the tensor's last 64 bytes (a tensor of at least 64). Only the stripes of `head` and
/// `tail` and the chain of the rounds run here.
pub fn tensor_hash_from_rounds(
    dtype: Dtype,
    shape: &[u64],
    head: &[u8],
    rounds: &[[u64; 8]],
    tail: &[u8],
    last: &[u8],
) -> Result<u128> {
    let prefix = tensor_prefix(dtype, shape);
    let len = (prefix.len() + head.len() + rounds.len() * xxh3::ROUND_BYTES + tail.len()) as u64;
    let numel_bytes = dtype::numel(shape).and_then(|n| n.checked_mul(dtype::width_of(dtype).ok()? as u64));
    let head_stream = [&prefix[..], head].concat();
    let first_round = (head_stream.len() / xxh3::ROUND_BYTES) as u64;
    let end_round = first_round + rounds.len() as u64;
    let regular = if len >= xxh3::Long128::MIN_LEN { xxh3::Long128::regular_stripes(len) } else { 0 };
    if numel_bytes != Some(len - prefix.len() as u64)
        || !head_stream.len().is_multiple_of(xxh3::ROUND_BYTES)
        || end_round * xxh3::STRIPES as u64 > regular
        || last.len() != xxh3::STRIPE
        || len - (prefix.len() as u64) < xxh3::STRIPE as u64
        || !last.ends_with(&tail[tail.len().saturating_sub(xxh3::STRIPE)..])
    {
        return Err(Error::invalid(format!(
            "round sums of a {shape:?} tensor of {}: {} head bytes, {} rounds, {} tail bytes and {} last bytes do \
             not make up its bytes",
            dtype::name_of(dtype),
            head.len(),
            rounds.len(),
            tail.len(),
            last.len()
        )));
    }
    let mut chain = xxh3::Long128::new(len);
    let stripes = |first_round: u64| first_round * xxh3::STRIPES as u64;
    chain.add_stripes(&head_stream, 0, stripes(first_round));
    chain.add_rounds(first_round, rounds);
    chain.add_stripes(tail, stripes(end_round), regular - stripes(end_round));
    Ok(chain.finish(last))
}

fn tensor_hash(input: &DigestInput<'_>) -> u128 {
    let mut hasher = tensor_hasher(input.dtype, input.shape);
    hasher.update(input.data);
    hasher.digest128()
}

/// A tensor's hash (`tensor_hasher`'s) from its bytes fed in order a part at a time, possibly by several holders
/// in turn: tensor-parallel readers that each hold some rows of a tensor hash theirs and hand the state on
/// (`to_bytes`, `from_bytes`: a few hundred bytes) instead of the bytes. The stream (the prefix, then the tensor's
/// bytes) is chained round by round as XXH3-128's long-input loop does (xxh3::Long128); a stream of up to 240
/// bytes, which XXH3 hashes another way, is kept whole until `finish`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorHashParts {
    /// The stream's length, and the prefix's.
    len: u64,
    prefix_len: u64,
    /// Stream bytes fed so far.
    fed: u64,
    /// The chain's state (xxh3::Long128::state); unused for a short stream.
    chain: ([u64; 8], u64, [u64; 8]),
    /// Fed bytes not summed yet: those after the last stripe summed (fewer than 64, or the bytes after the stream's
    /// last regular stripe), or every byte of a short stream.
    carry: Vec<u8>,
    /// The last (up to) 64 stream bytes fed.
    last: Vec<u8>,
}

impl TensorHashParts {
    /// The longest stream taken (2^56 bytes, 64 PiB): no tensor in memory comes near it.
    const MAX_LEN: u64 = 1 << 56;

    /// The state before the tensor's first byte (its prefix fed).
    pub fn begin(dtype: Dtype, shape: &[u64]) -> Result<Self> {
        let nbytes = dtype::numel(shape)
            .and_then(|n| n.checked_mul(dtype::width_of(dtype).ok()? as u64))
            .ok_or_else(|| Error::invalid(format!("a {shape:?} tensor of {} is too large", dtype::name_of(dtype))))?;
        let prefix = tensor_prefix(dtype, shape);
        let prefix_len = prefix.len() as u64;
        let len = nbytes
            .checked_add(prefix_len)
            .filter(|&len| len <= Self::MAX_LEN)
            .ok_or_else(|| Error::invalid(format!("a {shape:?} tensor of {} is too large", dtype::name_of(dtype))))?;
        let chain = xxh3::Long128::new(len.max(xxh3::Long128::MIN_LEN)).state();
        let mut parts = TensorHashParts { len, prefix_len, fed: 0, chain, carry: Vec::new(), last: Vec::new() };
        parts.take(&prefix);
        Ok(parts)
    }

    /// The tensor's bytes fed so far.
    pub fn tensor_fed(&self) -> u64 {
        self.fed - self.prefix_len
    }

    /// Feeds the tensor's next bytes.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<()> {
        if bytes.len() as u64 > self.len - self.fed {
            return Err(Error::invalid(format!(
                "{} bytes fed after {} of a tensor of {}",
                bytes.len(),
                self.tensor_fed(),
                self.len - self.prefix_len
            )));
        }
        self.take(bytes);
        Ok(())
    }

    fn take(&mut self, bytes: &[u8]) {
        let keep = xxh3::STRIPE.min(self.last.len() + bytes.len());
        let from_bytes = keep.min(bytes.len());
        let from_last = keep - from_bytes;
        self.last.drain(..self.last.len() - from_last);
        self.last.extend_from_slice(&bytes[bytes.len() - from_bytes..]);
        let start = self.fed;
        self.fed += bytes.len() as u64;
        if self.len < xxh3::Long128::MIN_LEN {
            self.carry.extend_from_slice(bytes);
            return;
        }
        let stripe = xxh3::STRIPE as u64;
        let summed = (start - self.carry.len() as u64) / stripe; // stripes summed so far
        let regular = xxh3::Long128::regular_stripes(self.len);
        let until = (self.fed / stripe).min(regular);
        if until <= summed {
            self.carry.extend_from_slice(bytes);
            return;
        }
        let mut chain = xxh3::Long128::resume(self.len, self.chain).expect("a state this type made");
        let mut at = 0usize; // bytes of `bytes` summed
        let mut next = summed;
        if !self.carry.is_empty() {
            let mut first = std::mem::take(&mut self.carry);
            at = xxh3::STRIPE - first.len();
            first.extend_from_slice(&bytes[..at]);
            chain.add_stripes(&first, next, 1);
            next += 1;
        }
        if until > next {
            chain.add_stripes(&bytes[at..], next, until - next);
            at += ((until - next) * stripe) as usize;
        }
        self.carry = bytes[at..].to_vec();
        self.chain = chain.state();
    }

    /// The tensor's hash, once every byte was fed.
    pub fn finish(&self) -> Result<u128> {
        if self.fed != self.len {
            return Err(Error::invalid(format!(
                "{} of the {} bytes of a tensor were fed",
                self.tensor_fed(),
                self.len - self.prefix_len
            )));
        }
        if self.len < xxh3::Long128::MIN_LEN {
            let mut hasher = Xxh3::new();
            hasher.update(&self.carry);
            return Ok(hasher.digest128());
        }
        let chain = xxh3::Long128::resume(self.len, self.chain).expect("a state this type made");
        Ok(chain.finish(&self.last))
    }

    /// The state as bytes, for `from_bytes`.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(200 + self.carry.len());
        for value in [self.len, self.prefix_len, self.fed, self.chain.1] {
            out.extend_from_slice(&value.to_le_bytes());
        }
        for value in self.chain.0.iter().chain(&self.chain.2) {
            out.extend_from_slice(&value.to_le_bytes());
        }
        out.extend_from_slice(&(self.carry.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.carry);
        out.extend_from_slice(&self.last);
        out
    }

    /// A state `to_bytes` wrote; an error for bytes that do not make a consistent one.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let bad = || Error::invalid(format!("{} bytes are not the state of a tensor's hash", bytes.len()));
        let word = |i: usize| -> Result<u64> {
            Ok(u64::from_le_bytes(bytes.get(8 * i..8 * i + 8).ok_or_else(bad)?.try_into().expect("8")))
        };
        let (len, prefix_len, fed, round) = (word(0)?, word(1)?, word(2)?, word(3)?);
        let mut acc = [0u64; 8];
        let mut pending = [0u64; 8];
        for lane in 0..8 {
            acc[lane] = word(4 + lane)?;
            pending[lane] = word(12 + lane)?;
        }
        let at = 8 * 20;
        let carry_len = u32::from_le_bytes(bytes.get(at..at + 4).ok_or_else(bad)?.try_into().expect("4")) as usize;
        let carry = bytes.get(at + 4..at + 4 + carry_len).ok_or_else(bad)?.to_vec();
        let last = bytes.get(at + 4 + carry_len..).ok_or_else(bad)?.to_vec();
        let short = len < xxh3::Long128::MIN_LEN;
        let stripe = xxh3::STRIPE as u64;
        let summed_end = fed.checked_sub(carry_len as u64).ok_or_else(bad)?;
        if len > Self::MAX_LEN || prefix_len > fed || fed > len || last.len() as u64 != fed.min(stripe) {
            return Err(bad());
        }
        if short {
            if carry_len as u64 != fed || round != 0 {
                return Err(bad());
            }
        } else {
            // As `take` leaves them: whole stripes summed, the chain at the round of the last one, and fewer than
            // 64 bytes carried, or the bytes after the last regular stripe.
            let summed = summed_end / stripe;
            let regular = xxh3::Long128::regular_stripes(len);
            let stripes = xxh3::STRIPES as u64;
            let at_round = if summed == 0 { 0 } else { (summed - 1) / stripes };
            if !summed_end.is_multiple_of(stripe)
                || summed > regular
                || round != at_round
                || (summed < regular && carry_len as u64 >= stripe)
                || (summed == regular && fed - summed_end > len - regular * stripe)
                || xxh3::Long128::resume(len, (acc, round, pending)).is_none()
            {
                return Err(bad());
            }
        }
        Ok(TensorHashParts { len, prefix_len, fed, chain: (acc, round, pending), carry, last })
    }
}

/// The state digest from each tensor's name and hash (`tensor_hasher`'s result), in any order.
pub fn combine(tensors: &[(&str, u128)]) -> String {
    let mut order: Vec<&(&str, u128)> = tensors.iter().collect();
    order.sort_by(|a, b| a.0.cmp(b.0));
    let mut hasher = Xxh3::new();
    for (name, hash) in order {
        hasher.update(name.as_bytes());
        hasher.update(&[0]);
        hasher.update(&hash.to_le_bytes());
    }
    format!("{:032x}", hasher.digest128())
}

/// Each tensor's own hash (what `combine` takes), in parallel: a state too large to hold or map at once is digested
/// a batch of tensors at a time, then combined.
pub fn tensor_hashes(inputs: &[DigestInput<'_>]) -> Vec<u128> {
    crate::core::pool::install(|| inputs.par_iter().map(tensor_hash).collect())
}

/// The digest of a state: XXH3-128 over, for each tensor in name order, the name's UTF-8 bytes, a zero byte
/// and the tensor's own XXH3-128 (of dtype name, a zero byte, rank and dims as u64 LE, then its data), as 16
/// little-endian bytes. Returned as 32 lowercase hex digits.
pub fn state_digest(inputs: &[DigestInput<'_>]) -> String {
    let hashes = tensor_hashes(inputs);
    let named: Vec<(&str, u128)> = inputs.iter().zip(hashes).map(|(input, hash)| (input.name, hash)).collect();
    combine(&named)
}

/// The state digest of the tensors `delta` holds, when it holds every one of them whole with its shape (an
/// anchor); None otherwise (a delta of changes, or a file without shapes).
pub fn of_whole_tensors(delta: &crate::core::delta::Delta) -> Option<String> {
    let inputs: Option<Vec<DigestInput<'_>>> = delta
        .tensors
        .iter()
        .map(|tensor| {
            let shape = tensor.shape.as_deref().filter(|_| tensor.is_dense())?;
            Some(DigestInput { name: &tensor.name, dtype: tensor.dtype, shape, data: &tensor.values[..] })
        })
        .collect();
    inputs.map(|inputs| state_digest(&inputs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tensor_hashed_a_part_at_a_time_by_holders_in_turn_is_its_hash() {
        let mut next = crate::core::testing::xorshift(17);
        // Streams short (XXH3's other algorithms), at the long loop's threshold, around rounds, and over a block.
        for numel in [0u64, 1, 50, 105, 106, 107, 480, 497, 498, 511, 512, 513, 1000, 5000, 131_072, 140_001] {
            let data: Vec<u8> = (0..numel * 2).map(|_| next() as u8).collect();
            let shape = [numel];
            let mut whole = tensor_hasher(Dtype::BF16, &shape);
            whole.update(&data);
            let expected = whole.digest128();
            for cuts in 0..6 {
                // The bytes cut at random places (empty parts included), the state handed on as bytes at each cut.
                let mut bounds: Vec<usize> = (0..cuts).map(|_| (next() % (data.len() as u64 + 1)) as usize).collect();
                bounds.extend([0, data.len()]);
                bounds.sort_unstable();
                let mut parts = TensorHashParts::begin(Dtype::BF16, &shape).unwrap();
                for pair in bounds.windows(2) {
                    parts.feed(&data[pair[0]..pair[1]]).unwrap();
                    let moved = TensorHashParts::from_bytes(&parts.to_bytes()).unwrap();
                    assert_eq!(moved, parts);
                    parts = moved;
                }
                assert_eq!(parts.tensor_fed(), data.len() as u64);
                assert_eq!(parts.finish().unwrap(), expected, "{numel} elements cut at {bounds:?}");
            }
            // Too few or too many bytes are refused; so is a state cut short or lengthened.
            let mut parts = TensorHashParts::begin(Dtype::BF16, &shape).unwrap();
            if !data.is_empty() {
                parts.feed(&data[..data.len() - 1]).unwrap();
                assert!(parts.finish().is_err());
            }
            assert!(parts.feed(&[0, 0]).is_err());
            let bytes = parts.to_bytes();
            assert!(TensorHashParts::from_bytes(&bytes[..bytes.len() - 1]).is_err());
            assert!(TensorHashParts::from_bytes(&[&bytes[..], &[0]].concat()).is_err());
        }
        // States no `take` leaves are refused, not taken into a panic (found by review): the chain's round ahead
        // of the stripes summed, a carry of a stripe or more before the last regular stripe, a stream too long.
        let mut parts = TensorHashParts::begin(Dtype::U8, &[5000]).unwrap();
        parts.feed(&[7; 1500]).unwrap();
        for bad in [
            TensorHashParts { chain: (parts.chain.0, parts.chain.1 + 1, parts.chain.2), ..parts.clone() },
            TensorHashParts { fed: parts.fed + 64, carry: [&parts.carry[..], &[0; 64]].concat(), ..parts.clone() },
            TensorHashParts { len: 1 << 62, ..parts.clone() },
        ] {
            assert!(TensorHashParts::from_bytes(&bad.to_bytes()).is_err(), "{bad:?}");
        }
        assert!(TensorHashParts::begin(Dtype::U8, &[u64::MAX - 10]).is_err());
        assert!(TensorHashParts::begin(Dtype::I64, &[(1 << 61) - 1]).is_err());
    }

    #[test]
    fn order_independent_and_sensitive_to_everything() {
        let a = DigestInput { name: "a", dtype: Dtype::BF16, shape: &[2], data: &[1, 2, 3, 4] };
        let b = DigestInput { name: "b", dtype: Dtype::U8, shape: &[1], data: &[9] };
        let base = state_digest(&[a, b]);
        let a = DigestInput { name: "a", dtype: Dtype::BF16, shape: &[2], data: &[1, 2, 3, 4] };
        let b = DigestInput { name: "b", dtype: Dtype::U8, shape: &[1], data: &[9] };
        assert_eq!(state_digest(&[b, a]), base);
        for changed in [
            DigestInput { name: "a", dtype: Dtype::BF16, shape: &[2], data: &[1, 2, 3, 5] },
            DigestInput { name: "a", dtype: Dtype::F16, shape: &[2], data: &[1, 2, 3, 4] },
            DigestInput { name: "a", dtype: Dtype::BF16, shape: &[1, 2], data: &[1, 2, 3, 4] },
            DigestInput { name: "c", dtype: Dtype::BF16, shape: &[2], data: &[1, 2, 3, 4] },
        ] {
            let b = DigestInput { name: "b", dtype: Dtype::U8, shape: &[1], data: &[9] };
            assert_ne!(state_digest(&[changed, b]), base);
        }
        assert_eq!(base.len(), 32);
    }

    #[test]
    fn a_tensor_hash_from_round_sums_is_the_tensor_hash() {
        let mut next = crate::core::testing::xorshift(0xface);
        for (dtype, shape) in
            [(Dtype::BF16, vec![96u64, 100]), (Dtype::F32, vec![8195]), (Dtype::U8, vec![3, 5, 7, 11, 13])]
        {
            let len = dtype::numel(&shape).unwrap() as usize * dtype::width_of(dtype).unwrap();
            let data: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            let want = tensor_hash(&DigestInput { name: "t", dtype, shape: &shape, data: &data });
            let prefix = tensor_prefix(dtype, &shape).len();
            // The rounds from the first that starts in the bytes, to the last whole one before the last stripe.
            let first = prefix.div_ceil(xxh3::ROUND_BYTES);
            let regular = xxh3::Long128::regular_stripes((prefix + len) as u64) as usize;
            for end in [first, first + 1, regular / xxh3::STRIPES] {
                let (head, tail) = (first * xxh3::ROUND_BYTES - prefix, end * xxh3::ROUND_BYTES - prefix);
                let sums = xxh3::StripeSums::of(
                    &data[head..tail],
                    0,
                    (first * xxh3::STRIPES) as u64,
                    ((end - first) * xxh3::STRIPES) as u64,
                );
                let got = tensor_hash_from_rounds(
                    dtype,
                    &shape,
                    &data[..head],
                    &sums.rounds,
                    &data[tail..],
                    &data[len - 64..],
                );
                assert_eq!(got.unwrap(), want, "{dtype:?} {shape:?} rounds {first}..{end}");
            }
            let short = tensor_hash_from_rounds(dtype, &shape, &data[..5], &[], &data[5..len - 1], &data[len - 64..]);
            assert!(short.unwrap_err().to_string().contains("do not make up its bytes"));
        }
    }

    #[test]
    fn streaming_hash_matches_a_second_implementation() {
        let data: Vec<u8> = (0..3_000_017u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
        for cuts in [vec![], vec![1], vec![63, 64, 240], vec![1 << 20, (1 << 20) + 1]] {
            let (mut ours, mut reference) = (Xxh3::new(), xxhash_rust::xxh3::Xxh3::new());
            let mut start = 0;
            for end in cuts.into_iter().chain([data.len()]) {
                ours.update(&data[start..end]);
                reference.update(&data[start..end]);
                start = end;
            }
            assert_eq!(ours.digest128(), reference.digest128());
        }
    }
}
