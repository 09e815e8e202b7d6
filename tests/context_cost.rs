//! What the `context` position codec costs per element: one 16M-element bf16 base of magnitudes spread over many
//! exponents, with about 5% of its elements changed (far denser among the small magnitudes, as an optimizer's step
//! changes them), encoded and decoded on one thread. Prints the median and minimum ns per element of
//! `context::encode` and `context::decode` next to a read floor measured in the same run (summing the base's u16s),
//! and a hash of the stream, so that two builds can be compared for speed and for identical bytes.
//! Ignored by default: `cargo test --release --test context_cost -- --ignored --nocapture`; CONTEXT_COST_RUNS sets
//! the number of timed runs (default 11), CONTEXT_COST_DENSITY scales every element's chance of a change (default 1;
//! 0.2 gives about 0.8%, as on real fine-tuning steps).

use std::hash::{Hash, Hasher};
use std::hint::black_box;
use std::time::Instant;

use deltasync_rs::core::codec::context::{self, Exponent};
use deltasync_rs::core::dtype::Dtype;

mod common;

fn median_and_min(mut times: Vec<f64>) -> (f64, f64) {
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], times[0])
}

#[test]
#[ignore]
fn context_cost_per_element() {
    let n = 16_000_000usize;
    let mut next = common::xorshift(0x9e37_79b9_7f4a_7c15);
    let density: f64 = std::env::var("CONTEXT_COST_DENSITY").ok().and_then(|s| s.parse().ok()).unwrap_or(1.0);
    let mut base = Vec::with_capacity(2 * n);
    let mut positions = Vec::new();
    for i in 0..n {
        // Magnitudes 2^-1 .. 2^-22 (a mantissa in [1, 2), an exponent spread like a model's weights, its median
        // inside a binade rather than at an edge), either sign.
        let r = next();
        let exponent = -1 - ((r % 8) + ((r >> 8) % 8) + ((r >> 16) % 7)) as i32;
        let value = (1.0 + ((r >> 24) % 4096) as f32 / 4096.0) * 2f32.powi(exponent);
        let value = if (r >> 40) & 1 == 1 { -value } else { value };
        base.extend_from_slice(&((value.to_bits() >> 16) as u16).to_le_bytes());
        // Changes about 2^(exponent + 13) times as likely as 1%, capped at 90%: ~5% overall.
        let per_mille = (10.0 * 2f64.powi((-exponent - 13).clamp(-10, 10))).min(900.0) * density;
        if ((next() % 1000) as f64) < per_mille {
            positions.push(i as u64);
        }
    }
    let field = Exponent::of(Dtype::BF16).unwrap();
    let runs: usize = std::env::var("CONTEXT_COST_RUNS").ok().and_then(|s| s.parse().ok()).unwrap_or(11);
    let (mut floor, mut encode, mut decode) = (Vec::new(), Vec::new(), Vec::new());
    let mut stream = Vec::new();
    for _ in 0..runs {
        let start = Instant::now();
        let sum: u64 = base.chunks_exact(2).map(|p| u64::from(u16::from_le_bytes([p[0], p[1]]))).sum();
        black_box(sum);
        floor.push(start.elapsed().as_nanos() as f64 / n as f64);

        let start = Instant::now();
        stream = context::encode(black_box(&base), field, black_box(&positions));
        encode.push(start.elapsed().as_nanos() as f64 / n as f64);

        let start = Instant::now();
        let decoded = context::decode(black_box(&stream), field, black_box(&base), positions.len() as u64).unwrap();
        decode.push(start.elapsed().as_nanos() as f64 / n as f64);
        assert!(decoded == positions, "decode(encode(positions)) differs");
    }
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    stream.hash(&mut hasher);
    let (floor, encode, decode) = (median_and_min(floor), median_and_min(encode), median_and_min(decode));
    println!(
        "{n} elements, {} changes ({:.2}%), stream {} bytes ({:.3} bytes per change), hash {:016x}",
        positions.len(),
        positions.len() as f64 * 100.0 / n as f64,
        stream.len(),
        stream.len() as f64 / positions.len() as f64,
        hasher.finish()
    );
    println!("read floor: median {:.3} ns, min {:.3} ns per element", floor.0, floor.1);
    println!(
        "encode:     median {:.3} ns, min {:.3} ns per element ({:.1}x floor)",
        encode.0,
        encode.1,
        encode.0 / floor.0
    );
    println!(
        "decode:     median {:.3} ns, min {:.3} ns per element ({:.1}x floor)",
        decode.0,
        decode.1,
        decode.0 / floor.0
    );
}
