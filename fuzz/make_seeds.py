"""Writes the seed corpus in fuzz/corpus/ from tests/vectors/*.safetensors and from TRL patches made by the
reference TRL writer in tests/test_trl.py. Run from the repository root: `python fuzz/make_seeds.py`."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.test_trl import write_trl  # noqa: E402

CORPUS = ROOT / "fuzz" / "corpus"


def trl_patches() -> dict[str, bytes]:
    g = torch.Generator().manual_seed(3)
    prev = {"w": torch.randn(8, 8, generator=g).to(torch.bfloat16), "b": torch.arange(6, dtype=torch.float32)}
    curr = {k: v.clone() for k, v in prev.items()}
    curr["w"].view(-1)[::5] += 1
    curr["b"][4] = -1
    return {
        "v1_raw": write_trl(prev, curr, version=1),
        "v1_full": write_trl(prev, curr, version=1, sparse=False),
        "v3_raw": write_trl(prev, curr, version=3, encoding="raw"),
        "v3_gap": write_trl(prev, curr, version=3, encoding="gap_delta"),
    }


def main() -> None:
    vectors = {p.stem: p.read_bytes() for p in sorted((ROOT / "tests" / "vectors").glob("*.safetensors"))}
    trl = trl_patches()
    targets = {
        "load_delta": {**vectors, "trl_v3_gap": trl["v3_gap"]},
        # The apply target reads its last byte as the size error to inject: 0, none.
        "apply_delta": {name: data + b"\0" for name, data in {**vectors, "trl_v1_raw": trl["v1_raw"]}.items()},
        "read_trl": trl,
    }
    for target, seeds in targets.items():
        folder = CORPUS / target
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for name, data in seeds.items():
            (folder / f"seed-{name}").write_bytes(data)


if __name__ == "__main__":
    main()
