"""What a reader's checks of an anchor it holds whole cost (docs/format.md §10, "Reading": a wrong anchor in the
store): the anchor's tensors hashed into the state digest its entry must match, and the first delta's base
identities compared with the anchor's tensors (``RawDelta.check_follows``). Both against reading the anchor's bytes
once (a numpy sum over uint64 views on 2 threads, the read floor) and against the pull of that anchor and delta from a
local store (``Subscriber.fetch``), round by round. And what tensor-parallel readers pay to check the tensors none
of them read whole (vLLM at TP > 1, docs/vllm.md §7): two readers each read half of every tensor by ranges (cut
a little past the middle, so that each cut falls inside a 256 KiB block); one reader's share of the check (hashing
the blocks it holds, ``held_tensors``, and sending its bytes of the cut blocks) and combining both readers' parts
into every tensor's identity (``split_identities``), against that reader's ranged fetch; and, where no delta
follows the anchor, one reader's turn of the state digest made in turns (its rows fed into each tensor's XXH3-128,
one tensor after another here), and the whole digest made in turns by the two readers, each a thread hashing on
one core as ranks on their own cores do, a barrier between turns (vLLM's all-gather): in the staggered turns the
readers take (``hash_turns``), and with every tensor started in the first turn (the readers one after another).

    python benches/anchor_checks.py [GiB] [rounds]

A synthetic bf16 state of 32 equal tensors (default 1 GiB) and a delta moving 1% of its elements by one. Prints
medians in ms and ratios. Nothing is asserted on timings.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import deltasync_rs as ds
from deltasync_rs._core import combine_hashes, tensor_hash_begin, tensor_hash_feed, tensor_hash_finish
from deltasync_rs._peers import read_floor
from deltasync_rs._ranged import (
    PartialAnchor,
    fragment_plan,
    fragments,
    hash_turns,
    held_tensors,
    segments,
    split_identities,
)


def main() -> None:
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    numel = int(gib * (1 << 30)) // 2 // 32
    generator = torch.Generator().manual_seed(0)
    prev = {f"layer{i}.weight": torch.randn(numel, generator=generator).to(torch.bfloat16) for i in range(32)}
    curr = {}
    for name, tensor in prev.items():
        bits = tensor.view(torch.int16).clone()
        bits[torch.randperm(numel, generator=generator)[: numel // 100]] += 1
        curr[name] = bits.view(torch.bfloat16)
    with tempfile.TemporaryDirectory() as folder:
        store = Path(folder, "store")
        with ds.Publisher(store, background=False) as publisher:
            publisher.publish(0, prev)
            publisher.publish(1, curr)
        subscriber = ds.Subscriber(store)
        anchor_entry = subscriber.entry(0)
        deltas = subscriber.fetch(None)
        anchor, delta = deltas[0], deltas[1]
        assert anchor._raw.whole_state_digest() == anchor_entry.state_digest
        names = list(prev)  # read_floor reads the two states it is given, paired by name: each tensor once
        evens = {names[i]: prev[names[i]] for i in range(0, len(names), 2)}
        odds = {names[i]: prev[names[i + 1]] for i in range(0, len(names), 2)}

        def read() -> None:
            read_floor(evens, odds, threads=2)

        def half(first: bool):
            def needed(tensors):
                cuts = [(t.start, t.start + (t.end - t.start) // 2 + 6) for t in tensors]
                return [(a, b) if first else (b - 8, t.end) for (a, b), t in zip(cuts, tensors)]

            return needed

        readers = [ds.Subscriber(store, anchor_ranges=half(first)).fetch(None)[0] for first in (True, False)]
        assert all(isinstance(reader, PartialAnchor) for reader in readers)

        held = [held_tensors(reader, names) for reader in readers]
        plan = fragment_plan(held)
        sent = [fragments(reader, plan, rank) for rank, reader in enumerate(readers)]

        def share() -> None:  # reader 0's part: its blocks hashed, its bytes of the cut blocks
            fragments(readers[0], fragment_plan([held_tensors(readers[0], names), held[1]]), 0)

        cuts = segments([held_tensors(reader, names, hashes=False) for reader in readers])
        infos = {info.name: info for info in readers[0].tensors}

        def digest_turn() -> None:  # reader 0's turn of the state digest: its rows fed into each tensor's XXH3-128
            for name, cut in cuts.items():
                rank, start, end = cut[0]
                if rank == 0:
                    state = tensor_hash_begin(infos[name].dtype, list(infos[name].shape))
                    with readers[0].tensor_view(name, start, end) as view:
                        tensor_hash_feed(state, view)

        def in_turns(plan: list[list[tuple[str, int]]]):
            def run() -> None:
                states: dict[str, bytes] = {}
                barrier = threading.Barrier(len(readers))

                def reader(rank: int) -> None:
                    for turn in plan:
                        for name, index in turn:
                            owner, start, end = cuts[name][index]
                            if owner == rank:
                                info = infos[name]
                                state = states[name] if index else tensor_hash_begin(info.dtype, list(info.shape))
                                with readers[rank].tensor_view(name, start, end) as view:
                                    state = tensor_hash_feed(state, view)
                                last = index == len(cuts[name]) - 1
                                states[name] = tensor_hash_finish(state) if last else state
                        barrier.wait()

                threads = [threading.Thread(target=reader, args=(rank,)) for rank in range(len(readers))]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                assert combine_hashes(sorted(states.items())) == anchor_entry.state_digest

            return run

        staggered = hash_turns(cuts, len(readers))
        longest = max(len(cut) for cut in cuts.values())
        in_rank_order = [[(name, k) for name, cut in cuts.items() if k < len(cut)] for k in range(longest)]

        def combine() -> None:
            identities, conflicts = split_identities(held, plan, sent)
            assert len(identities) == len(names) and not conflicts

        timings: dict[str, list[float]] = {
            "read floor": [],
            "digest": [],
            "check_follows": [],
            "fetch": [],
            "split: 1 reader": [],
            "split: combine": [],
            "digest: 1 reader's turn": [],
            "digest in turns, staggered": [],
            "digest in turns, in rank order": [],
            "ranged fetch": [],
        }
        work = {
            "read floor": read,
            "digest": anchor._raw.whole_state_digest,
            "check_follows": lambda: delta._raw.check_follows(anchor._raw),
            "fetch": lambda: ds.Subscriber(store).fetch(None),
            "split: 1 reader": share,
            "split: combine": combine,
            "digest: 1 reader's turn": digest_turn,
            "digest in turns, staggered": in_turns(staggered),
            "digest in turns, in rank order": in_turns(in_rank_order),
            "ranged fetch": lambda: ds.Subscriber(store, anchor_ranges=half(True)).fetch(None),
        }
        for _ in range(rounds):
            for what, run in work.items():
                start = time.perf_counter()
                run()
                timings[what].append(time.perf_counter() - start)
    median = {what: statistics.median(times) * 1e3 for what, times in timings.items()}
    print(f"{gib:g} GiB anchor, {rounds} rounds, medians in ms")
    for what, ms in median.items():
        print(f"  {what:<32} {ms:8.1f}")
    checks = median["digest"] + median["check_follows"]
    print(
        f"  both checks / read floor {checks / median['read floor']:.2f}; both checks / fetch {checks / median['fetch']:.2f}"
    )
    print(
        f"  split check, one reader's share / its ranged fetch {median['split: 1 reader'] / median['ranged fetch']:.2f}"
    )
    turns, one_turn = median["digest in turns, staggered"], median["digest: 1 reader's turn"]
    print(
        f"  digest in turns ({len(staggered)} staggered turns) / in rank order "
        f"{turns / median['digest in turns, in rank order']:.2f}; staggered / one reader's turn {turns / one_turn:.2f}"
    )

    # The staggered plan by bytes alone, on tensor-parallel ranks of every size: 72 row-split tensors of three sizes,
    # one segment per rank (as tests/test_anchor_ranges.py lays them out), against every tensor started in turn 0.
    for ranks in (2, 4, 8):
        sizes = [1 << 20, 3 << 19, 1 << 18]  # bytes per rank
        layout = {
            f"t{i}.{k}": [(r, r * size, (r + 1) * size) for r in range(ranks)]
            for i in range(24)
            for k, size in enumerate(sizes)
        }
        plan = hash_turns(layout, ranks)
        cost = sum(
            max(sum(layout[n][i][2] - layout[n][i][1] for n, i in turn if layout[n][i][0] == r) for r in range(ranks))
            for turn in plan
        )
        print(
            f"  by bytes, TP={ranks}: staggered {cost / (24 * sum(sizes)):.3f} x one rank's share in {len(plan)} turns (in rank order: {ranks})"
        )


if __name__ == "__main__":
    main()
