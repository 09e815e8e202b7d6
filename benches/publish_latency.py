"""What `Publisher.publish` costs the caller on steps without an anchor, on the benchmark workload.

    python benches/publish_latency.py [scale] [density] [steps]

Publishes ``steps`` steps (default 11) to a LocalStore in a temporary folder, alternating the workload's two
states (each step a delta of about ``density`` of the elements, default 1%; anchor_every=1000, so only the first
step is an anchor), and prints the medians over all steps but the first of ``publish()`` alone (the time until
training may go on) and of ``publish()`` + ``flush()`` (until the step is in the store), beside the time of
``ds.state_digest`` of one state, which the upload thread now pays instead of the caller. Then a Subscriber
pulls the same steps one at a time into a copy of the first state and the median of ``pull()`` per delta step is
printed (checked base, state digest checked: what a trainer's peer pays per step). Nothing is asserted.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workload  # noqa: E402

import deltasync_rs as ds  # noqa: E402


def main() -> None:
    scale = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    density = float(sys.argv[2]) if len(sys.argv) > 2 else 0.01
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 11
    w = workload.load_workload(scale, density)
    digest = []
    for _ in range(5):
        started = time.perf_counter()
        ds.state_digest(w.curr)
        digest.append(time.perf_counter() - started)
    root = tempfile.mkdtemp(prefix="deltasync-publish-")
    alone, flushed, pulled = [], [], []
    try:
        with ds.Publisher(ds.LocalStore(root), anchor_every=1000) as publisher:
            publisher.publish(0, w.prev)
            publisher.flush()
            for step in range(1, steps + 1):
                state = w.curr if step % 2 else w.prev
                started = time.perf_counter()
                publisher.publish(step, state)
                returned = time.perf_counter()
                publisher.flush()
                alone.append(returned - started)
                flushed.append(time.perf_counter() - started)
        subscriber = ds.Subscriber(ds.LocalStore(root, create=False))
        target = w.clone_prev()
        subscriber.pull(target, until=0)
        for step in range(1, steps + 1):
            started = time.perf_counter()
            subscriber.pull(target, until=step)
            pulled.append(time.perf_counter() - started)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"scale {scale}, density {density:.2%}, {steps} steps: publish() {statistics.median(alone[1:]) * 1e3:.1f} ms, "
        f"publish() + flush() {statistics.median(flushed[1:]) * 1e3:.1f} ms (medians); "
        f"ds.state_digest of one state {statistics.median(digest) * 1e3:.1f} ms; "
        f"Subscriber.pull() of one step {statistics.median(pulled[1:]) * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
