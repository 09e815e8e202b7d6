//! Property tests of the core through its public API: diff → bytes → load → apply is bit-exact, and no
//! corruption of a file makes the reader or the apply panic.

use deltasync_rs::core::apply::apply;
use deltasync_rs::core::base::{check_base, identity};
use deltasync_rs::core::codec::{Codec, ValueCodec};
use deltasync_rs::core::delta::TensorDelta;
use deltasync_rs::core::diff::{diff, DiffInput};
use deltasync_rs::core::dtype::Dtype;
use deltasync_rs::core::format::{from_bytes, to_bytes};
use deltasync_rs::core::{Delta, Error};
use proptest::prelude::*;

mod common;

fn dtype_of(width: usize) -> Dtype {
    match width {
        1 => Dtype::U8,
        2 => Dtype::BF16,
        4 => Dtype::F32,
        _ => Dtype::I64,
    }
}

/// Old bytes, and new bytes with some elements changed by small or arbitrary amounts.
fn pair() -> impl Strategy<Value = (usize, Vec<u8>, Vec<u8>)> {
    (prop::sample::select(vec![1usize, 2, 4, 8]), 0usize..3000).prop_flat_map(|(width, elements)| {
        let len = width * elements;
        (
            Just(width),
            prop::collection::vec(any::<u8>(), len),
            // Mostly ±1 / ±2 on the low byte, as in training steps, so that the compact codec's short codes are used.
            prop::collection::vec(
                (
                    0..elements.max(1),
                    prop_oneof![4 => Just(1u8), 4 => Just(255u8), 1 => Just(2u8), 1 => Just(254u8), 2 => any::<u8>()],
                    any::<bool>(),
                ),
                0..=elements.min(400),
            ),
        )
            .prop_map(move |(width, old, edits)| {
                let mut new = old.clone();
                for (element, byte, low) in edits {
                    if new.is_empty() {
                        break;
                    }
                    let at = element * width + if low { 0 } else { width - 1 };
                    new[at] = new[at].wrapping_add(byte.max(1));
                }
                (width, old, new)
            })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn roundtrip_is_bit_exact((width, old, new) in pair(), abs in any::<bool>(), compact in any::<bool>()) {
        let values = if abs { ValueCodec::Abs } else { ValueCodec::Diff };
        let codec = if compact { Codec::Compact } else { Codec::Varint };
        let elements = (old.len() / width) as u64;
        let tensors = diff(
            &[DiffInput { name: "t".into(), dtype: dtype_of(width), shape: vec![elements], old: &old, new: &new }],
            values,
            codec,
        ).unwrap();
        let expected_changes = old.chunks(width).zip(new.chunks(width)).filter(|(a, b)| a != b).count() as u64;
        prop_assert!(tensors[0].changed == expected_changes || tensors[0].is_dense());
        let delta = Delta { tensors, step: Some(1), ..Default::default() };
        let bytes = to_bytes(&delta).unwrap();
        safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let loaded = from_bytes(bytes, "prop").unwrap();
        prop_assert_eq!(loaded.tensors[0].base, delta.tensors[0].base);
        let tensor = &loaded.tensors[0];
        // A sparse record knows its base: it accepts the old state and refuses the new one (a second application)
        // and a base one bit away; a whole tensor accepts any base.
        prop_assert_eq!(tensor.base, (!tensor.is_dense()).then(|| identity(&old)));
        check_base(tensor, &old).unwrap();
        if !tensor.is_dense() && !old.is_empty() {
            if old != new {
                let refused = matches!(check_base(tensor, &new), Err(Error::BaseMismatch { .. }));
                prop_assert!(refused, "a second application passed");
            }
            let mut flipped = old.clone();
            let at = old.len() / 3;
            flipped[at] ^= 1 << (at % 8);
            let refused = matches!(check_base(tensor, &flipped), Err(Error::BaseMismatch { .. }));
            prop_assert!(refused, "a base one bit away passed");
        }
        let mut target = old.clone();
        apply(&loaded, vec![(0, &mut target[..])]).unwrap();
        prop_assert_eq!(target, new);
    }

    #[test]
    fn corrupted_files_never_panic((width, old, new) in pair(), compact in any::<bool>(), edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6)) {
        let codec = if compact { Codec::Compact } else { Codec::Varint };
        let elements = (old.len() / width) as u64;
        let tensors = diff(
            &[DiffInput { name: "t".into(), dtype: dtype_of(width), shape: vec![elements], old: &old, new: &new }],
            ValueCodec::Diff,
            codec,
        ).unwrap();
        let mut bytes = to_bytes(&Delta { tensors, ..Default::default() }).unwrap();
        for (index, byte) in edits {
            let at = index.index(bytes.len());
            bytes[at] = byte;
        }
        if let Ok(loaded) = from_bytes(bytes, "corrupt") {
            let mut target = old.clone();
            let _ = apply(&loaded, vec![(0, &mut target[..])]);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Load-time validation checks positions and values apart; it must accept exactly the streams the full walk
    /// accepts, in either codec family, and find the same last position.
    #[test]
    fn split_validation_agrees_with_the_walk(
        (width, old, new) in pair(),
        abs in any::<bool>(),
        compact in any::<bool>(),
        edits in prop::collection::vec((any::<bool>(), any::<prop::sample::Index>(), any::<u8>()), 0..4),
        cut in prop::option::of((any::<bool>(), any::<prop::sample::Index>())),
    ) {
        let codec = if abs { ValueCodec::Abs } else { ValueCodec::Diff };
        let elements = (old.len() / width) as u64;
        let tensors = diff(
            &[DiffInput { name: "t".into(), dtype: dtype_of(width), shape: vec![elements], old: &old, new: &new }],
            codec,
            if compact { Codec::Compact } else { Codec::Varint },
        ).unwrap();
        let mut tensor = tensors.into_iter().next().unwrap();
        prop_assume!(!tensor.is_dense() && tensor.changed > 0);
        let (mut positions, mut values) = (tensor.positions.to_vec(), tensor.values.to_vec());
        for (in_positions, index, byte) in edits {
            let stream = if in_positions { &mut positions } else { &mut values };
            let at = index.index(stream.len());
            stream[at] = byte;
        }
        if let Some((in_positions, index)) = cut {
            let stream = if in_positions { &mut positions } else { &mut values };
            let keep = index.index(stream.len() + 1);
            stream.truncate(keep);
        }
        tensor.positions = positions.into();
        tensor.values = values.into();
        if let Err(disagreement) = fast_paths_agree_with_the_walk(&mut tensor) {
            prop_assert!(false, "{}", disagreement);
        }
    }
}

/// Validation and the batched decoder (used by apply) agree with the one-by-one walk, change for change and on
/// every error; after a successful validation the last position is the walk's. Validation that leaves the streams
/// to the apply accepts every stream the walk reads, and the apply then fails exactly where the walk does, leaving
/// its target as it was.
fn fast_paths_agree_with_the_walk(tensor: &mut TensorDelta) -> Result<(), String> {
    deferred_check_agrees_with_the_walk(tensor)?;
    let mut changes = Vec::new();
    let walked = tensor.for_each_change(|position, value| changes.push((position, value))).is_ok();
    let mut batched = Vec::new();
    let batch_ok = tensor.for_each_batch(None, |p, v| batched.extend(p.iter().copied().zip(v.iter().copied()))).is_ok();
    if batch_ok != walked {
        return Err(format!("batched decoder ok: {batch_ok}, walk ok: {walked}"));
    }
    let valid = tensor.validate("t", false).is_ok();
    if valid != walked {
        return Err(format!("validation ok: {valid}, walk ok: {walked}"));
    }
    if walked && batched != changes {
        return Err("the batched decoder's changes differ from the walk's".to_owned());
    }
    if walked && tensor.last_position != changes.last().map(|c| c.0) {
        return Err(format!("last position {:?}, walk's {:?}", tensor.last_position, changes.last().map(|c| c.0)));
    }
    Ok(())
}

/// The part of `fast_paths_agree_with_the_walk` that loads with the check left to the apply.
fn deferred_check_agrees_with_the_walk(tensor: &TensorDelta) -> Result<(), String> {
    let walked = tensor.for_each_change(|_, _| {}).is_ok();
    let mut deferred = tensor.clone();
    let headers_ok = deferred.validate("t", true).is_ok();
    if walked && !headers_ok {
        return Err("the header check refused streams the walk reads".to_owned());
    }
    let Some(numel) = deferred.numel().filter(|_| headers_ok && deferred.unchecked) else { return Ok(()) };
    let mut target: Vec<u8> = (0..numel as usize * deferred.width()).map(|i| (i * 7) as u8).collect();
    let before = target.clone();
    let delta = Delta { tensors: vec![deferred], ..Default::default() };
    let applied = apply(&delta, vec![(0, &mut target[..])]).is_ok();
    if applied != walked {
        return Err(format!("apply of streams checked as they are decoded ok: {applied}, walk ok: {walked}"));
    }
    if !applied && target != before {
        return Err("a failed apply left its target changed".to_owned());
    }
    Ok(())
}

/// A large compact tensor (Rice positions, `diffbits` values, streams far longer than the decoders' 16-byte
/// margin) under many single-byte corruptions and truncations: validation and the batched decoder agree with the
/// one-by-one walk every time.
#[test]
fn compact_fast_paths_agree_with_the_walk_under_corruption() {
    let mut next = common::xorshift(0x2545_f491_4f6c_dd1d);
    for width in [1usize, 2, 4, 8] {
        let elements = 60_000;
        let old: Vec<u8> = (0..elements * width).map(|_| next() as u8).collect();
        let mut new = old.clone();
        for element in 0..elements {
            if next().is_multiple_of(50) {
                let byte = element * width;
                new[byte] = new[byte].wrapping_add(match next() % 20 {
                    0..=8 => 1,
                    9..=17 => 255,
                    18 => 2,
                    _ => next() as u8 | 0x80,
                });
            }
        }
        let tensors = diff(
            &[DiffInput {
                name: "t".into(),
                dtype: dtype_of(width),
                shape: vec![elements as u64],
                old: &old,
                new: &new,
            }],
            ValueCodec::Diff,
            Codec::Compact,
        )
        .unwrap();
        let pristine = tensors.into_iter().next().unwrap();
        assert_eq!(pristine.positions_codec, deltasync_rs::core::codec::PositionCodec::Rice, "width {width}");
        for round in 0..400 {
            let mut tensor = pristine.clone();
            let (mut positions, mut values) = (tensor.positions.to_vec(), tensor.values.to_vec());
            let stream = if next().is_multiple_of(2) { &mut positions } else { &mut values };
            if round % 5 == 0 {
                let keep = next() as usize % (stream.len() + 1);
                stream.truncate(keep);
            } else {
                let at = next() as usize % stream.len();
                stream[at] ^= 1 << (next() % 8);
            }
            tensor.positions = positions.into();
            tensor.values = values.into();
            fast_paths_agree_with_the_walk(&mut tensor).unwrap_or_else(|e| panic!("width {width} round {round}: {e}"));
        }
    }
}

/// A deltasync file whose 'tensors' metadata lists `records` (each with no stored streams: changed 0).
fn file_with_records(records: &[(&str, Vec<u64>)]) -> Vec<u8> {
    let records: Vec<serde_json::Value> = records
        .iter()
        .map(|(name, shape)| {
            serde_json::json!({"name": name, "dtype": "U8", "shape": shape, "changed": 0, "positions": "varint", "values": "diff"})
        })
        .collect();
    let metadata: std::collections::BTreeMap<String, String> = [
        ("format", "deltasync".to_owned()),
        ("format_version", deltasync_rs::core::format::FORMAT_VERSION.to_owned()),
        ("kind", "delta".to_owned()),
        ("tensors", serde_json::to_string(&records).unwrap()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    deltasync_rs::core::format::encode_entries(&metadata, Vec::new()).unwrap().to_vec()
}

fn format_error_naming(bytes: Vec<u8>, name: &str) {
    match from_bytes(bytes, "crafted") {
        Err(Error::Format { message, .. }) => assert!(message.contains(&format!("{name:?}")), "{message}"),
        other => panic!("expected a format error naming {name:?}, got {other:?}"),
    }
}

#[test]
fn declared_sizes_that_overflow_are_format_errors() {
    assert_eq!(
        from_bytes(file_with_records(&[("a", vec![1 << 62]), ("b", vec![1 << 62])]), "ok").unwrap().num_elements(),
        1 << 63
    );
    format_error_naming(file_with_records(&[("huge", vec![1 << 40, 1 << 40])]), "huge");
    // Each shape fits 64 bits, their sum does not: `num_elements` used to wrap (and panic in debug builds).
    format_error_naming(file_with_records(&[("first", vec![1 << 63]), ("second", vec![1 << 63])]), "second");
}

#[test]
fn reserved_tensor_names_are_refused_when_writing_and_reading() {
    let (old, new) = (vec![0u8; 4], vec![1u8; 4]);
    for name in ["__metadata__", "w:pos", "w:val"] {
        let input = DiffInput { name: name.into(), dtype: Dtype::U8, shape: vec![4], old: &old, new: &new };
        let err = diff(&[input], ValueCodec::Diff, Codec::Varint).unwrap_err();
        assert!(matches!(err, Error::InvalidInput { .. }) && err.to_string().contains(&format!("{name:?}")), "{err}");
        let whole =
            deltasync_rs::core::diff::FullInput { name: name.into(), dtype: Dtype::U8, shape: vec![4], data: &new };
        let err = deltasync_rs::core::diff::full(&[whole]).unwrap_err();
        assert!(err.to_string().contains(&format!("{name:?}")), "{err}");
        // A delta renamed after the fact is refused by the writer too, not written unreadable.
        let mut tensors = diff(
            &[DiffInput { name: "w".into(), dtype: Dtype::U8, shape: vec![4], old: &old, new: &new }],
            ValueCodec::Diff,
            Codec::Varint,
        )
        .unwrap();
        tensors[0].name = name.into();
        let err = to_bytes(&Delta { tensors, ..Default::default() }).unwrap_err();
        assert!(err.to_string().contains(&format!("{name:?}")), "{err}");
        format_error_naming(file_with_records(&[(name, vec![4])]), name);
    }
}

#[test]
fn arranged_names_records_in_order_and_copies_tied_ones() {
    let (old, new) = (vec![0u8; 8], vec![0u8, 1, 0, 2, 0, 0, 0, 3]);
    let inputs = [
        DiffInput { name: "a".into(), dtype: Dtype::U8, shape: vec![8], old: &old, new: &new },
        DiffInput { name: "b".into(), dtype: Dtype::U8, shape: vec![8], old: &new, new: &old },
    ];
    let delta = Delta {
        tensors: diff(&inputs, ValueCodec::Diff, Codec::Compact).unwrap(),
        step: Some(2),
        base_step: Some(1),
        packed: true,
        ..Default::default()
    };
    let names = [("b".to_string(), 1), ("a".to_string(), 0), ("tied".to_string(), 0)];
    let arranged = delta.arranged(&names).unwrap();
    assert_eq!(arranged.tensors.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), ["b", "a", "tied"]);
    assert!(arranged.tensors[2].same_changes(&delta.tensors[0]));
    assert_eq!((arranged.step, arranged.base_step, arranged.packed), (Some(2), Some(1), true));
    let read = from_bytes(to_bytes(&arranged).unwrap(), "arranged").unwrap();
    let (mut b, mut a, mut tied) = (new.clone(), old.clone(), old.clone());
    apply(&read, vec![(0, &mut b[..]), (1, &mut a[..]), (2, &mut tied[..])]).unwrap();
    assert_eq!((b, a, tied), (old.clone(), new.clone(), new.clone()));
    // Every record named, each name once, every index in range.
    assert!(delta.arranged(&names[..1]).unwrap_err().to_string().contains("\"a\" is not named"));
    assert!(delta.arranged(&[names[0].clone(), names[1].clone(), names[1].clone()]).is_err());
    assert!(delta.arranged(&[names[0].clone(), names[1].clone(), ("c".to_string(), 2)]).is_err());
}
