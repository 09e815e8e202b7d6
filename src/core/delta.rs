//! The in-memory delta: per tensor, its encoded position and value streams plus what is needed to check them.

use std::collections::BTreeMap;

use rayon::prelude::*;

use crate::core::codec::compact::{self, BitReader, RiceReader};
use crate::core::codec::rans::{self, RansReader};
use crate::core::codec::values::ValueReader;
use crate::core::codec::varint::{self, PositionReader};
use crate::core::codec::{PositionCodec, PositionSource, ValueCodec};
use crate::core::dtype::{self, Dtype};
use crate::core::error::{Error, Result};
use crate::core::stream::Stream;

/// Changes per `for_each_batch` call.
pub const BATCH: usize = 64;

/// The changes to one tensor.
#[derive(Debug, Clone)]
pub struct TensorDelta {
    pub name: String,
    pub dtype: Dtype,
    /// None only for deltas imported from TRL files, which do not record shapes.
    pub shape: Option<Vec<u64>>,
    pub changed: u64,
    pub positions_codec: PositionCodec,
    pub values_codec: ValueCodec,
    /// Empty when `positions_codec` is `All` or nothing changed.
    pub positions: Stream,
    pub values: Stream,
    /// The largest changed position, known once the streams have been checked.
    pub last_position: Option<u64>,
    /// The base identity of the tensor before the change (core::base), for records that apply to one base only.
    pub base: Option<u64>,
    /// For a tensor stored whole (where `changed` counts every element): how many elements differ from the base,
    /// when the writer knew and fewer than all did.
    pub differing: Option<u64>,
}

impl TensorDelta {
    pub fn width(&self) -> usize {
        dtype::width_of(self.dtype).expect("dtype checked on construction")
    }

    pub fn numel(&self) -> Option<u64> {
        self.shape.as_deref().and_then(dtype::numel)
    }

    /// Bytes of encoded streams.
    pub fn nbytes(&self) -> u64 {
        (self.positions.len() + self.values.len()) as u64
    }

    /// This tensor stored whole instead of as changes: positions `all`, values `abs` (`data`, the whole new
    /// tensor's bytes).
    pub fn into_whole(self, data: &[u8]) -> TensorDelta {
        let changed = (data.len() / self.width()) as u64;
        TensorDelta {
            changed,
            differing: (self.changed < changed).then_some(self.changed),
            positions_codec: PositionCodec::All,
            values_codec: ValueCodec::Abs,
            positions: Stream::empty(),
            values: data.to_vec().into(),
            last_position: changed.checked_sub(1),
            // A whole tensor applies to any base.
            base: None,
            ..self
        }
    }

    /// Elements that differ from the base: `changed`, but for a tensor stored whole where fewer differ.
    pub fn num_changed(&self) -> u64 {
        self.differing.unwrap_or(self.changed)
    }

    /// True when the tensor is stored whole: every element, new raw values.
    pub fn is_dense(&self) -> bool {
        self.positions_codec == PositionCodec::All && self.values_codec == ValueCodec::Abs
    }

    /// True when both carry the same changes to tensors of the same dtype and shape (as tied weights do), so
    /// applying one is applying the other.
    pub fn same_changes(&self, other: &TensorDelta) -> bool {
        self.dtype == other.dtype
            && self.shape == other.shape
            && self.changed == other.changed
            && self.positions_codec == other.positions_codec
            && self.values_codec == other.values_codec
            && self.positions[..] == other.positions[..]
            && self.values[..] == other.values[..]
    }

    /// Walks every change in order, calling `visit(position, value)`; checks the streams fully.
    /// `value` is the raw new bits for `abs` and the wrapping difference for `diff`.
    pub fn for_each_change(&self, visit: impl FnMut(u64, u64)) -> std::result::Result<(), String> {
        match self.width() {
            1 => self.walk::<1>(visit),
            2 => self.walk::<2>(visit),
            4 => self.walk::<4>(visit),
            _ => self.walk::<8>(visit),
        }
    }

    /// `for_each_change` in batches of up to `BATCH` changes: `visit(positions, values)`. The compact codec is
    /// decoded several codes per loaded word here; other codecs are gathered from the walk.
    pub fn for_each_batch(&self, visit: impl FnMut(&[u64], &[u64])) -> std::result::Result<(), String> {
        match self.width() {
            1 => self.walk_batches::<1>(visit),
            2 => self.walk_batches::<2>(visit),
            4 => self.walk_batches::<4>(visit),
            _ => self.walk_batches::<8>(visit),
        }
    }

