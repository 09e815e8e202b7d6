"""torch glue on the trainer side: the Mirror (pipelined device-to-CPU copy into the one-pass core compare) and the
optimizer hook that publishes through it. Writing deltas into tensors lives in _write.py."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from . import _arrays
from ._core import BaseMismatchError, DeltaSyncError, MirrorDiff
from .delta import Delta, _check_step, _Deferred, _finish, check_codec
from .errors import at_least_one, flag

log = logging.getLogger("deltasync_rs.sync")


def _named_tensors(source: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(source, torch.nn.Module):
        return dict(source.state_dict())
    if isinstance(source, Mapping):
        return dict(source)
    raise DeltaSyncError(f"Mirror takes a torch.nn.Module or a mapping of tensors, not {type(source).__name__}")


def _tensor_objects(source: Any) -> dict[str, int]:
    """A model's parameter and buffer names, each with the id of its tensor object (tied names share one)."""
    if not isinstance(source, torch.nn.Module):
        return {}
    named = [*source.named_parameters(remove_duplicate=False), *source.named_buffers(remove_duplicate=False)]
    # Under torch's checkpoint_wrapper the state dict's names leave out the wrapper's module, as here.
    return {name.replace("_checkpoint_wrapped_module.", ""): id(tensor) for name, tensor in named}


def _refuse_fsdp1(source: Any) -> None:
    """FSDP1 (``FullyShardedDataParallel``) is refused: its state dict is a collective every rank must enter (which a
    mirror on one rank never is) or holds ShardedTensors, and its parameters are views of flat shards. FSDP2
    (``fully_shard``: DTensor parameters) is supported."""
    if not isinstance(source, torch.nn.Module):
        return
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # torch built without distributed
        return
    if any(isinstance(m, FullyShardedDataParallel) for m in source.modules()) or any(
        getattr(p, "_fsdp_flattened", False) for p in source.parameters()
    ):
        raise DeltaSyncError(
            f"{type(source).__name__} is sharded by FSDP1 (FullyShardedDataParallel), which deltasync does not take: "
            "shard it with FSDP2 (torch.distributed.fsdp.fully_shard; in transformers/accelerate, fsdp_version 2) "
            "and call this on every rank"
        )


