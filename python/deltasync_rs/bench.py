"""`deltasync bench`: a short version of the benchmark suite's codec comparison, printed as a table and optionally
plotted. Needs torch (the peers are torch encoders), zstandard for the grail-like peer, matplotlib for ``--plot``.

Everything is measured in this process, in one run: medians of ``rounds`` timed calls after one warm-up. The state is
the synthetic Qwen3-0.6B-shaped workload of ``benches/`` (``deltasync_rs._workload``) shrunk by ``scale``.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _workload
from .delta import diff, load

DEFAULT_DENSITIES = (0.0025, 0.005, 0.01, 0.02, 0.05)


@dataclass
class Result:
    density: float
    what: str
    bytes_per_changed: float | None
    encode_ms: float | None
    apply_ms: float | None


def _median_ms(fn: Callable[..., Any], rounds: int, setup: Callable[[], Any] | None = None) -> tuple[float, Any]:
    """The median time of ``fn()`` (or ``fn(setup())``) over ``rounds`` calls after a warm-up, and its last result."""
    times, out = [], None
    for i in range(rounds + 1):
        arg = setup() if setup else None
        start = time.perf_counter()
        out = fn(arg) if setup else fn()
        if i:  # the first call is a warm-up
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, out


def _torch_state(flat: np.ndarray, layout: dict) -> dict:
    import torch

    base = torch.from_numpy(flat.view(np.int16)).view(torch.bfloat16)
    state, at = {}, 0
    for name, shape in zip(layout["names"], layout["shapes"]):
        n = int(np.prod(shape)) if shape else 1
        state[name] = base[at : at + n].view(shape)
        at += n
    return state


def _peer_codecs() -> dict[str, tuple[Callable, Callable]]:
    from . import _peers

    peers: dict[str, tuple[Callable, Callable]] = {
        "TRL v1": (_peers.trl_v1_encode, _peers.trl_v1_apply),
        "TRL v3 gap_delta": (_peers.trl_v3_encode, _peers.trl_v3_apply),
    }
    try:
        import zstandard  # noqa: F401

        peers["grail-like zstd-1"] = (_peers.grail_like_encode, _peers.grail_like_apply)
    except ImportError:
        pass
    return peers


def run(
    scale: float = 0.05,
    densities: Sequence[float] = DEFAULT_DENSITIES,
    rounds: int = 3,
    seed: int = 0,
    peers: bool = True,
    progress: Callable[[str], None] | None = None,
) -> list[Result]:
    """Measures each codec (and, with ``peers``, each peer) at each density; checks every result bit-exactly."""
    results = []
    for density in densities:
        results += _measure_density(scale, density, rounds, seed, peers)
        if progress:
            progress(f"density {density:.2%} done")
    return results


def _measure_density(scale: float, density: float, rounds: int, seed: int, peers: bool) -> list[Result]:
    import torch

    from . import _peers

    prev_flat, curr_flat, layout = _workload.generate(scale, density, seed)
    prev, curr = _torch_state(prev_flat, layout), _torch_state(curr_flat, layout)
    changed = sum(layout["changed"])

    def fresh() -> dict:
        return {k: v.clone() for k, v in prev.items()}

    def check(state: dict, what: str) -> None:
        if not all(torch.equal(state[k].view(torch.int16), curr[k].view(torch.int16)) for k in curr):
            raise AssertionError(f"{what} at density {density}: the applied state differs from the new state")

    def measure(what: str, encode: Callable[[], bytes], apply: Callable[[bytes, dict], object]) -> Result:
        encode_ms, blob = _median_ms(encode, rounds)
        apply_ms, state = _median_ms(lambda s: (apply(blob, s), s)[1], rounds, setup=fresh)
        check(state, what)
        return Result(density, what, len(blob) / changed, encode_ms, apply_ms)

    def apply_deltasync(blob: bytes, state: dict) -> None:
        load(blob).apply_(state)

    results = [
        measure(f"deltasync {codec}", functools.partial(_encode_deltasync, prev, curr, codec), apply_deltasync)
        for codec in ("varint", "compact")
    ]
    for name, (encode, apply) in _peer_codecs().items() if peers else ():
        results.append(measure(name, functools.partial(encode, prev, curr), apply))
    floor_ms, _ = _median_ms(functools.partial(_peers.read_floor, prev, curr, threads=2), rounds)
    results.append(Result(density, "read floor (2 threads)", None, floor_ms, None))
    return results


def _encode_deltasync(prev: dict, curr: dict, codec: str) -> bytes:
    return diff(prev, curr, codec=codec).to_bytes()


def table(results: list[Result]) -> str:
    lines = [f"{'density':>8}  {'what':<24} {'bytes/changed':>13} {'encode ms':>10} {'apply ms':>9}"]
    for r in results:
        size = f"{r.bytes_per_changed:.3f}" if r.bytes_per_changed is not None else ""
        encode = f"{r.encode_ms:.1f}" if r.encode_ms is not None else ""
        apply = f"{r.apply_ms:.1f}" if r.apply_ms is not None else ""
        lines.append(f"{r.density:>8.2%}  {r.what:<24} {size:>13} {encode:>10} {apply:>9}")
    return "\n".join(lines)


def plot(results: list[Result], path: str) -> None:
    """Three panels against density: bytes per changed element, encode time, decode+apply time."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    names = list(dict.fromkeys(r.what for r in results))
    for name in names:
        rows = [r for r in results if r.what == name]
        x = [r.density * 100 for r in rows]
        for ax, values in zip(
            axes, ([r.bytes_per_changed for r in rows], [r.encode_ms for r in rows], [r.apply_ms for r in rows])
        ):
            if all(v is not None for v in values):
                ax.plot(x, values, marker="o", label=name)
    for ax, title in zip(
        axes, ("file bytes per changed element", "encode (diff + serialize), ms", "decode + apply onto a CPU state, ms")
    ):
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(sorted({r.density * 100 for r in results}))
        ax.set_xlabel("changed elements, %")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    axes[1].legend(fontsize=8)  # the encode panel has every line, the read floor included
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
