//! The on-disk container: a valid safetensors file of U8 streams plus metadata (docs/format.md), in the named
//! layout (version 1: a `W:pos`/`W:val` pair per tensor, JSON records) or the packed one (version 2, §4.1: one
//! tensor of binary records, one of all streams).
//!
//! Writing is zero-copy: the header is built, then each stream is copied once, straight from the delta
//! into the output. Reading validates the safetensors header with the safetensors crate, then every
//! per-tensor record, then every stream, before a `Delta` is handed out.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;
use std::mem::MaybeUninit;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use rayon::prelude::*;

use crate::core::base;
use crate::core::codec::PositionCodec;
use crate::core::delta::{Delta, TensorDelta};
use crate::core::dtype::{self, Dtype};
use crate::core::error::{Error, Result};
use crate::core::records::{self, Record, RECORDS_KEY, STREAMS_KEY};
use crate::core::stream::{Backing, Stream};

pub const FORMAT_NAME: &str = "deltasync";
/// The version of the named layout, which varint deltas and anchors keep.
pub const FORMAT_VERSION: &str = "1";
/// The version of the packed layout (§4.1), which older readers refuse by its number.
pub const PACKED_FORMAT_VERSION: &str = "2";
pub const POSITIONS_SUFFIX: &str = ":pos";
pub const VALUES_SUFFIX: &str = ":val";
/// The safetensors header's own key: no tensor may be stored under it.
pub const METADATA_KEY: &str = "__metadata__";
/// The metadata key of the file's checksum (§2.1): the base identity (§3.1) of the whole file with its own 16 digits
/// read as zeros. `encode` writes it on every file, and core::anchors on the anchors it streams; readers check it
/// wherever it is.
pub const CHECKSUM_KEY: &str = "file_xxh3";
/// Header keys the format owns; caller metadata may not use them.
/// Metadata key of the tied names (docs/format.md §2.2).
pub const ALIASES_KEY: &str = "aliases";
pub const RESERVED_KEYS: [&str; 8] =
    ["format", "format_version", "kind", "tensors", "step", "base_step", CHECKSUM_KEY, ALIASES_KEY];
/// What the checksum's value stands in for while the file is hashed.
const CHECKSUM_PLACEHOLDER: &str = "0000000000000000";

/// Whether and how `encode_with` gives a file its checksum (§2.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Checksum {
    /// No checksum key: a file as an older writer made it.
    Absent,
    /// The checksum, computed over the laid-out file (every piece read once).
    Computed,
    /// The key, with the 16 ASCII zeros the definition hashes in place of its digits: a writer that streams the file
    /// hashes it as it writes, then writes the digits at `Encoded::checksum_at` (core::anchors).
    Placeholder,
}

/// One safetensors entry of the output, usually borrowing its bytes from the delta.
pub struct Entry<'a> {
    pub key: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub data: Cow<'a, [u8]>,
}

/// A file laid out for writing: the padded header, then the data pieces in order.
pub struct Encoded<'a> {
    header: Vec<u8>,
    pieces: Vec<Cow<'a, [u8]>>,
}

impl Encoded<'_> {
    /// Where the 16 zeros of the checksum's placeholder start, from the file's first byte: a file laid out by
    /// `encode_with(.., Checksum::Placeholder)`.
    pub fn checksum_at(&self) -> Result<usize> {
        checksum_at(&self.header, CHECKSUM_PLACEHOLDER)
            .map(|at| 8 + at)
            .map_err(|problem| Error::invalid(format!("the file's checksum cannot be placed: {problem}")))
    }

    /// Computes the file's checksum (§2.1), every piece read once, writes its digits over the placeholder at `at`
    /// (`checksum_at`) and returns it.
    pub fn seal(&mut self, at: usize) -> u64 {
        let length = (self.header.len() as u64).to_le_bytes();
        let mut pieces: Vec<&[u8]> = vec![&length, &self.header];
        pieces.extend(self.pieces.iter().map(|piece| &piece[..]));
        let checksum = base::identity_of_pieces(&pieces);
        self.header[at - 8..at - 8 + CHECKSUM_PLACEHOLDER.len()].copy_from_slice(base::to_hex(checksum).as_bytes());
        checksum
    }

    /// Total file size.
    pub fn len(&self) -> usize {
        8 + self.header.len() + self.pieces.iter().map(|p| p.len()).sum::<usize>()
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    /// Fills `out`, which must be exactly `len()` bytes.
    pub fn fill(&self, out: &mut [u8]) {
        // SAFETY: `[u8]` and `[MaybeUninit<u8>]` have one layout, and `fill_uninit` writes only initialised bytes.
        self.fill_uninit(unsafe { &mut *(out as *mut [u8] as *mut [MaybeUninit<u8>]) });
    }

    /// Fills `out` (which must be exactly `len()` bytes, initialised or not), so that the caller need not
    /// zero a fresh buffer first. Large files are copied by the pool's threads piece by piece: the copy is mostly
    /// the kernel handing out fresh pages, which threads do side by side.
    pub fn fill_uninit(&self, out: &mut [MaybeUninit<u8>]) {
        assert_eq!(out.len(), self.len(), "output buffer size");
        fn copy(target: &mut [MaybeUninit<u8>], source: &[u8]) {
            debug_assert_eq!(target.len(), source.len());
            // SAFETY: same length, and a `&mut` target cannot overlap a `&` source.
            unsafe { std::ptr::copy_nonoverlapping(source.as_ptr(), target.as_mut_ptr().cast::<u8>(), source.len()) };
        }
        let (length, rest) = out.split_at_mut(8);
        copy(length, &(self.header.len() as u64).to_le_bytes());
        let (header, mut rest) = rest.split_at_mut(self.header.len());
        copy(header, &self.header);
        let mut jobs: Vec<(&mut [MaybeUninit<u8>], &[u8])> = Vec::with_capacity(self.pieces.len());
        for piece in &self.pieces {
            let (target, tail) = std::mem::take(&mut rest).split_at_mut(piece.len());
            jobs.push((target, piece));
            rest = tail;
        }
        if self.len() < PARALLEL_FILL_BYTES {
            jobs.into_iter().for_each(|(target, piece)| copy(target, piece));
        } else {
            use rayon::prelude::*;
            crate::core::pool::install(|| jobs.into_par_iter().for_each(|(target, piece)| copy(target, piece)));
        }
    }

    pub fn write_to(&self, writer: &mut impl Write) -> std::io::Result<()> {
        writer.write_all(&(self.header.len() as u64).to_le_bytes())?;
        writer.write_all(&self.header)?;
        for piece in &self.pieces {
            writer.write_all(piece)?;
        }
        Ok(())
    }

    /// Writes the file to `path` atomically.
    pub fn save(&self, path: &Path) -> Result<()> {
        write_atomically(path, |file| {
            let mut writer = std::io::BufWriter::with_capacity(1 << 20, file);
            self.write_to(&mut writer)?;
            writer.flush()
        })
    }

    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len()];
        self.fill(&mut out);
        out
    }
}

/// Files smaller than this are copied on the calling thread.
const PARALLEL_FILL_BYTES: usize = 1 << 20;

/// One entry as laid out in the file: its bytes in one or more pieces, copied one after another.
struct Laid<'a> {
    key: String,
    dtype: Dtype,
    shape: Vec<u64>,
    pieces: Vec<Cow<'a, [u8]>>,
}

