//! Joins the partial deltas of sharded tensors (each rank diffs only its own contiguous range of elements, with
//! positions already in the whole tensor's index space) into one delta per step. Parts are `varint`; the joined
//! tensors may be re-encoded in the compact codec, or in the context codec by a joiner that holds every tensor's
//! whole base (FSDP's rank 0, whose publisher keeps the last published state).

use std::collections::BTreeMap;

use crate::core::base;
use crate::core::codec::ranges::Changes;
use crate::core::codec::{plan, varint, Codec, PositionCodec};
use crate::core::delta::{Delta, TensorDelta};
use crate::core::dtype;
use crate::core::error::{Error, Result};

/// The first position of a varint stream (its first gap counts from element 0).
fn first_position(tensor: &TensorDelta) -> Result<u64> {
    let mut at = 0;
    varint::read(&tensor.positions, &mut at)
        .map_err(|e| Error::invalid(format!("tensor {:?}: bad position stream ({e:?})", tensor.name)))
}

/// Joins parts of one tensor that cover disjoint element ranges, given in ascending order. A tensor with one part
/// (one rank held it whole: a replicated tensor, or a plain one, which the first rank ships) is that part as it is,
/// stored whole or not, with its base identity.
pub fn join_tensor(parts: Vec<TensorDelta>) -> Result<TensorDelta> {
    if parts.len() == 1 {
        return Ok(parts.into_iter().next().expect("one part"));
    }
    let mut parts = parts.into_iter();
    let mut joined = parts.next().ok_or_else(|| Error::invalid("no parts to join"))?;
    let name = joined.name.clone();
    let mut positions: Vec<u8> = joined.positions.to_vec();
    let mut values: Vec<u8> = joined.values.to_vec();
    for part in parts {
        if part.dtype != joined.dtype || part.shape != joined.shape {
            return Err(Error::mismatch(format!("tensor {name:?}: shards disagree on dtype or shape")));
        }
        if part.changed == 0 {
            continue;
        }
        if part.positions_codec != PositionCodec::Varint || part.values_codec != joined.values_codec {
            return Err(Error::invalid(format!(
                "tensor {name:?}: shard parts must be sparse with one value codec to be joined"
            )));
        }
        let first = first_position(&part)?;
        let mut rest_at = 0;
        varint::read(&part.positions, &mut rest_at).expect("read above");
        let gap = match joined.last_position {
            Some(last) if first <= last => {
                return Err(Error::invalid(format!(
                    "tensor {name:?}: a shard starts at element {first}, not after the previous shard's {last}"
                )))
            }
            Some(last) => first - last - 1,
            None => first,
        };
        varint::write(&mut positions, gap);
        positions.extend_from_slice(&part.positions[rest_at..]);
        values.extend_from_slice(&part.values);
        joined.changed += part.changed;
        joined.last_position = part.last_position;
    }
    if joined.changed > 0 && joined.positions_codec != PositionCodec::Varint {
        return Err(Error::invalid(format!("tensor {name:?}: shard parts must be sparse to be joined")));
    }
    joined.positions = positions.into();
    joined.values = values.into();
    // No rank saw the whole tensor, so there is no base identity to record.
    joined.base = None;
    Ok(joined)
}

