"""The one place that writes a delta's changes into targets: CPU memory through the Rust core, other tensors and
arrays through staged torch/numpy writes, and regions of larger parameters (vLLM shards). Everything that can fail
is checked and staged first; only then is anything written."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from . import _arrays
from ._core import DeltaFormatError, DeltaSyncError, RawDelta

_NUMPY_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _torch() -> Any:
    return sys.modules["torch"]  # only reached with a torch target or device, so torch is imported


def int_dtype(width: int) -> Any:
    """The torch integer dtype that holds bit patterns of ``width`` bytes."""
    torch = _torch()
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]


def wrapping_add(old: Any, difference: Any, width: int) -> Any:
    """``old + difference`` modulo 2**(8*width) on torch integer tensors, exact on every backend."""
    torch = _torch()
    if width == 8:
        return old + difference  # int64 addition wraps in two's complement
    wide = {1: torch.int16, 2: torch.int32, 4: torch.int64}[width]
    bits = 8 * width
    total = (old.to(wide) + difference.to(wide)) & ((1 << bits) - 1)
    if width > 1:
        total = torch.where(total >= (1 << (bits - 1)), total - (1 << bits), total)
    return total.to(old.dtype)


def new_bits(raw: RawDelta, index: int, old: Any, values: Any, width: int) -> Any:
    """The new bit patterns of the changed elements, given their ``old`` bit patterns: the values themselves, or
    old plus the values, as the core's metadata for tensor ``index`` says. Every staged write goes through here."""
    if not raw.holds_differences(index):
        return values
    if isinstance(values, np.ndarray):
        return old + values  # unsigned numpy arithmetic wraps modulo 2**bits
    return wrapping_add(old, values, width)


def is_dense(raw: RawDelta, index: int) -> bool:
    """Stored whole as new bits: the core decodes such a tensor to its data alone, without positions."""
    return raw.tensor_info(index)[4] == "all" and not raw.holds_differences(index)


def needs_base(raw: RawDelta, index: int) -> bool:
    """True when tensor ``index``'s positions decode only against its base (``context``, docs/format.md §5.2)
    and it has changes to decode (one without writes nothing, as in every other codec)."""
    info = raw.tensor_info(index)
    return info[4] == "context" and int(info[3]) > 0


def decode(
    raw: RawDelta, index: int, *, device: Any = None, base: Any = None, base_checked: bool = False
) -> tuple[Any, Any]:
    """Tensor ``index``'s changes decoded on the CPU and moved to ``device`` (a torch device) in one transfer.

    A tensor with ``context`` positions is decoded against ``base``, the tensor before the change (any tensor or
    array), checked first against the recorded base identity: on the host by the core, or where ``base`` is a torch
    tensor on another device, there, by torch ops (its classes too; :func:`_context_on_device`), unless the caller
    says it has checked it (``base_checked``, :func:`check_bases`).

    Returns ``(positions, values)``: int64 flat row-major positions (``None`` for a tensor stored whole as new
    bits, whose values are then every element in order), and the values as the torch integer type of the element
    width, holding bit patterns: new bits or differences, as :func:`new_bits` applies them."""
    torch = _torch()
    info = raw.tensor_info(index)
    width, changed = _arrays.WIDTHS[info[1]], int(info[3])
    if changed == 0:
        return torch.empty(0, dtype=torch.int64, device=device), torch.empty(0, dtype=int_dtype(width), device=device)
    if base is not None and info[4] == "context" and _on_device(base):
        positions, values = _context_on_device(raw, index, base, base_checked)
        return positions.to(device), values.to(device)
    host_base = None
    if base is not None and info[4] == "context":
        host_base = _arrays.host_bytes(base)[0]
    staged = torch.frombuffer(raw.decode(index, host_base), dtype=torch.uint8)
    if device is not None:
        staged = staged.to(device)
    if is_dense(raw, index):
        return None, staged.view(int_dtype(width))
    return staged[: changed * 8].view(torch.int64), staged[changed * 8 :].view(int_dtype(width))