impl<'a> From<Entry<'a>> for Laid<'a> {
    fn from(entry: Entry<'a>) -> Self {
        Laid { key: entry.key, dtype: entry.dtype, shape: entry.shape, pieces: vec![entry.data] }
    }
}

/// A `U8` entry of the given pieces.
fn bytes_entry<'a>(key: String, pieces: Vec<Cow<'a, [u8]>>) -> Laid<'a> {
    let len = pieces.iter().map(|p| p.len() as u64).sum();
    Laid { key, dtype: Dtype::U8, shape: vec![len], pieces }
}

/// The entries of `delta`'s file: whole tensors first, widest dtype first, so each lands aligned to its element
/// size; then the streams, per tensor (`W:pos`, `W:val`) or packed after the packed record list.
fn entries<'a>(delta: &'a Delta, packed_records: Option<Vec<u8>>) -> Vec<Laid<'a>> {
    let mut dense: Vec<&TensorDelta> = delta.tensors.iter().filter(|t| t.is_dense()).collect();
    dense.sort_by_key(|t| std::cmp::Reverse(t.width()));
    let mut out: Vec<Laid<'a>> = dense
        .into_iter()
        .map(|t| Laid {
            key: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone().unwrap_or_default(),
            pieces: vec![Cow::Borrowed(&t.values[..])],
        })
        .collect();
    let sparse = delta.tensors.iter().filter(|t| !t.is_dense() && t.changed > 0);
    let streams = |t: &'a TensorDelta| [&t.positions, &t.values].into_iter().filter(|stream| !stream.is_empty());
    match packed_records {
        Some(records) => {
            out.push(bytes_entry(RECORDS_KEY.to_owned(), vec![Cow::Owned(records)]));
            let pieces = sparse.flat_map(streams).map(|stream| Cow::Borrowed(&stream[..])).collect();
            out.push(bytes_entry(STREAMS_KEY.to_owned(), pieces));
        }
        None => {
            for t in sparse {
                for (suffix, stream) in [(POSITIONS_SUFFIX, &t.positions), (VALUES_SUFFIX, &t.values)] {
                    if !stream.is_empty() {
                        out.push(bytes_entry(format!("{}{suffix}", t.name), vec![Cow::Borrowed(&stream[..])]));
                    }
                }
            }
        }
    }
    out
}

/// Refuses a tensor name the container cannot store: the safetensors header's `__metadata__` key, the packed
/// layout's two tensors, and names ending in the stream suffixes, which would collide with another tensor's
/// streams. Every writer (diff, anchor, mirror, encode) calls this, and the reader refuses what it refuses.
pub fn check_tensor_name(name: &str) -> Result<()> {
    if name == METADATA_KEY {
        return Err(Error::invalid(format!("tensor {name:?}: the name is the safetensors header's own key")));
    }
    if name == RECORDS_KEY || name == STREAMS_KEY {
        return Err(Error::invalid(format!("tensor {name:?}: the name is reserved for the packed layout")));
    }
    if name.ends_with(POSITIONS_SUFFIX) || name.ends_with(VALUES_SUFFIX) {
        return Err(Error::invalid(format!(
            "tensor {name:?}: names ending in {POSITIONS_SUFFIX:?} or {VALUES_SUFFIX:?} are reserved for delta streams"
        )));
    }
    Ok(())
}

/// The `format_version` that `encode` writes for `delta`: the packed layout's when `delta.packed` asks for it and
/// some tensor is not stored whole (an anchor stays an ordinary checkpoint), else the named layout's.
pub fn version_of(delta: &Delta) -> &'static str {
    if delta.packed && !delta.is_anchor() {
        PACKED_FORMAT_VERSION
    } else {
        FORMAT_VERSION
    }
}

/// Builds the header for `delta` and lists the pieces that follow it, in the layout of `version_of(delta)`, with
/// the file's checksum (§2.1). Streams loaded with their check left to the apply (`TensorDelta::unchecked`) are
/// checked first: a file is only ever written with streams known to be sound.
pub fn encode(delta: &Delta) -> Result<Encoded<'_>> {
    encode_with(delta, Checksum::Computed)
}

/// `encode`, with the checksum computed, left out, or as a placeholder for a writer that hashes the file as it
/// streams it (core::anchors).
pub fn encode_with(delta: &Delta, checksum: Checksum) -> Result<Encoded<'_>> {
    for tensor in &delta.tensors {
        check_tensor_name(&tensor.name)?;
    }
    crate::core::pool::install(|| {
        delta
            .tensors
            .par_iter()
            .filter(|t| t.unchecked)
            .try_for_each(|tensor| tensor.check_streams("delta").map(|_| ()))
    })?;
    let version = version_of(delta);
    let packed = version == PACKED_FORMAT_VERSION;
    let records: Vec<Record> = delta
        .tensors
        .iter()
        .map(|t| Record {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            changed: t.changed,
            positions: t.positions_codec,
            values: t.values_codec,
            base: t.base,
            differing: t.differing,
            stream_lengths: (packed && !t.is_dense()).then(|| (t.positions.len() as u64, t.values.len() as u64)),
        })
        .collect();
    let mut metadata: BTreeMap<String, String> = BTreeMap::new();
    for (key, value) in &delta.metadata {
        if RESERVED_KEYS.contains(&key.as_str()) {
            return Err(Error::invalid(format!("metadata key {key:?} is reserved by the format")));
        }
        metadata.insert(key.clone(), value.clone());
    }
    metadata.insert("format".into(), FORMAT_NAME.into());
    metadata.insert("format_version".into(), version.into());
    metadata.insert("kind".into(), if delta.is_anchor() { "anchor" } else { "delta" }.into());
    if !packed {
        metadata.insert("tensors".into(), records::to_json(&records));
    }
    if let Some(step) = delta.step {
        metadata.insert("step".into(), step.to_string());
    }
    if let Some(base) = delta.base_step {
        metadata.insert("base_step".into(), base.to_string());
    }
    if !delta.aliases.is_empty() {
        check_aliases(&delta.aliases, &delta.tensors).map_err(Error::invalid)?;
        let json = serde_json::to_string(&delta.aliases).map_err(|e| Error::invalid(format!("aliases: {e}")))?;
        metadata.insert(ALIASES_KEY.into(), json);
    }
    if checksum != Checksum::Absent {
        metadata.insert(CHECKSUM_KEY.into(), CHECKSUM_PLACEHOLDER.into());
    }
    let mut encoded = lay_out(&metadata, entries(delta, packed.then(|| records::to_packed(&records))))?;
    if checksum == Checksum::Computed {
        let at = encoded.checksum_at()?;
        encoded.seal(at);
    }
    Ok(encoded)
}

/// Where, in the JSON `header`, the 16 digits of the checksum whose value is `value` start: the header must hold
/// `"file_xxh3":"<value>"` exactly once (§2.1).
fn checksum_at(header: &[u8], value: &str) -> std::result::Result<usize, String> {
    let pattern = format!("\"{CHECKSUM_KEY}\":\"{value}\"");
    let mut found = memchr::memmem::find_iter(header, pattern.as_bytes());
    match (found.next(), found.next()) {
        (Some(at), None) => Ok(at + pattern.len() - 1 - value.len()),
        (None, _) => Err(format!("the header does not hold {pattern} as written")),
        (Some(_), Some(_)) => Err(format!("the header holds {pattern} more than once")),
    }
}

