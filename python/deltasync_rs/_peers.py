"""Peer encoders the benchmarks and ``deltasync bench`` compare deltasync_rs against, written from the published
descriptions of their formats (TRL: Hugging Face's blog post "Shipping a Trillion Parameters With a Hub Bucket:
Delta Weight Sync in TRL", and docs/format.md §9; grail: the PULSE paper, arXiv 2602.03839, and the
one-covenant/grail repository's description of its codec), not from the peers' own code. Needs torch (and zstandard
for the grail-like encoder).

* :func:`trl_v1_encode` -- a TRL-v1-style torch encoder: per tensor ``prev != curr`` on the int16 views, ``nonzero``,
  gather the new values, and ``safetensors.torch.save`` to bytes with ``<name>.indices`` (int32, ascending flat
  row-major positions) and ``<name>.values`` (the parameter's dtype, NEW absolute values); unchanged parameters are
  left out; ``__metadata__`` holds the v1 string fields.
* :func:`trl_v1_apply` -- the matching decode + apply: ``safetensors.torch.load`` and a per-tensor
  ``flat.index_put_((indices.long(),), values)``.
* :func:`trl_v1_decode_positions` / :func:`scatter_apply` -- the scatter floor: ``index_put_`` from positions that are
  already int64 tensors (no file parsing, no index widening in the timed part).
* :func:`trl_v3_encode` / :func:`trl_v3_apply` -- TRL v3 ``gap_delta``: ``<name>.idx`` holds
  ``idx[k] - idx[k-1] - 1`` (``idx[-1] = -1``) as uint16, or uint32 for a tensor whose largest gap does not fit, and
  ``<name>.val`` the new raw values; header ``encoding="gap_delta"``, ``version="3"``. Apply: ``cumsum(gap + 1) - 1``,
  then ``index_put_``.
* :func:`grail_like_encode` / :func:`grail_like_apply` -- like grail/PULSE: per tensor the gaps narrowed to the smallest
  of uint8/uint16/uint32 that holds them, then the new raw values, the pair compressed with zstd level 1 (one frame
  per tensor, single-threaded) behind a small JSON index. grail codes 2-D tensors as row/column gaps; this codes the
  flat row-major gaps, which is at least as small for scattered changes.
* :func:`read_floor` -- one single-threaded numpy pass over both buffers (a sum over uint64 views): the least work
  any encoder that reads every byte of both states has to do. ``threads=2`` spreads the same pass over two threads,
  the floor for an encoder that uses both cores of the 2-core reference machine.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.uint8}


def _int_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_VIEW[t.element_size()])


def trl_v1_encode(
    prev: Mapping[str, torch.Tensor], curr: Mapping[str, torch.Tensor], *, model_version: int = 0
) -> bytes:
    """A TRL v1 sparse weight patch (bytes of a safetensors file) that turns ``prev`` into ``curr``."""
    tensors: dict[str, torch.Tensor] = {}
    changed_params: list[str] = []
    total_changed = 0
    total_elements = 0
    for name, new in curr.items():
        old = prev[name]
        total_elements += new.numel()
        flat_new = new.reshape(-1)
        mask = _int_view(old.reshape(-1)) != _int_view(flat_new)
        indices = torch.nonzero(mask, as_tuple=True)[0]
        if indices.numel() == 0:
            continue
        tensors[f"{name}.indices"] = indices.to(torch.int32)
        tensors[f"{name}.values"] = flat_new[indices]
        changed_params.append(name)
        total_changed += indices.numel()
    metadata = {
        "format": "sparse_weight_patch",
        "version": "1",
        "sparse": "True",
        "model_version": str(model_version),
        "num_changed_params": str(len(changed_params)),
        "total_changed_elements": str(total_changed),
        "total_elements": str(total_elements),
        "sparsity": str(1.0 - total_changed / max(total_elements, 1)),
        "changed_params": json.dumps(changed_params),
    }
    return st_save(tensors, metadata=metadata)


def trl_v1_apply(blob: bytes, state: Mapping[str, torch.Tensor]) -> int:
    """Applies TRL v1 bytes in place (parse with safetensors, ``index_put_`` per tensor); returns elements written."""
    loaded = st_load(blob)
    written = 0
    for key, indices in loaded.items():
        if not key.endswith(".indices"):
            continue
        name = key[: -len(".indices")]
        values = loaded[f"{name}.values"]
        flat = state[name].view(-1)
        flat.index_put_((indices.long(),), values)
        written += indices.numel()
    return written


def trl_v1_decode_positions(blob: bytes) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, int64 positions, values) per changed tensor: the input of :func:`scatter_apply`."""
    loaded = st_load(blob)
    out = []
    for key, indices in loaded.items():
        if key.endswith(".indices"):
            name = key[: -len(".indices")]
            out.append((name, indices.long(), loaded[f"{name}.values"]))
    return out


def scatter_apply(decoded: list[tuple[str, torch.Tensor, torch.Tensor]], state: Mapping[str, torch.Tensor]) -> int:
    """The scatter floor: ``index_put_`` of already-decoded int64 positions and values."""
    written = 0
    for name, positions, values in decoded:
        state[name].view(-1).index_put_((positions,), values)
        written += positions.numel()
    return written


def _uint64_view(t: torch.Tensor) -> np.ndarray:
    raw = t.reshape(-1).view(torch.uint8).numpy()
    if raw.size % 8:
        raise ValueError(f"tensor of {raw.size} bytes is not a whole number of uint64 words")
    return raw.view(np.uint64)


