//! The per-tensor records of a deltasync file (docs/format.md §3) in both spellings: the JSON list of the
//! `tensors` metadata (version 1) and the packed binary list of the packed layout (version 2, §4.1).

use serde::{Deserialize, Serialize};

use crate::core::codec::{varint, PositionCodec, ValueCodec};
use crate::core::dtype::{self, Dtype};

/// Name of the `U8` tensor that holds a packed file's record list.
pub const RECORDS_KEY: &str = "__deltasync_records__";
/// Name of the `U8` tensor that holds a packed file's position and value streams, one after another.
pub const STREAMS_KEY: &str = "__deltasync_streams__";
/// Cap on a packed record list, as stored and as decoded (each record counted as `RECORD_COST` bytes plus its
/// name and 8 bytes per dimension): the 100 MB of a safetensors header, where version 1 keeps its records.
pub const MAX_RECORDS_BYTES: u64 = 100_000_000;
/// What a decoded record counts against `MAX_RECORDS_BYTES` beside its name and dimensions.
const RECORD_COST: u64 = 64;
/// The fewest bytes a packed record takes: one-byte name prefix and length, three table indices, flags, `changed`.
const MIN_RECORD_BYTES: usize = 7;

const SHAPE_KNOWN: u8 = 1;
const HAS_BASE: u8 = 2;
const HAS_DIFFERING: u8 = 4;

/// One tensor record, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Option<Vec<u64>>,
    pub changed: u64,
    pub positions: PositionCodec,
    pub values: ValueCodec,
    /// The base identity (core::base); absent for records that apply to any base.
    pub base: Option<u64>,
    /// For a tensor stored whole: how many of its elements differ from the base, when fewer than all.
    pub differing: Option<u64>,
    /// Packed layout only: the byte lengths of the position and value streams, for a record not stored whole.
    pub stream_lengths: Option<(u64, u64)>,
}

impl Record {
    /// Stored whole: positions `all`, values `abs`; such a record has no streams.
    pub fn is_whole(&self) -> bool {
        self.positions == PositionCodec::All && self.values == ValueCodec::Abs
    }
}

/// One entry of the version-1 `tensors` metadata list, as JSON spells it.
#[derive(Serialize, Deserialize)]
struct JsonRecord {
    name: String,
    dtype: String,
    /// Required, `null` for an unknown shape (§3): a record without the key is refused, not read as unknown.
    #[serde(deserialize_with = "nullable")]
    shape: Option<Vec<u64>>,
    changed: u64,
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "present")]
    differing: Option<u64>,
    positions: PositionCodec,
    values: ValueCodec,
    /// 16 lowercase hex digits.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "present")]
    base: Option<String>,
}

/// An optional field that, when present, must hold a value (`null` is refused, not read as absent).
fn present<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(deserializer: D) -> Result<Option<T>, D::Error> {
    T::deserialize(deserializer).map(Some)
}

/// A field that must be present and may be `null` (serde reads a missing `Option` field as `None` otherwise).
fn nullable<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(deserializer: D) -> Result<Option<T>, D::Error> {
    Option::<T>::deserialize(deserializer)
}

/// The version-1 `tensors` metadata string.
pub fn to_json(records: &[Record]) -> String {
    let records: Vec<JsonRecord> = records
        .iter()
        .map(|r| JsonRecord {
            name: r.name.clone(),
            dtype: dtype::name_of(r.dtype),
            shape: r.shape.clone(),
            changed: r.changed,
            differing: r.differing,
            positions: r.positions,
            values: r.values,
            base: r.base.map(crate::core::base::to_hex),
        })
        .collect();
    serde_json::to_string(&records).expect("records serialize")
}

/// Parses the version-1 `tensors` metadata string.
pub fn from_json(text: &str) -> Result<Vec<Record>, String> {
    let records: Vec<JsonRecord> =
        serde_json::from_str(text).map_err(|e| format!("the 'tensors' metadata is malformed: {e}"))?;
    records
        .into_iter()
        .map(|r| {
            let dtype = dtype::parse(&r.dtype).map_err(|e| format!("tensor {:?}: {e}", r.name))?;
            let base = r
                .base
                .map(|text| {
                    crate::core::base::parse_hex(&text)
                        .ok_or_else(|| format!("tensor {:?}: base {text:?} is not 16 lowercase hex digits", r.name))
                })
                .transpose()?;
            Ok(Record {
                name: r.name,
                dtype,
                shape: r.shape,
                changed: r.changed,
                positions: r.positions,
                values: r.values,
                base,
                differing: r.differing,
                stream_lengths: None,
            })
        })
        .collect()
}

