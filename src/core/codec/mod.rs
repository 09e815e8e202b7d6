//! Every stream format of a tensor delta, both directions: the two streams of a tensor (changed positions and
//! their values), each in a codec named in the file's per-tensor metadata, so new ones slot in beside these.
//!
//! Positions: `varint` (LEB128 gaps), `rice` (Golomb-Rice gaps), `context` (Rice gaps per class of the base). Values: `abs`, `diff` (byte-aligned, `values`),
//! `diffbits` (bit-packed), `rans` (entropy-coded). `bits` and `elements` are their shared pieces; `ranges` joins
//! the scan's ranges into `varint` streams, `plan` picks the compact codec's streams, `decode` reads any pair.

pub mod bits;
pub mod classvalues;
pub mod context;
pub mod decode;
pub mod diffbits;
pub mod elements;
pub mod pairs;
pub mod plan;
pub mod ranges;
pub mod rans;
pub mod rice;
pub mod values;
pub mod varint;

/// Runs `$body` with `$W` a `const usize` equal to the element width `$width` (1, 2 or 4; 8 for any other), so
/// that code generic over `const W: usize` is picked once per tensor, not branched on per element.
macro_rules! with_width {
    ($width:expr, $W:ident => $body:expr) => {
        match $width {
            1 => {
                const $W: usize = 1;
                $body
            }
            2 => {
                const $W: usize = 2;
                $body
            }
            4 => {
                const $W: usize = 4;
                $body
            }
            _ => {
                const $W: usize = 8;
                $body
            }
        }
    };
}
pub(crate) use with_width;

/// A byte buffer written through unaligned 8-byte stores, as the scan kernel's: the encoders that run inside the
/// kernel (`varint::put`, `values::put_diff`) append through it without a length check per byte.
pub trait WordSink {
    /// Stores the 8 little-endian bytes of `word` and keeps the first `len` (≤ 8).
    ///
    /// # Safety
    /// The sink has room for 8 bytes past its end.
    unsafe fn put(&mut self, word: u64, len: usize);
}

use serde::{Deserialize, Serialize};

/// The position after a gap: `next_allowed + gap`, which must lie below `numel`; moves `next_allowed` past it.
/// Every position codec decodes through this one check.
#[inline(always)]
/// `count` zeroed values, or an error where they cannot be allocated: a record's declared count, before any target
/// bounds it, must never abort the process (a failed allocation does, in Rust).
pub fn zeroed_values(count: u64) -> Result<Vec<u64>, String> {
    let too_many = || format!("{count} values do not fit in memory");
    let n = usize::try_from(count).map_err(|_| too_many())?;
    let mut values = Vec::new();
    values.try_reserve_exact(n).map_err(|_| too_many())?;
    values.resize(n, 0);
    Ok(values)
}

pub fn next_position(next_allowed: &mut u64, gap: u64, numel: u64) -> Result<u64, String> {
    let position = next_allowed
        .checked_add(gap)
        .filter(|&p| p < numel)
        .ok_or_else(|| format!("position out of range (tensor has {numel} elements)"))?;
    *next_allowed = position + 1;
    Ok(position)
}

/// How the changed positions are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PositionCodec {
    /// LEB128 varints of the gaps `p[k] - p[k-1] - 1`, with `p[-1] = -1`.
    Varint,
    /// Golomb-Rice codes of the same gaps, with a per-tensor parameter (the `compact` codec).
    Rice,
    /// Rice codes of ranks within classes of the base's elements (core::codec::context); decoded only against the
    /// exact base.
    Context,
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
    /// The same difference in a bit-packed prefix code: 2 bits for ±1, 3 for ±2 (the `compact` codec).
    DiffBits,
    /// The same difference entropy-coded: static rANS over a per-tensor frequency table (the `compact` codec).
    Rans,
    /// The same difference entropy-coded with a `rans` table per group of the base's exponent classes
    /// (core::codec::classvalues); only beside `context` positions, and decoded only against the exact base.
    #[serde(rename = "rans_classes")]
    RansClasses,
}

/// Which family of stream codecs a diff writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Codec {
    /// Byte-aligned streams: `varint` positions, `diff` or `abs` values, in the named layout of version 1. Read
    /// by every reader, version-1 readers included.
    Varint,
    /// Bit-packed streams: `rice` positions, `diffbits` or `rans` values, each chosen per tensor only when smaller
    /// than its `varint`/`diff` counterpart (and `rans` only when smaller than `diffbits` too), in the packed
    /// layout of version 2. The default: the smallest files, read by every reader of this version.
    #[default]
    Compact,
    /// `compact`, with `context` positions (classes of the base's elements) for every float tensor where they are
    /// smaller than `rice`. Opt-in: read by readers of this version only, and only against the exact base.
    Context,
}

impl Codec {
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "varint" => Some(Codec::Varint),
            "compact" => Some(Codec::Compact),
            "context" => Some(Codec::Context),
            _ => None,
        }
    }
}

impl PositionCodec {
    pub fn name(self) -> &'static str {
        match self {
            PositionCodec::Varint => "varint",
            PositionCodec::Rice => "rice",
            PositionCodec::Context => "context",
            PositionCodec::All => "all",
        }
    }
}

impl ValueCodec {
    pub fn name(self) -> &'static str {
        match self {
            ValueCodec::Abs => "abs",
            ValueCodec::Diff => "diff",
            ValueCodec::DiffBits => "diffbits",
            ValueCodec::Rans => "rans",
            ValueCodec::RansClasses => "rans_classes",
        }
    }

    /// True when the decoded values are wrapping bit-pattern differences to add to the base, false when they
    /// are the new bits. Every writer of changes, in Rust and in Python, takes this rule from here.
    pub fn holds_differences(self) -> bool {
        // Exhaustive, so that a new value codec has to say which it holds.
        match self {
            ValueCodec::Abs => false,
            ValueCodec::Diff | ValueCodec::DiffBits | ValueCodec::Rans | ValueCodec::RansClasses => true,
        }
    }

    /// The value codecs a caller may ask a diff for (`diffbits`, `rans` and `rans_classes` are chosen per tensor,
    /// never asked).
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "abs" => Some(ValueCodec::Abs),
            "diff" => Some(ValueCodec::Diff),
            _ => None,
        }
    }
}