    fn walk_batches<const W: usize>(&self, mut visit: impl FnMut(&[u64], &[u64])) -> std::result::Result<(), String> {
        let (mut positions, mut values) = ([0u64; BATCH], [0u64; BATCH]);
        if self.positions_codec == PositionCodec::Rice && self.values_codec == ValueCodec::DiffBits {
            let numel = self.numel().unwrap_or(u64::MAX);
            if self.changed > numel {
                return Err(format!("changed={} exceeds the {numel} elements", self.changed));
            }
            let mut position_reader = RiceReader::new(&self.positions, numel)?;
            let mut value_bits = BitReader::new(&self.values);
            let mut left = self.changed;
            while left > 0 {
                let n = left.min(BATCH as u64) as usize;
                compact::read_pairs::<W>(&mut position_reader, &mut value_bits, &mut positions[..n], &mut values[..n])?;
                visit(&positions[..n], &values[..n]);
                left -= n as u64;
            }
            if !position_reader.is_exhausted() {
                return Err("position stream has bytes after the last change".to_owned());
            }
            if !value_bits.is_exhausted() {
                return Err("value stream has bytes after the last change".to_owned());
            }
            return Ok(());
        }
        if self.positions_codec == PositionCodec::Rice && self.values_codec == ValueCodec::Rans {
            let numel = self.numel().unwrap_or(u64::MAX);
            if self.changed > numel {
                return Err(format!("changed={} exceeds the {numel} elements", self.changed));
            }
            let mut position_reader = RiceReader::new(&self.positions, numel)?;
            let mut value_reader = RansReader::new(&self.values, W)?;
            let mut left = self.changed;
            while left > 0 {
                let n = left.min(BATCH as u64) as usize;
                compact::read_positions(&mut position_reader, &mut positions[..n])?;
                value_reader.read_values::<W>(&mut values[..n])?;
                visit(&positions[..n], &values[..n]);
                left -= n as u64;
            }
            if !position_reader.is_exhausted() {
                return Err("position stream has bytes after the last change".to_owned());
            }
            if !value_reader.is_exhausted() {
                return Err(
                    "value stream has bytes after the last change, or a rans end other than its start".to_owned()
                );
            }
            return Ok(());
        }
        let mut filled = 0;
        self.walk::<W>(|position, value| {
            positions[filled] = position;
            values[filled] = value;
            filled += 1;
            if filled == BATCH {
                visit(&positions, &values);
                filled = 0;
            }
        })?;
        if filled > 0 {
            visit(&positions[..filled], &values[..filled]);
        }
        Ok(())
    }

    fn walk<const W: usize>(&self, mut visit: impl FnMut(u64, u64)) -> std::result::Result<(), String> {
        let width = W;
        let numel = self.numel().unwrap_or(u64::MAX);
        let mut values = ValueReader::<W>::new(&self.values, self.values_codec)?;
        match self.positions_codec {
            PositionCodec::All => {
                if self.shape.is_none() {
                    return Err("positions 'all' need a known shape".to_owned());
                }
                if self.changed != numel {
                    return Err(format!("positions 'all' but changed={} for {numel} elements", self.changed));
                }
                if !self.positions.is_empty() {
                    return Err("positions 'all' with a position stream".to_owned());
                }
                for position in 0..numel {
                    visit(position, values.next_value()?);
                }
            }
            PositionCodec::Varint | PositionCodec::Rice => {
                if self.changed > numel {
                    return Err(format!("changed={} exceeds the {numel} elements", self.changed));
                }
                if self.values_codec == ValueCodec::Abs
                    && Some(self.values.len() as u64) != self.changed.checked_mul(width as u64)
                {
                    return Err(format!(
                        "value stream has {} bytes, expected {} x {width}",
                        self.values.len(),
                        self.changed
                    ));
                }
                if self.positions_codec == PositionCodec::Varint {
                    walk_stream(self.changed, PositionReader::new(&self.positions, numel), &mut values, &mut visit)?;
                } else {
                    walk_stream(self.changed, RiceReader::new(&self.positions, numel)?, &mut values, &mut visit)?;
                }
            }
        }
        if !values.is_exhausted() {
            return Err("value stream has bytes after the last change".to_owned());
        }
        Ok(())
    }

