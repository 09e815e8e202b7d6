"""Encode and decode+apply benchmarks on a synthetic Qwen3-0.6B-shaped bf16 state at 1% density.

Run as benchmarks (full scale):   pytest benches --benchmark-only --benchmark-columns=median,min,max,rounds
Run as quick tests (tiny scale):  pytest benches --benchmark-disable -q

Every benchmark checks its result outside the timed function: the deltas are applied to a fresh copy of ``prev`` and
compared bit-exactly (int16 views) with ``curr``; the TRL encoder's index count is compared with the true number of
changed elements. Nothing here asserts on timings.
"""

from __future__ import annotations

import json
import struct

import baselines
import numpy as np
import pytest
import safetensors
import torch

import deltasync_rs as ds

ENCODE_GROUP = "encode-0.6B-1%"
APPLY_GROUP = "apply-0.6B-1%"


# ---------------------------------------------------------------------------------------------------------- helpers


def safetensors_header(blob: bytes) -> dict:
    """The JSON header of safetensors bytes, after checking that the data section is exactly covered."""
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    data_len = len(blob) - 8 - n
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    assert max(ends, default=0) == data_len, "safetensors data section is not exactly covered by the header"
    return header


def assert_state_equals_curr(state: dict, workload) -> None:
    """Bit-exact comparison (int16 views) of every tensor of ``state`` with ``workload.curr``."""
    assert state.keys() == workload.curr.keys()
    bad = [
        name
        for name, want in workload.curr.items()
        if not torch.equal(state[name].view(torch.int16), want.view(torch.int16))
    ]
    assert not bad, f"{len(bad)} tensors differ from curr after apply, e.g. {bad[:3]}"


def common_info(benchmark, workload) -> None:
    benchmark.extra_info.update(
        scale=workload.scale,
        density=workload.density,
        num_elements=workload.num_elements,
        num_changed=workload.num_changed,
        deltasync_threads=ds.get_num_threads(),
        torch_threads=torch.get_num_threads(),
    )


def fresh_prev(workload):
    """A pedantic ``setup``: a new copy of ``prev`` every round (apply_ mutates its target)."""

    def setup():
        return (workload.clone_prev(),), {}

    return setup


# --------------------------------------------------------------------------------------------- session-wide inputs


@pytest.fixture(scope="session")
def deltasync_blobs(workload):
    """values -> bytes of our delta file (made outside any timing)."""
    cache: dict[str, bytes] = {}

    def get(values: str) -> bytes:
        if values not in cache:
            cache[values] = ds.diff(workload.prev, workload.curr, values=values).to_bytes()
        return cache[values]

    return get


@pytest.fixture(scope="session")
def trl_blob(workload) -> bytes:
    return baselines.trl_v1_encode(workload.prev, workload.curr)


# ---------------------------------------------------------------------------------------------------------- encode


@pytest.mark.benchmark(group=ENCODE_GROUP)
@pytest.mark.parametrize("values", ["diff", "abs"])
def test_encode_deltasync(benchmark, workload, pedantic_opts, values):
    def encode():
        delta = ds.diff(workload.prev, workload.curr, values=values)
        return delta, delta.to_bytes()

    delta, blob = benchmark.pedantic(encode, **pedantic_opts)

    assert delta.num_changed == workload.num_changed
    assert delta.num_elements == workload.num_elements
    header = safetensors_header(blob)
    assert "__metadata__" in header
    safetensors.deserialize(blob)  # the file parses with the safetensors library itself
    state = workload.clone_prev()
    ds.load(blob).apply_(state)
    assert_state_equals_curr(state, workload)
    del state

    common_info(benchmark, workload)
    benchmark.extra_info.update(
        file_bytes=len(blob), stream_bytes=delta.nbytes, bytes_per_changed=len(blob) / workload.num_changed
    )


@pytest.mark.benchmark(group=ENCODE_GROUP)
def test_encode_deltasync_as_trl_v1(benchmark, workload, pedantic_opts):
    """Our Rust encoder writing TRL's v1 layout (``values="abs"``, ``format="trl"``)."""

    def encode():
        return ds.diff(workload.prev, workload.curr, values="abs").to_bytes(format="trl")

    blob = benchmark.pedantic(encode, **pedantic_opts)

    meta = safetensors_header(blob)["__metadata__"]
    assert meta["format"] == "sparse_weight_patch" and meta["version"] == "1" and meta["sparse"] == "True"
    assert int(meta["total_changed_elements"]) == workload.num_changed
    state = workload.clone_prev()
    assert baselines.trl_v1_apply(blob, state) == workload.num_changed  # readable by the TRL-style reader
    assert_state_equals_curr(state, workload)
    del state

    common_info(benchmark, workload)
    benchmark.extra_info.update(file_bytes=len(blob), bytes_per_changed=len(blob) / workload.num_changed)


