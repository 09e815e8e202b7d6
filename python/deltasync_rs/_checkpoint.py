"""Checkpoints filled in place: a plain safetensors file laid out as safetensors' own writer lays it out, created at
its full size and filled in batches of tensors, straight from an anchor's local file with each piece checked first
(or through a writable memory map), each batch patched by the deltas right after. A pulled state is then never held
in memory a second time, and the file comes out byte for byte as ``safetensors.numpy.save_file`` would write it."""

from __future__ import annotations

import json
import math
import mmap
import os
from typing import Any, BinaryIO

import numpy as np

from . import _arrays, _write
from ._core import checkpoint_layout, combine_hashes, copy_checked_pieces, tensor_hashes
from ._ranged import MAX_HEADER_BYTES, AnchorTensor, PartialAnchor, anchor_tensors
from .delta import Delta
from .errors import BaseMismatchError, DeltaFormatError, IntegrityError
from .manifest import Pieces

#: Linux's madvise advice that faults every page of a range in, writable (5.14+; Python names no constant for it).
_MADV_POPULATE_WRITE = 23


#: Bytes of the output filled and patched at a time: small enough that the kernel's writeback has not cleaned a
#: batch's pages between its copy and its deltas (a cleaned page faults again when written), and that only a batch
#: of the output is mapped at once.
BATCH_BYTES = 256 << 20