/// A joined `varint` tensor in the compact codec (codec::plan::smallest_streams, never stored whole: no rank
/// holds the whole tensor's bytes). Given the whole tensor's `base` bytes, its positions are coded against their
/// classes where that is smaller (the context codec, codec::plan::context_streams), and its base identity recorded.
fn to_compact(tensor: TensorDelta, base: Option<&[u8]>) -> Result<TensorDelta> {
    let width = dtype::width_of(tensor.dtype).map_err(|e| Error::invalid(format!("tensor {:?}: {e}", tensor.name)))?;
    let identity = match base {
        Some(base) => {
            let numel: u64 = tensor.shape.as_deref().unwrap_or_default().iter().product();
            if tensor.shape.is_none() || base.len() as u64 != numel * width as u64 {
                return Err(Error::mismatch(format!(
                    "tensor {:?}: its base has {} bytes, expected {} for shape {:?}",
                    tensor.name,
                    base.len(),
                    numel * width as u64,
                    tensor.shape
                )));
            }
            Some(base::identity(base))
        }
        None => None,
    };
    // Without the whole base, a part that held the whole tensor keeps the identity it recorded.
    let identity = identity.or(tensor.base);
    if tensor.changed == 0 || tensor.positions_codec != PositionCodec::Varint {
        return Ok(TensorDelta { base: identity, ..tensor });
    }
    let first = first_position(&tensor)?;
    let mut rest_at = 0;
    varint::read(&tensor.positions, &mut rest_at).expect("read above");
    let range = Changes {
        count: tensor.changed,
        first_position: first,
        last_position: tensor.last_position.unwrap_or(first),
        positions: tensor.positions[rest_at..].to_vec(),
        values: tensor.values.to_vec(),
    };
    let ranges = [range];
    let (dtype, values) = (tensor.dtype, tensor.values_codec);
    let streams = match base {
        Some(base) => plan::context_streams(&ranges, dtype, width, values, base, usize::MAX),
        None => plan::smallest_streams(&ranges, width, values, usize::MAX),
    }
    .expect("never whole");
    Ok(TensorDelta { base: identity, ..tensor.with_streams(streams) })
}

