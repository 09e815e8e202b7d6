//! PyO3 bindings for `deltasync_rs._core`: convert, call the core with the GIL released, map errors.

use std::collections::BTreeMap;
use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicPtr, Ordering};

use pyo3::buffer::PyBuffer;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyTuple, PyType};

use crate::core::codec::{Codec, ValueCodec};
use crate::core::diff::{DiffInput, FullInput};
use crate::core::digest::{self, DigestInput};
use crate::core::stream::Backing;
use crate::core::{anchors, apply, base, checkpoint, diff, dtype, files, format, pool, trl, Delta, Error};

mod mirror;

create_exception!(deltasync_rs._core, DeltaSyncError, PyException, "Base class of every deltasync error.");
create_exception!(
    deltasync_rs._core,
    DeltaFormatError,
    DeltaSyncError,
    "A delta file is corrupt, truncated or malformed."
);
create_exception!(
    deltasync_rs._core,
    BaseMismatchError,
    DeltaSyncError,
    "The target does not match the delta: names, shapes, dtypes or base identity."
);

fn to_py(error: Error) -> PyErr {
    let message = error.to_string();
    match error {
        Error::Format { .. } => DeltaFormatError::new_err(message),
        Error::BaseMismatch { .. } => BaseMismatchError::new_err(message),
        Error::InvalidInput { .. } | Error::Io { .. } => DeltaSyncError::new_err(message),
    }
}

/// A raw pointer into a Python buffer, kept alive by the `PyBuffer` held beside it.
#[derive(Clone, Copy)]
struct RawSlice {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the memory belongs to a Python buffer that the caller keeps exported for the whole call.
unsafe impl Send for RawSlice {}
unsafe impl Sync for RawSlice {}

impl RawSlice {
    /// SAFETY: the exporting `PyBuffer` must outlive the slice.
    unsafe fn get<'a>(self) -> &'a [u8] {
        if self.len == 0 {
            return &[];
        }
        std::slice::from_raw_parts(self.ptr, self.len)
    }
    /// SAFETY: as `get`, and nothing else may read or write the memory meanwhile.
    unsafe fn get_mut<'a>(self) -> &'a mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        std::slice::from_raw_parts_mut(self.ptr, self.len)
    }
}

/// What keeps exported memory alive: the exported buffer, or the torch tensor whose memory is read. Only held,
/// never read.
#[allow(dead_code)]
pub(crate) enum Held {
    Buffer(PyBuffer<u8>),
    Tensor(Py<PyAny>),
}

/// `torch.Tensor`, once torch has been imported by someone (this module never imports it): a strong reference,
/// never released, or null. An atomic rather than a `PyOnceLock`: a lazy initialisation under a lock that
/// another thread holds when the process forks leaves the child waiting on it forever (tests/test_fork.py).
static TORCH_TENSOR: AtomicPtr<ffi::PyObject> = AtomicPtr::new(std::ptr::null_mut());

fn torch_tensor_type(py: Python<'_>) -> Option<Borrowed<'_, '_, PyType>> {
    let cached = TORCH_TENSOR.load(Ordering::Acquire);
    if !cached.is_null() {
        // SAFETY: a `torch.Tensor` type object whose reference is never released (above).
        return Some(unsafe { Borrowed::from_ptr(py, cached).cast_unchecked::<PyType>() });
    }
    // `sys.modules` through the C API: no lookup of `sys`, no cache to initialise.
    // SAFETY: a borrowed reference to the interpreter's module dict, valid while attached.
    let modules = unsafe { Borrowed::from_ptr_or_opt(py, ffi::PyImport_GetModuleDict())? }.cast::<PyDict>().ok()?;
    // A dict lookup without raising: no exception is made for a process without torch.
    let torch = modules.get_item("torch").ok()??;
    let ty = torch.getattr("Tensor").ok()?.cast_into::<PyType>().ok()?;
    let ptr = ty.into_ptr();
    let winner = match TORCH_TENSOR.compare_exchange(std::ptr::null_mut(), ptr, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => ptr,
        Err(first) => {
            // Another thread cached it first: release our reference and use theirs.
            // SAFETY: `ptr` is the strong reference taken by `into_ptr` above.
            unsafe { ffi::Py_DecRef(ptr) };
            first
        }
    };
    // SAFETY: as for `cached`.
    Some(unsafe { Borrowed::from_ptr(py, winner).cast_unchecked::<PyType>() })
}

/// The memory of a CPU, contiguous torch tensor (read through `data_ptr`/`nbytes`, the way torch documents
/// them), or `None` when `obj` is not a torch tensor. Tensors with lazy negation or conjugation bits are refused:
/// their memory does not hold their values.
fn torch_memory(obj: &Bound<'_, PyAny>, what: &dyn Fn() -> String) -> PyResult<Option<RawSlice>> {
    let Some(ty) = torch_tensor_type(obj.py()) else { return Ok(None) };
    if !obj.is_instance(ty.as_any())? {
        return Ok(None);
    }
    if !obj.getattr("is_cpu")?.is_truthy()? {
        return Err(DeltaSyncError::new_err(format!("{}: tensor is not on the CPU", what())));
    }
    if !obj.call_method0("is_contiguous")?.is_truthy()? {
        return Err(DeltaSyncError::new_err(format!("{}: tensor is not contiguous", what())));
    }
    if obj.call_method0("is_neg")?.is_truthy()? || obj.call_method0("is_conj")?.is_truthy()? {
        return Err(DeltaSyncError::new_err(format!(
            "{}: tensor has a lazy negation or conjugation bit; resolve it first",
            what()
        )));
    }
    let len: usize = obj.getattr("nbytes")?.extract()?;
    let address: usize = obj.call_method0("data_ptr")?.extract()?;
    if len > 0 && address == 0 {
        return Err(DeltaSyncError::new_err(format!("{}: tensor has no storage", what())));
    }
    Ok(Some(RawSlice { ptr: address as *mut u8, len }))
}

/// The bytes of a C-contiguous buffer (numpy array, bytes, bytearray, memoryview) or of a CPU contiguous torch
/// tensor; `what` names it in errors. The returned `Held` must be kept while the slice is used.
fn export(obj: &Bound<'_, PyAny>, what: &dyn Fn() -> String, writable: bool) -> PyResult<(Held, RawSlice)> {
    if let Some(slice) = torch_memory(obj, what)? {
        return Ok((Held::Tensor(obj.clone().unbind()), slice));
    }
    let buffer = PyBuffer::<u8>::get(obj)
        .map_err(|e| DeltaSyncError::new_err(format!("{}: not a byte buffer ({e})", what())))?;
    if !buffer.is_c_contiguous() {
        return Err(DeltaSyncError::new_err(format!("{}: buffer is not contiguous", what())));
    }
    if writable && buffer.readonly() {
        return Err(DeltaSyncError::new_err(format!("{}: buffer is read-only", what())));
    }
    let slice = RawSlice { ptr: buffer.buf_ptr().cast::<u8>(), len: buffer.len_bytes() };
    Ok((Held::Buffer(buffer), slice))
}

