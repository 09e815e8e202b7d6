"""Where hashing a tensor on its GPU beats copying it to the host, for the two hashes deltasync makes of device
tensors (deltasync_rs._identity): the base identity (XXH3-64 per 256 KiB block; 255 scramble rounds run one after
another on the device per call, so small tensors pay kernel launches) and the state-digest hash (XXH3-128; rounds
summed on the device, chained on the host: no sequential device work). For each size, bf16 tensors on the device:

- base identity: ``.cpu()`` + the core's hash, against ``_identity.base_identities`` (HOST_BELOW set to 0);
- state hash: ``.cpu()`` + ``_core.tensor_hashes``, against ``_identity.state_hashes`` (STATE_HOST_BELOW set to 0);

then 1,000 tensors of 64 KiB hashed for the digest one copy each against the batched copies ``state_hashes`` makes.
The crossover sizes are what ``HOST_BELOW`` and ``STATE_HOST_BELOW`` should be (today 16 MiB and 1 MiB, guesses).

    python benches/device_hashes.py [--cpu] [--rounds N] [--sizes BYTES,...] [--small N]

Needs a CUDA device; ``--cpu`` runs the same code on CPU tensors sent down the device path (a check that the script
runs; its timings say nothing about a GPU). Medians of ``rounds`` (default 7) after one warm-up. Nothing is asserted
on timings; every hash is checked against the host's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from deltasync_rs import _identity
from deltasync_rs._core import base_identity, tensor_hashes

DEFAULT_SIZES = [1 << 18, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


def median_ms(
    run: Callable[[], Any], rounds: int, sync: Callable[[], None], reset: Callable[[], None] = lambda: None
) -> float:
    """Median of ``run()`` over ``rounds`` after a warm-up, the device synchronised, ``reset()`` (untimed) before
    each."""
    times = []
    for index in range(rounds + 1):
        reset()
        sync()
        started = time.perf_counter()
        run()
        sync()
        if index:
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def _host_state_hash(name: str, tensor: torch.Tensor) -> bytes:
    data = tensor.reshape(-1).view(torch.uint8).cpu().numpy()
    return bytes(tensor_hashes([(name, "BF16", list(tensor.shape), data)])[0])


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="CPU tensors down the device path (a smoke run)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=DEFAULT_SIZES)
    parser.add_argument("--small", type=int, default=1000, help="how many 64 KiB tensors in the last row")
    args = parser.parse_args(argv)
    saved = _identity.HOST_BELOW, _identity.STATE_HOST_BELOW, _identity.TORCH_ON_CPU
    if args.cpu:
        device = torch.device("cpu")
        _identity.TORCH_ON_CPU = True
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("needs a CUDA device (or --cpu for a smoke run)")
        return []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    _identity.HOST_BELOW = _identity.STATE_HOST_BELOW = 0
    rows = []
    try:
        g = torch.Generator().manual_seed(0)
        for size in args.sizes:
            tensor = torch.randn(size // 2, generator=g).bfloat16().to(device)
            host_identity = base_identity(tensor.view(torch.uint8).cpu().numpy())
            assert _identity.base_identities([tensor]) == [host_identity], "base identity on the device"
            want = _host_state_hash("t", tensor)
            assert _identity.state_hashes({"t": tensor}) == {"t": want}, "state hash on the device"
            row = {
                "bytes": size,
                "identity, copy + core": median_ms(
                    lambda t=tensor: base_identity(t.view(torch.uint8).cpu().numpy()), args.rounds, sync
                ),
                "identity, device": median_ms(lambda t=tensor: _identity.base_identities([t]), args.rounds, sync),
                "state hash, copy + core": median_ms(lambda t=tensor: _host_state_hash("t", t), args.rounds, sync),
                "state hash, device": median_ms(lambda t=tensor: _identity.state_hashes({"t": t}), args.rounds, sync),
            }
            rows.append(row)
            del tensor
        small = {f"t{i}": torch.randn(32 << 10, generator=g).bfloat16().to(device) for i in range(args.small)}
        one_each = median_ms(lambda: [_host_state_hash(n, t) for n, t in small.items()], args.rounds, sync)
        _identity.STATE_HOST_BELOW = 1 << 20
        batched = median_ms(lambda: _identity.state_hashes(small), args.rounds, sync)
    finally:
        _identity.HOST_BELOW, _identity.STATE_HOST_BELOW, _identity.TORCH_ON_CPU = saved
    print(
        f"{device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'smoke run'}), medians of {args.rounds}"
    )
    print("| bytes | identity: copy + core | identity: device | state hash: copy + core | state hash: device |")
    print("|---:|---:|---:|---:|---:|")
    for row in rows:
        values = [row[k] for k in list(row)[1:]]
        print(f"| {row['bytes']:,} | " + " | ".join(f"{v:.2f} ms" for v in values) + " |")
    print(f"{args.small:,} tensors of 64 KiB, state hashes: one copy each {one_each:.1f} ms, batched {batched:.1f} ms")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
