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
///
/// With `defer=True` a whole tensor's finish (the compact re-encoding, the choice to store it whole) waits: the
/// mirror moves at once, and `take_deferred` returns a DeferredDelta, which `complete` finishes later from the same
/// mirror memory, still holding this step (a publisher's upload thread, while the next step waits for the mirror).
#[pyclass(module = "deltasync_rs._core")]
pub struct MirrorDiff {
    values: ValueCodec,
    codec: Codec,
    defer: bool,
    open: Option<MirrorTensor>,
    done: Vec<Slot>,
    /// What each shard finished since the last `take_shard_bases` mirrored: (name, first element, elements, identity).
    shard_bases: Vec<(String, u64, u64, String)>,
}

/// A tensor of a MirrorDiff: finished, or compared with its encoding deferred, with the address and length of the
/// whole mirror it was compared into (its completion must be given that same memory).
enum Slot {
    Done(TensorDelta),
    Pending { tensor: MirrorTensor, mirror: (usize, usize) },
}

impl MirrorDiff {
    fn open_tensor(&mut self) -> PyResult<&mut MirrorTensor> {
        self.open.as_mut().ok_or_else(|| DeltaSyncError::new_err("no tensor is open: call begin first"))
    }
}

#[pymethods]
impl MirrorDiff {
    #[new]
    #[pyo3(signature = (values = "diff", codec = "compact", defer = false))]
    fn new(values: &str, codec: &str, defer: bool) -> PyResult<Self> {
        Ok(MirrorDiff {
            values: parse_values(values)?,
            codec: parse_codec(codec)?,
            defer,
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
            self.done.push(Slot::Done(finished));
            return Ok(());
        };
        let (held, slice) = export(obj, &|| format!("tensor {:?} (mirror)", tensor.name()), false)?;
        if self.defer {
            self.done.push(Slot::Pending { tensor, mirror: (slice.ptr as usize, slice.len) });
            return Ok(());
        }
        // SAFETY: the buffer stays exported until after the call.
        let finished = py.detach(|| tensor.finish(Some(unsafe { slice.get() }))).map_err(to_py)?;
        drop(held);
        self.done.push(Slot::Done(finished));
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
        for (name, dtype_name, shape, mirror, new) in &entries {
            let dtype = parse_dtype(dtype_name, name)?;
            let (mirror_buffer, mirror_slice) = export(mirror, &|| format!("tensor {name:?} (mirror)"), true)?;
            let (new_buffer, new_slice) = export(new, &|| format!("tensor {name:?} (new)"), false)?;
            held.push(mirror_buffer);
            held.push(new_buffer);
            specs.push((name.clone(), dtype, shape.clone(), mirror_slice, new_slice));
        }
        let layout: Vec<(mirror::Span, mirror::Span)> =
            specs.iter().map(|(.., m, n)| ((m.ptr as usize, m.len), (n.ptr as usize, n.len))).collect();
        if let Some(index) = mirror::overlapping_mirror(&layout) {
            return Err(DeltaSyncError::new_err(format!(
                "tensor {:?}: its mirror overlaps other memory of this call",
                specs[index].0
            )));
        }
        let (values, codec, defer) = (self.values, self.codec, self.defer);
        let spans: Vec<(usize, usize)> = layout.iter().map(|&(mirror, _)| mirror).collect();
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
                if defer {
                    mirror::advance_deferred(inputs, values, codec).map(|pending| {
                        pending
                            .into_iter()
                            .zip(spans)
                            .map(|(tensor, mirror)| Slot::Pending { tensor, mirror })
                            .collect::<Vec<_>>()
                    })
                } else {
                    mirror::advance(inputs, values, codec).map(|done| done.into_iter().map(Slot::Done).collect())
                }
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
        if self.done.iter().any(|slot| matches!(slot, Slot::Pending { .. })) {
            return Err(DeltaSyncError::new_err("tensors were deferred: take them with take_deferred"));
        }
        let mut raw = RawDelta { delta: Delta { packed: self.codec != Codec::Varint, ..Delta::default() } };
        raw.extend(
            std::mem::take(&mut self.done)
                .into_iter()
                .map(|slot| match slot {
                    Slot::Done(tensor) => tensor,
                    Slot::Pending { .. } => unreachable!("checked above"),
                })
                .collect(),
        )?;
        Ok(raw)
    }

    /// The tensors so far, finished or deferred, as a DeferredDelta; the builder starts empty again.
    fn take_deferred(&mut self) -> PyResult<DeferredDelta> {
        if let Some(open) = &self.open {
            return Err(DeltaSyncError::new_err(format!("tensor {:?} is still open: finish it first", open.name())));
        }
        Ok(DeferredDelta { slots: Some(std::mem::take(&mut self.done)), packed: self.codec != Codec::Varint })
    }

    /// Tensors finished (or deferred) and not yet taken.
    fn __len__(&self) -> usize {
        self.done.len()
    }
}

/// A delta whose tensors' encoding was deferred (MirrorDiff with `defer=True`): the mirror has moved already.
#[pyclass(module = "deltasync_rs._core")]
pub struct DeferredDelta {
    slots: Option<Vec<Slot>>,
    packed: bool,
}

#[pymethods]
impl DeferredDelta {
    /// Finishes every deferred tensor as MirrorDiff's `finish` would have right after its compare, from `mirrors`,
    /// (name, buffer) of each deferred tensor's whole mirror: the very memory it was compared into (checked), still
    /// holding that step. Once only.
    fn complete(&mut self, py: Python<'_>, mirrors: Vec<(String, Bound<'_, PyAny>)>) -> PyResult<RawDelta> {
        let slots =
            self.slots.as_ref().ok_or_else(|| DeltaSyncError::new_err("this deferred delta was completed already"))?;
        let given: std::collections::HashMap<&str, &Bound<'_, PyAny>> =
            mirrors.iter().map(|(name, obj)| (name.as_str(), obj)).collect();
        // Every mirror is found and checked before anything is taken: a refused call leaves the delta as it was.
        let mut held = Vec::new();
        let mut slices = Vec::new();
        for slot in slots {
            let Slot::Pending { tensor, mirror } = slot else { continue };
            let name = tensor.name();
            let obj = given.get(name).ok_or_else(|| {
                DeltaSyncError::new_err(format!("tensor {name:?}: its mirror was not given to complete the delta"))
            })?;
            let (buffer, slice) = export(obj, &|| format!("tensor {name:?} (mirror)"), false)?;
            // (An empty tensor's address means nothing: only its length is compared.)
            if slice.len != mirror.1 || (slice.len > 0 && slice.ptr as usize != mirror.0) {
                return Err(DeltaSyncError::new_err(format!(
                    "tensor {name:?}: the delta is completed from other memory than the mirror it was compared into"
                )));
            }
            held.push(buffer);
            slices.push(slice);
        }
        let mut slices = slices.into_iter();
        let mut pending = Vec::new();
        let mut order = Vec::new();
        for slot in self.slots.take().expect("checked above") {
            match slot {
                Slot::Done(tensor) => order.push(Some(tensor)),
                Slot::Pending { tensor, .. } => {
                    pending.push((tensor, slices.next().expect("one slice per deferred tensor")));
                    order.push(None);
                }
            }
        }
        let finished = py
            .detach(|| {
                // SAFETY: `held` keeps every buffer exported until after the call; they are only read.
                mirror::complete(pending.into_iter().map(|(tensor, slice)| (tensor, unsafe { slice.get() })).collect())
            })
            .map_err(to_py)?;
        drop(held);
        let mut finished = finished.into_iter();
        let tensors = order
            .into_iter()
            .map(|slot| slot.unwrap_or_else(|| finished.next().expect("one finished tensor per deferred one")))
            .collect();
        let mut raw = RawDelta { delta: Delta { packed: self.packed, ..Delta::default() } };
        raw.extend(tensors)?;
        Ok(raw)
    }

