//! Deterministic test data shared by the integration tests (each test file is its own crate and includes this
//! module; not every one uses every item).
#![allow(dead_code)]

/// A xorshift64 generator: fast, deterministic, and good enough to scatter changes (`seed` must not be 0).
pub fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut state = seed;
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}

/// `len` bytes that look random (the high bits of a multiplicative hash of each index): a base state to change.
pub fn hashed_bytes(len: usize) -> Vec<u8> {
    (0..len).map(|i| ((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) as u8).collect()
}
