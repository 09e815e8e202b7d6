"""Peak extra memory of ``ds.diff`` (+ ``to_bytes``) on the benchmark workload, per codec, from the kernel's count.

    python benches/memory.py [scale] [density]

Each measurement runs in a fresh subprocess: it loads the workload, resets the peak resident set size (writing 5 to
/proc/self/clear_refs resets VmHWM to the current VmRSS), diffs, and reports VmHWM minus the resident size before the
diff. Rust allocations are invisible to tracemalloc, hence the kernel's figures. Linux only.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys
sys.path.insert(0, {benches!r})
import workload, deltasync_rs as ds

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)

w = workload.load_workload({scale}, {density})
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
delta = ds.diff(w.prev, w.curr, codec={codec!r})
after_diff = status("VmHWM")
blob = delta.to_bytes()
print(json.dumps({{"codec": {codec!r}, "threads": ds.get_num_threads(), "rss_before": before,
                  "peak_extra_diff": after_diff - before, "peak_extra_with_bytes": status("VmHWM") - before,
                  "stream_bytes": delta.nbytes, "file_bytes": len(blob)}}))
"""


def measure(scale: float, density: float, codec: str) -> dict:
    code = CHILD.format(benches=str(Path(__file__).resolve().parent), scale=scale, density=density, codec=codec)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    scale = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    density = float(sys.argv[2]) if len(sys.argv) > 2 else 0.01
    mb = 1e6
    print("| codec | threads | peak extra during diff | + to_bytes | streams | file |")
    print("|---|---:|---:|---:|---:|---:|")
    for codec in ("varint", "compact"):
        r = measure(scale, density, codec)
        print(
            f"| {codec} | {r['threads']} | {r['peak_extra_diff'] / mb:.1f} MB | {r['peak_extra_with_bytes'] / mb:.1f} MB "
            f"| {r['stream_bytes'] / mb:.1f} MB | {r['file_bytes'] / mb:.1f} MB |"
        )


if __name__ == "__main__":
    main()
