"""The Delta object and the calls that make one: diff, anchor, load; plus all-or-nothing apply_."""

from __future__ import annotations

import os
from collections.abc import Callable, Container, Iterable, Mapping
from typing import Any, NamedTuple, Union

import numpy as np

from . import _arrays, _identity, _write
from ._core import BaseMismatchError, DeferredDelta, DeltaSyncError, RawDelta, alias_problem
from ._core import combine_hashes as _combine_hashes
from ._core import tensor_hashes as _tensor_hashes
from ._core import write_anchor as _write_anchor
from .errors import shown

#: Name under which a single tensor (not a mapping) is stored.
DEFAULT_NAME = "tensor"
#: Host bytes staged from devices before each batch is handed to the core.
_STAGING_BYTES = 512 << 20

Tensor = Any  # torch.Tensor | numpy.ndarray
State = Union[Tensor, Mapping[str, Tensor]]  # noqa: UP007 (a runtime alias; "os.PathLike[str]" below is a string)
Source = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview]


class TensorInfo(NamedTuple):
    """What a delta holds for one tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...] | None
    #: Elements that differ from the base; for a tensor stored whole, every element unless the file records fewer.
    changed: int
    positions: str
    values: str
    nbytes: int

    @property
    def density(self) -> float | None:
        """Changed elements over all elements, or None when the shape is unknown (TRL imports)."""
        if self.shape is None:
            return None
        numel = int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1
        return self.changed / numel if numel else 0.0


class Delta:
    """Bit-exact changes to a set of tensors, stored as encoded position and value streams.

    Make one with :func:`diff`, :func:`anchor` or :func:`load`; write it with :meth:`save` or :meth:`to_bytes`;
    apply it in place with :meth:`apply_`.
    """

    __slots__ = ("_raw", "_entry")

    def __init__(self, raw: RawDelta) -> None:
        self._raw = raw
        #: The manifest entry (a ``manifest.Entry``) a Subscriber verified this file against; None for a file read
        #: otherwise.
        self._entry: Any = None

    @property
    def names(self) -> list[str]:
        return [t[0] for t in self._raw.tensors()]

    @property
    def tensors(self) -> list[TensorInfo]:
        return [
            TensorInfo(n, d, tuple(s) if s is not None else None, changed, p, v, b)
            for (n, d, s, _, p, v, b), changed in zip(self._raw.tensors(), self._raw.changed_elements(), strict=True)
        ]

    @property
    def num_changed(self) -> int:
        """Changed elements over all tensors. A tensor stored whole counts the elements that differ from the base
        where the writer knew them, else (anchors, TRL imports, older files) every element."""
        return self._raw.num_changed

    @property
    def num_elements(self) -> int:
        """Elements covered by the delta, over tensors whose shape is known."""
        return self._raw.num_elements

    @property
    def nbytes(self) -> int:
        """Bytes of the encoded streams alone; :attr:`file_nbytes` is the size of the file."""
        return self._raw.nbytes

    @property
    def file_nbytes(self) -> int:
        """Bytes of the file :meth:`save` writes (and :meth:`to_bytes` returns): the streams plus the header.
        Measured by building the file's bytes, so it costs one copy of the streams."""
        return len(self._raw.to_bytes("deltasync"))

    @property
    def is_anchor(self) -> bool:
        """True when every tensor is stored whole, so the delta applies to any base."""
        return self._raw.is_anchor

    @property
    def _whole_state(self) -> bool:
        """True for an anchor of a whole state: every tensor stored whole and no base step named. A delta that names
        its base is none, even where every tensor it names changed whole (``publish_delta`` of some of the
        tensors): it holds those tensors only, and the state's others stay as they were."""
        return self.is_anchor and self.base_step is None

    @property
    def step(self) -> int | None:
        return self._raw.step

    @step.setter
    def step(self, value: int | None) -> None:
        self._raw.step = _check_step(value, "step")

    @property
    def base_step(self) -> int | None:
        return self._raw.base_step

    @base_step.setter
    def base_step(self, value: int | None) -> None:
        self._raw.base_step = _check_step(value, "base_step")

    @property
    def metadata(self) -> dict[str, str]:
        """Caller metadata stored in the file header (a copy; assign to change it)."""
        return dict(self._raw.metadata)

    @metadata.setter
    def metadata(self, value: Mapping[str, str]) -> None:
        self._raw.metadata = _metadata(value)

    @property
    def aliases(self) -> dict[str, str]:
        """Tied names stored in the file header (docs/format.md §2.2): each name the trainer's model holds as the
        same tensor as another, to the name of the record it is written under. A reader holding the alias as a
        tensor of its own must write it too or refuse the file. A copy; assign to change it (checked against the
        records when the file is written)."""
        return dict(self._raw.aliases)

    @aliases.setter
    def aliases(self, value: Mapping[str, str]) -> None:
        self._raw.aliases = _aliases(value)

    def __len__(self) -> int:
        return len(self._raw)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._raw.has_tensor(name)

    def __repr__(self) -> str:
        kind = "anchor" if self.is_anchor else "delta"
        tensors = "1 tensor" if len(self) == 1 else f"{len(self)} tensors"
        if any(t.shape is None for t in self.tensors):  # TRL files store no shapes, so the total is unknown
            changed = f"{self.num_changed} element{'' if self.num_changed == 1 else 's'} changed (shapes unknown)"
        else:
            changed = f"{self.num_changed} of {self.num_elements} elements changed"
        return (
            f"<deltasync {kind}: {tensors}, {changed}, {self.nbytes} bytes of streams, step={self.step}, "
            f"base_step={self.base_step}>"
        )

    def to_bytes(self, format: str = "deltasync") -> bytes:
        """The file's bytes. ``format="trl"`` writes TRL's v1 layout, which needs ``values="abs"`` and has no place
        for tied names: each alias (:attr:`aliases`) is written there as a tensor of its own, with its tensor's
        changes, so that a TRL reader holding it untied writes it too."""
        return self._for(format)._raw.to_bytes(format)

    def save(self, path: str | os.PathLike[str], format: str = "deltasync") -> None:
        """Writes the file atomically: a temporary file in the same folder, then a rename (so ``path`` must be a
        regular file, or nothing yet: a device or FIFO there would be replaced, and is refused)."""
        from ._outputs import require_output_file

        if isinstance(path, (str, os.PathLike)):
            require_output_file(os.fsdecode(os.fspath(path)))
        self._for(format)._raw.save(os.fspath(path), format)

    def _for(self, format: str) -> Delta:
        """The delta to write in ``format``: TRL's layout names every alias as a tensor."""
        return self._with_ties(self._raw.aliases) if format == "trl" else self

    def apply_(self, state: State, *, check_base: bool = False) -> None:
        """Applies the delta in place to a tensor, an array, or a mapping of them.

        Every name, dtype and shape is checked, and everything that can fail is done, before the first write:
        on an error the target is untouched. CPU tensors and arrays are written by the Rust core; tensors on
        other devices get their changes decoded on the CPU, moved over once and written with ``index_copy_``.
        With ``check_base=True`` every target must first hold the exact base the delta was made against (the
        ``base`` identity the writer records per tensor), or BaseMismatchError names the tensor: a wrong base, or
        a delta applied twice, is refused instead of producing wrong weights.

        A name the file lists as tied (:attr:`aliases`) that ``state`` holds as a tensor of its own (a model
        served untied) is written with its tensor's changes too, as the trainer's model holds them, and checked
        the same way; left out, it would keep its old values.
        """
        self._with_ties(state if isinstance(state, Mapping) else ())._apply(state, check_base=check_base, digest=False)

    def _with_ties(self, held: Container[str]) -> Delta:
        """This delta, with each tied name in ``held`` (a target's names) given its tensor's record as well, and no
        longer listed as an alias; itself where there is none (or it is not a plain Delta, whose records are read
        otherwise)."""
        aliases = self._raw.aliases
        if not aliases or type(self) is not Delta:
            return self
        names = self.names
        index = {name: i for i, name in enumerate(names)}
        extra = [(alias, index[name]) for alias, name in aliases.items() if alias in held and name in index]
        if not extra:
            return self
        return Delta(self._raw.arranged([(name, i) for i, name in enumerate(names)] + extra))

    def _apply(self, state: State, *, check_base: bool, digest: bool) -> dict[str, bytes | None]:
        """``apply_``, returning the names of the tensors it wrote: each with its state-digest hash
        (``_core.tensor_hashes``) where, with ``digest`` and ``check_base``, the core hashed its target in passing
        after the write (so a caller checking the state digest need not read it again), else None."""
        writes = _write.Writes(self._raw)
        writes.add_all(self._resolve_targets(state, [info[0] for info in writes.infos]), check_base=check_base)
        hashes = writes.commit(digest=digest)
        written: dict[str, bytes | None] = {info[0]: None for info in writes.infos if int(info[3]) > 0}
        written.update((writes.infos[index][0], hash_) for index, hash_ in hashes.items())
        return written

    def decoded(self, index: int, device: Any = None, *, base: Any = None) -> tuple[Any, Any]:
        """The changes of tensor ``index`` as torch tensors on ``device``, decoded on the CPU and moved in one transfer.

        A tensor with ``context`` positions (``codec="context"``) decodes only against ``base``, the tensor before
        the change (a tensor or array, checked against the recorded base identity); others ignore ``base``.

        Returns ``(positions, values)``: ``positions`` is int64, flat row-major (``None`` when the tensor is stored
        whole as new values); ``values`` has the integer type of the element width and holds bit patterns: the new
        bits for ``values="abs"``, the wrapping bit-pattern difference for ``values="diff"`` (see docs/format.md).
        """
        try:
            import torch  # noqa: F401  (decoded returns torch tensors; a numpy-only program may not have imported it)
        except ImportError:
            raise DeltaSyncError("Delta.decoded returns torch tensors, and torch is not installed") from None
        return _write.decode(self._raw, self._index(index), device=device, base=base)

    def holds_differences(self, index: int) -> bool:
        """True when tensor ``index``'s values are bit-pattern differences to add to the base, not new bits."""
        return self._raw.holds_differences(self._index(index))

    def base_identity(self, index: int) -> str | None:
        """The identity of the base tensor ``index`` was diffed against (docs/format.md §3), or None if unrecorded."""
        return self._raw.base_identity(self._index(index))

    def _index(self, index: int) -> int:
        """``index`` when it is the index of one of the delta's tensors (0 to len - 1; not a bool, not negative)."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self):
            raise DeltaSyncError(
                f"index must be an integer from 0 to {len(self) - 1} (the delta's tensors), not {shown(index)}"
            )
        return index

    def _resolve_targets(self, state: State, names: list[str]) -> list[tuple[int, Tensor]]:
        if _arrays.is_array(state):
            if len(names) != 1:
                raise BaseMismatchError(f"a single tensor was given, but the delta holds {len(names)} tensors")
            return [(0, state)]
        if not isinstance(state, Mapping):
            raise DeltaSyncError(f"apply_ takes a tensor, an array or a mapping of them, not {type(state).__name__}")
        missing = [name for name in names if name not in state]
        if missing:
            shown = ", ".join(repr(n) for n in missing[:5]) + (" ..." if len(missing) > 5 else "")
            counted = f"{len(missing)} tensor{'' if len(missing) == 1 else 's'} of the delta"
            raise BaseMismatchError(f"{counted} {'is' if len(missing) == 1 else 'are'} not in the target: {shown}")
        return [(index, state[name]) for index, name in enumerate(names)]


def in_batches(entries: Iterable[tuple[Any, int]], flush: Callable[[list], object]) -> None:
    """Hands ``(entry, bytes copied to the host)`` pairs to ``flush`` in batches, so that host copies of device
    tensors never exceed about ``_STAGING_BYTES`` at once; tensors already on the host cost nothing."""
    batch, staged_bytes = [], 0
    for entry, copied in entries:
        batch.append(entry)
        staged_bytes += copied
        if staged_bytes >= _STAGING_BYTES:
            flush(batch)
            batch, staged_bytes = [], 0
    if batch:
        flush(batch)


def _as_mapping(x: State, role: str) -> Mapping[str, Tensor]:
    if _arrays.is_array(x):
        return {DEFAULT_NAME: x}
    if isinstance(x, Mapping):
        return _arrays.check_state(x, role)
    raise DeltaSyncError(f"{role} must be a tensor, an array or a mapping of them, not {type(x).__name__}")


def check_codec(codec: str, *, values: str = "diff", mirror: bool = False) -> None:
    """Raises unless ``values`` names a value kind (``"diff"`` or ``"abs"``) and ``codec`` a stream family:
    ``"varint"``, ``"compact"`` or ``"context"``. A writer that encodes from a mirror it updates in the same pass
    (``mirror=True``) writes ``"context"`` only with ``values="diff"``: the base's bits of a changed element are then
    its new bits less the difference."""
    if values not in ("diff", "abs"):
        raise DeltaSyncError(f'values must be "diff" or "abs", not {shown(values)}')
    if codec not in ("varint", "compact", "context"):
        raise DeltaSyncError(f'codec must be "varint", "compact" or "context", not {shown(codec)}')
    if codec == "context" and mirror and values != "diff":
        raise DeltaSyncError(
            'codec="context" from a mirror needs values="diff": context positions are coded against the base, '
            "which the mirror no longer holds once updated, and only differences give its changed bits back "
            '(use codec="compact" with values="abs")'
        )


def diff(
    prev: State,
    curr: State,
    *,
    values: str = "diff",
    codec: str = "compact",
    step: int | None = None,
    base_step: int | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Delta:
    """The bit-exact changes from ``prev`` to ``curr``.

    ``prev`` and ``curr`` are each a tensor/array or a mapping (a state_dict) with the same names, dtypes and
    shapes. ``values="diff"`` (the default) stores bit-pattern differences, one byte for most changes;
    ``values="abs"`` stores the new values, which apply to any base and convert to TRL files.

    ``codec="compact"`` (the default) writes the packed layout of format version 2 (one compact record index and
    one stream tensor) with Golomb-Rice positions and bit-packed or entropy-coded values (``rice``, ``diffbits`` or
    ``rans``), chosen per tensor and per stream only where smaller than the varint streams: about half the size of
    ``codec="varint"`` on training steps. ``codec="varint"`` writes byte-aligned streams in the named layout of
    version 1, for readers older than this version.

    ``codec="context"`` (opt-in) is ``"compact"`` with ``context`` positions for BF16, F16 and F32 tensors where
    they are smaller: ranks within classes of each base element's exponent (docs/format.md §5.2), which both ends
    hold, so positions cost about a third less on real training steps. Such a delta decodes only against its exact
    base (checked against the recorded base identity before anything is written): ``apply_`` on CPU and device
    tensors (on a device, checked and placed there by torch ops), ``Subscriber.pull``, ``deltasync apply`` and
    vLLM workers at any tensor parallel size read it; TRL conversion refuses it. ``Publisher``, the mirrors and
    ``attach`` write it too, with ``values="diff"`` (the same bytes), FSDP2 included (rank 0 joins the shards
    against its publisher's whole mirror, ``Publisher.publish_shards``).
    """
    check_codec(codec, values=values)
    prev_map, curr_map = _as_mapping(prev, "prev"), _as_mapping(curr, "curr")
    only_prev = [n for n in prev_map if n not in curr_map]
    only_curr = [n for n in curr_map if n not in prev_map]
    if only_prev or only_curr:
        raise BaseMismatchError(
            f"prev and curr hold different tensors: only in prev {only_prev[:5]}, only in curr {only_curr[:5]}"
        )
    raw = RawDelta()

    def entries():
        for name, new in curr_map.items():
            dtype, shape = _arrays.check_same_kind(prev_map[name], new, name)
            old_bytes, old_copied = _arrays.host_bytes(prev_map[name])
            new_bytes, new_copied = _arrays.host_bytes(new)
            yield (name, dtype, list(shape), old_bytes, new_bytes), old_copied + new_copied

    in_batches(entries(), lambda batch: raw.add_diff(batch, values, codec))
    return _finish(raw, step, base_step, metadata)


def anchor(state: State, *, step: int | None = None, metadata: Mapping[str, str] | None = None) -> Delta:
    """A full snapshot: every tensor stored whole. It applies to any base, and the file is also a plain
    safetensors checkpoint of ``state``."""
    raw = RawDelta()

    def entries():
        for name, tensor in _as_mapping(state, "state").items():
            dtype, shape = _arrays.describe(tensor, name)
            data, copied = _arrays.host_bytes(tensor)
            yield (name, dtype, list(shape), data), copied

    in_batches(entries(), raw.add_full)
    return _finish(raw, step, None, metadata)


def write_anchor_file(
    state: State, path: str | os.PathLike[str], *, step: int | None = None, metadata: Mapping[str, str] | None = None
) -> tuple[int, str, str]:
    """Writes the file ``anchor(state, step=step, metadata=metadata).to_bytes()`` gives (the same bytes) into the
    existing file at ``path``, straight from the tensors' memory: no copy of the state is made (CPU tensors and
    arrays are read in place; others are copied to the host first). Returns the file's size, its SHA-256 (hex) and
    ``state_digest(state)``, all hashed in the same pass as the write. The tensors must not change until this
    returns; the file is not fsynced."""
    size, sha256, digest, _ = write_anchor_pieces(state, path, step=step, metadata=metadata, piece_bytes=0)
    assert sha256 is not None
    return size, sha256, digest


def write_anchor_pieces(
    state: State,
    path: str | os.PathLike[str],
    *,
    piece_bytes: int,
    piece_hash: str = "blake3",
    step: int | None = None,
    metadata: Mapping[str, str] | None = None,
    whole_sha256: bool = True,
    early_writeback: bool = False,
    aliases: Mapping[str, str] | None = None,
) -> tuple[int, str | None, str, bytes]:
    """:func:`write_anchor_file`, also returning the hash (``piece_hash``: "blake3" or "sha256") of each
    ``piece_bytes`` piece of the file (a power of two from 1 KiB to 1 GiB; 0: none), concatenated, 32 bytes each,
    hashed in the same pass (docs/format.md §10). With ``whole_sha256=False`` the file's SHA-256 is not computed
    (None in its place; a pass on one core, the slowest part of the write) and ``piece_bytes`` must not be 0. With
    ``early_writeback=True`` (Linux) the kernel starts writing the file to disk every 64 MiB while the pass goes on,
    so that an fsync right after it finds less left to write; it changes no byte. The file carries its checksum
    (docs/format.md §2.1), as ``to_bytes`` gives it: without the whole-file SHA-256 it is hashed in the same pass and
    its digits are written over their placeholder at the end (the piece that holds them hashed again); with it, it
    is computed from the tensors before the pass (one more read of them, on every core). ``aliases`` are the tied
    names the header carries (``Delta.aliases``)."""
    if not whole_sha256 and not piece_bytes:
        raise DeltaSyncError("an anchor without a whole-file SHA-256 needs pieces (piece_bytes) to be checked by")
    entries = []
    for name, tensor in _as_mapping(state, "state").items():
        dtype, shape = _arrays.describe(tensor, name)
        data, _ = _arrays.host_bytes(tensor)
        entries.append((name, dtype, list(shape), data))
    return _write_anchor(
        os.fspath(path),
        entries,
        _check_step(step, "step"),
        _metadata(metadata or {}),
        piece_bytes,
        piece_hash,
        whole_sha256,
        early_writeback,
        _aliases(aliases or {}),
    )


def state_digest(state: State) -> str:
    """A 128-bit digest (32 hex digits) of a state's names, dtypes, shapes and bytes (docs/format.md §10). Torch
    tensors on a device (CUDA, ...) are hashed there: their bytes are not copied to the host."""
    return state_digest_knowing(_as_mapping(state, "state"), {})


def state_digest_knowing(state: Mapping[str, Tensor], known: Mapping[str, bytes]) -> str:
    """``state_digest``, given ``known``: tensor hashes (``_core.tensor_hashes``) already made from some tensors'
    present bytes, dtype and shape (``Delta._apply``), so that those tensors are not read again."""
    rest = {name: t for name, t in state.items() if name not in known}
    device = {name: t for name, t in rest.items() if _identity.on_device(t)}
    entries = _digest_entries({name: t for name, t in rest.items() if name not in device})
    hashes = dict(zip((entry[0] for entry in entries), _tensor_hashes(entries))) if entries else {}
    hashes.update(_identity.state_hashes(device))
    return _combine_hashes([(name, hashes[name] if name in hashes else known[name]) for name in state])


def _digest_entries(state: Mapping[str, Tensor]) -> list[tuple[str, str, list[int], Any]]:
    entries = []
    for name, tensor in state.items():
        dtype, shape = _arrays.describe(tensor, name)
        data, _ = _arrays.host_bytes(tensor)
        entries.append((name, dtype, list(shape), data))
    return entries


def _check_step(value: int | None, what: str, *, optional: bool = True) -> int | None:
    """``value`` when it is a step number (an integer in [0, 2**64), not a bool), or None where ``optional``; else
    DeltaSyncError naming the argument ``what``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
        allowed = "None or an integer" if optional else "an integer"
        raise DeltaSyncError(f"{what} must be {allowed} in [0, 2**64), not {shown(value)}")
    return value


