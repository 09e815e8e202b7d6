"""The `deltasync` command in a process where torch cannot be imported: publish, pull, log, verify, diff, apply and
inspect work with numpy alone (bf16 and fp8 through ml_dtypes); plus the command's small usability fixes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

PYTHON_PATH = str(Path(__file__).resolve().parents[1] / "python")

# Runs the CLI's main() after installing a meta-path finder that refuses the named top-level modules, so an
# `import torch` anywhere in the command raises ImportError as it would where torch is not installed.
_BLOCKED_MAIN = """
import sys
blocked = set(sys.argv[1].split(","))

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, Blocker())
for name in list(sys.modules):
    if name.split(".")[0] in blocked:
        del sys.modules[name]
from deltasync_rs.cli import main
code = main(sys.argv[2:])
assert not blocked & {name.split(".")[0] for name in sys.modules}, "a blocked module was imported"
sys.exit(code)
"""


def _deltasync(*argv, cwd, blocked=("torch",)):
    env = dict(os.environ) | {"PYTHONPATH": PYTHON_PATH}
    return subprocess.run(
        [sys.executable, "-c", _BLOCKED_MAIN, ",".join(blocked), *map(str, argv)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    state = {
        "model.embed_tokens.weight": rng.standard_normal((64, 16)).astype(ml_dtypes.bfloat16),
        "model.norm.weight": rng.standard_normal(16).astype(np.float32),
        "model.scale": rng.standard_normal(8).astype(ml_dtypes.float8_e4m3fn),
        "model.count": np.array(7, dtype=np.int64),
    }
    step_rng = np.random.default_rng(seed + 1)
    for array in state.values():
        flat = array.reshape(-1).view(np.uint8)
        flat[step_rng.integers(0, flat.size, size=max(1, flat.size // 50))] ^= 1  # a few bits per step
    return state


def _bytes_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype and a[n].shape == b[n].shape and a[n].tobytes() == b[n].tobytes() for n in a
    )


def _load(path: Path) -> dict[str, np.ndarray]:
    import safetensors

    data = path.read_bytes()
    dtypes = {"BF16": ml_dtypes.bfloat16, "F32": np.float32, "F8_E4M3": ml_dtypes.float8_e4m3fn, "I64": np.int64}
    return {
        name: np.frombuffer(t["data"], dtype=dtypes[t["dtype"]]).reshape(t["shape"])
        for name, t in safetensors.deserialize(data)
    }


def test_publish_pull_log_verify_without_torch(tmp_path):
    store = tmp_path / "store"
    states = [_state(step) for step in range(3)]
    for step, state in enumerate(states):
        save_file(state, tmp_path / f"ckpt{step}.safetensors")
        whole = ["--whole-sha256"] if step == 2 else []
        result = _deltasync(
            "publish", f"ckpt{step}.safetensors", "--store", store, "--step", step, "--anchor-every", 2, *whole,
            cwd=tmp_path,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert f"published step {step}" in result.stdout
    # Anchors at steps 0 and 2: the second with its whole-file SHA-256, so version 1 (docs/format.md §10).
    entries = [json.loads((store / "manifest" / f"step_{step:012d}.json").read_bytes()) for step in (0, 2)]
    assert [(e["version"], "sha256" in e["anchor"]) for e in entries] == [(2, False), (1, True)]

    result = _deltasync("log", "--store", store, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "3 steps" in result.stdout
    result = _deltasync("verify", "--store", store, cwd=tmp_path)
    assert result.returncode == 0 and "checks out" in result.stdout, result.stderr

    result = _deltasync("pull", "--store", store, "-o", "out.safetensors", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert _bytes_equal(_load(tmp_path / "out.safetensors"), states[2])
    result = _deltasync("pull", "--store", store, "-o", "one.safetensors", "--step", 1, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert _bytes_equal(_load(tmp_path / "one.safetensors"), states[1])


def test_diff_apply_inspect_without_torch(tmp_path):
    save_file(_state(0), tmp_path / "prev.safetensors")
    save_file(_state(1), tmp_path / "curr.safetensors")
    result = _deltasync("diff", "prev.safetensors", "curr.safetensors", "-o", "d.safetensors", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    result = _deltasync("apply", "prev.safetensors", "d.safetensors", "-o", "out.safetensors", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "curr.safetensors").read_bytes()
    result = _deltasync("inspect", "d.safetensors", cwd=tmp_path)
    assert result.returncode == 0 and "model.embed_tokens.weight" in result.stdout, result.stderr


def test_bf16_without_ml_dtypes_names_the_package(tmp_path):
    save_file(_state(0), tmp_path / "ckpt.safetensors")
    result = _deltasync(
        "publish", "ckpt.safetensors", "--store", "store", "--step", 0, cwd=tmp_path, blocked=("torch", "ml_dtypes")
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "BF16" in result.stderr and "pip install ml_dtypes" in result.stderr


def test_no_arguments_prints_the_help(tmp_path):
    result = _deltasync(cwd=tmp_path)
    assert result.returncode == 2
    assert "usage: deltasync" in result.stderr and "show this help message" in result.stderr
    for command in ("diff", "apply", "inspect", "publish", "pull", "log", "verify", "bench"):
        assert command in result.stderr


def test_trl_format_without_abs_values_names_the_flag(tmp_path):
    save_file(_state(0), tmp_path / "prev.safetensors")
    save_file(_state(1), tmp_path / "curr.safetensors")
    result = _deltasync(
        "diff", "prev.safetensors", "curr.safetensors", "-o", "t.safetensors", "--format", "trl", cwd=tmp_path
    )
    assert result.returncode == 1
    assert "--values abs" in result.stderr and 'values="abs"' not in result.stderr
    assert not (tmp_path / "t.safetensors").exists()


@pytest.mark.parametrize(("count", "noun"), [(1, "1 tensor,"), (2, "2 tensors,")])
def test_counts_agree_in_number(tmp_path, count, noun):
    prev, curr = _state(0), _state(1)
    names = list(prev)[:count]
    save_file({n: prev[n] for n in names}, tmp_path / "prev.safetensors")
    save_file({n: curr[n] for n in names}, tmp_path / "curr.safetensors")
    result = _deltasync("diff", "prev.safetensors", "curr.safetensors", "-o", "d.safetensors", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert noun in result.stdout


def test_inspect_of_a_trl_file_says_the_shapes_are_unknown(tmp_path):
    save_file(_state(0), tmp_path / "prev.safetensors")
    save_file(_state(1), tmp_path / "curr.safetensors")
    args = ("diff", "prev.safetensors", "curr.safetensors", "-o", "t.safetensors", "--format", "trl", "--values", "abs")
    assert _deltasync(*args, cwd=tmp_path).returncode == 0
    result = _deltasync("inspect", "t.safetensors", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (total,) = [line for line in result.stdout.splitlines() if line.startswith("total:")]
    assert "changed (shapes unknown)" in total and " of 0 elements" not in total


# Runs the CLI's main() and reports the process's peak resident set size (VmHWM) on stderr.
_PEAK_MAIN = """
import sys
from deltasync_rs.cli import main
code = main(sys.argv[1:])
peak = [int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:")][0]
print("PEAK", peak, file=sys.stderr)
sys.exit(code)
"""


def _peak_of(*argv, cwd) -> int:
    env = dict(os.environ) | {"PYTHONPATH": PYTHON_PATH}
    run = subprocess.run(
        [sys.executable, "-c", _PEAK_MAIN, *map(str, argv)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    return int(run.stderr.split("PEAK")[-1].split()[0])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_publishing_a_delta_holds_the_mapped_checkpoint_and_one_mirror(tmp_path):
    """`deltasync publish` of a later step maps the checkpoint and rebuilds the last published state into the arrays
    its publisher keeps as the mirror: the checkpoint plus one state, not a state read into memory and two more copies
    (it was 3 checkpoints' worth: 820 MB for 256 MB checkpoints, now 564 MB)."""
    size = 256 << 20
    words = np.random.default_rng(0).integers(0, 2**16, size=size // 2, dtype=np.uint16)
    state = {
        "embed.weight": words[: size // 8].view(ml_dtypes.bfloat16).reshape(-1, 1024),
        "layers.weight": words[size // 8 :].view(ml_dtypes.bfloat16).reshape(-1, 2048),
    }
    save_file(state, tmp_path / "ckpt0.safetensors")
    for array in state.values():
        array.view(np.uint16)[::97] += 1  # about 1% of the elements change
    save_file(state, tmp_path / "ckpt1.safetensors")
    del state, words
    anchor = _peak_of("publish", "ckpt0.safetensors", "--store", "store", "--step", 0, cwd=tmp_path)
    baseline = _peak_of("log", "--store", "store", cwd=tmp_path)  # the interpreter and the modules alone
    # The anchor is written straight from the mapped checkpoint: its pages, and no copy of them as a mirror.
    assert anchor - baseline <= size + (64 << 20), (anchor, baseline)
    peak = _peak_of("publish", "ckpt1.safetensors", "--store", "store", "--step", 1, cwd=tmp_path)
    assert peak - baseline <= 2 * size + (64 << 20), (peak, baseline)
    pulled = _peak_of("pull", "--store", "store", "-o", "out.safetensors", cwd=tmp_path)
    assert pulled - baseline <= size + (64 << 20), (pulled, baseline)  # the state it writes, and little more
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "ckpt1.safetensors").read_bytes()
    # The figures docs/benchmarks.md quotes (shown with pytest -s).
    print(
        f"peak RSS: anchor {anchor >> 20} MiB, publish {peak >> 20} MiB, pull {pulled >> 20} MiB, "
        f"interpreter alone {baseline >> 20} MiB"
    )


def test_publishing_a_checkpoint_with_other_tensors_than_the_store_is_refused(tmp_path):
    save_file(_state(0), tmp_path / "ckpt0.safetensors")
    result = _deltasync("publish", "ckpt0.safetensors", "--store", "store", "--step", 0, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    extra = _state(1) | {"model.extra": np.zeros(4, np.float32)}
    del extra["model.norm.weight"]
    save_file(extra, tmp_path / "ckpt1.safetensors")
    result = _deltasync("publish", "ckpt1.safetensors", "--store", "store", "--step", 1, cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "model.extra" in result.stderr and "model.norm.weight" in result.stderr and "--anchor" in result.stderr
    result = _deltasync("publish", "ckpt1.safetensors", "--store", "store", "--step", 1, "--anchor", cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def test_publishing_a_checkpoint_of_more_tensors_than_the_kernel_allows_mappings(tmp_path):
    """The checkpoint is mapped once, not once per tensor: 70,000 tensors (a mixture-of-experts model has about
    90,000) stay under the kernel's default limit of 65,530 mappings per process."""
    count = 70_000
    rng = np.random.default_rng(0)
    state = {f"experts.{i}.weight": rng.standard_normal(4).astype(np.float32) for i in range(count)}
    save_file(state, tmp_path / "ckpt0.safetensors")
    for array in list(state.values())[::7]:
        array[0] += 1
    save_file(state, tmp_path / "ckpt1.safetensors")
    for step in (0, 1):
        result = _deltasync("publish", f"ckpt{step}.safetensors", "--store", "store", "--step", step, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
    result = _deltasync("pull", "--store", "store", "-o", "out.safetensors", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert _bytes_equal(_load(tmp_path / "out.safetensors"), state)


def test_a_publisher_sharing_read_only_arrays_publishes_that_step_alone(tmp_path):
    """`publish_shared(..., read_only=True)` (what `deltasync publish` of an anchor does with the mapped checkpoint):
    the anchor is published from the arrays themselves, and any later step is refused by name, with nothing
    written into them."""
    import deltasync_rs as ds

    state = _state(0)
    for array in state.values():
        array.flags.writeable = False
    before = {name: array.copy() for name, array in state.items()}
    with ds.Publisher(tmp_path / "store", background=False) as publisher:
        with pytest.raises(ds.DeltaSyncError):
            publisher.publish_shared(0, state)  # without read_only, read-only arrays are refused
        publisher.publish_shared(0, state, read_only=True)
        with pytest.raises(ds.DeltaSyncError, match="read-only"):
            publisher.publish(1, _state(1))
    assert _bytes_equal(state, before)
    pulled = {name: np.zeros_like(array) for name, array in state.items()}
    ds.Subscriber(tmp_path / "store").pull(pulled)
    assert _bytes_equal(pulled, state)
