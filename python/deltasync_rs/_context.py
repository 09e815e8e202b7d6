"""``context`` positions (docs/format.md §5.2) decoded by a reader that holds only part of the base: a
tensor-parallel worker's shard, with the classes of its elements computed by torch ops on the shard's own device.

A class rank counts the elements of one class before an element in the whole tensor, row-major, so a reader that
holds rows ``r0..r1`` (or columns ``c0..c1`` of every row) needs, besides its own elements' classes, how many
elements of each class lie before each of its runs. The readers that together hold the tensor tell each other
(:func:`held`, one small exchange per delta: 16 counts per run a reader holds, a run being its rows when they are
whole, else each row's slice), then each places its own changes and finds each one's value in the value stream
(:func:`place`): every class's listed ranks and every group's values are read from the file without the base
(``RawDelta.context_parts``). Nothing extra is in the file.

What such a reader cannot check is the base identity: it is over the whole tensor, which no reader holds. It
checks instead that readers holding the same elements (replicas) count the same classes, that the readers together
hold every element once, that every listed rank lies within its class, and that the changes add up to the record's
``changed``; a worker otherwise trusts its step chain, as for every codec (docs/vllm.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _arrays
from ._core import BaseMismatchError, DeltaFormatError, DeltaSyncError, RawDelta

CLASSES = 16
#: Per dtype: (shift, mask) of the exponent field in the element's bit pattern.
_FIELDS = {"BF16": (7, 0xFF), "F16": (10, 0x1F), "F32": (23, 0xFF)}


@dataclass(frozen=True)
class Held:
    """What one reader holds of a tensor, as runs of its row-major elements: each run's first element and length,
    and how many of its elements fall in each class (int64, ``[runs, 16]``). Plain numpy, to be exchanged."""

    starts: np.ndarray
    lengths: np.ndarray
    counts: np.ndarray


@dataclass(frozen=True)
class Parts:
    """A ``context`` tensor's streams read without the base (``RawDelta.context_parts``)."""

    reference: int
    complement: np.ndarray  # bool [16]
    ranks: list[np.ndarray]  # per class, ascending int64
    group_of: np.ndarray  # int64 [16]
    values: list[np.ndarray]  # per group, in change order, the element width's unsigned type


def read_parts(raw: RawDelta, index: int) -> Parts:
    """Tensor ``index``'s listed ranks and values, checked to the end of both streams (DeltaFormatError)."""
    reference, complement, ranks, group_of, values = raw.context_parts(index)
    width = _arrays.WIDTHS[raw.tensors()[index][1]]
    unsigned = "<u2" if width == 2 else "<u4"  # BF16 and F16, or F32
    return Parts(
        reference=int(reference),
        complement=np.array(complement, dtype=bool),
        ranks=[np.frombuffer(r, dtype="<i8").copy() for r in ranks],
        group_of=np.frombuffer(group_of, dtype=np.uint8).astype(np.int64),
        values=[np.frombuffer(v, dtype=unsigned) for v in values],
    )


def classes(bits: Any, dtype: str, reference: int) -> Any:
    """The class of every element (int64, same shape) from its bit pattern ``bits`` (a torch integer tensor of the
    element width): the exponent field minus ``reference`` plus 8, clamped to 0..15 (docs/format.md §5.2)."""
    import torch

    shift, mask = _FIELDS[dtype]
    field = (bits.to(torch.int64) >> shift) & mask  # the sign extension lies above the mask
    return (field - reference + 8).clamp_(0, CLASSES - 1)


def _runs(cls: Any, row_start: int, col_start: int, cols: int) -> tuple[Any, np.ndarray, np.ndarray]:
    """``cls`` (``[rows, width]``, rows ``row_start..`` and columns ``col_start..`` of a tensor of ``cols``
    columns) as runs: one run when its rows are whole, else one per row. Returns ``(cls as [runs, run length],
    starts, lengths)``."""
    rows, width = cls.shape
    if width == cols:
        return cls.reshape(1, rows * width), np.array([row_start * cols], np.int64), np.array([rows * width], np.int64)
    starts = (row_start + np.arange(rows, dtype=np.int64)) * cols + col_start
    return cls, starts, np.full(rows, width, np.int64)