def _on_device(x: Any) -> bool:
    """A torch tensor outside the host's memory (CUDA, ...)."""
    return _arrays.is_torch(x) and not x.is_cpu


def check_bases(raw: RawDelta, targets: list[tuple[int, Any]]) -> None:
    """BaseMismatchError unless each ``(index, target)`` holds the base recorded for tensor ``index`` (those that
    record none are skipped). Host targets are hashed by the core; torch tensors on another device there, together
    (deltasync_rs._identity: only block hashes and the bytes after the last whole 256 KiB block reach the host)."""
    from . import _identity

    host, device = [], []
    for index, target in targets:
        if raw.base_identity(index) is None:
            continue
        if _on_device(target):
            device.append((index, target))
        else:
            host.append((index, _arrays.host_bytes(target)[0]))
    if device:
        found = _identity.base_identities([target for _, target in device])
        raw.check_identities([(index, identity) for (index, _), identity in zip(device, found)])
    if host:
        raw.check_base(host)


def _context_on_device(raw: RawDelta, index: int, base: Any, checked: bool) -> tuple[Any, Any]:
    """Tensor ``index``'s ``context`` changes placed against ``base``, a whole tensor on a device, with torch ops
    there: its identity checked first (unless ``checked``), then its classes counted and the changes placed as a
    reader holding all of it (deltasync_rs._context, one run); positions and values on ``base``'s device."""
    from . import _context

    name, dtype = raw.tensor_info(index)[:2]
    if raw.base_identity(index) is None:
        raise DeltaFormatError(f"tensor {name!r}: 'context' positions without a base identity")
    if not checked:
        check_bases(raw, [(index, base)])
    bits = base.detach().reshape(1, -1).view(int_dtype(_arrays.WIDTHS[dtype]))
    whole = _context.Slice(raw, index, bits, 0, 0, bits.shape[1], walk="torch")
    return whole.place([whole.held])


def _hf_rows_cols(region: Region) -> tuple[int, int]:
    """The region's tensor viewed as ``[rows, cols]`` (a vector as one column)."""
    rows = region.hf_shape[0] if region.hf_shape else 1
    return rows, region.hf_shape[1] if len(region.hf_shape) == 2 else 1


def _covers_all(region: Region) -> bool:
    rows, cols = _hf_rows_cols(region)
    return region.row_start == 0 and region.row_count == rows and region.col_start == 0 and region.col_count == cols


def param_cols(param: Any) -> int:
    """The columns of a parameter viewed as ``[rows, cols]`` (a vector as one column)."""
    return param.shape[1] if param.dim() == 2 else 1


def _region_block(region: Region, width: int) -> Any:
    """The region's elements in its (contiguous) parameter as a ``[row_count, col_count]`` view of bit patterns."""
    param = region.param.data
    grid = param.view(int_dtype(width)).view(-1, param_cols(param))
    return grid[region.param_row_offset : region.param_row_offset + region.row_count, : region.col_count]


def _extent(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, bool]:
    """(elements spanned from the lowest element, whether no two elements can share memory). The second is proven
    by sorting dimensions by stride: each stride must pass the span of all smaller ones."""
    if any(size == 0 for size in shape):
        return 0, True
    span, disjoint = 1, True
    for size, stride in sorted(((n, abs(s)) for n, s in zip(shape, strides) if n > 1), key=lambda d: d[1]):
        if stride < span:
            disjoint = False
        span = max(span, stride * (size - 1) + 1)
    return span, disjoint


@dataclass
class _Memory:
    """One target and the memory it spans, for the overlap check."""

    index: int
    target: Any
    device: str
    start: int
    end: int
    layout: tuple[Any, ...]


class Region(Protocol):
    """This rank's slice of a tensor inside a larger parameter (``deltasync_rs.vllm.ShardMap`` is one)."""

    @property
    def param(self) -> Any: ...
    @property
    def hf_shape(self) -> tuple[int, ...]: ...
    @property
    def row_start(self) -> int: ...
    @property
    def row_count(self) -> int: ...
    @property
    def col_start(self) -> int: ...
    @property
    def col_count(self) -> int: ...
    @property
    def param_row_offset(self) -> int: ...