/// A new `bytes` object of `len` bytes, filled by `fill`, which must write every byte. Unlike
/// `PyBytes::new_with` it does not zero the buffer first: for a large file that memset, on one thread, costs about
/// as much as the parallel copy that follows.
fn new_bytes_with<'py>(
    py: Python<'py>,
    len: usize,
    fill: impl FnOnce(&mut [MaybeUninit<u8>]),
) -> PyResult<Bound<'py, PyBytes>> {
    let size = ffi::Py_ssize_t::try_from(len)
        .map_err(|_| DeltaSyncError::new_err(format!("{len} bytes do not fit a bytes object")))?;
    // SAFETY: a NULL source asks CPython for an uninitialised buffer of `size` bytes (plus its trailing NUL),
    // which the new object owns; nobody else sees the object until it is returned, after `fill` wrote it all.
    unsafe {
        let bytes = Bound::from_owned_ptr_or_err(py, ffi::PyBytes_FromStringAndSize(std::ptr::null(), size))?
            .cast_into_unchecked::<PyBytes>();
        let data = ffi::PyBytes_AsString(bytes.as_ptr()).cast::<MaybeUninit<u8>>();
        fill(std::slice::from_raw_parts_mut(data, len));
        Ok(bytes)
    }
}

/// An exported immutable `bytes` object, kept alive for as long as a loaded delta reads from it.
struct HeldBytes {
    _buffer: Held,
    slice: RawSlice,
}

impl AsRef<[u8]> for HeldBytes {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `_buffer` keeps the exporting `bytes` object alive and its contents never change.
        unsafe { self.slice.get() }
    }
}

fn parse_dtype(name: &str, tensor: &str) -> PyResult<dtype::Dtype> {
    dtype::parse(name).map_err(|e| DeltaSyncError::new_err(format!("tensor {tensor:?}: {e}")))
}

fn parse_values(values: &str) -> PyResult<ValueCodec> {
    match ValueCodec::parse(values) {
        Some(codec @ (ValueCodec::Diff | ValueCodec::Abs)) => Ok(codec),
        _ => Err(DeltaSyncError::new_err(format!("values must be \"diff\" or \"abs\", not {values:?}"))),
    }
}

/// The stream family of a writer that diffs whole old and new tensors: "varint", "compact" or "context".
fn parse_codec(codec: &str) -> PyResult<Codec> {
    Codec::parse(codec).ok_or_else(|| {
        DeltaSyncError::new_err(format!("codec must be \"varint\", \"compact\" or \"context\", not {codec:?}"))
    })
}

/// The stream family of a join of shard deltas without the tensors' bases, which no rank holds: "varint" or
/// "compact".
fn join_codec_without_bases(codec: Codec) -> PyResult<Codec> {
    match codec {
        Codec::Context => Err(DeltaSyncError::new_err(
            "codec \"context\" codes positions against each whole tensor's base, which no rank of a sharded state \
             holds: join shard deltas with codec=\"compact\"",
        )),
        codec => Ok(codec),
    }
}

/// A delta held by the core: tensors with their encoded streams, and file metadata.
#[pyclass(module = "deltasync_rs._core")]
pub struct RawDelta {
    delta: Delta,
}

impl RawDelta {
    fn extend(&mut self, tensors: Vec<crate::core::TensorDelta>) -> PyResult<()> {
        self.delta.extend(tensors).map_err(to_py)
    }

    fn tensor(&self, index: usize) -> PyResult<&crate::core::TensorDelta> {
        self.delta
            .tensors
            .get(index)
            .ok_or_else(|| DeltaSyncError::new_err(format!("no tensor number {index} in this delta")))
    }
}

/// What `RawDelta.tensors` says of one tensor: (name, dtype, shape or None, changed, positions codec, values codec,
/// stream bytes).
type TensorInfo = (String, String, Option<Vec<u64>>, u64, &'static str, &'static str, u64);

fn tensor_info(t: &crate::core::TensorDelta) -> TensorInfo {
    (
        t.name.clone(),
        dtype::name_of(t.dtype),
        t.shape.clone(),
        t.changed,
        t.positions_codec.name(),
        t.values_codec.name(),
        t.nbytes(),
    )
}

/// `read(bytes)` of `block` (a buffer or CPU contiguous tensor: part of tensor `tensor`'s base), without the GIL.
fn on_block<T: Send>(
    py: Python<'_>,
    tensor: &crate::core::TensorDelta,
    block: &Bound<'_, PyAny>,
    read: impl FnOnce(&[u8]) -> crate::core::error::Result<T> + Send,
) -> PyResult<T> {
    let (held, slice) = export(block, &|| format!("block of tensor {:?}", tensor.name), false)?;
    // SAFETY: `held` keeps the exported buffer alive until after the read.
    let result = py.detach(|| read(unsafe { slice.get() })).map_err(to_py);
    drop(held);
    result
}

/// Exports each (name, dtype, shape, buffer) entry's buffer; the buffers must be held while the slices are used.
#[allow(clippy::type_complexity)]
fn export_tensors<'a>(
    entries: &'a [FullEntry<'_>],
) -> PyResult<(Vec<Held>, Vec<(&'a str, dtype::Dtype, &'a [u64], RawSlice)>)> {
    let mut held = Vec::with_capacity(entries.len());
    let mut specs = Vec::with_capacity(entries.len());
    for (name, dtype_name, shape, data) in entries {
        let dtype = parse_dtype(dtype_name, name)?;
        let (buffer, slice) = export(data, &|| format!("tensor {name:?}"), false)?;
        held.push(buffer);
        specs.push((name.as_str(), dtype, shape.as_slice(), slice));
    }
    Ok((held, specs))
}

/// The core's view of `export_tensors`' specs.
///
/// # Safety
/// The `Held` buffers that `export_tensors` returned with `specs` must outlive the returned inputs.
unsafe fn full_inputs<'a>(specs: &'a [(&'a str, dtype::Dtype, &'a [u64], RawSlice)]) -> Vec<FullInput<'a>> {
    specs
        .iter()
        .map(|(name, dtype, shape, data)| FullInput {
            name: (*name).to_owned(),
            dtype: *dtype,
            shape: shape.to_vec(),
            data: unsafe { data.get() },
        })
        .collect()
}

type DiffEntry<'py> = (String, String, Vec<u64>, Bound<'py, PyAny>, Bound<'py, PyAny>);
type FullEntry<'py> = (String, String, Vec<u64>, Bound<'py, PyAny>);

#[pymethods]
impl RawDelta {
    #[new]
    fn new() -> Self {
        RawDelta { delta: Delta::default() }
    }

    /// Diffs tensors given as (name, dtype, shape, old bytes, new bytes) and appends them.
    #[pyo3(signature = (entries, values, codec = "compact"))]
    fn add_diff(&mut self, py: Python<'_>, entries: Vec<DiffEntry<'_>>, values: &str, codec: &str) -> PyResult<()> {
        let values = parse_values(values)?;
        let codec = parse_codec(codec)?;
        let mut held = Vec::with_capacity(entries.len() * 2);
        let mut specs = Vec::with_capacity(entries.len());
        for (name, dtype_name, shape, old, new) in &entries {
            let dtype = parse_dtype(dtype_name, name)?;
            let (old_buffer, old_slice) = export(old, &|| format!("tensor {name:?} (previous)"), false)?;
            let (new_buffer, new_slice) = export(new, &|| format!("tensor {name:?} (current)"), false)?;
            held.push(old_buffer);
            held.push(new_buffer);
            specs.push((name.clone(), dtype, shape.clone(), old_slice, new_slice));
        }
        let tensors = py
            .detach(|| {
                let inputs: Vec<DiffInput<'_>> = specs
                    .iter()
                    .map(|(name, dtype, shape, old, new)| DiffInput {
                        name: name.clone(),
                        dtype: *dtype,
                        shape: shape.clone(),
                        // SAFETY: `held` keeps every buffer exported until after this call.
                        old: unsafe { old.get() },
                        new: unsafe { new.get() },
                    })
                    .collect();
                diff::diff(&inputs, values, codec)
            })
            .map_err(to_py)?;
        drop(held);
        self.extend(tensors)?;
        self.delta.packed |= codec != Codec::Varint;
        Ok(())
    }

