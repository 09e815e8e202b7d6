"""Header bytes per tensor and file bytes per changed element of compact deltas, in the named layout (version 1) and
the packed one (version 2, docs/format.md §4.1), on a step of many small tensors and on the synthetic workload.

Run: `python benches/header_overhead.py`. Prints one markdown table.
"""

from __future__ import annotations

import numpy as np

import deltasync_rs as ds
from deltasync_rs import _workload


def gpt2_like(layers: int = 6, hidden: int = 384, vocab: int = 16384, positions: int = 1024):
    """A GPT-2-shaped state of 4 + 12 * layers tensors (76 for 6 layers), bf16 bit patterns."""
    shapes = {"transformer.wte.weight": (vocab, hidden), "transformer.wpe.weight": (positions, hidden)}
    for i in range(layers):
        p = f"transformer.h.{i}."
        shapes |= {
            p + "ln_1.weight": (hidden,),
            p + "ln_1.bias": (hidden,),
            p + "attn.c_attn.weight": (hidden, 3 * hidden),
            p + "attn.c_attn.bias": (3 * hidden,),
            p + "attn.c_proj.weight": (hidden, hidden),
            p + "attn.c_proj.bias": (hidden,),
            p + "ln_2.weight": (hidden,),
            p + "ln_2.bias": (hidden,),
            p + "mlp.c_fc.weight": (hidden, 4 * hidden),
            p + "mlp.c_fc.bias": (4 * hidden,),
            p + "mlp.c_proj.weight": (4 * hidden, hidden),
            p + "mlp.c_proj.bias": (hidden,),
        }
    shapes |= {"transformer.ln_f.weight": (hidden,), "transformer.ln_f.bias": (hidden,)}
    return shapes


def gpt2_step(density: float = 0.005, seed: int = 0):
    """bf16 states of `gpt2_like` shapes and a step that moves `density` of each tensor's elements by ±1 (90%) or
    ±2 in their bit patterns."""
    rng = np.random.default_rng(seed)
    prev, curr = {}, {}
    for name, shape in gpt2_like().items():
        bits = rng.integers(0x3C00, 0x3F00, shape, dtype=np.uint16)
        new = bits.copy()
        flat = new.reshape(-1)
        picked = rng.choice(flat.size, size=max(1, round(flat.size * density)), replace=False)
        flat[picked] += rng.choice(
            np.array([1, -1, 2, -2], dtype=np.int16), p=[0.45, 0.45, 0.05, 0.05], size=picked.size
        ).astype(np.uint16)
        prev[name], curr[name] = bits, new
    return prev, curr


def workload_step():
    prev, curr, layout = _workload.generate(scale=0.1, density=0.01)

    def split(flat):
        return {
            name: flat[offset : offset + int(np.prod(shape))].reshape(shape)
            for name, shape, offset in zip(layout["names"], layout["shapes"], layout["offsets"])
        }

    return split(prev), split(curr)


def measure(label: str, prev, curr) -> list[str]:
    delta = ds.diff(prev, curr, codec="compact")
    rows = []
    for layout, packed in (("named (v1)", False), ("packed (v2)", True)):
        delta._raw.packed = packed
        size = len(delta.to_bytes())
        header = size - delta.nbytes
        stored = sum(1 for t in delta.tensors if t.changed) or 1
        rows.append(
            f"| {label} | {len(delta)} | {delta.num_changed} | {layout} | {size} | {header} | "
            f"{header / stored:.1f} | {header / size:.1%} | {size / delta.num_changed:.3f} |"
        )
    return rows


def main() -> None:
    print(
        "| step | tensors | changed | layout | file bytes | header bytes | header per changed tensor | header share | bytes per changed element |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in measure("GPT-2-like, 6 layers, 0.5%", *gpt2_step()) + measure(
        "workload scale 0.1, 1%", *workload_step()
    ):
        print(row)


if __name__ == "__main__":
    main()
