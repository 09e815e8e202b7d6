//! State digests: a 128-bit XXH3 hash per tensor, in parallel, combined into one digest of a whole state.
//! They detect corruption and divergence; authenticity comes from the manifest's HMAC (docs/format.md §10).

use rayon::prelude::*;
use twox_hash::XxHash3_128;

use crate::core::dtype::{self, Dtype};

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
    hasher.update(dtype::name_of(dtype).as_bytes());
    hasher.update(&[0]);
    hasher.update(&(shape.len() as u64).to_le_bytes());
    for dim in shape {
        hasher.update(&dim.to_le_bytes());
    }
    hasher
}

fn tensor_hash(input: &DigestInput<'_>) -> u128 {
    let mut hasher = tensor_hasher(input.dtype, input.shape);
    hasher.update(input.data);
    hasher.digest128()
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

#[cfg(test)]
mod tests {
    use super::*;

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
