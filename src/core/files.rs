//! Whole-file operations for the CLI: diff two safetensors checkpoints and apply a delta to one,
//! memory-mapping the inputs and working in bounded batches of tensors.

use std::path::{Path, PathBuf};

use memmap2::{Mmap, MmapMut};
use rayon::prelude::*;

use crate::core::apply::{apply_tensor, check_target};
use crate::core::codec::{Codec, ValueCodec};
use crate::core::delta::Delta;
use crate::core::diff::{diff_with, DiffInput};
use crate::core::dtype;
use crate::core::error::{Error, Result};
use crate::core::format::{persist, read_header, write_temp};

/// Bytes of the newer checkpoint compared per batch. Mapped pages are released chunk by chunk as they are compared
/// (and again per batch), so this bounds the encoded streams held per `diff` call, not the mapped pages.
const BATCH_BYTES: usize = 256 << 20;

/// The file at `path`, opened, and a read-only mapping of it.
fn open_and_map(path: &Path) -> Result<(std::fs::File, Mmap)> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: the mapping is read-only; a concurrent writer truncating the file would be a caller error
    // and is the same hazard every safetensors mmap reader accepts.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    Ok((file, map))
}

fn release(map: &Mmap, range: std::ops::Range<usize>) {
    // SAFETY: the mapping is private and read-only, so dropping its pages only means re-reading the file.
    let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, range.start, range.len()) };
}

/// Where one tensor of a checkpoint lies: the file it is in (an index into the checkpoint's files), its dtype, its
/// shape and its byte range in that file.
#[derive(Clone)]
struct Located {
    file: usize,
    dtype: safetensors::Dtype,
    shape: Vec<u64>,
    range: std::ops::Range<usize>,
}

/// A checkpoint of one or more safetensors files (a sharded checkpoint: every tensor in exactly one of them), each
/// memory-mapped, with every tensor located.
struct Checkpoint<'a> {
    paths: &'a [PathBuf],
    /// The files as opened: an output is copied from the very file checked, even where its path has been
    /// replaced since (another apply of the same delta, in place, that finished first).
    files: Vec<std::fs::File>,
    maps: Vec<Mmap>,
    tensors: std::collections::HashMap<String, Located>,
}

impl<'a> Checkpoint<'a> {
    fn open(paths: &'a [PathBuf]) -> Result<Self> {
        if paths.is_empty() {
            return Err(Error::invalid("a checkpoint needs at least one file"));
        }
        let (mut files, mut maps) = (Vec::with_capacity(paths.len()), Vec::with_capacity(paths.len()));
        let mut tensors = std::collections::HashMap::new();
        for (file, path) in paths.iter().enumerate() {
            let (opened, map) = open_and_map(path)?;
            let header = read_header(&map, &path.display().to_string())?;
            for (name, (dtype, shape, range)) in header.tensors {
                let located = Located { file, dtype, shape, range };
                if let Some(other) = tensors.insert(name.clone(), located) {
                    return Err(Error::format(
                        &path.display().to_string(),
                        format!(
                            "tensor {name:?} is also in {}: a checkpoint holds each tensor once",
                            paths[other.file].display()
                        ),
                    ));
                }
            }
            files.push(opened);
            maps.push(map);
        }
        Ok(Checkpoint { paths, files, maps, tensors })
    }

    /// The checkpoint's name in messages: its file, or its first file and how many others.
    fn describe(&self) -> String {
        match self.paths {
            [one] => one.display().to_string(),
            [first, rest @ ..] => format!("{} (and {} more files)", first.display(), rest.len()),
            [] => String::new(),
        }
    }

    /// Tensor names in file order (files in the order given, tensors by offset).
    fn names_in_order(&self) -> Vec<String> {
        let mut names: Vec<String> = self.tensors.keys().cloned().collect();
        names.sort_by_key(|name| {
            let t = &self.tensors[name];
            (t.file, t.range.start)
        });
        names
    }

    fn bytes(&self, tensor: &Located) -> &[u8] {
        &self.maps[tensor.file][tensor.range.clone()]
    }

    fn release(&self, tensor: &Located, bytes: std::ops::Range<usize>) {
        release(&self.maps[tensor.file], tensor.range.start + bytes.start..tensor.range.start + bytes.end);
    }
}