def held(cls: Any, row_start: int, col_start: int, cols: int) -> Held:
    """What a reader holding ``cls`` (the classes of rows ``row_start..`` and columns ``col_start..`` of a tensor
    of ``cols`` columns, as :func:`classes` gives them) tells the others."""
    import torch

    if cls.numel() == 0:
        empty = np.zeros(0, np.int64)
        return Held(empty, empty, np.zeros((0, CLASSES), np.int64))
    runs, starts, lengths = _runs(cls, row_start, col_start, cols)
    keys = torch.arange(runs.shape[0], device=runs.device).unsqueeze(1) * CLASSES + runs
    counts = torch.bincount(keys.reshape(-1), minlength=runs.shape[0] * CLASSES).reshape(-1, CLASSES)
    return Held(starts, lengths, counts.cpu().numpy().astype(np.int64))


@dataclass(frozen=True)
class _Layout:
    """Every reader's runs of one tensor, each once, in order: they cover the tensor exactly."""

    starts: np.ndarray
    counts: np.ndarray


def _layout(name: str, everyone: list[Held], numel: int) -> _Layout:
    starts = np.concatenate([h.starts for h in everyone])
    lengths = np.concatenate([h.lengths for h in everyone])
    counts = np.concatenate([h.counts for h in everyone])
    order = np.lexsort((lengths, starts))
    starts, lengths, counts = starts[order], lengths[order], counts[order]
    same = (starts[1:] == starts[:-1]) & (lengths[1:] == lengths[:-1])
    if (same & np.any(counts[1:] != counts[:-1], axis=1)).any():
        at = int(starts[1:][same][0])
        raise BaseMismatchError(
            f"tensor {name!r}: two workers hold elements from {at} on but their bases differ there (their "
            "elements' exponents differ); nothing was written"
        )
    keep = np.concatenate([[True], ~same])
    starts, lengths, counts = starts[keep], lengths[keep], counts[keep]
    ends = starts + lengths
    if len(starts) == 0 or starts[0] != 0 or ends[-1] != numel or (starts[1:] != ends[:-1]).any():
        raise DeltaSyncError(
            f"tensor {name!r} has 'context' positions, which decode only with every element's class, but the "
            f"workers together do not hold each of its {numel} elements exactly once; nothing was written"
        )
    return _Layout(starts, counts)


