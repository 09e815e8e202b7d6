"""Writing changes into targets (deltasync_rs/_write.py): every kind of target, all-or-nothing over any mix of them,
autograd's version counter, and regions of larger parameters (tensor-parallel shards) for every codec."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

import deltasync_rs as ds
from deltasync_rs import _write
from tests.helpers import assert_bits_equal


def _pair(shape, seed=0, dtype=torch.bfloat16, every=5):
    g = torch.Generator().manual_seed(seed)
    prev = torch.randn(shape, generator=g).to(dtype)
    curr = prev.clone()
    flat = curr.view(-1)
    # mostly +-1 steps of the bit pattern, as on training steps, so that compact picks rice/diffbits
    bits = flat.view(torch.int16) if dtype == torch.bfloat16 else None
    if bits is not None:
        bits[::every] += 1
        bits[2 :: every * 3] -= 2
    else:
        flat[::every] = flat[::every] * 1.5 + 0.25
    return prev, curr


def test_the_issue_example_mixed_targets_refused_before_any_write():
    prev = {"a": torch.zeros(16), "b": torch.zeros(4, 4)}
    curr = {"a": torch.ones(16), "b": torch.ones(4, 4)}
    state = {"a": torch.zeros(16), "b": torch.zeros(4).expand(4, 4)}
    with pytest.raises(ds.DeltaSyncError, match="'b'.*share memory"):
        ds.diff(prev, curr).apply_(state)
    assert torch.equal(state["a"], torch.zeros(16))


def test_refusals_come_before_writes_whatever_the_order():
    prev, curr = _pair((8, 8))
    for bad in (np.zeros((8, 8), dtype=np.float32), torch.zeros(8, 8, device="meta", dtype=torch.bfloat16)):
        names = ["a", "b", "c"]
        delta = ds.diff({n: prev for n in names}, {n: curr for n in names})
        state = {"a": prev.clone(), "b": bad, "c": prev.clone().t().contiguous().t()}
        with pytest.raises(ds.DeltaSyncError, match="[\"']b[\"']"):
            delta.apply_(state)
        assert_bits_equal(state["a"], prev) and assert_bits_equal(state["c"], prev)


def test_read_only_and_broadcast_arrays_are_refused():
    prev, curr = np.zeros((4, 4), np.float32), np.ones((4, 4), np.float32)
    delta = ds.diff(prev, curr)
    frozen = prev.copy()
    frozen.flags.writeable = False
    with pytest.raises(ds.DeltaSyncError, match="read-only"):
        delta.apply_(frozen)
    broadcast = np.broadcast_to(np.zeros(4, np.float32), (4, 4))
    with pytest.raises(ds.DeltaSyncError):
        delta.apply_(broadcast)


@pytest.mark.parametrize("codec", ["varint", "compact"])
@pytest.mark.parametrize("values", ["diff", "abs"])
def test_every_kind_of_target_in_one_apply(codec, values):
    """Contiguous CPU, strided and transposed views, inference tensors (contiguous or not), numpy (contiguous or
    strided), a view at an offset: one delta, one apply, every target bit-exact."""
    shapes = {
        "contig": (16, 12),
        "strided": (16, 12),
        "transposed": (12, 16),
        "inference": (16, 12),
        "inference_t": (12, 16),
        "numpy": (16, 12),
        "numpy_strided": (16, 12),
        "offset": (50,),
    }
    prev, curr = {}, {}
    for i, (name, shape) in enumerate(shapes.items()):
        prev[name], curr[name] = _pair(shape, seed=i, dtype=torch.bfloat16 if "numpy" not in name else torch.float32)
    delta = ds.load(ds.diff(prev, curr, codec=codec, values=values).to_bytes())
    if codec == "compact" and values == "diff":
        assert "diffbits" in {t.values for t in delta.tensors}
    wide = torch.zeros(16, 24, dtype=torch.bfloat16)
    wide[:, ::2] = prev["strided"]
    with torch.inference_mode():
        inference = prev["inference"].clone()
        inference_t = prev["inference_t"].t().contiguous().t()
    big = torch.zeros(200, dtype=torch.bfloat16)
    big[100:150] = prev["offset"]
    np_big = np.zeros((16, 24), np.float32)
    np_big[:, ::2] = prev["numpy_strided"].numpy()
    state = {
        "contig": prev["contig"].clone(),
        "strided": wide[:, ::2],
        "transposed": prev["transposed"].t().contiguous().t(),
        "inference": inference,
        "inference_t": inference_t,
        "numpy": prev["numpy"].numpy().copy(),
        "numpy_strided": np_big[:, ::2],
        "offset": big[100:150],
    }
    assert not state["strided"].is_contiguous() and not state["transposed"].is_contiguous()
    assert state["inference_t"].is_inference() and not state["inference_t"].is_contiguous()
    delta.apply_(state)
    for name in shapes:
        target = state[name]
        got = torch.from_numpy(np.ascontiguousarray(target)) if isinstance(target, np.ndarray) else target
        assert_bits_equal(got, curr[name])
    assert torch.equal(big[:100], torch.zeros(100, dtype=torch.bfloat16))
    assert np.array_equal(np_big[:, 1::2], np.zeros((16, 12), np.float32))


def test_autograd_sees_the_write_as_an_in_place_change():
    prev, curr = _pair((8, 8), dtype=torch.float32)
    for make in (lambda t: t.clone(), lambda t: t.t().contiguous().t()):  # the core's path and the staged path
        weight = make(prev).requires_grad_(True)
        loss = (weight * weight).sum()  # saves `weight` for backward
        version = weight._version
        ds.diff(prev, curr).apply_({"tensor": weight})
        assert weight._version > version
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        assert_bits_equal(weight.detach(), curr)


def test_tied_targets_written_once_and_partial_overlaps_refused():
    prev, curr = _pair((10, 6))
    shared = prev.clone()
    delta = ds.diff({"embed": prev, "head": prev}, {"embed": curr, "head": curr}, codec="compact")
    delta.apply_({"embed": shared, "head": shared})
    assert_bits_equal(shared, curr)
    other = curr.clone()
    other.view(torch.int16)[0, 0] += 3
    differing = ds.diff({"embed": prev, "head": prev}, {"embed": curr, "head": other})
    target = prev.clone()
    with pytest.raises(ds.DeltaSyncError, match="changes them differently"):
        differing.apply_({"embed": target, "head": target})
    assert_bits_equal(target, prev)
    base = torch.cat([prev.view(-1), prev.view(-1)])
    halves = ds.diff(
        {"x": prev.view(-1)[:40], "y": prev.view(-1)[20:]}, {"x": curr.view(-1)[:40], "y": curr.view(-1)[20:]}
    )
    with pytest.raises(ds.DeltaSyncError, match="overlap"):
        halves.apply_({"x": base[:40], "y": base[20:60]})


@pytest.mark.parametrize("codec", ["varint", "compact", "context"])
def test_check_base_checks_every_name_of_a_tied_target(codec):
    """Tied targets are written once, under one name, but each name's record has its own base: with check_base the
    other name's base went unchecked, so a target that was the base of one name only took the changes meant for
    the other, silently (found by an adversarial helper)."""
    torch.manual_seed(3)
    embed = (torch.randn(64, 48) * 0.02).to(torch.bfloat16)
    head = embed.clone()
    head.view(torch.int16)[::7, ::5] += 1  # another base
    new_embed, new_head = embed.clone(), head.clone()
    for tensor in (new_embed, new_head):
        tensor.view(torch.int16)[3, :4] += 1  # the same change to both
    delta = ds.diff({"embed": embed, "head": head}, {"embed": new_embed, "head": new_head}, codec=codec)
    for order in (("embed", "head"), ("head", "embed")):
        shared = embed.clone()
        with pytest.raises(ds.BaseMismatchError, match="head"):
            delta.apply_({name: shared for name in order}, check_base=True)
        assert_bits_equal(shared, embed)
    # Tensors the delta leaves alone are checked as well: a target tying them holds the base of one only.
    other, new_other = torch.zeros(8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)
    quiet = ds.diff(
        {"embed": embed, "head": head, "other": other}, {"embed": embed, "head": head, "other": new_other}, codec=codec
    )
    shared, written = embed.clone(), other.clone()
    with pytest.raises(ds.BaseMismatchError, match="head"):
        quiet.apply_({"embed": shared, "head": shared, "other": written}, check_base=True)
    assert_bits_equal(shared, embed)
    assert_bits_equal(written, other)
    tied = ds.diff({"embed": embed, "head": embed}, {"embed": new_embed, "head": new_embed}, codec=codec)
    tied.apply_({"embed": shared, "head": shared}, check_base=True)  # one base: accepted, written once
    assert_bits_equal(shared, new_embed)


def test_many_targets_are_checked_for_overlap_in_one_sort():
    n = 20000
    prev = {f"t{i}": torch.zeros(3) for i in range(n)}
    curr = {f"t{i}": torch.ones(3) for i in range(n)}
    storage = torch.zeros(3 * n)
    state = {f"t{i}": storage[3 * i : 3 * i + 3] for i in range(n)}
    ds.diff(prev, curr).apply_(state)
    assert torch.equal(storage, torch.ones(3 * n))


class _CountingRaw:
    """A delta's core object that counts the calls of each of its methods (then forwards them)."""

    def __init__(self, raw):
        self._raw, self.calls = raw, {}

    def __getattr__(self, name):
        attribute = getattr(self._raw, name)
        if not callable(attribute):
            return attribute

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return attribute(*args, **kwargs)

        return counted

    def __len__(self):
        return len(self._raw)