/// The packed record list (§4.1). Every record not stored whole must carry its stream lengths.
pub fn to_packed(records: &[Record]) -> Vec<u8> {
    let mut table: Vec<String> = Vec::new();
    let mut index_of = |name: String| -> u64 {
        let index = table.iter().position(|known| *known == name).unwrap_or_else(|| {
            table.push(name);
            table.len() - 1
        });
        index as u64
    };
    let mut body = Vec::new();
    varint::write(&mut body, records.len() as u64);
    let mut previous: &[u8] = &[];
    for record in records {
        let name = record.name.as_bytes();
        let shared = name.iter().zip(previous).take_while(|(a, b)| a == b).count();
        varint::write(&mut body, shared as u64);
        varint::write(&mut body, (name.len() - shared) as u64);
        body.extend_from_slice(&name[shared..]);
        previous = name;
        varint::write(&mut body, index_of(dtype::name_of(record.dtype)));
        varint::write(&mut body, index_of(record.positions.name().to_owned()));
        varint::write(&mut body, index_of(record.values.name().to_owned()));
        let flags = if record.shape.is_some() { SHAPE_KNOWN } else { 0 }
            | if record.base.is_some() { HAS_BASE } else { 0 }
            | if record.differing.is_some() { HAS_DIFFERING } else { 0 };
        body.push(flags);
        if let Some(shape) = &record.shape {
            varint::write(&mut body, shape.len() as u64);
            shape.iter().for_each(|&dim| varint::write(&mut body, dim));
        }
        varint::write(&mut body, record.changed);
        if let Some(base) = record.base {
            body.extend_from_slice(&base.to_le_bytes());
        }
        if let Some(differing) = record.differing {
            varint::write(&mut body, differing);
        }
        if !record.is_whole() {
            let (positions, values) = record.stream_lengths.expect("a packed record not stored whole has streams");
            varint::write(&mut body, positions);
            varint::write(&mut body, values);
        }
    }
    let mut out = Vec::with_capacity(body.len() + 64);
    varint::write(&mut out, table.len() as u64);
    for name in &table {
        varint::write(&mut out, name.len() as u64);
        out.extend_from_slice(name.as_bytes());
    }
    out.extend_from_slice(&body);
    out
}

/// Reads a packed record list, within `MAX_RECORDS_BYTES` stored and decoded: every count is checked against the
/// bytes left before anything is allocated for it.
pub fn from_packed(bytes: &[u8]) -> Result<Vec<Record>, String> {
    if bytes.len() as u64 > MAX_RECORDS_BYTES {
        return Err(format!("the record list is {} bytes, over the cap of {MAX_RECORDS_BYTES}", bytes.len()));
    }
    let mut at = Cursor { bytes, at: 0 };
    let table_len = at.count("the name table's length", 1)?;
    let mut table = Vec::with_capacity(table_len);
    for _ in 0..table_len {
        let len = at.varint("a table name's length")?;
        let name =
            std::str::from_utf8(at.take(len, "a table name")?).map_err(|_| "a table name is not UTF-8".to_owned())?;
        table.push(name);
    }
    let count = at.count("the record count", MIN_RECORD_BYTES)?;
    let mut decoded = 0u64;
    let mut records = Vec::with_capacity(count);
    let mut name: Vec<u8> = Vec::new();
    for index in 0..count {
        let fail = |message: String| format!("record {index}: {message}");
        let shared = at.varint("a name's shared prefix").map_err(fail)?;
        if shared > name.len() as u64 {
            return Err(fail(format!("shares {shared} bytes with a name of {} bytes", name.len())));
        }
        let rest_len = at.varint("a name's length").map_err(fail)?;
        let rest = at.take(rest_len, "a name").map_err(fail)?;
        name.truncate(shared as usize);
        name.extend_from_slice(rest);
        let text = std::str::from_utf8(&name).map_err(|_| fail("the name is not UTF-8".to_owned()))?.to_owned();
        let fail = |message: String| format!("record {index} ({text:?}): {message}");
        let mut from_table = |what: &str| -> Result<&str, String> {
            let entry = at.varint(what)?;
            usize::try_from(entry)
                .ok()
                .and_then(|entry| table.get(entry).copied())
                .ok_or_else(|| format!("{what} {entry} is not in the name table of {table_len}"))
        };
        let dtype_name = from_table("dtype").map_err(fail)?;
        let positions_name = from_table("positions codec").map_err(fail)?;
        let values_name = from_table("values codec").map_err(fail)?;
        let dtype = dtype::parse(dtype_name).map_err(|e| fail(e.to_string()))?;
        let positions: PositionCodec = codec_named(positions_name).map_err(fail)?;
        let values: ValueCodec = codec_named(values_name).map_err(fail)?;
        let flags = at.byte("flags").map_err(fail)?;
        if flags & !(SHAPE_KNOWN | HAS_BASE | HAS_DIFFERING) != 0 {
            return Err(fail(format!("unknown flags {flags:#04x}")));
        }
        let shape = if flags & SHAPE_KNOWN != 0 {
            let rank = at.count("the rank", 1).map_err(fail)?;
            let dims = (0..rank).map(|_| at.varint("a dimension")).collect::<Result<Vec<u64>, String>>();
            Some(dims.map_err(fail)?)
        } else {
            None
        };
        decoded += RECORD_COST + text.len() as u64 + 8 * shape.as_ref().map_or(0, |s| s.len() as u64);
        if decoded > MAX_RECORDS_BYTES {
            return Err(fail(format!("the decoded record list passes the cap of {MAX_RECORDS_BYTES} bytes")));
        }
        let changed = at.varint("changed").map_err(fail)?;
        let base = if flags & HAS_BASE != 0 {
            let bytes = at.take(8, "the base identity").map_err(fail)?;
            Some(u64::from_le_bytes(bytes.try_into().expect("8 bytes")))
        } else {
            None
        };
        let differing = if flags & HAS_DIFFERING != 0 { Some(at.varint("differing").map_err(fail)?) } else { None };
        let mut record =
            Record { name: text, dtype, shape, changed, positions, values, base, differing, stream_lengths: None };
        if !record.is_whole() {
            let positions_len =
                at.varint("the position stream's length").map_err(|e| format!("record {index}: {e}"))?;
            let values_len = at.varint("the value stream's length").map_err(|e| format!("record {index}: {e}"))?;
            record.stream_lengths = Some((positions_len, values_len));
        }
        records.push(record);
    }
    if at.at != bytes.len() {
        return Err(format!("the record list has {} bytes after its last record", bytes.len() - at.at));
    }
    Ok(records)
}

