//! XXH3-64 of one whole base identity block (`base::BLOCK_BYTES` bytes), computed stripe by stripe alongside the
//! scan's compare (core::scan), so that the base is read once for both.
//!
//! This is XXH3's long-input algorithm with the default secret and seed 0, as its specification gives it, for the
//! one length the fused path hashes: 256 rounds of 16 stripes of 64 bytes; the accumulators are scrambled after
//! every round but the last; the last round takes its 16th stripe (the block's last 64 bytes) with the secret from
//! byte 121 instead of the 16th stripe's key; then the accumulators are merged. `base::block_hash` (twox-hash)
//! stays the reference: every block of other lengths, and every kernel without a fused path, hashes with it, and the
//! tests check that both give the same hash.
//!
//! Also XXH3-128 of a long stream chained from its stripes' terms summed round by round elsewhere (`StripeSums`,
//! `Long128`): a state-digest hash (core::digest) of a tensor on a torch device, whose rounds are summed there and
//! only their sums, 1/16 of the bytes, cross to the host.

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
    merge_accs(acc, MERGE_KEY, (BLOCK_BYTES as u64).wrapping_mul(PRIME64_1))
}

/// Where the secret's key of the (first) merge starts.
const MERGE_KEY: usize = 11;
/// Where the key of XXH3-128's second merge starts.
const MERGE_KEY_HIGH: usize = SECRET.len() - STRIPE - MERGE_KEY;

/// XXH3's merge of the accumulators into 64 bits, with the secret's key at `key` and the start value `start`.
fn merge_accs(acc: &[u64; 8], key: usize, start: u64) -> u64 {
    let mut result = start;
    for pair in 0..4 {
        let a = acc[2 * pair] ^ secret_word(key + 16 * pair);
        let b = acc[2 * pair + 1] ^ secret_word(key + 16 * pair + 8);
        let product = u128::from(a) * u128::from(b);
        result = result.wrapping_add(product as u64 ^ (product >> 64) as u64);
    }
    result ^= result >> 37;
    result = result.wrapping_mul(0x1656_6791_9E37_79F9);
    result ^ (result >> 32)
}

/// One stripe, one lane at a time (what the vector kernels do eight lanes at once).
pub fn accumulate_portable(acc: &mut [u64; 8], stripe: &[u8], key: &[u8]) {
    let word = |bytes: &[u8], lane: usize| u64::from_le_bytes(bytes[8 * lane..8 * lane + 8].try_into().expect("8"));
    for lane in 0..8 {
        let data = word(stripe, lane);
        let mixed = data ^ word(key, lane);
        acc[lane ^ 1] = acc[lane ^ 1].wrapping_add(data);
        acc[lane] = acc[lane].wrapping_add((mixed & 0xffff_ffff) * (mixed >> 32));
    }
}

/// XXH3's scramble, one lane at a time.
pub fn scramble_portable(acc: &mut [u64; 8]) {
    for (lane, value) in acc.iter_mut().enumerate() {
        let mixed = (*value ^ (*value >> 47)) ^ secret_word(SCRAMBLE_KEY + 8 * lane);
        *value = mixed.wrapping_mul(PRIME32_1);
    }
}

/// Bytes of one round of the long-input loop (16 stripes).
pub const ROUND_BYTES: usize = STRIPE * STRIPES;

/// The terms of some consecutive stripes of a stream, summed round by round.
///
/// XXH3's long-input loop adds each stripe's term (what `accumulate` adds, from the stripe and its key) to the
/// accumulators, which only the scramble after each round mixes. A round's terms may therefore be summed anywhere
/// and in any order (on a torch device, for example), and chained afterwards (`Long128`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StripeSums {
    /// The stream's number of the first stripe summed.
    pub first: u64,
    /// Stripes summed, from `first` on.
    pub count: u64,
    /// One sum per round with summed stripes, from round `first / STRIPES` on (partial at both ends).
    pub rounds: Vec<[u64; 8]>,
}