    /// Tensors in the delta, finished or deferred (none once completed).
    fn __len__(&self) -> usize {
        self.slots.as_ref().map_or(0, Vec::len)
    }
}

/// Joins the deltas of all shards of a sharded state, in rank order, into one: each rank's tensor parts cover
/// disjoint element ranges with positions in the whole tensor's index space. With `codec="compact"` each joined
/// tensor is re-encoded as `diff` would encode it (never stored whole); `codec="context"` needs `bases`, each
/// tensor's whole bytes before the step (buffers or CPU contiguous tensors, by name), and records their identities.
/// `identities`, (name, 16 hex digits) pairs, are whole tensors' base identities known elsewhere (a publisher's, of
/// the state it keeps), recorded on each joined tensor that is not stored whole and has none of its own.
#[pyfunction]
#[pyo3(signature = (parts, codec = "compact", bases = None, identities = None))]
pub fn join_shards(
    py: Python<'_>,
    parts: Vec<PyRef<'_, RawDelta>>,
    codec: &str,
    bases: Option<Vec<(String, Bound<'_, PyAny>)>>,
    identities: Option<Vec<(String, String)>>,
) -> PyResult<RawDelta> {
    let mut known = std::collections::BTreeMap::new();
    for (name, hex) in identities.into_iter().flatten() {
        let identity = crate::core::base::parse_hex(&hex).ok_or_else(|| {
            DeltaSyncError::new_err(format!("tensor {name:?}: base identity {hex:?} is not 16 lowercase hex digits"))
        })?;
        known.insert(name, identity);
    }
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
            crate::core::shards::join(deltas, codec, &bases, &known)
        })
        .map_err(to_py)?;
    drop(held);
    Ok(RawDelta { delta })
}
