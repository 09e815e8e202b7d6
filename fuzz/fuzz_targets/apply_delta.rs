//! Loads arbitrary bytes as a delta and applies it to targets of the size it asks for, or of a wrong size:
//! apply must never panic or write out of bounds, and a refused apply must leave every target untouched. The same
//! bytes loaded with the streams' check left to the apply must end as the fully checked load does. A file with a
//! checksum (docs/format.md §2.1) has it made right first, so that mutations reach the checks behind it.
#![no_main]

use std::sync::Arc;

use deltasync_rs::core::codec::decode::EncodedTensor;
use deltasync_rs::core::error::Error;
use deltasync_rs::core::stream::Backing;
use deltasync_rs::core::{apply, format, Delta};
use libfuzzer_sys::fuzz_target;

/// Targets larger than this are skipped, to keep each run fast.
const MAX_TARGET_BYTES: u64 = 1 << 20;

fuzz_target!(|data: &[u8]| {
    // The last byte picks a size error to inject (0: none), the rest is the file.
    let Some((&skew, file)) = data.split_last() else { return };
    let mut file = file.to_vec();
    format::reseal(&mut file);
    let file = &file[..];
    let eager = format::from_bytes(file.to_vec(), "fuzz");
    deferred_ends_as_eager(file, skew, eager.as_ref().ok());
    let Ok(delta) = eager else { return };
    let mut buffers = Vec::new();
    for (index, tensor) in delta.tensors.iter().enumerate() {
        let elements = match tensor.numel() {
            Some(numel) => numel,
            // TRL files record no shape: the smallest target that holds the last change.
            None => tensor.last_position.map_or(0, |last| last + 1),
        };
        let Some(bytes) = elements.checked_mul(tensor.width() as u64).filter(|&n| n <= MAX_TARGET_BYTES) else {
            return;
        };
        let mut len = bytes as usize;
        if index == 0 {
            len = match skew % 4 {
                1 => len.saturating_sub(1),
                2 => len + 1,
                3 => len.saturating_sub(tensor.width()),
                _ => len,
            };
        }
        // A fill pattern, so that a partial write is visible.
        let target: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31) ^ skew).collect();
        buffers.push((index, target));
    }
    let before: Vec<Vec<u8>> = buffers.iter().map(|(_, b)| b.clone()).collect();
    // `context` positions (and `rans_classes` values) decode against the base: against any bytes they must decode
    // to `changed` strictly increasing positions inside the tensor, or fail, never panic. (The apply below refuses these fill patterns
    // at the base check, so this is where their decoding is fuzzed.)
    // A fill pattern's classes rarely fit a stream's ranks: also a base made to fit them (`fitting_base`).
    let fitting: Vec<Vec<u8>> = buffers
        .iter()
        .map(|(index, b)| fitting_base(&delta.tensors[*index], b.len(), skew).unwrap_or_default())
        .collect();
    for ((index, _), base) in buffers.iter().zip(&before).chain(buffers.iter().zip(&fitting)) {
        let tensor = &delta.tensors[*index];
        if !tensor.needs_base() {
            continue;
        }
        if let Ok(changes) = (EncodedTensor { base: Some(base), ..tensor.encoded() }).context_changes() {
            let (positions, numel) = (&changes.positions, (base.len() / tensor.width()) as u64);
            // `rans_classes` values are decoded by class with the positions: one per change.
            assert!(changes.values.as_ref().is_none_or(|v| v.len() == positions.len()), "a value per change");
            assert_eq!(positions.len() as u64, tensor.changed, "context positions of the wrong count");
            assert!(positions.windows(2).all(|w| w[0] < w[1]), "context positions not increasing");
            assert!(positions.last().is_none_or(|&p| p < numel), "context position past the tensor");
            readers_of_parts_agree(tensor, base, positions);
        }
    }
    let needs_base = delta.tensors.iter().any(|t| t.needs_base() && t.changed > 0);
    let targets = buffers.iter_mut().map(|(index, b)| (*index, &mut b[..])).collect();
    match apply::apply(&delta, targets) {
        Ok(()) => {}
        Err(error) => {
            // A delta with `context` positions applies only to its exact base, which a fill pattern is not.
            let base_refused = needs_base && matches!(error, Error::BaseMismatch { .. });
            assert!(
                skew % 4 != 0 || base_refused,
                "a delta that loaded was refused by targets of its own size: {error}"
            );
            for ((_, after), before) in buffers.iter().zip(&before) {
                assert!(after == before, "a refused apply wrote into a target");
            }
        }
    }
});

/// Targets of the sizes `delta`'s tensors ask for, filled with a pattern; None when one is too large or unknown.
fn own_size_targets(delta: &Delta, skew: u8) -> Option<Vec<(usize, Vec<u8>)>> {
    let mut buffers = Vec::new();
    for (index, tensor) in delta.tensors.iter().enumerate() {
        let elements = tensor.numel().or(tensor.last_position.map(|last| last + 1)).unwrap_or(0);
        let bytes = elements.checked_mul(tensor.width() as u64).filter(|&n| n <= MAX_TARGET_BYTES)?;
        buffers.push((index, (0..bytes as usize).map(|i| (i as u8).wrapping_mul(31) ^ skew).collect()));
    }
    Some(buffers)
}

