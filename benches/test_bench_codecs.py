"""The codec comparison across densities: for each density (0.25% to 5%), deltasync's two codecs and the peers.

Run as benchmarks (full scale):   pytest benches --benchmark-only --benchmark-json=out.json
                                  then `python benches/report.py out.json` for the tables of docs/benchmarks.md
Run as quick tests (tiny scale):  pytest benches --benchmark-disable -q

Groups are ``encode-<density>`` and ``apply-<density>``. Every benchmark records ``bytes_per_changed`` (whole file
bytes over changed elements) in its extra_info, and checks its result outside the timed function: every file is
applied to a fresh copy of ``prev`` and compared bit-exactly with ``curr``. Nothing here asserts on timings.

* encode: deltasync ``diff`` + ``to_bytes`` per codec on 1 and 2 threads (``ds.set_num_threads``); the TRL v1 and
  v3 (gap_delta) torch encoders; the grail-like gap + u8/u16 + zstd-1 encoder; the read floor on 1 and 2 threads.
* apply (decode + apply onto a CPU torch state, copied fresh in an untimed setup): ``ds.load(bytes).apply_`` per
  codec; each peer's own decode + ``index_put_``; the scatter floor (``index_put_`` from decoded int64 positions).
"""

from __future__ import annotations

import gc
import os

import baselines
import numpy as np
import pytest
import torch
import workload as _workload

import deltasync_rs as ds

DENSITIES = [0.0025, 0.005, 0.01, 0.02, 0.05]
CODECS = ["varint", "compact"]
PEERS = {
    "trl_v1": (baselines.trl_v1_encode, baselines.trl_v1_apply),
    "trl_v3_gap_delta": (baselines.trl_v3_encode, baselines.trl_v3_apply),
    "grail_like_zstd1": (baselines.grail_like_encode, baselines.grail_like_apply),
}


def _density_id(density: float) -> str:
    return f"{density * 100:g}%"


@pytest.fixture(scope="module", params=DENSITIES, ids=_density_id)
def sweep(request, bench_scale):
    """The workload at one density; module-scoped and parametrized, so pytest keeps one density in memory at a time."""
    seed = int(os.environ.get("DELTASYNC_BENCH_SEED", "0"))
    w = _workload.load_workload(bench_scale, request.param, seed)
    assert w.num_changed > 0
    yield w
    del w
    gc.collect()


@pytest.fixture(scope="module")
def files(sweep):
    """(kind, density) -> file bytes, made outside any timing and kept for the apply benchmarks."""
    cache: dict = {}

    def get(kind: str) -> bytes:
        key = (kind, sweep.density)
        if key not in cache:
            cache.clear()  # one density at a time
            if kind in CODECS:
                cache[key] = ds.diff(sweep.prev, sweep.curr, codec=kind).to_bytes()
            else:
                cache[key] = PEERS[kind][0](sweep.prev, sweep.curr)
        return cache[key]

    return get


def _info(benchmark, w, blob: bytes | None = None, **extra) -> None:
    benchmark.extra_info.update(
        scale=w.scale,
        density=w.density,
        num_elements=w.num_elements,
        num_changed=w.num_changed,
        torch_threads=torch.get_num_threads(),
        **extra,
    )
    if blob is not None:
        benchmark.extra_info.update(file_bytes=len(blob), bytes_per_changed=len(blob) / w.num_changed)


def _assert_equals_curr(state: dict, w) -> None:
    assert state.keys() == w.curr.keys()
    bad = [n for n, want in w.curr.items() if not torch.equal(state[n].view(torch.int16), want.view(torch.int16))]
    assert not bad, f"{len(bad)} tensors differ from curr, e.g. {bad[:3]}"


def _assert_applies(w, apply) -> None:
    state = w.clone_prev()
    apply(state)
    _assert_equals_curr(state, w)


def _fresh_prev(w):
    def setup():
        return (w.clone_prev(),), {}

    return setup