def read_floor(prev: Mapping[str, torch.Tensor], curr: Mapping[str, torch.Tensor], threads: int = 1) -> int:
    """Sum (mod 2**64) of both states read as uint64 words: one numpy pass over each buffer.

    ``threads=1`` (the reference floor) does it on the calling thread. ``threads=n`` splits the buffers into ``n``
    groups of about equal bytes, each summed on its own thread (numpy releases the GIL in the reduction): the
    floor for a parallel encoder on ``n`` cores.
    """
    words = []
    for name, new in curr.items():
        words.append(_uint64_view(prev[name]))
        words.append(_uint64_view(new))
    if threads <= 1:
        return _sum_words(words)
    groups: list[list[np.ndarray]] = [[] for _ in range(threads)]
    loads = [0] * threads
    for w in sorted(words, key=lambda a: -a.size):  # greedy: largest first onto the lightest group
        k = loads.index(min(loads))
        groups[k].append(w)
        loads[k] += w.size
    with ThreadPoolExecutor(threads) as pool:
        parts = list(pool.map(_sum_words, groups))
    return _sum_words([np.array(parts, dtype=np.uint64)])


def _sum_words(words: list[np.ndarray]) -> int:
    total = np.uint64(0)
    with np.errstate(over="ignore"):
        for w in words:
            total += np.add.reduce(w, dtype=np.uint64)
    return int(total)


def _changes(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 flat positions, new values) of the elements whose bits differ."""
    flat_new = new.reshape(-1)
    indices = torch.nonzero(_int_view(old.reshape(-1)) != _int_view(flat_new), as_tuple=True)[0]
    return indices, flat_new[indices]


def trl_v3_encode(
    prev: Mapping[str, torch.Tensor], curr: Mapping[str, torch.Tensor], *, model_version: int = 0
) -> bytes:
    """A TRL v3 ``gap_delta`` sparse weight patch (safetensors bytes) that turns ``prev`` into ``curr``."""
    tensors: dict[str, torch.Tensor] = {}
    changed_params: list[str] = []
    total_changed = total_elements = 0
    for name, new in curr.items():
        total_elements += new.numel()
        indices, values = _changes(prev[name], new)
        if indices.numel() == 0:
            continue
        gaps = torch.diff(indices, prepend=indices.new_tensor([-1])) - 1
        tensors[f"{name}.idx"] = gaps.to(torch.uint16 if int(gaps.max()) < 1 << 16 else torch.uint32)
        tensors[f"{name}.val"] = values
        changed_params.append(name)
        total_changed += indices.numel()
    metadata = {
        "format": "sparse_weight_patch",
        "version": "3",
        "sparse": "True",
        "encoding": "gap_delta",
        "model_version": str(model_version),
        "num_changed_params": str(len(changed_params)),
        "total_changed_elements": str(total_changed),
        "total_elements": str(total_elements),
        "changed_params": json.dumps(changed_params),
    }
    return st_save(tensors, metadata=metadata)


def trl_v3_apply(blob: bytes, state: Mapping[str, torch.Tensor]) -> int:
    """Applies TRL v3 ``gap_delta`` bytes in place; returns elements written."""
    loaded = st_load(blob)
    written = 0
    for key, gaps in loaded.items():
        if not key.endswith(".idx"):
            continue
        name = key[: -len(".idx")]
        positions = torch.cumsum(gaps.to(torch.int64) + 1, 0) - 1
        state[name].view(-1).index_put_((positions,), loaded[f"{name}.val"])
        written += positions.numel()
    return written


_NARROW: list[tuple[type[np.unsignedinteger], str]] = [
    (np.uint8, "u1"),
    (np.uint16, "u2"),
    (np.uint32, "u4"),
    (np.uint64, "u8"),
]


def grail_like_encode(prev: Mapping[str, torch.Tensor], curr: Mapping[str, torch.Tensor]) -> bytes:
    """Gaps narrowed to u8/u16/u32 plus raw new values, zstd level 1 per tensor (see the module docstring)."""
    import zstandard

    compressor = zstandard.ZstdCompressor(level=1)
    index, frames = [], []
    for name, new in curr.items():
        indices, values = _changes(prev[name], new)
        if indices.numel() == 0:
            continue
        gaps = np.diff(indices.numpy(), prepend=-1) - 1
        largest = int(gaps.max())
        narrow, code = next((t, c) for t, c in _NARROW if largest <= np.iinfo(t).max)
        raw_values = _int_view(values).numpy()
        frame = compressor.compress(gaps.astype(narrow).tobytes() + raw_values.tobytes())
        index.append([name, int(indices.numel()), code, str(values.dtype).removeprefix("torch."), len(frame)])
        frames.append(frame)
    encoded = json.dumps(index).encode()
    return struct.pack("<Q", len(encoded)) + encoded + b"".join(frames)


def grail_like_apply(blob: bytes, state: Mapping[str, torch.Tensor]) -> int:
    """Applies :func:`grail_like_encode` bytes in place; returns elements written."""
    import zstandard

    decompressor = zstandard.ZstdDecompressor()
    (n,) = struct.unpack("<Q", blob[:8])
    at = 8 + n
    written = 0
    for name, count, code, _, frame_len in json.loads(blob[8:at]):
        raw = decompressor.decompress(blob[at : at + frame_len])
        at += frame_len
        gap_bytes = count * int(code[1])
        gaps = np.frombuffer(raw, dtype=code, count=count).astype(np.int64)
        positions = torch.from_numpy(np.cumsum(gaps + 1) - 1)
        flat = state[name].view(-1)
        values = torch.frombuffer(bytearray(raw[gap_bytes:]), dtype=_INT_VIEW[flat.element_size()])
        _int_view(flat).index_put_((positions,), values)
        written += count
    return written
