//! Loads arbitrary bytes as a delta (deltasync or TRL): a format error is fine, a panic is a bug, and a delta
//! that loads must encode again and load back the same.
#![no_main]

use deltasync_rs::core::format;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(delta) = format::from_bytes(data.to_vec(), "fuzz") else { return };
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