/// Diffs two safetensors checkpoints (each one file, or the files of a sharded checkpoint) tensor by tensor; every
/// tensor of each must match the other. `progress(done, total)` is called with bytes of the newer checkpoint
/// compared so far; returning false stops.
pub fn diff_files(
    prev: &[PathBuf],
    curr: &[PathBuf],
    values_codec: ValueCodec,
    codec: Codec,
    progress: &mut dyn FnMut(u64, u64) -> bool,
) -> Result<Delta> {
    let (prev, curr) = (Checkpoint::open(prev)?, Checkpoint::open(curr)?);
    if let Some(missing) = prev.tensors.keys().find(|k| !curr.tensors.contains_key(*k)) {
        return Err(Error::mismatch(format!(
            "tensor {missing:?} is in {} but not in {}",
            prev.describe(),
            curr.describe()
        )));
    }
    // Check every pair before comparing any, so a mismatch fails fast.
    let mut pairs = Vec::with_capacity(curr.tensors.len());
    for name in curr.names_in_order() {
        let new = curr.tensors[&name].clone();
        let old = prev.tensors.get(&name).cloned().ok_or_else(|| {
            Error::mismatch(format!("tensor {name:?} is in {} but not in {}", curr.describe(), prev.describe()))
        })?;
        if old.dtype != new.dtype || old.shape != new.shape {
            return Err(Error::mismatch(format!(
                "tensor {name:?}: {} {:?} in {}, {} {:?} in {}",
                dtype::name_of(old.dtype),
                old.shape,
                prev.paths[old.file].display(),
                dtype::name_of(new.dtype),
                new.shape,
                curr.paths[new.file].display()
            )));
        }
        pairs.push((name, old, new));
    }
    let total: u64 = pairs.iter().map(|p| p.2.range.len() as u64).sum();
    let mut done = 0u64;
    let mut tensors = Vec::with_capacity(pairs.len());
    let mut start = 0;
    while start < pairs.len() {
        let mut end = start;
        let mut batch_bytes = 0;
        while end < pairs.len() && (end == start || batch_bytes + pairs[end].2.range.len() <= BATCH_BYTES) {
            batch_bytes += pairs[end].2.range.len();
            end += 1;
        }
        let batch: Vec<DiffInput<'_>> = pairs[start..end]
            .iter()
            .map(|(name, old, new)| DiffInput {
                name: name.clone(),
                dtype: new.dtype,
                shape: new.shape.clone(),
                old: prev.bytes(old),
                new: curr.bytes(new),
            })
            .collect();
        // Hand each chunk's pages back as soon as it is compared, so that resident memory stays near
        // threads x chunk even for a tensor larger than the batch.
        let batch_pairs = &pairs[start..end];
        let compared = |index: usize, bytes: std::ops::Range<usize>| {
            let (_, old, new) = &batch_pairs[index];
            prev.release(old, bytes.clone());
            curr.release(new, bytes);
        };
        tensors.extend(diff_with(&batch, values_codec, codec, &compared)?);
        for (_, old, new) in batch_pairs {
            prev.release(old, 0..old.range.len());
            curr.release(new, 0..new.range.len());
        }
        done += batch_bytes as u64;
        if !progress(done, total) {
            return Err(Error::invalid("stopped by the progress callback"));
        }
        start = end;
    }
    Ok(Delta { tensors, packed: codec != Codec::Varint, ..Default::default() })
}

