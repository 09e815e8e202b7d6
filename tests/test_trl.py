"""TRL sparse weight patches, both ways: files written by a reference TRL writer load and apply bit-exactly, and our
TRL output reads back with a reference TRL reader. The reference code below follows TRL's published description
of its files (Hugging Face's blog post on delta weight sync in TRL; summarised in docs/format.md §9) and uses only
safetensors.torch and torch, never deltasync_rs."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

import deltasync_rs as ds
from tests.helpers import assert_states_equal, bits, clone_state

TRL_FORMAT = "sparse_weight_patch"
UINT16_MAX = 65535

# ---------------------------------------------------------------------------------------------------------------
# Reference TRL writer and reader (TRL's published file layout, docs/format.md §9)
# ---------------------------------------------------------------------------------------------------------------


def changed_positions(prev: torch.Tensor, curr: torch.Tensor) -> torch.Tensor:
    """Ascending flat row-major positions whose bit pattern differs (int64)."""
    return (bits(prev).reshape(-1) != bits(curr).reshape(-1)).nonzero().reshape(-1)


def gap_code(positions: torch.Tensor) -> torch.Tensor:
    """TRL v3 gap_delta: gap[k] = idx[k] - idx[k-1] - 1 with idx[-1] = -1; uint16, or uint32 when a gap is too big."""
    before = torch.cat([torch.tensor([-1], dtype=torch.int64), positions[:-1]])
    gaps = positions - before - 1
    dtype = torch.uint16 if int(gaps.max()) <= UINT16_MAX else torch.uint32
    return gaps.to(dtype)


def trl_metadata(prev, curr, changed, *, version, sparse, model_version, encoding=None):
    total_changed = sum(n for n in changed.values())
    total = sum(t.numel() for t in curr.values())
    meta = {
        "format": TRL_FORMAT,
        "version": str(version),
        "sparse": "True" if sparse else "False",
        "model_version": str(model_version),
        "num_changed_params": str(len(changed)),
        "total_changed_elements": str(total_changed),
        "total_elements": str(total),
        "sparsity": str(1.0 - total_changed / total),
        "changed_params": json.dumps(list(changed)),
    }
    if encoding is not None:
        meta["encoding"] = encoding
    return meta


def write_trl(prev, curr, *, version=1, sparse=True, encoding="raw", model_version=7) -> bytes:
    """A TRL weight patch from ``prev`` to ``curr`` (v1, or v3 with ``encoding`` raw or gap_delta)."""
    tensors, changed = {}, {}
    for name, new in curr.items():
        if not sparse:
            tensors[name] = new.clone().contiguous()
            changed[name] = new.numel()
            continue
        positions = changed_positions(prev[name], new)
        if positions.numel() == 0:
            continue  # TRL omits parameters with no change
        values = new.reshape(-1)[positions].clone()
        changed[name] = positions.numel()
        if version == 1:
            tensors[f"{name}.indices"] = positions.to(torch.int32)
            tensors[f"{name}.values"] = values
        else:
            tensors[f"{name}.idx"] = positions.to(torch.int32) if encoding == "raw" else gap_code(positions)
            tensors[f"{name}.val"] = values
    meta = trl_metadata(
        prev,
        curr,
        changed,
        version=version,
        sparse=sparse,
        model_version=model_version,
        encoding=encoding if version == 3 else None,
    )
    return st_save(tensors, metadata=meta)


def read_header(data: bytes) -> dict:
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length])


def read_trl(data: bytes) -> tuple[dict[str, str], dict[str, tuple[torch.Tensor, torch.Tensor] | torch.Tensor]]:
    """Reference TRL reader: metadata and, per parameter, (int64 positions, values) or a full tensor."""
    meta = read_header(data).get("__metadata__", {})
    assert meta["format"] == TRL_FORMAT
    raw = st_load(data)
    if meta["sparse"] == "False":
        return meta, dict(raw)
    out = {}
    gap_coded = meta.get("encoding") == "gap_delta"
    for key, tensor in raw.items():
        for index_suffix, value_suffix in ((".indices", ".values"), (".idx", ".val")):
            if key.endswith(index_suffix):
                name = key[: -len(index_suffix)]
                idx = tensor.to(torch.int64)
                if gap_coded and index_suffix == ".idx":
                    idx = (idx + 1).cumsum(0) - 1
                out[name] = (idx, raw[name + value_suffix])
    return meta, out


def trl_apply(data: bytes, state: dict[str, torch.Tensor]) -> None:
    """Applies a TRL patch the way TRL's receiver does: ``flat.index_put_((idx.long(),), vals)``."""
    meta, params = read_trl(data)
    for name, entry in params.items():
        if isinstance(entry, torch.Tensor):
            state[name].copy_(entry)
        else:
            idx, vals = entry
            state[name].view(-1).index_put_((idx.long(),), vals)


