"""Shared test helpers: bit-level equality, state copies, and scenarios run in another virtualenv."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
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


def run_scenario(python, setup: str, script: str, *args: str, timeout: int, logs=None, **environment: str) -> dict:
    """Runs ``tests/<script>`` with another virtualenv's ``python`` (skipped, naming the ``make`` target ``setup``,
    when it is missing) and returns the JSON of its last ``RESULT`` line; on failure, prints the end of its output
    and of every ``*.log`` under ``logs``, and fails the test."""
    if not Path(python).exists():
        pytest.skip(f"no environment at {python}: run `make {setup}`")
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONUNBUFFERED="1", **environment)
    env.pop("VLLM_TARGET_DEVICE", None)  # the CPU build knows its platform
    process = subprocess.run(
        [str(python), str(root / "tests" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=root,
    )
    results = [line for line in process.stdout.splitlines() if line.startswith("RESULT ")]
    if process.returncode != 0 or not results:
        sys.stderr.write(process.stdout[-20000:] + process.stderr[-20000:])
        for log in sorted(Path(logs).glob("*.log")) if logs is not None else []:
            sys.stderr.write(f"--- {log.name}\n" + log.read_text(errors="replace")[-5000:])
        pytest.fail(f"{script} {' '.join(args)} failed (rc {process.returncode}); its output is above")
    return json.loads(results[-1].removeprefix("RESULT "))


def counting_store(root):
    """A LocalStore over an existing folder that counts, in its ``read`` Counter, the bytes each key gave through
    every read method (whole, small, to a file, by range, opened to be read in place)."""
    from collections import Counter

    import deltasync_rs as ds

    class Counting(ds.LocalStore):
        def get(self, key):
            data = super().get(key)
            self.read[key] += len(data)
            return data

        def get_small(self, key, max_bytes):
            data = super().get_small(key, max_bytes)
            self.read[key] += len(data)
            return data

        def get_file(self, key, out):
            done = super().get_file(key, out)
            self.read[key] += done
            return done

        def get_range(self, key, start, length):
            data = super().get_range(key, start, length)
            self.read[key] += len(data)
            return data

        def open_local(self, key):  # opened to be read in place: every reader of it reads it whole
            file = super().open_local(key)
            self.read[key] += os.fstat(file.fileno()).st_size
            return file

    store = Counting(root, create=False)
    store.read = Counter()
    return store