/// A codec read by its name, as JSON reads it, so that unknown names are refused alike in both layouts.
fn codec_named<T: serde::de::DeserializeOwned>(name: &str) -> Result<T, String> {
    serde_json::from_value(serde_json::Value::String(name.to_owned())).map_err(|_| format!("unknown codec {name:?}"))
}

/// Reads a packed record list front to back; every read is bounds-checked.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn varint(&mut self, what: &str) -> Result<u64, String> {
        varint::read(self.bytes, &mut self.at).map_err(|e| match e {
            varint::ReadError::Truncated => format!("the record list ends inside {what}"),
            varint::ReadError::Overflow => format!("{what} overflows 64 bits"),
        })
    }

    /// A count of items that take at least `item_bytes` bytes each: no more than the bytes left can hold.
    fn count(&mut self, what: &str, item_bytes: usize) -> Result<usize, String> {
        let count = self.varint(what)?;
        let room = (self.bytes.len() - self.at) / item_bytes;
        usize::try_from(count).ok().filter(|&count| count <= room).ok_or_else(|| {
            format!("{what} {count} is more than the {} bytes left can hold", self.bytes.len() - self.at)
        })
    }

    fn take(&mut self, len: u64, what: &str) -> Result<&'a [u8], String> {
        let end = usize::try_from(len)
            .ok()
            .and_then(|len| self.at.checked_add(len))
            .filter(|&end| end <= self.bytes.len())
            .ok_or_else(|| format!("{what} of {len} bytes runs past the record list's end"))?;
        let taken = &self.bytes[self.at..end];
        self.at = end;
        Ok(taken)
    }

    fn byte(&mut self, what: &str) -> Result<u8, String> {
        Ok(self.take(1, what)?[0])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(name: &str, positions: PositionCodec, values: ValueCodec) -> Record {
        let whole = positions == PositionCodec::All && values == ValueCodec::Abs;
        Record {
            name: name.to_owned(),
            dtype: Dtype::BF16,
            shape: Some(vec![3, 4]),
            changed: if whole { 12 } else { 2 },
            positions,
            values,
            base: (!whole).then_some(0x0123_4567_89ab_cdef),
            differing: whole.then_some(5),
            stream_lengths: (!whole).then_some((2, 300)),
        }
    }

    fn sample() -> Vec<Record> {
        vec![
            record("model.layers.0.mlp.weight", PositionCodec::Rice, ValueCodec::DiffBits),
            record("model.layers.0.norm.weight", PositionCodec::All, ValueCodec::Abs),
            Record {
                shape: None,
                base: None,
                ..record("model.layers.1.mlp.weight", PositionCodec::Varint, ValueCodec::Abs)
            },
            record("é", PositionCodec::Varint, ValueCodec::Diff),
        ]
    }

    #[test]
    fn packed_roundtrip() {
        let records = sample();
        let packed = to_packed(&records);
        assert_eq!(from_packed(&packed).unwrap(), records);
        assert_eq!(from_packed(&to_packed(&[])).unwrap(), vec![]);
    }

    #[test]
    fn every_truncation_and_flip_is_refused_or_harmless() {
        let packed = to_packed(&sample());
        for cut in 0..packed.len() {
            assert!(from_packed(&packed[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = packed.clone();
        longer.push(0);
        assert!(from_packed(&longer).unwrap_err().contains("after its last record"));
        for at in 0..packed.len() {
            for flip in [0x01, 0x80, 0xff] {
                let mut broken = packed.clone();
                broken[at] ^= flip;
                let _ = from_packed(&broken);
            }
        }
    }

    #[test]
    fn counts_beyond_the_bytes_left_are_refused_before_allocating() {
        // A table, a record count, a rank and a name length that claim far more than the list holds.
        let mut huge_count = vec![0];
        varint::write(&mut huge_count, u64::MAX >> 1);
        assert!(from_packed(&huge_count).unwrap_err().contains("record count"));
        let mut huge_table = Vec::new();
        varint::write(&mut huge_table, 1 << 40);
        assert!(from_packed(&huge_table).unwrap_err().contains("name table"));
        let mut packed = to_packed(&[record("w", PositionCodec::Varint, ValueCodec::Diff)]);
        let rank_at = packed.iter().position(|&b| b == b'w').unwrap() + 5;
        assert_eq!(packed[rank_at], 2, "the rank of [3, 4]");
        packed[rank_at] = 0x7f;
        assert!(from_packed(&packed).unwrap_err().contains("rank"));
        let name_len_at = rank_at - 6;
        packed[name_len_at] = 0x7f;
        assert!(from_packed(&packed).unwrap_err().contains("runs past"));
    }

    #[test]
    fn a_list_that_decodes_past_the_cap_is_refused() {
        // Each record shares the whole previous name and adds 100 bytes: names that grow quadratically from a
        // list that grows linearly (2 MB here, 20 GB of names decoded).
        let mut packed = Vec::new();
        varint::write(&mut packed, 3);
        for name in ["U8", "varint", "diff"] {
            varint::write(&mut packed, name.len() as u64);
            packed.extend_from_slice(name.as_bytes());
        }
        let count = 20_000u64;
        varint::write(&mut packed, count);
        for index in 0..count {
            varint::write(&mut packed, index * 100);
            varint::write(&mut packed, 100);
            packed.extend_from_slice(&[b'x'; 100]);
            packed.extend_from_slice(&[0, 1, 2, 0, 0, 0, 0]);
        }
        assert!(packed.len() < 3 << 20);
        assert!(from_packed(&packed).unwrap_err().contains("cap"));
        assert!(from_packed(&vec![0; MAX_RECORDS_BYTES as usize + 1]).unwrap_err().contains("cap"));
    }

    #[test]
    fn unknown_names_and_flags_are_refused() {
        let mut packed = to_packed(&[record("w", PositionCodec::Varint, ValueCodec::Diff)]);
        let at = packed.windows(4).position(|w| w == b"diff").unwrap();
        packed[at..at + 4].copy_from_slice(b"dif2");
        assert!(from_packed(&packed).unwrap_err().contains("unknown codec \"dif2\""));
        let mut packed = to_packed(&[record("w", PositionCodec::Varint, ValueCodec::Diff)]);
        let flags_at = packed.iter().position(|&b| b == b'w').unwrap() + 4;
        assert_eq!(packed[flags_at], SHAPE_KNOWN | HAS_BASE);
        packed[flags_at] |= 0x80;
        assert!(from_packed(&packed).unwrap_err().contains("unknown flags"));
    }

    // Pins `shared > name.len()` in `from_packed`: a record may share
    // no more bytes than the previous record's name has; without the check `truncate` is a no-op and the malformed
    // list is read as if it were well formed.
    #[test]
    fn a_name_sharing_more_than_the_previous_name_is_refused() {
        let list = |shared: u8| {
            let mut bytes = vec![3, 4];
            bytes.extend_from_slice(b"BF16");
            bytes.push(6);
            bytes.extend_from_slice(b"varint");
            bytes.push(4);
            bytes.extend_from_slice(b"diff");
            // One record: shared prefix, rest "w", dtype 0, positions 1, values 2, no flags, changed 0, lengths 0, 0.
            bytes.extend_from_slice(&[1, shared, 1, b'w', 0, 1, 2, 0, 0, 0, 0]);
            bytes
        };
        let records = from_packed(&list(0)).unwrap();
        assert_eq!(records.len(), 1);
        assert_eq!(records[0].name, "w");
        let error = from_packed(&list(1)).unwrap_err();
        assert!(error.contains("shares 1 bytes"), "{error}");
    }
}
