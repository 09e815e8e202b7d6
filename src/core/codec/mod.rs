//! Codecs for the two streams of a tensor delta: changed positions and their values.
//! Each codec is named in the file's per-tensor metadata, so new ones slot in beside these.

pub mod values;
pub mod varint;

use serde::{Deserialize, Serialize};

/// How the changed positions are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PositionCodec {
    /// LEB128 varints of the gaps `p[k] - p[k-1] - 1`, with `p[-1] = -1`.
    Varint,
    /// Every element is present in row-major order; there is no position stream.
    All,
}

/// How the values of the changed elements are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ValueCodec {
    /// The new raw element bytes, little-endian.
    Abs,
    /// The wrapping difference of bit patterns (new - old), one signed byte or an escape.
    Diff,
}

impl PositionCodec {
    pub fn name(self) -> &'static str {
        match self {
            PositionCodec::Varint => "varint",
            PositionCodec::All => "all",
        }
    }
}

impl ValueCodec {
    pub fn name(self) -> &'static str {
        match self {
            ValueCodec::Abs => "abs",
            ValueCodec::Diff => "diff",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "abs" => Some(ValueCodec::Abs),
            "diff" => Some(ValueCodec::Diff),
            _ => None,
        }
    }
}
