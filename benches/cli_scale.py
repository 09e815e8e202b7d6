"""`deltasync publish` and `deltasync pull` of model-shaped checkpoints too large to hold twice in RAM.

    python benches/cli_scale.py [--shape 7b|3b|0.6b|tiny] [--density 0.01] [--keep] FOLDER

Writes two bf16 checkpoints of the shape's tensors (normal(0, 0.02) weights; the second with ``density`` of every
tensor's elements moved by one step of their bit pattern, up or down), streamed in pieces so that writing them
needs little memory. Then, each command in its own process under ``/usr/bin/time -v``:

1. ``deltasync publish --anchor --step 0`` of the first: an anchor (the file streamed from the mapped checkpoint);
2. ``deltasync publish --step 1`` of the second: the store's last state rebuilt, then a delta against it;
3. ``deltasync pull --step 1`` into a new checkpoint, checked byte for byte against the second checkpoint's tensors.

Prints wall seconds and peak resident set size (``Maximum resident set size``) of each, next to ``cp`` of a
checkpoint and reading it. Every timed write (``cp``, both publishes, the pull) starts as in benches/anchors.py: a
scratch file of the checkpoint's size written and deleted, then ``sync`` (see there why). Needs about 4.3x the
checkpoint's size on disk (two checkpoints, the anchor, the pulled file): a 7B shape is 13.5 GB. Linux only. The folder is deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from anchors import ready_to_write  # benches/ is this script's folder, first on sys.path

SHAPES = {
    # name: (vocab, hidden, intermediate, layers); Llama-style: q/k/v/o, gate/up/down, two norms per layer.
    "7b": (32000, 4096, 11008, 32),
    "3b": (32000, 3200, 8640, 26),  # OpenLLaMA-3B's shape: half a 7B, for disks that cannot hold 4.3x a 7B
    "0.6b": (151936, 1024, 3072, 28),
    "tiny": (1000, 256, 512, 2),
}
PIECE = 1 << 24  # elements generated at a time


def tensors(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    vocab, hidden, inter, layers = SHAPES[shape]
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + f"self_attn.{n}_proj.weight", (hidden, hidden)) for n in "qkvo"]
        out += [(p + "mlp.gate_proj.weight", (inter, hidden)), (p + "mlp.up_proj.weight", (inter, hidden))]
        out += [(p + "mlp.down_proj.weight", (hidden, inter))]
        out += [(p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))]
    out += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return out


def header(specs: list[tuple[str, tuple[int, ...]]]) -> bytes:
    entries, offset = {}, 0
    for name, shape in specs:
        size = 2 * int(np.prod(shape))
        entries[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_pair(specs, first: Path, second: Path, density: float) -> int:
    """Both checkpoints in one pass; returns the number of elements changed."""
    rng = np.random.default_rng(0)
    head, changed = header(specs), 0
    with open(first, "wb") as a, open(second, "wb") as b:
        a.write(head)
        b.write(head)
        for _, shape in specs:
            left = int(np.prod(shape))
            while left:
                n = min(left, PIECE)
                left -= n
                bits = (rng.standard_normal(n, dtype=np.float32) * 0.02).view(np.uint32) >> 16
                bits = bits.astype(np.uint16)
                a.write(bits.tobytes())
                at = np.unique(rng.integers(0, n, size=int(n * density)))  # a few repeats merge: ~density
                step = np.where(rng.random(at.size) < 0.5, 1, 0xFFFF).astype(np.uint16)
                bits[at] += step  # wraps modulo 2**16: one step of the bit pattern up or down
                changed += at.size
                b.write(bits.tobytes())
    return changed


def timed(command: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS in bytes) of one command run under /usr/bin/time -v."""
    start = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1)) * 1024
    return wall, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    folder: Path = args.folder
    folder.mkdir(parents=True, exist_ok=True)
    specs = tensors(args.shape)
    first, second, store = folder / "step0.safetensors", folder / "step1.safetensors", folder / "store"
    pulled = folder / "pulled.safetensors"
    cli = [sys.executable, "-m", "deltasync_rs.cli"]
    try:
        start = time.perf_counter()
        changed = write_pair(specs, first, second, args.density)
        size = first.stat().st_size
        print(
            f"{args.shape}: {len(specs)} tensors, {size / 1e9:.2f} GB per checkpoint, {changed:,} changed "
            f"({time.perf_counter() - start:.0f} s to write both)"
        )
        rows = []
        ready_to_write(folder, size)
        wall, _ = timed(["cp", str(first), str(folder / "copy.safetensors")])
        os.remove(folder / "copy.safetensors")
        rows.append(("cp of a checkpoint", wall, None))
        wall, _ = timed(["sh", "-c", f"cat {first} > /dev/null"])
        rows.append(("read a checkpoint (cat)", wall, None))
        ready_to_write(folder, size)
        rows.append(
            (
                "publish --anchor --step 0",
                *timed([*cli, "publish", "--store", str(store), "--step", "0", "--anchor", str(first)]),
            )
        )
        ready_to_write(folder, size)
        rows.append(
            ("publish --step 1 (a delta)", *timed([*cli, "publish", "--store", str(store), "--step", "1", str(second)]))
        )
        ready_to_write(folder, size)
        rows.append(("pull --step 1", *timed([*cli, "pull", "--store", str(store), "--step", "1", "-o", str(pulled)])))
        ok = check_same(second, pulled)
        files = {str(p.relative_to(store)): p.stat().st_size for p in store.rglob("*") if p.is_file()}
        delta = sum(s for n, s in files.items() if n.startswith("deltas/") and n.endswith(".safetensors"))
        print("| what | seconds | peak RSS (GiB) |\n|---|---:|---:|")
        for what, wall, peak in rows:
            print(f"| {what} | {wall:.1f} | {'' if peak is None else f'{peak / 2**30:.2f}'} |")
        print(
            f"checkpoint {size / 2**30:.2f} GiB; store files {len(files)}, deltas {delta / 1e6:.1f} MB "
            f"({delta / max(changed, 1):.2f} bytes per change); pulled == step 1: {ok}"
        )
        if not ok:
            sys.exit("the pulled checkpoint differs from step 1")
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


def check_same(a: Path, b: Path) -> bool:
    """Same tensor names, dtypes, shapes and bytes (the headers' order and layout may differ)."""
    import torch
    from safetensors import safe_open

    with safe_open(a, "pt") as x, safe_open(b, "pt") as y:
        if sorted(x.keys()) != sorted(y.keys()):
            return False
        return all(torch.equal(x.get_tensor(k).view(torch.int16), y.get_tensor(k).view(torch.int16)) for k in x.keys())


if __name__ == "__main__":
    main()