impl StripeSums {
    /// Sums the `count` stripes starting `lead` bytes into `data`, the first one being the stream's stripe `first`
    /// (with AVX2 where the CPU has it).
    pub fn of(data: &[u8], lead: usize, first: u64, count: u64) -> Self {
        let rounds = round_sums(&data[lead.min(data.len())..], first, count).map(|(_, sum)| sum).collect();
        StripeSums { first, count, rounds }
    }
}

/// The sums of the `count` stripes at the start of `data`, the first being the stream's stripe `first`, round by
/// round: each round's number and the sum of its stripes there.
fn round_sums(data: &[u8], first: u64, count: u64) -> impl Iterator<Item = (u64, [u64; 8])> + '_ {
    let count = usize::try_from(count).expect("stripes in memory");
    assert!(count * STRIPE <= data.len(), "{count} stripes of {} bytes", data.len());
    let (mut round, mut lane) = (first / STRIPES as u64, (first % STRIPES as u64) as usize);
    let (mut at, mut left) = (0, count);
    std::iter::from_fn(move || {
        if left == 0 {
            return None;
        }
        let stripes = (STRIPES - lane).min(left);
        let sum = round_sum(&data[at..at + stripes * STRIPE], lane);
        let out = (round, sum);
        (at, left, lane, round) = (at + stripes * STRIPE, left - stripes, 0, round + 1);
        Some(out)
    })
}

/// The sum of the terms of the stripes of `data` (whole stripes), the first keyed as stripe `lane` of its round
/// (with AVX2 where the CPU has it: the sum stays in registers from stripe to stripe).
fn round_sum(data: &[u8], lane: usize) -> [u64; 8] {
    let stripes = data.len() / STRIPE;
    assert!(
        data.len().is_multiple_of(STRIPE) && lane + stripes <= STRIPES,
        "{} bytes from stripe {lane} of a round",
        data.len()
    );
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2; `data` holds `stripes` stripes, and their keys lie in the secret (asserted).
        return unsafe { x86::round_sum_avx2(data.as_ptr(), lane, stripes) };
    }
    let mut sum = [0u64; 8];
    for (stripe, key) in data.chunks_exact(STRIPE).zip(lane..) {
        accumulate_portable(&mut sum, stripe, &SECRET[8 * key..8 * key + STRIPE]);
    }
    sum
}

/// The fastest `scramble` of this CPU.
fn scrambler() -> fn(&mut [u64; 8]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return |acc| unsafe { x86::scramble_avx2(acc) };
    }
    scramble_portable
}

/// XXH3-128 (seed 0, the default secret) of a stream longer than 240 bytes, chained from the sums of its stripe
/// terms. The stream's first `regular_stripes(len)` stripes are keyed by their place in their round and summed
/// round by round (`add`, rounds in ascending order); `finish` takes the stream's last 64 bytes, which XXH3 keys
/// apart, and merges.
pub struct Long128 {
    len: u64,
    /// Rounds that are scrambled: every full one before the stream's last stripe.
    full_rounds: u64,
    acc: [u64; 8],
    /// The round whose terms `pending` sums.
    round: u64,
    pending: [u64; 8],
    scramble: fn(&mut [u64; 8]),
}

impl Long128 {
    /// Streams of more than this many bytes are hashed by the long-input loop.
    pub const MIN_LEN: u64 = 241;

    pub fn new(len: u64) -> Self {
        assert!(len >= Self::MIN_LEN, "XXH3's long-input loop hashes streams of 241 bytes or more, not {len}");
        let full_rounds = (len - 1) / ROUND_BYTES as u64;
        Long128 { len, full_rounds, acc: INIT, round: 0, pending: [0; 8], scramble: scrambler() }
    }

    /// Stripes of a stream of `len` bytes summed round by round: every whole one before its last byte.
    pub fn regular_stripes(len: u64) -> u64 {
        (len - 1) / STRIPE as u64
    }

