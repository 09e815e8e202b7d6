"""One tensor-parallel rank's apply of a `context` delta against the same step coded `compact`, on a CPU.

Run as benchmarks:   pytest benches/test_bench_context_tp.py --benchmark-only --benchmark-columns=median,min,rounds
Run as quick tests:  pytest benches/test_bench_context_tp.py --benchmark-disable -q   (a tiny layer)

The tensors are one Qwen3-0.6B decoder layer's linear weights (q/k/v/o, gate/up/down: 15.7M parameters in 7 tensors)
with a real step's structure: base magnitudes spread over many binades, a step of about the same size for every
weight (DELTASYNC_BENCH_DENSITY of the BF16 elements change, 1% by default). TP=2 as vLLM splits them: q/k/v and
gate/up by rows (column-parallel), o and down by columns (row-parallel). Rank 0 is timed; the other rank's counts
are made once, outside the timer (what the all-gather hands it). Each round starts from the same base (reset outside
the timer) and must end bit-identical to the new state's slice; nothing here asserts on timings.

Rows: `context` at TP=2 (counts of the rank's slices, placement, staged writes), `compact` at TP=2 (decode of the
whole tensor, the rank's changes kept), and `context` at TP=1 (the core's whole-tensor decode, base checked).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import deltasync_rs as ds
from deltasync_rs import _write

GROUP = "context-tp"
DENSITY = float(os.environ.get("DELTASYNC_BENCH_DENSITY", "0.01"))


@dataclass
class Region:
    """A rank's block of an HF tensor viewed as [rows, cols], as vLLM's shard map gives it."""

    param: Any
    hf_shape: tuple[int, ...]
    row_start: int
    row_count: int
    col_start: int
    col_count: int
    param_row_offset: int = 0


def _shapes(bench_scale: float) -> dict[str, tuple[tuple[int, int], str]]:
    hidden, inter, q, kv = (1024, 3072, 2048, 1024) if bench_scale >= 0.1 else (64, 192, 128, 64)
    return {
        "q_proj": ((q, hidden), "rows"),
        "k_proj": ((kv, hidden), "rows"),
        "v_proj": ((kv, hidden), "rows"),
        "o_proj": ((hidden, q), "cols"),
        "gate_proj": ((inter, hidden), "rows"),
        "up_proj": ((inter, hidden), "rows"),
        "down_proj": ((hidden, inter), "cols"),
    }


def _lr_for(density: float) -> float:
    """The step size that changes about `density` of the elements of `_step`'s bases (measured once)."""
    return 5.1e-7 * (density / 0.01)


def _step(shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = (0.02 * torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g))).to(torch.bfloat16)
    return base, (base.float() + _lr_for(DENSITY) * torch.randn(shape, generator=g)).to(torch.bfloat16)


def _split(shape: tuple[int, int], how: str) -> list[tuple[int, int, int, int]]:
    rows, cols = shape
    if how == "rows":
        return [(0, rows // 2, 0, cols), (rows // 2, rows, 0, cols)]
    return [(0, rows, 0, cols // 2), (0, rows, cols // 2, cols)]


@pytest.fixture(scope="module")
def layer(bench_scale):
    prev, curr, splits = {}, {}, {}
    for i, (name, (shape, how)) in enumerate(_shapes(bench_scale).items()):
        prev[name], curr[name] = _step(shape, i)
        splits[name] = _split(shape, how)
    deltas = {codec: ds.diff(prev, curr, codec=codec) for codec in ("context", "compact")}
    assert {t.positions for t in deltas["context"].tensors} == {"context"}, deltas["context"].tensors
    rank0 = {}
    for name, blocks in splits.items():
        r0, r1, c0, c1 = blocks[0]
        rank0[name] = Region(prev[name][r0:r1, c0:c1].clone(), tuple(prev[name].shape), r0, r1 - r0, c0, c1 - c0)
    others = {}  # what rank 1 hands rank 0 in the exchange
    for index, info in enumerate(deltas["context"].tensors):
        r0, r1, c0, c1 = splits[info.name][1]
        other = Region(prev[info.name][r0:r1, c0:c1].clone(), info.shape, r0, r1 - r0, c0, c1 - c0)
        others[index] = _write.Writes(deltas["context"]._raw).context_held(index, other)
    return prev, curr, deltas, rank0, others


def _reset(prev, rank0) -> None:
    for name, region in rank0.items():
        r, c = region.row_start, region.col_start
        region.param.copy_(prev[name][r : r + region.row_count, c : c + region.col_count])


def _check(curr, rank0) -> None:
    for name, region in rank0.items():
        r, c = region.row_start, region.col_start
        expected = curr[name][r : r + region.row_count, c : c + region.col_count]
        assert torch.equal(region.param.view(torch.int16), expected.view(torch.int16)), name


@pytest.mark.benchmark(group=GROUP)
def test_context_at_tp2_one_rank(benchmark, layer, pedantic_opts):
    prev, curr, deltas, rank0, others = layer
    delta = deltas["context"]

    def apply() -> None:
        writes = _write.Writes(delta._raw)
        held = {i: writes.context_held(i, rank0[t.name]) for i, t in enumerate(delta.tensors)}
        for index, info in enumerate(delta.tensors):
            writes.add_region(index, rank0[info.name], [held[index], others[index]])
        writes.commit()

    benchmark.pedantic(apply, setup=lambda: _reset(prev, rank0), **pedantic_opts)
    _check(curr, rank0)


@pytest.mark.benchmark(group=GROUP)
def test_compact_at_tp2_one_rank(benchmark, layer, pedantic_opts):
    prev, curr, deltas, rank0, _ = layer
    delta = deltas["compact"]

    def apply() -> None:
        writes = _write.Writes(delta._raw)
        for index, info in enumerate(delta.tensors):
            writes.add_region(index, rank0[info.name])
        writes.commit()

    benchmark.pedantic(apply, setup=lambda: _reset(prev, rank0), **pedantic_opts)
    _check(curr, rank0)


@pytest.mark.benchmark(group=GROUP)
def test_context_at_tp1_whole_tensors(benchmark, layer, pedantic_opts):
    prev, curr, deltas, _, _ = layer
    target = {name: t.clone() for name, t in prev.items()}

    def reset() -> None:
        for name, t in target.items():
            t.copy_(prev[name])

    benchmark.pedantic(lambda: deltas["context"].apply_(target), setup=reset, **pedantic_opts)
    assert all(torch.equal(target[n].view(torch.int16), curr[n].view(torch.int16)) for n in curr)
