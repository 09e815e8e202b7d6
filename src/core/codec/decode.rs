//! Reading a tensor's two streams back, for every pair of codecs: the walk change by change, the walk in batches
//! (with the fast decoders of the bit-packed codecs), and the end-to-end check of a loaded tensor.

use super::bits::BitReader;
use super::classvalues;
use super::context::{self, Exponent};
use super::pairs;
use super::rans::{self, RansReader};
use super::rice::{self, RiceReader};
use super::varint::{self, PositionReader};
use super::{diffbits, values, with_width, PositionCodec, ValueCodec};

/// Changes per `for_each_batch` call.
pub const BATCH: usize = 64;

/// A `context` tensor's changes, decoded against its base before anything is written: the positions, ascending,
/// and the values where they too are decoded by class (`rans_classes`); None to read them from the value stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContextChanges {
    pub positions: Vec<u64>,
    pub values: Option<Vec<u64>>,
}

/// A `context` tensor read without its base, for a reader that holds only part of the base and finds the classes
/// of its own elements itself (docs/format.md §5.2, "A reader holding part of the base"): every class's listed
/// ranks, and the values by group of classes (`rans_classes`; otherwise one group, every class in it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextParts {
    pub listed: context::Listed,
    /// The group of every class.
    pub group_of: [u8; context::CLASSES],
    /// Per group, its values in change order: the new bits (`abs`) or wrapping differences (the others).
    pub values: Vec<Vec<u64>>,
}

/// A tensor's streams as stored, with what it takes to read them.
#[derive(Clone, Copy)]
pub struct EncodedTensor<'a> {
    /// Bytes per element: 1, 2, 4 or 8.
    pub width: usize,
    /// Where the dtype keeps its exponent, for `context` positions; None for dtypes without one.
    pub exponent: Option<Exponent>,
    /// The tensor's bytes before the change, which `context` positions are decoded against; None where the caller
    /// has not given them (the other codecs do not need them).
    pub base: Option<&'a [u8]>,
    /// A `context` tensor's changes, already decoded against its base (core::apply decodes every tensor's before
    /// writing any); None to decode them from `base`.
    pub decoded: Option<&'a ContextChanges>,
    /// Elements of the tensor; None where its shape is not known.
    pub numel: Option<u64>,
    pub changed: u64,
    pub positions_codec: PositionCodec,
    pub values_codec: ValueCodec,
    pub positions: &'a [u8],
    pub values: &'a [u8],
}

/// A decoder of a position stream: strictly increasing positions, each checked against the element count.
pub trait PositionSource {
    fn next_position(&mut self) -> Result<u64, String>;
    /// True once the stream has been read to its end, with nothing left over.
    fn is_exhausted(&self) -> bool;
}

impl PositionSource for PositionReader<'_> {
    #[inline(always)]
    fn next_position(&mut self) -> Result<u64, String> {
        PositionReader::next_position(self)
    }
    fn is_exhausted(&self) -> bool {
        PositionReader::is_exhausted(self)
    }
}

/// Positions decoded beforehand (`context`), handed out in order.
struct Decoded<'a> {
    positions: std::slice::Iter<'a, u64>,
}

impl PositionSource for Decoded<'_> {
    #[inline(always)]
    fn next_position(&mut self) -> Result<u64, String> {
        self.positions.next().copied().ok_or_else(|| "position stream ended early".to_owned())
    }
    fn is_exhausted(&self) -> bool {
        self.positions.len() == 0
    }
}

impl PositionSource for RiceReader<'_> {
    #[inline(always)]
    fn next_position(&mut self) -> Result<u64, String> {
        RiceReader::next_position(self)
    }
    fn is_exhausted(&self) -> bool {
        RiceReader::is_exhausted(self)
    }
}

/// Reads values one by one, in any value codec: the raw new bits (`abs`) or the wrapping difference (the others).
pub struct ValueReader<'a, const W: usize> {
    bytes: &'a [u8],
    at: usize,
    codec: ValueCodec,
    /// Used by `diffbits` only.
    bits: BitReader<'a>,
    /// Used by `rans` only.
    rans: Option<RansReader<'a>>,
}

