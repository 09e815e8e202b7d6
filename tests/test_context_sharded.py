"""`context` positions placed by readers that each hold only part of the base (deltasync_rs._context): the
tensor-parallel case, simulated in one process. Every "rank" holds a block of rows and columns in a parameter of
its own; the ranks' holdings are exchanged by hand, as vLLM's workers all-gather them (tests/vllm_workers.py runs
the real thing at TP=2). Each rank must write exactly its part of the new state; bad layouts and bases are refused
before anything is written."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deltasync_rs as ds
from deltasync_rs import _context, _write
from tests.test_context import DTYPES, _bits


def _step(seed: int, shape: tuple[int, ...], dtype: torch.dtype, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A base spread over many binades and a step of random size: small elements change more often than large
    ones, but in every class some change and some do not (so classes list changed ranks and unchanged ones)."""
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(shape, generator=g) * torch.exp(2 * torch.randn(shape, generator=g))).to(dtype)
    return base, (base.float() + lr * torch.randn(shape, generator=g)).to(dtype)


@dataclass
class Region:
    """A rank's block of an HF tensor viewed as [rows, cols], in a parameter of its own (at row `param_row_offset`)."""

    param: Any
    hf_shape: tuple[int, ...]
    row_start: int
    row_count: int
    col_start: int
    col_count: int
    param_row_offset: int = 0


def _blocks(rows: int, cols: int, row_cuts: list[int], col_cuts: list[int]) -> list[tuple[int, int, int, int]]:
    """The grid of blocks (r0, r1, c0, c1) cut at the given rows and columns."""
    r = [0, *sorted(set(row_cuts)), rows]
    c = [0, *sorted(set(col_cuts)), cols]
    return [(r[i], r[i + 1], c[j], c[j + 1]) for i in range(len(r) - 1) for j in range(len(c) - 1)]


def _regions(base: torch.Tensor, blocks, pad_rows: int = 0) -> list[Region]:
    """Each block copied into a parameter of its own, below `pad_rows` rows of padding (as fused parameters hold
    other tensors before it) and with two more columns than the block."""
    shape = tuple(base.shape)
    grid = base.reshape(shape[0], -1)
    regions = []
    for r0, r1, c0, c1 in blocks:
        param = torch.full((pad_rows + r1 - r0, c1 - c0 + 2), 7.0, dtype=base.dtype)
        param[pad_rows:, : c1 - c0] = grid[r0:r1, c0:c1]
        regions.append(Region(param, shape, r0, r1 - r0, c0, c1 - c0, pad_rows))
    return regions


def _apply(delta: ds.Delta, regions: list[Region]) -> None:
    """Every rank stages and commits its region, with every rank's holdings exchanged first. The core walks CPU
    blocks; each rank also places its changes with the torch ops used on other devices, which must agree."""
    writes = [_write.Writes(delta._raw) for _ in regions]
    held = [w.context_held(0, r) for w, r in zip(writes, regions)]
    for region in regions:
        block = region.param[region.param_row_offset :, : region.col_count].view(_bits(region.param).dtype)
        cols = region.hf_shape[1] if len(region.hf_shape) == 2 else 1
        slices = [
            _context.Slice(delta._raw, 0, block, region.row_start, region.col_start, cols, walk=walk)
            for walk in ("core", "torch")
        ]
        assert np.array_equal(slices[0].held.counts, slices[1].held.counts)
        by_core, by_torch = (s.place(held) for s in slices)
        assert all(torch.equal(a, b) for a, b in zip(by_core, by_torch))
    for w, r in zip(writes, regions):
        assert w.context_sharded(0, r)
        w.add_region(0, r, held)
    for w in writes:
        w.commit()