class Writes:
    """Stages the changes of one delta into any mix of targets, then writes them all with :meth:`commit`.

    :meth:`add_all` checks every target's dtype and shape, refuses targets that cannot be written (read-only arrays,
    expanded or self-overlapping views, meta and sparse tensors), optionally checks the base identity, then decodes,
    gathers on each target's device and computes the new bits; nothing is written before :meth:`commit`. Targets
    that are the same memory (tied weights) are written once, when their changes agree; any other overlap is
    refused. :meth:`commit` writes contiguous CPU memory through the core and the rest with torch/numpy index
    writes, and moves autograd's version counter of every torch tensor it writes, as torch's in-place ops do."""

    def __init__(self, raw: RawDelta) -> None:
        self._raw = raw
        self.infos = raw.tensors()
        self._in_core: list[tuple[int, Any]] = []
        self._core_tensors: list[Any] = []  # torch tensors the core writes, for their version counters
        self._staged: list[Callable[[], object]] = []
        self._check_in_core = False  # the core checks the base of the targets it writes (add_all's check_base)
        self._context: dict[int, Any] = {}  # context tensors held in part: their _context.Slice
        self._base_checked: set[int] = set()  # tensors whose device target's base identity is checked
        self.elements = 0  # elements staged for writing

    def _name(self, index: int) -> str:
        return self.infos[index][0]

    def _width(self, index: int) -> int:
        return _arrays.WIDTHS[self.infos[index][1]]

    def _changed(self, index: int) -> int:
        return int(self.infos[index][3])

    # -- whole targets ------------------------------------------------------------------------------------------------
    def add_all(self, targets: list[tuple[int, Any]], *, check_base: bool = False) -> None:
        """Stages tensor ``index`` into ``target`` for each pair: torch tensors or numpy arrays of the tensor's
        dtype and shape. Everything is checked before anything is staged. With ``check_base`` each target must
        hold the exact base recorded for its tensor (docs/format.md §3, ``base``), else BaseMismatchError."""
        described = []
        for index, target in targets:
            name = self._name(index)
            dtype, shape = _arrays.describe(target, name)
            self._raw.check_target(index, dtype, list(shape))
            described.append(self._memory(index, target, name))
        kept, aliases = self._without_aliases(described)
        in_core = [self._changed(m.index) > 0 and self._writable_in_core(m.target) for m in kept]
        if check_base:
            # The core checks its own targets as it writes them (commit); the others are checked here, first, and
            # so is every name of a tied target that is not written (its record may name another base).
            self._check_base([memory for memory, core in zip(kept, in_core) if not core] + aliases)
            self._check_in_core = True
        else:
            self.check_context_bases([(m.index, m.target) for m, core in zip(kept, in_core) if not core])
        for memory, core in zip(kept, in_core):
            index, target = memory.index, memory.target
            changed = self._changed(index)
            self.elements += changed
            if changed == 0:
                continue
            if core and _arrays.is_torch(target):
                self._in_core.append((index, target))
                self._core_tensors.append(target)
            elif core:
                self._in_core.append((index, target.reshape(-1).view(np.uint8)))
            elif _arrays.is_torch(target):
                self._staged.append(self._stage_torch(index, target))
            else:
                self._staged.append(self._stage_numpy(index, target))

    @staticmethod
    def _writable_in_core(target: Any) -> bool:
        """True when the core writes ``target`` through its memory: a contiguous CPU tensor or array."""
        if _arrays.is_torch(target):
            return bool(_arrays.readable_in_place(target))
        return bool(target.flags.c_contiguous)

    def _memory(self, index: int, target: Any, name: str) -> _Memory:
        """The target's memory extent, after refusing targets that cannot be written."""
        if _arrays.is_torch(target):
            torch = _torch()
            if target.layout != torch.strided:
                raise DeltaSyncError(f"target of tensor {name!r}: {target.layout} tensors cannot be written in place")
            if target.is_meta:
                raise DeltaSyncError(f"target of tensor {name!r}: a meta tensor has no data to write")
            if target.is_neg() or target.is_conj():
                # Its memory holds other values than it shows (torch negates or conjugates them as it reads).
                raise DeltaSyncError(
                    f"target of tensor {name!r}: a view with torch's lazy negation or conjugation bit cannot be "
                    "written in place; write into a tensor of its own (resolve_neg() / resolve_conj())"
                )
            shape, strides = tuple(target.shape), target.stride()
            if target.is_contiguous():  # the usual target, and the cheap case at 100k tensors
                span, disjoint = target.numel(), True
            else:
                span, disjoint = _extent(shape, strides)
            start, itemsize = _arrays.address(target), target.element_size()
            layout: tuple[Any, ...] = (target.dtype, shape, strides)
            device = str(target.device)
        else:
            if not target.flags.writeable:
                raise DeltaSyncError(f"target of tensor {name!r} is a read-only array")
            itemsize = max(1, target.itemsize)
            if any(stride % itemsize for stride in target.strides):
                raise DeltaSyncError(f"target of tensor {name!r}: its strides are not whole elements")
            span, disjoint = _extent(target.shape, tuple(stride // itemsize for stride in target.strides))
            start = _arrays.address(target)
            start += sum(min(0, (n - 1) * stride) for n, stride in zip(target.shape, target.strides) if n)
            layout = (target.dtype, target.shape, target.strides)
            device = "cpu"
        if not disjoint:
            raise DeltaSyncError(
                f"target of tensor {name!r}: several of its elements share memory (an expanded, "
                "broadcast or overlapping view); write into a tensor that owns its elements"
            )
        return _Memory(index, target, device, start, start + span * itemsize, layout)

    def _without_aliases(self, targets: list[_Memory]) -> tuple[list[_Memory], list[_Memory]]:
        """Targets that are one memory with one layout (tied weights) are written once, when their changes agree;
        any other overlap is refused. Returns the targets to write and the other names of tied ones. One sort and
        one sweep, so 100k tensors cost milliseconds, not minutes."""
        aliases: set[int] = set()
        ordered = sorted((t for t in targets if t.end > t.start), key=lambda t: (t.device, t.start, -t.end))
        reach: _Memory | None = None  # the target reaching furthest so far on this device
        for memory in ordered:
            if reach is not None and reach.device == memory.device and memory.start < reach.end:
                if (reach.start, reach.end, reach.layout) != (memory.start, memory.end, memory.layout):
                    raise DeltaSyncError(
                        f"targets of tensors {self._name(reach.index)!r} and "
                        f"{self._name(memory.index)!r} overlap in memory"
                    )
                if not self._raw.same_changes(reach.index, memory.index):
                    raise DeltaSyncError(
                        f"tensors {self._name(reach.index)!r} and {self._name(memory.index)!r} "
                        "share memory in the target but the delta changes them differently"
                    )
                aliases.add(id(memory))
                continue
            if reach is None or reach.device != memory.device or memory.end > reach.end:
                reach = memory
        return [t for t in targets if id(t) not in aliases], [t for t in targets if id(t) in aliases]

    def _check_base(self, targets: list[_Memory]) -> None:
        """Every target holds the base its tensor was diffed against (its base identity: computed by the core for
        CPU memory and numpy arrays, by torch ops on the target's device for any other device)."""
        self.check_bases([(memory.index, memory.target) for memory in targets])

    def check_bases(self, targets: list[tuple[int, Any]]) -> None:
        """:func:`check_bases`, remembering which device targets it checked (their decode does not check again)."""
        check_bases(self._raw, targets)
        self._base_checked.update(index for index, target in targets if _on_device(target))

    def check_context_bases(self, targets: list[tuple[int, Any]], *, on_host: bool = False) -> None:
        """Of ``(index, whole target)`` pairs, checks those a ``context`` tensor decodes against on a device, all
        together, before anything is staged: such a base is always checked, with or without ``check_base``. The
        core checks a host target's as it writes it, unless ``on_host``: then here too (ranks that must agree on
        a refusal before any of them writes)."""
        self.check_bases([(i, t) for i, t in targets if (on_host or _on_device(t)) and needs_base(self._raw, i)])

    def _stage_torch(self, index: int, target: Any) -> Callable[[], object]:
        torch = _torch()
        width = self._width(index)
        view = target.detach().view(int_dtype(width))
        positions, values = decode(
            self._raw, index, device=view.device, base=target.detach(), base_checked=index in self._base_checked
        )
        if positions is None:
            new = values.view(view.shape)
            write: Callable[[], object] = lambda: view.copy_(new)  # noqa: E731
        elif view.is_contiguous():
            flat = view.view(-1)
            new = new_bits(self._raw, index, flat.index_select(0, positions), values, width)
            write = lambda: flat.index_copy_(0, positions, new)  # noqa: E731
        else:
            coordinates = torch.unravel_index(positions, tuple(view.shape))
            new = new_bits(self._raw, index, view[coordinates], values, width)
            write = lambda: view.index_put_(coordinates, new)  # noqa: E731
        if not target.is_inference():
            return write

        def write_inference() -> None:
            with torch.inference_mode():  # in-place writes to inference tensors are allowed only there
                write()

        return write_inference

    def _stage_numpy(self, index: int, target: np.ndarray) -> Callable[[], object]:
        width = self._width(index)
        view = target.view(_NUMPY_UINT[width])
        base = _arrays.host_bytes(target)[0] if needs_base(self._raw, index) else None
        decoded = np.frombuffer(self._raw.decode(index, base), dtype=np.uint8)
        if is_dense(self._raw, index):
            whole = decoded.view(f"<u{width}").astype(_NUMPY_UINT[width]).reshape(target.shape)
            return lambda: np.copyto(view, whole)
        changed = self._changed(index)
        positions = decoded[: changed * 8].view("<i8")
        values = decoded[changed * 8 :].view(f"<u{width}").astype(_NUMPY_UINT[width])
        coordinates = np.unravel_index(positions, target.shape)
        new = new_bits(self._raw, index, view[coordinates], values, width)

        def write() -> None:
            view[coordinates] = new

        return write

    # -- regions of larger parameters (vLLM) ----------------------------------------------------------------------
    def context_sharded(self, index: int, region: Region) -> bool:
        """True when tensor ``index`` has ``context`` positions and ``region`` is only part of it: its changes are
        placed with what every rank holds (:meth:`context_held`, exchanged by the caller; deltasync_rs._context)."""
        return needs_base(self._raw, index) and self._changed(index) > 0 and not _covers_all(region)

    def context_held(self, index: int, region: Region) -> Any:
        """What this rank holds of ``context`` tensor ``index`` (a ``_context.Held``), for the other ranks: how many
        elements of each class its slice's runs hold, counted where the parameter is (the slice is kept for
        :meth:`add_region`)."""
        return self._context_slice(index, region).held

    def _context_slice(self, index: int, region: Region) -> Any:
        from . import _context

        if index not in self._context:
            block = _region_block(region, self._width(index))
            cols = _hf_rows_cols(region)[1]
            self._context[index] = _context.Slice(self._raw, index, block, region.row_start, region.col_start, cols)
        return self._context[index]

    def add_region(self, index: int, region: Region, everyone: list[Any] | None = None) -> None:
        """Stages tensor ``index`` (in its own coordinates, viewed as ``[rows, cols]``) into this rank's slice of a
        larger parameter: rows ``row_start ..+ row_count`` and columns ``col_start ..+ col_count`` land at
        parameter row ``param_row_offset + i``, column ``j``. The caller checks that regions do not collide.
        A ``context`` tensor held in part (:meth:`context_sharded`) needs ``everyone``: every rank's
        :meth:`context_held`, this rank's included, in any order."""
        torch = _torch()
        width = self._width(index)
        param = region.param.data
        if not param.is_contiguous():
            raise DeltaSyncError(f"tensor {self._name(index)!r}: the target parameter is not contiguous")
        hf_rows, hf_cols = _hf_rows_cols(region)
        stride = param_cols(param)  # elements per parameter row
        covers_all = _covers_all(region)
        changed = self._changed(index)
        if changed == 0:
            return
        if self.context_sharded(index, region):
            self._add_context_part(index, region, everyone)
            return
        if covers_all and not _on_device(param):
            # The whole tensor is one contiguous run of this CPU parameter: the core writes into it directly.
            start = region.param_row_offset * stride
            self._in_core.append((index, param.view(-1)[start : start + hf_rows * hf_cols]))
            self._core_tensors.append(region.param)
            self.elements += changed
            return
        flat = param.view(int_dtype(width)).view(-1)
        base = None
        if needs_base(self._raw, index):
            start = region.param_row_offset * stride
            base = param.view(-1)[start : start + hf_rows * hf_cols]
        positions, values = decode(
            self._raw, index, device=param.device, base=base, base_checked=index in self._base_checked
        )
        if positions is None:
            positions = torch.arange(hf_rows * hf_cols, device=param.device)
        if covers_all:
            positions = positions + region.param_row_offset * stride
        else:
            rows = torch.div(positions, hf_cols, rounding_mode="floor")
            cols = positions - rows * hf_cols
            keep = (
                (rows >= region.row_start)
                & (rows < region.row_start + region.row_count)
                & (cols >= region.col_start)
                & (cols < region.col_start + region.col_count)
            )
            positions = (
                (rows[keep] - region.row_start + region.param_row_offset) * stride + cols[keep] - region.col_start
            )
            values = values[keep]
        new = new_bits(self._raw, index, flat.index_select(0, positions), values, width)
        self.elements += int(positions.numel())
        self._staged.append(lambda: flat.index_copy_(0, positions, new))

    def _add_context_part(self, index: int, region: Region, everyone: list[Any] | None) -> None:
        if everyone is None:
            raise DeltaSyncError(
                f"tensor {self._name(index)!r} has 'context' positions (codec=\"context\") and this worker holds "
                f"rows {region.row_start}..{region.row_start + region.row_count} and columns "
                f"{region.col_start}..{region.col_start + region.col_count} of its {tuple(region.hf_shape)}: "
                "placing its changes needs what every worker holds, which was not exchanged"
            )
        positions, values = self._context_slice(index, region).place(everyone)
        block = _region_block(region, self._width(index))
        rows = _torch().div(positions, block.shape[1], rounding_mode="floor")
        cols = positions - rows * block.shape[1]
        new = new_bits(self._raw, index, block[rows, cols], values, self._width(index))
        self.elements += int(positions.numel())
        self._staged.append(lambda: block.index_put_((rows, cols), new))

    # -- writing ----------------------------------------------------------------------------------------------------
    def commit(self, *, digest: bool = False) -> dict[int, bytes]:
        """Writes everything staged: the core's targets first, then the staged index writes.

        With ``digest`` (and ``add_all``'s ``check_base``), returns, by tensor index, the state-digest hash
        (``_core.tensor_hashes``) of the targets the core hashed while writing them, taken after the write; other
        targets are not in it."""
        hashes: dict[int, bytes] = {}
        if self._in_core:
            hashes = dict(self._raw.apply(self._in_core, check_base=self._check_in_core, digest=digest))
        torch = sys.modules.get("torch")
        if torch is None:
            for write in self._staged:
                write()
            return hashes
        with torch.no_grad():
            for write in self._staged:
                write()
        # Writes through memory (the core) are invisible to autograd: a graph that saved one of these tensors must
        # see that it changed, as after any in-place op (torch's own index writes move the counter themselves).
        for tensor in self._core_tensors:
            if not tensor.is_inference():
                torch.autograd.graph.increment_version(tensor)
        return hashes