impl<'a, const W: usize> ValueReader<'a, W> {
    /// Fails where a `rans` stream's table or initial state is bad, and for `rans_classes`, whose values are read
    /// with their classes (`EncodedTensor::context_changes`).
    pub fn new(bytes: &'a [u8], codec: ValueCodec) -> Result<Self, String> {
        if codec == ValueCodec::RansClasses {
            return Err("values 'rans_classes' are decoded with their classes, from 'context' positions".to_owned());
        }
        let rans = if codec == ValueCodec::Rans { Some(RansReader::new(bytes, W)?) } else { None };
        Ok(ValueReader { bytes, at: 0, codec, bits: BitReader::new(bytes), rans })
    }

    /// The next value as `W` low bytes of a u64.
    #[inline(always)]
    pub fn next_value(&mut self) -> Result<u64, String> {
        match self.codec {
            ValueCodec::Abs => values::read_abs::<W>(self.bytes, &mut self.at),
            ValueCodec::Diff => values::read_diff::<W>(self.bytes, &mut self.at),
            ValueCodec::DiffBits => diffbits::read_difference::<W>(&mut self.bits),
            ValueCodec::Rans => self.rans.as_mut().expect("made with the codec").next_value::<W>(),
            ValueCodec::RansClasses => unreachable!("refused by ValueReader::new"),
        }
    }

    /// True once every byte has been consumed (for `diffbits`: every bit, with zero padding; for `rans`: with the
    /// state back at its start).
    pub fn is_exhausted(&self) -> bool {
        match self.codec {
            ValueCodec::DiffBits => self.bits.is_exhausted(),
            ValueCodec::Rans => self.rans.as_ref().is_some_and(RansReader::is_exhausted),
            _ => self.at == self.bytes.len(),
        }
    }
}

impl<'a> EncodedTensor<'a> {
    fn numel_or_max(&self) -> u64 {
        self.numel.unwrap_or(u64::MAX)
    }

    /// The exponent field of a `context` tensor's dtype.
    fn context_field(&self) -> Result<Exponent, String> {
        self.exponent.ok_or_else(|| "positions 'context' need a BF16, F16 or F32 tensor".to_owned())
    }