def _dtensor_type() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def _local_part(name: str, tensor: torch.Tensor) -> tuple[torch.Tensor | None, int | None]:
    """For a DTensor: this rank's local tensor and the flat offset of its elements in the whole tensor, or
    (None, None) when another rank ships it (a replicated tensor is shipped by the mesh's first rank). For a plain
    tensor: (tensor, None). FSDP2 shards dim 0 in ``torch.chunk`` pieces, so a local shard is one contiguous flat
    range; ``to_local()`` drops FSDP2's padding, which the check on the row count confirms."""
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(tensor, dtensor):
        return tensor, None
    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    local = tensor.to_local()
    if mesh.ndim != 1 or len(placements) != 1:
        raise DeltaSyncError(f"tensor {name!r}: only one-dimensional meshes are supported, not {placements}")
    placement, rank, world = placements[0], mesh.get_local_rank(), mesh.size()
    if placement.is_replicate():
        return (local, None) if rank == 0 else (None, None)
    if not placement.is_shard(0):
        raise DeltaSyncError(f"tensor {name!r}: only Shard(0) and Replicate placements are supported, not {placements}")
    rows = tensor.shape[0]
    per_rank = -(-rows // world)
    first_row = min(rank * per_rank, rows)
    if local.shape[0] != min(per_rank, rows - first_row) or tuple(local.shape[1:]) != tuple(tensor.shape[1:]):
        raise DeltaSyncError(
            f"tensor {name!r}: local shard {list(local.shape)} on rank {rank} of {world} is not "
            f"the dim-0 chunk of {list(tensor.shape)}"
        )
    return local, first_row * (tensor.numel() // rows if rows else 0)


def _rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _memory_key(tensor: torch.Tensor, name: str) -> tuple[Any, ...]:
    try:
        address = tensor.untyped_storage().data_ptr()
    except RuntimeError as error:  # a wrapper subclass (a quantized weight) without storage of its own
        raise DeltaSyncError(
            f"tensor {name!r}: a {type(tensor).__name__} without storage of its own cannot be mirrored ({error})"
        ) from None
    return (
        tensor.device,
        address,
        tensor.storage_offset(),
        tensor.dtype,
        tuple(tensor.shape),
        tuple(tensor.stride()),
    )


def _unwrapped(model: Any) -> Any:
    """The module whose names the weights go by, under the wrappers that prefix them: torch.compile's
    (``_orig_mod.``) and DDP's or DataParallel's (``module.``). An engine or a state dict of the plain model knows
    the weights by the plain names (TRL strips them too)."""
    while isinstance(model, torch.nn.Module):
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and isinstance(
            getattr(model, "_orig_mod", None), torch.nn.Module
        ):
            model = model._orig_mod
        else:
            break
    return model


def shipped_dtype(dtype: torch.dtype, shipped: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` is shipped as when floating-point weights ship as ``shipped``: fp32 (or
    fp16, fp64) masters cast to it; fp8 weights in the formats files hold (float8_e4m3fn, float8_e5m2: an fp8
    checkpoint's quantized layers), integers and bools keep their own, as ``deltasync publish --dtype`` keeps them
    (an engine serving fp8 weights takes fp8 only); other 1-byte floats are cast, as before."""
    kept = str(dtype) in _arrays._TORCH_NAMES and dtype.itemsize == 1
    return shipped if dtype.is_floating_point and not kept else dtype


class Mirror:
    """A CPU copy of a model's weights in the shipped dtype, moved forward one step at a time.

    ``step()`` streams each tensor in chunks of ``chunk_bytes``: cast to the shipped dtype on the tensor's device,
    copy into a (pinned) staging buffer, and let the core compare the chunk with the mirror, recording the changes
    and writing the new bits into the mirror in the same pass. On CUDA two staging buffers alternate, so the copy of
    chunk k+1 runs while the core scans chunk k. Floating-point tensors are shipped as ``dtype`` (fp32 masters are
    cast on the device, before the copy); fp8 and other tensors keep their dtype (``shipped_dtype``). Tensors that
    share memory (tied weights) are mirrored once, under their first name; ``aliases`` maps the other names to it.
    ``step()``'s delta names such a tensor under every name, as ``ds.diff`` of the state dict does; a publisher
    sharing the mirror (``attach``) ships it once and lists the other names in its manifest entries. ``values`` and
    ``codec`` are as for :func:`deltasync_rs.diff`, whose bytes ``step()`` writes; a shard keeps ``varint`` streams.

    Memory: the mirror, at most two staging buffers of ``chunk_bytes`` (none on CPU when no cast is needed, since
    the core then reads the weights in place), one cast chunk on the device, and the delta.
    """

    def __init__(
        self,
        model: torch.nn.Module | Mapping[str, torch.Tensor],
        dtype: torch.dtype = torch.bfloat16,
        *,
        chunk_bytes: int = 64 << 20,
        values: str = "diff",
        codec: str = "compact",
        step: int | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise DeltaSyncError(f"the shipped dtype must be a floating-point torch.dtype, not {dtype!r}")
        if at_least_one(chunk_bytes, "chunk_bytes") < 64:
            raise DeltaSyncError(f"chunk_bytes must be at least 64, not {chunk_bytes}")
        check_codec(codec, values=values, mirror=True)
        model = _unwrapped(model)
        self._source = model
        self.dtype = dtype
        self.chunk_bytes = chunk_bytes
        self.values = values
        self.codec = codec
        self.current_step = _check_step(step, "step")
        #: For a sharded mirror, after each ``step()``: (name, first element, elements, base identity) of each shard,
        #: what this mirror held over that range of the whole tensor before the step (hashed by the step's own
        #: scan), for the rank that joins the shards to check against the state it published
        #: (``Publisher.publish_shards``' ``proofs``).
        self.last_bases: list[tuple[str, int, int, str]] = []
        self._pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._staging: list[torch.Tensor] = []
        self.aliases: dict[str, str] = {}
        self._tensors: dict[str, torch.Tensor] = {}
        self._bytes: dict[str, Any] = {}  # flat uint8 views of the mirror tensors, for the core
        first_by_memory: dict[tuple[Any, ...], str] = {}
        self._shards: dict[str, tuple[tuple[int, ...], int]] = {}  # name -> (whole shape, flat offset)
        dtensor = _dtensor_type()
        plain: list[str] = []  # not DTensors: with sharded tensors beside them, every rank holds its own copy
        _refuse_fsdp1(model)
        named = _named_tensors(model)
        # Every name of the source, mirrored or not (tied names, other ranks' tensors): a name that turns up later
        # is one the mirror would never ship (_live).
        self._names = frozenset(named)
        # Tied names are one parameter object of the model (one tensor object of a mapping), even where this rank's
        # shard of it is empty and has no memory to tell by: every rank must ship the same names.
        objects = _tensor_objects(model)
        first_by_object: dict[int, str] = {}
        for name, whole in named.items():
            if not isinstance(whole, torch.Tensor):
                raise DeltaSyncError(f"tensor {name!r}: expected a torch.Tensor, got {type(whole).__name__}")
            tensor, offset = _local_part(name, whole)
            if tensor is None:
                continue
            identity = objects.get(name, id(whole))
            if identity in first_by_object:
                self.aliases[name] = first_by_object[identity]
                continue
            first_by_object[identity] = name
            _arrays.describe(tensor, name)  # a dtype, layout (sparse) or meta tensor the mirror cannot hold
            if dtensor is None or not isinstance(whole, dtensor):
                plain.append(name)
            if offset is not None:
                self._shards[name] = (tuple(whole.shape), offset)
            key = _memory_key(tensor, name)
            if tensor.numel() and key in first_by_memory:
                self.aliases[name] = first_by_memory[key]
                continue
            first_by_memory[key] = name
            shipped = self._shipped_dtype(tensor)
            mirror = torch.empty(tuple(tensor.shape), dtype=shipped, pin_memory=self._pin)
            flat = mirror.view(-1)
            for start, end, chunk in self._device_chunks(tensor, shipped):
                flat[start:end].copy_(chunk)
            self._tensors[name] = mirror
            self._bytes[name] = flat.view(torch.uint8)  # sliced by byte offsets; the core writes it in place
        self._plain = frozenset(plain)  # the names that were not DTensors (checked at every step: _live)
        if self._shards and plain and _rank() != 0:
            # Plain tensors of a sharded model (FSDP2 leaves buffers such as running statistics as they are) are
            # each rank's own, and may differ between ranks: rank 0's are shipped, as torch.save on rank 0 would
            # keep them (every rank shipping its own would give one tensor several times over).
            for name in plain:
                self._tensors.pop(name, None)
                self._bytes.pop(name, None)
            self.aliases = {name: first for name, first in self.aliases.items() if first in self._tensors}

    def _shipped_dtype(self, tensor: torch.Tensor) -> torch.dtype:
        return shipped_dtype(tensor.dtype, self.dtype)

    def _device_chunks(self, tensor: torch.Tensor, shipped: torch.dtype):
        """(start, end, chunk) over the flat tensor: each chunk cast to ``shipped`` on the tensor's own device."""
        flat = tensor.detach().reshape(-1)  # a view when contiguous; one copy on the device otherwise
        elements = max(1, self.chunk_bytes // torch.empty(0, dtype=shipped).element_size())
        for start in range(0, flat.numel(), elements):
            end = min(start + elements, flat.numel())
            yield start, end, flat[start:end].to(shipped)

    @property
    def is_sharded(self) -> bool:
        """True when some tensors are DTensor shards: the mirror then holds this rank's part of them."""
        return bool(self._shards)

    @property
    def shards(self) -> dict[str, tuple[tuple[int, ...], int]]:
        """Sharded tensors: name -> (shape of the whole tensor, flat offset of this rank's elements in it)."""
        return dict(self._shards)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The mirrored tensors, one per memory (read them, don't write them)."""
        return self._tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every name of the source, tied names viewing their first name's mirror."""
        out = dict(self._tensors)
        out.update({alias: self._tensors[first] for alias, first in self.aliases.items()})
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    @property
    def staging_nbytes(self) -> int:
        """Bytes of staging buffers allocated so far (0, 1 or 2 of ``chunk_bytes``)."""
        return sum(t.numel() for t in self._staging)

    def digest(self) -> str:
        from .delta import state_digest

        return state_digest(self._tensors)

    def _staging_buffer(self, index: int) -> torch.Tensor:
        while len(self._staging) <= index:
            self._staging.append(torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self._pin))
        return self._staging[index]

    def _live(self) -> dict[str, torch.Tensor]:
        current = _named_tensors(self._source)
        missing = [name for name in self._tensors if name not in current]
        if missing:
            raise DeltaSyncError(f"tensors {missing[:5]} of the mirror are gone from the model")
        new = [name for name in current if name not in self._names]
        if new:
            raise DeltaSyncError(
                f"tensors {new[:5]} are new in the model since the mirror was made: it would never ship them; "
                "make a new mirror (attach again) after changing the model's tensors"
            )
        for alias, first in self.aliases.items():
            # Shipped once, under the first name: that holds only while both still share memory.
            mine = _local_part(alias, current[alias])[0] if alias in current else None
            theirs = _local_part(first, current[first])[0]
            if mine is None or theirs is None or _memory_key(mine, alias) != _memory_key(theirs, first):
                raise DeltaSyncError(
                    f"tensor {alias!r} no longer shares memory with {first!r} (tied when the mirror was made, "
                    "shipped as one): make a new mirror (attach again) after untying them"
                )
        dtensor = _dtensor_type()
        for name, mirror in self._tensors.items():
            if dtensor is not None and isinstance(current[name], dtensor) == (name in self._plain):
                raise DeltaSyncError(
                    f"tensor {name!r} is {'now' if name in self._plain else 'no longer'} a DTensor (sharded or "
                    "replicated over a device mesh) since the mirror was made: make a new mirror (attach again) "
                    "after sharding the model"
                )
            if name in self._shards:
                continue  # checked against the recorded sharding in _local, shape by shape
            if tuple(current[name].shape) != tuple(mirror.shape) or self._shipped_dtype(current[name]) != mirror.dtype:
                raise DeltaSyncError(
                    f"tensor {name!r}: the model now holds {current[name].dtype}{list(current[name].shape)}, "
                    f"the mirror {mirror.dtype}{list(mirror.shape)}"
                )
        live = {name: self._local(name, current[name]) for name in self._tensors}
        for name, tensor in live.items():
            # Checked before anything moves: the step copies tensor by tensor, so one that cannot be read found
            # part way would leave the mirror holding the new bits of the tensors before it.
            if tensor.is_meta or tensor.layout != torch.strided:
                kind = "a meta tensor" if tensor.is_meta else f"a {tensor.layout} tensor"
                raise DeltaSyncError(f"tensor {name!r}: the model now holds {kind}, which has no dense data to copy")
        return live

    def _local(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name not in self._shards:
            return tensor
        local, offset = _local_part(name, tensor)
        if local is None or (tuple(tensor.shape), offset) != self._shards[name]:
            raise DeltaSyncError(f"tensor {name!r}: its sharding changed since the mirror was made")
        return local

    def _differing(self) -> list[str]:
        """The mirrored tensors whose current weights (cast to the shipped dtype) differ from the mirror, bit for
        bit; the mirror is not moved. One read of the model, chunk by chunk as ``step()`` reads it."""
        differing = []
        for name, tensor in self._live().items():
            flat = self._tensors[name].view(-1)
            for start, end, chunk in self._device_chunks(tensor, flat.dtype):
                host = chunk.to("cpu").contiguous()
                if not torch.equal(host.view(torch.uint8), flat[start:end].view(torch.uint8)):
                    differing.append(name)
                    break
        return differing

    def step(self, step: int | None = None) -> Delta:
        """Copies the current weights to the CPU chunk by chunk, compares them with the mirror and moves the mirror
        to them, in one pass; returns the delta from the previous mirror state (``base_step``) to ``step``."""
        delta = self._step(step, defer=False)
        assert isinstance(delta, Delta)
        return self._under_every_name(delta)

    def _under_every_name(self, delta: Delta) -> Delta:
        """``delta`` with each tied tensor's record also under each of its other names, in the model's order, as
        ``ds.diff`` of the model's state dict gives them: a target that holds the names apart (a state dict cloned
        tensor by tensor, an untied model, a publisher's copy) gets every name written, and one that ties them
        writes the memory once. (A publisher sharing the mirror ships the tensor once and lists the other names in
        its manifest entries instead.)"""
        if not self.aliases:
            return delta
        index = {name: i for i, name in enumerate(delta.names)}
        order = [
            (name, index[name] if name in index else index[self.aliases[name]])
            for name in _named_tensors(self._source)
            if name in index or self.aliases.get(name) in index
        ]
        return Delta(delta._raw.arranged(order))

    def _step(self, step: int | None, *, defer: bool) -> Delta | _Deferred:
        """``step``; with ``defer`` the encoding of whole tensors' changes waits (the compact re-encoding, the choice
        to store a tensor whole): the mirror moves, and the ``_Deferred`` returned is completed from it later, before
        it moves again (a publisher's upload thread, off the training step's path)."""
        # Checked before the mirror moves: a step refused after the scan would leave the mirror at the new weights
        # with its step unchanged, and the next delta would lose this step's changes.
        _check_step(step, "step")
        _check_step(self.current_step, "the mirror's current_step")
        live = self._live()
        self.last_bases = []
        builder = MirrorDiff(self.values, self.codec, defer)
        stream = torch.cuda.Stream() if any(t.device.type == "cuda" for t in live.values()) else None
        # Chunks whose bytes are on their way to the host: (name, start, end, host bytes, event, first, last).
        pending: list[tuple[str, int, int, Any, Any, bool, bool]] = []
        slot = 0

        def scan(job: tuple[str, int, int, Any, Any, bool, bool]) -> None:
            name, start, end, host, event, first, last = job
            mirror = self._tensors[name]
            width = mirror.element_size()
            whole_shape, offset = self._shards.get(name, (None, 0))
            if first:
                dtype_name, shape = _arrays.describe(mirror, name)
                builder.begin(name, dtype_name, list(whole_shape or shape))
            if event is not None:
                event.synchronize()
            if end > start:
                builder.update(self._bytes[name][start * width : end * width], host, offset + start)
            if last:
                # A shard cannot judge whether the whole tensor is better stored whole, so it keeps its streams.
                builder.finish(None if whole_shape else self._bytes[name])

        # Without a device in play, runs of tensors that need no cast are compared in one call, side by side (as
        # ds.diff does), instead of one tensor at a time; the delta lists tensors in the same order either way.
        batch: list[tuple[str, str, list[int], Any, torch.Tensor]] = []

        def flush() -> None:
            if batch:
                builder.advance(batch)
                batch.clear()

        for name, tensor in live.items():
            mirror = self._tensors[name]
            if (
                stream is None
                and name not in self._shards
                and tensor.dtype == mirror.dtype
                and _arrays.readable_in_place(tensor)
            ):
                dtype_name, shape = _arrays.describe(mirror, name)
                batch.append((name, dtype_name, list(shape), self._bytes[name], tensor))
                continue
            flush()
            width = mirror.element_size()
            chunks = list(self._chunk_bounds(tensor.numel(), width)) or [(0, 0)]
            flat = tensor.detach().reshape(-1)  # a view when contiguous; one copy on the device otherwise
            for index, (start, end) in enumerate(chunks):
                first, last = index == 0, index == len(chunks) - 1
                host, event = self._to_host(flat, mirror.dtype, start, end, slot, stream)
                slot ^= 1
                job = (name, start, end, host, event, first, last)
                if stream is None:  # the bytes are on the host already
                    scan(job)
                    continue
                pending.append(job)
                if len(pending) == 2:  # the copy just queued overlaps the scan of the one before
                    scan(pending.pop(0))
        flush()
        for job in pending:
            scan(job)
        if defer:
            delta: Delta | _Deferred = _Deferred(builder.take_deferred(), step, self.current_step)
        else:
            delta = _finish(builder.take(), step, self.current_step, None)
        self.last_bases = builder.take_shard_bases()
        self.current_step = step
        return delta

    def _chunk_bounds(self, numel: int, width: int):
        elements = max(1, self.chunk_bytes // width)
        for start in range(0, numel, elements):
            yield start, min(start + elements, numel)

    def _to_host(
        self, flat: torch.Tensor, shipped: torch.dtype, start: int, end: int, slot: int, stream: Any
    ) -> tuple[Any, Any]:
        """The bytes of elements [start, end) of the flat tensor in the shipped dtype on the host, and the CUDA event
        that marks them ready (None when they already are)."""
        if end == start:
            return None, None
        if flat.device.type == "cpu" and flat.dtype == shipped:
            return _arrays.host_bytes(flat[start:end])[0], None  # read in place: no copy at all
        width = torch.empty(0, dtype=shipped).element_size()
        staging = self._staging_buffer(slot if stream is not None else 0)[: (end - start) * width].view(shipped)
        if flat.device.type != "cuda":
            staging.copy_(flat[start:end])  # the cast, if any, happens in this copy
            return staging.view(torch.uint8).numpy(), None
        cast = flat[start:end].to(shipped)  # on the device, before the copy
        stream.wait_stream(torch.cuda.current_stream(flat.device))
        with torch.cuda.stream(stream):
            staging.copy_(cast, non_blocking=True)
            cast.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        return staging.view(torch.uint8).numpy(), event


class Attachment:
    """What :func:`attach` returns: the mirror, the publisher and a ``detach()``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | None,
        model: torch.nn.Module,
        publisher: Any,
        *,
        sync_every: int,
        dtype: torch.dtype,
        chunk_bytes: int,
        start_step: int,
        resume: bool = True,
    ) -> None:
        self.publisher = publisher
        self.sync_every = at_least_one(sync_every, "sync_every")
        self.steps = 0  # optimizer steps seen since attaching
        self._group: Any = None
        self._agreed: int | None = None  # sharded: the last step every rank was told was published
        if _holds_dtensors(model):
            self._init_sharded(model, dtype, chunk_bytes, start_step, resume)
        else:
            if publisher is None:
                raise DeltaSyncError("attach needs a publisher")
            base = publisher.step if publisher.step is not None else start_step
            self.mirror = Mirror(
                model, dtype, chunk_bytes=chunk_bytes, values=publisher.values, codec=publisher.codec, step=base
            )
            self._base = base
            publisher.publish_shared(base, self.mirror.tensors, resume=resume, aliases=self.mirror.aliases)
        # Without an optimizer (DeltaSyncCallback), the caller calls _sync itself.
        self._handle = optimizer.register_step_post_hook(self._after_step) if optimizer is not None else None

    def _init_sharded(
        self, model: torch.nn.Module, dtype: torch.dtype, chunk_bytes: int, start_step: int, resume: bool
    ) -> None:
        """FSDP2 / DTensor: every rank mirrors its shards; rank 0 publishes. The first state is gathered to rank 0
        once; after that only each rank's delta travels (a gather of encoded deltas, never of weights). Every check
        is agreed on by all ranks, so that they raise together rather than leave one waiting in a collective."""
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        misuse = None
        if (rank == 0) != (self.publisher is not None):
            misuse = f"rank {rank}: pass the publisher on rank 0 and None on the other ranks"
        misuses: list[Any] = [None] * world
        dist.all_gather_object(misuses, misuse)
        if any(misuses):
            raise DeltaSyncError("; ".join(m for m in misuses if m))
        settings: list[Any] = [None]
        if rank == 0:
            base = self.publisher.step if self.publisher.step is not None else start_step
            settings = [(self.publisher.values, base, self.publisher.codec)]
        dist.broadcast_object_list(settings, src=0)
        values, self._base, _ = settings[0]
        # Shards stay varint: rank 0 re-encodes the joined tensors in the publisher's codec (publish_shards; for
        # "context", against the whole last published state its publisher keeps).
        self.mirror = Mirror(model, dtype, chunk_bytes=chunk_bytes, values=values, step=self._base)
        self._group = dist.group.WORLD
        parts: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object((self.mirror.tensors, self.mirror.shards), parts, dst=0)
        outcome: list[Any] = ["published"]
        failure: Exception | None = None
        if parts is not None:
            try:
                # The first publish of this publisher (an anchor of the gathered state, which it keeps without a
                # copy; or, with resume, a resume where the store holds that step as this state), or, after
                # Publisher.resume, a check that the model holds the state it resumed from.
                self.publisher.publish_shared(
                    self._base, self._whole_state(parts), resume=resume, aliases=self.mirror.aliases
                )
            except Exception as error:
                outcome[0], failure = f"rank 0: {type(error).__name__}: {error}", error
        _told(outcome, failure, ("published",), "attach failed on rank 0")
        self._agreed = self._base

    def _gather_and_publish(self, step: int) -> None:
        """Every rank steps its mirror, and its delta with what its mirror held (``Mirror.last_bases``), or the error
        its step raised, is gathered to rank 0. Rank 0 joins and publishes them, or, where a shard did not start
        from the last published state, re-anchors from every rank's mirror; then it tells every rank the outcome, so
        that all ranks return, or all raise, together: none is left waiting in a collective."""
        import torch.distributed as dist

        rank = dist.get_rank()
        failure: Exception | None = None
        part: Any
        try:
            delta = self.mirror._step(step, defer=False)  # each tied tensor once: rank 0's entry names the ties
            assert isinstance(delta, Delta)
            part = (delta.to_bytes(), self.mirror.last_bases)
        except Exception as error:  # the other ranks still gather, and learn of it
            failure, part = error, f"rank {rank}: {type(error).__name__}: {error}"
        parts: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(part, parts, dst=0)
        outcome: list[Any] = [None]
        if parts is not None:
            outcome[0], rank0_failure = self._publish_parts(step, parts)
            failure = failure or rank0_failure
        _told(outcome, failure, ("published", "reanchor"), f"step {step} was not published")
        if outcome[0] == "reanchor":
            mirrors: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
            dist.gather_object((self.mirror.tensors, self.mirror.shards), mirrors, dst=0)
            outcome, failure = ["published"], None
            if mirrors is not None:
                try:
                    self.publisher.reanchor(step, self._whole_state(mirrors), copy=False)
                except Exception as error:  # told to every rank, which all raise: none is left a step ahead
                    outcome[0], failure = f"rank 0: {type(error).__name__}: {error}", error
            _told(outcome, failure, ("published",), f"step {step} was not published")
        self._agreed = step  # a re-anchor publishes this step too

    def _whole_state(self, mirrors: list[Any]) -> dict[str, torch.Tensor]:
        """Rank 0: the whole state from every rank's gathered (mirror tensors, shards), for its publisher to keep
        without a copy. Gathered objects arrive as copies; one that did not (rank 0's own mirror) is copied, so that
        the publisher's state never moves with rank 0's mirror."""
        own = {tensor.untyped_storage().data_ptr() for tensor in self.mirror.tensors.values()}
        return {
            name: tensor.clone() if tensor.untyped_storage().data_ptr() in own else tensor
            for name, tensor in _assemble(mirrors).items()
        }

    def _publish_parts(self, step: int, parts: list[Any]) -> tuple[str, Exception | None]:
        """Rank 0: publishes the gathered parts; returns the outcome every rank is told ("published", "reanchor" or
        why it failed) and rank 0's own error, if any."""
        from .delta import load

        failed = [part for part in parts if isinstance(part, str)]
        if failed:
            return f"a step failed: {'; '.join(failed)}", None
        try:
            deltas = [load(bytes(blob)) for blob, _ in parts]
            self.publisher.publish_shards(step, deltas, proofs=[bases for _, bases in parts])
        except BaseMismatchError as error:
            log.error("step %d: %s; publishing it as an anchor made from every rank's mirror", step, error)
            return "reanchor", None
        except Exception as error:
            return f"rank 0: {type(error).__name__}: {error}", error
        return "published", None

    @property
    def published_step(self) -> int | None:
        return self._agreed if self._group is not None else self.mirror.current_step

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1
        if self.steps % self.sync_every:
            return
        self.sync()

    def sync(self, step: int | None = None) -> int:
        """Publishes the current weights now, as ``step`` (by default ``base + optimizer steps seen``: the step the
        hook would give them); returns that step. The hook keeps its own numbering, so a step given here that is
        ahead of it makes the hook's next publishes raise (not after the last published step) until it catches up.
        At the step published last it returns at once when the weights are still as published, and raises when
        they were changed since (that step cannot be published twice: give a later one). With FSDP2, call it on
        every rank, with the same step."""
        return self._sync(self._base + self.steps if step is None else step)

    def _sync(self, step: int) -> int:
        if self._group is not None:
            import torch.distributed as dist

            # Every rank must sync the same step: they would otherwise enter different collectives (and wait there
            # for gloo's timeout), or join parts made as different steps.
            steps: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(steps, step)
            if len(set(steps)) > 1:
                raise DeltaSyncError(
                    f"the ranks synced different steps ({', '.join(f'rank {r}: {s}' for r, s in enumerate(steps))}): "
                    "call sync on every rank with the same step; nothing was published"
                )
            # Sharded: what every rank was told was published, not this rank's mirror, which may have moved on a
            # step that failed on another rank (then every rank syncs again, together).
            if step != self._agreed:
                self._gather_and_publish(step)
            else:
                self._refuse_edits_since(step)
            return step
        if step == self.mirror.current_step:
            self._refuse_edits_since(step)
            return step
        _publish_step(self.publisher, self.mirror, step)
        return step

    def _refuse_edits_since(self, step: int) -> None:
        """``step`` is published already: fine while the weights are as published, an error where they changed
        since (an edit after the optimizer's step), since those changes cannot go out as the same step again.
        Sharded, every rank checks its own shards and all raise together."""
        if self._group is None:
            changed = self.mirror._differing()
        else:
            import torch.distributed as dist

            mine: Any
            try:
                mine = self.mirror._differing()
            except Exception as error:  # the other ranks still gather, and learn of it
                mine = f"rank {dist.get_rank()}: {type(error).__name__}: {error}"
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            failures = [part for part in everyone if isinstance(part, str)]
            if failures:
                raise DeltaSyncError(f"step {step}: {'; '.join(failures)}")
            changed = sorted({name for part in everyone for name in part})
        if changed:
            raise DeltaSyncError(
                f"step {step} is published already, and tensors {changed[:5]} changed since: sync them as a later "
                f"step (sync(step={step + 1}); the hook's next publishes then raise until its count passes it)"
            )

    def detach(self) -> None:
        """Removes the hook; later optimizer steps do no deltasync work."""
        if self._handle is not None:
            self._handle.remove()


def _publish_step(publisher: Any, mirror: Mirror, step: int) -> None:
    """Publishes ``mirror``'s next step through ``publisher``, which shares its tensors (``attach``, the Trainer
    callback). A model the mirror cannot take is refused first, before the mirror could be torn; the encoding of
    the delta waits for the publisher's upload thread, so training goes on once the mirror moved."""
    mirror._live()
    publisher.publish_shared(step, mirror.tensors, lambda: mirror._step(step, defer=True), aliases=mirror.aliases)


def _told(outcome: list[Any], failure: Exception | None, accepted: tuple[str, ...], what: str) -> None:
    """Broadcasts rank 0's ``outcome[0]`` to every rank (filling ``outcome`` there); every rank then raises unless
    it is one of ``accepted``: its own error where it had one, else DeltaSyncError with ``what`` and the outcome."""
    import torch.distributed as dist

    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] not in accepted:
        if failure is not None:
            raise failure
        raise DeltaSyncError(f"{what}: {outcome[0]}")


def _holds_dtensors(source: torch.nn.Module | Mapping[str, torch.Tensor]) -> bool:
    """Whether a model's state holds DTensors (FSDP2 shards, or tensors replicated over a device mesh); an FSDP1
    model is refused (on every rank: each calls this first)."""
    _refuse_fsdp1(source)
    dtensor = _dtensor_type()
    return dtensor is not None and any(isinstance(t, dtensor) for t in _named_tensors(source).values())


def _assemble(parts: list[Any]) -> dict[str, torch.Tensor]:
    """The whole state from every rank's (mirror tensors, shards), in rank order: shards placed at their offsets."""
    state: dict[str, torch.Tensor] = {}
    covered: dict[str, int] = {}
    for tensors, shards in parts:
        for name, tensor in tensors.items():
            if name not in shards:
                state.setdefault(name, tensor)
                continue
            shape, offset = shards[name]
            whole = state.setdefault(name, torch.empty(shape, dtype=tensor.dtype))
            whole.view(-1)[offset : offset + tensor.numel()] = tensor.reshape(-1)
            covered[name] = covered.get(name, 0) + tensor.numel()
    for name, count in covered.items():
        if count != state[name].numel():  # shards on dim 0 do not overlap: anything else left memory unfilled
            raise DeltaSyncError(
                f"tensor {name!r}: the ranks' shards hold {count} of its {state[name].numel()} elements; "
                "nothing was published"
            )
    return state


def attach(
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    publisher: Any,
    *,
    sync_every: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    chunk_bytes: int = 64 << 20,
    start_step: int = 0,
    resume: bool = True,
) -> Attachment:
    """Publishes ``model``'s weights through ``publisher`` after every ``sync_every`` optimizer steps.

    The weights as they are now are published first (as ``start_step``, or the publisher's step after
    ``Publisher.resume``). With ``resume`` (the default), where the store already holds ``start_step`` > 0 as
    these weights (a trainer restarted from the checkpoint of a step it published), the publisher resumes there
    instead: nothing is published for it, the store's later steps (a history the run leaves) are removed, and the
    next publish is a delta; the store holding that step as other weights is an IntegrityError. Each later publish is the delta from the last *published* state, so the steps in between lose
    nothing. The publisher shares the mirror's memory rather than keeping a second copy. Call ``detach()`` on
    the returned object to stop.

    With FSDP2 (DTensor parameters sharded on dim 0, or replicated) call it on every rank, with the publisher on
    rank 0 and ``None`` elsewhere: each rank mirrors and diffs only its shards, with positions in the whole
    tensor's index space, and rank 0 joins the ranks' deltas into one delta and one manifest entry per step.
    Rank 0's publisher keeps a whole CPU copy, for anchors."""
    if not hasattr(optimizer, "_optimizer_step_post_hooks") and hasattr(
        getattr(optimizer, "optimizer", None), "_optimizer_step_post_hooks"
    ):
        # A wrapper that never ran Optimizer.__init__ (accelerate's AcceleratedOptimizer): it steps the optimizer
        # it wraps, whose step hooks run.
        optimizer = getattr(optimizer, "optimizer")  # noqa: B009  (typed as an Optimizer, which has none)
    if not hasattr(optimizer, "register_step_post_hook") or not hasattr(optimizer, "_optimizer_step_post_hooks"):
        raise DeltaSyncError(
            f"attach(optimizer, model, publisher): optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}"
        )
    if not isinstance(model, (torch.nn.Module, Mapping)):
        raise DeltaSyncError(
            f"attach(optimizer, model, publisher): model must be a torch.nn.Module, not {type(model).__name__}"
        )
    if publisher is not None and not hasattr(publisher, "publish_shared"):
        raise DeltaSyncError(
            "attach(optimizer, model, publisher): publisher must be a deltasync_rs.Publisher (None on the ranks "
            f"other than 0 with FSDP2), not {type(publisher).__name__}"
        )
    return Attachment(
        optimizer,
        model,
        publisher,
        sync_every=sync_every,
        dtype=dtype,
        chunk_bytes=chunk_bytes,
        start_step=start_step,
        resume=flag(resume, "resume"),
    )