@pytest.mark.benchmark(group=ENCODE_GROUP)
def test_encode_trl_v1_torch(benchmark, workload, pedantic_opts):
    """The TRL-v1-style torch encoder (baselines.trl_v1_encode)."""
    blob = benchmark.pedantic(baselines.trl_v1_encode, args=(workload.prev, workload.curr), **pedantic_opts)

    header = safetensors_header(blob)
    meta = header["__metadata__"]
    assert meta["format"] == "sparse_weight_patch" and meta["sparse"] == "True"
    counts = {k[: -len(".indices")]: v["shape"][0] for k, v in header.items() if k.endswith(".indices")}
    assert sum(counts.values()) == workload.num_changed
    want = {n: c for n, c in zip(workload.names, workload.changed) if c}
    assert counts == want
    assert int(meta["total_changed_elements"]) == workload.num_changed

    common_info(benchmark, workload)
    benchmark.extra_info.update(file_bytes=len(blob), bytes_per_changed=len(blob) / workload.num_changed)


@pytest.mark.benchmark(group=ENCODE_GROUP)
@pytest.mark.parametrize("threads", [1, 2], ids=["1thread", "2threads"])
def test_read_floor(benchmark, workload, pedantic_opts, threads):
    """One numpy pass over both states (sum of uint64 words): a lower bound for any encoder. ``1thread`` is the
    floor docs/benchmarks.md measures encoders against; ``2threads`` splits the same pass over two threads."""
    got = benchmark.pedantic(
        baselines.read_floor, args=(workload.prev, workload.curr), kwargs={"threads": threads}, **pedantic_opts
    )

    with np.errstate(over="ignore"):
        want = int(
            np.add.reduce(workload.prev_flat.view(np.uint64), dtype=np.uint64)
            + np.add.reduce(workload.curr_flat.view(np.uint64), dtype=np.uint64)
        )
    assert got == want

    common_info(benchmark, workload)
    benchmark.extra_info.update(bytes_read=2 * workload.nbytes, floor_threads=threads)


# ---------------------------------------------------------------------------------------------------- decode+apply


@pytest.mark.benchmark(group=APPLY_GROUP)
@pytest.mark.parametrize("values", ["diff", "abs"])
def test_apply_deltasync(benchmark, workload, pedantic_opts, deltasync_blobs, values):
    """ds.load(bytes) + apply_ onto a fresh CPU torch copy of prev (the copy is made in setup, not timed)."""
    blob = deltasync_blobs(values)

    def apply(state):
        ds.load(blob).apply_(state)
        return state

    state = benchmark.pedantic(apply, setup=fresh_prev(workload), **pedantic_opts)

    assert_state_equals_curr(state, workload)
    del state
    common_info(benchmark, workload)
    benchmark.extra_info.update(file_bytes=len(blob), bytes_per_changed=len(blob) / workload.num_changed)


@pytest.mark.benchmark(group=APPLY_GROUP)
def test_apply_deltasync_checking_base(benchmark, workload, pedantic_opts, deltasync_blobs):
    """ds.load(bytes) + apply_(check_base=True): the base identity of every touched tensor is checked first."""
    blob = deltasync_blobs("diff")

    def apply(state):
        ds.load(blob).apply_(state, check_base=True)
        return state

    state = benchmark.pedantic(apply, setup=fresh_prev(workload), **pedantic_opts)

    assert_state_equals_curr(state, workload)
    del state
    common_info(benchmark, workload)
    benchmark.extra_info.update(file_bytes=len(blob), bytes_per_changed=len(blob) / workload.num_changed)


@pytest.mark.benchmark(group=APPLY_GROUP)
def test_apply_deltasync_reading_trl_v1(benchmark, workload, pedantic_opts, trl_blob):
    """Our loader on the TRL-style file: ds.load(trl bytes) + apply_."""

    def apply(state):
        ds.load(trl_blob).apply_(state)
        return state

    state = benchmark.pedantic(apply, setup=fresh_prev(workload), **pedantic_opts)

    assert_state_equals_curr(state, workload)
    del state
    common_info(benchmark, workload)
    benchmark.extra_info.update(file_bytes=len(trl_blob), bytes_per_changed=len(trl_blob) / workload.num_changed)


@pytest.mark.benchmark(group=APPLY_GROUP)
def test_apply_trl_v1_torch(benchmark, workload, pedantic_opts, trl_blob):
    """TRL v1 path: safetensors.torch.load + per-tensor flat.index_put_((indices.long(),), values)."""

    def apply(state):
        written = baselines.trl_v1_apply(trl_blob, state)
        return state, written

    state, written = benchmark.pedantic(apply, setup=fresh_prev(workload), **pedantic_opts)

    assert written == workload.num_changed
    assert_state_equals_curr(state, workload)
    del state
    common_info(benchmark, workload)
    benchmark.extra_info.update(file_bytes=len(trl_blob), bytes_per_changed=len(trl_blob) / workload.num_changed)


@pytest.mark.benchmark(group=APPLY_GROUP)
def test_apply_scatter_floor(benchmark, workload, pedantic_opts, trl_blob):
    """index_put_ from positions already decoded to int64 tensors (decoding is not timed)."""
    decoded = baselines.trl_v1_decode_positions(trl_blob)

    def apply(state):
        return state, baselines.scatter_apply(decoded, state)

    state, written = benchmark.pedantic(apply, setup=fresh_prev(workload), **pedantic_opts)

    assert written == workload.num_changed
    assert_state_equals_curr(state, workload)
    del state
    common_info(benchmark, workload)
