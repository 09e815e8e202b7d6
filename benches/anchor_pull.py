"""One fresh pull of a store's newest anchor, timed against reading the anchor file, in this process.

    python benches/anchor_pull.py STORE [warm|cold]

STORE is a LocalStore whose newest step is an anchor (for example ``store-0`` of ``benches/anchors.py``'s folder).
A target of zeros of the anchor's shapes is allocated and touched first; then ``Subscriber(STORE).pull(target)`` is
timed, then reading the anchor file in 8 MiB pieces. With ``cold`` the file's pages are dropped from the page cache
(``posix_fadvise(DONTNEED)``) before each of the two, as a reader on another machine finds it. Prints the two
seconds. Run it alternately against two builds (``PYTHONPATH=.../python``), each on a store its own version wrote,
for ratios in one run; docs/benchmarks.md quotes it so.
"""

from __future__ import annotations

import os
import sys
import time

import safetensors
import torch

import deltasync_rs as ds


def drop_cached(path: str) -> None:
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def main() -> None:
    store_path = sys.argv[1]
    cold = len(sys.argv) > 2 and sys.argv[2] == "cold"
    subscriber = ds.Subscriber(ds.LocalStore(store_path, create=False))
    anchor = subscriber.entry(subscriber.latest_step()).anchor
    if anchor is None:
        raise SystemExit(f"{store_path}: the newest step has no anchor")
    path = os.path.join(store_path, anchor["key"])
    dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    with safetensors.safe_open(path, "np") as f:
        specs = {name: (f.get_slice(name).get_shape(), dtypes[f.get_slice(name).get_dtype()]) for name in f.keys()}
    target = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in specs.items()}
    if cold:
        drop_cached(path)
    started = time.perf_counter()
    subscriber.pull(target)
    pull = time.perf_counter() - started
    if cold:
        drop_cached(path)
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(8 << 20)
        while f.readinto(buffer):
            pass
    read = time.perf_counter() - started
    print(f"pull {pull:.3f} s, read {read:.3f} s, pull / read {pull / read:.2f}")


if __name__ == "__main__":
    main()