def _expected(curr: torch.Tensor, region: Region) -> torch.Tensor:
    grid = curr.reshape(curr.shape[0], -1)
    block = grid[region.row_start : region.row_start + region.row_count]
    return block[:, region.col_start : region.col_start + region.col_count]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31),
    dtype=st.sampled_from(sorted(DTYPES)),
    rows=st.integers(1, 48),
    cols=st.integers(1, 80),
    lr=st.sampled_from([1e-4, 1e-3, 1e-2, 1e-1]),
    values=st.sampled_from(["diff", "abs"]),
    row_cuts=st.lists(st.integers(1, 47), max_size=3),
    col_cuts=st.lists(st.integers(1, 79), max_size=3),
    replicas=st.integers(0, 2),
    pad_rows=st.integers(0, 3),
)
def test_ranks_holding_blocks_write_exactly_their_part(
    seed, dtype, rows, cols, lr, values, row_cuts, col_cuts, replicas, pad_rows
):
    # F32's spacing is 2**16 times finer than BF16's: a step that changes part of a BF16 tensor changes all of it.
    prev, curr = _step(seed, (rows, cols), DTYPES[dtype], lr * (1e-5 if dtype == "f32" else 1.0))
    delta = ds.diff({"w": prev}, {"w": curr}, codec="context", values=values)
    if delta.tensors[0].positions != "context" or delta.num_changed == 0:
        return  # the writer chose another codec (smaller here), or nothing changed
    blocks = _blocks(rows, cols, [c for c in row_cuts if c < rows], [c for c in col_cuts if c < cols])
    if len(blocks) == 1:
        blocks = _blocks(rows, cols, [rows // 2] if rows > 1 else [], [] if rows > 1 else [cols // 2])
        if len(blocks) == 1:
            return  # a single element: no split
    blocks += blocks[:replicas]  # replicated blocks (vLLM's replicated KV heads) are placed by both holders
    regions = _regions(prev, blocks, pad_rows)
    _apply(delta, regions)
    for region in regions:
        got = region.param[region.param_row_offset :, : region.col_count]
        assert torch.equal(_bits(got), _bits(_expected(curr, region))), region
        assert (region.param[:pad_rows] == 7).all() and (region.param[:, region.col_count :] == 7).all()


def test_class_values_and_complemented_classes_across_column_splits():
    """A large tensor whose values are coded by class (rans_classes) and whose smallest class changes almost
    everywhere (its unchanged elements are listed), split by columns into uneven slices, as row-parallel layers."""
    prev, curr = _step(3, (96, 160), torch.bfloat16, 3e-3)
    delta = ds.diff({"w": prev}, {"w": curr}, codec="context")
    assert delta.tensors[0].positions == "context" and delta.tensors[0].values == "rans_classes"
    parts = _context.read_parts(delta._raw, 0)
    assert parts.complement.any(), "no class lists its unchanged elements"
    for cuts in ([80], [16, 50, 121], [1, 159]):
        regions = _regions(prev, _blocks(96, 160, [], cuts))
        _apply(delta, regions)
        for region in regions:
            assert torch.equal(_bits(region.param[:, : region.col_count]), _bits(_expected(curr, region)))


def _staged_error(delta: ds.Delta, regions: list[Region], held: list[Any], error: type, match: str) -> None:
    before = [r.param.clone() for r in regions]
    for region in regions:
        with pytest.raises(error, match=match):
            _write.Writes(delta._raw).add_region(0, region, held)
    assert all(torch.equal(r.param, b) for r, b in zip(regions, before)), "a refused placement wrote"


def _sparse(seed: int) -> tuple[torch.Tensor, torch.Tensor, ds.Delta]:
    prev, curr = _step(seed, (32, 48), torch.bfloat16, 3e-3)
    delta = ds.diff({"w": prev}, {"w": curr}, codec="context")
    assert delta.tensors[0].positions == "context"
    return prev, curr, delta


def test_refused_when_the_ranks_do_not_hold_every_element_once():
    prev, curr, delta = _sparse(1)
    regions = _regions(prev, _blocks(32, 48, [], [20]))
    held = [_write.Writes(delta._raw).context_held(0, r) for r in regions]
    _staged_error(delta, regions[:1], held[:1], ds.DeltaSyncError, "exactly once")  # half the columns missing
    overlapping = _regions(prev, [(0, 32, 0, 30), (0, 32, 20, 48)])
    held = [_write.Writes(delta._raw).context_held(0, r) for r in overlapping]
    _staged_error(delta, overlapping, held, ds.DeltaSyncError, "exactly once")
    with pytest.raises(ds.DeltaSyncError, match="not exchanged"):
        _write.Writes(delta._raw).add_region(0, regions[0])


def test_replicas_that_disagree_are_refused():
    prev, curr, delta = _sparse(2)
    regions = _regions(prev, [(0, 16, 0, 48), (16, 32, 0, 48), (16, 32, 0, 48)])
    regions[2].param[0, 0] = regions[2].param[0, 0] * 1024  # another binade: another class
    held = [_write.Writes(delta._raw).context_held(0, r) for r in regions]
    _staged_error(delta, regions, held, ds.BaseMismatchError, "bases differ")


def test_a_base_with_other_classes_is_refused_where_the_counts_show_it():
    """No rank can check the whole tensor's base identity. Where the ranks' bases put fewer elements in a class than
    the stream lists, or give another number of changes, the placement is refused before anything is written."""
    prev, curr, delta = _sparse(4)
    parts = _context.read_parts(delta._raw, 0)
    crowded = max(range(_context.CLASSES), key=lambda c: 0 if parts.complement[c] else len(parts.ranks[c]))
    assert len(parts.ranks[crowded]) > 0
    cls = _context.classes(_bits(prev), "BF16", parts.reference)
    wrong = prev.clone()
    # Every element of the most listed class moved 4 binades up: its class holds nothing now.
    wrong[cls == crowded] = wrong[cls == crowded] * 16
    # A reader holding no element of it (a vocabulary shard of no rows) refuses too: it wrote its other tensors
    # while the others refused (found by an adversarial helper).
    regions = _regions(wrong, _blocks(32, 48, [20], []) + [(32, 32, 0, 48)])
    held = [_write.Writes(delta._raw).context_held(0, r) for r in regions]
    _staged_error(delta, regions, held, ds.BaseMismatchError, "is this the delta's base")


@settings(max_examples=150, deadline=None)
@given(flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=3))
def test_flipped_bytes_are_refused_or_placed_like_the_whole_reader(flips):
    """A context delta with flipped bytes: what a load accepts, sharded readers place exactly as a reader of the
    whole tensor decodes it (or refuse it, every rank, with a DeltaSyncError, writing nothing)."""
    prev, curr, delta = _sparse(5)
    data = bytearray(delta.to_bytes())
    for at, mask in flips:
        data[at % len(data)] ^= mask
    try:
        loaded = ds.load(bytes(data))
        whole = {"w": prev.clone()}
        loaded.apply_(whole)
    except ds.DeltaSyncError:
        return
    if loaded.tensors[0].positions != "context" or loaded.tensors[0].shape != (32, 48):
        return
    regions = _regions(prev, _blocks(32, 48, [11], [30]))
    before = [r.param.clone() for r in regions]
    try:
        _apply(loaded, regions)
    except ds.DeltaSyncError:
        assert all(torch.equal(r.param, b) for r, b in zip(regions, before))
        raise AssertionError("a delta the whole reader applied was refused by the sharded readers") from None
    for region in regions:
        assert torch.equal(_bits(region.param[:, : region.col_count]), _bits(_expected(whole["w"], region)))


def test_counts_travel_in_the_smallest_type_that_holds_a_run():
    """What a rank sends: per run 16 counts, 2 bytes each for a column split of rows under 65,536 elements."""
    prev, curr, delta = _sparse(6)
    by_columns, by_rows = _regions(prev, [(0, 32, 0, 20)]), _regions(prev, [(0, 16, 0, 48)])
    held = _write.Writes(delta._raw).context_held(0, by_columns[0])
    assert held.counts.shape == (32, 16) and held.counts.dtype == np.uint8  # runs of 20 elements
    held = _write.Writes(delta._raw).context_held(0, by_rows[0])
    assert held.counts.shape == (1, 16) and held.counts.dtype == np.uint16  # one run of 768 elements
