//! What the compact codec's re-encoding (`plan::smallest_streams`, after the scan) costs per change: one
//! 100M-element bf16 tensor scanned in 2^18-element ranges, as `diff` and the mirror cut tensors, with about 1% of
//! its elements changed (geometric gaps; differences mostly ±1 as benches/workload.py draws them), re-encoded on
//! one thread. Prints the median and minimum of the runs and a hash of the streams, so that two builds can be
//! compared for speed and for identical bytes.
//! Ignored by default: `cargo test --release --test plan_cost -- --ignored --nocapture`; PLAN_COST_RUNS sets the
//! number of timed runs (default 15).

use std::hash::{Hash, Hasher};
use std::time::Instant;

use deltasync_rs::core::codec::{plan, ValueCodec};
use deltasync_rs::core::scan;

mod common;

#[test]
#[ignore]
fn reencode_cost_per_change() {
    let n = 100_000_000usize;
    let old = common::hashed_bytes(n * 2);
    let mut new = old.clone();
    let mut next = common::xorshift(0x2545_f491_4f6c_dd1d);
    let mut element = 0usize;
    loop {
        // Geometric gaps of mean 99 (density 1%).
        let u = ((next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        element += (u.ln() / 0.99f64.ln()).floor() as usize;
        if element >= n {
            break;
        }
        let (draw, sign) = (next() % 1000, if next().is_multiple_of(2) { 1i32 } else { -1 });
        let bits = u16::from_le_bytes([new[2 * element], new[2 * element + 1]]);
        let moved = match draw {
            0..900 => bits.wrapping_add((sign) as u16),
            900..940 => bits.wrapping_add((2 * sign) as u16),
            940..995 => bits.wrapping_add((sign * (3 + (next() % 198) as i32)) as u16),
            _ => bits ^ 0x8000,
        };
        new[2 * element..2 * element + 2].copy_from_slice(&moved.to_le_bytes());
        element += 1;
    }
    let range = 1usize << 18;
    let ranges: Vec<_> = (0..n)
        .step_by(range)
        .map(|start| {
            let end = (start + range).min(n);
            scan::scan(&old[2 * start..2 * end], &new[2 * start..2 * end], start as u64, 2, ValueCodec::Diff)
        })
        .collect();
    let changed: u64 = ranges.iter().map(|r| r.count).sum();
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let runs: usize = std::env::var("PLAN_COST_RUNS").ok().and_then(|s| s.parse().ok()).unwrap_or(15);
    let (mut times, mut hash) = (Vec::with_capacity(runs), 0);
    pool.install(|| {
        for _ in 0..runs {
            let start = Instant::now();
            let streams = plan::smallest_streams(&ranges, 2, ValueCodec::Diff, n * 2).unwrap();
            times.push(start.elapsed().as_nanos() as f64 / changed as f64);
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            (streams.positions_codec.name(), streams.values_codec.name(), &streams.positions, &streams.values)
                .hash(&mut hasher);
            hash = hasher.finish();
            assert_eq!(streams.values_codec, ValueCodec::Rans);
        }
    });
    times.sort_by(f64::total_cmp);
    println!(
        "{changed} changes: re-encode median {:.2} ns, min {:.2} ns per change; streams hash {hash:016x}",
        times[runs / 2],
        times[0]
    );
}