/// Joins the deltas of all shards (in rank order) into one: tensors in order of first appearance, each one's
/// parts joined in rank order, in the stream family `codec`. Step, base step and metadata come from the first delta.
/// `Codec::Context` needs every tensor's whole base bytes in `bases` (by name), which the joiner must hold.
/// `identities` (by name) are the base identities of whole tensors, which the joiner found elsewhere (a publisher,
/// in the state it keeps): each is recorded on its joined tensor unless that is stored whole or has its own.
pub fn join(
    deltas: Vec<Delta>,
    codec: Codec,
    bases: &BTreeMap<String, &[u8]>,
    identities: &BTreeMap<String, u64>,
) -> Result<Delta> {
    let mut deltas = deltas.into_iter();
    let first = deltas.next().ok_or_else(|| Error::invalid("no shard deltas to join"))?;
    let mut order: Vec<String> = Vec::new();
    let mut by_name: BTreeMap<String, Vec<TensorDelta>> = BTreeMap::new();
    let mut out = Delta {
        tensors: Vec::new(),
        step: first.step,
        base_step: first.base_step,
        metadata: first.metadata,
        aliases: first.aliases,
        packed: codec != Codec::Varint,
    };
    for tensor in first.tensors.into_iter().chain(deltas.flat_map(|d| d.tensors)) {
        if !by_name.contains_key(&tensor.name) {
            order.push(tensor.name.clone());
        }
        by_name.entry(tensor.name.clone()).or_default().push(tensor);
    }
    for name in order {
        let mut tensor = join_tensor(by_name.remove(&name).expect("collected above"))?;
        if tensor.base.is_none() && !tensor.is_dense() {
            tensor.base = identities.get(&name).copied();
        }
        out.tensors.push(match codec {
            Codec::Varint => tensor,
            Codec::Compact => to_compact(tensor, None)?,
            Codec::Context => {
                let base = bases.get(&name).ok_or_else(|| {
                    Error::invalid(format!(
                        "tensor {name:?}: codec \"context\" codes positions against the whole tensor's base, which \
                         the join was not given"
                    ))
                })?;
                to_compact(tensor, Some(base))?
            }
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::base;
    use crate::core::codec::ValueCodec;
    use crate::core::diff::{diff, DiffInput};
    use crate::core::dtype::Dtype;
    use crate::core::mirror::MirrorTensor;

    fn shard_delta(old: &[u8], new: &[u8], range: std::ops::Range<usize>, numel: u64) -> Delta {
        let mut mirror = old[range.start * 2..range.end * 2].to_vec();
        let mut tensor = MirrorTensor::begin("w", Dtype::BF16, &[numel], ValueCodec::Diff).unwrap();
        tensor.update(&mut mirror, &new[range.start * 2..range.end * 2], range.start as u64).unwrap();
        Delta { tensors: vec![tensor.finish(None).unwrap()], ..Delta::default() }
    }

    #[test]
    fn joined_shards_equal_the_whole_diff() {
        let numel = 1000usize;
        let old = vec![0u8; numel * 2];
        let mut new = old.clone();
        for p in [0usize, 3, 499, 500, 501, 777, 999] {
            new[p * 2] = (p % 200) as u8 + 1;
        }
        for bounds in [vec![0, 500, 1000], vec![0, 334, 668, 1000], vec![0, 0, 1000], vec![0, 2, 1000]] {
            let parts: Vec<Delta> =
                bounds.windows(2).map(|b| shard_delta(&old, &new, b[0]..b[1], numel as u64)).collect();
            let joined = join(parts, Codec::Varint, &BTreeMap::new(), &BTreeMap::new()).unwrap();
            let input =
                DiffInput { name: "w".into(), dtype: Dtype::BF16, shape: vec![numel as u64], old: &old, new: &new };
            let whole = diff(&[input], ValueCodec::Diff, crate::core::codec::Codec::Varint).unwrap().remove(0);
            let tensor = &joined.tensors[0];
            assert_eq!((tensor.changed, tensor.last_position), (whole.changed, whole.last_position));
            assert_eq!(&tensor.positions[..], &whole.positions[..]);
            assert_eq!(&tensor.values[..], &whole.values[..]);
            assert_eq!(tensor.base, None, "a joined shard delta records no base");
            // Unless the joiner knows the whole tensor's identity (a publisher, from the state it keeps): then it is
            // the identity `diff` records, in either family.
            let known = BTreeMap::from([("w".to_owned(), base::identity(&old))]);
            for codec in [Codec::Varint, Codec::Compact] {
                let parts: Vec<Delta> =
                    bounds.windows(2).map(|b| shard_delta(&old, &new, b[0]..b[1], numel as u64)).collect();
                let joined = join(parts, codec, &BTreeMap::new(), &known).unwrap();
                assert_eq!(joined.tensors[0].base, whole.base);
                base::check_bases(&joined, &[(0, &old[..])]).unwrap();
                assert!(base::check_bases(&joined, &[(0, &new[..])]).is_err());
            }
        }
        // A tensor one rank held whole is its part as it is, with the base identity that rank recorded, in every
        // family, and stored whole where it was (as a small tensor whose elements all changed is).
        for (new, dense) in [(new.clone(), false), (old.iter().map(|b| b ^ 1).collect::<Vec<u8>>(), true)] {
            let input =
                DiffInput { name: "w".into(), dtype: Dtype::BF16, shape: vec![numel as u64], old: &old, new: &new };
            let whole = diff(&[input], ValueCodec::Diff, crate::core::codec::Codec::Varint).unwrap();
            // A tensor stored whole records no base: it does not depend on one.
            assert_eq!((whole[0].base.is_some(), whole[0].is_dense()), (!dense, dense));
            for codec in [Codec::Varint, Codec::Compact] {
                let part = Delta { tensors: whole.clone(), ..Delta::default() };
                // An identity the joiner knows changes nothing here: the part's own, or none where stored whole.
                let known = BTreeMap::from([("w".to_owned(), 7u64)]);
                let joined = join(vec![part], codec, &BTreeMap::new(), &known).unwrap();
                assert_eq!(joined.tensors[0].base, whole[0].base);
                assert_eq!(joined.tensors[0].is_dense(), dense);
                let mut target = old.clone();
                crate::core::apply::apply(&joined, vec![(0, &mut target[..])]).unwrap();
                assert_eq!(target, new);
            }
        }
        // Several parts, one of them stored whole, cannot be joined.
        let whole = Delta {
            tensors: diff(
                &[DiffInput {
                    name: "w".into(),
                    dtype: Dtype::BF16,
                    shape: vec![numel as u64],
                    old: &old,
                    new: &[1u8; 2000],
                }],
                ValueCodec::Diff,
                crate::core::codec::Codec::Varint,
            )
            .unwrap(),
            ..Delta::default()
        };
        assert!(whole.tensors[0].is_dense());
        let err = join(
            vec![shard_delta(&old, &new, 0..10, numel as u64), whole],
            Codec::Varint,
            &BTreeMap::new(),
            &BTreeMap::new(),
        );
        assert!(err.unwrap_err().to_string().contains("must be sparse"));
    }

    #[test]
    fn joined_shards_in_compact_equal_the_whole_diff() {
        let numel = 3000usize;
        let old = vec![0u8; numel * 2];
        let mut new = old.clone();
        for p in (0..numel).step_by(11) {
            new[p * 2] = if p % 2 == 0 { 1 } else { 255 };
        }
        let parts: Vec<Delta> =
            [0usize, 1000, 2001, 3000].windows(2).map(|b| shard_delta(&old, &new, b[0]..b[1], numel as u64)).collect();
        let joined = join(parts, Codec::Compact, &BTreeMap::new(), &BTreeMap::new()).unwrap();
        let input = DiffInput { name: "w".into(), dtype: Dtype::BF16, shape: vec![numel as u64], old: &old, new: &new };
        let whole = diff(&[input], ValueCodec::Diff, Codec::Compact).unwrap().remove(0);
        let tensor = &joined.tensors[0];
        assert_eq!((tensor.positions_codec, tensor.values_codec), (PositionCodec::Rice, ValueCodec::Rans));
        assert_eq!((tensor.changed, tensor.last_position), (whole.changed, whole.last_position));
        assert_eq!((&tensor.positions[..], &tensor.values[..]), (&whole.positions[..], &whole.values[..]));
    }

    #[test]
    fn joined_shards_in_context_with_the_base_equal_the_whole_diff() {
        // Magnitudes over many binades and a step of one size: small weights change far more often, so the
        // context codec wins (as on real training steps).
        let numel = 40_000usize;
        let mut old = vec![0u8; numel * 2];
        let mut new = old.clone();
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for i in 0..numel {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let exponent = 100 + (state >> 59) as u16; // 32 binades
            let bits = (exponent << 7) | ((state >> 40) as u16 & 0x7f);
            let changes = (state >> 20) % 1000 < u64::from(160u16.saturating_sub((exponent - 100) * 5));
            old[i * 2..i * 2 + 2].copy_from_slice(&bits.to_le_bytes());
            let after = if changes { bits.wrapping_add(if state & 1 == 0 { 1 } else { 0xffff }) } else { bits };
            new[i * 2..i * 2 + 2].copy_from_slice(&after.to_le_bytes());
        }
        let input = DiffInput { name: "w".into(), dtype: Dtype::BF16, shape: vec![numel as u64], old: &old, new: &new };
        let whole = diff(&[input], ValueCodec::Diff, Codec::Context).unwrap().remove(0);
        assert_eq!(whole.positions_codec, PositionCodec::Context, "the workload must make context win");
        let bases = BTreeMap::from([("w".to_owned(), &old[..])]);
        for bounds in [vec![0, numel], vec![0, 13_001, numel], vec![0, 1, 20_000, numel]] {
            let parts: Vec<Delta> =
                bounds.windows(2).map(|b| shard_delta(&old, &new, b[0]..b[1], numel as u64)).collect();
            let joined = join(parts, Codec::Context, &bases, &BTreeMap::new()).unwrap();
            assert!(joined.packed);
            let tensor = &joined.tensors[0];
            assert_eq!((tensor.positions_codec, tensor.values_codec), (whole.positions_codec, whole.values_codec));
            assert_eq!(
                (tensor.changed, tensor.last_position, tensor.base),
                (whole.changed, whole.last_position, whole.base)
            );
            assert_eq!((&tensor.positions[..], &tensor.values[..]), (&whole.positions[..], &whole.values[..]));
        }
        // Without the base, or with one of another size, the join refuses by the tensor's name.
        let parts = || vec![shard_delta(&old, &new, 0..numel, numel as u64)];
        let err = join(parts(), Codec::Context, &BTreeMap::new(), &BTreeMap::new()).unwrap_err().to_string();
        assert!(err.contains("\"w\"") && err.contains("base"), "{err}");
        let short = BTreeMap::from([("w".to_owned(), &old[2..])]);
        let err = join(parts(), Codec::Context, &short, &BTreeMap::new()).unwrap_err().to_string();
        assert!(err.contains("\"w\"") && err.contains("bytes"), "{err}");
    }

    #[test]
    fn rejects_shards_out_of_order() {
        let numel = 10u64;
        let old = vec![0u8; 20];
        let new = vec![1u8; 20];
        let parts = vec![shard_delta(&old, &new, 5..10, numel), shard_delta(&old, &new, 0..5, numel)];
        let err = join(parts, Codec::Varint, &BTreeMap::new(), &BTreeMap::new()).unwrap_err();
        assert!(err.to_string().contains("\"w\""), "{err}");
    }
}
