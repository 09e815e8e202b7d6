"""Per-tensor overhead: a state of many small tensors, as a mixture-of-experts model has (about 90k).

    python benches/many_tensors.py [tensors] [elements] [rounds]

Times ``ds.diff`` and ``ds.load(...).apply_`` on ``tensors`` bf16 tensors of ``elements`` each (defaults 90000 and
256), 2% of the elements changed by one in their bit pattern, and prints the medians. The apply is timed twice: into
contiguous CPU tensors, which the core writes itself, and into strided ones (the same values, every other element of a buffer), which
are decoded and written tensor by tensor with torch index writes, as every tensor on a GPU is. Here the Python glue
and the core's per-tensor work, not the bytes, set the time. Also timed: ``ds.torch.Mirror.step`` of the same change (a
mirror of ``prev``, the state then set to ``curr``). Nothing is asserted on timings.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import deltasync_rs as ds


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 90_000
    elements = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    g = torch.Generator().manual_seed(0)
    prev = {
        f"model.layers.{i // 1000}.mlp.experts.{i % 1000}.weight": torch.randn(elements, generator=g).bfloat16()
        for i in range(count)
    }
    curr = {name: tensor.clone() for name, tensor in prev.items()}
    for tensor in curr.values():
        tensor.view(torch.int16)[::50] += 1
    blob = ds.diff(prev, curr).to_bytes()
    diff_times, apply_times, staged_times, mirror_times = [], [], [], []
    for _ in range(rounds):
        started = time.perf_counter()
        ds.diff(prev, curr)
        diff_times.append(time.perf_counter() - started)
        target = {name: tensor.clone() for name, tensor in prev.items()}
        started = time.perf_counter()
        ds.load(blob).apply_(target)
        apply_times.append(time.perf_counter() - started)
        strided = {name: torch.empty(2 * elements, dtype=tensor.dtype)[::2] for name, tensor in prev.items()}
        for name, tensor in strided.items():
            tensor.copy_(prev[name])
        started = time.perf_counter()
        ds.load(blob).apply_(strided)
        staged_times.append(time.perf_counter() - started)
        state = {name: tensor.clone() for name, tensor in prev.items()}
        mirror = ds.torch.Mirror(state)
        for name, tensor in state.items():
            tensor.copy_(curr[name])
        started = time.perf_counter()
        mirror.step(1)
        mirror_times.append(time.perf_counter() - started)
    print(
        f"{count} tensors of {elements} elements, {rounds} rounds: diff {statistics.median(diff_times):.3f} s, "
        f"load + apply_ {statistics.median(apply_times):.3f} s, into strided tensors (staged tensor by tensor) "
        f"{statistics.median(staged_times):.3f} s, ds.torch.Mirror.step {statistics.median(mirror_times):.3f} s "
        f"(medians); {len(blob)} bytes"
    )


if __name__ == "__main__":
    main()
