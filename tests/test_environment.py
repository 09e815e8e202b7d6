"""The one-virtualenv promise: deltasync-rs, torch 2.14.0 and vllm 0.33.0 import side by side."""

from __future__ import annotations

import importlib.metadata
import os

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


def test_every_scan_kernel_writes_the_same_bytes():
    """`DELTASYNC_SCAN_KERNEL` picks the compare kernel once per process; each must give identical deltas (their
    base identities included: the AVX2 and AVX-512 kernels hash the base in the compare's pass, the others apart)."""
    import subprocess
    import sys

    script = (
        "import numpy as np, deltasync_rs as ds, sys\n"
        "rng = np.random.default_rng(7)\n"
        "old = rng.integers(0, 2**16, 300_001, dtype=np.uint16)\n"
        "new = old.copy()\n"
        "at = rng.choice(old.size, 6_000, replace=False)\n"
        "new[at] += rng.choice(np.array([1, 65535, 2, 300], dtype=np.uint16), at.size)\n"
        "prev = {'w': old.view(np.int16)}\n"
        "curr = {'w': new.view(np.int16)}\n"
        "sys.stdout.buffer.write(ds.diff(prev, curr).to_bytes() + ds.diff(prev, curr, codec='varint').to_bytes())\n"
        # The mirror's one pass (compare, hash the base, copy the changes in) with each kernel too.
        "mirror = ds.Mirror(prev, step=0)\n"
        "sys.stdout.buffer.write(mirror.advance(curr, step=1).to_bytes())\n"
        "assert (mirror.tensors['w'] == curr['w']).all()\n"
        "sys.stderr.write(ds._core.scan_kernel())\n"
    )
    outputs = {}
    used = {}
    for kernel in ("", "portable", "sse2", "avx2", "avx512"):
        env = {**__import__("os").environ, "DELTASYNC_SCAN_KERNEL": kernel}
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, check=True)
        outputs[kernel] = done.stdout
        used[kernel] = done.stderr.decode()
    # Never more than the CPU has: a kernel asked for is used, or the best one available where it is missing.
    assert used[""] in ("avx512", "avx2", "sse2", "portable")
    assert all(used[k] in (k, used[""]) for k in used), used
    assert len(set(outputs.values())) == 1
    assert len(outputs[""]) > 1000


@pytest.mark.parametrize(
    ("variable", "value", "warned"),
    [
        ("DELTASYNC_NUM_THREADS", "two", True),
        ("DELTASYNC_NUM_THREADS", "0", True),
        ("DELTASYNC_NUM_THREADS", " 2 ", False),
        ("DELTASYNC_NUM_THREADS", "20000", True),
        ("DELTASYNC_SCAN_KERNEL", "avx-512", True),
        ("DELTASYNC_SCAN_KERNEL", "sse2", False),
    ],
)
def test_unusable_settings_warn_on_import(variable, value, warned):
    """The core falls back to its defaults on a value it cannot use; the import says so instead of staying silent."""
    import os
    import subprocess
    import sys

    env = {**os.environ, variable: value}
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", "import deltasync_rs"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert (f"{variable}={value.strip()!r}" in done.stderr) == warned, done.stderr


def test_thread_count_is_bounded():
    """DELTASYNC_NUM_THREADS=20000 once spawned 20,000 threads; the pool is capped at 4 per CPU (at least 256)."""
    import os
    import subprocess
    import sys

    script = (
        "import warnings, numpy as np, deltasync_rs as ds\n"
        "bound = ds.get_num_threads()\n"
        "assert 256 <= bound <= max(256, 4 * os.cpu_count()), bound\n"
        "assert ds.diff({'w': np.zeros(8, np.float32)}, {'w': np.ones(8, np.float32)}).num_changed == 8\n"
        "ds.set_num_threads(3)\n"
        "assert ds.get_num_threads() == 3\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    ds.set_num_threads(10**6)\n"
        "assert ds.get_num_threads() == bound, ds.get_num_threads()\n"
        "assert any('more threads than this machine can use' in str(w.message) for w in caught), caught\n"
    )
    env = {**os.environ, "DELTASYNC_NUM_THREADS": "20000"}
    subprocess.run([sys.executable, "-W", "ignore", "-c", "import os\n" + script], env=env, check=True)


@pytest.mark.parametrize("module_skip", [False, True])
def test_ci_turns_skips_into_failures(module_skip):
    """Under DELTASYNC_NO_SKIP=1 (set by .ci/run) a skip fails the run, in a test or at collection; a GPU skip does
    not. Without the variable both are plain skips."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    probe = str(root / "tests" / "skip_probe.py")

    def run(no_skip: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "DELTASYNC_NO_SKIP": no_skip, "SKIP_PROBE_MODULE": "1" if module_skip else "0"}
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", probe]
        return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=120)

    strict, lenient = run("1"), run("0")
    assert lenient.returncode == (5 if module_skip else 0), lenient.stdout + lenient.stderr  # 5: nothing ran
    assert strict.returncode in (1, 2), strict.stdout + strict.stderr  # 2: an error at collection
    assert "skipped in CI, where every test must run" in strict.stdout
    if not module_skip:
        assert "1 failed, 1 skipped" in strict.stdout, strict.stdout
