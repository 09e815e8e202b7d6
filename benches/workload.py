"""Synthetic, deterministic Qwen3-0.6B-shaped bf16 weight states for the benchmarks.

``load_workload(scale, density, seed)`` returns a :class:`Workload` holding two states, ``prev`` and ``curr``, that
differ the way two consecutive RL steps of a bf16 model differ (REFERENCE.md §1):

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

Shapes follow REFERENCE.md §4 (28 layers, hidden 1024, intermediate 3072, vocab 151936, tied embeddings, 596M params).
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
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

#: Bump when the generated data changes, so stale caches are not reused.
GENERATOR_VERSION = 2
CACHE_DIR = Path(__file__).resolve().parent / ".cache"

VOCAB = 151936
HIDDEN = 1024
INTERMEDIATE = 3072
LAYERS = 28
HEAD_DIM = 128
Q_HEADS = 16
KV_HEADS = 8

# Categories of bit-pattern change, as cumulative probabilities: ±1, ±2, ±3..±200, sign flip.
_P_ONE = 0.90
_P_TWO = 0.94
_P_LARGE = 0.995
_LARGE_MAX = 200

_CHUNK = 1 << 23  # elements generated per chunk, to bound temporaries


def qwen3_shapes(scale: float = 1.0) -> list[tuple[str, tuple[int, ...]]]:
    """HF parameter names and shapes of a Qwen3-0.6B-like model shrunk by ``scale`` (see the module docstring)."""
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    if scale >= 1.0:
        layers, hidden, vocab, head_dim = LAYERS, HIDDEN, VOCAB, HEAD_DIM
    else:
        layers = max(1, round(LAYERS * scale))
        width = min(1.0, math.sqrt(LAYERS * scale))
        hidden = max(64, int(round(HIDDEN * width / 64)) * 64)
        vocab = max(256, round(VOCAB * scale))
        head_dim = min(HEAD_DIM, hidden // 2)
    q_dim = hidden * Q_HEADS * HEAD_DIM // HIDDEN  # 2048 at full size
    kv_dim = hidden * KV_HEADS * HEAD_DIM // HIDDEN  # 1024 at full size
    inter = hidden * INTERMEDIATE // HIDDEN
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (q_dim, hidden)),
            (p + "self_attn.k_proj.weight", (kv_dim, hidden)),
            (p + "self_attn.v_proj.weight", (kv_dim, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, q_dim)),
            (p + "self_attn.q_norm.weight", (head_dim,)),
            (p + "self_attn.k_norm.weight", (head_dim,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
        ]
    shapes.append(("model.norm.weight", (hidden,)))
    return shapes


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


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even (inputs are finite)."""
    bits = x.view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    return ((bits + rounding) >> 16).astype(np.uint16)


def _change_positions(rng: np.random.Generator, n: int, density: float) -> np.ndarray:
    """Ascending positions in [0, n) where each element is chosen independently with probability ``density``."""
    if density <= 0 or n == 0:
        return np.empty(0, dtype=np.int64)
    if density >= 1:
        return np.arange(n, dtype=np.int64)
    parts = []
    start = -1  # position of the last chosen element
    while True:
        expected = (n - 1 - start) * density
        m = int(expected + 8 * math.sqrt(expected) + 16)
        pos = start + np.cumsum(rng.geometric(density, size=m), dtype=np.int64)
        if pos[-1] >= n:
            parts.append(pos[pos < n])
            break
        parts.append(pos)
        start = int(pos[-1])
    return np.concatenate(parts)


def _change_bits(rng: np.random.Generator, old: np.ndarray) -> np.ndarray:
    """New uint16 bit patterns for the changed elements (see the module docstring for the mix)."""
    k = old.size
    u = rng.random(k)
    sign = rng.integers(0, 2, size=k, dtype=np.int32) * 2 - 1
    magnitude = np.where(u < _P_ONE, 1, np.where(u < _P_TWO, 2, rng.integers(3, _LARGE_MAX + 1, size=k)))
    new = ((old.astype(np.int32) + sign * magnitude) & 0xFFFF).astype(np.uint16)
    flip = u >= _P_LARGE
    new[flip] = old[flip] ^ np.uint16(0x8000)
    return new


def generate(scale: float = 1.0, density: float = 0.01, seed: int = 0):
    """Builds the two flat uint16 buffers and the layout, without touching the cache."""
    spec = qwen3_shapes(scale)
    names = [n for n, _ in spec]
    shapes = [s for _, s in spec]
    sizes = [int(np.prod(s)) for s in shapes]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    total = int(offsets[-1])
    prev = np.empty(total, dtype=np.uint16)
    curr = np.empty(total, dtype=np.uint16)
    changed = []
    for i, (name, n) in enumerate(zip(names, sizes)):
        # An independent stream per tensor: the data for a name does not depend on generation order.
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, GENERATOR_VERSION, i])))
        dst = prev[offsets[i]: offsets[i] + n]
        # bf16 patterns of normal(0, 0.02) (norms: 1 + normal(0, 0.02)): a table of 2**16 normal draws, rounded to
        # bf16, indexed by uniform random 16-bit numbers (4 per raw 64-bit draw). Much faster than one normal draw
        # per element, and bf16 has far fewer than 2**16 distinct values in this range, so nothing visible is lost.
        x = rng.standard_normal(1 << 16, dtype=np.float32) * np.float32(0.02)
        if name.endswith("norm.weight"):
            x += np.float32(1.0)
        table = _bf16_bits(x)
        for lo in range(0, n, _CHUNK):
            m = min(_CHUNK, n - lo)
            draws = rng.bit_generator.random_raw((m + 3) // 4).view(np.uint16)[:m]
            dst[lo: lo + m] = table[draws]
        out = curr[offsets[i]: offsets[i] + n]
        out[:] = dst
        pos = _change_positions(rng, n, density)
        out[pos] = _change_bits(rng, dst[pos])
        changed.append(int(pos.size))
    layout = {
        "generator_version": GENERATOR_VERSION,
        "scale": scale,
        "density": density,
        "seed": seed,
        "names": names,
        "shapes": [list(s) for s in shapes],
        "offsets": [int(o) for o in offsets[:-1]],
        "changed": changed,
        "num_elements": total,
    }
    return prev, curr, layout


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
        out[name] = base[off: off + n].view(shape)
    return out


def load_workload(scale: float = 1.0, density: float = 0.01, seed: int = 0,
                  cache_dir: Path | None = CACHE_DIR) -> Workload:
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


if __name__ == "__main__":  # python benches/workload.py [scale] [density] [seed]
    import sys
    import time

    args = sys.argv[1:]
    s = float(args[0]) if args else 1.0
    d = float(args[1]) if len(args) > 1 else 0.01
    sd = int(args[2]) if len(args) > 2 else 0
    t0 = time.perf_counter()
    w = load_workload(s, d, sd)
    print(f"scale={s} density={d} seed={sd}: {len(w.names)} tensors, {w.num_elements:,} elements, "
          f"{w.num_changed:,} changed ({w.num_changed / w.num_elements:.4%}), {time.perf_counter() - t0:.2f} s")