class _Deferred:
    """A delta whose tensors' encoding waits (``ds.Mirror._advance(..., defer=True)``, ``ds.torch.Mirror._step(...,
    defer=True)``): the mirror moved already; :meth:`complete` encodes the delta from that mirror, which must still
    hold this step (a publisher's upload thread completes it before the next step may move the mirror). The bytes
    are those the mirror's step would have returned at once."""

    def __init__(self, raw: DeferredDelta, step: int | None, base_step: int | None) -> None:
        self._raw = raw
        self.step = step
        self.base_step = base_step

    def complete(self, tensors: Mapping[str, Any]) -> Delta:
        """The delta, from the mirror's ``tensors`` (name -> tensor): the memory it was compared into (checked)."""
        mirrors = [(name, _arrays.host_bytes(tensor)[0]) for name, tensor in tensors.items()]
        return _finish(self._raw.complete(mirrors), self.step, self.base_step, None)


class _Recode:
    """A delta already applied to a publisher's mirror, to be re-encoded in ``codec`` later (its upload thread):
    :meth:`complete` is the delta as ``join_shards`` of it alone encodes it, which needs no mirror."""

    def __init__(self, delta: Delta, codec: str) -> None:
        self._delta = delta
        self._codec = codec

    @property
    def step(self) -> int | None:
        return self._delta.step

    @property
    def base_step(self) -> int | None:
        return self._delta.base_step

    def complete(self, tensors: Mapping[str, Any]) -> Delta:
        from ._core import join_shards

        return Delta(join_shards([self._delta._raw], self._codec))


