//! The in-memory delta: per tensor, its encoded position and value streams plus what is needed to check them.

use std::collections::BTreeMap;

use rayon::prelude::*;

use crate::core::codec::decode::{ContextChanges, ContextParts, EncodedTensor};
use crate::core::codec::plan::TensorStreams;
use crate::core::codec::{PositionCodec, ValueCodec};
use crate::core::dtype::{self, Dtype};
use crate::core::error::{Error, Result};
use crate::core::stream::Stream;

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
    /// True for a tensor loaded with the check of its streams left to the apply (`validate` with `defer`): only
    /// their headers have been checked, and `last_position` is unknown. Every reader checks such streams as it
    /// decodes them, and core::apply takes back its writes to the tensor's target when they turn out malformed.
    pub unchecked: bool,
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
            unchecked: false,
            ..self
        }
    }

    /// This tensor holding the streams the compact codec chose for it (codec::plan::smallest_streams).
    pub fn with_streams(self, streams: TensorStreams) -> TensorDelta {
        TensorDelta {
            positions_codec: streams.positions_codec,
            values_codec: streams.values_codec,
            positions: streams.positions.into(),
            values: streams.values.into(),
            ..self
        }
    }

    /// The streams and what it takes to read them, for the codec's readers (codec::decode).
    pub fn encoded(&self) -> EncodedTensor<'_> {
        EncodedTensor {
            width: self.width(),
            exponent: crate::core::codec::context::Exponent::of(self.dtype),
            base: None,
            decoded: None,
            numel: self.numel(),
            changed: self.changed,
            positions_codec: self.positions_codec,
            values_codec: self.values_codec,
            positions: &self.positions,
            values: &self.values,
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
            // `context` streams say where the changes are only together with the base they were made against.
            && (self.positions_codec != PositionCodec::Context || self.base == other.base)
    }

    /// True when the positions can only be decoded against the base (`context`), which the caller must give.
    pub fn needs_base(&self) -> bool {
        self.positions_codec == PositionCodec::Context
    }

    /// Walks every change in order, calling `visit(position, value)`; checks the streams fully.
    /// `value` is the raw new bits for `abs` and the wrapping difference for the other value codecs.
    pub fn for_each_change(&self, visit: impl FnMut(u64, u64)) -> std::result::Result<(), String> {
        self.encoded().for_each_change(visit)
    }

    /// `for_each_change` in batches of up to `codec::decode::BATCH` changes: `visit(positions, values)`.
    /// `context` positions need `decoded` (see `context_changes`); other codecs ignore it.
    pub fn for_each_batch(
        &self,
        decoded: Option<&ContextChanges>,
        visit: impl FnMut(&[u64], &[u64]),
    ) -> std::result::Result<(), String> {
        EncodedTensor { decoded, ..self.encoded() }.for_each_batch(visit)
    }

    /// `for_each_change`, with `decoded` as for `for_each_batch`.
    pub fn for_each_change_on(
        &self,
        decoded: Option<&ContextChanges>,
        visit: impl FnMut(u64, u64),
    ) -> std::result::Result<(), String> {
        EncodedTensor { decoded, ..self.encoded() }.for_each_change(visit)
    }

    /// A `context` tensor's changes decoded against `base`, its bytes before the change, after checking them
    /// against the record's base identity (a wrong base is refused, never mis-decoded). None for other codecs.
    pub fn context_changes(&self, base: &[u8]) -> Result<Option<ContextChanges>> {
        if !self.needs_base() {
            return Ok(None);
        }
        crate::core::base::check_base(self, base)?;
        EncodedTensor { base: Some(base), ..self.encoded() }
            .context_changes()
            .map(|changes| Some(changes.into_owned()))
            .map_err(|message| self.format_error(message))
    }

    /// A stream of this tensor read badly, named by the tensor.
    pub fn format_error(&self, message: impl std::fmt::Display) -> Error {
        Error::format("delta", format!("tensor {:?}: {message}", self.name))
    }

    /// A `context` tensor's streams read without its base, for a reader holding only part of it (`ContextParts`):
    /// nothing here is checked against the base identity, which only a reader of the whole tensor can compute.
    pub fn context_parts(&self) -> Result<ContextParts> {
        self.encoded().context_parts().map_err(|message| self.format_error(message))
    }

    /// The changed elements of a reader holding part of this `context` tensor's base, found by walking its runs
    /// (`codec::context::decode_runs`): indices into `block`, ascending.
    pub fn context_runs(&self, block: &[u8], run_len: usize, first_ranks: &[[u64; 16]]) -> Result<Vec<u64>> {
        self.encoded().context_runs(block, run_len, first_ranks).map_err(|message| self.format_error(message))
    }

    /// How many elements of each class every run of `block` holds (`codec::context::count_runs`).
    pub fn context_counts(&self, block: &[u8], run_len: usize) -> Result<Vec<[u64; 16]>> {
        self.encoded().context_counts(block, run_len).map_err(|message| self.format_error(message))
    }

    /// True when `validate` may leave this tensor's streams to the apply: `rice` positions with `rans` or `diffbits`
    /// values, that is differences, which core::apply can take back exactly, and a known shape, which bounds every
    /// position a reader decodes.
    pub fn check_can_wait(&self) -> bool {
        self.changed > 0
            && self.positions_codec == PositionCodec::Rice
            && matches!(self.values_codec, ValueCodec::Rans | ValueCodec::DiffBits)
            && self.numel().is_some()
    }

    /// Checks the streams end to end and records the last position; with `defer`, a tensor whose check can wait
    /// for the apply (`check_can_wait`) has only its streams' headers checked and is marked `unchecked`.
    pub fn validate(&mut self, source_name: &str, defer: bool) -> Result<()> {
        if defer && self.check_can_wait() {
            self.encoded()
                .check_headers()
                .map_err(|message| Error::format(source_name, format!("tensor {:?}: {message}", self.name)))?;
            (self.last_position, self.unchecked) = (None, true);
            return Ok(());
        }
        if self.positions_codec == PositionCodec::Context && self.changed > 0 {
            // Decoding depends on the base: without its identity a wrong base would decode to wrong positions.
            let why = if self.base.is_none() {
                Some("records no base identity")
            } else if self.shape.is_none() {
                Some("records no shape")
            } else if crate::core::codec::context::Exponent::of(self.dtype).is_none() {
                Some("is not BF16, F16 or F32")
            } else {
                None
            };
            if let Some(why) = why {
                return Err(Error::format(
                    source_name,
                    format!("tensor {:?}: positions 'context' but the record {why}", self.name),
                ));
            }
        }
        self.last_position = self.check_streams(source_name)?;
        self.unchecked = false;
        Ok(())
    }

    /// Checks the streams end to end (codec::decode::EncodedTensor::check): the last position, or a format error of
    /// `source_name` naming the tensor.
    pub fn check_streams(&self, source_name: &str) -> Result<Option<u64>> {
        self.encoded()
            .check()
            .map_err(|message| Error::format(source_name, format!("tensor {:?}: {message}", self.name)))
    }
}