@pytest.mark.parametrize("codec", ["compact", "context"])
def test_staged_writes_read_each_tensors_record_alone(codec):
    """Targets the core does not write itself (strided here; every tensor on a GPU) are decoded and staged tensor by
    tensor, and each asks the core about its own record: not for the whole list of records, which made an apply of
    n such tensors take time n^2 (8,000 tensors: 369 s, 1.2 s after)."""
    n = 300
    g = torch.Generator().manual_seed(5)
    prev = {f"t{i}": torch.randn(8, 8, generator=g).bfloat16() for i in range(n)}
    curr = {name: t.clone() for name, t in prev.items()}
    for t in curr.values():
        t.view(torch.int16)[::3, ::2] += 1
    delta = ds.load(ds.diff(prev, curr, codec=codec).to_bytes())
    state = {name: t.clone().t().contiguous().t() for name, t in prev.items()}  # same values, column-major
    assert not any(t.is_contiguous() for t in state.values())
    counting = _CountingRaw(delta._raw)
    delta._raw = counting
    delta.apply_(state)
    for name in prev:
        assert_bits_equal(state[name], curr[name])
    assert counting.calls.get("tensor_info", 0) >= n  # staged one by one, each asking for its own record
    assert counting.calls.get("tensors", 0) <= 2, counting.calls
    raw = counting._raw
    assert [raw.tensor_info(i) for i in range(len(raw))] == raw.tensors()
    with pytest.raises(ds.DeltaSyncError, match=f"no tensor number {n}"):
        raw.tensor_info(n)


