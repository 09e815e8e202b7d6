"""Anchors at scale: time and peak memory of publishing an anchor and of a fresh pull, against copying the file.

    python benches/anchors.py [GB] [folder] [runs]

A bf16 state of about GB gigabytes (default 0.5: one embedding of a quarter of it, the rest in 32 MB tensors) is
published to a LocalStore in ``folder`` (default: a temporary folder under TMPDIR) and pulled back; what the run
writes in ``folder`` is deleted when it ends. Each side runs
in its own process, which resets its peak resident set size (writing 5 to /proc/self/clear_refs sets VmHWM to
VmRSS) before the measured call and reports VmHWM less the resident size before it. Rows:

- publish, streamed: the second publish of a Publisher whose mirror holds the state (anchor_every=1, so an empty
  delta and an anchor), through flush(): the diff against the mirror, then the anchor. The publisher rows' peak
  extra is over state + mirror.
- anchor alone, streamed: the anchor's own work in the upload thread: the file written from the mirror, hashed
  (the state digest and the 256 KiB pieces in the same pass), then ``store.put_file`` (fsync, link into the store)
  and the pieces sidecar's ``store.put``. "with the whole-file SHA-256 too" is the same with ``whole_sha256=True``
  (what version 1 entries need: one more hash, serial, on one core); "without pieces" is the same with
  ``piece_bytes=None``, which always has the whole-file SHA-256.
- anchor alone, in memory (the path before streaming): ``ds.anchor(mirror).to_bytes()``, SHA-256, ``store.put``.
- pull: a fresh Subscriber's ``pull`` into a zeroed target (allocated and touched before the reset): from this
  local store, every piece of the store's file checked (BLAKE3, in parallel), then the file read again straight
  into the target, each group checked again before it is copied; no temporary copy. "cold": the same with the
  anchor's pages dropped from the page cache first (``posix_fadvise(DONTNEED)``), as a reader on another machine
  or long after the publish finds it.
- pull, ranged half: what one rank of two reads of the anchor (the first half of every tensor's rows, as a row
  split gives): the sidecar, the header and the pieces covering those rows, each piece checked, into a sparse
  temporary file that is then mapped (``Subscriber(anchor_ranges=...).fetch``; the apply is vLLM's, not timed).
- pull, in memory (before): ``store.get``, SHA-256, ``ds.load(blob).apply_(target)`` (for an entry without the
  whole-file SHA-256 the digest it is checked against is taken from the file before the timer).
- the floors: ``cp`` of the anchor file on the same disk (then ``sync`` of the copy), the same bytes written with
  numpy's ``tofile`` (then fsync), reading the file in 8 MiB pieces (warm, and cold as above), and reading it with
  hashlib's SHA-256. The page cache is warm for every row but the two cold ones.

Every timed write (the publish rows, ``cp``, numpy) starts the same way: a scratch file of the anchor's size is
written and deleted, then ``sync``. On the virtual machines these benchmarks run on, memory the guest has not used
for a while is given back to the host, and a write that takes such pages for the page cache pays for each one again:
the anchor's write pass took about 2-2.7 s per GB into such pages and 0.83-0.89 s into pages just freed
(docs/benchmarks.md), which is what ``cp`` of a file deleted a moment before gets. Without the ``sync`` the
writeback of earlier rows throttles the next. Neither is the code under test; both made any one row up to three times slower.
Linux only.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMON = r"""
import hashlib, json, os, sys, time
import numpy as np, torch
import deltasync_rs as ds

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")

