"""Not collected by a normal run (the name does not start with test_): tests/test_environment.py runs it alone to check
that DELTASYNC_NO_SKIP=1 turns skips into failures, at collection and in a test, but not GPU skips."""

import os

import pytest

if os.environ.get("SKIP_PROBE_MODULE") == "1":
    pytest.importorskip("a_module_that_does_not_exist")


def test_skips():
    pytest.skip("a dependency is missing")


def test_needs_gpu():
    pytest.skip("needs a GPU: no CUDA device")