/// Makes the checksum of the file in `bytes` right again, if its JSON header parses and holds one, and says whether
/// it did: for tests and fuzzers that edit a file on purpose and aim at a check behind the checksum.
pub fn reseal(bytes: &mut [u8]) -> bool {
    let Some((value, header_len)) = raw_checksum(bytes) else { return false };
    let Ok(at) = checksum_at(&bytes[8..8 + header_len], &value) else { return false };
    let digits = 8 + at..8 + at + CHECKSUM_PLACEHOLDER.len();
    bytes[digits.clone()].copy_from_slice(CHECKSUM_PLACEHOLDER.as_bytes());
    let checksum = base::to_hex(base::identity(bytes));
    bytes[digits].copy_from_slice(checksum.as_bytes());
    true
}

/// Blocks of a file hashed between two releases of a mapping's pages by `file_identity` (16 MiB).
const CHECKSUM_WINDOW_BLOCKS: usize = 64;

/// The checksum's hash (§2.1) of the file in `backing`, the 16 digits at `at` read as ASCII zeros: blocks hashed in
/// parallel in the deltasync pool, a window at a time, and a mapped file's pages dropped from memory after each
/// window, so that checking an anchor of any size holds little of it at once (applying reads its pages again).
fn file_identity(backing: &Backing, at: usize) -> u64 {
    let bytes: &[u8] = backing;
    let pieces = [&bytes[..at], CHECKSUM_PLACEHOLDER.as_bytes(), &bytes[at + CHECKSUM_PLACEHOLDER.len()..]];
    let blocks = bytes.len().div_ceil(base::BLOCK_BYTES);
    let mut hashes = Vec::with_capacity(blocks);
    for first in (0..blocks).step_by(CHECKSUM_WINDOW_BLOCKS) {
        let end = (first + CHECKSUM_WINDOW_BLOCKS).min(blocks);
        hashes.extend(base::block_hashes_of_pieces(&pieces, first..end));
        backing.release(first * base::BLOCK_BYTES..(end * base::BLOCK_BYTES).min(bytes.len()));
    }
    base::combine(&hashes)
}

/// Checks the checksum `value` of the file in `backing` (whole) whose JSON header is `header_len` bytes: §2.1.
fn check_checksum(backing: &Backing, header_len: usize, value: &str, source_name: &str) -> Result<()> {
    let bytes: &[u8] = backing;
    let bad = |message: String| Error::format(source_name, message);
    let expected = base::parse_hex(value)
        .ok_or_else(|| bad(format!("metadata {CHECKSUM_KEY:?} is {value:?}, not 16 lowercase hex digits")))?;
    let at = 8 + checksum_at(&bytes[8..8 + header_len], value).map_err(|problem| {
        bad(format!(
            "its checksum cannot be checked: {problem} (docs/format.md §2.1); was the header rewritten since the file \
             was written?"
        ))
    })?;
    let found = file_identity(backing, at);
    if found != expected && value == CHECKSUM_PLACEHOLDER {
        return Err(bad(format!(
            "the file is damaged: its checksum ({CHECKSUM_KEY}) is still the writer's placeholder, 16 zeros: the \
             writer stopped before it wrote the checksum (a write cut short?); write, fetch or copy it again"
        )));
    }
    if found != expected {
        return Err(bad(format!(
            "the file is damaged: its bytes hash to {} where its checksum ({CHECKSUM_KEY}) says {value}; \
             fetch or copy it again",
            base::to_hex(found)
        )));
    }
    Ok(())
}

/// Lays out any safetensors file: string metadata plus entries in the given data order.
pub fn encode_entries<'a>(metadata: &BTreeMap<String, String>, entries: Vec<Entry<'a>>) -> Result<Encoded<'a>> {
    lay_out(metadata, entries.into_iter().map(Laid::from).collect())
}

fn lay_out<'a>(metadata: &BTreeMap<String, String>, entries: Vec<Laid<'a>>) -> Result<Encoded<'a>> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::to_value(metadata).expect("strings serialize"));
    let mut offset = 0usize;
    let mut keys = HashSet::new();
    for entry in &entries {
        if !keys.insert(entry.key.as_str()) {
            return Err(Error::invalid(format!("two tensors would be stored under the key {:?}", entry.key)));
        }
        let end = offset + entry.pieces.iter().map(|p| p.len()).sum::<usize>();
        header.insert(
            entry.key.clone(),
            serde_json::json!({
                "dtype": dtype::name_of(entry.dtype),
                "shape": entry.shape,
                "data_offsets": [offset, end],
            }),
        );
        offset = end;
    }
    let mut header = serde_json::to_vec(&serde_json::Value::Object(header)).expect("header serializes");
    // Pad with spaces so that data starts 8-byte aligned, as safetensors writers do.
    header.resize(header.len().div_ceil(8) * 8, b' ');
    let pieces = entries.into_iter().flat_map(|e| e.pieces).filter(|p| !p.is_empty()).collect();
    Ok(Encoded { header, pieces })
}

/// Serializes a delta to one byte vector.
pub fn to_bytes(delta: &Delta) -> Result<Vec<u8>> {
    Ok(encode(delta)?.to_vec())
}

/// Writes `write` to a temporary file beside `path`, then renames it into place, so readers never see
/// half a file. The result has the mode of the file it replaces, or for a new file 0o666 less the umask, as
/// any plain `open` would give (the temp file alone would be 0o600).
pub fn write_atomically(path: &Path, write: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>) -> Result<()> {
    persist(write_temp(path, write)?, path)
}

/// The first half of `write_atomically`: `write` fills a new temporary file beside `path` (with `path`'s mode where
/// it exists), which is synced to disk and handed back, to be renamed over `path` by `persist`. Dropped instead, it
/// is removed.
pub fn write_temp(
    path: &Path,
    write: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>,
) -> Result<tempfile::NamedTempFile> {
    let dir = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    let mut builder = tempfile::Builder::new();
    builder.prefix(".deltasync-").suffix(".tmp");
    #[cfg(unix)]
    builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666));
    let mut temp = builder.tempfile_in(dir).map_err(|e| Error::io(path, e))?;
    if let Ok(existing) = std::fs::metadata(path) {
        temp.as_file().set_permissions(existing.permissions()).map_err(|e| Error::io(path, e))?;
    }
    write(temp.as_file_mut()).map_err(|e| Error::io(path, e))?;
    temp.as_file().sync_all().map_err(|e| Error::io(path, e))?;
    Ok(temp)
}

/// Renames a temporary file written by `write_temp` over `path`.
pub fn persist(temp: tempfile::NamedTempFile, path: &Path) -> Result<()> {
    temp.persist(path).map_err(|e| Error::io(path, e.error))?;
    Ok(())
}

/// Saves a delta to `path` atomically.
pub fn save(delta: &Delta, path: &Path) -> Result<()> {
    encode(delta)?.save(path)
}

/// A parsed safetensors header: metadata, and each tensor's dtype, shape and absolute byte range.
pub struct Header {
    /// The JSON header's length in bytes (padding included), after the 8-byte length.
    pub len: usize,
    pub metadata: HashMap<String, String>,
    pub tensors: HashMap<String, (Dtype, Vec<u64>, Range<usize>)>,
}