    /// Stores tensors given as (name, dtype, shape, bytes) whole, as in an anchor.
    fn add_full(&mut self, py: Python<'_>, entries: Vec<FullEntry<'_>>) -> PyResult<()> {
        let (held, specs) = export_tensors(&entries)?;
        let tensors = py
            .detach(|| {
                // SAFETY: `held` keeps every buffer exported until after this call.
                let inputs = unsafe { full_inputs(&specs) };
                diff::full(&inputs)
            })
            .map_err(to_py)?;
        drop(held);
        self.extend(tensors)
    }

    #[getter]
    fn step(&self) -> Option<u64> {
        self.delta.step
    }
    #[setter]
    fn set_step(&mut self, step: Option<u64>) {
        self.delta.step = step;
    }
    #[getter]
    fn base_step(&self) -> Option<u64> {
        self.delta.base_step
    }
    #[setter]
    fn set_base_step(&mut self, step: Option<u64>) {
        self.delta.base_step = step;
    }
    #[getter]
    fn metadata(&self) -> BTreeMap<String, String> {
        self.delta.metadata.clone()
    }
    #[setter]
    fn set_metadata(&mut self, metadata: BTreeMap<String, String>) -> PyResult<()> {
        if let Some(key) = metadata.keys().find(|k| format::RESERVED_KEYS.contains(&k.as_str())) {
            return Err(DeltaSyncError::new_err(format!("metadata key {key:?} is reserved by the format")));
        }
        self.delta.metadata = metadata;
        Ok(())
    }
    /// Tied names (docs/format.md §2.2): each alias to the name of the record it is written under. Checked against
    /// the records when the file is written.
    #[getter]
    fn aliases(&self) -> BTreeMap<String, String> {
        self.delta.aliases.clone()
    }
    #[setter]
    fn set_aliases(&mut self, aliases: BTreeMap<String, String>) {
        self.delta.aliases = aliases;
    }
    /// True when the file is written in the packed layout (docs/format.md §4.1), as the compact codec's writers
    /// and packed files ask; a delta whose tensors are all stored whole is written as an anchor all the same.
    #[getter]
    fn packed(&self) -> bool {
        self.delta.packed
    }
    #[setter]
    fn set_packed(&mut self, packed: bool) {
        self.delta.packed = packed;
    }
    /// The `format_version` the file is written with: "2" in the packed layout, else "1".
    #[getter]
    fn format_version(&self) -> &'static str {
        format::version_of(&self.delta)
    }
    /// Elements that differ from the base (of a tensor stored whole, only those that changed, where known).
    #[getter]
    fn num_changed(&self) -> u64 {
        self.delta.num_changed()
    }
    #[getter]
    fn num_elements(&self) -> u64 {
        self.delta.num_elements()
    }
    #[getter]
    fn nbytes(&self) -> u64 {
        self.delta.nbytes()
    }
    #[getter]
    fn is_anchor(&self) -> bool {
        self.delta.is_anchor()
    }

    /// Per tensor: (name, dtype, shape or None, changed, positions codec, values codec, stream bytes). `changed` is
    /// what `decode` yields: every element of a tensor stored whole (`changed_elements` has the real count).
    fn tensors(&self) -> Vec<TensorInfo> {
        self.delta.tensors.iter().map(tensor_info).collect()
    }

    /// True when a record is named `name` (what `name in delta` asks), without building every name.
    fn has_tensor(&self, name: &str) -> bool {
        self.delta.tensors.iter().any(|t| t.name == name)
    }

    /// `tensors()[index]` without building the others' (a reader working tensor by tensor calls it per tensor).
    fn tensor_info(&self, index: usize) -> PyResult<TensorInfo> {
        Ok(tensor_info(self.tensor(index)?))
    }

    /// Per tensor, the elements that differ from the base: `changed`, but for a tensor stored whole whose file
    /// records fewer (docs/format.md §3, `differing`).
    fn changed_elements(&self) -> Vec<u64> {
        self.delta.tensors.iter().map(crate::core::TensorDelta::num_changed).collect()
    }

    fn __len__(&self) -> usize {
        self.delta.tensors.len()
    }

    /// The file as bytes: `format` is "deltasync" or "trl" (TRL's v1 layout).
    #[pyo3(signature = (format = "deltasync"))]
    fn to_bytes<'py>(&self, py: Python<'py>, format: &str) -> PyResult<Bound<'py, PyBytes>> {
        let encoded = match format {
            "deltasync" => format::encode(&self.delta),
            "trl" => trl::encode_v1(&self.delta),
            other => {
                return Err(DeltaSyncError::new_err(format!("format must be \"deltasync\" or \"trl\", not {other:?}")))
            }
        }
        .map_err(to_py)?;
        new_bytes_with(py, encoded.len(), |out| py.detach(|| encoded.fill_uninit(out)))
    }

    /// Writes the file atomically (temporary file, then rename).
    #[pyo3(signature = (path, format = "deltasync"))]
    fn save(&self, py: Python<'_>, path: PathBuf, format: &str) -> PyResult<()> {
        let delta = &self.delta;
        let result = match format {
            "deltasync" => py.detach(|| format::encode(delta)?.save(&path)),
            "trl" => py.detach(|| trl::encode_v1(delta)?.save(&path)),
            other => {
                return Err(DeltaSyncError::new_err(format!("format must be \"deltasync\" or \"trl\", not {other:?}")))
            }
        };
        result.map_err(to_py)
    }

    /// Parses and fully validates a delta (deltasync or TRL) from a bytes-like object; with `defer_checks`, the
    /// streams whose check can wait for the apply are checked only as far as their headers (core::format::read_checked).
    #[staticmethod]
    #[pyo3(signature = (data, source_name = "<bytes>", defer_checks = false))]
    fn from_bytes(
        py: Python<'_>,
        data: &Bound<'_, PyAny>,
        source_name: &str,
        defer_checks: bool,
    ) -> PyResult<RawDelta> {
        let (buffer, slice) = export(data, &|| source_name.to_owned(), false)?;
        let backing = if data.is_exact_instance_of::<PyBytes>() {
            // `bytes` never changes: keep it alive and read it in place instead of copying it.
            Backing::Borrowed(Box::new(HeldBytes { _buffer: buffer, slice }))
        } else {
            // A mutable buffer (bytearray, memoryview) could change after validation: take a private copy.
            // SAFETY: `buffer` is alive for the copy.
            let bytes = py.detach(|| unsafe { slice.get() }.to_vec());
            drop(buffer);
            Backing::Owned(bytes)
        };
        let delta = py
            .detach(|| format::read_checked(std::sync::Arc::new(backing), source_name, defer_checks))
            .map_err(to_py)?;
        Ok(RawDelta { delta })
    }

    /// Reads and fully validates a delta file (deltasync or TRL); `defer_checks` as for `from_bytes`.
    #[staticmethod]
    #[pyo3(signature = (path, defer_checks = false))]
    fn load(py: Python<'_>, path: PathBuf, defer_checks: bool) -> PyResult<RawDelta> {
        let delta = py.detach(|| format::load_checked(&path, defer_checks)).map_err(to_py)?;
        Ok(RawDelta { delta })
    }

    /// Reads and fully validates a delta file through a read-only memory map (core::anchors::load_mapped): the
    /// file must stay unchanged while the delta lives. `checksum=False` leaves the file's checksum unchecked: only
    /// for a stand-in of an anchor read by ranges, whose pieces are checked instead.
    #[staticmethod]
    #[pyo3(signature = (path, checksum = true))]
    fn map(py: Python<'_>, path: PathBuf, checksum: bool) -> PyResult<RawDelta> {
        let delta = py.detach(|| anchors::load_mapped_with(&path, checksum)).map_err(to_py)?;
        Ok(RawDelta { delta })
    }

    /// Raises BaseMismatchError unless tensor `index` can be applied to a target of this dtype and shape.
    fn check_target(&self, index: usize, dtype_name: &str, shape: Vec<u64>) -> PyResult<()> {
        let tensor = self.tensor(index)?;
        let dtype = dtype::parse(dtype_name)
            .map_err(|e| BaseMismatchError::new_err(format!("tensor {:?}: {e}", tensor.name)))?;
        let len = apply::target_len(tensor, dtype, &shape).map_err(to_py)?;
        apply::check_target(tensor, dtype, Some(&shape), len).map_err(to_py)
    }

    /// The base identity (16 hex digits) that tensor `index` must be applied to, or None when it applies to any
    /// base (stored whole, from a shard, or from a file that records none).
    fn base_identity(&self, index: usize) -> PyResult<Option<String>> {
        Ok(self.tensor(index)?.base.map(base::to_hex))
    }

    /// Raises BaseMismatchError unless each target, given as (index, buffer or CPU contiguous tensor), is the
    /// base its tensor was made for; the targets are hashed in parallel.
    fn check_base(&self, py: Python<'_>, targets: Vec<(usize, Bound<'_, PyAny>)>) -> PyResult<()> {
        let mut held = Vec::with_capacity(targets.len());
        let mut slices = Vec::with_capacity(targets.len());
        for (index, target) in &targets {
            let tensor = self.tensor(*index)?;
            let (buffer, slice) = export(target, &|| format!("target of tensor {:?}", tensor.name), false)?;
            held.push(buffer);
            slices.push((*index, slice));
        }
        let delta = &self.delta;
        py.detach(|| {
            // SAFETY: `held` keeps every buffer exported until after this call.
            let targets: Vec<(usize, &[u8])> =
                slices.iter().map(|(index, slice)| (*index, unsafe { slice.get() })).collect();
            base::check_bases(delta, &targets)
        })
        .map_err(to_py)?;
        drop(held);
        Ok(())
    }

    /// Raises BaseMismatchError unless this delta, read to follow the anchor `anchor`, was made against the tensors
    /// `anchor` stores whole (core::base::check_follows); with `usable` (indices into `anchor`), only those tensors
    /// are compared (a reader that read the rest only in part). Returns how many records were checked.
    #[pyo3(signature = (anchor, usable=None))]
    fn check_follows(
        &self,
        py: Python<'_>,
        anchor: PyRef<'_, RawDelta>,
        usable: Option<Vec<usize>>,
    ) -> PyResult<usize> {
        let (held, delta) = (&anchor.delta, &self.delta);
        let usable: Option<std::collections::HashSet<usize>> = usable.map(|indices| indices.into_iter().collect());
        py.detach(|| base::check_follows(held, delta, |index| usable.as_ref().is_none_or(|set| set.contains(&index))))
            .map_err(to_py)
    }

    /// The state digest (32 hex digits) of the tensors this anchor holds, or None when it does not hold every one
    /// whole (a delta of changes).
    fn whole_state_digest(&self, py: Python<'_>) -> Option<String> {
        let delta = &self.delta;
        py.detach(|| digest::of_whole_tensors(delta))
    }

    /// Raises BaseMismatchError unless each (index, identity) pair, a target's base identity computed elsewhere (16
    /// hex digits; on its device, deltasync_rs._identity), is the one recorded for its tensor (or none is).
    fn check_identities(&self, found: Vec<(usize, String)>) -> PyResult<()> {
        for (index, identity) in found {
            let tensor = self.tensor(index)?;
            let value = base::parse_hex(&identity).ok_or_else(|| {
                DeltaSyncError::new_err(format!("{identity:?} is not a base identity (16 hex digits)"))
            })?;
            base::check_identity(tensor, value).map_err(to_py)?;
        }
        Ok(())
    }

    /// Applies tensors to writable contiguous byte buffers, given as (index, buffer); all are checked first. With
    /// `check_base`, each target must hold its tensor's recorded base (BaseMismatchError otherwise, every buffer as
    /// it was): tensors of differences are hashed while they are written, and taken back on a mismatch. With
    /// `digest` too, returns (index, hash) for the tensors so hashed (core::apply::apply_checked): each one's hash
    /// in the state digest (`tensor_hashes`), 16 bytes little-endian, taken from its bytes after the write.
    #[pyo3(signature = (targets, check_base = false, digest = false))]
    fn apply<'py>(
        &self,
        py: Python<'py>,
        targets: Vec<(usize, Bound<'py, PyAny>)>,
        check_base: bool,
        digest: bool,
    ) -> PyResult<Vec<(usize, Bound<'py, PyBytes>)>> {
        let mut held = Vec::with_capacity(targets.len());
        let mut slices = Vec::with_capacity(targets.len());
        for (index, target) in &targets {
            let tensor = self.tensor(*index)?;
            let (buffer, slice) = export(target, &|| format!("target of tensor {:?}", tensor.name), true)?;
            held.push(buffer);
            slices.push((*index, slice));
        }
        let spans: Vec<(usize, usize, usize)> = slices.iter().map(|(i, s)| (*i, s.ptr as usize, s.len)).collect();
        apply::check_disjoint(&self.delta, &spans).map_err(to_py)?;
        let delta = &self.delta;
        let hashes = py
            .detach(|| {
                // SAFETY: buffers are held, writable and pairwise disjoint (checked above).
                let targets = slices.iter().map(|(index, slice)| (*index, unsafe { slice.get_mut() })).collect();
                if check_base {
                    apply::apply_checked(delta, targets, digest)
                } else {
                    apply::apply(delta, targets).map(|()| Vec::new())
                }
            })
            .map_err(to_py)?;
        drop(held);
        Ok(hashes.into_iter().map(|(index, hash)| (index, PyBytes::new(py, &hash.to_le_bytes()))).collect())
    }

    /// Decodes tensor `index` into one little-endian bytearray: `changed` int64 positions, then
    /// `changed` values of the element width (the new bits for "abs", the wrapping bit-pattern
    /// difference for "diff"). A dense tensor has no positions: the bytearray is its data.
    ///
    /// A tensor with `context` positions is decoded against `base`, its bytes before the change (a buffer or a
    /// CPU contiguous tensor, checked against the record's base identity); other tensors ignore it.
    #[pyo3(signature = (index, base = None))]
    fn decode<'py>(
        &self,
        py: Python<'py>,
        index: usize,
        base: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyByteArray>> {
        let tensor = self.tensor(index)?;
        let base = match &base {
            Some(base) if tensor.needs_base() => {
                Some(export(base, &|| format!("base of tensor {:?}", tensor.name), false)?)
            }
            _ => None,
        };
        let too_many = || {
            DeltaSyncError::new_err(format!(
                "tensor {:?}: {} changes do not fit in memory",
                tensor.name, tensor.changed
            ))
        };
        let count = usize::try_from(tensor.changed).map_err(|_| too_many())?;
        let positions_len = if tensor.is_dense() { Some(0) } else { count.checked_mul(8) };
        let len = positions_len.zip(count.checked_mul(tensor.width())).and_then(|(p, v)| p.checked_add(v));
        let (positions_len, len) = positions_len.zip(len).ok_or_else(too_many)?;
        let out = PyByteArray::new_with(py, len, |_| Ok(()))?;
        // SAFETY: the bytearray is fresh and private to this call, and is not resized while borrowed.
        let bytes = unsafe { out.as_bytes_mut() };
        let slice = RawSlice { ptr: bytes.as_mut_ptr(), len: bytes.len() };
        py.detach(|| {
            // SAFETY: as above; no Python code runs while the GIL is released here.
            let (positions, values) = unsafe { slice.get_mut() }.split_at_mut(positions_len);
            if tensor.is_dense() {
                values.copy_from_slice(&tensor.values);
                Ok(())
            } else {
                // SAFETY: `base` keeps the exported buffer alive until after this call.
                apply::decode_into(tensor, base.as_ref().map(|(_, slice)| unsafe { slice.get() }), positions, values)
            }
        })
        .map_err(to_py)?;
        drop(base);
        Ok(out)
    }

    /// Tensor `index`'s `context` streams read without its base, for a reader that holds only part of the base
    /// (a tensor-parallel shard) and finds the classes of its own elements itself (docs/format.md §5.2). Returns
    /// `(reference, complement, ranks, group_of, values)`: the reference exponent field; per class, whether its
    /// listed ranks are those of unchanged elements, and the listed ranks (ascending little-endian uint64 bytes);
    /// the group of every class (one byte each); per group, its values in change order (little-endian, the element width). The
    /// base identity is not checked here: only a reader of the whole tensor can compute it.
    #[allow(clippy::type_complexity)]
    fn context_parts<'py>(
        &self,
        py: Python<'py>,
        index: usize,
    ) -> PyResult<(u8, Vec<bool>, Vec<Bound<'py, PyBytes>>, Vec<u8>, Vec<Bound<'py, PyBytes>>)> {
        let tensor = self.tensor(index)?;
        let width = tensor.width();
        let (parts, ranks, values) = py
            .detach(|| -> crate::core::error::Result<_> {
                let parts = tensor.context_parts()?;
                let ranks: Vec<Vec<u8>> = parts
                    .listed
                    .ranks
                    .iter()
                    .map(|list| list.iter().flat_map(|rank| rank.to_le_bytes()).collect())
                    .collect();
                let values: Vec<Vec<u8>> = parts
                    .values
                    .iter()
                    .map(|group| {
                        let mut bytes = Vec::with_capacity(group.len() * width);
                        for value in group {
                            bytes.extend_from_slice(&value.to_le_bytes()[..width]);
                        }
                        bytes
                    })
                    .collect();
                Ok((parts, ranks, values))
            })
            .map_err(to_py)?;
        Ok((
            parts.listed.reference,
            parts.listed.complement.to_vec(),
            ranks.iter().map(|bytes| PyBytes::new(py, bytes)).collect(),
            parts.group_of.to_vec(),
            values.iter().map(|bytes| PyBytes::new(py, bytes)).collect(),
        ))
    }

    /// The changed elements of a reader holding part of `context` tensor `index`'s base (docs/format.md §5.2):
    /// `block` (a buffer or CPU contiguous tensor) holds its runs back to back, `run_len` elements each, and
    /// `first_ranks` (little-endian uint64, 16 per run) each run's first class rank in every class over the whole
    /// tensor. Returns the changed elements' indices in `block`, ascending, as little-endian int64 bytes.
    fn context_runs<'py>(
        &self,
        py: Python<'py>,
        index: usize,
        block: Bound<'py, PyAny>,
        run_len: usize,
        first_ranks: &[u8],
    ) -> PyResult<Bound<'py, PyBytes>> {
        let tensor = self.tensor(index)?;
        if !first_ranks.len().is_multiple_of(128) {
            return Err(DeltaSyncError::new_err("first_ranks must hold 16 uint64 per run"));
        }
        let firsts: Vec<[u64; 16]> = first_ranks
            .chunks_exact(128)
            .map(|run| std::array::from_fn(|c| u64::from_le_bytes(run[8 * c..8 * c + 8].try_into().expect("8 bytes"))))
            .collect();
        let positions = on_block(py, tensor, &block, |block| tensor.context_runs(block, run_len, &firsts))?;
        let bytes: Vec<u8> = positions.iter().flat_map(|p| p.to_le_bytes()).collect();
        Ok(PyBytes::new(py, &bytes))
    }

    /// How many elements of each class every run of `block` (runs of `run_len` elements back to back, a buffer or
    /// CPU contiguous tensor) holds, for `context` tensor `index`'s reference exponent: little-endian uint64 bytes,
    /// 16 per run.
    fn context_counts<'py>(
        &self,
        py: Python<'py>,
        index: usize,
        block: Bound<'py, PyAny>,
        run_len: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let tensor = self.tensor(index)?;
        let counts = on_block(py, tensor, &block, |block| tensor.context_counts(block, run_len))?;
        let bytes: Vec<u8> = counts.iter().flatten().flat_map(|c| c.to_le_bytes()).collect();
        Ok(PyBytes::new(py, &bytes))
    }

    /// True when tensor `index`'s decoded values are wrapping bit-pattern differences to add to the base
    /// (`diff`, `diffbits`, `rans`), false when they are the new bits (`abs`).
    fn holds_differences(&self, index: usize) -> PyResult<bool> {
        Ok(self.tensor(index)?.values_codec.holds_differences())
    }

    /// The delta with its records named and ordered by `names` (`(name, record index)`; a record may be named
    /// more than once, every record at least once).
    fn arranged(&self, names: Vec<(String, usize)>) -> PyResult<RawDelta> {
        Ok(RawDelta { delta: self.delta.arranged(&names).map_err(to_py)? })
    }

    /// True when tensors `a` and `b` carry the same changes (as tied weights do).
    fn same_changes(&self, a: usize, b: usize) -> PyResult<bool> {
        Ok(self.tensor(a)?.same_changes(self.tensor(b)?))
    }
}

