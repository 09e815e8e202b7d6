"""What ``check_base=True`` costs vLLM ranks at TP = 2 (docs/vllm.md §7): the ranks check the tensors split across
them together. Each rank hashes the 256 KiB identity blocks wholly inside its slices (``vllm._split_part``), the
ranks all-gather those hashes and their bytes of the row-split blocks no rank holds whole, send each column split's
slices to the rank that rebuilds it (``vllm._exchange``), and find every tensor's identity
(``vllm._split_base_error``). The two ranks are threads, one per core as vLLM's ranks on their own cores, the
all-gathers and gathers a barrier exchange through pickle (what gloo's object collectives do, without the
sockets). Against one process checking the same tensors whole (TP = 1: the core's
base identities of every tensor, ``range_identities``), round by round.

    python benches/split_base_check.py [layers] [rounds]

Qwen3-0.6B's shapes (hidden 1024, 16 query and 8 KV heads of 128, MLP 3072, vocabulary 151936), ``layers`` decoder
layers (default 4) and the embedding, bf16, split as vLLM splits them at TP = 2: q/k/v and gate/up by rows (in
fused parameters), o_proj and down_proj by columns, the vocabulary by rows. Prints medians in ms and the bytes that
cross. Nothing is asserted on timings.
"""

from __future__ import annotations

import pickle
import statistics
import sys
import threading
import time
from unittest import mock

import torch

import deltasync_rs as ds
from deltasync_rs import vllm as ds_vllm
from deltasync_rs._core import range_identities

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 1024, 16, 8, 128, 3072, 151936


def shapes(layers: int) -> dict[str, tuple[tuple[int, int], str]]:
    """HF name -> (shape, how TP = 2 splits it)."""
    out = {"model.embed_tokens.weight": ((VOCAB, HIDDEN), "rows")}
    for layer in range(layers):
        p = f"model.layers.{layer}."
        out[p + "self_attn.q_proj.weight"] = ((HEADS * HEAD_DIM, HIDDEN), "rows")
        out[p + "self_attn.k_proj.weight"] = ((KV_HEADS * HEAD_DIM, HIDDEN), "rows")
        out[p + "self_attn.v_proj.weight"] = ((KV_HEADS * HEAD_DIM, HIDDEN), "rows")
        out[p + "self_attn.o_proj.weight"] = ((HIDDEN, HEADS * HEAD_DIM), "cols")
        out[p + "mlp.gate_proj.weight"] = ((MLP, HIDDEN), "rows")
        out[p + "mlp.up_proj.weight"] = ((MLP, HIDDEN), "rows")
        out[p + "mlp.down_proj.weight"] = ((HIDDEN, MLP), "cols")
    return out


def shard(name: str, full: torch.Tensor, how: str, rank: int) -> ds_vllm.ShardMap:
    """Rank ``rank``'s slice of ``full`` (of two), in a parameter of its own (row splits: after as many rows of
    another tensor, as a fused parameter holds them)."""
    rows, cols = full.shape
    if how == "cols":
        half = cols // 2
        param = full[:, rank * half : (rank + 1) * half].contiguous()
        return ds_vllm.ShardMap(name, name, param, (rows, cols), 0, rows, rank * half, half, 0)
    half = rows // 2
    param = torch.empty(2 * half, cols, dtype=full.dtype)
    param[half:] = full[rank * half : (rank + 1) * half]
    return ds_vllm.ShardMap(name, name, param, (rows, cols), rank * half, half, 0, cols, half)


