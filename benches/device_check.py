"""The one script a session with a GPU runs (the device is lent for minutes): every deltasync path that touches the
device, timed against its floor in the same run, on the benchmark workload (benches/workload.py: Qwen3-0.6B-shaped
bf16 states, about 1% of the elements changed per step).

1. Trainer: ``ds.torch.Mirror.step`` of a model on the GPU (chunked device-to-host copies into pinned buffers,
   overlapping the core's compare and mirror update), for ``varint`` and ``compact``, against copying the weights
   to pinned host buffers alone.
2. Inference side: ``Delta.apply_`` onto the state on the GPU (decode on the host, one transfer, ``index_copy_`` on
   the device) for ``compact`` and ``context``, with and without ``check_base`` (the base identity on the device),
   against TRL v1's path (safetensors load, indices and values to the device, ``index_put_``).
3. ``ds.state_digest`` of the state on the GPU (round sums on the device) against copying it to the host and
   hashing it there; then benches/device_hashes.py's table, to set ``_identity.HOST_BELOW`` and
   ``STATE_HOST_BELOW``.

    python benches/device_check.py [--scale S] [--rounds N] [--cpu]

Medians of ``rounds`` (default 5) after a warm-up; every result is checked bit for bit. Prints a markdown report
and writes it, with the raw figures as JSON, into $OUT when that is set (the device tool's output folder).
``--cpu`` runs everything on CPU tensors (a smoke run, tested; its timings say nothing about a GPU). Nothing is
asserted on timings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import device_hashes  # noqa: E402
import workload  # noqa: E402
from safetensors.torch import load as st_load  # noqa: E402

import deltasync_rs as ds  # noqa: E402
from deltasync_rs._peers import trl_v1_encode  # noqa: E402


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[n].cpu().view(torch.int16), b[n].cpu().view(torch.int16)) for n in b)


def _trl_v1_apply(blob: bytes, state: dict[str, torch.Tensor]) -> None:
    """TRL v1's apply onto a state on a device: parse, move indices and values there, ``index_put_``."""
    loaded = st_load(blob)
    for key, indices in loaded.items():
        if key.endswith(".indices"):
            name = key[: -len(".indices")]
            target = state[name]
            values = loaded[f"{name}.values"].to(target.device)
            target.view(-1).index_put_((indices.to(target.device).long(),), values)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cpu", action="store_true", help="CPU tensors throughout (a smoke run)")
    args = parser.parse_args(argv)
    if args.cpu:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("needs a CUDA device (or --cpu for a smoke run)")
        return {}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    w = workload.load_workload(args.scale, 0.01)
    prev = {n: t.to(device) for n, t in w.prev.items()}
    curr = {n: t.to(device) for n, t in w.curr.items()}
    state_bytes = sum(t.numel() * t.element_size() for t in prev.values())
    figures: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke run)",
        "scale": args.scale,
        "state bytes": state_bytes,
    }

    # 1. Trainer: the mirror's step against copying the weights to pinned host buffers.
    model = {n: t.clone() for n, t in prev.items()}
    pinned = {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=device.type == "cuda") for n, t in prev.items()}

    def copy_alone() -> None:
        for n, t in model.items():
            pinned[n].copy_(t, non_blocking=True)

    figures["copy to pinned host buffers, ms"] = device_hashes.median_ms(copy_alone, args.rounds, sync, lambda: None)
    for codec in ("varint", "compact"):
        mirror = ds.torch.Mirror(model, codec=codec, step=0)
        steps = iter(range(1, 10**6))  # each timed step a new step number

        def back_to_prev(mirror: Any = mirror) -> None:
            """The mirror at the previous state, the model at the new one: each step is the same 1% delta."""
            for n, m in mirror.tensors.items():
                m.copy_(w.prev[n])
            mirror.current_step = 0
            for n, t in model.items():
                t.copy_(curr[n])

        figures[f"Mirror.step {codec}, ms"] = device_hashes.median_ms(
            lambda mirror=mirror, steps=steps: mirror.step(next(steps)), args.rounds, sync, back_to_prev
        )
        back_to_prev()
        delta = mirror.step(1)
        replica = {n: t.clone() for n, t in prev.items()}
        delta.apply_(replica)
        assert _equal(replica, curr), f"Mirror.step {codec}: the delta does not rebuild the new state"

    # 2. Inference side: apply onto the state on the device.
    target = {n: t.clone() for n, t in prev.items()}

    def reset_target() -> None:
        for n, t in target.items():
            t.copy_(prev[n])

    trl = trl_v1_encode(w.prev, w.curr)
    figures["TRL v1 load + index_put_, ms"] = device_hashes.median_ms(
        lambda: _trl_v1_apply(trl, target), args.rounds, sync, reset_target
    )
    assert _equal(target, curr), "TRL v1 apply"
    for codec in ("compact", "context"):
        blob = ds.diff(w.prev, w.curr, codec=codec).to_bytes()
        for check in (False, True):
            name = f"apply {codec}{', check_base' if check else ''}, ms"
            figures[name] = device_hashes.median_ms(
                lambda b=blob, c=check: ds.load(b, check="apply").apply_(target, check_base=c),
                args.rounds,
                sync,
                reset_target,
            )
            assert _equal(target, curr), name

    # 3. The state digest of the state on the device, and where the device beats a copy to the host.
    want = ds.state_digest(w.curr)
    assert ds.state_digest(curr) == want, "state digest on the device"
    figures["state_digest on the device, ms"] = device_hashes.median_ms(
        lambda: ds.state_digest(curr), args.rounds, sync, lambda: None
    )
    figures["copy to host + state_digest, ms"] = device_hashes.median_ms(
        lambda: ds.state_digest({n: t.cpu() for n, t in curr.items()}), args.rounds, sync, lambda: None
    )
    hashes_argv = ["--rounds", str(args.rounds)] + (
        ["--cpu", "--sizes", "262144,1048576", "--small", "20"] if args.cpu else []
    )
    rows = device_hashes.main(hashes_argv)
    figures["device hashes"] = rows

    report = [
        f"# deltasync device check: {figures['device']}, scale {args.scale} ({state_bytes / 1e9:.2f} GB bf16)",
        "",
    ]
    report += ["| what | median ms |", "|---|---:|"]
    report += [f"| {k[:-4]} | {v:.1f} |" for k, v in figures.items() if k.endswith(", ms")]
    text = "\n".join(report)
    print(text)
    out = os.environ.get("OUT")
    if out:
        Path(out, "device_check.md").write_text(text + "\n")
        Path(out, "device_check.json").write_text(json.dumps(figures, indent=1))
    return figures


if __name__ == "__main__":
    main(sys.argv[1:])