def make_state(gb, seed):
    total = int(gb * 1e9) // 2
    g = torch.Generator().manual_seed(seed)
    state = {"embed.weight": torch.randint(-32768, 32767, (total // 4 // 1024, 1024), dtype=torch.int16, generator=g)}
    rest, layer = total - state["embed.weight"].numel(), 16 << 20
    for i in range(max(1, rest // layer)):
        state[f"layers.{i}.weight"] = torch.randint(-32768, 32767, (layer // 2048, 2048), dtype=torch.int16, generator=g)
    return {k: v.view(torch.bfloat16) for k, v in state.items()}

gb, store_path, mode = float(sys.argv[1]), sys.argv[2], sys.argv[3]
"""

PUBLISH = r"""
state = make_state(gb, 0)
store = ds.LocalStore(store_path)
with ds.Publisher(store, anchor_every=1, keep_anchors=2) as publisher:
    publisher.publish(0, state)
    publisher.flush()
    ready_to_write(store_path, sum(t.numel() * 2 for t in state.values()))
    before = reset_peak()
    started = time.perf_counter()
    if mode == "streamed":
        publisher.publish(1, state)
        publisher.flush()
    elif mode.startswith("anchor only"):
        if mode.endswith("late writeback"):  # the pass as it was before it started the writeback itself
            import deltasync_rs.publisher as module
            real = module.write_anchor_pieces
            module.write_anchor_pieces = lambda *args, **options: real(*args, **{**options, "early_writeback": False})
        publisher.piece_bytes = None if mode.endswith("no pieces") else publisher.piece_bytes
        publisher.whole_sha256 = mode.endswith("whole SHA-256")
        path, ref, _, sidecar = publisher._anchor_file(publisher._mirror.tensors, 1, {})
        store.put_file(ref["key"], path)
        if sidecar is not None:
            store.put(ref["pieces"]["key"], sidecar)
        os.unlink(path)
    else:
        blob = ds.anchor(publisher._mirror.tensors, step=1).to_bytes()
        hashlib.sha256(blob).hexdigest()
        store.put("anchors/step_000000000001.safetensors", blob)
        del blob
    seconds = time.perf_counter() - started
print(json.dumps({"seconds": seconds, "peak_extra": status("VmHWM") - before,
                  "state": sum(t.numel() * 2 for t in state.values())}))
"""

PULL = r"""
store = ds.LocalStore(store_path, create=False)
subscriber = ds.Subscriber(store)
ref = subscriber.entry(subscriber.latest_step()).anchor
if mode == "in memory" and "sha256" not in ref:  # a version 2 entry: what the path before streaming checked against
    with open(os.path.join(store_path, ref["key"]), "rb") as f:
        ref["sha256"] = hashlib.file_digest(f, "sha256").hexdigest()
shapes = json.loads(os.environ["ANCHOR_SHAPES"])
target = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in shapes.items()}  # touched: zeroed
if mode == "cold":  # the anchor's pages dropped from the page cache: read from the disk, as on a fresh reader
    with open(os.path.join(store_path, ref["key"]), "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
before = reset_peak()
started = time.perf_counter()
if mode in ("streamed", "cold"):
    subscriber.pull(target)
elif mode == "ranged half":
    def half(tensors):
        return [(t.start, t.start + (t.end - t.start) // 2) for t in tensors]
    (partial,) = ds.Subscriber(store, anchor_ranges=half).fetch(None)
    assert type(partial).__name__ == "PartialAnchor", type(partial)
    del partial
else:
    blob = store.get(ref["key"])
    assert hashlib.sha256(blob).hexdigest() == ref["sha256"]
    ds.load(blob).apply_(target)
    del blob
seconds = time.perf_counter() - started
print(json.dumps({"seconds": seconds, "peak_extra": status("VmHWM") - before}))
"""


#: The children import this module's ``ready_to_write`` (this module imports nothing heavy).
CHILD_IMPORTS = (
    f"import sys\nsys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\nfrom anchors import ready_to_write\n"
)


def child(code: str, gb: float, store: Path, mode: str, env: dict | None = None) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", CHILD_IMPORTS + COMMON + code, str(gb), str(store), mode],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    if run.returncode:
        raise SystemExit(f"{mode}: {run.stderr}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def ready_to_write(folder: str | Path, nbytes: int) -> None:
    """Writes and deletes a scratch file of ``nbytes`` in ``folder``, then syncs: the timed write that follows gets
    page-cache pages the kernel has just freed, and no writeback of earlier writes runs under it (see the module's
    docstring). Every timed write here starts with it, in the children (which import it) and in ``floors``."""
    path = os.path.join(folder, "scratch.bin")
    chunk = bytes(8 << 20)
    with open(path, "wb") as f:
        for _ in range(-(-nbytes // len(chunk))):
            f.write(chunk)
    os.unlink(path)
    os.sync()


def timed(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True)
    return time.perf_counter() - started


def floors(anchor: Path, scratch: Path) -> dict[str, float]:
    import numpy as np

    copy = scratch / "copy.safetensors"
    size = anchor.stat().st_size
    ready_to_write(scratch, size)  # as before each publish row
    out = {"cp": timed(["cp", str(anchor), str(copy)])}
    copy.unlink()
    ready_to_write(scratch, size)
    out["cp + sync"] = timed(["sh", "-c", f"cp '{anchor}' '{copy}' && sync '{copy}'"])
    copy.unlink()
    data = np.fromfile(anchor, dtype=np.uint8)
    ready_to_write(scratch, size)
    started = time.perf_counter()
    with open(copy, "wb") as f:
        data.tofile(f)
    out["numpy tofile"] = time.perf_counter() - started
    with open(copy, "r+b") as f:
        os.fsync(f.fileno())
    out["numpy tofile + fsync"] = time.perf_counter() - started
    copy.unlink()
    del data
    started = time.perf_counter()
    with open(anchor, "rb", buffering=0) as f:
        buffer = bytearray(8 << 20)
        while f.readinto(buffer):
            pass
    out["read the file"] = time.perf_counter() - started
    with open(anchor, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        started = time.perf_counter()
        while f.readinto(buffer):
            pass
    out["read the file, cold"] = time.perf_counter() - started
    started = time.perf_counter()
    with open(anchor, "rb") as f:
        hashlib.file_digest(f, "sha256")
    out["read + SHA-256 (hashlib)"] = time.perf_counter() - started
    return out


def median_row(rows: list[dict]) -> dict:
    """The run with the median time (its peak memory with it)."""
    return sorted(rows, key=lambda row: row["seconds"])[len(rows) // 2]


def main() -> None:
    import shutil

    gb = float(sys.argv[1]) if len(sys.argv) > 1 else 0.5
    made = len(sys.argv) <= 2
    folder = Path(sys.argv[2]) if not made else Path(tempfile.mkdtemp(prefix="deltasync-bench-"))
    runs = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    before = set(folder.iterdir())
    try:
        run_all(gb, folder, runs)
    finally:
        # Every store holds about two anchors of the state: at 4 GB and a few runs they fill a disk.
        for path in set(folder.iterdir()) - before:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        if made:
            shutil.rmtree(folder, ignore_errors=True)


def run_all(gb: float, folder: Path, runs: int) -> None:
    import shutil
    import statistics

    store = folder / "store-0"
    # A fresh store per publishing run (each publishes steps 0 and 1); the pulls read the first one.
    modes = ("streamed", "anchor only", "anchor only, whole SHA-256", "anchor only, no pieces", "in memory")
    loads = [os.getloadavg()[0]]
    publish = {}
    for i, mode in enumerate(modes):
        rows = []
        for run in range(runs):
            where = folder / f"store-{i}" if run == 0 else folder / f"store-{i}-again"
            shutil.rmtree(where, ignore_errors=True)
            rows.append(child(PUBLISH, gb, where, mode))
        publish[mode] = median_row(rows)
    anchor = store / "anchors" / "step_000000000001.safetensors"
    os.sync()  # the publishes' dirty pages written back now, not under the pulls and floors timed next
    import safetensors

    with safetensors.safe_open(anchor, "np") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    env = {"ANCHOR_SHAPES": json.dumps(shapes)}
    pull = {
        mode: median_row([child(PULL, gb, store, mode, env) for _ in range(runs)])
        for mode in ("streamed", "cold", "ranged half", "in memory")
    }
    loads.append(os.getloadavg()[0])
    samples = [floors(anchor, folder) for _ in range(runs)]
    base = {name: statistics.median(sample[name] for sample in samples) for name in samples[0]}
    loads.append(os.getloadavg()[0])
    size = anchor.stat().st_size
    gib = 1 << 30
    print(
        f"anchor file: {size / 1e9:.2f} GB; state {publish['streamed']['state'] / 1e9:.2f} GB; threads {os.cpu_count()}; "
        f"median of {runs} run(s); 1-minute load average {' / '.join(f'{x:.1f}' for x in loads)} "
        "(start / after the pulls / end)"
    )
    print()
    print("| what | seconds | GB/s | peak RSS beyond state + mirror (publish) or target (pull) |")
    print("|---|---:|---:|---:|")
    for name, row in (
        ("publish, streamed", publish["streamed"]),
        ("anchor alone, streamed (file, pieces, digest, fsync, link)", publish["anchor only"]),
        (
            "anchor alone, streamed, with the whole-file SHA-256 too (version 1 entry)",
            publish["anchor only, whole SHA-256"],
        ),
        ("anchor alone, streamed, without pieces (whole-file SHA-256 only)", publish["anchor only, no pieces"]),
        ("anchor alone, in memory (before)", publish["in memory"]),
        ("pull (local store: every piece checked, then filled from the store's file)", pull["streamed"]),
        ("pull, cold (the anchor's pages dropped first)", pull["cold"]),
        ("pull, ranged half (one rank of two: fetch and verify)", pull["ranged half"]),
        ("pull, in memory (before)", pull["in memory"]),
    ):
        print(
            f"| {name} | {row['seconds']:.2f} | {size / row['seconds'] / 1e9:.2f} | {row['peak_extra'] / gib:.2f} GiB |"
        )
    for name, seconds in base.items():
        print(f"| {name} | {seconds:.2f} | {size / seconds / 1e9:.2f} | |")
    ratio = publish["anchor only"]["seconds"]
    print()
    print(
        f"anchor alone / cp = {ratio / base['cp']:.2f}, anchor alone / (cp + sync) = {ratio / base['cp + sync']:.2f}, "
        f"anchor alone / (numpy tofile + fsync) = {ratio / base['numpy tofile + fsync']:.2f}, "
        f"anchor alone with the whole-file SHA-256 / cp = "
        f"{publish['anchor only, whole SHA-256']['seconds'] / base['cp']:.2f}, "
        f"anchor alone without pieces / cp = {publish['anchor only, no pieces']['seconds'] / base['cp']:.2f}, "
        f"pull / read = {pull['streamed']['seconds'] / base['read the file']:.2f}, "
        f"pull cold / read cold = {pull['cold']['seconds'] / base['read the file, cold']:.2f}, "
        f"ranged half / read = {pull['ranged half']['seconds'] / base['read the file']:.2f}, "
        f"pull / (read + SHA-256) = {pull['streamed']['seconds'] / base['read + SHA-256 (hashlib)']:.2f}"
    )


if __name__ == "__main__":
    main()
