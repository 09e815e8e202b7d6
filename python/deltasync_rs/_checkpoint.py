"""Checkpoints filled in place: a plain safetensors file laid out as safetensors' own writer lays it out, created at
its full size and filled in batches of tensors, straight from an anchor's local file with each piece checked first
(or through a writable memory map), each batch patched by the deltas right after. A pulled state is then never held
in memory a second time, and the file comes out byte for byte as ``safetensors.numpy.save_file`` would write it."""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import sys
from collections.abc import Callable
from typing import Any, BinaryIO

import numpy as np

from . import _arrays, _write
from ._core import (
    checkpoint_layout,
    combine_hashes,
    copy_checked_pieces,
    file_piece_hashes,
    fill_checked_pieces,
    tensor_hashes,
)
from ._ranged import MAX_HEADER_BYTES, AnchorTensor, PartialAnchor, anchor_tensors
from .delta import Delta, load_stand_in
from .errors import BaseMismatchError, DeltaFormatError, DeltaSyncError, IntegrityError
from .manifest import Pieces
from .store import private_temp, remove_temp

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
            # Its blocks reserved now: a full disk is an error here, not a SIGBUS from a write through the map.
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as error:
                if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
            os.pwrite(fd, header, 0)
        except OSError as error:
            os.close(fd)
            raise DeltaSyncError(f"{path}: cannot write a checkpoint of {size} bytes: {error}") from error
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
        tensors, self.prefix = _checked_header(self.fd, key, step, pieces)
        self.tensors = {t.name: t for t in tensors}

    def specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        return [(t.name, t.dtype, t.shape) for t in self.tensors.values()]

    def copy_into(self, out: CheckpointFile, names: list[str]) -> None:
        """Copies tensors ``names`` into ``out``; IntegrityError when a byte differs (``out`` is then the caller's
        to discard)."""
        segments = [(t.start, t.end - t.start, out.ranges[t.name][0]) for t in map(self.tensors.__getitem__, names)]
        copy_checked(self.fd, self.key, self.pieces, out.path, segments)


