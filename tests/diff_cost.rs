//! What `diff` costs on a Qwen3-0.6B-shaped bf16 state (596M elements, the shapes of
//! python/deltasync_rs/_workload.py) at 1% density, next to the read floor (one parallel read of both states).
//! Ignored by default: `cargo test --release --test diff_cost -- --ignored --nocapture`; DIFF_COST_RUNS sets
//! the number of timed runs (default 5).

use std::time::Instant;

use deltasync_rs::core::codec::{Codec, ValueCodec};
use deltasync_rs::core::diff::{diff, DiffInput};
use deltasync_rs::core::dtype::Dtype;
use rayon::prelude::*;

mod common;

fn shapes() -> Vec<(String, Vec<u64>)> {
    let (vocab, hidden, inter, q_dim, kv_dim, head_dim) = (151_936u64, 1024u64, 3072u64, 2048u64, 1024u64, 128u64);
    let mut shapes = vec![("model.embed_tokens.weight".to_owned(), vec![vocab, hidden])];
    for layer in 0..28 {
        let p = format!("model.layers.{layer}.");
        for (name, shape) in [
            ("input_layernorm.weight", vec![hidden]),
            ("self_attn.q_proj.weight", vec![q_dim, hidden]),
            ("self_attn.k_proj.weight", vec![kv_dim, hidden]),
            ("self_attn.v_proj.weight", vec![kv_dim, hidden]),
            ("self_attn.o_proj.weight", vec![hidden, q_dim]),
            ("self_attn.q_norm.weight", vec![head_dim]),
            ("self_attn.k_norm.weight", vec![head_dim]),
            ("post_attention_layernorm.weight", vec![hidden]),
            ("mlp.gate_proj.weight", vec![inter, hidden]),
            ("mlp.up_proj.weight", vec![inter, hidden]),
            ("mlp.down_proj.weight", vec![hidden, inter]),
        ] {
            shapes.push((format!("{p}{name}"), shape));
        }
    }
    shapes.push(("model.norm.weight".to_owned(), vec![hidden]));
    shapes
}

/// Two states of `len` bytes: pseudo-random old bits, and new bits with about 1% of the 2-byte elements moved by ±1.
fn states(len: usize) -> (Vec<u8>, Vec<u8>) {
    let old: Vec<u8> = (0..len / 8)
        .into_par_iter()
        .flat_map_iter(|i| {
            let mut x = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            x ^= x >> 31;
            x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
            (x ^ (x >> 29)).to_le_bytes()
        })
        .collect();
    let mut new = old.clone();
    new.par_chunks_mut(1 << 20).enumerate().for_each(|(chunk, bytes)| {
        let mut next = common::xorshift((chunk as u64 + 1).wrapping_mul(0x2545_f491_4f6c_dd1d));
        let mut element = 0usize;
        loop {
            let state = next();
            // Gaps uniform in [0, 198]: a mean of 99 unchanged elements between changes.
            element += (state % 199) as usize + 1;
            if element * 2 >= bytes.len() {
                break;
            }
            let bits = u16::from_le_bytes([bytes[element * 2], bytes[element * 2 + 1]]);
            let moved = if state & (1 << 40) == 0 { bits.wrapping_add(1) } else { bits.wrapping_sub(1) };
            bytes[element * 2..element * 2 + 2].copy_from_slice(&moved.to_le_bytes());
        }
    });
    (old, new)
}

/// CPU time of this process's threads so far, in seconds (Linux; 0 elsewhere): on a shared machine it is less
/// disturbed by other processes than the wall time is.
fn cpu_seconds() -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return 0.0 };
    tasks
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok())
        .filter_map(|stat| stat.split_whitespace().next()?.parse::<u64>().ok())
        .sum::<u64>() as f64
        / 1e9
}

fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

#[test]
#[ignore = "a benchmark: 2.4 GB of states, several seconds"]
fn diff_against_the_read_floor() {
    let runs: usize = std::env::var("DIFF_COST_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(5);
    let shapes = shapes();
    let numels: Vec<usize> = shapes.iter().map(|(_, s)| s.iter().product::<u64>() as usize).collect();
    let total: usize = numels.iter().sum();
    let (old, new) = states(total * 2);
    let mut inputs = Vec::with_capacity(shapes.len());
    let mut at = 0;
    for ((name, shape), numel) in shapes.into_iter().zip(&numels) {
        let bytes = at..at + numel * 2;
        inputs.push(DiffInput { name, dtype: Dtype::BF16, shape, old: &old[bytes.clone()], new: &new[bytes] });
        at += numel * 2;
    }
    let (mut diff_times, mut floor_times, mut identity_times, mut diff_cpu) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut changed = 0;
    for _ in 0..runs {
        let start = Instant::now();
        let folded: u64 = old
            .par_chunks(1 << 18)
            .zip(new.par_chunks(1 << 18))
            .map(|(a, b)| {
                a.chunks_exact(8).zip(b.chunks_exact(8)).fold(0u64, |acc, (x, y)| {
                    acc ^ u64::from_le_bytes(x.try_into().unwrap()) ^ u64::from_le_bytes(y.try_into().unwrap())
                })
            })
            .reduce(|| 0, |a, b| a ^ b);
        floor_times.push(start.elapsed().as_secs_f64());
        std::hint::black_box(folded);
        let (start, cpu) = (Instant::now(), cpu_seconds());
        let tensors = diff(&inputs, ValueCodec::Diff, Codec::Varint).unwrap();
        diff_times.push(start.elapsed().as_secs_f64());
        diff_cpu.push(cpu_seconds() - cpu);
        changed = tensors.iter().map(|t| t.changed).sum::<u64>();
        let start = Instant::now();
        std::hint::black_box(deltasync_rs::core::base::identity(&old));
        identity_times.push(start.elapsed().as_secs_f64());
    }
    let (diff_median, floor_median) = (median(diff_times.clone()), median(floor_times));
    println!(
        "diff of {total} bf16 elements, {changed} changed, {} threads: median {:.1} ms (runs {:?} ms, CPU time {:?} ms); read floor {:.1} ms; \
         {:.2}x the floor; the base identity of the old state alone: median {:.1} ms",
        rayon::current_num_threads(),
        diff_median * 1e3,
        diff_times.iter().map(|t| (t * 1e3).round()).collect::<Vec<_>>(),
        diff_cpu.iter().map(|t| (t * 1e3).round()).collect::<Vec<_>>(),
        floor_median * 1e3,
        diff_median / floor_median,
        median(identity_times) * 1e3
    );
}