    /// A `context` tensor's changes, decoded against the base the caller gave (or as decoded beforehand).
    pub fn context_changes(&self) -> Result<std::borrow::Cow<'a, ContextChanges>, String> {
        if let Some(decoded) = self.decoded {
            return Ok(std::borrow::Cow::Borrowed(decoded));
        }
        let field = self.context_field()?;
        let base = self.base.ok_or_else(|| {
            "positions 'context' are decoded against the base tensor, and none was given (apply the delta to \
             its target, which holds the base)"
                .to_owned()
        })?;
        if base.len() % self.width != 0
            || self.numel.is_some_and(|n| Some(n) != (base.len() as u64).checked_div(self.width as u64))
        {
            return Err(format!("the base holds {} bytes, which does not fit the tensor", base.len()));
        }
        self.check_changed()?;
        let positions = context::decode(self.positions, field, base, self.changed)?;
        let values = match self.values_codec {
            ValueCodec::RansClasses => {
                let classes = context::classes_at(self.positions, field, base, &positions)?;
                Some(with_width!(self.width, W => classvalues::decode::<W>(self.values, &classes))?)
            }
            _ => None,
        };
        Ok(std::borrow::Cow::Owned(ContextChanges { positions, values }))
    }

    /// A `context` tensor's exponent field and element count, for the readers that hold part of its base.
    fn context_part_reader(&self) -> Result<(Exponent, u64), String> {
        if self.positions_codec != PositionCodec::Context {
            return Err(format!("positions are '{}', not 'context'", self.positions_codec.name()));
        }
        Ok((self.context_field()?, self.numel.ok_or("positions 'context' need the tensor's shape")?))
    }

    /// A `context` tensor's streams read without the base (`ContextParts`), both checked to their ends.
    pub fn context_parts(&self) -> Result<ContextParts, String> {
        let (field, numel) = self.context_part_reader()?;
        self.check_changed()?;
        let listed = context::listed(self.positions, field, self.changed, numel)?;
        let (group_of, values) = match self.values_codec {
            ValueCodec::RansClasses => {
                with_width!(self.width, W => classvalues::by_group::<W>(self.values, self.changed))?
            }
            _ => ([0; context::CLASSES], vec![with_width!(self.width, W => self.values_in_order::<W>())?]),
        };
        Ok(ContextParts { listed, group_of, values })
    }

    /// The changed elements of a reader holding runs of the base (`context::decode_runs`): indices into `block`.
    pub fn context_runs(&self, block: &[u8], run_len: usize, first_ranks: &[[u64; 16]]) -> Result<Vec<u64>, String> {
        let (field, numel) = self.context_part_reader()?;
        context::decode_runs(self.positions, field, numel, block, run_len, first_ranks)
    }

    /// How many elements of each class every run of `block` holds (`context::count_runs`).
    pub fn context_counts(&self, block: &[u8], run_len: usize) -> Result<Vec<[u64; 16]>, String> {
        let (field, _) = self.context_part_reader()?;
        context::count_runs(self.positions, field, block, run_len)
    }

    /// All `changed` values of a value stream other than `rans_classes`, in change order, checked to its end.
    fn values_in_order<const W: usize>(&self) -> Result<Vec<u64>, String> {
        let mut reader = ValueReader::<W>::new(self.values, self.values_codec)?;
        let mut out = super::zeroed_values(self.changed)?;
        match reader.rans.as_mut() {
            Some(rans) => rans.read_values::<W>(&mut out)?,
            None => {
                for value in &mut out {
                    *value = reader.next_value()?;
                }
            }
        }
        if !reader.is_exhausted() {
            return Err("value stream has bytes after the last change".to_owned());
        }
        Ok(out)
    }

    /// Refuses `rans_classes` values beside positions other than `context`, which give them their classes.
    fn check_pairing(&self) -> Result<(), String> {
        if self.values_codec == ValueCodec::RansClasses && self.positions_codec != PositionCodec::Context {
            return Err(format!(
                "values 'rans_classes' need 'context' positions, not '{}'",
                self.positions_codec.name()
            ));
        }
        Ok(())
    }

    /// The element count, once `changed` is known to fit in it and in the position stream: a `varint` code takes
    /// at least a byte, a `rice` code at least a bit. So no check reads a value stream for more changes than its
    /// positions can hold (a `rans` value may take no bits at all: `rans::RansReader::most_values`).
    fn check_changed(&self) -> Result<u64, String> {
        let numel = self.numel_or_max();
        if self.changed > numel {
            return Err(format!("changed={} exceeds the {numel} elements", self.changed));
        }
        let bits = self.positions.len() as u64;
        let most = match self.positions_codec {
            PositionCodec::Varint => Some(bits),
            PositionCodec::Rice => Some(bits.saturating_mul(8)),
            PositionCodec::Context | PositionCodec::All => None,
        };
        if let Some(most) = most.filter(|&most| self.changed > most) {
            return Err(format!(
                "position stream of {} bytes cannot hold changed={} (at most {most})",
                self.positions.len(),
                self.changed
            ));
        }
        Ok(numel)
    }

    /// Walks every change in order, calling `visit(position, value)`; checks the streams fully.
    /// `value` is the raw new bits for `abs` and the wrapping difference for the other value codecs.
    pub fn for_each_change(&self, visit: impl FnMut(u64, u64)) -> Result<(), String> {
        with_width!(self.width, W => self.walk::<W>(visit))
    }

    /// `for_each_change` in batches of up to `BATCH` changes: `visit(positions, values)`. The compact codec is
    /// decoded several codes per loaded word here; other codecs are gathered from the walk.
    pub fn for_each_batch(&self, visit: impl FnMut(&[u64], &[u64])) -> Result<(), String> {
        with_width!(self.width, W => self.walk_batches::<W>(visit))
    }

    fn walk_batches<const W: usize>(&self, mut visit: impl FnMut(&[u64], &[u64])) -> Result<(), String> {
        let (mut positions, mut values) = ([0u64; BATCH], [0u64; BATCH]);
        self.check_pairing()?;
        if self.positions_codec == PositionCodec::Context {
            let changes = self.context_changes()?;
            if let Some(values) = &changes.values {
                for (positions, values) in changes.positions.chunks(BATCH).zip(values.chunks(BATCH)) {
                    visit(positions, values);
                }
                return Ok(());
            }
            let decoded = &changes.positions;
            let mut value_reader = ValueReader::<W>::new(self.values, self.values_codec)?;
            for batch in decoded.chunks(BATCH) {
                let n = batch.len();
                match value_reader.rans.as_mut() {
                    Some(rans) => rans.read_values::<W>(&mut values[..n])?,
                    None => {
                        for value in &mut values[..n] {
                            *value = value_reader.next_value()?;
                        }
                    }
                }
                visit(batch, &values[..n]);
            }
            if !value_reader.is_exhausted() {
                return Err("value stream has bytes after the last change".to_owned());
            }
            return Ok(());
        }
        if self.positions_codec == PositionCodec::Rice && self.values_codec == ValueCodec::DiffBits {
            let numel = self.check_changed()?;
            let mut position_reader = RiceReader::new(self.positions, numel)?;
            let mut value_bits = BitReader::new(self.values);
            let mut left = self.changed;
            while left > 0 {
                let n = left.min(BATCH as u64) as usize;
                pairs::read_pairs::<W>(&mut position_reader, &mut value_bits, &mut positions[..n], &mut values[..n])?;
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
            let numel = self.check_changed()?;
            let mut position_reader = RiceReader::new(self.positions, numel)?;
            let mut value_reader = RansReader::new(self.values, W)?;
            let mut left = self.changed;
            while left > 0 {
                let n = left.min(BATCH as u64) as usize;
                rice::read_positions(&mut position_reader, &mut positions[..n])?;
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

    fn walk<const W: usize>(&self, mut visit: impl FnMut(u64, u64)) -> Result<(), String> {
        self.check_pairing()?;
        if self.values_codec == ValueCodec::RansClasses {
            self.check_changed()?;
            let changes = self.context_changes()?;
            let values = changes.values.as_ref().ok_or("values 'rans_classes' were not decoded with the positions")?;
            for (&position, &value) in changes.positions.iter().zip(values) {
                visit(position, value);
            }
            return Ok(());
        }
        let mut values = ValueReader::<W>::new(self.values, self.values_codec)?;
        match self.positions_codec {
            PositionCodec::All => {
                let Some(numel) = self.numel else {
                    return Err("positions 'all' need a known shape".to_owned());
                };
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
            PositionCodec::Varint | PositionCodec::Rice | PositionCodec::Context => {
                let numel = self.check_changed()?;
                if self.values_codec == ValueCodec::Abs
                    && Some(self.values.len() as u64) != self.changed.checked_mul(W as u64)
                {
                    return Err(format!(
                        "value stream has {} bytes, expected {} x {W}",
                        self.values.len(),
                        self.changed
                    ));
                }
                if self.positions_codec == PositionCodec::Context {
                    let changes = self.context_changes()?;
                    walk_stream(
                        self.changed,
                        Decoded { positions: changes.positions.iter() },
                        &mut values,
                        &mut visit,
                    )?;
                } else if self.positions_codec == PositionCodec::Varint {
                    walk_stream(self.changed, PositionReader::new(self.positions, numel), &mut values, &mut visit)?;
                } else {
                    walk_stream(self.changed, RiceReader::new(self.positions, numel)?, &mut values, &mut visit)?;
                }
            }
        }
        if !values.is_exhausted() {
            return Err("value stream has bytes after the last change".to_owned());
        }
        Ok(())
    }

    /// Checks what a reader of the `rice` position stream and the `rans` or `diffbits` value stream of a tensor with
    /// changes needs before its first change: the change count against the element count, the Rice parameter, the
    /// `rans` table and initial states. The rest is checked as the streams are decoded (TensorDelta::unchecked).
    pub fn check_headers(&self) -> Result<(), String> {
        let numel = self.check_changed()?;
        if self.positions.is_empty() || self.values.is_empty() {
            return Err(format!("{} changes but an empty stream", self.changed));
        }
        RiceReader::new(self.positions, numel)?;
        if self.values_codec == ValueCodec::Rans {
            RansReader::new(self.values, self.width)?;
        }
        Ok(())
    }

    /// Checks the streams end to end, with the same rules as the walk, and returns the last position.
    pub fn check(&self) -> Result<Option<u64>, String> {
        if self.positions_codec == PositionCodec::All && self.values_codec == ValueCodec::Abs {
            // A whole tensor: its only invariant is the byte count, so skip the walk.
            let numel = self.numel.ok_or_else(|| "a dense tensor needs a known shape".to_owned())?;
            let expected = numel.checked_mul(self.width as u64);
            if self.changed != numel || !self.positions.is_empty() || expected != Some(self.values.len() as u64) {
                return Err(format!(
                    "a dense tensor of {numel} elements must record changed={numel} and hold {} bytes, \
                     but records changed={} and holds {} bytes",
                    expected.unwrap_or(u64::MAX),
                    self.changed,
                    self.values.len()
                ));
            }
            return Ok(numel.checked_sub(1));
        }
        if self.positions_codec == PositionCodec::All {
            // `all` positions with a value codec other than `abs`: the walk's rules, without walking every
            // element (a `rans` stream of values that take no bits may declare any number).
            self.check_pairing()?;
            let numel = self.numel.ok_or("positions 'all' need a known shape")?;
            if self.changed != numel {
                return Err(format!("positions 'all' but changed={} for {numel} elements", self.changed));
            }
            if !self.positions.is_empty() {
                return Err("positions 'all' with a position stream".to_owned());
            }
            let (values, codec) = (self.values, self.values_codec);
            with_width!(self.width, W => check_values::<W>(values, codec, numel))?;
            return Ok(numel.checked_sub(1));
        }
        self.check_streams()
    }

    /// Checks a `varint`, `rice` or `context` position stream and its value stream and returns the last position
    /// (None for `context`, whose positions depend on the base). The
    /// bit-packed pair (`rice`, `diffbits`) is checked in one loop, so that the two streams' decoding chains
    /// overlap; other streams apart, side by side, without pairing them.
    fn check_streams(&self) -> Result<Option<u64>, String> {
        self.check_pairing()?;
        let numel = self.check_changed()?;
        let (positions, values, changed) = (self.positions, self.values, self.changed);
        if self.positions_codec == PositionCodec::Rice && self.values_codec == ValueCodec::DiffBits {
            return with_width!(self.width, W => pairs::check_rice_diffbits::<W>(positions, values, changed, numel));
        }
        let check_positions = || match self.positions_codec {
            PositionCodec::Rice => rice::check_rice(positions, changed, numel),
            // Where the positions are depends on the base: the stream is checked here as far as it goes without
            // it, and decoding against the base checks the rest before anything is written.
            PositionCodec::Context => context::check(positions, self.context_field()?, changed, numel).map(|()| None),
            _ => varint::check_varint(positions, changed, numel),
        };
        let codec = self.values_codec;
        let check_values = || with_width!(self.width, W => check_values::<W>(values, codec, changed));
        let (last, values) = rayon::join(check_positions, check_values);
        values?;
        last
    }
}

/// Checks that a value stream holds exactly `changed` values.
fn check_values<const W: usize>(bytes: &[u8], codec: ValueCodec, changed: u64) -> Result<(), String> {
    match codec {
        ValueCodec::DiffBits => diffbits::check_diffbits::<W>(bytes, changed),
        ValueCodec::Rans => rans::check_rans::<W>(bytes, changed),
        ValueCodec::RansClasses => classvalues::check::<W>(bytes, changed),
        ValueCodec::Abs | ValueCodec::Diff => values::check_bytes::<W>(bytes, codec, changed),
    }
}

fn walk_stream<const W: usize>(
    changed: u64,
    mut positions: impl PositionSource,
    values: &mut ValueReader<'_, W>,
    visit: &mut impl FnMut(u64, u64),
) -> Result<(), String> {
    for _ in 0..changed {
        visit(positions.next_position()?, values.next_value()?);
    }
    if !positions.is_exhausted() {
        return Err("position stream has bytes after the last change".to_owned());
    }
    Ok(())
}