    /// Checks the streams end to end and records the last position.
    pub fn validate(&mut self, source_name: &str) -> Result<()> {
        let fail = |message: String| Error::format(source_name, format!("tensor {:?}: {message}", self.name));
        if self.is_dense() {
            // A whole tensor: its only invariant is the byte count, so skip the walk.
            let numel = self.numel().ok_or_else(|| fail("a dense tensor needs a known shape".to_owned()))?;
            let expected = numel.checked_mul(self.width() as u64);
            if self.changed != numel || !self.positions.is_empty() || expected != Some(self.values.len() as u64) {
                return Err(fail(format!(
                    "a dense tensor of {numel} elements must record changed={numel} and hold {} bytes, \
                     but records changed={} and holds {} bytes",
                    expected.unwrap_or(u64::MAX),
                    self.changed,
                    self.values.len()
                )));
            }
            self.last_position = numel.checked_sub(1);
            return Ok(());
        }
        if self.positions_codec == PositionCodec::All {
            // `all` positions with a value codec other than `abs`: the walk states what is wrong.
            let mut last = None;
            self.for_each_change(|position, _| last = Some(position)).map_err(fail)?;
            self.last_position = last;
            return Ok(());
        }
        self.last_position = self.check_streams().map_err(fail)?;
        Ok(())
    }

    /// Checks a `varint` or `rice` position stream and its value stream with the same rules as the walk, and
    /// returns the last position. The bit-packed pair (`rice`, `diffbits`) is checked in one loop, so that the
    /// two streams' decoding chains overlap; other streams apart, side by side, without pairing them.
    fn check_streams(&self) -> std::result::Result<Option<u64>, String> {
        let numel = self.numel().unwrap_or(u64::MAX);
        if self.changed > numel {
            return Err(format!("changed={} exceeds the {numel} elements", self.changed));
        }
        if self.positions_codec == PositionCodec::Rice && self.values_codec == ValueCodec::DiffBits {
            let (positions, values, changed) = (&self.positions[..], &self.values[..], self.changed);
            return match self.width() {
                1 => compact::check_rice_diffbits::<1>(positions, values, changed, numel),
                2 => compact::check_rice_diffbits::<2>(positions, values, changed, numel),
                4 => compact::check_rice_diffbits::<4>(positions, values, changed, numel),
                _ => compact::check_rice_diffbits::<8>(positions, values, changed, numel),
            };
        }
        let check_positions = || -> std::result::Result<Option<u64>, String> {
            if self.positions_codec == PositionCodec::Rice {
                return compact::check_rice(&self.positions, self.changed, numel);
            }
            let (count, sum) = varint::count_and_sum(&self.positions).map_err(|e| match e {
                varint::ReadError::Truncated => "position stream ends early".to_owned(),
                varint::ReadError::Overflow => "a position varint overflows 64 bits".to_owned(),
            })?;
            match count.cmp(&self.changed) {
                std::cmp::Ordering::Less => return Err("position stream ends early".to_owned()),
                std::cmp::Ordering::Greater => return Err("position stream has bytes after the last change".to_owned()),
                std::cmp::Ordering::Equal => {}
            }
            // Each position is the previous one plus one plus its gap.
            let last = sum.and_then(|sum| sum.checked_add(count)).filter(|&end| end <= numel);
            match last {
                Some(end) => Ok(end.checked_sub(1)),
                None => Err(format!("position out of range (tensor has {numel} elements)")),
            }
        };
        let check_values = || match self.width() {
            1 => check_value_stream::<1>(&self.values, self.values_codec, self.changed),
            2 => check_value_stream::<2>(&self.values, self.values_codec, self.changed),
            4 => check_value_stream::<4>(&self.values, self.values_codec, self.changed),
            _ => check_value_stream::<8>(&self.values, self.values_codec, self.changed),
        };
        let (last, values) = rayon::join(check_positions, check_values);
        values?;
        last
    }
}