/// Diffs two safetensors checkpoints on disk, memory-mapped, in batches of tensors; `progress(done, total)`
/// is called with bytes compared after each batch.
#[pyfunction]
#[pyo3(signature = (prev, curr, values = "diff", progress = None, codec = "compact"))]
fn diff_files(
    py: Python<'_>,
    prev: Vec<PathBuf>,
    curr: Vec<PathBuf>,
    values: &str,
    progress: Option<Py<PyAny>>,
    codec: &str,
) -> PyResult<RawDelta> {
    let values = parse_values(values)?;
    let codec = parse_codec(codec)?;
    let mut callback_error = None;
    let result = py.detach(|| {
        let mut report = |done: u64, total: u64| {
            callback_error = Python::attach(|py| {
                py.check_signals()?;
                match &progress {
                    Some(callback) => callback.call1(py, (done, total)).map(drop),
                    None => Ok(()),
                }
            })
            .err();
            callback_error.is_none()
        };
        files::diff_files(&prev, &curr, values, codec, &mut report)
    });
    if let Some(error) = callback_error {
        return Err(error);
    }
    Ok(RawDelta { delta: result.map_err(to_py)? })
}

/// Writes each file of `base` (one file, or a sharded checkpoint's files) with `delta` applied to the path at the same
/// index of `outs`, all renamed into place once all are written; checks everything before writing.
#[pyfunction]
fn apply_files(
    py: Python<'_>,
    base: Vec<PathBuf>,
    delta: PyRef<'_, RawDelta>,
    outs: Vec<PathBuf>,
    check_base: bool,
) -> PyResult<()> {
    let delta = &delta.delta;
    py.detach(|| files::apply_files(&base, delta, &outs, check_base)).map_err(to_py)
}

