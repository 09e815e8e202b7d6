//! XXH3-64 of one whole base identity block (`base::BLOCK_BYTES` bytes), computed stripe by stripe alongside the
//! scan's compare (core::scan), so that the base is read once for both.
//!
//! This is XXH3's long-input algorithm with the default secret and seed 0, as its specification gives it, for the
//! one length the fused path hashes: 256 rounds of 16 stripes of 64 bytes; the accumulators are scrambled after
//! every round but the last; the last round takes its 16th stripe (the block's last 64 bytes) with the secret from
//! byte 121 instead of the 16th stripe's key; then the accumulators are merged. `base::block_hash` (twox-hash)
//! stays the reference: every block of other lengths, and every kernel without a fused path, hashes with it, and the
//! tests check that both give the same hash.

use super::base::BLOCK_BYTES;

/// XXH3's default secret.
pub const SECRET: [u8; 192] = [
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c, 0xde, 0xd4, 0x6d,
    0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0,
    0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0,
    0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b,
    0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac,
    0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51,
    0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34,
    0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, 0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49,
    0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8,
    0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b,
    0x40, 0x7e,
];

pub const PRIME32_1: u64 = 0x9E37_79B1;
const PRIME32_2: u64 = 0x85EB_CA77;
const PRIME32_3: u64 = 0xC2B2_AE3D;
const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;
const PRIME64_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const PRIME64_3: u64 = 0x1656_67B1_9E37_79F9;
const PRIME64_4: u64 = 0x85EB_CA77_C2B2_AE63;
const PRIME64_5: u64 = 0x27D4_EB2F_1656_67C5;

/// Bytes per stripe, stripes per round, rounds per block.
pub const STRIPE: usize = 64;
pub const STRIPES: usize = 16;
pub const ROUNDS: usize = BLOCK_BYTES / (STRIPE * STRIPES);
/// Where the key of the block's last stripe starts in the secret, and the scramble's key.
pub const LAST_STRIPE_KEY: usize = SECRET.len() - STRIPE - 7;
pub const SCRAMBLE_KEY: usize = SECRET.len() - STRIPE;

/// The accumulators before the first stripe.
pub const INIT: [u64; 8] = [PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1];

/// The secret's key for stripe `stripe` of round `round`.
#[inline(always)]
pub fn key_offset(round: usize, stripe: usize) -> usize {
    if round == ROUNDS - 1 && stripe == STRIPES - 1 {
        LAST_STRIPE_KEY
    } else {
        8 * stripe
    }
}

fn secret_word(offset: usize) -> u64 {
    u64::from_le_bytes(SECRET[offset..offset + 8].try_into().expect("8 bytes"))
}

/// The hash of a whole block from its accumulators after the last stripe.
pub fn merge(acc: &[u64; 8]) -> u64 {
    let mut result = (BLOCK_BYTES as u64).wrapping_mul(PRIME64_1);
    for pair in 0..4 {
        let a = acc[2 * pair] ^ secret_word(11 + 16 * pair);
        let b = acc[2 * pair + 1] ^ secret_word(11 + 16 * pair + 8);
        let product = u128::from(a) * u128::from(b);
        result = result.wrapping_add(product as u64 ^ (product >> 64) as u64);
    }
    result ^= result >> 37;
    result = result.wrapping_mul(0x1656_6791_9E37_79F9);
    result ^ (result >> 32)
}

/// One stripe, one lane at a time (what the vector kernels do eight lanes at once).
#[cfg(test)]
fn accumulate_portable(acc: &mut [u64; 8], stripe: &[u8], key: &[u8]) {
    let word = |bytes: &[u8], lane: usize| u64::from_le_bytes(bytes[8 * lane..8 * lane + 8].try_into().expect("8"));
    for lane in 0..8 {
        let data = word(stripe, lane);
        let mixed = data ^ word(key, lane);
        acc[lane ^ 1] = acc[lane ^ 1].wrapping_add(data);
        acc[lane] = acc[lane].wrapping_add((mixed & 0xffff_ffff) * (mixed >> 32));
    }
}

#[cfg(test)]
fn scramble_portable(acc: &mut [u64; 8]) {
    for (lane, value) in acc.iter_mut().enumerate() {
        let mixed = (*value ^ (*value >> 47)) ^ secret_word(SCRAMBLE_KEY + 8 * lane);
        *value = mixed.wrapping_mul(PRIME32_1);
    }
}

#[cfg(target_arch = "x86_64")]
pub mod x86 {
    use std::arch::x86_64::*;