class CheckpointFile:
    """The file at ``path`` (created or truncated) laid out for ``tensors`` (name, dtype name, shape) with its header
    written and held open; :meth:`arrays` maps part of it and gives numpy views of those tensors, until
    :meth:`release`. Close it before the file is renamed."""

    def __init__(self, path: str, tensors: list[tuple[str, str, tuple[int, ...]]]) -> None:
        header, ranges, size = checkpoint_layout([(name, dtype, list(shape)) for name, dtype, shape in tensors])
        self.path = path
        self.specs = {name: (dtype, shape) for name, dtype, shape in tensors}
        self.ranges = {name: span for (name, _, _), span in zip(tensors, ranges)}
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, 0)  # a previous attempt's bytes must not survive into this one
            os.ftruncate(fd, size)
            os.pwrite(fd, header, 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        self._maps: list[mmap.mmap] = []
        self._hashes: dict[str, bytes] = {}

    def hash(self, arrays: dict[str, np.ndarray]) -> None:
        """Records the state-digest hash of each of ``arrays`` (views of this file) as it is now."""
        entries: list[Any] = []
        for name, array in arrays.items():
            dtype, shape = self.specs[name]
            entries.append((name, dtype, list(shape), array.reshape(-1).view(np.uint8)))
        self._hashes.update(zip(arrays, tensor_hashes(entries)))

    def state_digest(self) -> str:
        """The state digest of the file's tensors, from the hashes :meth:`hash` recorded, one for every tensor."""
        missing = self.specs.keys() - self._hashes.keys()
        assert not missing, f"no hash recorded for {sorted(missing)[:3]}"
        return combine_hashes(list(self._hashes.items()))

    def batches(self) -> list[list[str]]:
        """The tensors in file order, in runs of about ``BATCH_BYTES`` (a larger tensor is a run of its own)."""
        runs: list[list[str]] = []
        size = 0
        for name in sorted(self.ranges, key=lambda n: self.ranges[n]):
            start, end = self.ranges[name]
            if not runs or size + end - start > BATCH_BYTES:
                runs.append([])
                size = 0
            runs[-1].append(name)
            size += end - start
        return runs

    def arrays(self, names: list[str]) -> dict[str, np.ndarray]:
        """Writable views of tensors ``names`` through one map of the bytes they span, faulted in at once (a write
        fault per page costs far more; map a batch, not a file larger than memory)."""
        assert self._fd is not None, "closed"
        spans = [self.ranges[n] for n in names if self.ranges[n][1] > self.ranges[n][0]]
        out: dict[str, np.ndarray] = {}
        buffer: mmap.mmap | bytearray = bytearray()
        base = 0
        if spans:
            base = min(s for s, _ in spans) // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
            length = max(e for _, e in spans) - base
            buffer = mmap.mmap(self._fd, length, offset=base)
            try:
                buffer.madvise(_MADV_POPULATE_WRITE)  # writable: no write-protect fault per page either
            except (OSError, ValueError):  # before Linux 5.14, or elsewhere: faults as pages are touched
                pass
            self._maps.append(buffer)
        for name in names:
            dtype, shape = self.specs[name]
            start, end = self.ranges[name]
            np_dtype = _arrays.numpy_dtype(dtype)
            count = (end - start) // np_dtype.itemsize
            offset = start - base if count else 0
            view = np.frombuffer(buffer if count else bytearray(), dtype=np_dtype, count=count, offset=offset)
            out[name] = view.reshape(shape)
        return out

    def release(self) -> None:
        """Unmaps what :meth:`arrays` mapped; its views must be gone by then (a live view keeps its map)."""
        for mapped in self._maps:
            try:
                mapped.close()
            except BufferError:  # a caller still holds a view: the map closes when the last one goes
                pass
        self._maps = []

    def close(self) -> None:
        self.release()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def apply_to(deltas: list[Delta], arrays: dict[str, np.ndarray], *, check_base: bool) -> None:
    """Applies ``deltas`` in order to the tensors of ``arrays``, which may be some of the state's (a batch): each
    delta's changes to tensors outside ``arrays`` are left for another call."""
    for delta in deltas:
        if isinstance(delta, PartialAnchor):  # its unread bytes read as zero: only vLLM's checked apply may use it
            raise delta._refused()
        writes = _write.Writes(delta._raw)
        pairs = [(index, arrays[name]) for index, (name, *_) in enumerate(writes.infos) if name in arrays]
        if pairs:
            writes.add_all(pairs, check_base=check_base)
            writes.commit()


def require_names(deltas: list[Delta], names: set[str], where: str) -> None:
    """Raises BaseMismatchError when a delta changes a tensor that the state (``names``) does not have."""
    for delta in deltas:
        missing = [name for name in delta.names if name not in names]
        if missing:
            shown = ", ".join(repr(n) for n in missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise BaseMismatchError(f"{where}: {len(missing)} tensors of a delta are not in the anchor: {shown}")


class LocalAnchor:
    """An anchor kept as a local regular file (``source``, ``key`` in its store, the anchor of ``step``): its header
    read once into memory and checked against ``pieces`` before it is parsed; :meth:`copy_into` then copies tensors
    from it with every piece they touch checked first (core::anchors::copy_checked_pieces)."""

    def __init__(self, source: BinaryIO, key: str, step: int, pieces: Pieces) -> None:
        self.fd, self.key, self.pieces = source.fileno(), key, pieces
        size = os.fstat(self.fd).st_size
        if size != pieces.size:
            raise IntegrityError(f"{key}: {size} bytes, its manifest entry says {pieces.size}")
        self.tensors = {t.name: t for t in _checked_header(self.fd, key, step, pieces)}

    def specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        return [(t.name, t.dtype, t.shape) for t in self.tensors.values()]

    def copy_into(self, out: CheckpointFile, names: list[str]) -> None:
        """Copies tensors ``names`` into ``out``; IntegrityError when a byte differs (``out`` is then the caller's
        to discard)."""
        segments = [(t.start, t.end - t.start, out.ranges[t.name][0]) for t in map(self.tensors.__getitem__, names)]
        copy_checked(self.fd, self.key, self.pieces, out.path, segments)


#: Whether a file opened here can be read by the core through its descriptor (/proc/self/fd/N: the very inode that
#: was opened, whatever its name points to meanwhile).
READS_BY_DESCRIPTOR = os.path.isdir("/proc/self/fd")


def copy_checked(fd: int, key: str, pieces: Pieces, dest: str, segments: list[tuple[int, int, int]]) -> None:
    """Copies (from, length, to) ``segments`` of anchor ``key``, open as ``fd``, into the file ``dest``, every piece
    they touch checked against ``pieces`` before it is used (core::anchors::copy_checked_pieces); IntegrityError for
    a source of another size or the first piece that differs (``dest`` is then the caller's to discard)."""
    bad = copy_checked_pieces(f"/proc/self/fd/{fd}", pieces.size, pieces.piece_bytes, pieces.hashes, dest, segments)
    if bad is None:
        return
    what, value = bad
    if what == "size":
        raise IntegrityError(f"{key}: {value} bytes, its manifest entry says {pieces.size}")
    raise pieces.mismatch(value, key)


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
    first = checked(8)  # whole pieces: usually the header too
    header_bytes = int.from_bytes(first[:8], "little")
    if header_bytes > MAX_HEADER_BYTES or 8 + header_bytes > pieces.size:
        raise DeltaFormatError(f"{key}: a header of {header_bytes} bytes does not fit the file")
    if len(first) < 8 + header_bytes:
        first = checked(8 + header_bytes)
    header = first[8 : 8 + header_bytes]
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
    # The tensors tile the data (as safetensors requires): every byte after the header lies in one, so copying every
    # tensor checks every piece of the file, the header's included.
    at = 8 + header_bytes
    for t in sorted(tensors, key=lambda t: (t.start, t.end)):
        if t.start != at:
            raise DeltaFormatError(
                f"{key}: tensor {t.name!r} starts at byte {t.start}, not at {at} where the last ended"
            )
        at = t.end
    if at != pieces.size:
        raise DeltaFormatError(f"{key}: its tensors end at byte {at} of {pieces.size}")
    return tensors
