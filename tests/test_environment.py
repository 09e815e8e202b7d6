"""The one-virtualenv promise: deltasync-rs, torch 2.14.0 and vllm 0.33.0 import side by side."""

from __future__ import annotations

import importlib.metadata

import pytest


def test_torch_and_vllm_share_the_environment():
    vllm = pytest.importorskip("vllm")  # installed by `make setup`; a skip fails CI (DELTASYNC_NO_SKIP=1)
    import torch

    import deltasync_rs as ds

    assert importlib.metadata.version("vllm") == "0.33.0"
    assert torch.__version__.split("+")[0] == "2.14.0"
    assert vllm.__version__.startswith("0.33")
    prev = torch.zeros(4, dtype=torch.bfloat16)
    assert ds.diff(prev, prev + 1).num_changed == 4


def test_package_metadata():
    import deltasync_rs as ds

    assert importlib.metadata.version("deltasync-rs") == ds.__version__
