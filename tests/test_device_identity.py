"""Base identities and `context` placement computed by torch ops on a target's own device (deltasync_rs._identity,
_write._context_on_device), so that a CUDA target's base is never copied to the host. These machines have no GPU:
the torch ops run on CPU tensors here, and the staged (non-core) apply path is sent down the device branch by
treating every torch tensor as one on a device. The ops are the same integer ops on any device."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deltasync_rs as ds
from deltasync_rs import _arrays, _identity, _write
from deltasync_rs._core import base_identity
from tests.test_context import _bits, _equal, _state

BLOCK = _identity.BLOCK_BYTES


@pytest.fixture(autouse=True)
def torch_path_on_cpu(monkeypatch):
    """The device path for CPU tensors too, whatever their size."""
    monkeypatch.setattr(_identity, "TORCH_ON_CPU", True)
    monkeypatch.setattr(_identity, "HOST_BELOW", 0)
    monkeypatch.setattr(_identity, "STATE_HOST_BELOW", 0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    blocks=st.integers(0, 3),
    tail=st.one_of(st.integers(0, 300), st.integers(0, BLOCK - 1), st.sampled_from([240, 241, 1023, 1024, 1025])),
    offset=st.integers(0, 9),
    seed=st.integers(0, 2**31),
)
def test_identity_on_the_device_equals_the_cores(blocks, tail, offset, seed):
    """Every length (whole blocks, tails short and long, XXH3's 240-byte boundary) and every start alignment."""
    n = blocks * BLOCK + tail
    data = np.random.default_rng(seed).integers(0, 256, n + offset, dtype=np.uint8)
    tensor = torch.from_numpy(data)[offset:]  # a view starting anywhere in its storage
    assert _identity.base_identity(tensor) == base_identity(data[offset:])


def test_identities_of_many_tensors_in_one_run_of_the_rounds(monkeypatch):
    """Tensors of several sizes hashed together equal each hashed alone, and the core's; small ones go to the host."""
    rng = np.random.default_rng(3)
    sizes = [BLOCK * 2, 100, BLOCK * 3 + 17, BLOCK - 1, BLOCK + 2 * 1024, 0]
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    tensors = [torch.from_numpy(a) for a in arrays]
    expected = [base_identity(a) for a in arrays]
    assert _identity.base_identities(tensors) == expected
    monkeypatch.setattr(_identity, "HOST_BELOW", 2 * BLOCK)
    rounds = []
    real = _identity._hash_rounds
    monkeypatch.setattr(_identity, "_hash_rounds", lambda sums: rounds.append(sums.shape[0]) or real(sums))
    assert _identity.base_identities(tensors) == expected
    assert rounds == [5]  # the two tensors from 2 blocks on, 2 + 3 whole blocks, in one run


def test_identity_of_a_strided_tensor_is_that_of_its_row_major_bytes():
    t = torch.randint(-(2**15), 2**15, (700, 600), dtype=torch.int16).view(torch.bfloat16)
    # Transposed; and every other column, whose flat view keeps a stride of 2 elements (reshape does not copy it).
    for view in (t.T, t[:, ::2]):
        want = base_identity(view.contiguous().view(torch.uint8).numpy().reshape(-1))
        assert _identity.base_identity(view) == want
        assert _identity.state_hashes({"t": view}) == {"t": _host_hash(view)}
    # One element or none with a stride of more than one (torch calls them contiguous and keeps the stride): the
    # view as bytes raised torch's RuntimeError, after a pull had written the state (found by an adversarial helper).
    for view in (t.reshape(-1)[::2][:1], t.T[:1, :1], t[:1, ::600], t.reshape(-1)[::2][:0], t.reshape(-1)[3]):
        want = base_identity(_row_major_bytes(view))
        assert _identity.base_identity(view) == want
        assert _identity.state_hashes({"t": view}) == {"t": _host_hash(view)}


def test_identity_detects_one_changed_bit_in_any_block():
    t = torch.randint(-(2**15), 2**15, (3 * BLOCK // 2 + 77,), dtype=torch.int16)
    before = _identity.base_identity(t)
    for element in (0, BLOCK // 2 - 1, BLOCK // 2 + 5, t.numel() - 1):
        flipped = t.clone()
        flipped[element] ^= 1 << 7
        assert _identity.base_identity(flipped) != before


@pytest.fixture
def on_device(monkeypatch):
    """Every torch tensor counts as one on a device; the calls of the device identity are recorded."""
    calls: list[list[int]] = []
    real = _identity.base_identities

    def recording(tensors):
        calls.append(sorted(t.numel() for t in tensors))
        return real(tensors)

    monkeypatch.setattr(_write, "_on_device", lambda x: isinstance(x, torch.Tensor))
    monkeypatch.setattr(_identity, "base_identities", recording)
    return calls


@pytest.mark.parametrize("check_base", [False, True])
def test_context_applies_on_the_device_bit_exactly(on_device, check_base, monkeypatch):
    prev, curr = _state(11)
    delta = ds.load(ds.diff(prev, curr, codec="context").to_bytes())
    assert {t.positions for t in delta.tensors} == {"context"}
    target = {k: v.clone().T.contiguous().T if v.dim() == 2 else v.clone() for k, v in prev.items()}
    target["w2"] = target["w2"].permute(2, 1, 0).contiguous().permute(2, 1, 0)
    assert not any(t.is_contiguous() for t in (target["w0"], target["w2"]))
    copied = []
    real_host_bytes = _arrays.host_bytes

    def recording_host_bytes(x):
        copied.append(x.numel() if isinstance(x, torch.Tensor) else x.size)
        return real_host_bytes(x)

    monkeypatch.setattr(_arrays, "host_bytes", recording_host_bytes)
    delta.apply_(target, check_base=check_base)
    monkeypatch.setattr(_arrays, "host_bytes", real_host_bytes)
    assert _equal(target, curr)
    # Neither staged tensor was copied to the host (for its identity, its classes or its decode).
    assert not {prev["w0"].numel(), prev["w2"].numel()} & set(copied), copied
    # The two staged tensors' identities were taken on the device, together, once (their decode does not again).
    assert on_device == [sorted([prev["w0"].numel(), prev["w2"].numel()])]


@pytest.mark.parametrize("codec", ["varint", "compact", "context"])
@pytest.mark.parametrize("values", ["diff", "abs"])
def test_contiguous_targets_on_the_device_take_torchs_index_writes_bit_exactly(on_device, monkeypatch, codec, values):
    """Every target on a GPU is written by torch's index_copy_ (the core writes host memory only); on the CPU a
    contiguous target went to the core even with _on_device forced, so that branch ran for strided targets alone
    (found by an adversarial helper). Forced here too: the same bits as the host's apply, with the base check."""
    prev, curr = _state(15)
    delta = ds.load(ds.diff(prev, curr, codec=codec, values=values).to_bytes())
    host = {k: v.clone() for k, v in prev.items()}
    delta.apply_(host, check_base=True)
    monkeypatch.setattr(_write.Writes, "_writable_in_core", staticmethod(lambda target: False))
    device = {k: v.clone() for k, v in prev.items()}
    assert all(t.is_contiguous() for t in device.values())
    delta.apply_(device, check_base=True)
    assert _equal(device, host) and _equal(host, curr)


def test_a_wrong_base_on_the_device_is_refused_and_nothing_is_written(on_device):
    prev, curr = _state(12)
    delta = ds.load(ds.diff(prev, curr, codec="context").to_bytes())
    target = {k: v.clone().T.contiguous().T if v.dim() == 2 else v.clone() for k, v in prev.items()}
    target["w0"][3, 4] = 5.0
    before = {k: v.clone() for k, v in target.items()}
    with pytest.raises(ds.BaseMismatchError, match='"w0".*not the base'):
        delta.apply_(target)
    assert _equal(target, before)


def test_compact_base_check_on_the_device(on_device):
    """check_base on a device target of any codec hashes it there, without copying it to the host."""
    prev, curr = _state(13)
    delta = ds.load(ds.diff(prev, curr).to_bytes())
    target = {k: v.clone().T.contiguous().T if v.dim() == 2 else v.clone() for k, v in prev.items()}
    delta.apply_(target, check_base=True)
    assert _equal(target, curr)
    assert prev["w0"].numel() in on_device[0]
    with pytest.raises(ds.BaseMismatchError, match="w0"):
        delta.apply_(target, check_base=True)  # applied already
    assert _equal(target, curr)


def test_decoded_against_a_device_base_equals_the_hosts(on_device):
    prev, curr = _state(14)
    delta = ds.load(ds.diff(prev, curr, codec="context").to_bytes())
    for index, name in enumerate(prev):
        host_positions, host_values = _write.decode(delta._raw, index, base=_bits(prev[name]).numpy())
        positions, values = _write.decode(delta._raw, index, base=prev[name])
        assert torch.equal(positions, host_positions) and torch.equal(values, host_values)
    with pytest.raises(ds.BaseMismatchError):
        _write.decode(delta._raw, 0, base=curr["w0"])


# --- state-digest hashes on the device -----------------------------------------------------------------------------


def _row_major_bytes(tensor) -> np.ndarray:
    """By numpy through an integer view of the same width (any strides; torch's views as bytes refuse some)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return np.ascontiguousarray(tensor.reshape(-1).view(ints).numpy()).view(np.uint8)


def _host_hash(tensor):
    from deltasync_rs._core import tensor_hashes

    dtype, shape = _arrays.describe(tensor, "t")
    return bytes(tensor_hashes([("t", dtype, list(shape), _row_major_bytes(tensor))])[0])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    numel=st.one_of(st.integers(2048, 9000), st.sampled_from([4096, 4097, 8192, 70_001])),
    rank=st.sampled_from([1, 2, 7, 60, 130]),
    dtype=st.sampled_from([torch.uint8, torch.bfloat16, torch.float32, torch.int64]),
    offset=st.integers(0, 9),
    seed=st.integers(0, 2**31),
)
def test_state_hashes_on_the_device_equal_the_cores(numel, rank, dtype, offset, seed):
    """Every prefix length (rank 7: over one stripe; rank 130: over one round), element width, length and start
    alignment: the rounds summed by torch ops and chained by the core give the hash made from the bytes."""
    width = torch.empty(0, dtype=dtype).element_size()
    data = np.random.default_rng(seed).integers(0, 256, (numel + offset) * width, dtype=np.uint8)
    flat = torch.from_numpy(data).view(dtype)[offset:]  # a view starting anywhere in its storage
    tensor = flat.view([1] * (rank - 1) + [numel])
    assert _identity.state_hashes({"t": tensor}) == {"t": _host_hash(tensor)}


def test_a_device_state_digest_sends_only_round_sums_and_edges_to_the_host(monkeypatch):
    """``ds.state_digest`` of tensors on a device: each large one through its round sums (the bytes that cross are
    its first and last KiB or so), a strided one too; the digest is the specification's."""
    from deltasync_rs import _core
    from deltasync_rs import delta as delta_module
    from tests.test_digest import reference_digest

    g = torch.Generator().manual_seed(5)
    state = {
        "big": torch.randn(300, 257, generator=g).bfloat16(),
        "strided": torch.randn(64, 1000, generator=g)[:, ::2],
        "small": torch.randn(10, generator=g),
    }
    calls = []
    real = _core.tensor_hash_from_rounds

    def recording(dtype, shape, head, rounds, tail, last):
        calls.append((len(head) + len(tail) + len(last), rounds.nbytes // 64))
        return real(dtype, shape, head, rounds, tail, last)

    monkeypatch.setattr(_core, "tensor_hash_from_rounds", recording)
    monkeypatch.setattr(delta_module, "_tensor_hashes", lambda entries: pytest.fail(f"hashed on the host: {entries}"))
    assert ds.state_digest(state) == reference_digest(state)
    assert len(calls) == 2  # the small tensor is copied to the host whole, by _identity
    for edges, rounds in calls:
        assert edges <= 2 * 1024 + 64 and rounds >= 60


def test_a_pull_onto_device_tensors_checks_the_digest_there(tmp_path, monkeypatch):
    """A subscriber's state on a device: the digest after each pull is made on the device (the tensors no delta
    wrote, and those the staged apply wrote), and a replica that drifted is still caught by it and re-synced."""
    from deltasync_rs import delta as delta_module

    g = torch.Generator().manual_seed(8)
    state = {"a": torch.randn(300, 40, generator=g).bfloat16(), "b": torch.randn(5000, generator=g).bfloat16()}
    monkeypatch.setattr(_write, "_on_device", lambda x: _arrays.is_torch(x))
    monkeypatch.setattr(delta_module, "_tensor_hashes", lambda entries: pytest.fail(f"hashed on the host: {entries}"))
    store = ds.LocalStore(tmp_path)
    replica = {name: torch.zeros_like(t) for name, t in state.items()}
    subscriber = ds.Subscriber(store, check_base=False)
    with ds.Publisher(store, anchor_every=100, background=False) as publisher:
        publisher.publish(0, state)
        assert subscriber.pull(replica) == 0
        state["a"].view(torch.int16).view(-1)[::97] += 1  # "b" stays as it was
        publisher.publish(1, state)
        assert subscriber.pull(replica) == 1
        replica["b"].view(torch.int16)[3] += 1  # drifts where no delta writes
        state["a"].view(torch.int16).view(-1)[::89] += 1
        publisher.publish(2, state)
        assert subscriber.pull(replica) == 2  # the digest misses, the anchor re-syncs it
    for name in state:
        assert torch.equal(replica[name].view(torch.int16), state[name].view(torch.int16)), name


def test_small_device_tensors_cross_to_the_host_in_batches(monkeypatch):
    """Tensors below STATE_HOST_BELOW are joined on their device and copied in one go per batch (not one copy
    each: a model with tens of thousands of small tensors), every hash the core's."""
    monkeypatch.setattr(_identity, "STATE_HOST_BELOW", 1 << 20)
    monkeypatch.setattr(_identity, "_HOST_BATCH_BYTES", 10_000)
    g = torch.Generator().manual_seed(9)
    state = {f"t{i}": torch.randn(int(n), generator=g).bfloat16() for i, n in enumerate([1, 700, 3000, 0, 2500, 64])}
    state["int"] = torch.arange(300, dtype=torch.int32).view(3, 100)
    joined = []
    real_cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda parts, *a, **k: joined.append(len(parts)) or real_cat(parts, *a, **k))
    assert _identity.state_hashes(state) == {name: _host_hash(t) for name, t in state.items()}
    # 2 + 1,400 + 6,000 + 0 bytes, then 5,000 + 128 + 1,200: two copies under 10,000 bytes each.
    assert joined == [4, 3]


def _bench(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benches" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_device_hash_bench_runs():
    """benches/device_hashes.py, which a session with a GPU runs to set HOST_BELOW and STATE_HOST_BELOW, runs
    (here on CPU tensors down the device path) and checks every hash it times against the host's."""
    rows = _bench("device_hashes").main(
        ["--cpu", "--rounds", "1", "--sizes", f"{BLOCK},{4 * BLOCK + 6}", "--small", "3"]
    )
    assert [row["bytes"] for row in rows] == [BLOCK, 4 * BLOCK + 6]


def test_the_device_check_runs():
    """benches/device_check.py, the script a session with a GPU runs once, runs end to end on CPU tensors (its
    every result checked bit for bit inside): the mirror's step, the applies, the digests, the hash table."""
    figures = _bench("device_check").main(["--cpu", "--scale", "0.005", "--rounds", "1"])
    assert figures["Mirror.step compact, ms"] > 0 and figures["apply context, check_base, ms"] > 0
    assert len(figures["device hashes"]) == 2