/// Writes the anchor of tensors given as (name, dtype, shape, bytes) into the existing file at `path`, straight
/// from their memory (core::anchors::write_anchor); returns the file's size, SHA-256 (hex; None without
/// `whole_sha256`), the tensors' state digest (as `state_digest` gives it) and, with `piece_bytes`, the hash
/// (`piece_hash`: "blake3" or "sha256") of each piece of that size concatenated (32 bytes each; empty without), all
/// from one pass. With `early_writeback` the kernel starts writing the file to disk as the pass goes, for a caller
/// that fsyncs it next.
#[pyfunction]
#[pyo3(signature = (
    path, entries, step = None, metadata = BTreeMap::new(), piece_bytes = 0, piece_hash = "blake3", whole_sha256 = true,
    early_writeback = false, aliases = BTreeMap::new()
))]
#[allow(clippy::too_many_arguments)] // Python's keyword arguments, one each
fn write_anchor(
    py: Python<'_>,
    path: PathBuf,
    entries: Vec<FullEntry<'_>>,
    step: Option<u64>,
    metadata: BTreeMap<String, String>,
    piece_bytes: usize,
    piece_hash: &str,
    whole_sha256: bool,
    early_writeback: bool,
    aliases: BTreeMap<String, String>,
) -> PyResult<(u64, Option<String>, String, Py<PyBytes>)> {
    let options = anchors::AnchorOptions {
        piece_bytes,
        piece_hash: anchors::PieceHash::parse(piece_hash).map_err(to_py)?,
        whole_sha256,
        early_writeback,
    };
    let (held, specs) = export_tensors(&entries)?;
    let written = py
        .detach(|| {
            // SAFETY: `held` keeps every buffer exported until after this call.
            let inputs = unsafe { full_inputs(&specs) };
            anchors::write_anchor(&inputs, step, &metadata, &aliases, &path, options)
        })
        .map_err(to_py)?;
    drop(held);
    let hex = written.sha256.map(|sha256| sha256.iter().map(|byte| format!("{byte:02x}")).collect());
    let pieces = PyBytes::new(py, written.pieces.as_flattened()).unbind();
    Ok((written.size, hex, written.state_digest, pieces))
}