fn clone_pair((a, b): (&String, &String)) -> (String, String) {
    (a.clone(), b.clone())
}

/// A set of tensor deltas plus file-level metadata.
#[derive(Debug, Clone, Default)]
pub struct Delta {
    pub tensors: Vec<TensorDelta>,
    pub step: Option<u64>,
    pub base_step: Option<u64>,
    /// Caller-supplied string metadata, stored in the file header beside the reserved keys.
    pub metadata: BTreeMap<String, String>,
    /// Tied names: each alias (a name the trainer's model holds as the same tensor as another) to the name of the
    /// tensor it is written under, which the file's records carry (docs/format.md §2.2). Empty when none.
    pub aliases: BTreeMap<String, String>,
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

    /// Checks every tensor's streams, in parallel (with `defer`, those whose check can wait for the apply only as
    /// far as their headers: `TensorDelta::validate`), and rejects duplicate names.
    pub fn validate(&mut self, source_name: &str, defer: bool) -> Result<()> {
        let mut seen = std::collections::HashSet::new();
        for tensor in &self.tensors {
            if !seen.insert(tensor.name.as_str()) {
                return Err(Error::format(source_name, format!("tensor {:?} appears twice", tensor.name)));
            }
        }
        crate::core::pool::install(|| {
            self.tensors.par_iter_mut().try_for_each(|tensor| tensor.validate(source_name, defer))
        })
    }

