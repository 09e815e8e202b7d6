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


def _publish(folder, steps):
    with ds.Publisher(ds.LocalStore(folder), anchor_every=100) as publisher:
        for step, state in enumerate(steps):
            publisher.publish(step, state)


def test_a_pull_hashes_in_passing_what_it_writes_and_reads_only_the_rest(tmp_path, monkeypatch, caplog):
    import deltasync_rs.delta as delta_module

    rng = np.random.default_rng(5)
    s0 = {f"t{i}": rng.integers(0, 2**16, BLOCK + 17 * i, dtype=np.uint16) for i in range(4)}
    s1 = _copy(s0)
    s1["t0"][::97] += 1
    s1["t1"][5] += 3
    s2 = _copy(s1)
    s2["t1"][9] += 1
    s2["t2"][:] = rng.integers(0, 2**16, s2["t2"].size, dtype=np.uint16)  # stored whole: not hashed in passing
    _publish(tmp_path / "store", [s0, s1, s2])
    subscriber = ds.Subscriber(ds.LocalStore(tmp_path / "store", create=False))
    assert subscriber.fetch(1)[0].tensors[2].positions == "all"  # t2 really is stored whole at step 2
    state = _copy(s0)
    subscriber.pull(state, until=0)
    read: list[str] = []
    real = delta_module._tensor_hashes

    def counting(entries):
        read.extend(entry[0] for entry in entries)
        return real(entries)

    monkeypatch.setattr(delta_module, "_tensor_hashes", counting)
    with caplog.at_level("WARNING", logger="deltasync_rs"):
        assert subscriber.pull(state) == 2
    assert _same(state, s2)
    assert not [r for r in caplog.records if "mismatch" in r.getMessage()], "the digest check must pass first time"
    # t0 and t1 were hashed as they were written; t2 was written whole and t3 not at all: read for the digest.
    assert sorted(read) == ["t2", "t3"]


def test_a_hash_made_in_passing_is_dropped_when_a_later_delta_writes_the_tensor_again(tmp_path, caplog):
    rng = np.random.default_rng(6)
    s0 = {"a": rng.integers(0, 2**16, BLOCK, dtype=np.uint16), "b": rng.integers(0, 2**16, 64, dtype=np.uint16)}
    s1 = _copy(s0)
    s1["a"][3] += 1  # a few differences: hashed in passing
    s2 = _copy(s1)
    s2["a"][:] = rng.integers(0, 2**16, s2["a"].size, dtype=np.uint16)  # then stored whole: the first hash is stale
    _publish(tmp_path / "store", [s0, s1, s2])
    subscriber = ds.Subscriber(ds.LocalStore(tmp_path / "store", create=False))
    state = _copy(s0)
    subscriber.pull(state, until=0)
    with caplog.at_level("WARNING", logger="deltasync_rs"):
        assert subscriber.pull(state) == 2
    assert _same(state, s2)
    assert not [r for r in caplog.records if "mismatch" in r.getMessage()]


def test_a_digest_made_in_passing_is_still_checked(tmp_path):
    import json

    rng = np.random.default_rng(7)
    s0 = {"a": rng.integers(0, 2**16, BLOCK, dtype=np.uint16), "b": rng.integers(0, 2**16, 64, dtype=np.uint16)}
    s1 = _copy(s0)
    s1["a"][3] += 1
    _publish(tmp_path / "store", [s0, s1])
    # The entry (unsigned store) now names another state: the state the pull builds, hashed in passing, must not
    # match it.
    entry_path = tmp_path / "store" / "manifest" / "step_000000000001.json"
    entry = json.loads(entry_path.read_text())
    entry["state_digest"] = "0" * 32
    entry_path.write_text(json.dumps(entry))
    subscriber = ds.Subscriber(ds.LocalStore(tmp_path / "store", create=False))
    state = _copy(s0)
    subscriber.pull(state, until=0)
    with pytest.raises(ds.IntegrityError, match="state digest at step 1"):
        subscriber.pull(state)


def test_a_context_tensor_with_a_wrong_base_refuses_the_whole_delta():
    """A delta of `context` tensors beside tensors of rice positions: the context tensors' bases are checked when
    their positions are decoded, which must come before any tensor is written."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(8)
    magnitudes = torch.rand(256, 256, generator=g) * 2.0 ** -torch.randint(0, 14, (256, 256), generator=g).float()
    prev = {
        "a_context": (magnitudes * torch.sign(torch.randn(256, 256, generator=g))).bfloat16(),
        "b_uniform": torch.randn(BLOCK, generator=g).bfloat16(),
    }
    curr = {name: t.clone() for name, t in prev.items()}
    curr["a_context"] = (prev["a_context"].float() + 3e-5 * torch.sign(torch.randn(256, 256, generator=g))).bfloat16()
    curr["b_uniform"].view(torch.int16)[::89] += 1
    delta = ds.diff(prev, curr, codec="context")
    kinds = {t.name: t.positions for t in delta.tensors}
    assert kinds["a_context"] == "context" and kinds["b_uniform"] != "context", kinds
    for wrong in ("a_context", "b_uniform"):
        target = {name: t.clone() for name, t in prev.items()}
        target[wrong].view(torch.int16).view(-1)[100] ^= 1
        before = {name: t.clone() for name, t in target.items()}
        with pytest.raises(ds.BaseMismatchError, match=wrong):
            delta.apply_(target, check_base=True)
        for name in target:
            assert torch.equal(target[name].view(torch.int16), before[name].view(torch.int16)), (wrong, name)
    target = {name: t.clone() for name, t in prev.items()}
    delta.apply_(target, check_base=True)
    assert all(torch.equal(target[n].view(torch.int16), curr[n].view(torch.int16)) for n in curr)