/// The hash (`piece_hash`: "blake3" or "sha256") of each `piece_bytes` piece of the file at `path`, concatenated
/// (32 bytes each), hashed in parallel.
#[pyfunction]
fn file_piece_hashes(py: Python<'_>, path: PathBuf, piece_bytes: usize, piece_hash: &str) -> PyResult<Py<PyBytes>> {
    let kind = anchors::PieceHash::parse(piece_hash).map_err(to_py)?;
    let hashes = py.detach(|| anchors::file_piece_hashes(&path, piece_bytes, kind)).map_err(to_py)?;
    Ok(PyBytes::new(py, hashes.as_flattened()).unbind())
}

/// The hash (`piece_hash`: "blake3" or "sha256") of one anchor piece.
#[pyfunction]
fn piece_hash(py: Python<'_>, data: Bound<'_, PyAny>, piece_hash: &str) -> PyResult<Py<PyBytes>> {
    let kind = anchors::PieceHash::parse(piece_hash).map_err(to_py)?;
    let (held, slice) = export(&data, &|| "piece".to_owned(), false)?;
    // SAFETY: `held` keeps the buffer exported until after this call.
    let hash = py.detach(|| kind.digest(unsafe { slice.get() }));
    drop(held);
    Ok(PyBytes::new(py, &hash).unbind())
}

/// A checkpoint's header, its tensors' byte ranges and its size, as Python gets them.
type CheckpointLayout = (Py<PyBytes>, Vec<(u64, u64)>, u64);

/// The layout of a plain safetensors checkpoint of (name, dtype, shape) tensors, as safetensors' own writer lays
/// it out (core::checkpoint): its header (length prefix included), each tensor's absolute byte range in the given
/// order, and the file's size.
#[pyfunction]
fn checkpoint_layout(py: Python<'_>, tensors: Vec<(String, String, Vec<u64>)>) -> PyResult<CheckpointLayout> {
    let mut specs = Vec::with_capacity(tensors.len());
    for (name, dtype_name, shape) in tensors {
        let dtype = dtype::parse(&dtype_name).map_err(|e| DeltaSyncError::new_err(format!("tensor {name:?}: {e}")))?;
        specs.push((name, dtype, shape));
    }
    let layout = checkpoint::layout(&specs).map_err(to_py)?;
    Ok((PyBytes::new(py, &layout.header).unbind(), layout.ranges, layout.size))
}

/// The checked source of `copy_checked_pieces` and `fill_checked_pieces`.
fn checked_source<'a>(
    source: &'a Path,
    size: u64,
    piece_bytes: usize,
    piece_hash: &str,
    expected: &'a [[u8; 32]],
) -> PyResult<anchors::CheckedSource<'a>> {
    let kind = anchors::PieceHash::parse(piece_hash).map_err(to_py)?;
    Ok(anchors::CheckedSource { path: source, size, piece_bytes, kind, expected })
}

/// `expected` piece hashes (32 bytes each, concatenated) as the core takes them.
fn piece_list(expected: &[u8]) -> PyResult<Vec<[u8; 32]>> {
    if !expected.len().is_multiple_of(32) {
        return Err(DeltaSyncError::new_err("expected piece hashes must be 32 bytes each"));
    }
    Ok(expected.chunks_exact(32).map(|h| h.try_into().expect("32 bytes")).collect())
}

/// A checked copy's outcome as Python gets it: None, or ("size", the source's size) or ("piece", the first
/// differing piece).
fn unchecked(outcome: Option<anchors::Unchecked>) -> Option<(&'static str, u64)> {
    outcome.map(|unchecked| match unchecked {
        anchors::Unchecked::Size(actual) => ("size", actual),
        anchors::Unchecked::Piece(index) => ("piece", index as u64),
    })
}

/// Copies (from, length, to) segments of the file `source` into the existing file `dest`, each piece of the source
/// checked against `expected` (32-byte hashes of `piece_hash`, concatenated) before it is used (core::anchors::
/// copy_checked_pieces). Returns None, or ("size", the source's size) or ("piece", the first differing piece).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn copy_checked_pieces(
    py: Python<'_>,
    source: PathBuf,
    size: u64,
    piece_bytes: usize,
    piece_hash: &str,
    expected: &[u8],
    dest: PathBuf,
    segments: Vec<(u64, u64, u64)>,
) -> PyResult<Option<(&'static str, u64)>> {
    let hashes = piece_list(expected)?;
    let checked = checked_source(&source, size, piece_bytes, piece_hash, &hashes)?;
    let segments: Vec<anchors::Segment> =
        segments.into_iter().map(|(from, len, to)| anchors::Segment { from, len, to }).collect();
    let outcome = py.detach(|| anchors::copy_checked_pieces(&checked, &dest, &segments)).map_err(to_py)?;
    Ok(unchecked(outcome))
}

