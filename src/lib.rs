//! deltasync-rs: bit-exact sparse deltas of model weights.
//!
//! `core` is plain Rust with no Python in it; `bindings` (feature `python`) is the PyO3 layer that
//! converts arguments, releases the GIL around core calls and maps errors.

#[cfg(feature = "python")]
mod bindings;
pub mod core;