def place(
    raw: RawDelta, index: int, parts: Parts, cls: Any, row_start: int, col_start: int, everyone: list[Held]
) -> tuple[Any, Any]:
    """This reader's changes of tensor ``index``: ``cls`` (``[rows, width]``) are the classes of the elements it
    holds (rows ``row_start..``, columns ``col_start..``), ``everyone`` what every reader holds (this one too).
    Returns ``(positions, values)`` on ``cls``'s device: int64 row-major positions within the held block,
    ascending, and the values (the width's torch integer type) as ``_write.new_bits`` applies them."""
    import torch

    from ._write import int_dtype

    info = raw.tensors()[index]
    name, changed, shape = info[0], int(info[3]), info[2]
    numel = int(np.prod(shape)) if shape else 1
    cols = int(shape[1]) if shape is not None and len(shape) == 2 else 1
    width = _arrays.WIDTHS[info[1]]
    device = cls.device
    layout = _layout(name, everyone, numel)
    counts = layout.counts
    first_rank = np.cumsum(counts, axis=0) - counts  # [runs, class]: the class rank of each run's first element
    totals = counts.sum(axis=0)

    listed_in = np.zeros_like(counts)
    for c in range(CLASSES):
        ranks = parts.ranks[c]
        if len(ranks) and ranks[-1] >= totals[c]:
            raise DeltaFormatError(
                f"tensor {name!r}: class {c} lists rank {int(ranks[-1])} but the workers' bases have "
                f"{int(totals[c])} elements in that class (is this the delta's base?); nothing was written"
            )
        listed_in[:, c] = np.searchsorted(ranks, first_rank[:, c] + counts[:, c]) - np.searchsorted(
            ranks, first_rank[:, c]
        )
    changed_in = np.where(parts.complement, counts - listed_in, listed_in)
    if int(changed_in.sum()) != changed:
        raise DeltaFormatError(
            f"tensor {name!r}: the 'context' stream decodes to {int(changed_in.sum())} changes against the workers' "
            f"bases but the record says changed={changed} (is this the delta's base?); nothing was written"
        )
    groups = len(parts.values)
    if int(parts.group_of.max()) >= groups:
        raise DeltaFormatError(f"tensor {name!r}: a class's value group is missing")
    by_group = np.zeros((len(counts), groups), np.int64)
    for g in range(groups):
        by_group[:, g] = changed_in[:, parts.group_of == g].sum(axis=1)
        if int(by_group[:, g].sum()) != len(parts.values[g]):
            raise DeltaFormatError(
                f"tensor {name!r}: value group {g} holds {len(parts.values[g])} values for the "
                f"{int(by_group[:, g].sum())} changes of its classes in the workers' bases (is this the delta's "
                "base?); nothing was written"
            )
    before = np.cumsum(by_group, axis=0) - by_group  # [runs, group]: values of the group before each run

    runs, starts, _ = _runs(cls, row_start, col_start, cols)
    mine = np.searchsorted(layout.starts, starts)  # exact: this reader's runs are in the layout
    run_length = runs.shape[1]
    found = []
    for c in range(CLASSES):
        here = counts[mine, c]
        if not here.any() or (not parts.complement[c] and not listed_in[mine, c].any()):
            continue  # no element of the class here, or none of its listed ranks
        mask = runs == c
        rank = mask.cumsum(dim=1) - 1 + torch.from_numpy(first_rank[mine, c]).to(device).unsqueeze(1)
        at = mask.reshape(-1).nonzero().squeeze(1)
        rank = rank.reshape(-1)[at]
        listed = torch.from_numpy(parts.ranks[c]).to(device)
        if len(listed):
            where = torch.searchsorted(listed, rank).clamp_(max=len(listed) - 1)
            hit = listed[where] == rank
        else:
            hit = torch.zeros_like(rank, dtype=torch.bool)
        found.append(at[hit != bool(parts.complement[c])])
    positions = torch.sort(torch.cat(found)).values if found else torch.zeros(0, dtype=torch.int64, device=device)
    if positions.numel() == 0:
        return positions, torch.zeros(0, dtype=int_dtype(width), device=device)

    # Each change's value: the group's values before its run, then its order among the run's changes of the group.
    group = torch.from_numpy(parts.group_of).to(device)[runs.reshape(-1)[positions].long()]
    run = torch.div(positions, run_length, rounding_mode="floor")
    key = run * groups + group
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    key_first = torch.cumsum(torch.bincount(sorted_key, minlength=int(runs.shape[0]) * groups), 0)
    key_first = key_first - torch.bincount(sorted_key, minlength=int(runs.shape[0]) * groups)
    within = torch.empty_like(positions)
    within[order] = torch.arange(len(positions), device=device) - key_first[sorted_key]
    group_start = np.cumsum([0] + [len(v) for v in parts.values])[:-1]
    offset = torch.from_numpy(before[mine] + group_start).to(device)  # [my runs, group]
    index_in_values = offset[run, group] + within
    signed = {2: np.int16, 4: np.int32}[width]
    values = torch.from_numpy(np.concatenate([v.view(signed) for v in parts.values])).to(device)
    return positions, values[index_in_values]
