"""`apply_(..., check_base=True)` on CPU targets: the core hashes each tensor of differences while it writes it
(core::apply::apply_checked) and takes every written change back when any target is not its base. Whatever the
codec, the value kind, and wherever a target differs from its base, the result is all or nothing: the new state,
or BaseMismatchError naming the tensor with every target bit for bit as it was."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import deltasync_rs as ds

BLOCK = 1 << 18  # bytes per base identity block (docs/format.md §3.1)


def _states(seed: int, sizes: list[int], density: float) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    old, new = {}, {}
    for i, size in enumerate(sizes):
        dtype = (np.uint16, np.uint32, np.uint8)[i % 3]
        info = np.iinfo(dtype)
        a = rng.integers(0, info.max, size, dtype=dtype, endpoint=True)
        b = a.copy()
        if size:
            mask = rng.random(size) < density
            mask[rng.integers(0, size)] = True  # at least one change
            b[mask] += rng.integers(1, 4, int(mask.sum()), dtype=dtype)  # wraps at the top
        old[f"t{i}"], new[f"t{i}"] = a, b
    return old, new


def _copy(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: a.copy() for name, a in state.items()}


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return all(np.array_equal(a[name], b[name]) for name in a)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    sizes=st.lists(st.sampled_from([1, 7, 1000, BLOCK // 2 + 3, BLOCK + 1, 3 * BLOCK // 2]), min_size=1, max_size=5),
    density=st.sampled_from([0.001, 0.05, 0.6, 1.0]),
    codec=st.sampled_from(["varint", "compact", "context"]),
    values=st.sampled_from(["diff", "abs"]),
    data=st.data(),
)
def test_all_or_nothing_wherever_a_target_differs(seed, sizes, density, codec, values, data):
    old, new = _states(seed, sizes, density)
    delta = ds.diff(old, new, codec=codec, values=values)
    state = _copy(old)
    delta.apply_(state, check_base=True)
    assert _same(state, new)
    # One element of one target differs from the base: before, among or after the changes.
    bad = _copy(old)
    name = data.draw(st.sampled_from(sorted(bad)))
    at = data.draw(st.integers(0, bad[name].size - 1))
    bad[name][at] ^= 1
    before = _copy(bad)
    stored_whole = {t[0] for t in delta._raw.tensors() if delta.base_identity(delta.names.index(t[0])) is None}
    if name in stored_whole:
        delta.apply_(bad, check_base=True)  # a tensor stored whole applies to any base
        assert _same(bad, new)
        return
    with pytest.raises(ds.BaseMismatchError, match=repr(name).replace("'", '"')):
        delta.apply_(bad, check_base=True)
    assert _same(bad, before), "a refused delta left a target changed"


def test_a_delta_applied_twice_is_refused_and_taken_back():
    old, new = _states(1, [3 * BLOCK + 11, 5000, 40], 0.01)
    delta = ds.diff(old, new)
    state = _copy(old)
    delta.apply_(state, check_base=True)
    with pytest.raises(ds.BaseMismatchError, match="applied already"):
        delta.apply_(state, check_base=True)
    assert _same(state, new)


def test_the_last_block_is_checked_after_the_last_change():
    old = {"t0": np.random.default_rng(2).integers(0, 2**16, 4 * BLOCK // 2, dtype=np.uint16)}
    new = _copy(old)
    new["t0"][0] += 1  # the only change is in the first block
    delta = ds.diff(old, new)
    bad = _copy(old)
    bad["t0"][-1] ^= 1  # the base differs in the last block only, far past every change
    with pytest.raises(ds.BaseMismatchError):
        delta.apply_(bad, check_base=True)
    assert bad["t0"][0] == old["t0"][0] and bad["t0"][-1] == old["t0"][-1] ^ 1


def test_without_the_check_a_wrong_base_is_written():
    old, new = _states(3, [BLOCK + 5], 0.01)
    delta = ds.diff(old, new)
    bad = _copy(old)
    bad["t0"][3] ^= 1
    delta.apply_(bad)  # check_base=False: written as asked, no hashing
    assert not _same(bad, old)


def test_torch_targets_and_staged_targets_share_the_verdict():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(4)
    old = {"t0": torch.randn(BLOCK + 9, generator=g).bfloat16(), "t1": torch.randn(300, generator=g).bfloat16()}
    new = {name: t.clone() for name, t in old.items()}
    for t in new.values():
        t.view(torch.int16)[::50] += 1
    delta = ds.diff(old, new)
    # t0 is written by the core (contiguous), t1 through a strided view (staged, checked before anything is written).
    t0 = old["t0"].clone()
    strided = torch.zeros(600, dtype=torch.bfloat16)[::2]
    strided.copy_(old["t1"])
    target = {"t0": t0, "t1": strided}
    strided.view(torch.int16)[5] ^= 1  # the staged target is not its base: refused before the core writes t0
    with pytest.raises(ds.BaseMismatchError, match='"t1"'):
        delta.apply_(target, check_base=True)
    assert torch.equal(t0.view(torch.int16), old["t0"].view(torch.int16))
    strided.view(torch.int16)[5] ^= 1
    t0.view(torch.int16)[7] ^= 1  # now the core's target is not its base: t0 taken back, t1 never written
    before = t0.clone()
    with pytest.raises(ds.BaseMismatchError, match='"t0"'):
        delta.apply_(target, check_base=True)
    assert torch.equal(t0.view(torch.int16), before.view(torch.int16))
    assert torch.equal(strided.view(torch.int16), old["t1"].view(torch.int16))
    t0.view(torch.int16)[7] ^= 1
    delta.apply_(target, check_base=True)
    assert all(torch.equal(target[n].view(torch.int16), new[n].view(torch.int16)) for n in new)
