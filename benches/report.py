"""Markdown tables of a codec sweep from pytest-benchmark's JSON (benches/test_bench_codecs.py).

    pytest benches/test_bench_codecs.py --benchmark-only --benchmark-json=sweep.json
    python benches/report.py sweep.json

Per density: bytes per changed element, encode and decode+apply medians (ms), and the ratios that the performance
goals are stated in, all taken from the same run.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def _rows(path: str) -> dict:
    """density -> label -> {"encode1", "encode2", "apply": ms; "bytes": float}, from one benchmark JSON."""
    out: dict = defaultdict(lambda: defaultdict(dict))
    with open(path) as f:
        benchmarks = json.load(f)["benchmarks"]
    for bench in benchmarks:
        info, name = bench["extra_info"], bench["name"]
        kind = "apply" if bench["group"].startswith("apply") else "encode"
        median = bench["stats"]["median"] * 1e3
        if "codec" in info:
            label = f"deltasync {info['codec']}"
            if info.get("check") == "apply":  # the same file, its streams checked as they are applied
                label += ', load(check="apply")'
            if kind == "encode":
                kind += str(info["deltasync_threads"])
        elif "peer" in info:
            label, kind = info["peer"], kind if kind == "apply" else "encode1"
        elif "floor_threads" in info:
            label, kind = "read floor (numpy sum of both states)", f"encode{info['floor_threads']}"
        elif "scatter_floor" in name:
            label = "scatter floor (index_put_ of decoded int64 positions)"
        else:
            continue
        row = out[info["density"]][label]
        row[kind] = median
        if "bytes_per_changed" in info:
            row["bytes"] = info["bytes_per_changed"]
    return out


def _ms(value: float | None) -> str:
    return f"{value:.1f}" if value else ""


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else ""


def main(path: str) -> None:
    for density, rows in sorted(_rows(path).items()):
        floor = rows.get("read floor (numpy sum of both states)", {})
        trl = rows.get("trl_v1", {})
        scatter = rows.get("scatter floor (index_put_ of decoded int64 positions)", {}).get("apply")
        print(f"\n### {density * 100:g}% density\n")
        print(
            "| what | bytes / changed | encode ms, 2 thr | 1 thr | TRL v1 encode / this | this / read floor 2 thr "
            "| decode+apply ms | this / TRL v1 apply | this / scatter floor |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for label, row in rows.items():
            best_encode = row.get("encode2") or row.get("encode1")
            print(
                "| "
                + " | ".join(
                    [
                        label,
                        f"{row['bytes']:.3f}" if "bytes" in row else "",
                        _ms(row.get("encode2")),
                        _ms(row.get("encode1")),
                        # On the floor's row: the ceiling on this ratio for any encoder that reads both states.
                        _ratio(trl.get("encode1"), best_encode)
                        if "bytes" in row or label.startswith("read floor")
                        else "",
                        _ratio(best_encode, floor.get("encode2")) if "bytes" in row else "",
                        _ms(row.get("apply")),
                        _ratio(row.get("apply"), trl.get("apply")),
                        _ratio(row.get("apply"), scatter),
                    ]
                )
                + " |"
            )


if __name__ == "__main__":
    main(sys.argv[1])