/// Checks that a value stream holds exactly `changed` entries.
fn check_value_stream<const W: usize>(
    bytes: &[u8],
    codec: ValueCodec,
    changed: u64,
) -> std::result::Result<(), String> {
    let width = W;
    if codec == ValueCodec::DiffBits {
        return compact::check_diffbits::<W>(bytes, changed);
    }
    if codec == ValueCodec::Rans {
        return rans::check_rans::<W>(bytes, changed);
    }
    let end = match codec {
        ValueCodec::Abs => {
            changed.checked_mul(width as u64).map_or(usize::MAX, |n| usize::try_from(n).unwrap_or(usize::MAX))
        }
        _ if width == 1 => changed.try_into().unwrap_or(usize::MAX),
        _ => {
            // Every byte between escapes is a whole value: jump from escape to escape.
            let (mut at, mut seen) = (0usize, 0u64);
            while seen < changed {
                let Some(&first) = bytes.get(at) else {
                    return Err("value stream ends early".to_owned());
                };
                if first == crate::core::codec::values::ESCAPE {
                    at += 1 + width;
                    seen += 1;
                    continue;
                }
                let run = memchr::memchr(crate::core::codec::values::ESCAPE, &bytes[at..]).unwrap_or(bytes.len() - at);
                let take = (run as u64).min(changed - seen);
                at += take as usize;
                seen += take;
            }
            at
        }
    };
    match end.cmp(&bytes.len()) {
        std::cmp::Ordering::Greater => Err("value stream ends early".to_owned()),
        std::cmp::Ordering::Less => Err("value stream has bytes after the last change".to_owned()),
        std::cmp::Ordering::Equal => Ok(()),
    }
}

fn walk_stream<const W: usize>(
    changed: u64,
    mut positions: impl PositionSource,
    values: &mut ValueReader<'_, W>,
    visit: &mut impl FnMut(u64, u64),
) -> std::result::Result<(), String> {
    for _ in 0..changed {
        visit(positions.next_position()?, values.next_value()?);
    }
    if !positions.is_exhausted() {
        return Err("position stream has bytes after the last change".to_owned());
    }
    Ok(())
}

/// A set of tensor deltas plus file-level metadata.
#[derive(Debug, Clone, Default)]
pub struct Delta {
    pub tensors: Vec<TensorDelta>,
    pub step: Option<u64>,
    pub base_step: Option<u64>,
    /// Caller-supplied string metadata, stored in the file header beside the reserved keys.
    pub metadata: BTreeMap<String, String>,
    /// Written in the packed layout (docs/format.md §4.1) unless every tensor is stored whole: set by the writers
    /// of the `compact` codec, and by loading a packed file.
    pub packed: bool,
}

impl Delta {
    /// An anchor holds every tensor whole, so it applies to any base.
    pub fn is_anchor(&self) -> bool {
        !self.tensors.is_empty() && self.tensors.iter().all(TensorDelta::is_dense)
    }

    // The sums saturate instead of wrapping; a loaded file's declared sizes are checked so that they fit
    // (core::format's reader).
    pub fn num_changed(&self) -> u64 {
        self.tensors.iter().map(TensorDelta::num_changed).fold(0, u64::saturating_add)
    }

    /// Elements covered, counting only tensors whose shape is known.
    pub fn num_elements(&self) -> u64 {
        self.tensors.iter().filter_map(TensorDelta::numel).fold(0, u64::saturating_add)
    }

    pub fn nbytes(&self) -> u64 {
        self.tensors.iter().map(TensorDelta::nbytes).fold(0, u64::saturating_add)
    }

    /// Checks every tensor's streams, in parallel, and rejects duplicate names.
    pub fn validate(&mut self, source_name: &str) -> Result<()> {
        let mut seen = std::collections::HashSet::new();
        for tensor in &self.tensors {
            if !seen.insert(tensor.name.as_str()) {
                return Err(Error::format(source_name, format!("tensor {:?} appears twice", tensor.name)));
            }
        }
        crate::core::pool::install(|| self.tensors.par_iter_mut().try_for_each(|tensor| tensor.validate(source_name)))
    }

    pub fn position_of(&self, name: &str) -> Option<usize> {
        self.tensors.iter().position(|t| t.name == name)
    }

    /// Adds tensors, refusing (before adding any) a name that is already in the delta or twice among them.
    pub fn extend(&mut self, tensors: Vec<TensorDelta>) -> Result<()> {
        let mut seen: std::collections::HashSet<&str> = self.tensors.iter().map(|t| t.name.as_str()).collect();
        for tensor in &tensors {
            if !seen.insert(tensor.name.as_str()) {
                return Err(Error::invalid(format!("tensor {:?} is already in this delta", tensor.name)));
            }
        }
        self.tensors.extend(tensors);
        Ok(())
    }
}
