"""Train a small model for a few steps, publish a bf16 anchor and one delta per step to a local folder, then
replay them into a fresh state and check it matches the trainer bit for bit. No network, no account.

    python examples/quickstart.py [--store ./deltasync-store] [--steps 5]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import deltasync_rs as ds


def bf16_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().to(torch.bfloat16).clone() for name, p in model.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, default=Path("deltasync-store"))
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    args.store.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(4096, 256), torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 4096)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)  # RL-scale learning rate; fp32 master weights, bf16 shipped

    published = bf16_state(model)
    ds.anchor(published, step=0).save(args.store / "anchor_000000.safetensors")
    print(f"step 0: anchor, {sum(t.nbytes for t in published.values()) / 1e6:.1f} MB")
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, 4096, (8, 32))
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, dims=1).flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

        current = bf16_state(model)
        start = time.perf_counter()
        delta = ds.diff(published, current, step=step, base_step=step - 1)
        path = args.store / f"delta_{step:06d}.safetensors"
        delta.save(path)
        elapsed = time.perf_counter() - start
        print(
            f"step {step}: {delta.num_changed / delta.num_elements:.3%} of elements changed, "
            f"{path.stat().st_size / 1e3:.1f} kB ({path.stat().st_size / max(delta.num_changed, 1):.2f} bytes per "
            f"change), diff+save {elapsed * 1e3:.1f} ms"
        )
        published = current

    # The inference side: start from the anchor, replay every delta in order.
    replica = {name: torch.empty_like(t) for name, t in published.items()}
    ds.load(args.store / "anchor_000000.safetensors").apply_(replica)
    for step in range(1, args.steps + 1):
        delta = ds.load(args.store / f"delta_{step:06d}.safetensors")
        assert delta.base_step == step - 1, "deltas must be replayed in order"
        delta.apply_(replica)
    exact = all(torch.equal(replica[k].view(torch.int16), published[k].view(torch.int16)) for k in published)
    print(f"replica after step {args.steps} matches the trainer bit for bit: {exact}")
    if not exact:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
