"""What the `context` codec's decision costs where it does not walk: `ds.diff` of the synthetic step with
`codec="compact"` and `codec="context"` in alternated pairs (on uniformly sampled changes the writer decides, per
tensor, from samples of the base and of the changes, that the walk would not pay, and writes compact's bytes).

    python benches/context_decision.py [pairs] [density]

Prints the medians of each and the median over the pairs of context less compact, in ms. Nothing is asserted.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workload  # noqa: E402

import deltasync_rs as ds  # noqa: E402


def main() -> None:
    pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    density = float(sys.argv[2]) if len(sys.argv) > 2 else 0.01
    w = workload.load_workload(1.0, density)
    compact, context, extra = [], [], []
    for _ in range(pairs):
        start = time.perf_counter()
        ds.diff(w.prev, w.curr, codec="compact")
        middle = time.perf_counter()
        ds.diff(w.prev, w.curr, codec="context")
        end = time.perf_counter()
        compact.append(middle - start)
        context.append(end - middle)
        extra.append(end - 2 * middle + start)
    print(
        f"{pairs} pairs, {density:.2%} changed: compact {statistics.median(compact) * 1e3:.1f} ms, "
        f"context {statistics.median(context) * 1e3:.1f} ms, context - compact "
        f"{statistics.median(extra) * 1e3:.1f} ms (medians)"
    )


if __name__ == "__main__":
    main()
