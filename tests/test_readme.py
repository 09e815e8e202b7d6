"""The documentation's code runs as written: every python block of README.md and docs/vllm.md, each in a fresh
process and a fresh temporary folder, and the `deltasync` commands of the README's command-line block on small
checkpoints. Blocks whose first line is the marker below need a running vLLM engine; they are left out at collection
(not skipped), and a test pins exactly which ones carry it."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", "docs/vllm.md")
ENGINE_MARKER = "# needs: a running vLLM engine"


class Block(NamedTuple):
    document: str
    heading: str
    language: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.document}:{self.heading}"


def _blocks(document: str) -> list[Block]:
    """Every fenced code block of a Markdown file, with the heading it sits under."""
    blocks, heading, language, lines = [], "(top)", None, []
    for line in (ROOT / document).read_text().splitlines():
        if language is None and line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif language is None and line.startswith("```"):
            language, lines = line[3:].strip(), []
        elif language is not None and line.startswith("```"):
            blocks.append(Block(document, heading, language, "\n".join(lines) + "\n"))
            language = None
        elif language is not None:
            lines.append(line)
    assert language is None, f"{document}: a code block is not closed"
    return blocks


def _unique_ids(blocks: list[Block]) -> list[str]:
    seen: dict[str, int] = {}
    ids = []
    for block in blocks:
        seen[block.id] = seen.get(block.id, 0) + 1
        ids.append(block.id if seen[block.id] == 1 else f"{block.id} ({seen[block.id]})")
    return ids


PYTHON_BLOCKS = [b for document in DOCUMENTS for b in _blocks(document) if b.language == "python"]
RUNNABLE = [b for b in PYTHON_BLOCKS if not b.code.startswith(ENGINE_MARKER)]


def _environment() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT / "python"), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ) | {"PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def test_engine_blocks_are_exactly_the_marked_ones():
    marked = {b.id for b in PYTHON_BLOCKS if ENGINE_MARKER in b.code}
    assert all(b.code.startswith(ENGINE_MARKER) for b in PYTHON_BLOCKS if ENGINE_MARKER in b.code), (
        "the marker must be a block's first line"
    )
    assert marked == {
        "README.md:vLLM: apply deltas inside the workers",
        "docs/vllm.md:3. Trigger a pull",
        "docs/vllm.md:8. TRL's async GRPO",
    }
    assert sum(ENGINE_MARKER in b.code for b in PYTHON_BLOCKS) == 4
    # Only the marked blocks talk to an engine.
    for block in RUNNABLE:
        assert "llm." not in block.code and "collective_rpc" not in block.code, block.id


@pytest.mark.parametrize("block", RUNNABLE, ids=_unique_ids(RUNNABLE))
def test_python_block_runs_as_written(block, tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", block.code],
        cwd=tmp_path,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"{block.id} failed:\n{result.stdout}\n{result.stderr}"


# The README's command-line block: placeholders stand for these files and values, optional `[...]` parts are left
# out, and each command runs in the block's order. `bench` generates and times a synthetic model (see benches/).
PLACEHOLDERS = {
    "PREV.safetensors": "prev.safetensors",
    "CURR.safetensors": "curr.safetensors",
    "DELTA.safetensors": "delta.safetensors",
    "BASE.safetensors": "prev.safetensors",
    "OUT.safetensors": "out.safetensors",
    "CKPT.safetensors": "curr.safetensors",
    "URL": "store",
    "N": "0",
    "M": "1",
    "R": "0",
}
NOT_RUN = {"bench"}


def _cli_commands() -> list[list[str]]:
    (block,) = [b for b in _blocks("README.md") if b.heading == "Command line" and b.language == "bash"]
    commands = []
    for line in block.code.splitlines():
        line = re.sub(r"\[[^\]]*\]", "", line.split("#")[0]).strip()
        if line:
            commands.append([PLACEHOLDERS.get(word, word) for word in shlex.split(line)])
    return commands


def _checkpoints(folder: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(5)
    prev = {"w": rng.standard_normal((32, 16)).astype(np.float32), "b": np.zeros(16, dtype=np.float16)}
    curr = {name: array.copy() for name, array in prev.items()}
    curr["w"][3, :5] += 1
    save_file(prev, folder / "prev.safetensors")
    save_file(curr, folder / "curr.safetensors")
    return prev, curr


def test_cli_block_runs_on_small_checkpoints(tmp_path):
    from safetensors.numpy import load_file

    _, curr = _checkpoints(tmp_path)
    commands = _cli_commands()
    assert [c[0] for c in commands] == ["deltasync"] * len(commands)
    ran = []
    for command in commands:
        if command[1] in NOT_RUN:
            continue
        result = subprocess.run(
            [sys.executable, "-m", "deltasync_rs.cli", *command[1:]],
            cwd=tmp_path,
            env=_environment(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, f"{shlex.join(command)}:\n{result.stdout}\n{result.stderr}"
        ran.append(command[1])
        if command[1] in ("apply", "pull"):  # both rebuild CURR: by a delta, or as the published step
            out = load_file(tmp_path / "out.safetensors")
            assert all(out[name].tobytes() == curr[name].tobytes() for name in curr), shlex.join(command)
    assert ran == ["diff", "apply", "inspect", "publish", "publish", "pull", "log", "verify"]