class FilledAnchor(PartialAnchor):
    """An anchor kept as a local file (a local store's), applied by filling each target straight from that file.
    :meth:`open` checks every piece of the file against the pieces sidecar (hashed in parallel); ``_apply`` reads
    them again, each group checked again before its bytes are copied into the targets (core::anchors::fill_checked),
    so no byte is used unchecked even if the file changes in between (then IntegrityError says the targets hold
    part of the anchor; a retry fills them again). Nothing of the anchor is copied anywhere else: no temporary
    file, no buffer beyond a few MiB per thread. Only its checked header is held here (every other byte reads as
    zero, as in a PartialAnchor that covers nothing), so only ``Subscriber.pull`` uses one, through ``_apply``;
    ``apply_``, ``save`` and ``to_bytes`` refuse. Targets the core cannot write in place (other devices, strided
    views, tensors that share memory) are written from ``whole()``, the anchor read the usual way."""

    __slots__ = ("_source", "_pieces", "_retry", "_whole")

    def __init__(
        self,
        source: BinaryIO,
        anchor: LocalAnchor,
        delta: Delta,
        retry: Callable[[str, Callable[[], Any]], Any],
        whole: Callable[[], Delta],
    ) -> None:
        offsets = {name: (t.start, t.end) for name, t in anchor.tensors.items()}
        super().__init__(delta, frozenset(), anchor.pieces.piece_bytes, offsets, anchor.key)
        self._source, self._pieces, self._retry, self._whole = source, anchor.pieces, retry, whole

    @classmethod
    def open(
        cls,
        source: BinaryIO,
        key: str,
        step: int,
        pieces: Pieces,
        retry: Callable[[str, Callable[[], Any]], Any],
        whole: Callable[[], Delta],
    ) -> FilledAnchor:
        """The anchor ``key`` of ``step``, open as ``source`` (which it takes over once this returns), every piece
        checked: IntegrityError for the first that differs."""
        anchor = LocalAnchor(source, key, step, pieces)
        pieces.check_all(
            file_piece_hashes(f"/proc/self/fd/{source.fileno()}", pieces.piece_bytes, pieces.algorithm), key
        )
        # The checked header alone, in a sparse private file of the anchor's size, for the tensors' metadata.
        fd, path = private_temp()
        try:
            os.ftruncate(fd, pieces.size)
            os.pwrite(fd, anchor.prefix, 0)
            delta = load_stand_in(path)
        finally:
            os.close(fd)
            remove_temp(path)
        return cls(source, anchor, delta, retry, whole)

    def close(self) -> None:
        self._source.close()

    def _apply(self, state: Any, *, check_base: bool, digest: bool) -> dict[str, bytes | None]:
        if self._source.closed:  # applied once already: the file it was checked from is gone
            return self._whole()._apply(state, check_base=check_base, digest=digest)
        try:
            infos = self._raw.tensors()
            names = [info[0] for info in infos]
            fills: list[tuple[int, Any]] = []
            spans: list[tuple[int, int]] = []
            written: dict[str, bytes | None] = {}
            for index, target in self._resolve_targets(state, names):
                dtype, shape = _arrays.describe(target, names[index])
                self._raw.check_target(index, dtype, list(shape))
                if int(infos[index][3]) == 0:
                    continue
                if _arrays.is_torch(target):
                    if not _arrays.readable_in_place(target):
                        return self._whole()._apply(state, check_base=check_base, digest=digest)
                    start, length = _arrays.address(target), target.numel() * target.element_size()
                else:
                    if not (target.flags.c_contiguous and target.flags.writeable):
                        return self._whole()._apply(state, check_base=check_base, digest=digest)
                    target = target.reshape(-1).view(np.uint8)
                    start, length = _arrays.address(target), target.nbytes
                fills.append((self._offsets[names[index]][0], target))
                spans.append((start, start + length))
                written[names[index]] = None
            spans.sort()
            if any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:])):
                # Tensors that share memory (tied weights): the usual path writes them once, when they agree.
                return self._whole()._apply(state, check_base=check_base, digest=digest)
            self._retry(self.key, lambda: self._fill(fills))
        finally:
            self.close()
        torch = sys.modules.get("torch")
        if torch is not None:  # writes through memory are invisible to autograd: move the version counters
            for _, target in fills:
                if _arrays.is_torch(target) and not target.is_inference():
                    torch.autograd.graph.increment_version(target)
        return written

    def _fill(self, fills: list[tuple[int, Any]]) -> None:
        pieces, key = self._pieces, self.key
        bad = fill_checked_pieces(
            f"/proc/self/fd/{self._source.fileno()}",
            pieces.size,
            pieces.piece_bytes,
            pieces.algorithm,
            pieces.hashes,
            fills,
        )
        if bad is None:
            return
        what, value = bad
        if what == "size":
            raise IntegrityError(f"{key}: {value} bytes, its manifest entry says {pieces.size}")
        start, end = pieces.span(value)
        raise IntegrityError(
            f"{key}: bytes {start}..{end} (piece {value}) changed after the anchor was checked (they matched its "
            "pieces sidecar, then did not); the target holds part of this anchor: pull it again"
        )


#: Whether a file opened here can be read by the core through its descriptor (/proc/self/fd/N: the very inode that
#: was opened, whatever its name points to meanwhile).
READS_BY_DESCRIPTOR = os.path.isdir("/proc/self/fd")


def copy_checked(fd: int, key: str, pieces: Pieces, dest: str, segments: list[tuple[int, int, int]]) -> None:
    """Copies (from, length, to) ``segments`` of anchor ``key``, open as ``fd``, into the file ``dest``, every piece
    they touch checked against ``pieces`` before it is used (core::anchors::copy_checked_pieces); IntegrityError for
    a source of another size or the first piece that differs (``dest`` is then the caller's to discard)."""
    bad = copy_checked_pieces(
        f"/proc/self/fd/{fd}", pieces.size, pieces.piece_bytes, pieces.algorithm, pieces.hashes, dest, segments
    )
    if bad is None:
        return
    what, value = bad
    if what == "size":
        raise IntegrityError(f"{key}: {value} bytes, its manifest entry says {pieces.size}")
    raise pieces.mismatch(value, key)


def _checked_header(fd: int, key: str, step: int, pieces: Pieces) -> tuple[list[AnchorTensor], bytes]:
    """The tensors of the anchor open as ``fd``, from its header read once into memory and checked piece by piece,
    and the file's first bytes, the header's included (whole pieces, checked)."""

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
        if t.end - t.start != _arrays.WIDTHS[t.dtype] * math.prod(t.shape):  # no numpy dtype: ml_dtypes loads slowly
            raise DeltaFormatError(f"{key}: tensor {t.name!r} takes {t.end - t.start} bytes, not its shape's")
        # The names docs/format.md §4 reserves (the writer refuses them), and no more: `__deltasync_x` is a tensor.
        if t.name.endswith((":pos", ":val")) or t.name in ("__deltasync_records__", "__deltasync_streams__"):
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
    return tensors, first
