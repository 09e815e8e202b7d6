"""Synthetic, deterministic bf16 weight states shaped like Qwen3-0.6B (or a 7B model), and their successor one
training step later: the workload of the benchmarks in ``benches/`` and of ``deltasync bench``.

``generate(scale, density, seed)`` returns two flat uint16 buffers of bf16 bit patterns and their layout;
``write_checkpoints`` streams the same kind of pair, tensor by tensor, into two safetensors files (for checkpoints
larger than memory). ``benches/workload.py`` documents the distribution and caches the buffers on disk.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np

#: Bump when the generated data changes, so stale caches are not reused.
GENERATOR_VERSION = 2

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
    """Builds the two flat uint16 buffers and the layout, without touching any cache."""
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
        prev[offsets[i] : offsets[i] + n], curr[offsets[i] : offsets[i] + n], count = _tensor_pair(
            name, n, i, density, seed
        )
        changed.append(count)
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


#: Qwen2.5-7B-like shapes: vocab 152064, hidden 3584, intermediate 18944, 28 layers, 28 query heads and 4 KV heads of
#: dim 128, untied lm_head; 7.6B params, 15.2 GB in bf16.
def qwen_7b_shapes() -> list[tuple[str, tuple[int, ...]]]:
    vocab, hidden, inter, layers, kv_dim = 152064, 3584, 18944, 28, 4 * 128
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.k_proj.weight", (kv_dim, hidden)),
            (p + "self_attn.v_proj.weight", (kv_dim, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
        ]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return shapes


def _tensor_pair(name: str, n: int, index: int, density: float, seed: int) -> tuple[np.ndarray, np.ndarray, int]:
    """One tensor's old and new uint16 bit patterns and its number of changes (see ``generate``)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, GENERATOR_VERSION, index])))
    prev = np.empty(n, dtype=np.uint16)
    x = rng.standard_normal(1 << 16, dtype=np.float32) * np.float32(0.02)
    if name.endswith("norm.weight"):
        x += np.float32(1.0)
    table = _bf16_bits(x)
    for lo in range(0, n, _CHUNK):
        m = min(_CHUNK, n - lo)
        draws = rng.bit_generator.random_raw((m + 3) // 4).view(np.uint16)[:m]
        prev[lo : lo + m] = table[draws]
    curr = prev.copy()
    pos = _change_positions(rng, n, density)
    curr[pos] = _change_bits(rng, prev[pos])
    return prev, curr, int(pos.size)


def write_checkpoints(
    prev_path: str | Path,
    curr_path: str | Path,
    shapes: list[tuple[str, tuple[int, ...]]],
    density: float = 0.01,
    seed: int = 0,
) -> int:
    """Writes two bf16 safetensors checkpoints that differ as one training step, one tensor at a time, so
    memory stays near two copies of the largest tensor. Returns the number of changed elements."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes:
        nbytes = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    changed = 0
    with open(prev_path, "wb") as prev_file, open(curr_path, "wb") as curr_file:
        for f in (prev_file, curr_file):
            f.write(struct.pack("<Q", len(encoded)) + encoded)
        for index, (name, shape) in enumerate(shapes):
            prev, curr, count = _tensor_pair(name, math.prod(shape), index, density, seed)
            prev_file.write(prev.tobytes())
            curr_file.write(curr.tobytes())
            changed += count
            del prev, curr
    return changed
