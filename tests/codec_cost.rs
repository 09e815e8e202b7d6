//! What checking and decoding a compact tensor's streams costs per change: one 50M-element bf16 tensor with about
//! 500k changes (gaps uniform in [1, 199], values mostly ±1, some ±2), diffed with the compact codec, then the
//! `rice` check, the `rans` check and a batched `rans` read, each the minimum of 25 runs on one thread.
//! Ignored by default: `cargo test --release --test codec_cost -- --ignored --nocapture`.

use std::time::Instant;

use deltasync_rs::core::codec::{rans, rice, Codec, ValueCodec};
use deltasync_rs::core::diff::{diff, DiffInput};
use deltasync_rs::core::dtype::Dtype;

mod common;

#[test]
#[ignore]
fn check_and_decode_cost_per_change() {
    let n = 50_000_000usize;
    let old = common::hashed_bytes(n * 2);
    let mut new = old.clone();
    let (mut next, mut element) = (common::xorshift(12_345), 0usize);
    loop {
        let state = next();
        element += (state % 199) as usize + 1;
        if element >= n {
            break;
        }
        let bits = u16::from_le_bytes([new[2 * element], new[2 * element + 1]]);
        let difference: u16 = match state >> 60 {
            0..=6 => 1,
            7..=13 => 0xffff,
            14 => 2,
            _ => 0xfffe,
        };
        new[2 * element..2 * element + 2].copy_from_slice(&bits.wrapping_add(difference).to_le_bytes());
    }
    let input = DiffInput { name: "t".into(), dtype: Dtype::BF16, shape: vec![n as u64], old: &old, new: &new };
    let tensor = diff(&[input], ValueCodec::Diff, Codec::Compact).unwrap().remove(0);
    assert_eq!(tensor.values_codec, ValueCodec::Rans);
    let changed = tensor.changed;
    let per_change = |start: Instant| start.elapsed().as_nanos() as f64 / changed as f64;
    let (mut rice_check, mut rans_check, mut rans_read) = (f64::MAX, f64::MAX, f64::MAX);
    for _ in 0..25 {
        let start = Instant::now();
        rice::check_rice(&tensor.positions, changed, n as u64).unwrap();
        rice_check = rice_check.min(per_change(start));
        let start = Instant::now();
        rans::check_rans::<2>(&tensor.values, changed).unwrap();
        rans_check = rans_check.min(per_change(start));
        let start = Instant::now();
        let mut reader = rans::RansReader::new(&tensor.values, 2).unwrap();
        let mut batch = [0u64; 64];
        let mut left = changed as usize;
        while left > 0 {
            let m = left.min(batch.len());
            reader.read_values::<2>(&mut batch[..m]).unwrap();
            left -= m;
        }
        rans_read = rans_read.min(per_change(start));
    }
    println!(
        "{changed} changes: rice check {rice_check:.2} ns, rans check {rans_check:.2} ns, rans batch read \
         {rans_read:.2} ns per change"
    );
}