@dataclass
class _Region:
    param: torch.Tensor
    hf_shape: tuple
    row_start: int
    row_count: int
    col_start: int
    col_count: int
    param_row_offset: int


@pytest.mark.parametrize("codec", ["varint", "compact"])
@pytest.mark.parametrize("values", ["diff", "abs"])
@pytest.mark.parametrize("device", ["cpu", "strided-copy"])
def test_regions_of_a_larger_parameter_are_bit_exact(codec, values, device):
    """A tensor-parallel rank's slices: rows 32..63 of a [64, 32] tensor at row 8 of a fused parameter (the issue's
    reproduction), and columns 16..31 (a row-parallel split); both through the staged path, which the core's
    direct path would hide."""
    prev, curr = _pair((64, 32))
    delta = ds.load(ds.diff({"w": prev}, {"w": curr}, codec=codec, values=values).to_bytes())
    if codec == "compact" and values == "diff":
        assert delta.tensors[0].values == "rans"
    fused = torch.zeros(8 + 32, 32, dtype=torch.bfloat16)
    fused[8:] = prev[32:]
    writes = _write.Writes(delta._raw)
    writes.add_region(0, _Region(fused, (64, 32), 32, 32, 0, 32, 8))
    writes.commit()
    assert_bits_equal(fused[8:], curr[32:])
    assert torch.equal(fused[:8], torch.zeros(8, 32, dtype=torch.bfloat16))
    columns = prev[:, 16:].clone()
    writes = _write.Writes(delta._raw)
    writes.add_region(0, _Region(columns, (64, 32), 0, 64, 16, 16, 0))
    writes.commit()
    assert_bits_equal(columns, curr[:, 16:])
    assert writes.elements == int((prev[:, 16:].view(torch.int16) != curr[:, 16:].view(torch.int16)).sum())


