"""The state digest, recomputed here from its definition in docs/format.md §10 with the xxhash package."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

import deltasync_rs as ds
from deltasync_rs import _arrays


def reference_digest(state) -> str:
    xxhash = pytest.importorskip("xxhash")
    outer = xxhash.xxh3_128()
    for name in sorted(state, key=lambda n: n.encode()):
        tensor = state[name]
        dtype, shape = _arrays.describe(tensor, name)
        inner = xxhash.xxh3_128()
        inner.update(dtype.encode() + b"\0")
        inner.update(struct.pack("<Q", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape))
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy() if isinstance(tensor, torch.Tensor) else tensor
        inner.update(raw.tobytes())
        outer.update(name.encode() + b"\0" + inner.intdigest().to_bytes(16, "little"))
    return f"{outer.intdigest():032x}"


def test_digest_matches_its_specification():
    g = torch.Generator().manual_seed(0)
    state = {
        "b.weight": torch.randn(7, 3, generator=g).bfloat16(),
        "a": torch.arange(5, dtype=torch.int32),
        "é": np.float16([1.5, -0.0]),
        "empty": torch.zeros(0, 4),
    }
    assert ds.state_digest(state) == reference_digest(state)


def test_digest_sees_every_bit_and_ignores_order():
    state = {"x": torch.zeros(4, dtype=torch.bfloat16), "y": torch.ones(2)}
    digest = ds.state_digest(state)
    assert ds.state_digest(dict(reversed(list(state.items())))) == digest
    flipped = {"x": state["x"].clone(), "y": state["y"]}
    flipped["x"].view(torch.int16)[3] = -32768  # -0.0: equal as a float, different as bits
    assert ds.state_digest(flipped) != digest
    assert ds.state_digest({"x": state["x"].view(2, 2), "y": state["y"]}) != digest
