"""Round-robin timing of the 1% comparison: every round runs each contender once, so a burst of load from other
processes on a shared machine hits all of them alike (pytest-benchmark runs one contender's rounds back to back).

    python benches/interleaved.py [density] [rounds]

Prints medians in ms and the ratios the performance goals are stated in. Nothing is asserted on timings.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import baselines  # noqa: E402
import torch  # noqa: E402
import workload  # noqa: E402

import deltasync_rs as ds  # noqa: E402

#: Every codec is timed; `context` also walks the base's classes (on this uniform workload it rarely wins on size,
#: so it shows what the walk costs).
CODECS = ("varint", "compact", "context")


def main() -> None:
    density = float(sys.argv[1]) if len(sys.argv) > 1 else 0.01
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    w = workload.load_workload(1.0, density)
    blobs = {c: ds.diff(w.prev, w.curr, codec=c).to_bytes() for c in CODECS}
    trl = baselines.trl_v1_encode(w.prev, w.curr)
    decoded = baselines.trl_v1_decode_positions(trl)

    def encode(codec: str, threads: int):
        def run():
            ds.set_num_threads(threads)
            try:
                ds.diff(w.prev, w.curr, codec=codec).to_bytes()
            finally:
                ds.set_num_threads(0)

        return run

    encoders = {f"encode {c}, {t} thr": encode(c, t) for c in CODECS for t in (1, 2)}
    encoders["encode TRL v1 torch"] = lambda: baselines.trl_v1_encode(w.prev, w.curr)
    encoders["read floor, 2 thr"] = lambda: baselines.read_floor(w.prev, w.curr, threads=2)
    appliers = {f"apply {c}": (lambda s, b=blobs[c]: ds.load(b).apply_(s)) for c in blobs}
    # What a Subscriber's pull does (check_base=True, and the streams checked as they are applied): every target must
    # first hold the delta's base.
    appliers["apply compact, base checked"] = lambda s: ds.load(blobs["compact"]).apply_(s, check_base=True)
    # A file read to be applied at once: its streams checked by the apply, decoded once instead of twice.
    appliers["apply compact, check=apply"] = lambda s: ds.load(blobs["compact"], check="apply").apply_(s)
    appliers["apply compact, check=apply, base checked"] = lambda s: ds.load(blobs["compact"], check="apply").apply_(
        s, check_base=True
    )
    appliers["apply TRL v1 torch"] = lambda s: baselines.trl_v1_apply(trl, s)
    appliers["apply scatter floor"] = lambda s: baselines.scatter_apply(decoded, s)
    times: dict[str, list[float]] = {k: [] for k in [*encoders, *appliers]}
    for _ in range(rounds + 1):  # the first round warms up
        for name, fn in encoders.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
        for name, fn in appliers.items():
            state = w.clone_prev()
            start = time.perf_counter()
            fn(state)
            times[name].append(time.perf_counter() - start)
            assert all(torch.equal(state[k].view(torch.int16), w.curr[k].view(torch.int16)) for k in state), name
            del state
    med = {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}
    print(f"density {density:.2%}, {rounds} rounds, round-robin; medians in ms")
    for name, value in med.items():
        print(f"  {name:<24} {value:8.1f}")
    # The ceiling on "TRL v1 encode / this" for any encoder that reads both states: reading them is all it costs.
    print(
        f"  TRL v1 encode / read floor {med['encode TRL v1 torch'] / med['read floor, 2 thr']:.2f} "
        "(the most any encoder that reads both states can reach)"
    )
    for codec in blobs:
        print(
            f"  {codec}: {len(blobs[codec]) / w.num_changed:.3f} B/changed; "
            f"TRL v1 encode / this {med['encode TRL v1 torch'] / med[f'encode {codec}, 2 thr']:.2f}; "
            f"this / read floor {med[f'encode {codec}, 2 thr'] / med['read floor, 2 thr']:.2f}; "
            f"1 thr / 2 thr {med[f'encode {codec}, 1 thr'] / med[f'encode {codec}, 2 thr']:.2f}; "
            f"apply / TRL v1 apply {med[f'apply {codec}'] / med['apply TRL v1 torch']:.2f}; "
            f"apply / scatter floor {med[f'apply {codec}'] / med['apply scatter floor']:.2f}"
        )
    checked = med["apply compact, base checked"]
    print(
        f"  compact, base checked: / unchecked {checked / med['apply compact']:.2f}; / TRL v1 apply "
        f"{checked / med['apply TRL v1 torch']:.2f}"
    )
    for name in ("apply compact, check=apply", "apply compact, check=apply, base checked"):
        print(f"  {name[6:]}: / TRL v1 apply {med[name] / med['apply TRL v1 torch']:.2f}")


if __name__ == "__main__":
    main()
