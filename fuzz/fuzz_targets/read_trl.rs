//! Reads arbitrary bytes as a TRL weight patch (src/core/trl.rs), whatever the header's 'format' says: a format
//! error is fine, a panic is a bug, and a patch that reads must write as TRL v1 and read back the same.
#![no_main]

use deltasync_rs::core::{format, trl};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(header) = format::read_header(data, "fuzz") else { return };
    let Ok(delta) = trl::read(data, &header, "fuzz") else { return };
    let Ok(encoded) = trl::encode_v1(&delta) else { return };
    let bytes = encoded.to_vec();
    let header = format::read_header(&bytes, "v1").expect("a TRL file we wrote has a valid header");
    let again = trl::read(&bytes, &header, "v1").expect("a TRL file we wrote must read");
    assert_eq!(again.num_changed(), delta.num_changed());
});
