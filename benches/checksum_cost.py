"""What the file checksum (docs/format.md §2.1) costs a reader: load + apply of the same delta with and without its
`file_xxh3` (the key taken out, as older writers wrote the file), alternated round by round so that load from other
processes on a shared machine hits both alike, and the hash of the file alone. Then the same for an anchor of the
state, as a publisher streams it (checksum hashed in the write pass) and read through a memory map
(``ds.load(path, mmap=True)``, which checks it 16 MiB at a time) against the same file mapped without the check
(what a Subscriber does with a copy it has just checked against the store's pieces).

    python benches/checksum_cost.py [rounds] [FOLDER]

A synthetic bf16 step: 6 tensors of 4096 x 4096 (201 MB), 1% of the elements moved by one in their bit pattern.
The anchor is written into FOLDER (default: a new temporary folder). Prints medians in ms and their ratio per
codec. Nothing is asserted on timings.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import torch

import deltasync_rs as ds
from deltasync_rs import _core
from deltasync_rs.delta import load_checked_copy, write_anchor_pieces


def _without_checksum(blob: bytes) -> bytes:
    length = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + length])
    del header["__metadata__"]["file_xxh3"]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + blob[8 + length :]


def _alternated(reads, fresh_target, rounds: int) -> tuple[float, float]:
    """Median ms of ``reads["with"]().apply_(target)`` and of ``reads["without"]``, alternated round by round, each
    into a ``fresh_target()``."""
    times: dict[str, list[float]] = {name: [] for name in reads}
    for _ in range(rounds):
        for name, read in reads.items():
            target = fresh_target()
            start = time.perf_counter()
            read().apply_(target)
            times[name].append(time.perf_counter() - start)
    return statistics.median(times["with"]) * 1e3, statistics.median(times["without"]) * 1e3


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 31
    g = torch.Generator().manual_seed(0)
    prev = {f"layer.{i}.weight": torch.randn(4096, 4096, generator=g).to(torch.bfloat16) for i in range(6)}
    curr = {}
    for name, tensor in prev.items():
        changed = tensor.clone()
        changed.view(torch.int16)[torch.rand(tensor.shape, generator=g) < 0.01] += 1
        curr[name] = changed
    for codec in ("varint", "compact"):
        delta = ds.diff(prev, curr, codec=codec)
        sealed = delta.to_bytes()
        files = {"with": sealed, "without": _without_checksum(sealed)}
        reads = {name: (lambda blob=blob: ds.load(blob)) for name, blob in files.items()}
        with_, without = _alternated(reads, lambda: {n: t.clone() for n, t in prev.items()}, rounds)
        hashes = []
        for _ in range(rounds):
            start = time.perf_counter()
            _core.base_identity(sealed)
            hashes.append(time.perf_counter() - start)
        print(
            f"{codec:8} {len(sealed) / 1e6:.2f} MB, {delta.num_changed:,} changes: load + apply {with_:.2f} ms with the "
            f"checksum, {without:.2f} ms without ({with_ / without:.3f}x); the file's hash alone "
            f"{statistics.median(hashes) * 1e3:.3f} ms"
        )
    with tempfile.TemporaryDirectory(dir=sys.argv[2] if len(sys.argv) > 2 else None) as folder:
        path = os.path.join(folder, "anchor.safetensors")
        open(path, "wb").close()
        write_anchor_pieces(prev, path, step=0, piece_bytes=256 << 10, whole_sha256=False)
        reads = {"with": lambda: ds.load(path, mmap=True), "without": lambda: load_checked_copy(path)}
        with_, without = _alternated(reads, lambda: {n: torch.empty_like(t) for n, t in prev.items()}, rounds)
        print(
            f"anchor   {os.path.getsize(path) / 1e6:.1f} MB, mapped: load + apply {with_:.1f} ms with the checksum, "
            f"{without:.1f} ms without ({with_ / without:.3f}x)"
        )


if __name__ == "__main__":
    main()
