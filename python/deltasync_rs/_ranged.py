"""Anchors read by byte ranges (docs/format.md §10, anchor pieces): a reader that needs only part of an anchor (a
tensor-parallel rank, its own shard) reads the pieces that cover those bytes, checks each against the anchor's
pieces sidecar, and gets a :class:`PartialAnchor` that knows which bytes it verified."""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

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

    __slots__ = ("_covered", "_piece_bytes", "_offsets", "_map", "key")

    def __init__(
        self, delta: Delta, covered: frozenset[int], piece_bytes: int, offsets: dict[str, tuple[int, int]], key: str
    ) -> None:
        super().__init__(delta._raw)
        self._covered = covered
        self._piece_bytes = piece_bytes
        self._offsets = offsets
        self._map: mmap.mmap | None = None
        self.key = key

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

    def tensor_bytes(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``start .. end`` of tensor ``name``, which must have been verified."""
        self.require(name, start, end)
        assert self._map is not None
        begin, stop = self._span(name, start, end)
        return self._map[begin:stop]

    def _refused(self) -> DeltaSyncError:
        return DeltaSyncError(
            f"{self.key}: only part of this anchor was read; apply it with deltasync_rs.vllm.apply_delta (which "
            "checks that it uses only verified bytes), or read it whole"
        )

    def decoded(self, index: int, device: Any = None, *, base: Any = None) -> tuple[Any, Any]:
        """As :meth:`Delta.decoded`, for a tensor whose bytes were all read and verified (IntegrityError else: its
        other bytes read as zero)."""
        name = self.names[self._index(index)]
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


__all__ = ["AnchorTensor", "NeededRanges", "PartialAnchor", "read_ranged"]
