"""What `Publisher.publish` costs the caller on steps without an anchor, on the benchmark workload, per codec.

    python benches/publish_latency.py [scale] [density] [steps] [codecs]

Publishes ``steps`` steps (default 11) to one LocalStore per codec (``codecs``, default ``varint,compact,context``)
in a temporary folder, alternating the workload's two states (each step a delta of about ``density`` of the
elements, default 1%; anchor_every=1000, so only the first step is an anchor). Each step is published with every
codec in turn (round-robin, so load from other processes hits all alike), and the medians over all steps but the
first are printed of ``publish()`` alone (the time until training may go on: the compare and the mirror's update;
the encoding of the delta and the state digest are the upload thread's) and of ``publish()`` + ``flush()`` (until
the step is in the store), beside the time of ``ds.state_digest`` of one state, and each codec's ``publish()``
against varint's. Then a Subscriber pulls the first codec's steps one at a time into a copy of the first state and
the median of ``pull()`` per delta step is printed (checked base, state digest checked: what a trainer's peer pays
per step). Nothing is asserted.
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
    codecs = sys.argv[4].split(",") if len(sys.argv) > 4 else ["varint", "compact", "context"]
    w = workload.load_workload(scale, density)
    digest = []
    for _ in range(5):
        started = time.perf_counter()
        ds.state_digest(w.curr)
        digest.append(time.perf_counter() - started)
    root = tempfile.mkdtemp(prefix="deltasync-publish-")
    alone: dict[str, list[float]] = {c: [] for c in codecs}
    flushed: dict[str, list[float]] = {c: [] for c in codecs}
    pulled = []
    try:
        publishers = {c: ds.Publisher(ds.LocalStore(f"{root}/{c}"), anchor_every=1000, codec=c) for c in codecs}
        try:
            for publisher in publishers.values():
                publisher.publish(0, w.prev)
                publisher.flush()
            for step in range(1, steps + 1):
                state = w.curr if step % 2 else w.prev
                for codec, publisher in publishers.items():
                    started = time.perf_counter()
                    publisher.publish(step, state)
                    returned = time.perf_counter()
                    publisher.flush()
                    alone[codec].append(returned - started)
                    flushed[codec].append(time.perf_counter() - started)
        finally:
            for publisher in publishers.values():
                publisher.close()
        subscriber = ds.Subscriber(ds.LocalStore(f"{root}/{codecs[0]}", create=False))
        target = w.clone_prev()
        subscriber.pull(target, until=0)
        for step in range(1, steps + 1):
            started = time.perf_counter()
            subscriber.pull(target, until=step)
            pulled.append(time.perf_counter() - started)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"scale {scale}, density {density:.2%}, {steps} steps; ds.state_digest of one state "
        f"{statistics.median(digest) * 1e3:.1f} ms; medians over steps 2-{steps}:"
    )
    first = statistics.median(alone[codecs[0]][1:])
    for codec in codecs:
        median = statistics.median(alone[codec][1:])
        print(
            f"  {codec:8s} publish() {median * 1e3:6.1f} ms ({median / first:.2f}x {codecs[0]}), "
            f"publish() + flush() {statistics.median(flushed[codec][1:]) * 1e3:6.1f} ms"
        )
    print(f"  Subscriber.pull() of one {codecs[0]} step {statistics.median(pulled[1:]) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
