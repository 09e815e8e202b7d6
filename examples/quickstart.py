"""The main job on the embedded default: train a small model with torch, publish every step to a local-folder
store, and have a subscriber pull and verify each one bit for bit. No account, no network.

    python examples/quickstart.py [--store ./deltasync-store] [--steps 8]
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

import deltasync_rs as ds


def bf16_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights inference runs: bf16 copies of the fp32 master weights."""
    return {name: p.detach().to(torch.bfloat16) for name, p in model.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, default=Path("deltasync-store"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--anchor-every", type=int, default=5)
    args = parser.parse_args()
    shutil.rmtree(args.store, ignore_errors=True)  # a fresh run each time

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(4096, 256), torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 4096)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)  # an RL-scale learning rate on fp32 masters
    full_bytes = sum(t.numel() * 2 for t in model.state_dict().values())

    publisher = ds.Publisher(args.store, anchor_every=args.anchor_every)
    subscriber = ds.Subscriber(args.store)
    replica = {name: torch.empty_like(t) for name, t in bf16_state(model).items()}  # the inference side's weights
    print(f"store: {args.store.resolve()}  (a full bf16 copy is {full_bytes / 1e6:.2f} MB)")
    for step in range(args.steps):
        tokens = torch.randint(0, 4096, (8, 32))
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, dims=1).flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

        trainer_state = bf16_state(model)
        start = time.perf_counter()
        publisher.publish(step, trainer_state)
        publisher.flush()
        published = time.perf_counter() - start

        start = time.perf_counter()
        pulled = subscriber.pull(replica)
        pull_time = time.perf_counter() - start
        exact = all(torch.equal(replica[k].view(torch.int16), trainer_state[k].view(torch.int16)) for k in replica)
        entry = subscriber.entry(step)
        written = sum(ref["size"] for ref in (entry.delta, entry.anchor) if ref)
        kinds = " + ".join(k for k, ref in (("delta", entry.delta), ("anchor", entry.anchor)) if ref)
        print(
            f"step {step}: {kinds:<14} changed {entry.num_changed / entry.num_elements:7.3%}  "
            f"wrote {written / 1e3:8.1f} kB ({written / full_bytes:7.2%} of a full copy)  "
            f"publish {published * 1e3:6.1f} ms  pull {pull_time * 1e3:6.1f} ms  "
            f"subscriber at step {pulled}, bit-exact: {exact}"
        )
        if not exact or pulled != step:
            raise SystemExit("the subscriber diverged from the trainer")
    publisher.close()
    print("verify:", ds.sync.verify_store(args.store) or "every entry, signature and digest checks out")


if __name__ == "__main__":
    main()
