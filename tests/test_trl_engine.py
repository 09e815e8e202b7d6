"""TRL's AsyncGRPOTrainer (trl 1.16.0) keeps a real CPU vLLM server in step through
ds.integrations.trl.DeltaSyncWeightTransfer, and after every sync the server generates exactly what a fresh server on
the weights the trainer sent generates (tests/trl_scenario.py). Runs in the engine virtualenv, which has trl: ``make setup-engine``."""

from __future__ import annotations

import os
from pathlib import Path

from tests.helpers import run_scenario

ROOT = Path(__file__).resolve().parent.parent
TRL_PYTHON = Path(os.environ.get("DELTASYNC_TRL_PYTHON", ROOT / ".venv-engine" / "bin" / "python"))


def test_async_grpo_keeps_vllm_serve_in_step(tmp_path):
    result = run_scenario(
        TRL_PYTHON,
        "setup-trl",
        "trl_scenario.py",
        str(tmp_path),
        timeout=1500,
        logs=tmp_path,
        TRL_EXPERIMENTAL_SILENCE="1",
    )
    assert result["steps"] == [0, 1, 2, 3]  # the cold sync, then one per optimizer step
    assert result["server_steps"] == result["steps"]
    assert result["mismatches"] == [], f"generation differs from a fresh server at steps {result['mismatches']}"
    assert result["steps_whose_generation_moved"] >= 1, "the updates never moved generation: the check is weak"
