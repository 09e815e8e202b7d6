"""Fixtures for the benchmark suite.

The workload scale is chosen once per session:

* ``--benchmark-disable`` (the suite run as plain tests, e.g. in CI): a tiny state, ``scale=0.005`` (~2.5M params);
* otherwise the full Qwen3-0.6B shape, ``scale=1.0`` (596M params, 1.19 GB per state);
* ``DELTASYNC_BENCH_SCALE`` overrides either default. ``DELTASYNC_BENCH_DENSITY`` (default 0.01) and
  ``DELTASYNC_BENCH_SEED`` (default 0) choose the rest of the workload.

Benchmarks are repeated ``rounds`` times after ``warmup_rounds`` (see the ``pedantic_opts`` fixture); both are smaller
at small scales.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workload as _workload  # noqa: E402

TINY_SCALE = 0.005
FULL_SCALE = 1.0


def _scale(config: pytest.Config) -> float:
    env = os.environ.get("DELTASYNC_BENCH_SCALE")
    if env:
        return float(env)
    disabled = bool(config.getoption("benchmark_disable", default=False))
    return TINY_SCALE if disabled else FULL_SCALE


@pytest.fixture(scope="session")
def bench_scale(pytestconfig: pytest.Config) -> float:
    return _scale(pytestconfig)


@pytest.fixture(scope="session")
def workload(bench_scale: float) -> _workload.Workload:
    density = float(os.environ.get("DELTASYNC_BENCH_DENSITY", "0.01"))
    seed = int(os.environ.get("DELTASYNC_BENCH_SEED", "0"))
    w = _workload.load_workload(bench_scale, density, seed)
    assert w.num_changed > 0, "the workload has no changed element; raise the density or the scale"
    return w


@pytest.fixture(scope="session")
def pedantic_opts(bench_scale: float) -> dict:
    if bench_scale >= 0.1:
        return {"rounds": 5, "warmup_rounds": 1, "iterations": 1}
    return {"rounds": 3, "warmup_rounds": 1, "iterations": 1}


def pytest_report_header(config: pytest.Config) -> str:
    return f"deltasync benches: workload scale {_scale(config)} (DELTASYNC_BENCH_SCALE overrides)"
