//! `MirrorDiff`: the one-pass compare-and-update of a mirror (core::mirror) for Python, chunk by chunk or
//! whole tensors at once, with the GIL released while it runs.

use pyo3::prelude::*;

use super::{
    export, join_codec_without_bases, parse_codec, parse_dtype, parse_values, to_py, DeltaSyncError, RawDelta, RawSlice,
};
use crate::core::codec::{Codec, ValueCodec};
use crate::core::mirror::{self, MirrorInput, MirrorTensor};
use crate::core::{base, Delta, TensorDelta};

type AdvanceEntry<'py> = (String, String, Vec<u64>, Bound<'py, PyAny>, Bound<'py, PyAny>);

fn overlap(a: RawSlice, b: RawSlice) -> bool {
    let (a_start, b_start) = (a.ptr as usize, b.ptr as usize);
    a.len > 0 && b.len > 0 && a_start < b_start + b.len && b_start < a_start + a.len
}

/// Builds a delta by comparing new bytes with a mirror and writing them into it, in one pass.
///
/// Per tensor: `begin`, then `update` for each chunk in ascending element order, then `finish`; or many
/// whole tensors at once with `advance`. `take` returns the finished tensors as a RawDelta. With
/// `codec="compact"` a whole tensor's streams are re-encoded at its finish exactly as `diff` does; a shard
/// (`finish(None)`) keeps `varint` streams.
#[pyclass(module = "deltasync_rs._core")]
pub struct MirrorDiff {
    values: ValueCodec,
    codec: Codec,
    open: Option<MirrorTensor>,
    done: Vec<TensorDelta>,
    /// What each shard finished since the last `take_shard_bases` mirrored: (name, first element, elements, identity).
    shard_bases: Vec<(String, u64, u64, String)>,
}

impl MirrorDiff {
    fn open_tensor(&mut self) -> PyResult<&mut MirrorTensor> {
        self.open.as_mut().ok_or_else(|| DeltaSyncError::new_err("no tensor is open: call begin first"))
    }
}

#[pymethods]
impl MirrorDiff {
    #[new]
    #[pyo3(signature = (values = "diff", codec = "compact"))]
    fn new(values: &str, codec: &str) -> PyResult<Self> {
        Ok(MirrorDiff {
            values: parse_values(values)?,
            codec: parse_codec(codec)?,
            open: None,
            done: Vec::new(),
            shard_bases: Vec::new(),
        })
    }

    /// Starts tensor `name`; the previous one must be finished.
    fn begin(&mut self, name: &str, dtype: &str, shape: Vec<u64>) -> PyResult<()> {
        if let Some(open) = &self.open {
            return Err(DeltaSyncError::new_err(format!("tensor {:?} is still open: finish it first", open.name())));
        }
        let dtype = parse_dtype(dtype, name)?;
        self.open = Some(
            MirrorTensor::begin(name, dtype, &shape, self.values)
                .and_then(|t| t.with_codec(self.codec))
                .map_err(to_py)?,
        );
        Ok(())
    }

    /// Compares the chunk of elements starting at `first_element`: `mirror` (writable) holds their last
    /// bytes and receives `new`.
    fn update(
        &mut self,
        py: Python<'_>,
        mirror: &Bound<'_, PyAny>,
        new: &Bound<'_, PyAny>,
        first_element: u64,
    ) -> PyResult<()> {
        let tensor = self.open_tensor()?;
        let what = format!("tensor {:?}", tensor.name());
        let (mirror_buffer, mirror_slice) = export(mirror, &|| format!("{what} (mirror)"), true)?;
        let (new_buffer, new_slice) = export(new, &|| format!("{what} (new)"), false)?;
        if overlap(mirror_slice, new_slice) {
            return Err(DeltaSyncError::new_err(format!("{what}: the mirror and the new bytes overlap")));
        }
        // SAFETY: both buffers stay exported until after the call and do not overlap (checked above).
        py.detach(|| tensor.update(unsafe { mirror_slice.get_mut() }, unsafe { new_slice.get() }, first_element))
            .map_err(to_py)?;
        drop((mirror_buffer, new_buffer));
        Ok(())
    }

    /// Finishes the open tensor. `whole_mirror`, the mirror of the whole tensor, lets it be stored whole
    /// when that is no larger (as `diff` does); a shard that mirrors part of a tensor passes None, and the
    /// identity of the range its chunks covered is kept for `take_shard_bases`.
    #[pyo3(signature = (whole_mirror = None))]
    fn finish(&mut self, py: Python<'_>, whole_mirror: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let tensor = self.open.take().ok_or_else(|| DeltaSyncError::new_err("no tensor is open: call begin first"))?;
        let Some(obj) = whole_mirror else {
            let name = tensor.name().to_owned();
            let (finished, range) = tensor.finish_shard().map_err(to_py)?;
            if let Some(range) = range {
                self.shard_bases.push((name, range.first, range.elements, base::to_hex(range.identity)));
            }
            self.done.push(finished);
            return Ok(());
        };
        let (held, slice) = export(obj, &|| format!("tensor {:?} (mirror)", tensor.name()), false)?;
        // SAFETY: the buffer stays exported until after the call.
        let finished = py.detach(|| tensor.finish(Some(unsafe { slice.get() }))).map_err(to_py)?;
        drop(held);
        self.done.push(finished);
        Ok(())
    }

