//! Whole-file operations for the CLI: diff two safetensors checkpoints and apply a delta to one,
//! memory-mapping the inputs and working in bounded batches of tensors.

use std::path::Path;

use memmap2::{Mmap, MmapMut};
use rayon::prelude::*;

use crate::core::apply::{apply_tensor, check_target};
use crate::core::codec::{Codec, ValueCodec};
use crate::core::delta::Delta;
use crate::core::diff::{diff_with, DiffInput};
use crate::core::dtype;
use crate::core::error::{Error, Result};
use crate::core::format::{read_header, write_atomically, Header};

/// Bytes of the newer checkpoint compared per batch. Mapped pages are released chunk by chunk as they are compared
/// (and again per batch), so this bounds the encoded streams held per `diff` call, not the mapped pages.
const BATCH_BYTES: usize = 256 << 20;

fn map(path: &Path) -> Result<Mmap> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: the mapping is read-only; a concurrent writer truncating the file would be a caller error
    // and is the same hazard every safetensors mmap reader accepts.
    unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))
}

fn release(map: &Mmap, range: std::ops::Range<usize>) {
    // SAFETY: the mapping is private and read-only, so dropping its pages only means re-reading the file.
    let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, range.start, range.len()) };
}

/// Tensor names of a checkpoint in file order.
fn names_in_order(header: &Header) -> Vec<String> {
    let mut names: Vec<String> = header.tensors.keys().cloned().collect();
    names.sort_by_key(|name| header.tensors[name].2.start);
    names
}

/// Diffs two safetensors checkpoints tensor by tensor; every tensor of each must match the other.
/// `progress(done, total)` is called with bytes of the newer checkpoint compared so far; returning false stops.
pub fn diff_files(
    prev: &Path,
    curr: &Path,
    values_codec: ValueCodec,
    codec: Codec,
    progress: &mut dyn FnMut(u64, u64) -> bool,
) -> Result<Delta> {
    let (prev_map, curr_map) = (map(prev)?, map(curr)?);
    let prev_header = read_header(&prev_map, &prev.display().to_string())?;
    let curr_header = read_header(&curr_map, &curr.display().to_string())?;
    if let Some(missing) = prev_header.tensors.keys().find(|k| !curr_header.tensors.contains_key(*k)) {
        return Err(Error::mismatch(format!(
            "tensor {missing:?} is in {} but not in {}",
            prev.display(),
            curr.display()
        )));
    }
    // Check every pair before comparing any, so a mismatch fails fast.
    let mut pairs = Vec::with_capacity(curr_header.tensors.len());
    for name in names_in_order(&curr_header) {
        let (dtype, shape, curr_range) = curr_header.tensors[&name].clone();
        let (prev_dtype, prev_shape, prev_range) = prev_header.tensors.get(&name).cloned().ok_or_else(|| {
            Error::mismatch(format!("tensor {name:?} is in {} but not in {}", curr.display(), prev.display()))
        })?;
        if prev_dtype != dtype || prev_shape != shape {
            return Err(Error::mismatch(format!(
                "tensor {name:?}: {} {prev_shape:?} in {}, {} {shape:?} in {}",
                dtype::name_of(prev_dtype),
                prev.display(),
                dtype::name_of(dtype),
                curr.display()
            )));
        }
        pairs.push((name, dtype, shape, prev_range, curr_range));
    }
    let total: u64 = pairs.iter().map(|p| p.4.len() as u64).sum();
    let mut done = 0u64;
    let mut tensors = Vec::with_capacity(pairs.len());
    let mut start = 0;
    while start < pairs.len() {
        let mut end = start;
        let mut batch_bytes = 0;
        while end < pairs.len() && (end == start || batch_bytes + pairs[end].4.len() <= BATCH_BYTES) {
            batch_bytes += pairs[end].4.len();
            end += 1;
        }
        let batch: Vec<DiffInput<'_>> = pairs[start..end]
            .iter()
            .map(|(name, dtype, shape, prev_range, curr_range)| DiffInput {
                name: name.clone(),
                dtype: *dtype,
                shape: shape.clone(),
                old: &prev_map[prev_range.clone()],
                new: &curr_map[curr_range.clone()],
            })
            .collect();
        // Hand each chunk's pages back as soon as it is compared, so that resident memory stays near
        // threads x chunk even for a tensor larger than the batch.
        let batch_pairs = &pairs[start..end];
        let compared = |index: usize, bytes: std::ops::Range<usize>| {
            let (_, _, _, prev_range, curr_range) = &batch_pairs[index];
            release(&prev_map, prev_range.start + bytes.start..prev_range.start + bytes.end);
            release(&curr_map, curr_range.start + bytes.start..curr_range.start + bytes.end);
        };
        tensors.extend(diff_with(&batch, values_codec, codec, &compared)?);
        for (_, _, _, prev_range, curr_range) in &pairs[start..end] {
            release(&prev_map, prev_range.clone());
            release(&curr_map, curr_range.clone());
        }
        done += batch_bytes as u64;
        if !progress(done, total) {
            return Err(Error::invalid("stopped by the progress callback"));
        }
        start = end;
    }
    Ok(Delta { tensors, packed: codec != Codec::Varint, ..Default::default() })
}

/// Writes `base` with `delta` applied to `out`, atomically. Everything is checked before a byte is written; with
/// `check_base`, also that every tensor of `base` is the exact base its record names (docs/format.md §3.1).
pub fn apply_file(base: &Path, delta: &Delta, out: &Path, check_base: bool) -> Result<()> {
    let base_map = map(base)?;
    let header = read_header(&base_map, &base.display().to_string())?;
    let mut targets = Vec::with_capacity(delta.tensors.len());
    for tensor in &delta.tensors {
        let (dtype, shape, range) = header.tensors.get(&tensor.name).cloned().ok_or_else(|| {
            Error::mismatch(format!("tensor {:?} is in the delta but not in {}", tensor.name, base.display()))
        })?;
        check_target(tensor, dtype, Some(&shape), range.len())?;
        targets.push((tensor, range));
    }
    if check_base {
        let bases: Vec<(usize, &[u8])> =
            targets.iter().enumerate().map(|(index, (_, range))| (index, &base_map[range.clone()])).collect();
        crate::core::base::check_bases(delta, &bases)?;
    }
    // `context` positions are decoded from the base (checked against its identity) before anything is written.
    let decoded: Vec<Option<crate::core::codec::decode::ContextChanges>> = crate::core::pool::install(|| {
        targets
            .par_iter()
            .map(|(tensor, range)| tensor.context_changes(&base_map[range.clone()]))
            .collect::<Result<_>>()
    })?;
    drop(base_map);
    write_atomically(out, |file| {
        // An in-kernel copy (copy_file_range where the filesystem has it), then patch the copy through a mapping,
        // handing each tensor's pages back once written so resident memory stays small.
        std::io::copy(&mut std::fs::File::open(base)?, file)?;
        // SAFETY: the temporary file is ours alone until it is renamed into place.
        let mut out_map = unsafe { MmapMut::map_mut(&*file) }?;
        for ((tensor, range), decoded) in targets.iter().zip(&decoded) {
            apply_tensor(tensor, &mut out_map[range.clone()], decoded.as_ref()).map_err(std::io::Error::other)?;
            // SAFETY: a shared file mapping keeps written pages in the page cache; dropping them from this
            // process loses nothing.
            let _ =
                unsafe { out_map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, range.start, range.len()) };
        }
        out_map.flush()
    })
}