    /// Adds the sum of some stripe terms of round `round`: no earlier round may come after it.
    pub fn add(&mut self, round: u64, sum: &[u64; 8]) {
        assert!(round >= self.round && round <= self.full_rounds, "round {round} after {}", self.round);
        while self.round < round {
            for (acc, term) in self.acc.iter_mut().zip(std::mem::take(&mut self.pending)) {
                *acc = acc.wrapping_add(term);
            }
            (self.scramble)(&mut self.acc);
            self.round += 1;
        }
        for (pending, term) in self.pending.iter_mut().zip(sum) {
            *pending = pending.wrapping_add(*term);
        }
    }

    /// Adds the terms of the `count` stripes at the start of `data`, the first being the stream's stripe `first`,
    /// summed round by round as they are read (what `add_sums` of their `StripeSums` adds, without keeping them).
    pub fn add_stripes(&mut self, data: &[u8], first: u64, count: u64) {
        for (round, sum) in round_sums(data, first, count) {
            self.add(round, &sum);
        }
    }

    /// Adds `StripeSums`, whose rounds must not come before the last one added.
    pub fn add_sums(&mut self, sums: &StripeSums) {
        self.add_rounds(sums.first / STRIPES as u64, &sums.rounds);
    }

    /// Adds the sums of consecutive rounds from `first_round` on, which must not come before the last one added.
    pub fn add_rounds(&mut self, first_round: u64, rounds: &[[u64; 8]]) {
        let Some((head, rest)) = rounds.split_first() else { return };
        self.add(first_round, head);
        // Every later sum starts a round of its own: scramble, then take it.
        assert!(first_round + rest.len() as u64 <= self.full_rounds, "rounds past the stream's end");
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F.
            unsafe { x86::chain_avx512(&mut self.acc, &mut self.pending, rest) };
            self.round += rest.len() as u64;
            return;
        }
        for sum in rest {
            self.add(self.round + 1, sum);
        }
    }

    /// The chain's state (the accumulators, the round `pending` sums, its sums), which `resume` takes up again
    /// elsewhere: a stream hashed a part at a time by several holders in turn (core::digest::TensorHashParts).
    pub fn state(&self) -> ([u64; 8], u64, [u64; 8]) {
        (self.acc, self.round, self.pending)
    }

    /// A chain of a stream of `len` bytes taken up from `state`; None where the round lies past the stream's.
    pub fn resume(len: u64, state: ([u64; 8], u64, [u64; 8])) -> Option<Self> {
        let mut chain = Self::new(len);
        if state.1 > chain.full_rounds {
            return None;
        }
        (chain.acc, chain.round, chain.pending) = state;
        Some(chain)
    }

    /// The hash, given the stream's last 64 bytes, once every regular stripe was added.
    pub fn finish(mut self, last: &[u8]) -> u128 {
        assert_eq!(last.len(), STRIPE, "the last stripe");
        self.add(self.full_rounds, &[0; 8]);
        for (acc, term) in self.acc.iter_mut().zip(self.pending) {
            *acc = acc.wrapping_add(term);
        }
        accumulate_portable(&mut self.acc, last, &SECRET[LAST_STRIPE_KEY..LAST_STRIPE_KEY + STRIPE]);
        let low = merge_accs(&self.acc, MERGE_KEY, self.len.wrapping_mul(PRIME64_1));
        let high = merge_accs(&self.acc, MERGE_KEY_HIGH, !self.len.wrapping_mul(PRIME64_2));
        (u128::from(high) << 64) | u128::from(low)
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

    /// For each of `sums`: adds `pending` to the accumulators, scrambles them, and takes the sum as `pending`
    /// (`Long128::add` of consecutive rounds).
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn chain_avx512(acc: &mut [u64; 8], pending: &mut [u64; 8], sums: &[[u64; 8]]) {
        for sum in sums {
            let total =
                _mm512_add_epi64(_mm512_loadu_si512(acc.as_ptr().cast()), _mm512_loadu_si512(pending.as_ptr().cast()));
            _mm512_storeu_si512(acc.as_mut_ptr().cast(), total);
            scramble_avx512(acc);
            *pending = *sum;
        }
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

    /// The sum of the terms of `stripes` stripes at `data`, the first keyed as stripe `lane` of its round.
    ///
    /// # Safety
    /// `stripes * 64` readable bytes at `data`; `lane + stripes <= 16`; the CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn round_sum_avx2(data: *const u8, lane: usize, stripes: usize) -> [u64; 8] {
        let mut sums = [_mm256_setzero_si256(); 2];
        for stripe in 0..stripes {
            let (data, key) = (data.add(64 * stripe), super::SECRET.as_ptr().add(8 * (lane + stripe)));
            for (half, sum) in sums.iter_mut().enumerate() {
                let data = _mm256_loadu_si256(data.add(32 * half).cast());
                let mixed = _mm256_xor_si256(data, _mm256_loadu_si256(key.add(32 * half).cast()));
                let product = _mm256_mul_epu32(mixed, _mm256_srli_epi64::<32>(mixed));
                let swapped = _mm256_shuffle_epi32::<0x4e>(data);
                *sum = _mm256_add_epi64(product, _mm256_add_epi64(*sum, swapped));
            }
        }
        let mut out = [0u64; 8];
        _mm256_storeu_si256(out.as_mut_ptr().cast(), sums[0]);
        _mm256_storeu_si256(out.as_mut_ptr().add(4).cast(), sums[1]);
        out
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

    #[test]
    fn stripe_sums_chained_give_xxh3_128() {
        let mut next = crate::core::testing::xorshift(0x5eed);
        let data: Vec<u8> = (0..70_000).map(|_| next() as u8).collect();
        for len in [241usize, 255, 256, 1023, 1024, 1025, 1088, 2048, 4097, 65_536, 70_000] {
            let bytes = &data[..len];
            let want = xxhash_rust::xxh3::xxh3_128(bytes);
            let regular = Long128::regular_stripes(len as u64);
            // Cut the regular stripes into parts at every kind of place: whole, at round edges, inside rounds.
            for cuts in [vec![], vec![1], vec![16, 17], vec![5, 31, 32, 48], (1..regular).step_by(7).collect()] {
                // Each part as `StripeSums` and as stripes added straight away.
                let (mut summed, mut added) = (Long128::new(len as u64), Long128::new(len as u64));
                let mut start = 0u64;
                for end in cuts.into_iter().filter(|&c| c < regular).chain([regular]) {
                    let at = start as usize * STRIPE;
                    summed.add_sums(&StripeSums::of(&bytes[at..], 0, start, end - start));
                    added.add_stripes(&bytes[at..], start, end - start);
                    start = end;
                }
                assert_eq!(summed.finish(&bytes[len - STRIPE..]), want, "{len} bytes");
                assert_eq!(added.finish(&bytes[len - STRIPE..]), want, "{len} bytes, stripes added");
            }
        }
    }

    #[test]
    fn every_way_of_chaining_agrees() {
        let mut next = crate::core::testing::xorshift(0xabc);
        let data: Vec<u8> = (0..200 * STRIPE).map(|_| next() as u8).collect();
        // Rounds added one at a time (the chain without AVX-512) give what `add_sums` gives.
        let len = 5000u64;
        let sums = StripeSums::of(&data, 0, 0, Long128::regular_stripes(len));
        let mut one_by_one = Long128::new(len);
        for (round, sum) in sums.rounds.iter().enumerate() {
            one_by_one.add(round as u64, sum);
        }
        let last = &data[len as usize - STRIPE..len as usize];
        assert_eq!(one_by_one.finish(last), xxhash_rust::xxh3::xxh3_128(&data[..len as usize]));
    }

    #[test]
    fn a_rounds_sum_is_its_stripes_terms_from_any_lane() {
        let mut next = crate::core::testing::xorshift(0x51de);
        let data: Vec<u8> = (0..ROUND_BYTES).map(|_| next() as u8).collect();
        for lane in 0..STRIPES {
            for stripes in 0..=STRIPES - lane {
                let mut want = [0u64; 8];
                for (stripe, key) in data.chunks_exact(STRIPE).take(stripes).zip(lane..) {
                    accumulate_portable(&mut want, stripe, &SECRET[8 * key..8 * key + STRIPE]);
                }
                assert_eq!(round_sum(&data[..stripes * STRIPE], lane), want, "{stripes} stripes from lane {lane}");
            }
        }
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
