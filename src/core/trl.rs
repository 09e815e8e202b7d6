//! Interop with TRL's sparse weight patches: read v1 (`.indices`/`.values`) and v3 (`.idx`/`.val`,
//! `raw` or `gap_delta`) files, full or sparse, and write the v1 layout.

use std::borrow::Cow;
use std::collections::BTreeMap;

use rayon::prelude::*;

use crate::core::codec::{elements, varint, PositionCodec, ValueCodec};
use crate::core::delta::{Delta, TensorDelta};
use crate::core::dtype::{self, Dtype};
use crate::core::error::{Error, Result};
use crate::core::format::{encode_entries, Encoded, Entry, Header};
use crate::core::stream::Stream;

pub const FORMAT_NAME: &str = "sparse_weight_patch";

/// Index-pair suffixes: v1 then v3.
const LAYOUTS: [(&str, &str); 2] = [(".indices", ".values"), (".idx", ".val")];

fn gap_width(dtype: Dtype) -> Option<usize> {
    match dtype {
        Dtype::U8 => Some(1),
        Dtype::U16 => Some(2),
        Dtype::U32 => Some(4),
        Dtype::U64 => Some(8),
        _ => None,
    }
}

/// Turns TRL positions (raw int32 or unsigned gaps) into our varint stream, checking that they increase.
fn positions_to_varint(
    bytes: &[u8],
    dtype: Dtype,
    gap_coded: bool,
    name: &str,
    source: &str,
) -> Result<(Vec<u8>, u64, Option<u64>)> {
    let bad = |message: String| Error::format(source, format!("tensor {name:?}: {message}"));
    let mut positions = Vec::new();
    if gap_coded {
        let width = gap_width(dtype)
            .ok_or_else(|| bad(format!("gap_delta indices must be unsigned, not {}", dtype::name_of(dtype))))?;
        let mut next = 0u64;
        for gap in bytes.chunks_exact(width) {
            // Each index is the previous one plus one plus its gap; past u64::MAX is a format error, not a wrap.
            let position = next.checked_add(elements::load(gap, width)).ok_or_else(|| bad("index overflows".into()))?;
            positions.push(position);
            next = position.checked_add(1).ok_or_else(|| bad("index overflows".into()))?;
        }
    } else {
        let width = match dtype {
            Dtype::I32 => 4,
            Dtype::I64 => 8,
            other => return Err(bad(format!("raw indices must be I32 or I64, not {}", dtype::name_of(other)))),
        };
        for raw in bytes.chunks_exact(width) {
            let signed = elements::sign_extend(elements::load(raw, width), width);
            positions.push(u64::try_from(signed).map_err(|_| bad(format!("negative index {signed}")))?);
        }
    }
    let mut out = Vec::with_capacity(positions.len() * 2);
    let mut next_allowed = 0u64;
    for &position in &positions {
        if position < next_allowed {
            return Err(bad(format!("indices are not strictly increasing at index {position}")));
        }
        varint::write(&mut out, position - next_allowed);
        next_allowed = position.checked_add(1).ok_or_else(|| bad(format!("index {position} overflows")))?;
    }
    let count = positions.len() as u64;
    let last = positions.last().copied();
    Ok((out, count, last))
}

