//! Loads arbitrary bytes as a delta (deltasync or TRL): a format error is fine, a panic is a bug, and a delta
//! that loads must encode again and load back the same. A file with a checksum (docs/format.md §2.1) has it made
//! right first, so that mutations reach the checks behind it (its own tests are in core::format).
#![no_main]

use deltasync_rs::core::format;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut file = data.to_vec();
    format::reseal(&mut file);
    let Ok(delta) = format::from_bytes(file, "fuzz") else { return };
    let Ok(encoded) = format::to_bytes(&delta) else { return };
    let again = format::from_bytes(encoded, "re-encoded").expect("a delta we wrote must load");
    assert_eq!(again.tensors.len(), delta.tensors.len());
    for (a, b) in again.tensors.iter().zip(&delta.tensors) {
        assert_eq!(
            (&a.name, a.dtype, &a.shape, a.changed, a.differing),
            (&b.name, b.dtype, &b.shape, b.changed, b.differing)
        );
        assert_eq!((&a.positions[..], &a.values[..]), (&b.positions[..], &b.values[..]));
    }
});