def test_holds_differences_comes_from_the_core():
    prev, curr = _pair((64, 32))
    kinds = {}
    for codec in ("varint", "compact"):
        for values in ("diff", "abs"):
            delta = ds.diff(prev, curr, codec=codec, values=values)
            kinds[delta.tensors[0].values] = delta.holds_differences(0)
    assert kinds == {"diff": True, "rans": True, "abs": False}


# ------------------------------------------------------------------------------------------- the base identity check


@pytest.mark.parametrize("codec", ["varint", "compact"])
@pytest.mark.parametrize("values", ["diff", "abs"])
def test_check_base_refuses_a_wrong_base_and_a_second_application(codec, values):
    prev, curr = {}, {}
    for i, name in enumerate(["a", "b", "c"]):
        prev[name], curr[name] = _pair((32, 16), seed=i)
    delta = ds.load(ds.diff(prev, curr, codec=codec, values=values).to_bytes())
    assert all(delta.base_identity(i) is not None for i in range(3))
    state = {"a": prev["a"].clone(), "b": prev["b"].t().contiguous().t(), "c": prev["c"].clone()}
    wrong = {k: v.clone() if isinstance(v, torch.Tensor) else v.copy() for k, v in state.items()}
    wrong["b"].view(torch.int16)[3, 3] += 1  # one bit pattern off, in a tensor the delta does not change there
    with pytest.raises(ds.BaseMismatchError, match="'b'|\"b\""):
        delta.apply_(wrong, check_base=True)
    assert_bits_equal(wrong["a"], prev["a"])  # nothing written anywhere
    delta.apply_(state, check_base=True)
    for name in curr:
        assert_bits_equal(state[name], curr[name])
    with pytest.raises(ds.BaseMismatchError, match="base"):
        delta.apply_(state, check_base=True)  # applied twice
    for name in curr:
        assert_bits_equal(state[name], curr[name])


def test_files_without_a_base_identity_still_apply_with_check_base():
    prev, curr = _pair((16, 8))
    trl = ds.diff(prev, curr, values="abs").to_bytes(format="trl")
    delta = ds.load(trl)
    assert delta.base_identity(0) is None
    target = prev.clone()
    delta.apply_({delta.names[0]: target}, check_base=True)
    assert_bits_equal(target, curr)


def test_anchors_record_no_base_and_apply_anywhere():
    prev, curr = _pair((16, 8))
    full = ds.anchor(curr)
    assert full.base_identity(0) is None
    target = torch.zeros_like(prev)
    full.apply_(target, check_base=True)
    assert_bits_equal(target, curr)


def test_raw_apply_checks_100k_targets_for_overlap():
    """RawDelta.apply sorts the targets by address to check them for overlap (it compared every pair: 7.3 s at 160k
    tensors); not timed here, it must just finish, write every target, and still refuse an overlap."""
    import numpy as np

    from deltasync_rs._core import RawDelta

    n = 100_000
    zeros, ones = np.zeros(1, np.uint8), np.ones(1, np.uint8)
    raw = RawDelta()
    raw.add_diff([(f"t{i}", "U8", [1], zeros, ones) for i in range(n)], "diff")
    storage = bytearray(n)
    view = memoryview(storage)
    raw.apply([(i, view[i : i + 1]) for i in range(n)])
    assert storage == bytearray(b"\1" * n)
    with pytest.raises(ds.DeltaSyncError, match='overlaps the target of tensor "t'):
        raw.apply([(i, view[i : i + 1]) for i in range(n - 1)] + [(n - 1, view[5:6])])
