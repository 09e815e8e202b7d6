//! Deterministic test data shared by the core's unit tests (tests/common/mod.rs is the integration tests' twin).

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
