"""Shared test helpers: bit-level equality and state copies."""

from __future__ import annotations

import numpy as np
import torch

INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t):
    """The tensor's bit patterns as an integer tensor/array, so NaN payloads and -0.0 compare exactly."""
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t).view(f"u{t.dtype.itemsize}") if t.dtype.itemsize > 0 else t
    return t.detach().cpu().contiguous().view(INT_VIEW[t.element_size()])


def assert_bits_equal(a, b, name=""):
    if isinstance(a, np.ndarray):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert np.array_equal(bits(a), bits(b)), f"{name}: bit patterns differ"
    else:
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(bits(a), bits(b)), f"{name}: bit patterns differ"


def assert_states_equal(a, b):
    assert list(a) == list(b)
    for name in a:
        assert_bits_equal(a[name], b[name], name)


def clone_state(state):
    return {k: (v.copy() if isinstance(v, np.ndarray) else v.clone()) for k, v in state.items()}