/// The bytes loaded with the check of `rice` + `rans` / `diffbits` streams left to the apply: refused (at load, or
/// by an apply that leaves every target as it was) whenever the fully checked load (`eager`) refuses them; else
/// writing what the fully checked delta writes.
fn deferred_ends_as_eager(file: &[u8], skew: u8, eager: Option<&Delta>) {
    let Ok(deferred) = format::read_checked(Arc::new(Backing::Owned(file.to_vec())), "fuzz", true) else {
        assert!(eager.is_none(), "a file the full check accepts was refused with the check left to the apply");
        return;
    };
    let Some(mut buffers) = own_size_targets(&deferred, skew) else { return };
    let before: Vec<Vec<u8>> = buffers.iter().map(|(_, b)| b.clone()).collect();
    let targets = buffers.iter_mut().map(|(index, b)| (*index, &mut b[..])).collect();
    let applied = apply::apply(&deferred, targets);
    let mut expected: Vec<(usize, Vec<u8>)> = before.iter().cloned().enumerate().collect();
    let eager_applied = eager.map(|eager| {
        let targets = expected.iter_mut().map(|(index, b)| (*index, &mut b[..])).collect();
        apply::apply(eager, targets).is_ok()
    });
    match applied {
        Ok(()) => {
            assert_eq!(eager_applied, Some(true), "applied a file the full check refuses");
            assert!(buffers.iter().zip(&expected).all(|((_, a), (_, b))| a == b), "wrote other bytes");
        }
        Err(_) => {
            assert!(eager_applied != Some(true), "refused a file the full check applies");
            assert!(buffers.iter().zip(&before).all(|((_, a), b)| a == b), "a refused apply wrote into a target");
        }
    }
}

/// A reader holding part of the base (docs/format.md §5.2): with the tensor cut into 2 or 3 runs and each run's
/// first class ranks counted, the odd runs walked alone hold exactly the whole decode's changes there, and the
/// streams read without the base hold a value per change.
fn readers_of_parts_agree(tensor: &deltasync_rs::core::TensorDelta, base: &[u8], positions: &[u64]) {
    let parts = tensor.context_parts().expect("a stream the whole reader decodes reads without the base");
    assert_eq!(parts.values.iter().map(Vec::len).sum::<usize>() as u64, tensor.changed, "a value per change");
    let numel = base.len() / tensor.width();
    for runs in [2usize, 3] {
        if numel == 0 || numel % runs != 0 {
            continue;
        }
        let run_len = numel / runs;
        let counts = tensor.context_counts(base, run_len).expect("counts of whole runs");
        let mut seen = [0u64; 16];
        let (mut block, mut firsts, mut expected) = (Vec::new(), Vec::new(), Vec::new());
        for (run, count) in counts.iter().enumerate() {
            if run % 2 == 1 {
                let (from, to) = (run * run_len, (run + 1) * run_len);
                let origin = (block.len() / tensor.width()) as u64;
                block.extend_from_slice(&base[from * tensor.width()..to * tensor.width()]);
                firsts.push(seen);
                let inside = positions.iter().filter(|&&p| (from as u64..to as u64).contains(&p));
                expected.extend(inside.map(|&p| p - from as u64 + origin));
            }
            for (total, n) in seen.iter_mut().zip(count) {
                *total += n;
            }
        }
        let found = tensor.context_runs(&block, run_len, &firsts).expect("the runs of a base that decodes");
        assert_eq!(found, expected, "a part's walk disagrees with the whole decode");
    }
}

/// A base of `len` bytes whose classes fit a `context` tensor's stream: each class with listed ranks holds at least
/// one more element than its last rank, classes that list unchanged elements hold as many more as make the changes
/// add up to `changed`, the rest go to a class that lists changed ones; classes shuffled by `seed`. None where no
/// such base exists.
fn fitting_base(tensor: &deltasync_rs::core::TensorDelta, len: usize, seed: u8) -> Option<Vec<u8>> {
    use deltasync_rs::core::dtype::Dtype;
    let parts = tensor.context_parts().ok()?;
    let (width, shift) = match tensor.dtype {
        Dtype::BF16 => (2, 7),
        Dtype::F16 => (2, 10),
        Dtype::F32 => (4, 23),
        _ => return None,
    };
    let numel = (len / width) as u64;
    let (listed, complement) = (&parts.listed.ranks, parts.listed.complement);
    let mut size: Vec<u64> = listed.iter().map(|ranks| ranks.last().map_or(0, |&last| last + 1)).collect();
    let counted = |size: &[u64]| -> u64 {
        (0..16).map(|c| if complement[c] { size[c] - listed[c].len() as u64 } else { listed[c].len() as u64 }).sum()
    };
    let short = tensor.changed.checked_sub(counted(&size))?;
    if short > 0 {
        size[(0..16).find(|&c| complement[c])?] += short;
    }
    let filler = (0..16).find(|&c| !complement[c])?;
    size[filler] += numel.checked_sub(size.iter().sum())?;
    let field = |class: usize| {
        (i64::from(parts.listed.reference) + class as i64 - 8).clamp(0, if shift == 10 { 0x1f } else { 0xff }) as u64
    };
    if (0..16)
        .any(|c| size[c] > 0 && (field(c) as i64 - i64::from(parts.listed.reference) + 8).clamp(0, 15) != c as i64)
    {
        return None; // a class the reference cannot reach
    }
    let mut classes: Vec<usize> = (0..16).flat_map(|c| std::iter::repeat_n(c, size[c] as usize)).collect();
    let mut state = u64::from(seed) | 0x9e37_79b9_0000_0001;
    for i in (1..classes.len()).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        classes.swap(i, (state % (i as u64 + 1)) as usize);
    }
    Some(classes.iter().flat_map(|&c| (field(c) << shift).to_le_bytes()[..width].to_vec()).collect())
}