def _finish(raw: RawDelta, step: int | None, base_step: int | None, metadata: Mapping[str, str] | None) -> Delta:
    raw.step = _check_step(step, "step")
    raw.base_step = _check_step(base_step, "base_step")
    if metadata:
        raw.metadata = _metadata(metadata)
    return Delta(raw)


#: Metadata keys the format itself writes (docs/format.md §2).
_RESERVED_METADATA = ("format", "format_version", "kind", "tensors", "step", "base_step", "file_xxh3", "aliases")


def _string_map(value: Any, what: str, of: str, items: str) -> dict[str, str]:
    """``value`` as a mapping of strings to strings (``what``, a mapping of ``of``), else DeltaSyncError naming the
    key whose ``items`` are not both strings."""
    if not isinstance(value, Mapping):
        raise DeltaSyncError(f"{what} must be a mapping of {of}, not {type(value).__name__}")
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, str):
            raise DeltaSyncError(
                f"{what} {key!r}: {items} must be strings, not {type(key).__name__} and {type(item).__name__}"
            )
    return dict(value)


def _metadata(value: Any) -> dict[str, str]:
    """``value`` as caller metadata: strings to strings, none of the format's own keys; else DeltaSyncError naming
    the key (refused when set, not when the file is written)."""
    metadata = _string_map(value, "metadata", "strings to strings", "keys and values")
    for key in metadata:
        if key in _RESERVED_METADATA:
            raise DeltaSyncError(f"metadata key {key!r} is reserved by the format (docs/format.md §2)")
    return metadata


