"""A fault-injecting Store wrapper and a publish/pull soak, for tests and for longer runs by hand:

python -m tests.faults --steps 1000 [--seed 1]
"""

from __future__ import annotations

import argparse
import logging
import random
import tempfile
from collections import Counter
from pathlib import Path

import torch

import deltasync_rs as ds
from deltasync_rs.store import Store
from deltasync_rs.sync import LATEST_KEY


class FaultyStore(Store):
    """Wraps a store and misbehaves like a real network and object store can:

    - writes: dropped silently, truncated, bit-flipped, duplicated, or delayed and later written out of order;
    - reads: a bit flipped in transit, or a stale copy of the latest pointer.
    Every fault is counted in ``faults``.
    """

    def __init__(self, inner: Store, *, seed: int, write_rate: float = 0.0, read_rate: float = 0.0) -> None:
        self.inner = inner
        self.url = f"faulty+{inner.url}"
        self.rng = random.Random(seed)
        self.write_rate = write_rate
        self.read_rate = read_rate
        self.faults: Counter[str] = Counter()
        self._delayed: list[tuple[str, bytes]] = []
        self._stale_latest: bytes | None = None

    def _flush_delayed(self, everything: bool = False) -> None:
        if self._delayed and (everything or self.rng.random() < 0.5):
            self.rng.shuffle(self._delayed)
            for key, data in self._delayed:
                self.inner.put(key, data)
            self._delayed = []

    def put(self, key: str, data: bytes) -> None:
        self._flush_delayed()
        if self.rng.random() >= self.write_rate:
            self.inner.put(key, data)
            return
        fault = self.rng.choice(["drop", "truncate", "flip", "duplicate", "delay"])
        self.faults[f"write:{fault}"] += 1
        if fault == "truncate":
            self.inner.put(key, data[: self.rng.randrange(len(data))] if data else data)
        elif fault == "flip" and data:
            corrupted = bytearray(data)
            corrupted[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
            self.inner.put(key, bytes(corrupted))
        elif fault == "duplicate":
            self.inner.put(key, data)
            self.inner.put(key, data)
        elif fault == "delay":
            self._delayed.append((key, data))

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        if key == LATEST_KEY:
            if self._stale_latest is not None and self._stale_latest != data and self.rng.random() < self.read_rate:
                self.faults["read:stale-latest"] += 1
                return self._stale_latest
            self._stale_latest = data
        if data and self.rng.random() < self.read_rate:
            self.faults["read:flip"] += 1
            corrupted = bytearray(data)
            corrupted[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
            return bytes(corrupted)
        return data

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)

    def delete(self, keys: list[str]) -> None:
        self.inner.delete(keys)


def soak(
    steps: int,
    root: Path,
    *,
    seed: int = 0,
    write_rate: float = 0.05,
    read_rate: float = 0.05,
    signing_key: str | None = None,
) -> dict:
    """Publishes `steps` training-like steps through a faulty store while a subscriber pulls after each one.
    After every successful pull the subscriber's state must equal the trainer's state at that step, bit for bit."""
    rng = torch.Generator().manual_seed(seed)
    base = ds.LocalStore(root)
    writer = FaultyStore(base, seed=seed, write_rate=write_rate)
    reader = FaultyStore(base, seed=seed + 1, read_rate=read_rate)
    state = {
        "embed": torch.randn(64, 32, generator=rng).bfloat16(),
        "mlp": torch.randn(48, 32, generator=rng).bfloat16(),
        "norm": torch.ones(32).bfloat16(),
    }
    published: dict[int, dict[str, torch.Tensor]] = {}
    publisher = ds.Publisher(writer, anchor_every=7, keep_anchors=3, background=False, signing_key=signing_key)
    subscriber = ds.Subscriber(reader, signing_key=signing_key, retries=2, retry_delay=0.0)
    replica = {name: torch.zeros_like(t) for name, t in state.items()}
    outcome = Counter()
    for step in range(steps):
        for t in state.values():  # a sparse, training-like update of the bit patterns
            flat = t.view(-1).view(torch.int16)
            where = torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), generator=rng)
            flat[where] += torch.randint(-2, 3, where.shape, generator=rng, dtype=torch.int16)
        publisher.publish(step, state)
        published[step] = {name: t.clone() for name, t in state.items()}
        try:
            at = subscriber.pull(replica)
        except ds.DeltaSyncError:
            outcome["failed pulls"] += 1
            continue
        outcome["successful pulls"] += 1
        if at != step:
            outcome["pulls behind the newest step"] += 1
        if not all(torch.equal(replica[n].view(torch.int16), published[at][n].view(torch.int16)) for n in replica):
            outcome["silent divergences"] += 1
    faults = writer.faults + reader.faults
    # Once the faults stop, the next anchor must bring the subscriber back to the trainer's exact state.
    writer.write_rate = reader.read_rate = 0.0
    writer._flush_delayed(everything=True)
    for step in range(steps, steps + publisher.anchor_every):
        publisher.publish(step, state)
    final = subscriber.pull(replica)
    converged = final == steps + publisher.anchor_every - 1 and all(
        torch.equal(replica[n].view(torch.int16), state[n].view(torch.int16)) for n in replica
    )
    return {
        "steps": steps,
        "successful pulls": outcome["successful pulls"],
        "failed pulls": outcome["failed pulls"],
        "pulls behind the newest step": outcome["pulls behind the newest step"],
        "silent divergences": outcome["silent divergences"],
        "converged after faults stop": converged,
        "faults injected": sum(faults.values()),
        "faults": dict(faults),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="Fault-injection soak of publish/pull through a local store.")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--write-rate", type=float, default=0.05)
    parser.add_argument("--read-rate", type=float, default=0.05)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory() as folder:
        report = soak(args.steps, Path(folder), seed=args.seed, write_rate=args.write_rate, read_rate=args.read_rate)
    for key, value in report.items():
        print(f"{key}: {value}")
    if report["silent divergences"] or not report["converged after faults stop"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
