"""What rank 0 pays per FSDP2 step to check the ranks' proofs of their bases, on the benchmark workload.

    python benches/shard_proofs.py [scale] [ranks] [rounds]

Publishes the workload's first state (scale 1: the Qwen3-0.6B shape, 1.1 GiB of BF16), then times
``Publisher.publish_shards``' check of the proofs alone (every tensor split into ``ranks`` dim-0 shards, default 2,
each with the base identity of its range, as ``ds.torch.Mirror.last_bases`` lists them), beside ``ds.state_digest``
of the same state (what the upload thread reads per step, at memory speed). Round-robin,
``rounds`` rounds (default 7); medians in ms. Nothing is asserted on timings; the check must accept the true proofs
and refuse one changed element.
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
from deltasync_rs._core import base_identity  # noqa: E402


def proofs_of(state: dict[str, torch.Tensor], ranks: int) -> list[list[tuple[str, int, int, str]]]:
    """Each rank's proofs for dim-0 chunks of every tensor, as FSDP2 cuts them (``torch.chunk`` sizes)."""
    out: list[list[tuple[str, int, int, str]]] = [[] for _ in range(ranks)]
    for name, tensor in state.items():
        rows = tensor.shape[0] if tensor.dim() else 1
        per_rank, row_elements = -(-rows // ranks), tensor.numel() // max(rows, 1)
        flat = tensor.reshape(-1).view(torch.uint8)
        width = tensor.element_size()
        for rank in range(ranks):
            first, last = min(rank * per_rank, rows) * row_elements, min((rank + 1) * per_rank, rows) * row_elements
            if last > first:
                out[rank].append((name, first, last - first, base_identity(flat[first * width : last * width])))
    return out


def main() -> None:
    scale = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    ranks = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 7
    state = workload.load_workload(scale, 0.01).prev
    proofs = proofs_of(state, ranks)
    empty = [ds.load(ds.diff({}, {}).to_bytes()) for _ in range(ranks)]  # parts without tensors: the proofs vouch
    with tempfile.TemporaryDirectory() as folder:
        publisher = ds.Publisher(folder, background=False)
        publisher.publish(0, state)
        publisher._check_proofs(empty, proofs)  # the true proofs are accepted
        wrong = [list(p) for p in proofs]
        name, first, elements, _ = wrong[-1][0]
        changed = state[name].clone()
        changed.reshape(-1).view(torch.int16)[first] += 1  # one element of the range, one bit-pattern step
        width = changed.element_size()
        span = changed.reshape(-1).view(torch.uint8)[first * width : (first + elements) * width]
        wrong[-1][0] = (name, first, elements, base_identity(span))
        try:
            publisher._check_proofs(empty, wrong)
        except ds.BaseMismatchError:
            pass
        else:
            raise SystemExit("a proof of another state was accepted")
        contenders = {
            f"proof check ({ranks} ranks)": lambda: publisher._check_proofs(empty, proofs),
            "ds.state_digest": lambda: ds.state_digest(state),
        }
        times: dict[str, list[float]] = {k: [] for k in contenders}
        for _ in range(rounds):
            for label, run in contenders.items():
                started = time.perf_counter()
                run()
                times[label].append(time.perf_counter() - started)
        publisher.close()
    gib = sum(t.numel() * t.element_size() for t in state.values()) / 2**30
    print(f"{gib:.2f} GiB in {len(state)} tensors, {rounds} rounds, round-robin; medians in ms")
    for label, values in times.items():
        print(f"  {label:32s} {statistics.median(values) * 1e3:8.1f}")


if __name__ == "__main__":
    main()