# ---------------------------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------------------------


def _bump(flat: torch.Tensor, positions) -> None:
    """Moves each listed element by one step of its bit pattern (always a real change)."""
    ints = flat.view(bits(flat).dtype)
    ints[positions] += 1


def make_states(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    specs = {
        "model.embed_tokens.weight": ((64, 32), torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": ((48, 40), torch.float32),
        "model.norm.weight": ((32,), torch.bfloat16),  # unchanged: TRL omits it
        "model.layers.0.self_attn.q_proj.weight": ((40, 24), torch.bfloat16),
        "lm_head.bias": ((10,), torch.float32),
    }
    prev = {name: torch.randn(shape, generator=g).to(dtype) for name, (shape, dtype) in specs.items()}
    curr = clone_state(prev)
    _bump(curr["model.embed_tokens.weight"].view(-1), slice(0, None, 7))
    pos = torch.randperm(48 * 40, generator=g)[:97]
    _bump(curr["model.layers.0.mlp.up_proj.weight"].view(-1), pos)
    flat = curr["model.layers.0.self_attn.q_proj.weight"].view(-1)
    # a realistic bf16 update: some elements keep their bit pattern, others move
    flat[::5] = (flat[::5].float() * 1.02 + 0.003).to(torch.bfloat16)
    _bump(curr["lm_head.bias"].view(-1), [0, 1, 9])  # first, adjacent and last elements
    return prev, curr


def make_far_apart_states():
    """A 200_000-element tensor with two far-apart changes (gap > uint16) next to a small tensor (gaps fit uint16)."""
    g = torch.Generator().manual_seed(3)
    prev = {
        "big.weight": torch.randn(200_000, generator=g).to(torch.float32).reshape(400, 500),
        "small.weight": torch.randn(64, 8, generator=g).to(torch.bfloat16),
    }
    curr = clone_state(prev)
    _bump(curr["big.weight"].view(-1), [5, 150_000])
    _bump(curr["small.weight"].view(-1), [0, 1, 2, 100, 511])
    return prev, curr


@pytest.fixture
def states():
    return make_states()


def _changed_names(prev, curr):
    return [n for n in curr if changed_positions(prev[n], curr[n]).numel()]


def _header_dtypes(data: bytes) -> dict[str, str]:
    return {k: v["dtype"] for k, v in read_header(data).items() if k != "__metadata__"}


# ---------------------------------------------------------------------------------------------------------------
# (a)-(c) TRL files -> deltasync
# ---------------------------------------------------------------------------------------------------------------


def test_reference_writer_is_sound(states):
    """The reference writer/reader pair reproduces curr on its own, so later failures point at deltasync."""
    prev, curr = states
    for kwargs in ({}, {"version": 3}, {"version": 3, "encoding": "gap_delta"}, {"sparse": False}):
        target = clone_state(prev)
        trl_apply(write_trl(prev, curr, **kwargs), target)
        assert_states_equal(target, curr)


@pytest.mark.parametrize("from_path", [False, True], ids=["bytes", "path"])
def test_v1_sparse_file_applies_bit_exactly(tmp_path, states, from_path):
    prev, curr = states
    data = write_trl(prev, curr, model_version=42)
    if from_path:
        path = tmp_path / "deltas" / "step_000042.safetensors"
        path.parent.mkdir()
        path.write_bytes(data)
        delta = ds.load(path)
    else:
        delta = ds.load(data)
    changed = _changed_names(prev, curr)
    assert "model.norm.weight" not in changed and len(changed) == 4
    assert sorted(delta.names) == sorted(changed)
    assert not delta.is_anchor
    assert delta.step == 42
    assert delta.num_changed == sum(changed_positions(prev[n], curr[n]).numel() for n in curr)
    for info in delta.tensors:
        assert info.shape is None and info.density is None  # TRL files carry no shapes
        assert info.dtype == {torch.bfloat16: "BF16", torch.float32: "F32"}[curr[info.name].dtype]
        assert info.changed == changed_positions(prev[info.name], curr[info.name]).numel()
        assert info.values == "abs"
    target = clone_state(prev)
    assert delta.apply_(target) is None  # in place; returning the state would fill a REPL
    assert_states_equal(target, curr)


def test_v1_sparse_file_applies_in_any_mapping_order(states):
    """Targets are found by name, not by position in the mapping."""
    prev, curr = states
    delta = ds.load(write_trl(prev, curr))
    target = {k: v.clone() for k, v in reversed(list(prev.items()))}
    delta.apply_(target)
    for name in curr:
        assert torch.equal(bits(target[name]), bits(curr[name])), name


def test_v1_full_file_is_an_anchor(states):
    prev, curr = states
    data = write_trl(prev, curr, sparse=False, model_version=10)
    delta = ds.load(data)
    assert delta.is_anchor
    assert delta.step == 10
    assert sorted(delta.names) == sorted(curr)
    assert delta.num_changed == delta.num_elements == sum(t.numel() for t in curr.values())
    for info in delta.tensors:
        assert info.shape == tuple(curr[info.name].shape)
    # an anchor applies to any base of the right kinds
    target = {k: torch.zeros_like(v) for k, v in curr.items()}
    delta.apply_(target)
    assert_states_equal(target, curr)
    target = clone_state(prev)
    delta.apply_(target)
    assert_states_equal(target, curr)


def test_v1_full_file_checks_shapes(states):
    prev, curr = states
    delta = ds.load(write_trl(prev, curr, sparse=False))
    target = clone_state(prev)
    target["model.norm.weight"] = torch.zeros(4, 8, dtype=torch.bfloat16)  # same numel, other shape
    before = clone_state(target)
    with pytest.raises(ds.BaseMismatchError, match="model.norm.weight"):
        delta.apply_(target)
    assert_states_equal(target, before)


def test_v3_raw_file_applies(states):
    prev, curr = states
    data = write_trl(prev, curr, version=3, encoding="raw", model_version=5)
    assert all(k.endswith((".idx", ".val")) for k in _header_dtypes(data))
    delta = ds.load(data)
    assert delta.step == 5 and not delta.is_anchor
    assert sorted(delta.names) == sorted(_changed_names(prev, curr))
    target = clone_state(prev)
    delta.apply_(target)
    assert_states_equal(target, curr)


def test_v3_gap_delta_uint16_and_uint32(states):
    prev, curr = make_far_apart_states()
    data = write_trl(prev, curr, version=3, encoding="gap_delta")
    dtypes = _header_dtypes(data)
    # the workload really exercises both widths
    assert dtypes["big.weight.idx"] == "U32"
    assert dtypes["small.weight.idx"] == "U16"
    delta = ds.load(data)
    assert {t.name: t.changed for t in delta.tensors} == {"big.weight": 2, "small.weight": 5}
    target = clone_state(prev)
    delta.apply_(target)
    assert_states_equal(target, curr)

    # a uint16-only gap_delta file of the mixed-dtype workload
    prev, curr = states
    data = write_trl(prev, curr, version=3, encoding="gap_delta")
    assert {d for k, d in _header_dtypes(data).items() if k.endswith(".idx")} == {"U16"}
    target = clone_state(prev)
    ds.load(data).apply_(target)
    assert_states_equal(target, curr)


def test_v3_gap_delta_positions_are_decoded_exactly():
    """Positions 0, 1 (gap 0 twice) and a uint16-max gap decode to the right elements, not off by one."""
    n = 70_000
    prev = {"w": torch.zeros(n, dtype=torch.float32)}
    curr = clone_state(prev)
    positions = [0, 1, 1 + UINT16_MAX + 1, n - 1]  # gaps 0, 0, 65535 (still uint16), then big
    _bump(curr["w"], positions)
    data = write_trl(prev, curr, version=3, encoding="gap_delta")
    delta = ds.load(data)
    target = clone_state(prev)
    delta.apply_(target)
    assert bits(target["w"]).nonzero().reshape(-1).tolist() == positions
    assert_states_equal(target, curr)


# ---------------------------------------------------------------------------------------------------------------
# (d)-(e) deltasync -> TRL files
# ---------------------------------------------------------------------------------------------------------------


def test_abs_delta_saved_as_trl_reads_back_with_reference_reader(tmp_path, states):
    prev, curr = states
    delta = ds.diff(prev, curr, values="abs", step=12, base_step=11)
    path = tmp_path / "step_000012.safetensors"
    delta.save(path, format="trl")
    data = path.read_bytes()
    assert data == delta.to_bytes(format="trl")

    meta, params = read_trl(data)
    changed = _changed_names(prev, curr)
    counts = {n: changed_positions(prev[n], curr[n]).numel() for n in changed}
    total = sum(t.numel() for t in curr.values())
    assert meta["format"] == TRL_FORMAT
    assert meta["version"] == "1"
    assert meta["sparse"] == "True"
    assert meta["model_version"] == "12"
    assert meta["num_changed_params"] == str(len(changed))
    assert meta["total_changed_elements"] == str(sum(counts.values()))
    assert meta["total_elements"] == str(total)
    assert float(meta["sparsity"]) == pytest.approx(1.0 - sum(counts.values()) / total, rel=1e-12)
    assert sorted(json.loads(meta["changed_params"])) == sorted(changed)

    # layout: exactly <name>.indices int32 + <name>.values of the parameter's dtype, for changed parameters only
    dtypes = _header_dtypes(data)
    assert set(dtypes) == {f"{n}{s}" for n in changed for s in (".indices", ".values")}
    raw = st_load(data)
    for name in changed:
        idx, vals = raw[f"{name}.indices"], raw[f"{name}.values"]
        assert idx.dtype == torch.int32 and idx.dim() == 1
        assert vals.dtype == curr[name].dtype and vals.shape == idx.shape
        assert torch.equal(idx.long(), changed_positions(prev[name], curr[name]))
        assert bool((idx[1:] > idx[:-1]).all())
        assert torch.equal(bits(vals), bits(curr[name].reshape(-1)[idx.long()]))

    target = clone_state(prev)
    trl_apply(data, target)
    assert_states_equal(target, curr)

    # and deltasync reads its own TRL output
    back = ds.load(path)
    assert back.step == 12
    target = clone_state(prev)
    back.apply_(target)
    assert_states_equal(target, curr)


def test_trl_output_with_a_wholly_changed_tensor(states):
    """A tensor whose every element changed (stored whole by deltasync) still becomes a valid sparse TRL entry."""
    prev, curr = states
    curr["model.norm.weight"] = (prev["model.norm.weight"].view(torch.int16) + 1).view(torch.bfloat16)
    delta = ds.diff(prev, curr, values="abs")
    data = delta.to_bytes(format="trl")
    meta, params = read_trl(data)
    assert meta["sparse"] == "True"
    idx, vals = params["model.norm.weight"]
    assert idx.tolist() == list(range(32))
    target = clone_state(prev)
    trl_apply(data, target)
    assert_states_equal(target, curr)


def test_trl_output_with_no_changes_is_an_empty_patch(states):
    prev, _ = states
    data = ds.diff(prev, prev, values="abs", step=3).to_bytes(format="trl")
    meta, params = read_trl(data)
    assert params == {}
    assert (meta["sparse"], meta["num_changed_params"], meta["total_changed_elements"]) == ("True", "0", "0")
    assert json.loads(meta["changed_params"]) == []
    delta = ds.load(data)
    assert delta.num_changed == 0 and len(delta) == 0
    target = clone_state(prev)
    delta.apply_(target)
    assert_states_equal(target, prev)


def test_anchor_saved_as_trl_is_a_full_patch(states):
    _, curr = states
    data = ds.anchor(curr, step=20).to_bytes(format="trl")
    meta, params = read_trl(data)
    assert meta["sparse"] == "False" and meta["model_version"] == "20"
    assert meta["total_elements"] == meta["total_changed_elements"] == str(sum(t.numel() for t in curr.values()))
    assert set(params) == set(curr)
    target = {k: torch.zeros_like(v) for k, v in curr.items()}
    trl_apply(data, target)
    assert_states_equal(target, curr)
    assert ds.load(data).is_anchor


def test_diff_values_cannot_be_written_as_trl(tmp_path, states):
    prev, curr = states
    delta = ds.diff(prev, curr, values="diff")
    with pytest.raises(ds.DeltaSyncError, match="abs"):
        delta.to_bytes(format="trl")
    path = tmp_path / "d.safetensors"
    with pytest.raises(ds.DeltaSyncError, match="abs"):
        delta.save(path, format="trl")
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary left over


# ---------------------------------------------------------------------------------------------------------------
# (f)-(g) malformed files and mismatched targets
# ---------------------------------------------------------------------------------------------------------------


def _v1_meta(**extra):
    meta = {
        "format": TRL_FORMAT,
        "version": "1",
        "sparse": "True",
        "model_version": "1",
        "num_changed_params": "1",
        "total_changed_elements": "2",
        "total_elements": "8",
        "sparsity": "0.75",
        "changed_params": '["w"]',
    }
    meta.update(extra)
    return meta


_I32 = torch.int32
# case: (tensors, extra metadata, message pattern)
MALFORMED = {
    "non-increasing": (
        {"w.indices": torch.tensor([1, 3, 3], dtype=_I32), "w.values": torch.ones(3)},
        {},
        "not strictly increasing",
    ),
    "decreasing": (
        {"w.indices": torch.tensor([4, 2], dtype=_I32), "w.values": torch.ones(2)},
        {},
        "not strictly increasing",
    ),
    "negative": ({"w.indices": torch.tensor([-1, 2], dtype=_I32), "w.values": torch.ones(2)}, {}, "negative"),
    "length-mismatch": (
        {"w.indices": torch.tensor([0, 2, 5], dtype=_I32), "w.values": torch.ones(2)},
        {},
        "one length",
    ),
    "indices-without-values": (
        {"w.indices": torch.tensor([0, 2], dtype=_I32), "v.values": torch.ones(2)},
        {},
        '"w.indices" has no "w.values"',
    ),
    "only-indices": ({"w.indices": torch.tensor([0, 2], dtype=_I32)}, {}, '"w.indices" has no "w.values"'),
    "stray-tensor": (
        {"w.indices": torch.tensor([0, 2], dtype=_I32), "w.values": torch.ones(2), "extra": torch.zeros(3)},
        {},
        '"extra"',
    ),
    "2-d-indices": ({"w.indices": torch.tensor([[0, 2]], dtype=_I32), "w.values": torch.ones(1, 2)}, {}, "1-D"),
    "float-indices": ({"w.indices": torch.tensor([0.0, 2.0]), "w.values": torch.ones(2)}, {}, "I32"),
    "v3-gap-signed": (
        {"w.idx": torch.tensor([0, 2], dtype=_I32), "w.val": torch.ones(2)},
        {"version": "3", "encoding": "gap_delta"},
        "unsigned",
    ),
    "v3-unknown-encoding": (
        {"w.idx": torch.tensor([0, 2], dtype=_I32), "w.val": torch.ones(2)},
        {"version": "3", "encoding": "zstd"},
        "zstd",
    ),
    "v3-raw-decreasing": (
        {"w.idx": torch.tensor([5, 1], dtype=_I32), "w.val": torch.ones(2)},
        {"version": "3", "encoding": "raw"},
        "not strictly increasing",
    ),
    "bad-sparse-flag": (
        {"w.indices": torch.tensor([0, 2], dtype=_I32), "w.values": torch.ones(2)},
        {"sparse": "maybe"},
        "sparse",
    ),
    # sparse="True" files whose only tensors are not index/value pairs
    "sparse-values-only": ({"w.values": torch.ones(2)}, {}, '"w.values"'),
    "sparse-stray-only": ({"extra": torch.zeros(3)}, {}, '"extra"'),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_trl_files_are_rejected(tmp_path, case):
    tensors, extra, message = MALFORMED[case]
    data = st_save(tensors, metadata=_v1_meta(**extra))
    with pytest.raises(ds.DeltaFormatError, match=message):
        ds.load(data)
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    with pytest.raises(ds.DeltaFormatError, match="bad.safetensors"):
        ds.load(path)


def test_index_beyond_target_is_a_base_mismatch_and_nothing_is_written():
    prev = {"a": torch.zeros(8, dtype=torch.float32), "w": torch.zeros(2, 4, dtype=torch.bfloat16)}
    data = st_save(
        {
            "a.indices": torch.tensor([0, 7], dtype=torch.int32),
            "a.values": torch.ones(2),  # valid
            "w.indices": torch.tensor([1, 8], dtype=torch.int32),  # 8 is past the 8 elements of w
            "w.values": torch.ones(2, dtype=torch.bfloat16),
        },
        metadata=_v1_meta(),
    )
    delta = ds.load(data)  # the file alone is well formed: TRL carries no shapes
    target = clone_state(prev)
    with pytest.raises(ds.BaseMismatchError, match='"w".*position 8'):
        delta.apply_(target)
    assert_states_equal(target, prev)  # not even the valid tensor "a" was written
    # the same file fits a larger target
    big = {"a": torch.zeros(8), "w": torch.zeros(3, 3, dtype=torch.bfloat16)}
    delta.apply_(big)
    assert big["w"].view(-1)[[1, 8]].tolist() == [1.0, 1.0] and big["a"][[0, 7]].tolist() == [1.0, 1.0]


def test_dtype_mismatch_is_a_base_mismatch(states):
    prev, curr = states
    delta = ds.load(write_trl(prev, curr))
    target = clone_state(prev)
    target["lm_head.bias"] = target["lm_head.bias"].to(torch.bfloat16)
    before = clone_state(target)
    with pytest.raises(ds.BaseMismatchError, match="lm_head.bias"):
        delta.apply_(target)
    assert_states_equal(target, before)


def test_trl_tensor_missing_from_target(states):
    prev, curr = states
    delta = ds.load(write_trl(prev, curr))
    target = clone_state(prev)
    del target["model.layers.0.mlp.up_proj.weight"]
    before = clone_state(target)
    with pytest.raises(ds.BaseMismatchError, match="model.layers.0.mlp.up_proj.weight"):
        delta.apply_(target)
    assert_states_equal(target, before)

    # a file naming a parameter the model never had
    data = st_save(
        {"ghost.weight.indices": torch.tensor([0], dtype=torch.int32), "ghost.weight.values": torch.ones(1)},
        metadata=_v1_meta(),
    )
    target = clone_state(prev)
    with pytest.raises(ds.BaseMismatchError, match="ghost.weight"):
        ds.load(data).apply_(target)
    assert_states_equal(target, prev)