/// Parses and validates a safetensors header with the safetensors crate.
pub fn read_header(bytes: &[u8], source_name: &str) -> Result<Header> {
    let (header_len, parsed) = safetensors::SafeTensors::read_metadata(bytes)
        .map_err(|e| Error::format(source_name, format!("not a valid safetensors file: {e}")))?;
    let data_start = 8 + header_len;
    let tensors = parsed
        .tensors()
        .into_iter()
        .map(|(name, info)| {
            let range = data_start + info.data_offsets.0..data_start + info.data_offsets.1;
            let shape = info.shape.iter().map(|&d| d as u64).collect();
            (name, (info.dtype, shape, range))
        })
        .collect();
    Ok(Header { len: header_len, metadata: parsed.metadata().clone().unwrap_or_default(), tensors })
}

/// Checks tied names against a file's records (docs/format.md §2.2): every alias and every name it is written under
/// is a valid tensor name, not empty and not each other; no alias has a record of its own (which would make it no
/// alias), and none is written under another alias.
pub fn check_aliases(aliases: &BTreeMap<String, String>, tensors: &[TensorDelta]) -> std::result::Result<(), String> {
    for (alias, name) in aliases {
        for one in [alias, name] {
            if one.is_empty() {
                return Err(format!("aliases: {alias:?} -> {name:?}: a name is empty"));
            }
            check_tensor_name(one).map_err(|e| format!("aliases: {e}"))?;
        }
        if alias == name {
            return Err(format!("aliases: {alias:?} is written under its own name"));
        }
        if aliases.contains_key(name) {
            return Err(format!("aliases: {alias:?} is written under {name:?}, itself an alias"));
        }
        if tensors.iter().any(|t| &t.name == alias) {
            return Err(format!("aliases: {alias:?} has a record of its own in the file"));
        }
    }
    Ok(())
}

/// A JSON object of names with every key once: a map would keep the last of a repeated key, which another reader
/// might not (and would then write the alias from another tensor).
struct UniqueNames(BTreeMap<String, String>);

impl<'de> serde::Deserialize<'de> for UniqueNames {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        struct Names;
        impl<'de> serde::de::Visitor<'de> for Names {
            type Value = UniqueNames;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object of names")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> std::result::Result<UniqueNames, A::Error> {
                let mut names = BTreeMap::new();
                while let Some((alias, name)) = map.next_entry::<String, String>()? {
                    if names.insert(alias.clone(), name).is_some() {
                        return Err(serde::de::Error::custom(format!("{alias:?} is listed twice")));
                    }
                }
                Ok(UniqueNames(names))
            }
        }
        deserializer.deserialize_map(Names)
    }
}

/// The tied names of a file's metadata: a JSON object of strings (docs/format.md §2.2), checked against its records.
fn parse_aliases(
    metadata: &HashMap<String, String>,
    tensors: &[TensorDelta],
    source_name: &str,
) -> Result<BTreeMap<String, String>> {
    let Some(json) = metadata.get(ALIASES_KEY) else { return Ok(BTreeMap::new()) };
    let UniqueNames(aliases) = serde_json::from_str(json).map_err(|e| {
        Error::format(source_name, format!("metadata {ALIASES_KEY:?} is not a JSON object of names: {e}"))
    })?;
    if aliases.is_empty() {
        return Err(Error::format(source_name, format!("metadata {ALIASES_KEY:?} is empty (a writer leaves it out)")));
    }
    check_aliases(&aliases, tensors).map_err(|message| Error::format(source_name, message))?;
    Ok(aliases)
}

fn parse_step(metadata: &HashMap<String, String>, key: &str, source_name: &str) -> Result<Option<u64>> {
    metadata
        .get(key)
        .map(|value| {
            value
                .parse::<u64>()
                .map_err(|_| Error::format(source_name, format!("metadata {key:?} is {value:?}, not a step number")))
        })
        .transpose()
}

/// Reads a delta from a whole file's bytes: a deltasync file, or a TRL weight patch.
pub fn read(backing: Arc<Backing>, source_name: &str) -> Result<Delta> {
    read_checked(backing, source_name, false)
}

/// `read`, with `defer`: the streams of tensors whose check can wait for the apply (`TensorDelta::check_can_wait`)
/// are checked only as far as their headers, and the rest when a reader decodes them.
pub fn read_checked(backing: Arc<Backing>, source_name: &str, defer: bool) -> Result<Delta> {
    read_with(backing, source_name, defer, true)
}

/// `read_checked`, with the file's checksum (§2.1) checked where it has one, or not (`checksum = false`: only for a
/// stand-in whose tensors' bytes are checked otherwise, as an anchor read by ranges).
pub fn read_with(backing: Arc<Backing>, source_name: &str, defer: bool, checksum: bool) -> Result<Delta> {
    let header = match read_header(&backing, source_name) {
        Ok(header) => header,
        // A file cut short or lengthened fails the container's checks; where its checksum can still be found, the
        // error says it is damaged.
        Err(error) => {
            return Err(match checksum.then(|| raw_checksum(&backing)).flatten() {
                Some((value, header_len))
                    if base::parse_hex(&value).is_some()
                        && checksum_at(&backing[8..8 + header_len], &value).is_ok() =>
                {
                    check_checksum(&backing, header_len, &value, source_name).err().unwrap_or(error)
                }
                _ => error,
            })
        }
    };
    // The checksum is checked after the structure, so that a damaged file still fails the first check it breaks
    // (and fuzzers still reach every one), but a damaged file is reported as such whichever check fails.
    let value = header.metadata.get(CHECKSUM_KEY).cloned().filter(|_| checksum);
    let header_len = header.len;
    let read = match header.metadata.get("format").map(String::as_str) {
        Some(FORMAT_NAME) => read_deltasync(Arc::clone(&backing), header, source_name, defer),
        Some(crate::core::trl::FORMAT_NAME) => crate::core::trl::read(&backing, &header, source_name),
        Some(other) => Err(Error::format(source_name, format!("unknown format {other:?} in the header metadata"))),
        None => Err(Error::format(
            source_name,
            "no 'format' in the header metadata: not a deltasync delta or a TRL weight patch \
             (a plain checkpoint is a base to apply to, not a delta)",
        )),
    };
    match value.map(|value| check_checksum(&backing, header_len, &value, source_name)) {
        Some(Err(damaged)) => Err(damaged),
        _ => read,
    }
}

/// The checksum of a file whose container is not sound (say, cut short), when its JSON header still parses and
/// holds one: its value and the header's length.
fn raw_checksum(bytes: &[u8]) -> Option<(String, usize)> {
    let header_len = usize::try_from(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?)).ok()?;
    let header = bytes.get(8..8usize.checked_add(header_len)?)?;
    let document: serde_json::Value = serde_json::from_slice(header).ok()?;
    let value = document.get(METADATA_KEY)?.get(CHECKSUM_KEY)?.as_str()?;
    Some((value.to_owned(), header_len))
}

/// Takes a 1-D `U8` tensor out of the header: its byte range, or None when it is absent.
fn take_bytes(header: &mut Header, key: &str, bad: &impl Fn(String) -> Error) -> Result<Option<Range<usize>>> {
    match header.tensors.remove(key) {
        Some((Dtype::U8, shape, range)) if shape.len() == 1 => Ok(Some(range)),
        Some(_) => Err(bad(format!("tensor {key:?} must be a 1-D U8 tensor"))),
        None => Ok(None),
    }
}

