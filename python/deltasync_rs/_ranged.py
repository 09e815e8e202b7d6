"""Anchors read by byte ranges (docs/format.md §10, anchor pieces): a reader that needs only part of an anchor (a
tensor-parallel rank, its own shard) reads the pieces that cover those bytes, checks each against the anchor's
pieces sidecar, and gets a :class:`PartialAnchor` that knows which bytes it verified."""

from __future__ import annotations

import heapq
import json
import mmap
import os
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from ._identity import BLOCK_BYTES
from .delta import Delta, load_stand_in
from .errors import DeltaFormatError, DeltaSyncError, IntegrityError
from .manifest import Pieces
from .store import Store, private_temp, remove_temp

#: safetensors' own cap on the header (docs/format.md §1).
MAX_HEADER_BYTES = 100_000_000
#: The most bytes asked for in one ranged read; longer runs of pieces are split.
_RUN_BYTES = 64 << 20


class AnchorTensor(NamedTuple):
    """One tensor of an anchor as its header lists it; ``start`` and ``end`` are byte offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


#: Given an anchor's tensors, the byte ranges [start, end) of the file that the reader will use.
NeededRanges = Callable[[list[AnchorTensor]], Iterable[tuple[int, int]]]


class PartialAnchor(Delta):
    """An anchor of which only some pieces were read, each checked against the pieces sidecar; every other byte
    reads as zero. Only a reader that checks coverage (:meth:`require`) before it uses a byte may apply it:
    ``deltasync_rs.vllm.apply_delta`` does; ``apply_``, ``save`` and ``to_bytes`` refuse."""

    __slots__ = ("_covered", "_piece_bytes", "_offsets", "_map", "key", "_names")

    def __init__(
        self, delta: Delta, covered: frozenset[int], piece_bytes: int, offsets: dict[str, tuple[int, int]], key: str
    ) -> None:
        super().__init__(delta._raw)
        self._covered = covered
        self._piece_bytes = piece_bytes
        self._offsets = offsets
        self._map: mmap.mmap | None = None
        self.key = key
        # The tensors' names by index, once: `names` builds the list anew, and a worker decodes tensor by tensor.
        self._names = self.names

    @property
    def covered_bytes(self) -> int:
        """Bytes of the anchor that were read and verified (whole pieces)."""
        return len(self._covered) * self._piece_bytes

    def _span(self, name: str, start: int, end: int) -> tuple[int, int]:
        first, last = self._offsets[name]
        if not 0 <= start <= end <= last - first:
            raise DeltaSyncError(f"{self.key}: bytes {start}..{end} are outside tensor {name!r}")
        return first + start, first + end

    def _verified(self, begin: int, stop: int) -> bool:
        """True when every piece holding file bytes ``begin .. stop`` was read and verified."""
        return all(p in self._covered for p in range(begin // self._piece_bytes, -(-stop // self._piece_bytes)))

    def whole_tensors(self) -> list[int]:
        """The indices of the tensors every byte of which was read and verified."""
        return [index for index, name in enumerate(self.names) if self._verified(*self._offsets[name])]

    def require(self, name: str, start: int, end: int) -> None:
        """Raises IntegrityError unless bytes ``start .. end`` of tensor ``name`` were read and verified."""
        if not self._verified(*self._span(name, start, end)):
            raise IntegrityError(
                f"{self.key}: bytes {start}..{end} of tensor {name!r} were not read and verified by this reader"
            )

    def verified_intervals(self, name: str) -> list[tuple[int, int]]:
        """The byte intervals [start, end) of tensor ``name`` (tensor offsets, in order, disjoint) that were read and
        verified: the tensor's bytes in the verified pieces."""
        first, last = self._offsets[name]
        out: list[tuple[int, int]] = []
        if first == last:
            return out
        for piece in range(first // self._piece_bytes, -(-last // self._piece_bytes)):
            if piece not in self._covered:
                continue
            begin = max(first, piece * self._piece_bytes) - first
            end = min(last, (piece + 1) * self._piece_bytes) - first
            if out and out[-1][1] == begin:
                out[-1] = (out[-1][0], end)
            else:
                out.append((begin, end))
        return out

    def tensor_bytes(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``start .. end`` of tensor ``name``, which must have been verified."""
        self.require(name, start, end)
        assert self._map is not None
        begin, stop = self._span(name, start, end)
        return self._map[begin:stop]

    def tensor_view(self, name: str, start: int, end: int) -> memoryview:
        """As :meth:`tensor_bytes`, without a copy: a read-only view of the mapped file (release it after use)."""
        self.require(name, start, end)
        begin, stop = self._span(name, start, end)
        if begin == stop:
            return memoryview(b"")
        assert self._map is not None
        return memoryview(self._map)[begin:stop]

    def _refused(self) -> DeltaSyncError:
        return DeltaSyncError(
            f"{self.key}: only part of this anchor was read; apply it with deltasync_rs.vllm.apply_delta (which "
            "checks that it uses only verified bytes), or read it whole"
        )

    def decoded(self, index: int, device: Any = None, *, base: Any = None) -> tuple[Any, Any]:
        """As :meth:`Delta.decoded`, for a tensor whose bytes were all read and verified (IntegrityError else: its
        other bytes read as zero)."""
        name = self._names[self._index(index)]
        first, last = self._offsets[name]
        self.require(name, 0, last - first)
        return super().decoded(index, device, base=base)

    def apply_(self, state: Any, *, check_base: bool = False) -> None:
        raise self._refused()

    def _apply(self, state: Any, *, check_base: bool, digest: bool) -> dict[str, bytes | None]:
        raise self._refused()

    def save(self, path: str | os.PathLike[str], format: str = "deltasync") -> None:
        raise self._refused()

    def to_bytes(self, format: str = "deltasync") -> bytes:
        raise self._refused()


def read_ranged(store: Store, ref: dict[str, Any], pieces: Pieces, needed: NeededRanges) -> PartialAnchor | None:
    """Reads anchor ``ref`` (its manifest entry's reference, ``pieces`` its checked sidecar) by ranges: its header,
    then the pieces that cover the ranges ``needed`` names, each checked before it is kept, into a private sparse
    temporary file that is then memory-mapped. Returns None, having read little more than the header, when the
    ranges cover at least 90% of the file: one whole read is then cheaper."""
    key, size = ref["key"], ref["size"]
    fd, path = private_temp()
    hashers = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="deltasync-pieces")
    try:
        os.ftruncate(fd, size)
        verified: set[int] = set()

        def fetch(start: int, end: int) -> None:
            wanted = [p for p in range(start // pieces.piece_bytes, -(-end // pieces.piece_bytes)) if p not in verified]
            for run in _runs(wanted, max(1, _RUN_BYTES // pieces.piece_bytes)):
                begin, _ = pieces.span(run[0])
                _, stop = pieces.span(run[-1])
                data = memoryview(store.get_range(key, begin, stop - begin))
                if len(data) != stop - begin:
                    raise IntegrityError(f"{key}: a read of bytes {begin}..{stop} returned {len(data)} bytes")

                def check(index: int, data: memoryview = data, begin: int = begin) -> None:
                    first, last = pieces.span(index)
                    pieces.check(index, data[first - begin : last - begin], key)

                # hashlib releases the GIL on large buffers: the pieces of a run are checked on several threads
                list(hashers.map(check, run) if len(run) > 1 else map(check, run))
                os.pwrite(fd, data, begin)
                verified.update(run)

        if size < 8:
            raise DeltaFormatError(f"{key}: {size} bytes, too short for a safetensors header")
        fetch(0, 8)
        header_bytes = int.from_bytes(os.pread(fd, 8, 0), "little")
        if header_bytes > MAX_HEADER_BYTES or 8 + header_bytes > size:
            raise DeltaFormatError(f"{key}: a header of {header_bytes} bytes does not fit the file")
        fetch(8, 8 + header_bytes)
        tensors = anchor_tensors(os.pread(fd, header_bytes, 8), 8 + header_bytes, size, key)
        ranges = [(int(s), int(e)) for s, e in needed(tensors)]
        wanted = set(verified)
        for start, end in ranges:
            if not 0 <= start <= end <= size:
                raise DeltaSyncError(f"{key}: asked for bytes {start}..{end} of a {size}-byte file")
            wanted.update(range(start // pieces.piece_bytes, -(-end // pieces.piece_bytes)))
        if sum(pieces.span(p)[1] - pieces.span(p)[0] for p in wanted) >= 0.9 * size:
            return None
        for start, end in sorted(ranges):
            fetch(start, end)
        delta = PartialAnchor(
            load_stand_in(path),
            frozenset(verified),
            pieces.piece_bytes,
            {t.name: (t.start, t.end) for t in tensors},
            key,
        )
        delta._map = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else None
        return delta
    finally:
        hashers.shutdown()
        os.close(fd)
        remove_temp(path)


def _runs(indices: list[int], most: int) -> Iterable[list[int]]:
    """Consecutive runs of sorted ``indices``, each at most ``most`` long."""
    run: list[int] = []
    for index in indices:
        if run and (index != run[-1] + 1 or len(run) == most):
            yield run
            run = []
        run.append(index)
    if run:
        yield run


class HeldTensor(NamedTuple):
    """What one reader holds of a tensor of an anchor it read by ranges (:func:`held_tensors`): the tensor's size,
    the byte intervals it verified (tensor offsets, in order, disjoint), and the hashes of the base-identity blocks
    (docs/format.md §3.1) wholly inside them, as runs ``(first block, its hash and the next ones', 8 bytes each)``."""

    nbytes: int
    intervals: tuple[tuple[int, int], ...]
    hashes: tuple[tuple[int, bytes], ...]


#: One part of a block that no reader holds whole: (rank that sends it, tensor, block, first byte, end byte).
Fragment = tuple[int, str, int, int, int]


def held_tensors(anchor: Delta, names: Iterable[str], *, hashes: bool = True) -> dict[str, HeldTensor | None]:
    """For each of ``names`` that ``anchor`` holds: None where this reader read the tensor whole (it checks that
    tensor alone), else what it holds of it, for :func:`split_identities` to combine with the other readers' parts
    (without ``hashes``, its intervals alone, for :func:`segments`). Small enough to all-gather: 8 bytes per 256 KiB
    block."""
    from ._core import block_hashes

    index = {name: i for i, name in enumerate(anchor.names)}
    whole = set(anchor.whole_tensors()) if isinstance(anchor, PartialAnchor) else None
    out: dict[str, HeldTensor | None] = {}
    for name in names:
        if name not in index:
            continue
        if whole is None or index[name] in whole:
            out[name] = None
            continue
        assert isinstance(anchor, PartialAnchor)
        first, last = anchor._offsets[name]
        nbytes = last - first
        intervals = anchor.verified_intervals(name)
        runs = []
        for start, end in intervals if hashes else ():
            first_block = -(-start // BLOCK_BYTES)
            end_block = _blocks(nbytes) if end == nbytes else end // BLOCK_BYTES
            if end_block > first_block:
                with anchor.tensor_view(name, first_block * BLOCK_BYTES, min(end_block * BLOCK_BYTES, nbytes)) as view:
                    runs.append((first_block, block_hashes(view)))
        out[name] = HeldTensor(nbytes, tuple(intervals), tuple(runs))
    return out


def _blocks(nbytes: int) -> int:
    return -(-nbytes // BLOCK_BYTES)


def fragment_plan(everyone: list[dict[str, HeldTensor | None]]) -> list[Fragment]:
    """The parts of blocks that the readers (``everyone``: each one's :func:`held_tensors`, in rank order) must send
    each other so that every block of a tensor none holds whole can be hashed: for each block no reader holds
    whole, its bytes in each of the tensor's :func:`segments` that meet it. A tensor whose bytes the readers do not
    cover between them gets none (it cannot be checked). The same on every reader, which all compute it from the
    same gathered parts."""
    plan: list[Fragment] = []
    for name, cut in segments(everyone).items():
        if cut is None:
            continue
        parts = [held[name] for held in everyone if held.get(name) is not None]
        hashed = {block for part in parts for block in _hashed_blocks(part)}  # type: ignore[arg-type]
        nbytes = cut[-1][2] if cut else 0
        for rank, start, end in cut:
            for block in range(start // BLOCK_BYTES, _blocks(end)):
                if block not in hashed:
                    low, high = block * BLOCK_BYTES, min((block + 1) * BLOCK_BYTES, nbytes)
                    plan.append((rank, name, block, max(start, low), min(end, high)))
    return plan


def segments(everyone: list[dict[str, HeldTensor | None]]) -> dict[str, list[tuple[int, int, int]] | None]:
    """For each tensor that no reader holds whole (``everyone``: each one's :func:`held_tensors`, in rank order):
    its bytes cut into consecutive segments ``(rank, start, end)``, each held by its rank (the one whose interval
    reaches furthest, the lowest rank among equals), for the readers to hash it in turn; None for a tensor whose
    bytes the readers do not cover between them. The same on every reader."""
    out: dict[str, list[tuple[int, int, int]] | None] = {}
    for name in sorted(_split_names(everyone)):
        parts = [(rank, held[name]) for rank, held in enumerate(everyone) if held.get(name) is not None]
        nbytes = parts[0][1].nbytes  # type: ignore[union-attr]
        # A sweep over the intervals by start (a column split holds one per row, so not each against each): at
        # each point, of those begun, the one that reaches furthest, the lowest rank among equals.
        pending = sorted(
            (start, rank, stop)
            for rank, part in parts
            for start, stop in part.intervals  # type: ignore[union-attr]
            if start < stop
        )
        begun: list[tuple[int, int]] = []  # (-stop, rank): a heap
        cut: list[tuple[int, int, int]] | None = []
        at, next_ = 0, 0
        while at < nbytes:
            while next_ < len(pending) and pending[next_][0] <= at:
                start, rank, stop = pending[next_]
                heapq.heappush(begun, (-stop, rank))
                next_ += 1
            while begun and -begun[0][0] <= at:
                heapq.heappop(begun)
            if not begun:
                cut = None
                break
            stop, rank = -begun[0][0], begun[0][1]
            cut.append((rank, at, stop))  # type: ignore[union-attr]
            at = stop
        out[name] = cut
    return out


def hash_turns(cuts: Mapping[str, list[tuple[int, int, int]] | None], readers: int) -> list[list[tuple[str, int]]]:
    """The turns in which the readers hash the tensors :func:`segments` cut (``cuts``), among ``readers``: for each
    turn, the ``(tensor, segment index)`` pairs hashed in it. A tensor's segments go one per turn, in order (each
    goes on from the hash state the previous one handed on), so its segments take consecutive turns from the one it
    starts in. Were every tensor to start in the first turn, the readers would hash one after another (the second
    reader's rows only once the first's are done); tensors start instead in up to ``4 * readers`` different turns,
    the largest first, each where it adds least to the sum over turns of the most bytes any reader hashes in that
    turn (the earliest among equals), so that the readers hash side by side in most turns. The same on every
    reader (``cuts`` is)."""
    load: list[dict[int, int]] = []  # per turn: the bytes each reader hashes in it
    peak: list[int] = []  # per turn: the most of them
    plan: list[list[tuple[str, int]]] = []
    chains = sorted(
        ((name, cut) for name, cut in cuts.items() if cut),
        key=lambda item: (-(item[1][-1][2] - item[1][0][1]), item[0]),
    )
    for name, cut in chains:
        best: tuple[int, int] | None = None
        for start in range(min(4 * max(readers, 1), len(load) + 1)):
            added = 0
            for index, (rank, begin, end) in enumerate(cut):
                if start + index < len(load):
                    added += max(0, load[start + index].get(rank, 0) + end - begin - peak[start + index])
                else:
                    added += end - begin
            if best is None or added < best[0]:
                best = (added, start)
        assert best is not None
        for index, (rank, begin, end) in enumerate(cut):
            at = best[1] + index
            while len(load) <= at:
                load.append({})
                peak.append(0)
                plan.append([])
            load[at][rank] = load[at].get(rank, 0) + end - begin
            peak[at] = max(peak[at], load[at][rank])
            plan[at].append((name, index))
    return plan


def differently_sized(everyone: list[dict[str, HeldTensor | None]]) -> list[str]:
    """The tensors no reader holds whole whose readers (``everyone``: each one's :func:`held_tensors`) hold parts of
    different sizes: they read different anchors. The same on every reader."""
    return sorted(_split_names(everyone, sizes_differ=True))


def _split_names(everyone: list[dict[str, HeldTensor | None]], *, sizes_differ: bool = False) -> set[str]:
    """The tensors that no reader holds whole but some hold in part, all of one size (with ``sizes_differ``: those
    whose readers disagree on its size)."""
    parts: dict[str, set[int]] = {}
    whole: set[str] = set()
    for held in everyone:
        for name, part in held.items():
            if part is None:
                whole.add(name)
            else:
                parts.setdefault(name, set()).add(part.nbytes)
    return {name for name, sizes in parts.items() if name not in whole and (len(sizes) > 1) == sizes_differ}


def _hashed_blocks(part: HeldTensor) -> Iterable[int]:
    for first, hashes in part.hashes:
        yield from range(first, first + len(hashes) // 8)


def fragments(anchor: Delta, plan: list[Fragment], rank: int) -> dict[tuple[str, int], bytes]:
    """This reader's share of ``plan``: its verified bytes of each fragment it sends, by (tensor, first byte)."""
    mine = [(name, start, end) for sender, name, _, start, end in plan if sender == rank]
    if not isinstance(anchor, PartialAnchor):
        if not mine:
            return {}
        raise DeltaSyncError("this reader holds the anchor whole, but the plan has it send parts of it")
    return {(name, start): anchor.tensor_bytes(name, start, end) for name, start, end in mine}


def split_identities(
    everyone: list[dict[str, HeldTensor | None]], plan: list[Fragment], sent: list[dict[tuple[str, int], bytes]]
) -> tuple[dict[str, str], list[str]]:
    """The base identities of the tensors that no reader holds whole, from every reader's parts (``everyone``, in
    rank order), the ``plan`` of fragments and what each reader ``sent`` of it: for each tensor whose blocks the
    readers cover between them, its identity, and the tensors whose readers disagree on a block's hash (they hold
    different bytes of the one anchor). The same on every reader."""
    from ._core import base_identity_from_blocks, block_hashes

    by_block: dict[tuple[str, int], list[tuple[int, bytes]]] = {}
    for sender, name, block, start, end in plan:
        data = sent[sender].get((name, start))
        if data is None or len(data) != end - start:
            raise IntegrityError(f"tensor {name!r}: reader {sender} sent no bytes {start}..{end} of it")
        by_block.setdefault((name, block), []).append((start, data))
    identities: dict[str, str] = {}
    conflicts = differently_sized(everyone)
    for name in sorted(_split_names(everyone)):
        parts = [held[name] for held in everyone if held.get(name) is not None]
        nbytes = parts[0].nbytes  # type: ignore[union-attr]
        hashes: dict[int, bytes] = {}
        disagree = False
        for part in parts:
            for first, run in part.hashes:  # type: ignore[union-attr]
                for i in range(len(run) // 8):
                    found = run[8 * i : 8 * i + 8]
                    disagree |= hashes.setdefault(first + i, found) != found
        for block in range(_blocks(nbytes)):
            if block not in hashes and (name, block) in by_block:
                data = b"".join(part for _, part in sorted(by_block[(name, block)]))
                hashes[block] = block_hashes(data)
        if disagree:
            conflicts.append(name)
        elif len(hashes) == _blocks(nbytes):
            identities[name] = base_identity_from_blocks(b"".join(hashes[b] for b in range(len(hashes))), b"")
    return identities, conflicts


def _block_parts(
    everyone: list[dict[str, HeldTensor | None]], name: str
) -> tuple[int, dict[int, set[int]], dict[int, list[tuple[int, int, int]]]]:
    """Of tensor ``name``, held in parts: its size, the readers that hold each block whole (hashed), and the
    ``(reader, first byte, end byte)`` parts of each block held by readers that do not hold it whole."""
    nbytes = 0
    whole: dict[int, set[int]] = {}
    partial: dict[int, list[tuple[int, int, int]]] = {}
    for rank, held in enumerate(everyone):
        part = held.get(name)
        if part is None:
            continue
        nbytes = part.nbytes
        mine = set(_hashed_blocks(part))
        for block in mine:
            whole.setdefault(block, set()).add(rank)
        for start, end in part.intervals:
            for block in range(start // BLOCK_BYTES, _blocks(end)):
                if block not in mine:
                    low, high = block * BLOCK_BYTES, (block + 1) * BLOCK_BYTES
                    partial.setdefault(block, []).append((rank, max(start, low), min(end, high)))
    return nbytes, whole, partial


def held_fragment_plan(everyone: list[dict[str, HeldTensor | None]]) -> list[Fragment]:
    """For holders of live slices of tensors (``everyone``: each one's parts, in rank order), the bytes they send
    each other so that every holder's every byte is checked, not only one holder's of each: for each block that
    some holder holds only part of, every such holder's bytes of it and, where another holds the block whole, the
    lowest such holder's whole block (to compare the parts with). Blocks held whole by all that hold them cross as
    their hashes alone. The same on every holder."""
    plan: list[Fragment] = []
    for name in sorted(_split_names(everyone)):
        nbytes, whole, partial = _block_parts(everyone, name)
        for block in sorted(partial):
            plan.extend((rank, name, block, start, end) for rank, start, end in partial[block])
            if block in whole:
                low = block * BLOCK_BYTES
                plan.append((min(whole[block]), name, block, low, min(low + BLOCK_BYTES, nbytes)))
    return plan


def held_identities(
    everyone: list[dict[str, HeldTensor | None]], plan: list[Fragment], sent: list[dict[tuple[str, int], bytes]]
) -> tuple[dict[str, str], list[str], list[str]]:
    """The base identities of tensors whose live slices the holders hold (``everyone``, in rank order), from the
    hashes of the blocks held whole and the bytes of the others (``plan``, :func:`held_fragment_plan`, and what each
    holder ``sent`` of it): the identities, the tensors where two holders hold different bytes (a block's hashes
    differ, or the bytes of two parts where they meet or overlap), and the tensors with bytes no holder holds. The
    same on every holder."""
    from ._core import base_identity_from_blocks, block_hashes

    received: dict[tuple[str, int], list[tuple[int, int, bytes]]] = {}
    for sender, name, block, start, end in plan:
        data = sent[sender].get((name, start)) if sender < len(sent) else None
        if data is None or len(data) != end - start:
            raise IntegrityError(f"tensor {name!r}: rank {sender} sent no bytes {start}..{end} of it")
        received.setdefault((name, block), []).append((start, sender, data))
    identities: dict[str, str] = {}
    conflicts, uncovered = differently_sized(everyone), []
    for name in sorted(_split_names(everyone)):
        nbytes, whole, partial = _block_parts(everyone, name)
        hashes = []
        differ = gap = False
        for block in range(_blocks(nbytes)):
            low, high = block * BLOCK_BYTES, min((block + 1) * BLOCK_BYTES, nbytes)
            found = {
                bytes(run[8 * (block - first) : 8 * (block - first) + 8])
                for rank in whole.get(block, ())
                for first, run in everyone[rank][name].hashes  # type: ignore[union-attr]
                if first <= block < first + len(run) // 8
            }
            parts = received.get((name, block), [])
            if block in whole:  # the whole block's holder sent it first of all: the parts are compared with it
                owner = min(whole[block])
                parts = [(start, -1 if sender == owner else sender, data) for start, sender, data in parts]
            parts.sort()
            content = bytearray()
            for start, _, data in parts:
                if start > low + len(content):
                    gap = True
                    break
                shared = content[start - low : start - low + len(data)]
                if data[: len(shared)] != shared:
                    differ = True
                content += data[len(shared) :]
            if parts and not gap and len(content) == high - low:
                found.add(bytes(block_hashes(bytes(content))))
            elif not found:
                gap = True
            if len(found) > 1:
                differ = True
            hashes.append(next(iter(found), b""))
        if differ:
            conflicts.append(name)
        elif gap:
            uncovered.append(name)
        else:
            identities[name] = base_identity_from_blocks(b"".join(hashes), b"")
    return identities, conflicts, uncovered


class HeldColumns(NamedTuple):
    """What one holder holds of a tensor split by columns (vLLM's o_proj and down_proj at TP > 1): bytes ``first ..
    last`` of each of the rows ``row_start ..+ row_count``, rows of ``row_bytes`` bytes, of a tensor of ``nbytes``.
    No holder holds a 256 KiB block of it whole where rows are shorter than that, so holders send each other
    their bytes of it (:func:`columns_identity`), as one run."""

    nbytes: int
    row_bytes: int
    row_start: int
    row_count: int
    first: int
    last: int

    @property
    def sent_bytes(self) -> int:
        return self.row_count * (self.last - self.first)


def columns_identity(parts: list[HeldColumns], sent: list[bytes]) -> tuple[str | None, str]:
    """The base identity of a tensor split by columns, rebuilt from every holder's ``parts`` and the bytes each
    ``sent`` (its slice, row after row), and "" where it could be; else None and why not: "differ" where two holders
    hold different bytes for the same elements, "uncovered" where bytes of it no holder holds."""
    import numpy as np

    from ._core import range_identities

    nbytes, row_bytes = parts[0].nbytes, parts[0].row_bytes
    if any((p.nbytes, p.row_bytes) != (nbytes, row_bytes) for p in parts) or row_bytes <= 0 or nbytes % row_bytes:
        return None, "differ"
    shape = (nbytes // row_bytes, row_bytes)
    boxes = [(p.row_start, p.row_start + p.row_count, p.first, p.last) for p in parts]
    if any(r0 < 0 or r1 > shape[0] or c0 < 0 or c1 > shape[1] or r0 > r1 or c0 > c1 for r0, r1, c0, c1 in boxes):
        return None, "uncovered"
    # Where no two slices meet (no replicas), none is compared and they cover the tensor when their areas add up to
    # it; else every byte is marked as it is placed, and bytes placed twice compared.
    apart = not any(
        a[0] < b[1] and b[0] < a[1] and a[2] < b[3] and b[2] < a[3] for i, a in enumerate(boxes) for b in boxes[:i]
    )
    full = np.empty(shape, dtype=np.uint8)
    seen = None if apart else np.zeros(shape, dtype=bool)
    differ = False
    for part, data in zip(parts, sent, strict=True):
        if len(data) != part.sent_bytes:
            raise IntegrityError(f"a holder sent {len(data)} bytes of its slice, not {part.sent_bytes}")
        rows, cols = slice(part.row_start, part.row_start + part.row_count), slice(part.first, part.last)
        block = np.frombuffer(data, dtype=np.uint8).reshape(part.row_count, part.last - part.first)
        if seen is not None:
            already = seen[rows, cols]
            if already.any():
                differ |= bool((full[rows, cols][already] != block[already]).any())
            already[...] = True
        full[rows, cols] = block
    if differ:
        return None, "differ"
    covered = seen.all() if seen is not None else sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in boxes) == nbytes
    if not covered:
        return None, "uncovered"
    return range_identities([(full.reshape(-1), 0, nbytes)])[0], ""


def anchor_tensors(header: bytes, data_start: int, size: int, key: str) -> list[AnchorTensor]:
    """The tensors a safetensors header lists, with absolute byte offsets; a malformed header is a format error
    (the core's reader checks the whole file again when it is loaded)."""
    try:
        document = json.loads(header)
    except ValueError as error:
        raise DeltaFormatError(f"{key}: the header is not JSON: {error}") from None
    if not isinstance(document, dict):
        raise DeltaFormatError(f"{key}: the header is not a JSON object")
    out = []
    for name, info in document.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            if not (
                isinstance(dtype, str)
                and isinstance(shape, list)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
                and all(isinstance(o, int) and not isinstance(o, bool) for o in (begin, end))
                and 0 <= begin <= end <= size - data_start
            ):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise DeltaFormatError(f"{key}: the header entry of {name!r} is malformed") from None
        out.append(AnchorTensor(name, dtype, tuple(shape), data_start + begin, data_start + end))
    return out


__all__ = [
    "AnchorTensor",
    "Fragment",
    "HeldTensor",
    "NeededRanges",
    "PartialAnchor",
    "differently_sized",
    "fragment_plan",
    "fragments",
    "hash_turns",
    "held_tensors",
    "read_ranged",
    "segments",
    "split_identities",
]