def _aliases(value: Any) -> dict[str, str]:
    """``value`` as tied names: strings to strings; else DeltaSyncError."""
    return _string_map(value, "aliases", "names to names", "names")


def check_ties(aliases: Mapping[str, str]) -> dict[str, str]:
    """``aliases`` as tied names a file may carry (docs/format.md §2.2, the rules that need no records), else
    DeltaSyncError naming the name: the core's own check, as its writer makes it."""
    ties = _aliases(aliases)
    problem = alias_problem(ties)
    if problem is not None:
        raise DeltaSyncError(problem)
    return ties


def load_stand_in(path: str | os.PathLike[str]) -> Delta:
    """The delta of a stand-in file: an anchor's header, already checked, and zeros where its tensors are, which are
    read by ranges and checked piece by piece (docs/format.md §10). Mapped, every check made but the file's
    checksum (§2.1), which the zeros cannot match."""
    return Delta(RawDelta.map(os.fspath(path), checksum=False))


def load_checked_copy(path: str | os.PathLike[str]) -> Delta:
    """The delta of a private copy of a store's file whose every byte was just checked against its entry (the
    whole-file SHA-256, or every piece against the sidecar): mapped, every check made but the file's checksum
    (docs/format.md §2.1), which would read the whole file once more to check the same bytes less strongly."""
    return Delta(RawDelta.map(os.fspath(path), checksum=False))


