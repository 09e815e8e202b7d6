"""What an anchor's write pass is made of, each part timed alone on this machine: the piece hashes (BLAKE3, the
default, and SHA-256), the whole-file SHA-256, the state digest's XXH3 and the kernel's copy of the bytes into the
page cache, against the pass itself (``write_anchor_pieces``) and ``cp`` of the file it writes; then the pass
followed by an fsync (what a local store's ``put_file`` does), with the kernel's writeback started during the pass
(``early_writeback=True``, the publisher's) and without, alternated round by round, against ``cp`` + ``sync``.

    python benches/hashes.py [GiB] [rounds] [FOLDER]

GiB of random bytes (default 1; rounded to a multiple of 8 MiB, at least 8 MiB) are hashed in memory, 256 KiB pieces one after another on one thread (``per core``
rows), then as a file in the page cache on every thread of the deltasync pool (``file_piece_hashes``, what a reader
checks an anchor with). The same bytes, as a bf16 state of 32 tensors, are written as an anchor into FOLDER (default:
a new temporary folder; give one on the disk you care about), which is then copied with ``cp``. Medians of ``rounds``
(default 5) after one warm-up, all in this process; each write starts as in benches/anchors.py (a scratch file of
the same size written and deleted, then ``sync``: see there why); the ``blake3`` package (a test dependency) checks the core's
BLAKE3 against a second implementation first. Nothing is asserted on timings.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from anchors import ready_to_write  # benches/ is this script's folder, first on sys.path

import deltasync_rs as ds
from deltasync_rs._core import file_piece_hashes, piece_hash
from deltasync_rs.delta import state_digest, write_anchor_pieces

PIECE = 256 << 10


def timed(run, rounds: int, *, writes: Path | None = None, nbytes: int = 0) -> float:
    """Median seconds of ``run``. With ``writes`` (the file ``run`` writes), each round starts as benches/anchors.py's
    do: that file deleted, a scratch file of ``nbytes`` written beside it and deleted, then ``sync``."""
    run()  # warm-up: allocations, page cache, thread pool
    samples = []
    for _ in range(rounds):
        if writes is not None:
            writes.unlink(missing_ok=True)  # its pages freed here, not in the timed run
            ready_to_write(writes.parent, nbytes)
        started = time.perf_counter()
        run()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def alternated(first, second, rounds: int, *, writes: Path, nbytes: int) -> tuple[float, float]:
    """Medians of ``first`` and ``second`` run in alternation (which goes first flips every round), each started
    as :func:`timed` starts a write, so that a drift in the host's load lands on both."""
    first(), second()
    samples: tuple[list[float], list[float]] = ([], [])
    for round_ in range(rounds):
        for which in (0, 1) if round_ % 2 == 0 else (1, 0):
            writes.unlink(missing_ok=True)
            ready_to_write(writes.parent, nbytes)
            started = time.perf_counter()
            (first, second)[which]()
            samples[which].append(time.perf_counter() - started)
    return statistics.median(samples[0]), statistics.median(samples[1])