/// Reads a TRL weight patch already parsed into `header`.
pub fn read(bytes: &[u8], header: &Header, source: &str) -> Result<Delta> {
    let bad = |message: String| Error::format(source, message);
    let metadata = &header.metadata;
    let sparse = match metadata.get("sparse").map(String::as_str) {
        Some("True" | "true") => true,
        None => header.tensors.keys().any(|k| LAYOUTS.iter().any(|(i, _)| k.ends_with(i))),
        Some("False" | "false") => false,
        Some(other) => return Err(bad(format!("metadata 'sparse' is {other:?}"))),
    };
    let gap_coded = match metadata.get("encoding").map(String::as_str) {
        None | Some("raw") => false,
        Some("gap_delta") => true,
        Some(other) => return Err(bad(format!("unknown index encoding {other:?}"))),
    };
    let mut names: Vec<&String> = header.tensors.keys().collect();
    names.sort_by_key(|k| header.tensors[*k].2.start);
    let mut tensors = Vec::new();
    if !sparse {
        for key in names {
            let (dtype, shape, range) = &header.tensors[key];
            dtype::width_of(*dtype).map_err(|e| bad(format!("tensor {key:?}: {e}")))?;
            let numel = dtype::numel(shape).ok_or_else(|| bad(format!("tensor {key:?}: shape overflows")))?;
            tensors.push(TensorDelta {
                name: key.clone(),
                dtype: *dtype,
                shape: Some(shape.clone()),
                changed: numel,
                positions_codec: PositionCodec::All,
                values_codec: ValueCodec::Abs,
                positions: Stream::empty(),
                values: bytes[range.clone()].to_vec().into(),
                last_position: numel.checked_sub(1),
                base: None,
                differing: None,
                unchecked: false,
            });
        }
    } else {
        let mut used = 0usize;
        let mut jobs = Vec::new();
        for key in names {
            let Some((index_suffix, value_suffix)) = LAYOUTS.iter().find(|(i, _)| key.ends_with(i)) else {
                continue;
            };
            let name = &key[..key.len() - index_suffix.len()];
            let value_key = format!("{name}{value_suffix}");
            let (index_dtype, index_shape, index_range) = &header.tensors[key];
            let (value_dtype, value_shape, value_range) = header
                .tensors
                .get(&value_key)
                .ok_or_else(|| bad(format!("tensor {name:?}: {key:?} has no {value_key:?}")))?;
            if index_shape.len() != 1 || value_shape.len() != 1 || index_shape[0] != value_shape[0] {
                return Err(bad(format!(
                    "tensor {name:?}: indices {index_shape:?} and values {value_shape:?} must be 1-D of one length"
                )));
            }
            dtype::width_of(*value_dtype).map_err(|e| bad(format!("tensor {name:?}: {e}")))?;
            jobs.push((
                name.to_owned(),
                *index_dtype,
                index_range.clone(),
                *value_dtype,
                value_range.clone(),
                gap_coded && *index_suffix == ".idx",
            ));
            used += 2;
        }
        if used != header.tensors.len() {
            // Every name a pair took, once (a name looked up against every pair was quadratic in the pairs).
            let paired: std::collections::HashSet<String> = jobs
                .iter()
                .flat_map(|job| {
                    LAYOUTS.iter().flat_map(move |(i, v)| [format!("{}{i}", job.0), format!("{}{v}", job.0)])
                })
                .collect();
            let stray = header.tensors.keys().find(|k| !paired.contains(k.as_str()));
            return Err(bad(format!(
                "tensor {:?} is not part of an index/value pair",
                stray.map_or("?", |s| s.as_str())
            )));
        }
        tensors = crate::core::pool::install(|| {
            jobs.par_iter()
                .map(|(name, index_dtype, index_range, value_dtype, value_range, gap)| {
                    let (positions, count, last) =
                        positions_to_varint(&bytes[index_range.clone()], *index_dtype, *gap, name, source)?;
                    Ok(TensorDelta {
                        name: name.clone(),
                        dtype: *value_dtype,
                        shape: None,
                        changed: count,
                        positions_codec: PositionCodec::Varint,
                        values_codec: ValueCodec::Abs,
                        positions: positions.into(),
                        values: bytes[value_range.clone()].to_vec().into(),
                        last_position: last,
                        base: None,
                        differing: None,
                        unchecked: false,
                    })
                })
                .collect::<Result<Vec<_>>>()
        })?;
    }
    let step = metadata.get("model_version").and_then(|v| v.parse::<u64>().ok());
    let mut delta = Delta { tensors, step, metadata: BTreeMap::new(), ..Delta::default() };
    delta.validate(source, false)?;
    Ok(delta)
}

/// A tensor's positions as TRL's little-endian int32 indices.
fn int32_positions(t: &TensorDelta) -> Result<Vec<u8>> {
    if t.needs_base() {
        return Err(Error::invalid(format!(
            "tensor {:?} has 'context' positions, which decode only against its base: a TRL file cannot hold \
             them (write the delta with codec=\"compact\")",
            t.name
        )));
    }
    let mut indices = Vec::with_capacity(t.changed as usize * 4);
    let mut overflow = None;
    let walk = if t.is_dense() {
        (0..t.changed).for_each(|p| match i32::try_from(p) {
            Ok(p) => indices.extend_from_slice(&p.to_le_bytes()),
            Err(_) => overflow = Some(p),
        });
        Ok(())
    } else {
        t.for_each_change(|position, _| match i32::try_from(position) {
            Ok(p) => indices.extend_from_slice(&p.to_le_bytes()),
            Err(_) => overflow = Some(position),
        })
    };
    walk.map_err(|m| Error::format("delta", format!("tensor {:?}: {m}", t.name)))?;
    match overflow {
        Some(position) => {
            Err(Error::invalid(format!("tensor {:?}: position {position} does not fit TRL's int32 indices", t.name)))
        }
        None => Ok(indices),
    }
}