/// Where the streams of a file's records are: named tensors (version 1), or consecutive slices of the packed
/// streams tensor (version 2), the next one starting at `next`.
enum Streams {
    Named,
    Packed { next: usize, end: usize },
}

fn read_deltasync(backing: Arc<Backing>, mut header: Header, source_name: &str, defer: bool) -> Result<Delta> {
    let bad = |message: String| Error::format(source_name, message);
    let (records, mut streams) = match header.metadata.get("format_version").map(String::as_str) {
        Some(FORMAT_VERSION) => {
            let json =
                header.metadata.get("tensors").ok_or_else(|| bad("no 'tensors' list in the header metadata".into()))?;
            (records::from_json(json).map_err(bad)?, Streams::Named)
        }
        Some(PACKED_FORMAT_VERSION) => {
            if header.metadata.contains_key("tensors") {
                return Err(bad("a packed file keeps its records in a tensor, not in the 'tensors' metadata".into()));
            }
            let missing = |key: &str| bad(format!("the packed tensor {key:?} is missing"));
            let list = take_bytes(&mut header, RECORDS_KEY, &bad)?.ok_or_else(|| missing(RECORDS_KEY))?;
            let packed = take_bytes(&mut header, STREAMS_KEY, &bad)?.ok_or_else(|| missing(STREAMS_KEY))?;
            let records =
                records::from_packed(&backing[list]).map_err(|e| bad(format!("tensor {RECORDS_KEY:?}: {e}")))?;
            (records, Streams::Packed { next: packed.start, end: packed.end })
        }
        Some(other) => {
            return Err(bad(format!(
                "format_version {other:?} is not supported (this reader knows {FORMAT_VERSION:?} and \
                 {PACKED_FORMAT_VERSION:?})"
            )))
        }
        None => return Err(bad("no 'format_version' in the header metadata".into())),
    };
    let packed = matches!(streams, Streams::Packed { .. });
    let mut names = HashSet::with_capacity(records.len());
    if let Some(twice) = records.iter().find(|r| !names.insert(r.name.as_str())) {
        return Err(bad(format!("tensor {:?} is listed twice", twice.name)));
    }
    let mut tensors = Vec::with_capacity(records.len());
    // Declared sizes are checked, never wrapped: each shape's element count, and their sum (`Delta::num_elements`).
    let mut total_elements = 0u64;
    for record in records {
        let name = record.name.as_str();
        check_tensor_name(name).map_err(|e| bad(e.to_string()))?;
        if let Some(shape) = &record.shape {
            let numel =
                dtype::numel(shape).ok_or_else(|| bad(format!("tensor {name:?}: shape {shape:?} overflows")))?;
            total_elements = total_elements
                .checked_add(numel)
                .ok_or_else(|| bad(format!("tensor {name:?}: the tensors' element counts overflow 64 bits")))?;
        }
        if let Some(differing) = record.differing {
            if !record.is_whole() || differing == 0 || differing > record.changed {
                return Err(bad(format!(
                    "tensor {name:?}: differing={differing} needs a tensor stored whole with changed={} or more, \
                     and more than 0",
                    record.changed
                )));
            }
        }
        let mut tensor = TensorDelta {
            name: record.name.clone(),
            dtype: record.dtype,
            shape: record.shape.clone(),
            changed: record.changed,
            positions_codec: record.positions,
            values_codec: record.values,
            positions: Stream::empty(),
            values: Stream::empty(),
            last_position: None,
            base: record.base,
            differing: record.differing,
            unchecked: false,
        };
        let shared = |range: Range<usize>| Stream::Shared { backing: Arc::clone(&backing), range };
        if tensor.is_dense() {
            let shape =
                tensor.shape.clone().ok_or_else(|| bad(format!("tensor {name:?}: a dense tensor needs a shape")))?;
            match header.tensors.remove(name) {
                Some((stored, stored_shape, range)) if stored == record.dtype && stored_shape == shape => {
                    tensor.values = shared(range);
                }
                Some(_) => {
                    return Err(bad(format!("tensor {name:?}: stored dtype or shape disagrees with its record")))
                }
                None => return Err(bad(format!("tensor {name:?}: its data is missing"))),
            }
        } else if let Streams::Packed { next, end } = &mut streams {
            let (positions_len, values_len) = record.stream_lengths.expect("a packed record not stored whole");
            if tensor.changed == 0 && (positions_len, values_len) != (0, 0) {
                return Err(bad(format!(
                    "tensor {name:?}: changes nothing, yet has streams of {positions_len} and {values_len} bytes"
                )));
            }
            let mut slice = |len: u64, what: &str| -> Result<Stream> {
                let stop = usize::try_from(len).ok().and_then(|len| next.checked_add(len)).filter(|stop| stop <= end);
                let stop = stop.ok_or_else(|| {
                    bad(format!(
                        "tensor {name:?}: its {what} stream of {len} bytes runs past the end of {STREAMS_KEY:?}"
                    ))
                })?;
                let stream = shared(*next..stop);
                *next = stop;
                Ok(stream)
            };
            tensor.positions = slice(positions_len, "position")?;
            tensor.values = slice(values_len, "value")?;
        } else if tensor.changed > 0 {
            // Positions `all` have no position stream, not even an empty one (§4).
            let mut take_stream = |suffix: &str, wanted: bool| -> Result<Stream> {
                let key = format!("{name}{suffix}");
                match take_bytes(&mut header, &key, &|_| {
                    bad(format!("tensor {name:?}: stream {key:?} must be a 1-D U8 tensor"))
                })? {
                    Some(range) if wanted => Ok(shared(range)),
                    Some(_) => Err(bad(format!("tensor {name:?}: positions 'all' with a position stream"))),
                    None if wanted => Err(bad(format!("tensor {name:?}: stream {key:?} is missing"))),
                    None => Ok(Stream::empty()),
                }
            };
            tensor.positions = take_stream(POSITIONS_SUFFIX, tensor.positions_codec != PositionCodec::All)?;
            tensor.values = take_stream(VALUES_SUFFIX, true)?;
        }
        tensors.push(tensor);
    }
    if let Streams::Packed { next, end } = streams {
        if next != end {
            return Err(bad(format!("tensor {STREAMS_KEY:?} has {} bytes after the records' last stream", end - next)));
        }
    }
    if let Some(extra) = header.tensors.keys().next() {
        return Err(bad(format!("tensor {extra:?} is stored but not listed in the file's records")));
    }
    let metadata = header.metadata;
    let aliases = parse_aliases(&metadata, &tensors, source_name)?;
    let mut delta = Delta {
        aliases,
        tensors,
        step: parse_step(&metadata, "step", source_name)?,
        base_step: parse_step(&metadata, "base_step", source_name)?,
        metadata: metadata
            .iter()
            .filter(|(k, _)| !RESERVED_KEYS.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        packed,
    };
    delta.validate(source_name, defer)?;
    let kind = metadata.get("kind").map_or("(missing)", String::as_str);
    let expected = if delta.is_anchor() { "anchor" } else { "delta" };
    if kind != expected {
        return Err(bad(format!("metadata kind is {kind:?} but the tensors make it a {expected:?}")));
    }
    Ok(delta)
}

/// Reads a delta from bytes in memory.
pub fn from_bytes(bytes: Vec<u8>, source_name: &str) -> Result<Delta> {
    read(Arc::new(Backing::Owned(bytes)), source_name)
}

/// Reads a delta file fully into memory, so later changes to the file cannot affect it.
pub fn load(path: &Path) -> Result<Delta> {
    load_checked(path, false)
}

/// `load`, with `defer` as for `read_checked`.
pub fn load_checked(path: &Path, defer: bool) -> Result<Delta> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    read_checked(Arc::new(Backing::Owned(bytes)), &path.display().to_string(), defer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::codec::{Codec, ValueCodec};
    use crate::core::diff::{diff, DiffInput};

    fn sample() -> Delta {
        let old: Vec<u8> = (0..200u8).collect();
        let mut new = old.clone();
        new[10] = 0;
        new[101] = 7;
        let tensors = diff(
            &[
                DiffInput { name: "a.weight".into(), dtype: Dtype::BF16, shape: vec![10, 10], old: &old, new: &new },
                DiffInput {
                    name: "b".into(),
                    dtype: Dtype::U8,
                    shape: vec![4],
                    old: &[1, 2, 3, 4],
                    new: &[5, 6, 7, 8],
                },
                DiffInput { name: "c".into(), dtype: Dtype::F32, shape: vec![1], old: &[0; 4], new: &[0; 4] },
            ],
            ValueCodec::Diff,
            Codec::Varint,
        )
        .unwrap();
        Delta {
            tensors,
            step: Some(7),
            base_step: Some(6),
            metadata: [("run".to_owned(), "x".to_owned())].into(),
            ..Delta::default()
        }
    }

    /// Tied names round-trip in both layouts, and the reader refuses what the writer would not write (§2.2).
    #[test]
    fn aliases_round_trip_and_are_checked() {
        for packed in [false, true] {
            let mut delta = Delta { packed, ..sample() };
            delta.aliases = [("head".to_owned(), "a.weight".to_owned())].into();
            let bytes = to_bytes(&delta).unwrap();
            let back = from_bytes(bytes.clone(), "mem").unwrap();
            assert_eq!(back.aliases, delta.aliases);
            assert!(!back.metadata.contains_key(ALIASES_KEY));
            assert_eq!(to_bytes(&back).unwrap(), bytes);
            for (aliases, why) in [
                (vec![("c", "b")], "has a record of its own"),
                (vec![("head", "head")], "under its own name"),
                (vec![("head", "a.weight"), ("x", "head")], "itself an alias"),
                (vec![("", "b")], "empty"),
            ] {
                let bad = Delta {
                    aliases: aliases.iter().map(|(a, n)| ((*a).to_owned(), (*n).to_owned())).collect(),
                    ..delta.clone()
                };
                let err = to_bytes(&bad).err().unwrap().to_string();
                assert!(err.contains(why), "{err}");
            }
            // Edited without a checksum, which would otherwise report the edit as damage.
            let unsealed = encode_with(&delta, Checksum::Absent).unwrap().to_vec();
            let written = serde_json::to_string(&serde_json::to_string(&delta.aliases).unwrap()).unwrap();
            for (value, why) in [
                ("[1]", "not a JSON object"),
                ("{}", "is empty"),
                ("{\"c\":\"b\"}", "of its own"),
                ("{\"h\":\"b\",\"h\":\"a.weight\"}", "listed twice"),
            ] {
                let quoted = serde_json::to_string(value).unwrap();
                let edited = edit_header(&unsealed, |h| {
                    assert!(h.contains(&written));
                    h.replace(&written, &quoted)
                });
                let err = from_bytes(edited, "mem").err().unwrap().to_string();
                assert!(err.contains(why), "{value}: {err}");
            }
        }
    }

    #[test]
    fn roundtrip_and_safetensors_valid() {
        let delta = sample();
        let bytes = to_bytes(&delta).unwrap();
        safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let back = from_bytes(bytes.clone(), "mem").unwrap();
        assert_eq!(back.step, Some(7));
        assert_eq!(back.base_step, Some(6));
        assert_eq!(back.metadata.get("run").map(String::as_str), Some("x"));
        assert_eq!(back.tensors.len(), 3);
        assert!(back.tensors[1].is_dense());
        assert_eq!(to_bytes(&back).unwrap(), bytes);
        // The base identity: kept for the sparse and the unchanged tensor, absent for the whole one.
        let bases: Vec<Option<u64>> = back.tensors.iter().map(|t| t.base).collect();
        assert_eq!(bases, delta.tensors.iter().map(|t| t.base).collect::<Vec<_>>());
        assert!(bases[0].is_some() && bases[1].is_none() && bases[2].is_some());
    }

    /// `bytes` with its header JSON rewritten by `edit` (the data section is unchanged).
    fn with_header(bytes: &[u8], edit: impl Fn(&str) -> String) -> Vec<u8> {
        let mut edited = edit_header(bytes, edit);
        reseal(&mut edited);
        edited
    }

    /// `bytes` with its JSON header edited, as is: a checksum is left as it was.
    fn edit_header(bytes: &[u8], edit: impl Fn(&str) -> String) -> Vec<u8> {
        let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header = std::str::from_utf8(&bytes[8..8 + len]).unwrap().trim_end();
        let mut header = edit(header).into_bytes();
        header.resize(header.len().div_ceil(8) * 8, b' ');
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&header);
        out.extend_from_slice(&bytes[8 + len..]);
        out
    }

    #[test]
    fn a_malformed_base_is_a_format_error() {
        let delta = sample();
        let bytes = to_bytes(&delta).unwrap();
        let hex = crate::core::base::to_hex(delta.tensors[0].base.unwrap());
        let field = format!(r#"\"base\":\"{hex}\""#);
        assert!(String::from_utf8_lossy(&bytes).contains(&field));
        let upper = hex.to_uppercase();
        let short = &hex[..15];
        for replacement in [
            format!(r#"\"base\":\"{short}\""#),
            format!(r#"\"base\":\"{hex}0\""#),
            format!(r#"\"base\":\"{upper}\""#),
            r#"\"base\":\"0123456789abcdeg\""#.to_owned(),
            r#"\"base\":\" 123456789abcdef\""#.to_owned(),
            r#"\"base\":81985529216486895"#.to_owned(),
            r#"\"base\":null"#.to_owned(),
            r#"\"base\":[\"0123456789abcdef\"]"#.to_owned(),
        ] {
            let broken = with_header(&bytes, |header| header.replacen(&field, &replacement, 1));
            let err = from_bytes(broken, "bad-base").unwrap_err();
            assert!(matches!(err, Error::Format { .. }), "{replacement}: {err}");
        }
        // Without the field (as older writers and TRL imports) the file still loads.
        let without = with_header(&bytes, |header| header.replacen(&format!(",{field}"), "", 1));
        let loaded = from_bytes(without, "no-base").unwrap();
        assert_eq!(loaded.tensors[0].base, None);
        assert_eq!(loaded.tensors[2].base, delta.tensors[2].base);
    }

    #[test]
    fn every_truncation_is_a_format_error() {
        let bytes = to_bytes(&sample()).unwrap();
        let data_start = 8 + read_header(&bytes, "mem").unwrap().len;
        for cut in 0..bytes.len() {
            let err = from_bytes(bytes[..cut].to_vec(), "cut").unwrap_err();
            assert!(matches!(err, Error::Format { .. }), "cut at {cut}: {err}");
            // With the header whole, the file is said to be damaged (a download cut short), not merely malformed.
            assert_eq!(err.to_string().contains("damaged"), cut >= data_start, "cut at {cut}: {err}");
        }
        let mut longer = bytes.clone();
        longer.extend_from_slice(b"tail");
        assert!(from_bytes(longer, "long").unwrap_err().to_string().contains("damaged"));
    }

    #[test]
    fn every_flipped_bit_of_a_delta_file_is_refused_or_changes_nothing() {
        // Before the checksum, a third to two thirds of random one-byte changes to a delta's data decoded to other,
        // valid changes.
        for delta in [sample(), packed_sample()] {
            let bytes = to_bytes(&delta).unwrap();
            let original = from_bytes(bytes.clone(), "original").unwrap();
            let key = memchr::memmem::find(&bytes, CHECKSUM_KEY.as_bytes()).unwrap();
            let (value, _) = raw_checksum(&bytes).unwrap();
            for at in 0..bytes.len() {
                for bit in 0..8 {
                    let mut broken = bytes.clone();
                    broken[at] ^= 1 << bit;
                    let still_found = raw_checksum(&broken).is_some_and(|(found, _)| found == value);
                    match from_bytes(broken, "flip") {
                        // Wherever the header still parses and holds the value, the file is said to be damaged.
                        Err(error @ Error::Format { .. }) => {
                            assert!(
                                !still_found || error.to_string().contains("damaged"),
                                "byte {at} bit {bit}: {error}"
                            )
                        }
                        Err(other) => panic!("byte {at} bit {bit}: not a format error: {other}"),
                        // Only a flip in the checksum's own key can hide it (the key is then caller metadata); the
                        // file is otherwise whole.
                        Ok(read) => {
                            assert!(
                                (key..key + CHECKSUM_KEY.len()).contains(&at),
                                "byte {at} bit {bit} was let through"
                            );
                            assert_eq!(read.tensors.len(), original.tensors.len());
                            for (a, b) in read.tensors.iter().zip(&original.tensors) {
                                assert_eq!(
                                    (&a.name, &a.positions[..], &a.values[..]),
                                    (&b.name, &b.positions[..], &b.values[..])
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_checksum_is_written_on_deltas_only_and_checked_wherever_it_is() {
        let bytes = to_bytes(&sample()).unwrap();
        let header = read_header(&bytes, "mem").unwrap();
        let value = &header.metadata[CHECKSUM_KEY];
        assert!(base::parse_hex(value).is_some());
        // The definition: the base identity of the whole file with its digits read as zeros.
        let at = memchr::memmem::find(&bytes, value.as_bytes()).unwrap();
        let mut zeroed = bytes.clone();
        zeroed[at..at + 16].fill(b'0');
        assert_eq!(&base::to_hex(base::identity(&zeroed)), value);
        assert!(!from_bytes(bytes.clone(), "mem").unwrap().metadata.contains_key(CHECKSUM_KEY));
        // An anchor laid out in memory carries one too; the one core::anchors streams (header first) carries none,
        // and a wrong one added to it is caught all the same; so are a malformed one and one not written as
        // specified.
        let old = [1u8, 2, 3, 4];
        let full = crate::core::diff::full(&[crate::core::diff::FullInput {
            name: "w".into(),
            dtype: Dtype::U8,
            shape: vec![4],
            data: &old,
        }])
        .unwrap();
        let anchor = Delta { tensors: full, step: Some(1), ..Delta::default() };
        assert!(read_header(&to_bytes(&anchor).unwrap(), "mem").unwrap().metadata.contains_key(CHECKSUM_KEY));
        let anchor_bytes = encode_with(&anchor, Checksum::Absent).unwrap().to_vec();
        assert!(!read_header(&anchor_bytes, "mem").unwrap().metadata.contains_key(CHECKSUM_KEY));
        assert!(from_bytes(anchor_bytes.clone(), "anchor").is_ok());
        let wrong = edit_header(&anchor_bytes, |h| {
            h.replacen(r#""kind":"anchor""#, r#""kind":"anchor","file_xxh3":"0123456789abcdef""#, 1)
        });
        let err = from_bytes(wrong, "anchor").unwrap_err().to_string();
        assert!(err.contains("damaged"), "{err}");
        for (edit, expected) in [
            (format!(r#""{CHECKSUM_KEY}":"{}""#, value.to_uppercase()), "not 16 lowercase hex digits"),
            (format!(r#""{CHECKSUM_KEY}": "{value}""#), "as written"),
        ] {
            let broken = edit_header(&bytes, |h| h.replacen(&format!(r#""{CHECKSUM_KEY}":"{value}""#), &edit, 1));
            let err = from_bytes(broken, "edited").unwrap_err().to_string();
            assert!(err.contains(expected), "{edit}: {err}");
        }
        // A second, caller-made copy of the pattern makes it ambiguous: refused by the writer.
        let mut ambiguous = sample();
        ambiguous.metadata.insert(format!("x\"{CHECKSUM_KEY}"), CHECKSUM_PLACEHOLDER.into());
        assert!(matches!(to_bytes(&ambiguous), Err(Error::InvalidInput { .. })));
    }

    #[test]
    fn reserved_metadata_is_refused() {
        let mut delta = sample();
        delta.metadata.insert("kind".into(), "x".into());
        assert!(matches!(to_bytes(&delta), Err(Error::InvalidInput { .. })));
    }

    fn packed_sample() -> Delta {
        Delta { packed: true, ..sample() }
    }

    #[test]
    fn packed_roundtrip_and_safetensors_valid() {
        let delta = packed_sample();
        let bytes = to_bytes(&delta).unwrap();
        let parsed = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut names = parsed.names();
        names.sort();
        assert_eq!(names, ["__deltasync_records__", "__deltasync_streams__", "b"]);
        let header = read_header(&bytes, "mem").unwrap();
        assert_eq!(header.metadata["format_version"], "2");
        assert!(!header.metadata.contains_key("tensors"));
        let back = from_bytes(bytes.clone(), "mem").unwrap();
        assert!(back.packed);
        assert_eq!((back.step, back.base_step, &back.metadata), (delta.step, delta.base_step, &delta.metadata));
        for (a, b) in back.tensors.iter().zip(&delta.tensors) {
            assert_eq!(
                (&a.name, a.dtype, &a.shape, a.changed, a.base),
                (&b.name, b.dtype, &b.shape, b.changed, b.base)
            );
            assert_eq!((a.positions_codec, a.values_codec), (b.positions_codec, b.values_codec));
            assert_eq!((&a.positions[..], &a.values[..]), (&b.positions[..], &b.values[..]));
        }
        assert_eq!(to_bytes(&back).unwrap(), bytes);
        assert!(bytes.len() < to_bytes(&sample()).unwrap().len());
    }

    #[test]
    fn anchors_and_unpacked_deltas_keep_version_1() {
        let anchor = Delta { tensors: vec![sample().tensors.swap_remove(1)], packed: true, ..Delta::default() };
        assert!(anchor.is_anchor());
        let bytes = to_bytes(&anchor).unwrap();
        assert_eq!(bytes, to_bytes(&Delta { packed: false, ..anchor }).unwrap());
        assert_eq!(read_header(&bytes, "mem").unwrap().metadata["format_version"], "1");
        assert!(!from_bytes(bytes, "mem").unwrap().packed);
    }

    #[test]
    fn every_packed_truncation_is_a_format_error_and_every_flip_harmless() {
        let bytes = to_bytes(&packed_sample()).unwrap();
        for cut in 0..bytes.len() {
            let err = from_bytes(bytes[..cut].to_vec(), "cut").unwrap_err();
            assert!(matches!(err, Error::Format { .. }), "cut at {cut}: {err}");
        }
        for at in 0..bytes.len() {
            for flip in [0x01, 0x80, 0xff] {
                let mut broken = bytes.clone();
                broken[at] ^= flip;
                if let Err(err) = from_bytes(broken, "flip") {
                    assert!(matches!(err, Error::Format { .. }), "flip {flip:#x} at {at}: {err}");
                }
            }
        }
    }

    /// A packed file of `records` and a streams tensor of `streams`, as a writer that lies could make one.
    fn packed_file(records: &[Record], streams: &[u8], extra: &[(&str, &str)]) -> Vec<u8> {
        let mut metadata: BTreeMap<String, String> =
            [("format", "deltasync"), ("format_version", "2"), ("kind", "delta")]
                .iter()
                .chain(extra)
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect();
        metadata.retain(|_, v| !v.is_empty());
        let entries = vec![
            bytes_entry(RECORDS_KEY.to_owned(), vec![Cow::Owned(records::to_packed(records))]),
            bytes_entry(STREAMS_KEY.to_owned(), vec![Cow::Owned(streams.to_vec())]),
        ];
        lay_out(&metadata, entries).unwrap().to_vec()
    }

    fn varint_record(lengths: (u64, u64)) -> Record {
        Record {
            name: "w".into(),
            dtype: Dtype::U8,
            shape: Some(vec![10]),
            changed: 2,
            positions: PositionCodec::Varint,
            values: ValueCodec::Diff,
            base: None,
            differing: None,
            stream_lengths: Some(lengths),
        }
    }

    #[test]
    fn stream_lengths_must_cover_the_packed_streams_exactly() {
        let streams = [0, 1, 5, 6];
        let loaded = from_bytes(packed_file(&[varint_record((2, 2))], &streams, &[]), "ok").unwrap();
        assert_eq!((&loaded.tensors[0].positions[..], &loaded.tensors[0].values[..]), (&[0, 1][..], &[5, 6][..]));
        for (lengths, complaint) in [
            ((2, 1), "1 bytes after the records' last stream"),
            ((2, 3), "runs past the end"),
            ((u64::MAX, 0), "runs past the end"),
            ((1, u64::MAX), "runs past the end"),
            ((0, 0), "after the records' last stream"),
        ] {
            let err = from_bytes(packed_file(&[varint_record(lengths)], &streams, &[]), "bad").unwrap_err();
            assert!(matches!(err, Error::Format { .. }) && err.to_string().contains(complaint), "{lengths:?}: {err}");
        }
        // Two records may not share or skip bytes: each takes the next ones.
        let twice = [varint_record((2, 2)), Record { name: "v".into(), ..varint_record((2, 2)) }];
        assert!(from_bytes(packed_file(&twice, &streams, &[]), "short").is_err());
        let loaded = from_bytes(packed_file(&twice, &[0, 1, 5, 6, 0, 2, 7, 8], &[]), "two").unwrap();
        assert_eq!(&loaded.tensors[1].values[..], &[7, 8]);
    }

    #[test]
    fn packed_files_must_be_whole() {
        let streams = [0, 1, 5, 6];
        let records = [varint_record((2, 2))];
        for (extra, complaint) in [
            (vec![("tensors", "[]")], "not in the 'tensors' metadata"),
            (vec![("format_version", "3")], "not supported"),
            (vec![("kind", "anchor")], "kind"),
        ] {
            let err = from_bytes(packed_file(&records, &streams, &extra), "bad").unwrap_err();
            assert!(err.to_string().contains(complaint), "{extra:?}: {err}");
        }
        let file = packed_file(&records, &streams, &[]);
        for missing in [RECORDS_KEY, STREAMS_KEY] {
            let mut renamed = file.clone();
            let at = file.windows(missing.len()).position(|w| w == missing.as_bytes()).unwrap();
            renamed[at + 2] = b'D';
            let err = from_bytes(renamed, "missing").unwrap_err();
            assert!(err.to_string().contains("is missing"), "{missing}: {err}");
        }
    }

    #[test]
    fn reserved_names_are_refused() {
        for name in [RECORDS_KEY, STREAMS_KEY, "x:pos", "x:val", "__metadata__"] {
            let input = DiffInput { name: name.into(), dtype: Dtype::U8, shape: vec![1], old: &[0], new: &[1] };
            assert!(matches!(diff(&[input], ValueCodec::Diff, Codec::Compact), Err(Error::InvalidInput { .. })));
            let mut delta = packed_sample();
            delta.tensors[0].name = name.into();
            assert!(matches!(to_bytes(&delta), Err(Error::InvalidInput { .. })), "{name}");
        }
        let records = [Record { name: STREAMS_KEY.into(), ..varint_record((2, 2)) }];
        assert!(from_bytes(packed_file(&records, &[0, 1, 5, 6], &[]), "reserved").is_err());
    }

    /// A tensor of four elements, three of which change: stored whole, with the real count beside it.
    fn partly_changed() -> Delta {
        let tensors = diff(
            &[DiffInput { name: "d".into(), dtype: Dtype::U8, shape: vec![4], old: &[1, 2, 3, 4], new: &[9, 2, 8, 7] }],
            ValueCodec::Diff,
            Codec::Varint,
        )
        .unwrap();
        Delta { tensors, ..Delta::default() }
    }

    #[test]
    fn a_whole_tensor_reports_its_real_count() {
        for packed in [false, true] {
            let mut delta = Delta { packed, ..partly_changed() };
            delta.tensors.extend(sample().tensors.into_iter().take(1));
            assert!(delta.tensors[0].is_dense());
            assert_eq!((delta.tensors[0].changed, delta.tensors[0].differing), (4, Some(3)));
            assert_eq!(delta.num_changed(), 3 + 2);
            let bytes = to_bytes(&delta).unwrap();
            let back = from_bytes(bytes.clone(), "mem").unwrap();
            assert_eq!((back.tensors[0].differing, back.num_changed()), (Some(3), 5));
            assert_eq!(to_bytes(&back).unwrap(), bytes);
        }
        let bytes = to_bytes(&partly_changed()).unwrap();
        assert!(String::from_utf8_lossy(&bytes).contains(r#"\"changed\":4,\"differing\":3,"#));
        let without = with_header(&bytes, |header| header.replacen(r#",\"differing\":3"#, "", 1));
        assert_eq!(from_bytes(without, "old").unwrap().num_changed(), 4);
        for replacement in ["0", "5", "null", "\\\"3\\\""] {
            let broken = with_header(&bytes, |header| {
                header.replacen(r#"\"differing\":3"#, &format!(r#"\"differing\":{replacement}"#), 1)
            });
            let err = from_bytes(broken, "bad").unwrap_err();
            assert!(matches!(err, Error::Format { .. }), "{replacement}: {err}");
        }
        // Only a tensor stored whole may carry the field.
        let sparse = [Record { differing: Some(1), ..varint_record((2, 2)) }];
        assert!(from_bytes(packed_file(&sparse, &[0, 1, 5, 6], &[]), "sparse")
            .unwrap_err()
            .to_string()
            .contains("differing"));
    }
}