    /// For each shard finished since the last call, (name, first element, elements, base identity): the range of
    /// the whole tensor its chunks covered and the identity of the bytes the mirror held there before, which a
    /// joiner holding the whole state checks against the same range of it.
    fn take_shard_bases(&mut self) -> Vec<(String, u64, u64, String)> {
        std::mem::take(&mut self.shard_bases)
    }

    /// Advances whole tensors given as (name, dtype, shape, mirror, new): diffs each against its mirror and
    /// writes the new bytes into it, all tensors side by side. Every entry is checked before the first write.
    fn advance(&mut self, py: Python<'_>, entries: Vec<AdvanceEntry<'_>>) -> PyResult<()> {
        if let Some(open) = &self.open {
            return Err(DeltaSyncError::new_err(format!("tensor {:?} is still open: finish it first", open.name())));
        }
        let mut held = Vec::with_capacity(entries.len() * 2);
        let mut specs = Vec::with_capacity(entries.len());
        let mut written: Vec<RawSlice> = Vec::with_capacity(entries.len());
        for (name, dtype_name, shape, mirror, new) in &entries {
            let dtype = parse_dtype(dtype_name, name)?;
            let (mirror_buffer, mirror_slice) = export(mirror, &|| format!("tensor {name:?} (mirror)"), true)?;
            let (new_buffer, new_slice) = export(new, &|| format!("tensor {name:?} (new)"), false)?;
            if overlap(mirror_slice, new_slice) || written.iter().any(|&other| overlap(other, mirror_slice)) {
                return Err(DeltaSyncError::new_err(format!(
                    "tensor {name:?}: its mirror overlaps other memory of this call"
                )));
            }
            written.push(mirror_slice);
            held.push(mirror_buffer);
            held.push(new_buffer);
            specs.push((name.clone(), dtype, shape.clone(), mirror_slice, new_slice));
        }
        let (values, codec) = (self.values, self.codec);
        let tensors = py
            .detach(|| {
                let inputs = specs
                    .into_iter()
                    .map(|(name, dtype, shape, mirror, new)| MirrorInput {
                        name,
                        dtype,
                        shape,
                        // SAFETY: `held` keeps every buffer exported; mirrors overlap nothing (checked above).
                        mirror: unsafe { mirror.get_mut() },
                        new: unsafe { new.get() },
                    })
                    .collect();
                mirror::advance(inputs, values, codec)
            })
            .map_err(to_py)?;
        drop(held);
        self.done.extend(tensors);
        Ok(())
    }

    /// The finished tensors as a RawDelta; the builder starts empty again.
    fn take(&mut self) -> PyResult<RawDelta> {
        if let Some(open) = &self.open {
            return Err(DeltaSyncError::new_err(format!("tensor {:?} is still open: finish it first", open.name())));
        }
        let mut raw = RawDelta { delta: Delta { packed: self.codec != Codec::Varint, ..Delta::default() } };
        raw.extend(std::mem::take(&mut self.done))?;
        Ok(raw)
    }

    /// Tensors finished and not yet taken.
    fn __len__(&self) -> usize {
        self.done.len()
    }
}

/// Joins the deltas of all shards of a sharded state, in rank order, into one: each rank's tensor parts cover
/// disjoint element ranges with positions in the whole tensor's index space. With `codec="compact"` each joined
/// tensor is re-encoded as `diff` would encode it (never stored whole); `codec="context"` needs `bases`, each
/// tensor's whole bytes before the step (buffers or CPU contiguous tensors, by name), and records their identities.
#[pyfunction]
#[pyo3(signature = (parts, codec = "compact", bases = None))]
pub fn join_shards(
    py: Python<'_>,
    parts: Vec<PyRef<'_, RawDelta>>,
    codec: &str,
    bases: Option<Vec<(String, Bound<'_, PyAny>)>>,
) -> PyResult<RawDelta> {
    let codec = match (bases.is_some(), parse_codec(codec)?) {
        (true, Codec::Context) => Codec::Context,
        (true, _) => return Err(DeltaSyncError::new_err("bases are for codec=\"context\" only")),
        (false, codec) => join_codec_without_bases(codec)?,
    };
    let deltas: Vec<Delta> = parts.iter().map(|part| part.delta.clone()).collect();
    let mut held = Vec::new();
    let mut slices = Vec::new();
    for (name, base) in bases.iter().flatten() {
        let (buffer, slice) = export(base, &|| format!("base of tensor {name:?}"), false)?;
        held.push(buffer);
        slices.push((name.clone(), slice));
    }
    let delta = py
        .detach(|| {
            // SAFETY: `held` keeps every buffer exported until after this call.
            let bases = slices.iter().map(|(name, slice)| (name.clone(), unsafe { slice.get() })).collect();
            crate::core::shards::join(deltas, codec, &bases)
        })
        .map_err(to_py)?;
    drop(held);
    Ok(RawDelta { delta })
}