@pytest.fixture
def threads(request):
    ds.set_num_threads(request.param)
    yield request.param
    ds.set_num_threads(0)  # back to DELTASYNC_NUM_THREADS or the CPU count


# ---------------------------------------------------------------------------------------------------------- encode


@pytest.mark.parametrize("threads", [1, 2], ids=["1thread", "2threads"], indirect=True)
@pytest.mark.parametrize("codec", CODECS)
def test_encode(benchmark, sweep, pedantic_opts, codec, threads):
    benchmark.group = f"encode-{_density_id(sweep.density)}"

    def encode():
        return ds.diff(sweep.prev, sweep.curr, codec=codec).to_bytes()

    blob = benchmark.pedantic(encode, **pedantic_opts)

    _assert_applies(sweep, lambda state: ds.load(blob).apply_(state))
    _info(benchmark, sweep, blob, codec=codec, deltasync_threads=threads)


@pytest.mark.parametrize("peer", list(PEERS))
def test_encode_peer(benchmark, sweep, pedantic_opts, peer):
    benchmark.group = f"encode-{_density_id(sweep.density)}"
    encode, apply = PEERS[peer]
    blob = benchmark.pedantic(encode, args=(sweep.prev, sweep.curr), **pedantic_opts)

    _assert_applies(sweep, lambda state: apply(blob, state))
    _info(benchmark, sweep, blob, peer=peer)


@pytest.mark.parametrize("floor_threads", [1, 2], ids=["1thread", "2threads"])
def test_encode_read_floor(benchmark, sweep, pedantic_opts, floor_threads):
    benchmark.group = f"encode-{_density_id(sweep.density)}"
    got = benchmark.pedantic(
        baselines.read_floor, args=(sweep.prev, sweep.curr), kwargs={"threads": floor_threads}, **pedantic_opts
    )
    with np.errstate(over="ignore"):
        want = int(
            np.add.reduce(sweep.prev_flat.view(np.uint64), dtype=np.uint64)
            + np.add.reduce(sweep.curr_flat.view(np.uint64), dtype=np.uint64)
        )
    assert got == want
    _info(benchmark, sweep, floor_threads=floor_threads)


# ---------------------------------------------------------------------------------------------------- decode+apply


@pytest.mark.parametrize("codec, check", [(codec, "load") for codec in CODECS] + [("compact", "apply")])
def test_apply(benchmark, sweep, pedantic_opts, files, codec, check):
    """``check="apply"``: the streams checked as they are applied (what ``Subscriber.pull`` does), not at load."""
    benchmark.group = f"apply-{_density_id(sweep.density)}"
    blob = files(codec)

    def apply(state):
        ds.load(blob, check=check).apply_(state)
        return state

    state = benchmark.pedantic(apply, setup=_fresh_prev(sweep), **pedantic_opts)

    _assert_equals_curr(state, sweep)
    del state
    _info(benchmark, sweep, blob, codec=codec, check=check, deltasync_threads=ds.get_num_threads())


@pytest.mark.parametrize("peer", list(PEERS))
def test_apply_peer(benchmark, sweep, pedantic_opts, files, peer):
    benchmark.group = f"apply-{_density_id(sweep.density)}"
    blob = files(peer)
    apply_peer = PEERS[peer][1]

    def apply(state):
        return state, apply_peer(blob, state)

    state, written = benchmark.pedantic(apply, setup=_fresh_prev(sweep), **pedantic_opts)

    assert written == sweep.num_changed
    _assert_equals_curr(state, sweep)
    del state
    _info(benchmark, sweep, blob, peer=peer)


def test_apply_scatter_floor(benchmark, sweep, pedantic_opts, files):
    benchmark.group = f"apply-{_density_id(sweep.density)}"
    decoded = baselines.trl_v1_decode_positions(files("trl_v1"))

    def apply(state):
        return state, baselines.scatter_apply(decoded, state)

    state, written = benchmark.pedantic(apply, setup=_fresh_prev(sweep), **pedantic_opts)

    assert written == sweep.num_changed
    _assert_equals_curr(state, sweep)
    del state
    _info(benchmark, sweep)
