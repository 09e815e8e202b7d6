"""Delta sizes on real AdamW steps of a small GPT-2 (``deltasync_rs._realistic``): every codec of ``ds.diff``, the
Publisher's stored deltas, the peers, an order-0 entropy bound, where the bytes go, and which weights change.

    python benches/realistic.py [--held-out] [--lr LR] [--steps N] [--codec NAME ...] [--markdown]

Sizes are whole files (header included) divided by the step's changed elements. The **order-0 bound** of a step is
``sum over tensors t of log2 C(n_t, k_t)`` bits for the positions (``n_t`` elements, ``k_t`` changed: any set of
``k_t`` positions, known ``k_t``) plus ``k_t * H_t`` bits for the values, where ``H_t`` is the empirical order-0 entropy
of tensor t's value symbols, the bit-pattern difference ``new - old`` of each changed element taken modulo 2**16 and
read as int16. It counts no header and no model description (a coder would have to send its tables), so it is a bound
for coders that treat positions as exchangeable and values as independent draws from one table per tensor, not for
coders that use magnitudes or neighbours.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import deltasync_rs as ds
from deltasync_rs import _peers
from deltasync_rs._realistic import DEFAULT, HELD_OUT, load_run

#: Codec names tried with ``ds.diff``; one that ``ds.diff`` rejects is reported as skipped. Add new codecs here
#: (or pass ``--codec``).
CODECS = ["varint", "compact", "context"]

PEERS = {
    "TRL v1": _peers.trl_v1_encode,
    "TRL v3 gap_delta": _peers.trl_v3_encode,
    "grail-like zstd-1": _peers.grail_like_encode,
}

#: Classes of a weight's bf16 exponent relative to its tensor's median exponent: each class halves the magnitude.
EXPONENT_CLASSES = list(range(-4, 4))


def bits16(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().reshape(-1)


def changed_counts(prev: dict, curr: dict) -> dict[str, int]:
    return {name: int(np.count_nonzero(bits16(prev[name]) != bits16(curr[name]))) for name in curr}


def order0_bound(prev: dict, curr: dict) -> tuple[float, float]:
    """(position bits, value bits) of the order-0 bound (module docstring), summed over tensors."""
    position_bits = value_bits = 0.0
    for name in curr:
        old, new = bits16(prev[name]), bits16(curr[name])
        changed = old != new
        n, k = old.size, int(np.count_nonzero(changed))
        if k == 0:
            continue
        position_bits += (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)
        symbols = (new[changed].astype(np.int32) - old[changed].astype(np.int32)).astype(np.int16)
        _, counts = np.unique(symbols, return_counts=True)
        p = counts / k
        value_bits += float(-(counts * np.log2(p)).sum())
    return position_bits, value_bits


def breakdown(blob: bytes) -> dict[str, int] | None:
    """Bytes of a deltasync file by role: header (8-byte length + JSON, and in the packed layout the record list),
    positions (``W:pos``), values (``W:val``) and whole (a tensor stored under its own name). None when some stream
    is of a kind this does not know."""
    (header_len,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + header_len])
    if "__deltasync_streams__" in header:
        # The packed layout (format version 2) holds every stream in one tensor: split them by writing the same
        # delta in the named layout, whose streams are the same bytes; the header is everything else.
        named = ds.load(blob)
        named._raw.packed = False
        parts = breakdown(named.to_bytes())
        if parts is None:
            return None
        parts["header"] = len(blob) - parts["positions"] - parts["values"] - parts["whole"]
        return parts
    records = {record["name"] for record in json.loads(header.get("__metadata__", {}).get("tensors", "[]"))}
    parts = {"header": 8 + header_len, "positions": 0, "values": 0, "whole": 0}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        start, end = info["data_offsets"]
        base, _, suffix = key.rpartition(":")
        if suffix == "pos" and base in records:
            parts["positions"] += end - start
        elif suffix == "val" and base in records:
            parts["values"] += end - start
        elif key in records:
            parts["whole"] += end - start
        else:
            return None
    if sum(parts.values()) != len(blob):
        return None
    return parts


def time_codecs(states: list, codecs: list[str]) -> dict[str, list[float]]:
    """Seconds per step of ``ds.diff(...).to_bytes()`` and of ``ds.load(blob).apply_`` onto a copy of the older
    state (the copy not timed), per codec, round-robin within each step, and of the read floor (both states read
    once, ``_peers.read_floor`` on 2 threads)."""
    from deltasync_rs._peers import read_floor

    times: dict[str, list[float]] = {"read floor": []}
    for prev, curr in zip(states, states[1:]):
        start = time.perf_counter()
        read_floor(prev, curr, threads=2)
        times["read floor"].append(time.perf_counter() - start)
        for codec in codecs:
            start = time.perf_counter()
            blob = ds.diff(prev, curr, codec=codec).to_bytes()
            times.setdefault(f"encode {codec}", []).append(time.perf_counter() - start)
            target = {name: t.clone() for name, t in prev.items()}
            start = time.perf_counter()
            ds.load(blob).apply_(target)
            times.setdefault(f"apply {codec}", []).append(time.perf_counter() - start)
    return times


def encode_codecs(prev: dict, curr: dict, codecs: list[str], skipped: dict[str, str]) -> dict[str, bytes]:
    """codec -> file bytes of ``ds.diff(prev, curr, codec=...)``, each checked to apply bit-exactly."""
    blobs = {}
    for codec in codecs:
        if codec in skipped:
            continue
        try:
            blob = ds.diff(prev, curr, codec=codec).to_bytes()
        except (ds.DeltaSyncError, ValueError, TypeError) as error:
            skipped[codec] = str(error)
            continue
        target = {name: t.clone() for name, t in prev.items()}
        ds.load(blob).apply_(target)
        if any(not np.array_equal(bits16(target[name]), bits16(curr[name])) for name in curr):
            raise AssertionError(f"codec {codec}: the delta does not reproduce the next state")
        blobs[codec] = blob
    return blobs


def publisher_sizes(states: list[dict], **options) -> list[int]:
    """Sizes of the delta files a Publisher stores for steps 1.. (LocalStore in a temporary folder)."""
    from deltasync_rs.manifest import delta_key

    sizes = []
    with tempfile.TemporaryDirectory() as folder, ds.Publisher(ds.LocalStore(folder), **options) as publisher:
        for step, state in enumerate(states):
            publisher.publish(step, state)
            publisher.flush()
            if step:
                sizes.append(os.path.getsize(Path(folder) / delta_key(step)))
    return sizes


def exponent_classes(prev: dict, curr: dict) -> list[tuple[str, int, int]]:
    """(class label, elements, changed) per class of bf16 exponent relative to the tensor's median exponent."""
    elements = dict.fromkeys(EXPONENT_CLASSES, 0)
    changed = dict.fromkeys(EXPONENT_CLASSES, 0)
    for name in curr:
        old, new = bits16(prev[name]), bits16(curr[name])
        exponent = (old.view(np.uint16) >> 7) & 0xFF
        relative = np.clip(
            exponent.astype(np.int32) - int(np.median(exponent)), EXPONENT_CLASSES[0], EXPONENT_CLASSES[-1]
        )
        moved = old != new
        for c in EXPONENT_CLASSES:
            in_class = relative == c
            elements[c] += int(np.count_nonzero(in_class))
            changed[c] += int(np.count_nonzero(moved & in_class))
    labels = {EXPONENT_CLASSES[0]: f"<= {EXPONENT_CLASSES[0]}", EXPONENT_CLASSES[-1]: f">= +{EXPONENT_CLASSES[-1]}"}
    return [(labels.get(c, f"{c:+d}" if c else "0"), elements[c], changed[c]) for c in EXPONENT_CLASSES]


