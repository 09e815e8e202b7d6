"""Synthetic, deterministic Qwen3-0.6B-shaped bf16 weight states for the benchmarks.

``load_workload(scale, density, seed)`` returns a :class:`Workload` holding two states, ``prev`` and ``curr``, that
differ the way two consecutive RL steps of a bf16 model differ (about 99% of bf16 elements keep their bit pattern
between steps: an Adam step at RL learning rates is smaller than bf16's rounding spacing):

* ``prev`` is random: ``normal * 0.02`` for matrices and embeddings, ``1 + normal * 0.02`` for the norm weights,
  rounded to bf16. For speed each element is drawn from a per-tensor table of 2**16 such bf16 values (uniform
  16-bit indices from the numpy Generator's raw bits), which is, for bf16, the same distribution truncated at ~4.3σ.
* ``curr`` is ``prev`` with a fraction ``density`` of the elements of every tensor changed. Changed positions are an
  independent Bernoulli(``density``) draw per element, so they are uniformly scattered within each tensor and the
  gaps between them are geometric (drawn directly as geometric gaps). Small tensors (norms) often get no change.
* The changes are sampled **directly on the 16-bit pattern** (the int16/uint16 view of the bf16 value), not on the
  float value: about 90% of the changed elements move by ±1 in their bit pattern, 4% by ±2, 5.5% by ±3..±200
  (uniform magnitude) and 0.5% get their sign flipped (pattern XOR 0x8000). Additions wrap modulo 2**16 and never
  are zero, so every selected element really changes. With these weight magnitudes no NaN or Inf is produced,
  but all comparisons in the suite are made on the integer views anyway.

Shapes follow Qwen3-0.6B's configuration (28 layers, hidden 1024, intermediate 3072, 16 query and 8 KV heads of
dim 128, vocab 151936, tied embeddings, 596M params).
``scale`` shrinks the model for smoke runs: 1.0 is the full model; below it the vocabulary shrinks by ``scale`` and
the layer count by ``scale`` (at least one layer); once fewer than one layer would remain, the hidden size shrinks
too (by ``sqrt(28 * scale)``, rounded to a multiple of 64) so the parameter count keeps roughly following ``scale``.
``scale=0.01`` gives about 4.7M params, ``scale=0.005`` about 2.5M.

Both states are kept as one flat uint16 buffer each (``prev_flat`` / ``curr_flat``); ``prev`` and ``curr`` are dicts
of bf16 torch tensors viewing into those buffers (row-major, HF names). Generated buffers are cached under
``benches/.cache/`` as ``.npy`` files plus a JSON layout, keyed by scale, density, seed and the generator version,
so reruns only read them back.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from deltasync_rs._workload import (
    GENERATOR_VERSION,
    generate,
    qwen3_shapes,
    qwen_7b_shapes,
    write_checkpoints,
)

__all__ = [
    "CACHE_DIR",
    "GENERATOR_VERSION",
    "Workload",
    "generate",
    "load_or_generate",
    "load_workload",
    "qwen3_shapes",
    "qwen_7b_shapes",
    "torch_views",
    "write_checkpoints",
]

CACHE_DIR = Path(__file__).resolve().parent / ".cache"


@dataclass
class Workload:
    scale: float
    density: float
    seed: int
    names: list[str]
    shapes: list[tuple[int, ...]]
    offsets: list[int]  # element offset of each tensor in the flat buffers
    changed: list[int]  # true number of changed elements per tensor
    prev_flat: np.ndarray  # uint16 bit patterns
    curr_flat: np.ndarray
    prev: dict = field(default_factory=dict)  # name -> torch.bfloat16 view into prev_flat
    curr: dict = field(default_factory=dict)

    @property
    def num_elements(self) -> int:
        return int(self.prev_flat.size)

    @property
    def num_changed(self) -> int:
        return int(sum(self.changed))

    @property
    def nbytes(self) -> int:
        return int(self.prev_flat.nbytes)

    def clone_prev(self) -> dict:
        """A fresh, independently allocated copy of ``prev`` (one tensor per name, as a model would hold)."""
        return {name: t.clone() for name, t in self.prev.items()}


def cache_key(scale: float, density: float, seed: int) -> str:
    return f"qwen3-0.6b_v{GENERATOR_VERSION}_scale{scale:g}_density{density:g}_seed{seed}"


def _atomic_save_npy(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def load_or_generate(scale: float = 1.0, density: float = 0.01, seed: int = 0, cache_dir: Path | None = CACHE_DIR):
    """(prev_flat, curr_flat, layout), read from the cache when present, else generated and cached."""
    if cache_dir is None:
        return generate(scale, density, seed)
    cache_dir = Path(cache_dir)
    key = cache_key(scale, density, seed)
    meta_path = cache_dir / f"{key}.json"
    prev_path = cache_dir / f"{key}.prev.npy"
    curr_path = cache_dir / f"{key}.curr.npy"
    if meta_path.exists() and prev_path.exists() and curr_path.exists():
        layout = json.loads(meta_path.read_text())
        prev, curr = np.load(prev_path), np.load(curr_path)
        if prev.dtype == np.uint16 and prev.shape == curr.shape == (layout["num_elements"],):
            return prev, curr, layout
    prev, curr, layout = generate(scale, density, seed)
    cache_dir.mkdir(parents=True, exist_ok=True)
    _atomic_save_npy(prev_path, prev)
    _atomic_save_npy(curr_path, curr)
    tmp = meta_path.with_name(f".{meta_path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(layout))
    os.replace(tmp, meta_path)  # written last: its presence marks a complete entry
    return prev, curr, layout


def torch_views(flat: np.ndarray, layout: dict) -> dict:
    """name -> bf16 torch tensor viewing into ``flat`` (no copy)."""
    import torch

    base = torch.from_numpy(flat.view(np.int16)).view(torch.bfloat16)
    out = {}
    for name, shape, off in zip(layout["names"], layout["shapes"], layout["offsets"]):
        n = int(np.prod(shape)) if shape else 1
        out[name] = base[off : off + n].view(shape)
    return out


def load_workload(
    scale: float = 1.0, density: float = 0.01, seed: int = 0, cache_dir: Path | None = CACHE_DIR
) -> Workload:
    prev, curr, layout = load_or_generate(scale, density, seed, cache_dir)
    return Workload(
        scale=scale,
        density=density,
        seed=seed,
        names=list(layout["names"]),
        shapes=[tuple(s) for s in layout["shapes"]],
        offsets=list(layout["offsets"]),
        changed=list(layout["changed"]),
        prev_flat=prev,
        curr_flat=curr,
        prev=torch_views(prev, layout),
        curr=torch_views(curr, layout),
    )


def _main() -> None:
    import argparse
    import time

    parser = argparse.ArgumentParser(
        description="Generate (and cache) the benchmark workload, or write it as checkpoints."
    )
    parser.add_argument("scale", type=float, nargs="?", default=1.0)
    parser.add_argument("density", type=float, nargs="?", default=0.01)
    parser.add_argument("seed", type=int, nargs="?", default=0)
    parser.add_argument(
        "--checkpoints", metavar="DIR", help="write DIR/prev.safetensors and DIR/curr.safetensors instead"
    )
    parser.add_argument("--shape", choices=("0.6b", "7b"), default="0.6b", help="model shape for --checkpoints")
    args = parser.parse_args()
    t0 = time.perf_counter()
    if args.checkpoints:
        out = Path(args.checkpoints)
        out.mkdir(parents=True, exist_ok=True)
        shapes = qwen_7b_shapes() if args.shape == "7b" else qwen3_shapes(args.scale)
        changed = write_checkpoints(out / "prev.safetensors", out / "curr.safetensors", shapes, args.density, args.seed)
        total = sum(int(np.prod(s)) for _, s in shapes)
        print(
            f"{out}: {len(shapes)} tensors, {total:,} elements, {changed:,} changed, {time.perf_counter() - t0:.1f} s"
        )
        return
    w = load_workload(args.scale, args.density, args.seed)
    print(
        f"scale={args.scale} density={args.density} seed={args.seed}: {len(w.names)} tensors, {w.num_elements:,} "
        f"elements, {w.num_changed:,} changed ({w.num_changed / w.num_elements:.4%}), {time.perf_counter() - t0:.2f} s"
    )


if __name__ == "__main__":  # python benches/workload.py [scale] [density] [seed] [--checkpoints DIR --shape 7b]
    _main()