/// Fills each target (a writable contiguous CPU tensor or buffer, paired with the offset of its bytes in `source`)
/// from the file `source`, each group of pieces checked against `expected` before its bytes are copied
/// (core::anchors::fill_checked). Targets must not overlap. Returns as `copy_checked_pieces` does.
#[pyfunction]
fn fill_checked_pieces<'py>(
    py: Python<'py>,
    source: PathBuf,
    size: u64,
    piece_bytes: usize,
    piece_hash: &str,
    expected: &[u8],
    fills: Vec<(u64, Bound<'py, PyAny>)>,
) -> PyResult<Option<(&'static str, u64)>> {
    let hashes = piece_list(expected)?;
    let checked = checked_source(&source, size, piece_bytes, piece_hash, &hashes)?;
    let mut held = Vec::with_capacity(fills.len());
    let mut slices = Vec::with_capacity(fills.len());
    for (index, (from, target)) in fills.iter().enumerate() {
        let (buffer, slice) = export(target, &|| format!("target at byte {from} of {}", source.display()), true)?;
        held.push(buffer);
        slices.push((index, slice));
    }
    let mut spans: Vec<(usize, usize)> =
        slices.iter().filter(|(_, s)| s.len > 0).map(|(_, s)| (s.ptr as usize, s.ptr as usize + s.len)).collect();
    spans.sort_unstable();
    if spans.windows(2).any(|pair| pair[1].0 < pair[0].1) {
        return Err(DeltaSyncError::new_err(format!("{}: two targets overlap", source.display())));
    }
    let offsets: Vec<(u64, usize)> = fills.iter().enumerate().map(|(index, (from, _))| (*from, index)).collect();
    let outcome = py
        .detach(|| {
            // SAFETY: buffers are held, writable and pairwise disjoint (checked above).
            let mut targets: Vec<&mut [u8]> = slices.iter().map(|(_, slice)| unsafe { slice.get_mut() }).collect();
            anchors::fill_checked(&checked, &mut targets, &offsets)
        })
        .map_err(to_py)?;
    drop(held);
    Ok(unchecked(outcome))
}

/// Each entry's tensor hash (core::digest::tensor_hashes) with its name, computed with the GIL released.
fn hashed_entries<'a>(py: Python<'_>, entries: &'a [FullEntry<'_>]) -> PyResult<Vec<(&'a str, u128)>> {
    let (held, specs) = export_tensors(entries)?;
    let hashes = py.detach(|| {
        let inputs: Vec<DigestInput<'_>> = specs
            .iter()
            // SAFETY: `held` keeps every buffer exported until after this call.
            .map(|(name, dtype, shape, data)| DigestInput { name, dtype: *dtype, shape, data: unsafe { data.get() } })
            .collect();
        digest::tensor_hashes(&inputs)
    });
    drop(held);
    Ok(specs.into_iter().zip(hashes).map(|((name, ..), hash)| (name, hash)).collect())
}

/// The digest of a state given as (name, dtype, shape, bytes) entries: 32 hex digits (docs/format.md §10).
#[pyfunction]
fn state_digest(py: Python<'_>, entries: Vec<FullEntry<'_>>) -> PyResult<String> {
    let hashed = hashed_entries(py, &entries)?;
    Ok(digest::combine(&hashed))
}

/// Each tensor's own hash in a state digest, for (name, dtype, shape, bytes) entries: 16 bytes each, little-endian
/// (core::digest::tensor_hashes); `combine_hashes` makes the digest of a state from all of them.
#[pyfunction]
fn tensor_hashes(py: Python<'_>, entries: Vec<FullEntry<'_>>) -> PyResult<Vec<Py<PyBytes>>> {
    let hashed = hashed_entries(py, &entries)?;
    Ok(hashed.into_iter().map(|(_, hash)| PyBytes::new(py, &hash.to_le_bytes()).unbind()).collect())
}

/// The digest of a state from each tensor's name and `tensor_hashes` hash, in any order: 32 hex digits.
#[pyfunction]
fn combine_hashes(tensors: Vec<(String, [u8; 16])>) -> String {
    let named: Vec<(&str, u128)> =
        tensors.iter().map(|(name, hash)| (name.as_str(), u128::from_le_bytes(*hash))).collect();
    digest::combine(&named)
}

/// The state of a tensor's `tensor_hashes` hash before its first byte (core::digest::TensorHashParts), as bytes:
/// feed it the tensor's bytes in order with `tensor_hash_feed`, possibly on several holders in turn, then
/// `tensor_hash_finish`.
#[pyfunction]
fn tensor_hash_begin<'py>(py: Python<'py>, dtype: &str, shape: Vec<u64>) -> PyResult<Bound<'py, PyBytes>> {
    let dtype = parse_dtype(dtype, "a tensor hashed in parts")?;
    let parts = digest::TensorHashParts::begin(dtype, &shape).map_err(to_py)?;
    Ok(PyBytes::new(py, &parts.to_bytes()))
}

/// `state` (of `tensor_hash_begin` or an earlier feed) with the tensor's next bytes, a buffer or CPU contiguous
/// tensor, fed.
#[pyfunction]
fn tensor_hash_feed<'py>(py: Python<'py>, state: &[u8], data: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    let mut parts = digest::TensorHashParts::from_bytes(state).map_err(to_py)?;
    let (held, slice) = export(data, &|| "the bytes fed to a tensor's hash".to_owned(), false)?;
    // SAFETY: `held` keeps the buffer exported until after the call.
    let fed = py.detach(|| parts.feed(unsafe { slice.get() }));
    drop(held);
    fed.map_err(to_py)?;
    Ok(PyBytes::new(py, &parts.to_bytes()))
}

/// The tensor's `tensor_hashes` hash (16 bytes) from a `state` fed every byte of it.
#[pyfunction]
fn tensor_hash_finish<'py>(py: Python<'py>, state: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    let parts = digest::TensorHashParts::from_bytes(state).map_err(to_py)?;
    let hash = parts.finish().map_err(to_py)?;
    Ok(PyBytes::new(py, &hash.to_le_bytes()))
}