class Ranks:
    """Two ranks as threads; vLLM's all-gather and ``_exchange``'s gathers replaced by barrier exchanges through
    pickle. ``received`` counts the pickled bytes rank 0 received from rank 1."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.barrier = threading.Barrier(2)
        self.slots: list = [None, None]
        self.received = 0

    def all_gather(self, mine):
        rank = self.local.rank
        self.slots[rank] = pickle.dumps(mine)
        self.barrier.wait()
        everyone = [pickle.loads(data) for data in self.slots]
        self.received += len(self.slots[1]) if rank == 0 else 0
        self.barrier.wait()
        return everyone

    def exchange(self, outgoing):
        rank = self.local.rank
        self.slots[rank] = [pickle.dumps(item) for item in outgoing]
        self.barrier.wait()
        mine = [pickle.loads(sent[rank]) for sent in self.slots]
        self.received += len(self.slots[1][0]) if rank == 0 else 0
        self.barrier.wait()
        return mine

    def run(self, work):
        results: list = [None, None]

        def go(rank: int) -> None:
            self.local.rank = rank
            results[rank] = work(rank)

        threads = [threading.Thread(target=go, args=(rank,)) for rank in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return results


def main() -> None:
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    generator = torch.Generator().manual_seed(0)
    base = {n: torch.randn(s, generator=generator).to(torch.bfloat16) for n, (s, _) in shapes(layers).items()}
    new = {n: t.clone() for n, t in base.items()}
    for t in new.values():
        t.view(torch.int16).view(-1)[::100] += 1
    delta = ds.diff(base, new, step=1, base_step=0)
    index = {name: i for i, name in enumerate(delta.names)}
    hows = {n: how for n, (_, how) in shapes(layers).items()}
    shards = [{n: shard(n, base[n], hows[n], rank) for n in base} for rank in range(2)]
    nbytes = sum(t.numel() * 2 for t in base.values())
    column_bytes = sum(t.numel() * 2 for n, t in base.items() if hows[n] == "cols")
    ranks = Ranks()

    class Group:
        world_size = 2

        @property
        def rank_in_group(self) -> int:
            return ranks.local.rank

    def check(rank: int):
        torch.set_num_threads(1)
        ds.set_num_threads(1)
        plan = [(index[n], s) for n, s in shards[rank].items()]
        parts = {n: ds_vllm._split_part(s, 2) for n, s in shards[rank].items()}
        return ds_vllm._split_base_error(delta, plan, ds_vllm._all_gather(parts))

    def whole() -> None:
        ds.set_num_threads(2)
        found = range_identities([(t.view(torch.uint8).view(-1).numpy(), 0, t.numel() * 2) for t in base.values()])
        assert found == [delta.base_identity(index[n]) for n in base]

    times: dict[str, list[float]] = {"TP = 2, the ranks together": [], "TP = 1, one process, 2 threads": []}
    from vllm.distributed import parallel_state

    with (
        mock.patch.object(ds_vllm, "_tensor_parallel", lambda: 2),
        mock.patch.object(ds_vllm, "_all_gather", ranks.all_gather),
        mock.patch.object(ds_vllm, "_exchange", ranks.exchange, create=True),  # create: for builds before it
        mock.patch.object(parallel_state, "get_tp_group", lambda: Group()),
    ):
        for _ in range(rounds + 1):  # the first round warms up
            ranks.received = 0
            start = time.perf_counter()
            assert ranks.run(check) == [None, None]
            times["TP = 2, the ranks together"].append(time.perf_counter() - start)
            start = time.perf_counter()
            whole()
            times["TP = 1, one process, 2 threads"].append(time.perf_counter() - start)
    ds.set_num_threads(0)
    med = {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}
    print(f"{layers} layers + embedding: {nbytes / 2**20:.1f} MiB bf16, column splits {column_bytes / 2**20:.1f} MiB")
    print(f"{rounds} rounds, round-robin; medians in ms")
    for name, value in med.items():
        print(f"  {name:<34} {value:8.1f}")
    print(f"  TP = 2 / TP = 1: {med['TP = 2, the ranks together'] / med['TP = 1, one process, 2 threads']:.2f}")
    print(f"  rank 0 received {ranks.received / 2**20:.1f} MiB pickled ({ranks.received / nbytes:.3f} of the state)")


if __name__ == "__main__":
    main()
