"""``context`` positions (docs/format.md §5.2) decoded by a reader that holds only part of the base: a
tensor-parallel worker's shard.

A class rank counts the elements of one class before an element in the whole tensor, row-major, so a reader that
holds rows ``r0..r1`` (or columns ``c0..c1`` of every row) needs, besides its own elements' classes, how many
elements of each class lie before each of its runs. The readers that together hold the tensor tell each other
(``Slice.held``, one small exchange per delta: 16 counts per run a reader holds, a run being its rows when they are
whole, else each row's slice), then each places its own changes and finds each one's value in the value stream
(``Slice.place``): every class's listed ranks and every group's values are read from the file without the base
(``RawDelta.context_parts``). Nothing extra is in the file. On the CPU the core counts and walks the slice's bits
(``RawDelta.context_counts`` / ``context_runs``: the whole reader's walk, restarted at each run's first class ranks);
on other devices torch ops compute the classes and place the changes there, without copying the weights to the host.

What such a reader cannot check alone is the base identity: it is over the whole tensor, which no reader holds
(with ``check_base`` the vLLM ranks check it together, docs/vllm.md §7). It checks besides that readers holding
the same elements (replicas) count the same classes, that the readers together hold every element once, that every
listed rank lies within its class, and that the changes add up to the record's ``changed``; a worker otherwise
trusts its step chain, as for every codec (docs/vllm.md).
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
    """What one reader holds of a tensor of ``cols`` columns: rows ``row_start ..+ row_count``, columns
    ``col_start ..+ col_count``, and how many of the elements of each of its runs (its rows, as one run when they are
    whole; else each row's slice) fall in each class: ``counts``, ``[runs, 16]``, in the smallest unsigned type that
    holds a run's length. Plain numbers and numpy, small, to be exchanged."""

    row_start: int
    row_count: int
    col_start: int
    col_count: int
    cols: int
    counts: np.ndarray

    def runs(self) -> tuple[np.ndarray, np.ndarray]:
        """Each run's first element (row-major, in the whole tensor) and length."""
        if self.row_count == 0 or self.col_count == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        if self.col_count == self.cols:
            return np.array([self.row_start * self.cols], np.int64), np.array([self.row_count * self.cols], np.int64)
        starts = (self.row_start + np.arange(self.row_count, dtype=np.int64)) * self.cols + self.col_start
        return starts, np.full(self.row_count, self.col_count, np.int64)


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
    width = _arrays.WIDTHS[raw.tensor_info(index)[1]]
    unsigned = "<u2" if width == 2 else "<u4"  # BF16 and F16, or F32
    return Parts(
        reference=int(reference),
        complement=np.array(complement, dtype=bool),
        ranks=[np.frombuffer(r, dtype="<i8").copy() for r in ranks],
        group_of=np.frombuffer(group_of, dtype=np.uint8).astype(np.int64),
        values=[np.frombuffer(v, dtype=unsigned) for v in values],
    )


def classes(bits: Any, dtype: str, reference: int) -> Any:
    """The class of every element (uint8, same shape) from its bit pattern ``bits`` (a torch integer tensor of the
    element width): the exponent field minus ``reference`` plus 8, clamped to 0..15 (docs/format.md §5.2). Computed
    in the bits' own integer type (the field's sign extension lies above the mask)."""
    import torch

    shift, mask = _FIELDS[dtype]
    return ((bits >> shift) & mask).sub_(reference - 8).clamp_(0, CLASSES - 1).to(torch.uint8)


def _runs(cls: Any, cols: int) -> Any:
    """``cls`` (``[rows, width]``, a block of a tensor of ``cols`` columns) as ``[runs, run length]``: one run when
    its rows are whole, else one per row (as :meth:`Held.runs`)."""
    rows, width = cls.shape
    return cls.reshape(1, rows * width) if width == cols else cls


class Slice:
    """What one reader holds of ``context`` tensor ``index``: rows ``row_start..`` and columns ``col_start..`` of a
    tensor of ``cols`` columns, whose bit patterns are ``bits`` (``[rows, width]``, the element width's torch
    integer type, on any device). On the CPU the core counts and walks the bits (``walk="core"``); elsewhere torch
    ops do, on the bits' device (``walk="torch"``, which the CPU can also be asked for)."""

    def __init__(
        self, raw: RawDelta, index: int, bits: Any, row_start: int, col_start: int, cols: int, walk: str = "auto"
    ) -> None:
        import torch

        self.raw, self.index, self.bits = raw, index, bits
        self.row_start, self.col_start, self.cols = row_start, col_start, cols
        self.parts = read_parts(raw, index)
        self.by_core = walk == "core" or (walk == "auto" and bits.device.type == "cpu")
        rows, width = bits.shape
        if bits.numel() == 0:
            self.held = Held(row_start, rows, col_start, width, cols, np.zeros((0, CLASSES), np.uint8))
            return
        if self.by_core:
            self.runs = _runs(bits, cols).contiguous()
            counted = raw.context_counts(index, self.runs, self.runs.shape[1])
            counts = np.frombuffer(counted, dtype="<u8").reshape(-1, CLASSES)
        else:
            self.runs = _runs(classes(bits, raw.tensor_info(index)[1], self.parts.reference), cols)
            wide = torch.int32 if self.runs.shape[0] * CLASSES < 2**31 else torch.int64
            keys = torch.arange(self.runs.shape[0], dtype=wide, device=bits.device).unsqueeze(1) * CLASSES + self.runs
            found = torch.bincount(keys.reshape(-1), minlength=self.runs.shape[0] * CLASSES)
            counts = found.reshape(-1, CLASSES).cpu().numpy()
        # Counts travel in the smallest unsigned type that holds a run's length.
        self.held = Held(row_start, rows, col_start, width, cols, counts.astype(np.min_scalar_type(self.runs.shape[1])))

    def place(self, everyone: list[Held]) -> tuple[Any, Any]:
        """This reader's changes, given what every reader holds (``everyone``, this one's ``held`` among them, in
        any order): ``(positions, values)`` on the bits' device, int64 row-major positions within the slice,
        ascending, and the values (the width's torch integer type) as ``_write.new_bits`` applies them."""
        return _place(self, everyone)


@dataclass(frozen=True)
class _Layout:
    """Every reader's runs of one tensor, each once, in order: they cover the tensor exactly."""

    starts: np.ndarray
    counts: np.ndarray


def _layout(name: str, everyone: list[Held], numel: int) -> _Layout:
    runs = [h.runs() for h in everyone]
    starts = np.concatenate([r[0] for r in runs])
    lengths = np.concatenate([r[1] for r in runs])
    counts = np.concatenate([h.counts.astype(np.int64) for h in everyone])
    if counts.shape != (len(starts), CLASSES) or (counts.sum(axis=1) != lengths).any():
        raise DeltaSyncError(f"tensor {name!r}: a worker's class counts do not fit the elements it holds")
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


def _place(part: Slice, everyone: list[Held]) -> tuple[Any, Any]:
    import torch

    from ._write import int_dtype

    raw, index, parts = part.raw, part.index, part.parts
    device = part.bits.device
    info = raw.tensor_info(index)
    name, changed, shape = info[0], int(info[3]), info[2]
    numel = int(np.prod(shape)) if shape else 1
    width = _arrays.WIDTHS[info[1]]
    layout = _layout(name, everyone, numel)
    counts = layout.counts
    first_rank = np.cumsum(counts, axis=0) - counts  # [runs, class]: the class rank of each run's first element
    totals = counts.sum(axis=0)

    listed_in = np.zeros_like(counts)
    for c in range(CLASSES):
        ranks = parts.ranks[c]
        if len(ranks) and ranks[-1] >= totals[c]:
            raise BaseMismatchError(
                f"tensor {name!r}: class {c} lists rank {int(ranks[-1])} but the workers' bases have "
                f"{int(totals[c])} elements in that class (is this the delta's base?); nothing was written"
            )
        listed_in[:, c] = np.searchsorted(ranks, first_rank[:, c] + counts[:, c]) - np.searchsorted(
            ranks, first_rank[:, c]
        )
    changed_in = np.where(parts.complement, counts - listed_in, listed_in)
    if int(changed_in.sum()) != changed:
        raise BaseMismatchError(
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
            raise BaseMismatchError(
                f"tensor {name!r}: value group {g} holds {len(parts.values[g])} values for the "
                f"{int(by_group[:, g].sum())} changes of its classes in the workers' bases (is this the delta's "
                "base?); nothing was written"
            )
    before = np.cumsum(by_group, axis=0) - by_group  # [runs, group]: values of the group before each run
    if part.bits.numel() == 0:  # after the checks, which every reader makes alike (all refuse, or none)
        return torch.zeros(0, dtype=torch.int64, device=device), torch.zeros(0, dtype=int_dtype(width), device=device)

    runs = part.runs
    mine = np.searchsorted(layout.starts, part.held.runs()[0])  # exact: this reader's runs are in the layout
    run_length = runs.shape[1]
    if part.by_core:  # the whole reader's walk, restarted at each run's first class ranks
        firsts = np.ascontiguousarray(first_rank[mine], dtype="<u8").tobytes()
        found = np.frombuffer(raw.context_runs(index, runs, run_length, firsts), dtype="<i8")
        positions = torch.from_numpy(found.copy())
    else:
        positions = _positions_by_class(runs, parts, counts[mine], first_rank[mine], listed_in[mine])
    if positions.numel() == 0:
        return positions, torch.zeros(0, dtype=int_dtype(width), device=device)

    # Each change's value: the group's values before its run, then its order among the run's changes of the group.
    if part.by_core:
        changed_classes = classes(runs.reshape(-1)[positions], info[1], parts.reference)
    else:
        changed_classes = runs.reshape(-1)[positions]
    group = torch.from_numpy(parts.group_of).to(device)[changed_classes.long()]
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


def _positions_by_class(
    runs: Any, parts: Parts, counts: np.ndarray, first_rank: np.ndarray, listed_in: np.ndarray
) -> Any:
    """The changed elements among ``runs`` (``[runs, run length]`` classes) by torch ops on their device: indices
    into the runs, ascending. ``counts``, ``first_rank`` and ``listed_in`` are the runs' rows of the layout's."""
    import torch

    device = runs.device
    # This reader's elements grouped by class, each class's in row-major order: the i-th of class c in a run is the
    # element of class rank first_rank[run, c] + i.
    by_class = torch.sort(runs.reshape(-1), stable=True).indices
    class_end = np.cumsum(counts.sum(axis=0))
    found = []
    for c in range(CLASSES):
        run_first, run_count = first_rank[:, c], counts[:, c]
        if not run_count.any() or (not parts.complement[c] and not listed_in[:, c].any()):
            continue  # no element of the class here, or none of its listed ranks
        at = by_class[class_end[c] - run_count.sum() : class_end[c]]
        # The listed ranks inside these runs, as indices into `at`.
        ranks = parts.ranks[c]
        run = np.searchsorted(run_first, ranks, side="right") - 1
        inside = (run >= 0) & (ranks < run_first[np.maximum(run, 0)] + run_count[np.maximum(run, 0)])
        local_first = np.cumsum(run_count) - run_count  # within `at`, where each run's elements of c start
        picked = torch.from_numpy(ranks[inside] - run_first[run[inside]] + local_first[run[inside]]).to(device)
        if parts.complement[c]:
            keep = torch.ones(len(at), dtype=torch.bool, device=device)
            keep[picked] = False
            found.append(at[keep])
        else:
            found.append(at[picked])
    return torch.sort(torch.cat(found)).values if found else torch.zeros(0, dtype=torch.int64, device=device)
