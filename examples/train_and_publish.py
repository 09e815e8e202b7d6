"""Train a small language model and publish its bf16 weights through an optimizer hook: ds.torch.attach mirrors the
weights on the CPU and, after every --sync-every optimizer steps, publishes the delta from the last published state.
Run examples/pull_and_verify.py against the same store to pull and check them.

    python examples/train_and_publish.py [--store ./deltasync-store] [--steps 20] [--sync-every 2]
"""

from __future__ import annotations

import argparse
import shutil
import time

import torch

import deltasync_rs as ds
import deltasync_rs.torch  # noqa: F401  (ds.torch)


class TinyLM(torch.nn.Module):
    """Embedding, two transformer layers and an output head tied to the embedding."""

    def __init__(self, vocab: int = 2048, width: int = 128) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        layer = torch.nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, batch_first=True)
        self.layers = torch.nn.TransformerEncoder(layer, num_layers=2)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        torch.nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        return self.head(self.layers(self.embed(tokens), mask=mask, is_causal=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="deltasync-store", help="a folder, s3://..., or hf://buckets/...")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sync-every", type=int, default=2)
    parser.add_argument("--anchor-every", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-6)
    args = parser.parse_args()
    if "://" not in args.store:
        shutil.rmtree(args.store, ignore_errors=True)  # a fresh run each time

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = TinyLM().to(device)  # fp32 master weights; the mirror ships them as bf16
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    publisher = ds.Publisher(args.store, anchor_every=args.anchor_every)
    attachment = ds.torch.attach(optimizer, model, publisher, sync_every=args.sync_every)
    print(
        f"store {publisher.store.url}: mirror {attachment.mirror.nbytes / 1e6:.1f} MB of bf16, "
        f"tied names {attachment.mirror.aliases}"
    )

    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, 2048, (8, 64), device=device)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        started = time.perf_counter()
        optimizer.step()  # the hook publishes after this when a sync is due
        took = time.perf_counter() - started
        optimizer.zero_grad()
        if attachment.published_step == step:
            entry_note = f"published step {step} in {took * 1e3:.1f} ms (optimizer step included)"
        else:
            entry_note = "not a sync step"
        print(f"step {step:3d}: loss {loss.item():.4f}  {entry_note}")
    attachment.sync()  # whatever changed since the last sync
    attachment.detach()
    publisher.close()
    for entry in ds.sync.log_entries(args.store)[-3:]:
        print(
            f"manifest step {entry.step}: {entry.num_changed / entry.num_elements:.3%} of the elements changed, "
            f"digest {entry.state_digest}"
        )
    print("final weights digest:", attachment.mirror.digest())


if __name__ == "__main__":
    main()