    /// Adds the stripe at `data` to the accumulators, with the key at `key`.
    ///
    /// # Safety
    /// 64 readable bytes at `data` and at `key`; the CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub unsafe fn accumulate_avx512(acc: &mut [u64; 8], data: *const u8, key: *const u8) {
        let sums = _mm512_loadu_si512(acc.as_ptr().cast());
        let data = _mm512_loadu_si512(data.cast());
        let mixed = _mm512_xor_si512(data, _mm512_loadu_si512(key.cast()));
        let product = _mm512_mul_epu32(mixed, _mm512_srli_epi64::<32>(mixed));
        let swapped = _mm512_shuffle_epi32::<_MM_PERM_BADC>(data);
        _mm512_storeu_si512(acc.as_mut_ptr().cast(), _mm512_add_epi64(product, _mm512_add_epi64(sums, swapped)));
    }

    /// Scrambles the accumulators after a round.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub unsafe fn scramble_avx512(acc: &mut [u64; 8]) {
        let sums = _mm512_loadu_si512(acc.as_ptr().cast());
        let key = _mm512_loadu_si512(super::SECRET.as_ptr().add(super::SCRAMBLE_KEY).cast());
        let mixed = _mm512_xor_si512(_mm512_xor_si512(sums, _mm512_srli_epi64::<47>(sums)), key);
        let prime = _mm512_set1_epi32(super::PRIME32_1 as u32 as i32);
        let low = _mm512_mul_epu32(mixed, prime);
        let high = _mm512_mul_epu32(_mm512_srli_epi64::<32>(mixed), prime);
        _mm512_storeu_si512(acc.as_mut_ptr().cast(), _mm512_add_epi64(low, _mm512_slli_epi64::<32>(high)));
    }

    /// `accumulate_avx512` in two halves.
    ///
    /// # Safety
    /// As `accumulate_avx512`, with AVX2.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub unsafe fn accumulate_avx2(acc: &mut [u64; 8], data: *const u8, key: *const u8) {
        for half in 0..2 {
            let sums = _mm256_loadu_si256(acc.as_ptr().add(4 * half).cast());
            let data = _mm256_loadu_si256(data.add(32 * half).cast());
            let mixed = _mm256_xor_si256(data, _mm256_loadu_si256(key.add(32 * half).cast()));
            let product = _mm256_mul_epu32(mixed, _mm256_srli_epi64::<32>(mixed));
            let swapped = _mm256_shuffle_epi32::<0x4e>(data);
            let result = _mm256_add_epi64(product, _mm256_add_epi64(sums, swapped));
            _mm256_storeu_si256(acc.as_mut_ptr().add(4 * half).cast(), result);
        }
    }

    /// `scramble_avx512` in two halves.
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub unsafe fn scramble_avx2(acc: &mut [u64; 8]) {
        let prime = _mm256_set1_epi32(super::PRIME32_1 as u32 as i32);
        for half in 0..2 {
            let sums = _mm256_loadu_si256(acc.as_ptr().add(4 * half).cast());
            let key = _mm256_loadu_si256(super::SECRET.as_ptr().add(super::SCRAMBLE_KEY + 32 * half).cast());
            let mixed = _mm256_xor_si256(_mm256_xor_si256(sums, _mm256_srli_epi64::<47>(sums)), key);
            let low = _mm256_mul_epu32(mixed, prime);
            let high = _mm256_mul_epu32(_mm256_srli_epi64::<32>(mixed), prime);
            let result = _mm256_add_epi64(low, _mm256_slli_epi64::<32>(high));
            _mm256_storeu_si256(acc.as_mut_ptr().add(4 * half).cast(), result);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::base::block_hash;

    fn block(seed: u64) -> Vec<u8> {
        let mut next = crate::core::testing::xorshift(seed);
        (0..BLOCK_BYTES / 8).flat_map(|_| next().to_le_bytes()).collect()
    }

    fn hash_with(
        bytes: &[u8],
        accumulate: impl Fn(&mut [u64; 8], &[u8], &[u8]),
        scramble: impl Fn(&mut [u64; 8]),
    ) -> u64 {
        let mut acc = INIT;
        for round in 0..ROUNDS {
            for stripe in 0..STRIPES {
                let at = (round * STRIPES + stripe) * STRIPE;
                let key = key_offset(round, stripe);
                accumulate(&mut acc, &bytes[at..at + STRIPE], &SECRET[key..key + STRIPE]);
            }
            if round + 1 < ROUNDS {
                scramble(&mut acc);
            }
        }
        merge(&acc)
    }

    #[test]
    fn the_stripes_give_twox_hashs_block_hash() {
        for seed in [1, 2, 0x9e37_79b9] {
            let bytes = block(seed);
            assert_eq!(hash_with(&bytes, accumulate_portable, scramble_portable), block_hash(&bytes));
        }
        assert_eq!(
            hash_with(&[0u8; BLOCK_BYTES], accumulate_portable, scramble_portable),
            block_hash(&[0; BLOCK_BYTES])
        );
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_vector_stripes_give_the_same_hash() {
        let bytes = block(7);
        if is_x86_feature_detected!("avx2") {
            let accumulate =
                |acc: &mut [u64; 8], s: &[u8], k: &[u8]| unsafe { x86::accumulate_avx2(acc, s.as_ptr(), k.as_ptr()) };
            let scramble = |acc: &mut [u64; 8]| unsafe { x86::scramble_avx2(acc) };
            assert_eq!(hash_with(&bytes, accumulate, scramble), block_hash(&bytes));
        }
        if is_x86_feature_detected!("avx512f") {
            let accumulate =
                |acc: &mut [u64; 8], s: &[u8], k: &[u8]| unsafe { x86::accumulate_avx512(acc, s.as_ptr(), k.as_ptr()) };
            let scramble = |acc: &mut [u64; 8]| unsafe { x86::scramble_avx512(acc) };
            assert_eq!(hash_with(&bytes, accumulate, scramble), block_hash(&bytes));
        }
    }
}
