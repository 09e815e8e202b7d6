"""The counterpart of train_and_publish.py: pull the newest published weights into a fresh CPU state (shaped from
the newest anchor) and verify them against the manifest's state digest.

    python examples/pull_and_verify.py [--store ./deltasync-store] [--expect DIGEST]
"""

from __future__ import annotations

import argparse

import torch

import deltasync_rs as ds
from deltasync_rs._arrays import torch_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="deltasync-store")
    parser.add_argument("--expect", help="the digest the trainer printed, checked too when given")
    args = parser.parse_args()

    subscriber = ds.Subscriber(args.store)
    newest_anchor = subscriber.fetch(None)[0]  # names, dtypes and shapes of the published state
    state = {t.name: torch.zeros(t.shape, dtype=torch_dtype(t.dtype)) for t in newest_anchor.tensors}
    step = subscriber.pull(state)  # verifies every file and the state digest, re-syncing on a mismatch
    digest = ds.state_digest(state)
    entry = subscriber.entry(step)
    print(f"pulled step {step}: {len(state)} tensors, digest {digest}")
    if digest != entry.state_digest:
        raise SystemExit(f"digest mismatch: the manifest says {entry.state_digest}")
    if args.expect and digest != args.expect:
        raise SystemExit(f"digest mismatch: expected {args.expect}")
    print("bit-exact: the state digest matches the manifest" + (" and the trainer" if args.expect else ""))


if __name__ == "__main__":
    main()
