"""Checkpoints filled in place: a plain safetensors file laid out as safetensors' own writer lays it out, created at
its full size and filled tensor by tensor, through a writable memory map or (an anchor in a local store) straight from
the anchor's file with each piece checked first. A pulled state is then never held in memory a second time, and the
file comes out byte for byte as ``safetensors.numpy.save_file`` would write it."""

from __future__ import annotations

import json
import math
import mmap
import os
from typing import BinaryIO

import numpy as np

from . import _arrays
from ._core import checkpoint_layout, copy_checked_pieces
from ._ranged import MAX_HEADER_BYTES, AnchorTensor, anchor_tensors
from .errors import DeltaFormatError, IntegrityError
from .manifest import Pieces

#: Linux's madvise advice that faults every page of a range in, writable (5.14+; Python names no constant for it).
_MADV_POPULATE_WRITE = 23


class CheckpointFile:
    """The file at ``path`` (created or truncated) laid out for ``tensors`` (name, dtype name, shape) with its header
    written and held open; :meth:`arrays` maps it and gives writable numpy views of its tensors. Close it before the
    file is renamed."""

    def __init__(self, path: str, tensors: list[tuple[str, str, tuple[int, ...]]]) -> None:
        header, ranges, size = checkpoint_layout([(name, dtype, list(shape)) for name, dtype, shape in tensors])
        self.path = path
        self.tensors = tensors
        self.ranges = {name: span for (name, _, _), span in zip(tensors, ranges)}
        self.size = size
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, 0)  # a previous attempt's bytes must not survive into this one
            os.ftruncate(fd, size)
            os.pwrite(fd, header, 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        self._map: mmap.mmap | None = None

    def arrays(self) -> dict[str, np.ndarray]:
        if self._map is None and self.size:
            assert self._fd is not None, "closed"
            # Every page is then written (an anchor applied) or read (the state digest) through the map: populating
            # it in one call costs far less than a fault per page. Mapped only now, after a copy of the anchor into
            # the file, so that it maps the pages that copy wrote rather than zero-filled ones it then replaces.
            self._map = mmap.mmap(self._fd, self.size)
            try:
                self._map.madvise(_MADV_POPULATE_WRITE)  # writable: no write-protect fault per page either
            except (OSError, ValueError):  # before Linux 5.14, or elsewhere: faults as pages are touched
                pass
        buffer = self._map if self._map is not None else bytearray()
        out = {}
        for name, dtype, shape in self.tensors:
            start, end = self.ranges[name]
            np_dtype = _arrays.numpy_dtype(dtype)
            count = (end - start) // np_dtype.itemsize
            out[name] = np.frombuffer(buffer, dtype=np_dtype, count=count, offset=start if count else 0).reshape(shape)
        return out

    def close(self) -> None:
        """Unmaps the file; the arrays from :meth:`arrays` must be gone by then (a live view keeps the map)."""
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a caller still holds a view: the map closes when the last one goes
                pass
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def copy_anchor(source: BinaryIO, key: str, step: int, pieces: Pieces, path: str) -> CheckpointFile:
    """Lays out the checkpoint at ``path`` for the anchor open as ``source`` (a local regular file, ``key`` in its
    store, the anchor of ``step``) and copies the anchor's tensors into it in one read of the anchor: its header is
    read and checked against ``pieces`` before it is parsed, and every piece of the file is checked before any byte
    of it is written (core::anchors::copy_checked_pieces). Raises IntegrityError when a byte differs, and
    DeltaFormatError when the checked header is not an anchor of ``step``'s tensors; ``path`` is then the caller's to
    remove."""
    fd = source.fileno()
    if os.fstat(fd).st_size != pieces.size:
        raise IntegrityError(f"{key}: {os.fstat(fd).st_size} bytes, its manifest entry says {pieces.size}")
    tensors = _checked_header(fd, key, step, pieces)
    out = CheckpointFile(path, [(t.name, t.dtype, t.shape) for t in tensors])
    segments = [(t.start, t.end - t.start, out.ranges[t.name][0]) for t in tensors]
    bad = copy_checked_pieces(f"/proc/self/fd/{fd}", pieces.size, pieces.piece_bytes, pieces.hashes, path, segments)
    if bad is not None:
        out.close()
        raise pieces_error(key, pieces, bad)
    return out


def pieces_error(key: str, pieces: Pieces, bad: tuple[str, int]) -> IntegrityError:
    """The error for what ``copy_checked_pieces`` found wrong with anchor ``key``."""
    what, value = bad
    if what == "size":
        return IntegrityError(f"{key}: {value} bytes, its manifest entry says {pieces.size}")
    start, end = pieces.span(value)
    return IntegrityError(f"{key}: bytes {start}..{end} (piece {value}) do not match its pieces sidecar")


def _checked_header(fd: int, key: str, step: int, pieces: Pieces) -> list[AnchorTensor]:
    """The tensors of the anchor open as ``fd``, from its header read once into memory and checked piece by piece."""

    def checked(end: int) -> bytes:
        last = max(0, -(-end // pieces.piece_bytes) - 1)
        data = os.pread(fd, pieces.span(last)[1], 0)
        for index in range(last + 1):
            first, stop = pieces.span(index)
            pieces.check(index, memoryview(data)[first:stop], key)
        return data

    if pieces.size < 8:
        raise DeltaFormatError(f"{key}: {pieces.size} bytes, too short for a safetensors header")
    header_bytes = int.from_bytes(checked(8)[:8], "little")
    if header_bytes > MAX_HEADER_BYTES or 8 + header_bytes > pieces.size:
        raise DeltaFormatError(f"{key}: a header of {header_bytes} bytes does not fit the file")
    header = checked(8 + header_bytes)[8 : 8 + header_bytes]
    tensors = anchor_tensors(header, 8 + header_bytes, pieces.size, key)
    metadata = json.loads(header).get("__metadata__") or {}
    if metadata.get("format") != "deltasync" or metadata.get("kind") != "anchor":
        raise DeltaFormatError(f"{key}: not a deltasync anchor")
    if metadata.get("step") not in (None, str(step)):
        raise IntegrityError(f"{key}: the file says step {metadata.get('step')}, its entry step {step}")
    if metadata.get("format_version") not in ("1", "2"):
        raise DeltaFormatError(f"{key}: format version {metadata.get('format_version')!r} is not one this reader knows")
    for t in tensors:
        if t.dtype not in _arrays._NUMPY_NAMES.values():
            raise DeltaFormatError(f"{key}: tensor {t.name!r} has dtype {t.dtype!r}, which no state holds")
        if t.end - t.start != _arrays.numpy_dtype(t.dtype).itemsize * math.prod(t.shape):
            raise DeltaFormatError(f"{key}: tensor {t.name!r} takes {t.end - t.start} bytes, not its shape's")
        if t.name.endswith((":pos", ":val")) or t.name.startswith("__deltasync_"):
            raise DeltaFormatError(f"{key}: tensor {t.name!r} is a delta's stream; an anchor holds whole tensors")
    return tensors
