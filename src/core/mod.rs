//! The plain-Rust core of deltasync-rs: bit-compare, codecs, the safetensors container and apply.
//! Nothing under `core` knows about Python.

pub mod anchors;
pub mod apply;
pub mod base;
pub mod checkpoint;
pub mod codec;
pub mod delta;
pub mod diff;
pub mod digest;
pub mod dtype;
pub mod error;
pub mod files;
pub mod format;
pub mod mirror;
pub mod pool;
pub mod records;
pub mod scan;
pub mod shards;
pub mod stream;
#[cfg(test)]
pub(crate) mod testing;
pub mod trl;
pub mod xxh3;

pub use delta::{Delta, TensorDelta};
pub use error::{Error, Result};
