"""What rank 0's ``Publisher.publish_shards`` costs the training step with FSDP2 (every rank waits for it), on the
benchmark workload.

    python benches/shard_publish.py [scale] [ranks] [steps]

Every tensor of the workload (scale 1: the Qwen3-0.6B shape, 1% of its elements changed per step) is cut into
``ranks`` dim-0 shards (default 2), each diffed by a sharded mirror (``MirrorDiff`` with ``finish(None)``, as
``ds.torch.Mirror`` does for a rank), with its proofs. Two publishers take the same steps (``steps``, default 9,
alternating the two states), round-robin: one by ``publish_shards`` (the parts joined as they are and applied to the
mirror; the upload thread re-encodes the joined delta in the compact codec), the other the way it was done before:
the proofs checked, the parts joined in the compact codec, then ``publish_delta``. Medians over all steps but the
first, in ms, of the call alone (what every rank waits for) and of the call + ``flush()``. Both stores must hold the
same delta bytes. Nothing is asserted on timings.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import workload  # noqa: E402

import deltasync_rs as ds  # noqa: E402
from deltasync_rs._core import MirrorDiff, join_shards  # noqa: E402


def shard_parts(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], ranks: int):
    """Each rank's delta (varint shards) from ``old`` to ``new`` and its proofs, tensors cut on dim 0 as FSDP2 cuts
    them (``torch.chunk`` sizes)."""
    parts, proofs = [], []
    for rank in range(ranks):
        builder = MirrorDiff("diff", "compact")
        for name, tensor in old.items():
            rows = tensor.shape[0] if tensor.dim() else 1
            per_rank, row_elements = -(-rows // ranks), tensor.numel() // max(rows, 1)
            first = min(rank * per_rank, rows) * row_elements
            last = min((rank + 1) * per_rank, rows) * row_elements
            if last <= first:
                continue
            builder.begin(name, "BF16", list(tensor.shape))
            mirror = tensor.reshape(-1)[first:last].clone()
            fresh = new[name].reshape(-1)[first:last].contiguous()
            builder.update(mirror.view(torch.uint8).numpy(), fresh.view(torch.uint8).numpy(), first)
            builder.finish(None)
        parts.append(ds.Delta(builder.take()))
        proofs.append(builder.take_shard_bases())
    return parts, proofs


def main() -> None:
    scale = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    ranks = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 9
    w = workload.load_workload(scale, 0.01)
    forward, backward = shard_parts(w.prev, w.curr, ranks), shard_parts(w.curr, w.prev, ranks)

    def before(publisher: ds.Publisher, step: int, parts, proofs) -> None:
        identities = publisher._check_proofs(parts, proofs)  # the joined tensors' base identities, as they record
        publisher.publish_delta(step, ds.Delta(join_shards([p._raw for p in parts], "compact", identities=identities)))

    contenders = {
        "publish_shards": lambda publisher, step, parts, proofs: publisher.publish_shards(step, parts, proofs=proofs),
        "before: join compact, publish_delta": before,
    }
    alone: dict[str, list[float]] = {k: [] for k in contenders}
    flushed: dict[str, list[float]] = {k: [] for k in contenders}
    with tempfile.TemporaryDirectory() as root:
        publishers = {
            k: ds.Publisher(ds.LocalStore(f"{root}/{i}"), anchor_every=1000) for i, k in enumerate(contenders)
        }
        for publisher in publishers.values():
            publisher.publish(0, w.prev)
            publisher.flush()
        for step in range(1, steps + 1):
            parts, proofs = forward if step % 2 else backward
            for part in parts:
                part.step, part.base_step = step, step - 1
            for label, run in contenders.items():
                started = time.perf_counter()
                run(publishers[label], step, parts, proofs)
                returned = time.perf_counter()
                publishers[label].flush()
                alone[label].append(returned - started)
                flushed[label].append(time.perf_counter() - started)
        for publisher in publishers.values():
            publisher.close()
        stores = [ds.LocalStore(f"{root}/{i}", create=False) for i in range(len(contenders))]
        for step in range(1, steps + 1):
            key = ds.sync.delta_key(step)
            if stores[0].get(key) != stores[1].get(key):
                raise SystemExit(f"step {step}: the two ways published different bytes")
    gib = sum(t.numel() * t.element_size() for t in w.prev.values()) / 2**30
    print(f"{gib:.2f} GiB in {len(w.prev)} tensors, {ranks} ranks, steps 2-{steps}, round-robin; medians in ms")
    for label in contenders:
        print(
            f"  {label:38s} call {statistics.median(alone[label][1:]) * 1e3:7.1f}   "
            f"call + flush {statistics.median(flushed[label][1:]) * 1e3:7.1f}"
        )


if __name__ == "__main__":
    main()