/// Lays out a delta as a TRL v1 file. Needs absolute values.
pub fn encode_v1(delta: &Delta) -> Result<Encoded<'_>> {
    if let Some(t) = delta.tensors.iter().find(|t| t.values_codec != ValueCodec::Abs) {
        return Err(Error::invalid(format!(
            "tensor {:?} stores bit-pattern differences, but TRL files hold new absolute values: \
             create the delta with values=\"abs\"",
            t.name
        )));
    }
    let anchor = delta.is_anchor();
    let included: Vec<&TensorDelta> = delta.tensors.iter().filter(|t| anchor || t.changed > 0).collect();
    let changed_params: Vec<String> = included.iter().map(|t| t.name.clone()).collect();
    let mut entries = Vec::new();
    if anchor {
        for t in &included {
            entries.push(Entry {
                key: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone().unwrap_or_default(),
                data: Cow::Borrowed(&t.values[..]),
            });
        }
    } else {
        let indices: Vec<Vec<u8>> =
            crate::core::pool::install(|| included.par_iter().map(|t| int32_positions(t)).collect::<Result<Vec<_>>>())?;
        for (t, indices) in included.iter().zip(indices) {
            entries.push(Entry {
                key: format!("{}.indices", t.name),
                dtype: Dtype::I32,
                shape: vec![t.changed],
                data: Cow::Owned(indices),
            });
            entries.push(Entry {
                key: format!("{}.values", t.name),
                dtype: t.dtype,
                shape: vec![t.changed],
                data: Cow::Borrowed(&t.values[..]),
            });
        }
    }
    // Wider dtypes first keeps every tensor aligned to its element size.
    entries.sort_by_key(|e| std::cmp::Reverse(dtype::width_of(e.dtype).unwrap_or(1)));
    // The elements the file lists (every element of a tensor stored whole), as its indices count them.
    let total_changed = included.iter().map(|t| t.changed).fold(0, u64::saturating_add);
    let total_elements = delta.num_elements();
    let sparsity = if total_elements == 0 { 0.0 } else { 1.0 - total_changed as f64 / total_elements as f64 };
    let metadata: BTreeMap<String, String> = [
        ("format", FORMAT_NAME.to_owned()),
        ("version", "1".to_owned()),
        ("sparse", if anchor { "False" } else { "True" }.to_owned()),
        ("model_version", delta.step.unwrap_or(0).to_string()),
        ("num_changed_params", changed_params.len().to_string()),
        ("total_changed_elements", total_changed.to_string()),
        ("total_elements", total_elements.to_string()),
        ("sparsity", format!("{sparsity:?}")),
        ("changed_params", serde_json::to_string(&changed_params).expect("names serialize")),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    encode_entries(&metadata, entries)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::codec::Codec;
    use crate::core::diff::{diff, DiffInput};
    use crate::core::format::{from_bytes, read_header};

    #[test]
    fn v1_roundtrip() {
        let old = vec![0u8; 64];
        let mut new = old.clone();
        new[6] = 3;
        new[40] = 1;
        let tensors = diff(
            &[DiffInput { name: "w".into(), dtype: Dtype::BF16, shape: vec![32], old: &old, new: &new }],
            ValueCodec::Abs,
            Codec::Varint,
        )
        .unwrap();
        let delta = Delta { tensors, step: Some(3), ..Default::default() };
        let bytes = encode_v1(&delta).unwrap().to_vec();
        let header = read_header(&bytes, "mem").unwrap();
        assert_eq!(header.metadata["format"], FORMAT_NAME);
        let back = from_bytes(bytes, "mem").unwrap();
        assert_eq!(back.tensors[0].shape, None);
        assert_eq!(back.tensors[0].changed, 2);
        assert_eq!(back.tensors[0].last_position, Some(20));
        assert_eq!(back.step, Some(3));
    }

    /// A TRL v3 gap_delta patch with U64 gaps `gaps` for tensor "w" (F32 values).
    fn v3_gap_patch(gaps: &[u64]) -> Vec<u8> {
        let metadata: BTreeMap<String, String> =
            [("format", FORMAT_NAME), ("version", "3"), ("sparse", "True"), ("encoding", "gap_delta")]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect();
        let count = gaps.len() as u64;
        let entries = vec![
            Entry {
                key: "w.idx".into(),
                dtype: Dtype::U64,
                shape: vec![count],
                data: Cow::Owned(gaps.iter().flat_map(|g| g.to_le_bytes()).collect()),
            },
            Entry {
                key: "w.val".into(),
                dtype: Dtype::F32,
                shape: vec![count],
                data: Cow::Owned(vec![0; gaps.len() * 4]),
            },
        ];
        encode_entries(&metadata, entries).unwrap().to_vec()
    }

    #[test]
    fn v3_gaps_that_overflow_are_a_format_error() {
        assert_eq!(from_bytes(v3_gap_patch(&[2, 0]), "ok").unwrap().tensors[0].last_position, Some(3));
        for gaps in [&[u64::MAX][..], &[5, u64::MAX - 6], &[u64::MAX - 1, 0]] {
            match from_bytes(v3_gap_patch(gaps), "gaps") {
                Err(Error::Format { message, .. }) => {
                    assert!(message.contains("\"w\"") && message.contains("overflows"), "{message}")
                }
                other => panic!("gaps {gaps:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn diff_values_cannot_become_trl() {
        let tensors = diff(
            &[DiffInput { name: "w".into(), dtype: Dtype::U8, shape: vec![3], old: &[0, 0, 0], new: &[0, 1, 0] }],
            ValueCodec::Diff,
            Codec::Varint,
        )
        .unwrap();
        let delta = Delta { tensors, ..Default::default() };
        assert!(matches!(encode_v1(&delta), Err(Error::InvalidInput { .. })));
    }
}