def print_table(title: str, header: list[str], rows: list[list[str]], markdown: bool) -> None:
    print(f"\n{'### ' if markdown else ''}{title}\n")
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
        return
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    for row in [header, *rows]:
        print("  ".join(str(cell).rjust(width) for cell, width in zip(row, widths)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--held-out", action="store_true", help="the held-out config (another seed, lr 1e-6)")
    parser.add_argument("--lr", type=float, help="fine-tuning learning rate (default: the config's)")
    parser.add_argument("--steps", type=int, help="fine-tuning steps (default 12)")
    parser.add_argument("--codec", action="append", default=[], help="another codec name to try with ds.diff")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    parser.add_argument("--cache-dir", help="cache folder (default ~/.cache/deltasync-rs)")
    args = parser.parse_args()
    torch.set_num_threads(2)

    config = HELD_OUT if args.held_out else DEFAULT
    if args.lr is not None:
        config = dataclasses.replace(config, finetune_lr=args.lr)
    if args.steps is not None:
        config = dataclasses.replace(config, finetune_steps=args.steps)
    start = time.perf_counter()
    run = load_run(config, args.cache_dir, log=lambda line: print(line, file=sys.stderr))
    loaded = time.perf_counter() - start
    meta = run.meta
    states = run.states
    losses = meta["pretrain_losses"]
    sizes = {name: t.numel() for name, t in states[0].items()}
    small = [name for name, t in states[0].items() if t.dim() == 1]
    print(
        f"config {run.key}: {json.dumps(meta['config'])}\n"
        f"{meta['num_parameters']:,} parameters in {meta['num_tensors']} tensors ({len(small)} of them 1-D, "
        f"{sum(sizes[n] for n in small):,} elements); pretraining loss {losses[0]:.3f} -> "
        f"{statistics.mean(losses[-10:]):.3f} (mean of the last 10) in {len(losses)} steps, "
        f"{meta['pretrain_seconds']:.0f} s; fine-tuning loss {meta['finetune_losses'][0]:.3f} -> "
        f"{meta['finetune_losses'][-1]:.3f}, {meta['finetune_seconds']:.0f} s; states loaded in {loaded:.1f} s"
    )

    codecs = CODECS + [c for c in args.codec if c not in CODECS]
    skipped: dict[str, str] = {}
    publishers = {
        "Publisher compact": publisher_sizes(states, codec="compact"),
        "Publisher context": publisher_sizes(states, codec="context"),
        "Publisher default": publisher_sizes(states),
    }
    columns: list[str] = []
    per_step: list[dict[str, float]] = []
    breakdowns: dict[str, list[dict[str, int] | None]] = {}
    small_changed = []
    for step in range(1, len(states)):
        prev, curr = states[step - 1], states[step]
        counts = changed_counts(prev, curr)
        k = sum(counts.values())
        small_changed.append(sum(counts[n] for n in small))
        blobs = encode_codecs(prev, curr, codecs, skipped)
        sizes_now = {f"ds.diff {codec}": len(blob) for codec, blob in blobs.items()}
        sizes_now.update({name: stored[step - 1] for name, stored in publishers.items()})
        sizes_now.update({name: len(encode(prev, curr)) for name, encode in PEERS.items()})
        for codec, blob in blobs.items():
            breakdowns.setdefault(codec, []).append(breakdown(blob))
        position_bits, value_bits = order0_bound(prev, curr)
        row = {"step": step, "changed": k, "fraction": k / meta["num_parameters"]}
        row.update({name: size / k for name, size in sizes_now.items()})
        row["order-0 bound"] = (position_bits + value_bits) / 8 / k
        row["bound positions bits"] = position_bits / k
        row["bound values bits"] = value_bits / k
        columns = list(sizes_now)
        per_step.append(row)
    for codec, reason in skipped.items():
        print(f"codec {codec!r} skipped: {reason}")
    timed = [c for c in codecs if c not in skipped]
    timing = time_codecs(states, timed)

    header = ["step", "changed", "changed %", *columns, "order-0 bound"]
    rows = [
        [
            str(r["step"]),
            f"{r['changed']:,}",
            f"{100 * r['fraction']:.3f}",
            *(f"{r[c]:.3f}" for c in columns),
            f"{r['order-0 bound']:.3f}",
        ]
        for r in per_step
    ]
    mean = {key: statistics.mean(r[key] for r in per_step) for key in per_step[0] if key != "step"}
    strong = "**" if args.markdown else ""
    rows.append(
        [
            f"{strong}mean{strong}",
            f"{mean['changed']:,.0f}",
            f"{100 * mean['fraction']:.3f}",
            *(f"{strong}{mean[c]:.3f}{strong}" for c in columns + ["order-0 bound"]),
        ]
    )
    print_table("Bytes per changed element (whole file / changed elements), per step", header, rows, args.markdown)

    print_table(
        "Order-0 bound, bits per changed element (mean over steps)",
        ["positions", "values", "total", "total, bytes"],
        [
            [
                f"{mean['bound positions bits']:.2f}",
                f"{mean['bound values bits']:.2f}",
                f"{mean['bound positions bits'] + mean['bound values bits']:.2f}",
                f"{mean['order-0 bound']:.3f}",
            ]
        ],
        args.markdown,
    )

    floor = statistics.median(timing["read floor"])
    print_table(
        "Time per step (median over steps, ms; 2 threads; the read floor reads both states once)",
        ["codec", "ds.diff + to_bytes", "/ read floor", "ds.load + apply_", "/ read floor"],
        [
            [
                codec,
                f"{statistics.median(timing[f'encode {codec}']) * 1e3:.1f}",
                f"{statistics.median(timing[f'encode {codec}']) / floor:.2f}",
                f"{statistics.median(timing[f'apply {codec}']) * 1e3:.1f}",
                f"{statistics.median(timing[f'apply {codec}']) / floor:.2f}",
            ]
            for codec in timed
        ]
        + [["read floor", f"{floor * 1e3:.1f}", "1.00", "", ""]],
        args.markdown,
    )

    for codec, parts_per_step in breakdowns.items():
        total_changed = sum(r["changed"] for r in per_step)
        if any(parts is None for parts in parts_per_step):
            total = sum(r[f"ds.diff {codec}"] * r["changed"] for r in per_step)
            print(
                f"\nds.diff {codec}: streams of an unknown kind; total only: {8 * total / total_changed:.2f} bits/changed"
            )
            continue
        known = [parts for parts in parts_per_step if parts is not None]
        sums = {role: sum(parts[role] for parts in known) for role in known[0]}
        total = sum(sums.values())
        print_table(
            f"ds.diff {codec}: where the bytes go (all steps together)",
            ["", *sums, "total"],
            [
                ["bytes", *(f"{v:,}" for v in sums.values()), f"{total:,}"],
                [
                    "bits per changed",
                    *(f"{8 * v / total_changed:.2f}" for v in sums.values()),
                    f"{8 * total / total_changed:.2f}",
                ],
                ["share", *(f"{100 * v / total:.1f}%" for v in sums.values()), "100%"],
            ],
            args.markdown,
        )

    middle = len(states) // 2
    classes = exponent_classes(states[middle - 1], states[middle])
    base = next(changed / elements for label, elements, changed in classes if label == "0")
    total_elements = sum(elements for _, elements, _ in classes)
    print_table(
        f"Change probability by bf16 exponent relative to the tensor's median (step {middle})",
        ["exponent class", "elements", "share", "changed", "P(change)", "P / P(class 0)"],
        [
            [
                label,
                f"{elements:,}",
                f"{100 * elements / total_elements:.1f}%",
                f"{changed:,}",
                f"{100 * changed / elements:.3f}%" if elements else "-",
                f"{changed / elements / base:.2f}" if elements else "-",
            ]
            for label, elements, changed in classes
        ],
        args.markdown,
    )
    small_elements = sum(sizes[n] for n in small)
    print(
        f"\n1-D tensors (biases, LayerNorms): {len(small)} tensors, {small_elements:,} elements, changed "
        f"{100 * statistics.mean(small_changed) / small_elements:.2f}% per step on average (all tensors: "
        f"{100 * mean['fraction']:.3f}%)"
    )


if __name__ == "__main__":
    main()