/// Writes each file of `base` (one file, or the files of a sharded checkpoint) with `delta` applied to the path at
/// the same index of `outs`. Everything is checked before a byte is written; with `check_base`, also that every
/// tensor of `base` is the exact base its record names (docs/format.md §3.1). Every output is written to a
/// temporary file beside it first and renamed into place only once all of them are written, so a failed write
/// (a full disk) leaves every output as it was.
pub fn apply_files(base: &[PathBuf], delta: &Delta, outs: &[PathBuf], check_base: bool) -> Result<()> {
    if outs.len() != base.len() {
        return Err(Error::invalid(format!("{} outputs given for {} checkpoint files", outs.len(), base.len())));
    }
    let checkpoint = Checkpoint::open(base)?;
    let mut targets = Vec::with_capacity(delta.tensors.len());
    for tensor in &delta.tensors {
        let located = checkpoint.tensors.get(&tensor.name).cloned().ok_or_else(|| {
            Error::mismatch(format!("tensor {:?} is in the delta but not in {}", tensor.name, checkpoint.describe()))
        })?;
        check_target(tensor, located.dtype, Some(&located.shape), located.range.len())?;
        targets.push((tensor, located));
    }
    if check_base {
        let bases: Vec<(usize, &[u8])> =
            targets.iter().enumerate().map(|(index, (_, located))| (index, checkpoint.bytes(located))).collect();
        crate::core::base::check_bases(delta, &bases)?;
    }
    // `context` positions are decoded from the base (checked against its identity) before anything is written.
    let decoded: Vec<Option<crate::core::codec::decode::ContextChanges>> = crate::core::pool::install(|| {
        targets
            .par_iter()
            .map(|(tensor, located)| tensor.context_changes(checkpoint.bytes(located)))
            .collect::<Result<_>>()
    })?;
    let Checkpoint { files: sources, maps, .. } = checkpoint;
    drop(maps);
    let mut written = Vec::with_capacity(base.len());
    for (file, (mut source, out)) in sources.into_iter().zip(outs).enumerate() {
        written.push(write_temp(out, |temp| {
            // An in-kernel copy (copy_file_range where the filesystem has it), then patch the copy through a
            // mapping, handing each tensor's pages back once written so resident memory stays small.
            std::io::copy(&mut source, temp)?;
            let mine: Vec<_> = targets.iter().zip(&decoded).filter(|((_, located), _)| located.file == file).collect();
            if mine.is_empty() {
                return Ok(());
            }
            // SAFETY: the temporary file is ours alone until it is renamed into place.
            let mut out_map = unsafe { MmapMut::map_mut(&*temp) }?;
            for ((tensor, located), decoded) in mine {
                let range = located.range.clone();
                apply_tensor(tensor, &mut out_map[range.clone()], decoded.as_ref()).map_err(std::io::Error::other)?;
                // SAFETY: a shared file mapping keeps written pages in the page cache; dropping them from this
                // process loses nothing.
                let _ = unsafe {
                    out_map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, range.start, range.len())
                };
            }
            out_map.flush()
        })?);
    }
    for (temp, out) in written.into_iter().zip(outs) {
        persist(temp, out)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes a safetensors file of BF16 tensors `(name, elements)`, each element's bits `fill`.
    fn checkpoint(path: &Path, tensors: &[(&str, usize)], fill: u8) {
        let data: Vec<Vec<u8>> = tensors.iter().map(|&(_, n)| vec![fill; 2 * n]).collect();
        let views: Vec<(&str, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .zip(&data)
            .map(|(&(name, n), bytes)| {
                (name, safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![n], bytes).unwrap())
            })
            .collect();
        std::fs::write(path, safetensors::tensor::serialize(views, None).unwrap()).unwrap();
    }

    /// A sharded checkpoint holds each tensor once: with a tensor in two files only one copy would be compared or
    /// patched, and the other would stay as it was. (Found by mutation testing: no test refused such a layout.)
    #[test]
    fn a_tensor_in_two_files_of_a_checkpoint_is_refused() {
        let folder = tempfile::tempdir().unwrap();
        let (a, b) = (folder.path().join("a.safetensors"), folder.path().join("b.safetensors"));
        checkpoint(&a, &[("w", 4), ("x", 2)], 1);
        checkpoint(&b, &[("w", 4), ("y", 3)], 2);
        let base = [a.clone(), b.clone()];
        let error = apply_files(&base, &Delta::default(), &[folder.path().join("o1"), folder.path().join("o2")], false)
            .unwrap_err();
        assert!(format!("{error}").contains("tensor \"w\" is also in"), "{error}");
        assert!(!folder.path().join("o1").exists() && !folder.path().join("o2").exists());
        let error = diff_files(&base, &base, ValueCodec::Diff, Codec::Compact, &mut |_, _| true).unwrap_err();
        assert!(format!("{error}").contains("tensor \"w\" is also in"), "{error}");
        checkpoint(&b, &[("y", 3)], 2); // each tensor once: taken
        apply_files(&base, &Delta::default(), &[folder.path().join("o1"), folder.path().join("o2")], false).unwrap();
    }
}