/// The base identity of a buffer or CPU contiguous tensor's bytes: 16 hex digits (docs/format.md §3).
#[pyfunction]
fn base_identity(py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<String> {
    let (held, slice) = export(data, &|| "base_identity's argument".to_owned(), false)?;
    // SAFETY: `held` keeps the buffer exported until after the call.
    let identity = py.detach(|| base::identity(unsafe { slice.get() }));
    drop(held);
    Ok(base::to_hex(identity))
}

/// Byte ranges (buffer or CPU contiguous tensor, first byte, bytes) exported, each checked to lie in its buffer.
#[allow(clippy::type_complexity)]
fn export_ranges(
    ranges: &[(Bound<'_, PyAny>, usize, usize)],
    what: &str,
) -> PyResult<(Vec<Held>, Vec<(RawSlice, usize, usize)>)> {
    let mut held = Vec::with_capacity(ranges.len());
    let mut runs = Vec::with_capacity(ranges.len());
    for (index, (data, start, len)) in ranges.iter().enumerate() {
        let (buffer, slice) = export(data, &|| format!("range {index} of {what}"), false)?;
        if start.checked_add(*len).is_none_or(|end| end > slice.len) {
            return Err(DeltaSyncError::new_err(format!(
                "range {index} of {what}: bytes {start}..{} of a buffer of {}",
                start.saturating_add(*len),
                slice.len
            )));
        }
        held.push(buffer);
        runs.push((slice, *start, *len));
    }
    Ok((held, runs))
}

/// The base identities (16 hex digits each) of byte ranges, each given as (buffer or CPU contiguous tensor, first
/// byte, bytes): all their blocks hashed side by side in one call.
#[pyfunction]
fn range_identities(py: Python<'_>, ranges: Vec<(Bound<'_, PyAny>, usize, usize)>) -> PyResult<Vec<String>> {
    let (held, runs) = export_ranges(&ranges, "range_identities")?;
    let identities = py.detach(|| {
        // SAFETY: `held` keeps every buffer exported until after this call; each range lies inside its buffer.
        let runs: Vec<&[u8]> =
            runs.iter().map(|(slice, start, len)| &unsafe { slice.get() }[*start..start + len]).collect();
        base::identities(&runs)
    });
    drop(held);
    Ok(identities.into_iter().map(base::to_hex).collect())
}

/// The XXH3-64 of each 256 KiB block of a buffer or CPU contiguous tensor's bytes (the last block may be
/// shorter), little-endian u64s in order: the hashes a base identity combines (docs/format.md §3.1).
#[pyfunction]
fn block_hashes<'py>(py: Python<'py>, data: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    let (held, slice) = export(data, &|| "block_hashes' argument".to_owned(), false)?;
    // SAFETY: `held` keeps the buffer exported until after the call.
    let hashes = py.detach(|| base::block_hashes(unsafe { slice.get() }));
    drop(held);
    let bytes: Vec<u8> = hashes.iter().flat_map(|hash| hash.to_le_bytes()).collect();
    Ok(PyBytes::new(py, &bytes))
}

/// `block_hashes` of byte ranges, each given as (buffer or CPU contiguous tensor, first byte, bytes): all their
/// blocks hashed side by side in one call.
#[pyfunction]
fn range_block_hashes<'py>(
    py: Python<'py>,
    ranges: Vec<(Bound<'py, PyAny>, usize, usize)>,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let (held, runs) = export_ranges(&ranges, "range_block_hashes")?;
    let hashes = py.detach(|| {
        // SAFETY: `held` keeps every buffer exported until after this call; each range lies inside its buffer.
        let runs: Vec<&[u8]> =
            runs.iter().map(|(slice, start, len)| &unsafe { slice.get() }[*start..start + len]).collect();
        base::runs_block_hashes(&runs)
    });
    drop(held);
    Ok(hashes
        .iter()
        .map(|run| PyBytes::new(py, &run.iter().flat_map(|hash| hash.to_le_bytes()).collect::<Vec<u8>>()))
        .collect())
}

/// The base identity (16 hex digits) of bytes whose whole blocks were hashed elsewhere (on a device, by
/// deltasync_rs._identity): `block_hashes` holds each whole block's hash, little-endian u64s in order, and `tail`
/// the bytes after the last whole block (shorter than a block; empty when none), hashed here.
#[pyfunction]
fn base_identity_from_blocks(py: Python<'_>, block_hashes: &[u8], tail: &Bound<'_, PyAny>) -> PyResult<String> {
    if !block_hashes.len().is_multiple_of(8) {
        return Err(DeltaSyncError::new_err("block hashes are 8 bytes each"));
    }
    let (held, slice) = export(tail, &|| "the bytes after the whole blocks".to_owned(), false)?;
    // SAFETY: `held` keeps the buffer exported until after the call.
    let tail = unsafe { slice.get() };
    if tail.len() >= base::BLOCK_BYTES {
        return Err(DeltaSyncError::new_err(format!("the tail has {} bytes, a whole block or more", tail.len())));
    }
    let mut hashes: Vec<u64> =
        block_hashes.chunks_exact(8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes"))).collect();
    if !tail.is_empty() {
        hashes.push(py.detach(|| base::block_hash(tail)));
    }
    drop(held);
    Ok(base::to_hex(base::combine(&hashes)))
}

/// A tensor's state-digest hash (`tensor_hashes`' 16 bytes) from its bytes' XXH3 round sums made elsewhere (on a
/// device, by deltasync_rs._identity): `head` the bytes up to the first summed round, `rounds` the round sums (eight
/// little-endian u64s each, in order), `tail` the bytes after them, `last` the tensor's last 64 bytes
/// (core::digest::tensor_hash_from_rounds).
#[pyfunction]
fn tensor_hash_from_rounds(
    py: Python<'_>,
    dtype: &str,
    shape: Vec<u64>,
    head: &[u8],
    rounds: &Bound<'_, PyAny>,
    tail: &[u8],
    last: &[u8],
) -> PyResult<Py<PyBytes>> {
    let dtype = parse_dtype(dtype, "a tensor hashed on its device")?;
    let (held, slice) = export(rounds, &|| "the round sums".to_owned(), false)?;
    // SAFETY: `held` keeps the buffer exported until after the call.
    let bytes = unsafe { slice.get() };
    if !bytes.len().is_multiple_of(64) {
        return Err(DeltaSyncError::new_err(format!("round sums are 64 bytes each, not {} bytes in all", bytes.len())));
    }
    let sums: Vec<[u64; 8]> = bytes
        .chunks_exact(64)
        .map(|round| {
            std::array::from_fn(|lane| u64::from_le_bytes(round[8 * lane..8 * lane + 8].try_into().expect("8")))
        })
        .collect();
    drop(held);
    let hash = py.detach(|| digest::tensor_hash_from_rounds(dtype, &shape, head, &sums, tail, last)).map_err(to_py)?;
    Ok(PyBytes::new(py, &hash.to_le_bytes()).unbind())
}

/// Sets the number of threads for later calls (0 restores DELTASYNC_NUM_THREADS or the CPU count).
#[pyfunction]
fn set_num_threads(n: usize) {
    pool::set_num_threads(n);
}

/// The number of threads the next call will use.
#[pyfunction]
fn get_num_threads() -> usize {
    pool::num_threads()
}

/// What is wrong with `aliases` as the tied names of a file (docs/format.md §2.2: the rules that need no records),
/// or None: the writer's and the reader's own check.
#[pyfunction]
fn alias_problem(aliases: BTreeMap<String, String>) -> Option<String> {
    format::check_aliases(&aliases, &[]).err()
}

/// The compare kernel this process uses: "avx512", "avx2", "sse2" or "portable".
#[pyfunction]
fn scan_kernel() -> &'static str {
    crate::core::scan::kernel().name()
}

#[pymodule(gil_used = false)]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    // Before any thread can use the core, so that a fork() never catches a lazy static half initialised.
    pool::init_statics();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("FORMAT_VERSION", format::FORMAT_VERSION)?;
    m.add("SCAN_KERNELS", PyTuple::new(py, crate::core::scan::Kernel::ALL.map(crate::core::scan::Kernel::name))?)?;
    m.add("DeltaSyncError", py.get_type::<DeltaSyncError>())?;
    m.add("DeltaFormatError", py.get_type::<DeltaFormatError>())?;
    m.add("BaseMismatchError", py.get_type::<BaseMismatchError>())?;
    m.add_class::<RawDelta>()?;
    m.add_class::<mirror::MirrorDiff>()?;
    m.add_class::<mirror::DeferredDelta>()?;
    m.add_function(wrap_pyfunction!(mirror::join_shards, m)?)?;
    m.add_function(wrap_pyfunction!(diff_files, m)?)?;
    m.add_function(wrap_pyfunction!(apply_files, m)?)?;
    m.add_function(wrap_pyfunction!(state_digest, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(combine_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(write_anchor, m)?)?;
    m.add_function(wrap_pyfunction!(base_identity, m)?)?;
    m.add_function(wrap_pyfunction!(range_identities, m)?)?;
    m.add_function(wrap_pyfunction!(base_identity_from_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(range_block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_hash_begin, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_hash_feed, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_hash_finish, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_hash_from_rounds, m)?)?;
    m.add_function(wrap_pyfunction!(file_piece_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(piece_hash, m)?)?;
    m.add_function(wrap_pyfunction!(fill_checked_pieces, m)?)?;
    m.add_function(wrap_pyfunction!(checkpoint_layout, m)?)?;
    m.add_function(wrap_pyfunction!(copy_checked_pieces, m)?)?;
    m.add_function(wrap_pyfunction!(set_num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(get_num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(scan_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(alias_problem, m)?)?;
    Ok(())
}