def main() -> None:
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    folder = Path(sys.argv[3]) if len(sys.argv) > 3 else Path(tempfile.mkdtemp(prefix="deltasync-hashes-"))
    folder.mkdir(parents=True, exist_ok=True)
    # 32 tensors of whole pieces: a multiple of 32 pieces (8 MiB), at least one (it was 64 MiB, rounded down, so that
    # below 64 MiB nothing was left and the cross-check failed with an IndexError).
    unit = 32 * PIECE
    size = max(1, round(gib * (1 << 30) / unit)) * unit
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    view = memoryview(data)
    pieces = [view[i : i + PIECE] for i in range(0, size, PIECE)]
    try:
        import blake3

        assert piece_hash(pieces[1], "blake3") == blake3.blake3(pieces[1]).digest(), "BLAKE3 differs from blake3"
    except ImportError:
        print("(the blake3 package is not installed: the core's BLAKE3 is not cross-checked)")
    assert piece_hash(pieces[1], "sha256") == hashlib.sha256(pieces[1]).digest(), "SHA-256 differs from hashlib"

    state = {
        f"layers.{i}.weight": torch.from_numpy(part).view(torch.bfloat16) for i, part in enumerate(np.split(data, 32))
    }
    anchor, copy = folder / "anchor.safetensors", folder / "copy.safetensors"
    source, written = folder / "bytes.bin", folder / "written.bin"
    data.tofile(source)

    def write_anchor(whole_sha256: bool, *, early_writeback: bool = False, fsync: bool = False) -> None:
        anchor.touch()
        write_anchor_pieces(
            state,
            str(anchor),
            step=1,
            piece_bytes=PIECE,
            piece_hash="blake3",
            whole_sha256=whole_sha256,
            early_writeback=early_writeback,
        )
        if fsync:  # what a local store's put_file does next
            fd = os.open(anchor, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def write_in(buffers: list[memoryview], chunk: int) -> Callable[[], None]:
        """Plain writes of ``buffers`` into a new file, ``chunk`` bytes per write, nothing hashed."""

        def write() -> None:
            with open(written, "wb", buffering=0) as f:
                for buffer in buffers:
                    for i in range(0, len(buffer), chunk):
                        f.write(buffer[i : i + chunk])

        return write

    kernel_copy = write_in([view], 8 << 20)
    # What any writer of these tensors from this process's memory pays: their bytes, 32 MiB per write.
    plain_writes = write_in([t.view(torch.uint8).numpy().data for t in state.values()], 32 << 20)

    def cp() -> None:
        subprocess.run(["cp", str(anchor), str(copy)], check=True)

    def cp_sync() -> None:
        cp()
        os.sync()

    rows = [
        ("BLAKE3 of each 256 KiB piece, one core", timed(lambda: [piece_hash(p, "blake3") for p in pieces], rounds)),
        ("SHA-256 of each 256 KiB piece, one core", timed(lambda: [piece_hash(p, "sha256") for p in pieces], rounds)),
        ("SHA-256 of the whole (hashlib, one stream: one core)", timed(lambda: hashlib.sha256(view).digest(), rounds)),
        ("XXH3-128 state digest of the same bytes as 32 tensors", timed(lambda: state_digest(state), rounds)),
        (
            "BLAKE3 pieces of the file, cached (`file_piece_hashes`, the pool)",
            timed(lambda: file_piece_hashes(source, PIECE, "blake3"), rounds),
        ),
        (
            "SHA-256 pieces of the file, cached (`file_piece_hashes`, the pool)",
            timed(lambda: file_piece_hashes(source, PIECE, "sha256"), rounds),
        ),
        (
            "the bytes written into a new file (the kernel's copy into the page cache)",
            timed(kernel_copy, rounds, writes=written, nbytes=size),
        ),
        (
            "the 32 tensors written from memory, 32 MiB per write, nothing hashed",
            timed(plain_writes, rounds, writes=written, nbytes=size),
        ),
        (
            "anchor write pass (`write_anchor_pieces`: file, pieces, digest; protocol 2's default)",
            timed(lambda: write_anchor(False), rounds, writes=anchor, nbytes=size),
        ),
        (
            "anchor write pass with the whole-file SHA-256 too (`whole_sha256=True`)",
            timed(lambda: write_anchor(True), rounds, writes=anchor, nbytes=size),
        ),
        ("`cp` of the anchor file", timed(cp, rounds, writes=copy, nbytes=size)),
    ]
    durable = alternated(
        lambda: write_anchor(False, early_writeback=True, fsync=True),
        lambda: write_anchor(False, fsync=True),
        rounds,
        writes=anchor,
        nbytes=size,
    )
    rows += [
        ("anchor write pass + fsync, writeback started during the pass (the publisher's)", durable[0]),
        ("anchor write pass + fsync, writeback left to the fsync (alternated with the row above)", durable[1]),
        ("`cp` + `sync` of the anchor file", timed(cp_sync, rounds, writes=copy, nbytes=size)),
    ]
    threads = ds.get_num_threads() if hasattr(ds, "get_num_threads") else os.cpu_count()
    print(f"{size / (1 << 30):.2f} GiB, medians of {rounds}, deltasync pool of {threads} threads, folder {folder}")
    print()
    print("| what | seconds | GB/s |")
    print("|---|---:|---:|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.3f} | {size / seconds / 1e9:.2f} |")
    for path in (anchor, copy, source, written):
        path.unlink(missing_ok=True)
    if len(sys.argv) <= 3:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