    pub fn position_of(&self, name: &str) -> Option<usize> {
        self.tensors.iter().position(|t| t.name == name)
    }

    /// The delta with its records named and ordered by `names`: each `(name, index)` is a copy of record `index`
    /// under `name`, so a record may appear under several names (tied weights, shipped once by a mirror, given back
    /// under every name of the model as `diff` of its state dict would give them). Every record must be named.
    pub fn arranged(&self, names: &[(String, usize)]) -> Result<Delta> {
        let mut used = vec![false; self.tensors.len()];
        let mut tensors = Vec::with_capacity(names.len());
        for (name, index) in names {
            let record = self
                .tensors
                .get(*index)
                .ok_or_else(|| Error::invalid(format!("tensor {name:?}: no record number {index} in this delta")))?;
            used[*index] = true;
            tensors.push(TensorDelta { name: name.clone(), ..record.clone() });
        }
        if let Some(left) = used.iter().position(|u| !u) {
            return Err(Error::invalid(format!("tensor {:?} is not named", self.tensors[left].name)));
        }
        // An alias now given a record of its own is no longer an alias in this delta.
        let aliases =
            self.aliases.iter().filter(|(alias, _)| !names.iter().any(|(name, _)| name == *alias)).map(clone_pair);
        let mut out = Delta {
            tensors: Vec::new(),
            metadata: self.metadata.clone(),
            aliases: aliases.collect(),
            step: self.step,
            base_step: self.base_step,
            packed: self.packed,
        };
        out.extend(tensors)?;
        Ok(out)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::codec::{Codec, ValueCodec};
    use crate::core::diff::{diff, DiffInput};
    use crate::core::dtype::Dtype;

    /// A record named again under a tie's alias (as a target holding the alias apart needs it) makes the alias no
    /// longer an alias of the delta; the other ties, the steps, the caller's metadata and the layout stay.
    #[test]
    fn arranged_drops_the_ties_it_names() {
        let (old, new) = ([1u8, 2, 3, 4], [1u8, 9, 3, 4]);
        let input = |name: &str| DiffInput {
            name: name.into(),
            dtype: Dtype::BF16,
            shape: vec![2],
            old: &old[..],
            new: &new[..],
        };
        let tensors = diff(&[input("w"), input("b")], ValueCodec::Diff, Codec::Compact).unwrap();
        let delta = Delta {
            tensors,
            step: Some(3),
            base_step: Some(2),
            metadata: [("run".to_owned(), "x".to_owned())].into(),
            aliases: [("head".to_owned(), "w".to_owned()), ("lm".to_owned(), "w".to_owned())].into(),
            packed: true,
        };
        let names = [("w".to_owned(), 0), ("b".to_owned(), 1), ("head".to_owned(), 0)];
        let out = delta.arranged(&names).unwrap();
        assert_eq!(out.aliases, BTreeMap::from([("lm".to_owned(), "w".to_owned())]));
        let got: Vec<&str> = out.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(got, ["w", "b", "head"]);
        assert!(out.tensors[2].same_changes(&out.tensors[0]));
        assert_eq!((out.step, out.base_step, out.packed), (Some(3), Some(2), true));
        assert_eq!(out.metadata, delta.metadata);
        // What it gives is a file the writer takes (the alias now a record), and the reader reads back.
        let back = crate::core::format::from_bytes(crate::core::format::to_bytes(&out).unwrap(), "mem").unwrap();
        assert_eq!(back.aliases, out.aliases);
        // The delta itself is unchanged, and still refuses to be written with its alias named as a record.
        assert_eq!(delta.aliases.len(), 2);
        let both = Delta { aliases: delta.aliases.clone(), ..out };
        assert!(crate::core::format::to_bytes(&both).is_err());
    }
}