def load(source: Source, *, mmap: bool = False, check: str = "load") -> Delta:
    """Reads a delta from a path or from bytes: a deltasync file or a TRL v1/v3 weight patch.
    Everything is validated up front; a bad file raises :class:`DeltaFormatError`.

    With ``mmap=True`` a file is memory-mapped instead of read: tensors stored whole (an anchor's) stay in the file
    and their pages are dropped as ``apply_`` copies them, so applying holds little of the file at a time. The file
    must then not change while the delta lives (a private copy may be unlinked right away).

    ``check="apply"`` is for a file read to be applied at once (what ``Subscriber.pull`` does): the bit-packed
    streams of tensors whose changes are differences (``rice`` positions with ``rans`` or ``diffbits`` values, the
    default codec's) are checked at load only as far as their headers, and in full as ``apply_`` decodes them, so
    they are decoded once instead of twice. A malformed stream still raises :class:`DeltaFormatError` naming the
    tensor, from ``apply_`` (which first takes back every change it wrote: the target is left as it was) or from
    any other method that reads the streams. With ``mmap=True`` every stream is checked at load."""
    if check not in ("load", "apply"):
        raise DeltaSyncError(f'check must be "load" or "apply", not {shown(check)}')
    defer = check == "apply"
    if isinstance(source, (bytes, bytearray, memoryview)):
        return Delta(RawDelta.from_bytes(source, defer_checks=defer))
    if isinstance(source, (str, os.PathLike)):
        if mmap:
            return Delta(RawDelta.map(os.fspath(source)))
        return Delta(RawDelta.load(os.fspath(source), defer_checks=defer))
    raise DeltaSyncError(f"load takes a path or bytes, not {type(source).__name__}")


__all__ = [
    "DEFAULT_NAME",
    "Delta",
    "TensorInfo",
    "anchor",
    "diff",
    "load",
    "state_digest",
    "write_anchor_file",
    "write_anchor_pieces",
]
