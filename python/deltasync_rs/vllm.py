"""vLLM integration: map HF-coordinate deltas onto vLLM's fused, tensor-parallel parameters and apply them in place.

``apply_delta(model, delta)`` writes only the changed elements of this rank's shard (``index_copy_`` on the
parameter's own storage); models outside the Qwen2/Qwen3/Llama/Mistral family go through vLLM's own
``load_checkpoint_weight_patches``. ``DeltaSyncWorkerExtension`` (``--worker-extension-cls``) and the ``deltasync``
weight-transfer engine (``vllm.general_plugins`` entry point ``register``) run it inside every worker.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import FrameType
from typing import Any, Union

import numpy as np
import torch
import vllm  # noqa: F401  (the real vllm package: absolute import, see docs/architecture.md, "Two names shadowed by our own modules")
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

from . import _arrays, _ranged, _vllm_cpu, _write
from ._core import BaseMismatchError, DeltaFormatError, DeltaSyncError
from ._ranged import AnchorTensor, PartialAnchor
from .delta import Delta, _check_step, load
from .errors import ChainError, IntegrityError, StaleStoreError, shown
from .manifest import Entry

log = logging.getLogger(__name__)

#: Architectures whose HF → vLLM layout ``apply_delta`` maps itself; any other model uses vLLM's loader.
MAPPED_ARCHITECTURES = frozenset({"Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"})
#: HF sub-module names fused by vLLM: (HF part, vLLM part, shard id) as in the models' ``hf_to_vllm_mapper``.
_STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)
_TORCH_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_UNQUANTIZED = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")

Source = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, Delta]


@dataclass(frozen=True)
class ShardMap:
    """Where one HF tensor lands in this rank's vLLM parameter.

    The HF tensor is viewed as ``[hf_rows, hf_cols]`` (a 1-D tensor as ``[n, 1]``). This rank holds HF rows
    ``row_start .. row_start + row_count`` and columns ``col_start .. col_start + col_count``; HF row
    ``row_start + i`` is parameter row ``param_row_offset + i`` and column ``col_start + j`` is parameter column ``j``.
    """

    hf_name: str
    param_name: str
    param: torch.Tensor
    hf_shape: tuple[int, ...]
    row_start: int
    row_count: int
    col_start: int
    col_count: int
    param_row_offset: int

    @property
    def hf_cols(self) -> int:
        return self.hf_shape[1] if len(self.hf_shape) == 2 else 1

    @property
    def covers_all(self) -> bool:
        """True when this rank holds the whole HF tensor."""
        return (
            self.row_start == 0
            and self.row_count == self.hf_shape[0]
            and self.col_start == 0
            and self.col_count == self.hf_cols
        )

    def region_key(self) -> tuple[int, int, int]:
        return (id(self.param), self.param_row_offset, self.row_start)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by name, as written: on vLLM's CPU backend a packed layer's kept unpacked weight."""
    return _vllm_cpu.live_parameters(model)


def _numel(shard: ShardMap) -> int:
    count = 1
    for dim in shard.hf_shape:
        count *= dim
    return count


def _shard_bytes(shard: ShardMap, width: int) -> tuple[int, int]:
    """The byte range [start, end) of the HF tensor (row-major) that holds every element of this rank's slice:
    exactly its rows when it has all columns (a row split: fused q/k/v, gate/up, vocabulary), else from its first
    element to its last (a column split spans nearly the whole tensor)."""
    if shard.row_count == 0 or shard.col_count == 0:
        return 0, 0
    cols = shard.hf_cols
    first = shard.row_start * cols + shard.col_start
    last = (shard.row_start + shard.row_count - 1) * cols + shard.col_start + shard.col_count
    return first * width, last * width


def anchor_ranges(model: torch.nn.Module) -> Callable[[list[AnchorTensor]], list[tuple[int, int]]]:
    """For ``Subscriber(anchor_ranges=...)``: the byte ranges of an anchor this rank's shard of ``model`` needs,
    found with the same coordinate mapping ``apply_delta`` writes with (:func:`shard_map`); a tensor the mapping
    cannot place (an unknown name, a shape that disagrees) is asked for whole, and ``apply_delta`` then rejects it
    as it would any anchor."""

    def needed(tensors: list[AnchorTensor]) -> list[tuple[int, int]]:
        params = _params(model)
        out = []
        for tensor in tensors:
            size = tensor.end - tensor.start
            try:
                shard = shard_map(model, tensor.name, params)
            except Exception:  # noqa: BLE001 (read it whole: apply_delta raises the same error, loudly)
                out.append((tensor.start, tensor.end))
                continue
            numel = _numel(shard)
            width = _arrays.WIDTHS.get(tensor.dtype, 0)
            count = 1
            for dim in tensor.shape:
                count *= dim
            if count != numel or width * numel != size:
                out.append((tensor.start, tensor.end))
                continue
            start, end = _shard_bytes(shard, width)
            out.append((tensor.start + start, tensor.start + end))
        return out

    return needed


def is_mapped(model: torch.nn.Module) -> bool:
    """True when ``apply_delta`` maps this model's layout itself: a known architecture without quantization."""
    if type(model).__name__ not in MAPPED_ARCHITECTURES or getattr(model, "quant_config", None) is not None:
        return False
    return all(
        type(getattr(m, "quant_method", None)).__name__ in _UNQUANTIZED
        for m in model.modules()
        if hasattr(m, "quant_method")
    )


def shard_map(model: torch.nn.Module, hf_name: str, params: dict[str, torch.Tensor] | None = None) -> ShardMap:
    """Maps HF parameter ``hf_name`` to this rank's slice of a vLLM parameter of a mapped-family model."""
    params = _params(model) if params is None else params
    vllm_name, shard_id = hf_name, None
    for hf_part, vllm_part, sid in _STACKED:
        if hf_part in hf_name:
            vllm_name, shard_id = hf_name.replace(hf_part, vllm_part, 1), sid
            break
    param = params.get(vllm_name)
    if param is None:
        raise BaseMismatchError(f"tensor {hf_name!r}: no vLLM parameter {vllm_name!r} in {type(model).__name__}")
    module_path, attr = vllm_name.rsplit(".", 1)
    module = model.get_submodule(module_path)
    _vllm_cpu.check_updatable(module, attr, hf_name, vllm_name)
    if not param.is_contiguous():
        raise DeltaSyncError(f"tensor {hf_name!r}: vLLM parameter {vllm_name!r} is not contiguous")
    return _layer_map(hf_name, vllm_name, module, attr, param, shard_id)


def _layer_map(
    hf_name: str, vllm_name: str, module: torch.nn.Module, attr: str, param: torch.Tensor, shard_id: Any
) -> ShardMap:
    quant = getattr(module, "quant_method", None)
    if quant is not None and type(quant).__name__ not in _UNQUANTIZED:
        raise DeltaSyncError(
            f"tensor {hf_name!r}: {vllm_name!r} is quantized ({type(quant).__name__}); "
            "use apply_delta(..., path='loader')"
        )
    pshape = tuple(param.shape)
    cols = pshape[1] if len(pshape) == 2 else 1
    if len(pshape) > 2:
        raise DeltaSyncError(
            f"tensor {hf_name!r}: {vllm_name!r} has {len(pshape)} dimensions; only 1-D and 2-D parameters are mapped"
        )

    def rows_map(hf_rows: int, row_start: int, row_count: int, offset: int) -> ShardMap:
        hf_shape = (hf_rows, cols) if len(pshape) == 2 else (hf_rows,)
        return ShardMap(hf_name, vllm_name, param, hf_shape, row_start, row_count, 0, cols, offset)

    if (shard_id is None) != (not isinstance(module, (QKVParallelLinear, MergedColumnParallelLinear))):
        raise BaseMismatchError(
            f"tensor {hf_name!r}: does not match the layout of vLLM's {vllm_name!r} ({type(module).__name__})"
        )
    if isinstance(module, QKVParallelLinear):
        if shard_id == "q":
            size, offset, shard_rank = module.num_heads * module.head_size, 0, module.tp_rank
            hf_rows = module.total_num_heads * module.head_size
        else:
            head = module.head_size if shard_id == "k" else module.v_head_size
            size, shard_rank = module.num_kv_heads * head, module.tp_rank // module.num_kv_head_replicas
            offset = module.num_heads * module.head_size + (
                0 if shard_id == "k" else module.num_kv_heads * module.head_size
            )
            hf_rows = module.total_num_kv_heads * head
        return rows_map(hf_rows, shard_rank * size, size, offset)
    if isinstance(module, MergedColumnParallelLinear):
        size = module.output_sizes[shard_id] // module.tp_size
        offset = sum(module.output_sizes[:shard_id]) // module.tp_size
        return rows_map(module.output_sizes[shard_id], module.tp_rank * size, size, offset)
    if isinstance(module, ColumnParallelLinear):
        size = module.output_size_per_partition
        return rows_map(module.output_size, module.tp_rank * size, size, 0)
    if isinstance(module, RowParallelLinear) and attr == "weight":
        per_rank = module.input_size_per_partition
        return ShardMap(
            hf_name,
            vllm_name,
            param,
            (pshape[0], module.input_size),
            0,
            pshape[0],
            module.tp_rank * per_rank,
            per_rank,
            0,
        )
    if isinstance(module, VocabParallelEmbedding):
        indices = module.shard_indices
        if module.num_added_embeddings:
            raise DeltaSyncError(f"tensor {hf_name!r}: {vllm_name!r} has added (LoRA) vocabulary, which is not mapped")
        start, end = indices.org_vocab_start_index, indices.org_vocab_end_index
        return rows_map(module.org_vocab_size, start, end - start, 0)
    if isinstance(module, (RowParallelLinear, ReplicatedLinear)) or not any(
        hasattr(param, a) for a in ("output_dim", "input_dim", "packed_dim")
    ):
        # Replicated: norms, biases of row-parallel layers, replicated linears.
        return ShardMap(hf_name, vllm_name, param, pshape, 0, pshape[0] if pshape else 1, 0, cols, 0)
    raise DeltaSyncError(
        f"tensor {hf_name!r}: vLLM's {vllm_name!r} ({type(module).__name__}) has a layout "
        "that is not mapped; use apply_delta(..., path='loader')"
    )


def _check_chain(delta: Delta, current_step: int | None) -> None:
    if current_step is not None and delta.base_step is not None and delta.base_step != current_step:
        raise BaseMismatchError(
            f"delta for step {delta.step} applies to step {delta.base_step}, "
            f"but the model is at step {current_step}; nothing was written"
        )


def _unknown_step(delta: Delta) -> BaseMismatchError:
    return BaseMismatchError(
        f"delta for step {delta.step} applies to step {delta.base_step}, but this "
        "worker's step is unknown: apply an anchor first or set the step"
    )


def _check_linked(delta: Delta, current_step: int | None) -> None:
    """What a worker that tracks its step applies: an anchor, or a delta naming the step it applies to, which is
    the worker's (known) step. A delta that names no base step (``ds.diff`` without ``base_step=``) would be
    applied onto whatever the worker holds, and the worker would then claim the delta's step."""
    if delta._whole_state:
        return
    if delta.base_step is None:
        raise BaseMismatchError(
            f"delta{'' if delta.step is None else f' for step {delta.step}'} names no base step, so the worker "
            f"cannot tell that it applies to the weights it holds (step {current_step}); make it with base_step= "
            "(ds.diff(..., step=, base_step=)); nothing was written"
        )
    if current_step is None:
        raise _unknown_step(delta)
    _check_chain(delta, current_step)


def _load_onto(sources: Sequence[Source], current_step: int | None) -> list[Delta]:
    """The delta files, loaded, each of which must name the step it applies to, the first ``current_step`` (at
    TP > 1 in ``_together``, so that every rank refuses together what one refuses)."""
    deltas = _load_all(sources)
    step = current_step
    for delta in deltas:
        _check_linked(delta, step)
        step = delta.step
    return deltas


def apply_delta(
    model: torch.nn.Module,
    delta: Delta,
    *,
    current_step: int | None = None,
    path: str = "auto",
    check_base: bool = False,
    aliases: Mapping[str, str] | None = None,
) -> int:
    """Applies ``delta`` (HF parameter names and coordinates) in place to this rank's shard of a vLLM model.

    All-or-nothing: the chain position (``delta.base_step == current_step`` when both are known), every name, dtype
    and shape are checked and every write is staged on the parameters' device before the first write; on an error
    nothing is changed. ``path="auto"`` maps the Qwen2/Qwen3/Llama/Mistral family itself (``"mapped"``) and sends any
    other model through vLLM's ``load_checkpoint_weight_patches`` (``"loader"``), which needs ``values="abs"``.
    ``check_base=True`` (mapped path) also checks that every touched tensor holds the exact base the delta was made
    against: a rank checks the tensors it holds whole alone, and the tensor-parallel ranks check the tensors split
    across them together (docs/vllm.md §7), each rank's own slice included. ``aliases`` (the manifest entry's,
    docs/format.md §10: names the trainer ties to a published tensor), and those the file itself lists
    (``delta.aliases``, docs/format.md §2.2), are refused where this model holds one as a parameter of its own,
    which the delta would leave at its old values. On vLLM's CPU backend the layers whose
    weights changed are repacked after the write (see docs/vllm.md). Returns the number of elements written on this
    rank.
    """
    if not isinstance(delta, Delta):
        raise DeltaSyncError(f"apply_delta takes a deltasync_rs.Delta, not {type(delta).__name__}")
    # The file's own ties too (docs/format.md §2.2): a file applied without its entry still names them.
    aliases = {**delta.aliases, **(aliases or {})}
    current_step = _check_step(current_step, "current_step")
    if path == "auto":
        path = "mapped" if is_mapped(model) else "loader"
    if path not in ("mapped", "loader"):
        raise _on_every_rank(DeltaSyncError(f'path must be "auto", "mapped" or "loader", not {shown(path)}'))
    if path == "loader" and check_base:
        raise _on_every_rank(
            DeltaSyncError("check_base needs path='mapped': vLLM's loader writes whole parameters itself")
        )
    # At TP > 1 the ranks agree on every delta before any of them writes: each checks only its own shards (of a
    # partial anchor, only the bytes it read), so one rank may refuse what another accepts, and a rank that wrote
    # while another raised would leave the group at two steps (and, before a later `context` delta's exchange,
    # waiting on a rank that left). A `context` tensor split across ranks is also placed with what every rank
    # holds of it (deltasync_rs._context), exchanged in the same all-gather.
    if path == "loader":
        # vLLM's loader: every rank checks the delta first (what one refuses, every rank refuses: decided together).
        def check() -> tuple[list[Any], list[Any], dict[int, torch.Tensor]]:
            _check_chain(delta, current_step)
            _refuse_untied(model, delta, aliases)
            if isinstance(delta, PartialAnchor):
                raise DeltaSyncError(
                    f"{delta.key}: only this rank's part of the anchor was read, which only the mapped path can "
                    "apply; nothing was written"
                )
            return _loader_patches(model, delta)

        patches, _ = _together(check, current_step, "check the delta for vLLM's loader")
        return _apply_through_loader(model, delta, patches)
    exchange = _tensor_parallel() > 1
    writes = _write.Writes(delta._raw)

    def stage() -> tuple[list[tuple[int, ShardMap]], dict[int, Any], dict[str, _Part]]:
        _check_chain(delta, current_step)
        _refuse_untied(model, delta, aliases)
        return _stage(model, delta, writes, check_base)

    if exchange:
        (plan, _, split), gathered = _together(stage, None, "apply the delta", lambda staged: staged[1:])
        holdings = [held for held, _ in gathered]
        if any(parts for _, parts in gathered):
            try:
                error = _split_base_error(delta, plan, [parts for _, parts in gathered])
            except DeltaSyncError as failed:  # found from what every rank gathered: the same on every rank
                raise _on_every_rank(failed) from None
            if error is not None:
                raise _on_every_rank(BaseMismatchError(error))
    else:
        (plan, _, split), holdings = stage(), []
        if split:  # one rank holds every tensor whole: not reached with vLLM's layers
            raise DeltaSyncError(
                f"tensor {min(split)!r}: check_base found only part of it on the only rank; nothing was applied"
            )
    everyone: dict[int, list[Any]] = {}
    for held in holdings:
        for index, part in held.items():
            everyone.setdefault(index, []).append(part)
    try:
        for index, shard in plan:
            if writes.context_sharded(index, shard):
                writes.add_region(index, shard, everyone.get(index))
    except DeltaSyncError as error:
        # Placed from what every rank holds (the exchange above): what one rank refuses there, every rank does.
        _on_every_rank(error)
        raise
    writes.commit()
    infos = delta.tensors  # built from the core on each access: once, not once per planned tensor
    _vllm_cpu.repack(model, [shard.param for index, shard in plan if infos[index].changed])
    return writes.elements


#: What a rank holds of a tensor split across the ranks, for the split base check (:func:`_split_part`).
_Part = _ranged.HeldTensor | _ranged.HeldColumns


def _stage(
    model: torch.nn.Module, delta: Delta, writes: _write.Writes, check_base: bool
) -> tuple[list[tuple[int, ShardMap]], dict[int, Any], dict[str, _Part]]:
    """Checks every tensor against this rank's parameters and stages its writes, but those of `context` tensors
    this rank holds in part: for them, returns what this rank holds (``Writes.context_held``), by tensor index.
    With ``check_base``, also returns what this rank holds of each tensor split across the ranks whose base it
    cannot check alone (:func:`_split_part`), for the ranks to check together (:func:`_split_base_error`)."""
    if type(model).__name__ not in MAPPED_ARCHITECTURES:
        raise DeltaSyncError(
            f"{type(model).__name__} is not one of the mapped architectures "
            f"{sorted(MAPPED_ARCHITECTURES)}; use path='loader'"
        )
    partial = delta if isinstance(delta, PartialAnchor) else None
    params = _params(model)
    infos = delta.tensors
    plan: list[tuple[int, ShardMap]] = []
    region_owner: dict[tuple[int, int, int], int] = {}
    planned: dict[tuple[int, int, int], int] = {}  # where each region's record is in `plan`
    for index, info in enumerate(infos):
        shard = shard_map(model, info.name, params)
        dtype = _arrays._TORCH_NAMES.get(str(shard.param.dtype))
        if dtype != info.dtype:
            raise BaseMismatchError(
                f"tensor {info.name!r}: the delta holds {info.dtype}, but vLLM's "
                f"{shard.param_name!r} is {shard.param.dtype}"
            )
        delta._raw.check_target(index, info.dtype, list(shard.hf_shape))
        if partial is not None:  # every byte this rank reads must have been read and verified
            partial.require(info.name, *_shard_bytes(shard, _arrays.WIDTHS[info.dtype]))
        first = region_owner.setdefault(shard.region_key(), index)
        if first != index:  # tied weights (lm_head / embed_tokens): one memory, written once
            if partial is not None:
                span = _shard_bytes(shard, _arrays.WIDTHS[info.dtype])
                same = partial.tensor_bytes(infos[first].name, *span) == partial.tensor_bytes(info.name, *span)
            else:
                same = delta._raw.same_changes(first, index)
            if not same:
                raise DeltaSyncError(
                    f"tensors {infos[first].name!r} and {info.name!r} are one parameter in vLLM "
                    "but the delta changes them differently"
                )
            bases = (delta.base_identity(first), delta.base_identity(index))
            if check_base and None not in bases and bases[0] != bases[1]:
                # One memory holds one base: the check of the first tensor's covers this one only where they agree.
                raise BaseMismatchError(
                    f"tensors {infos[first].name!r} and {info.name!r} are one parameter in vLLM, but the delta was "
                    f"made against different bases for them ({bases[0]} and {bases[1]}): the trainer's differ"
                )
            if bases[0] is None and bases[1] is not None:
                # The same changes: written (and checked) through the record that holds a base.
                region_owner[shard.region_key()] = index
                plan[planned[shard.region_key()]] = (index, shard)
            continue
        planned[shard.region_key()] = len(plan)
        plan.append((index, shard))
    _reject_lone_tied_head(params, {info.name for info in infos})
    split: dict[str, _Part] = {}
    if check_base:
        split = _check_base(writes, delta, plan)
    else:
        # At TP > 1 on the host too: a replicated tensor's base that differs on one rank must be refused by every
        # rank before any writes, not found by the core as that rank writes.
        writes.check_context_bases(
            [(index, _whole_region(shard)) for index, shard in plan if shard.covers_all],
            on_host=_tensor_parallel() > 1,
        )
    held = {}
    for index, shard in plan:
        if writes.context_sharded(index, shard):
            held[index] = writes.context_held(index, shard)
        else:
            writes.add_region(index, shard)
    return plan, held, split


def _whole_region(shard: ShardMap) -> torch.Tensor:
    """The bytes of a tensor this rank holds whole: one contiguous run of its parameter."""
    param = shard.param.data
    start = shard.param_row_offset * _write.param_cols(param)
    return param.reshape(-1)[start : start + _numel(shard)]


def _check_base(writes: _write.Writes, delta: Delta, plan: list[tuple[int, ShardMap]]) -> dict[str, _Part]:
    """Each planned tensor's bytes in this rank's parameter match the base identity the delta records (on a GPU,
    hashed there), where this rank holds the tensor whole; of each tensor it holds only a tensor-parallel slice
    of, returns what it holds (:func:`_split_part`), by name, for the ranks to check together."""
    targets, split = [], {}
    infos = delta.tensors  # built from the core on each access: once, not once per split tensor
    for index, shard in plan:
        if delta.base_identity(index) is None:
            continue
        if shard.covers_all:
            targets.append((index, _whole_region(shard)))
        elif shard.row_count and shard.col_count:  # an empty slice (a padded vocabulary's last rank) holds nothing
            split[shard.hf_name] = _split_part(shard, _arrays.WIDTHS[infos[index].dtype])
    writes.check_bases(targets)
    return split


def _shard_rows(shard: ShardMap, width: int) -> torch.Tensor:
    """The bytes of the parameter rows that hold this rank's slice (flat, uint8, where the parameter is)."""
    param = shard.param.data
    row_bytes = _write.param_cols(param) * width
    flat = param.reshape(-1).view(torch.uint8)
    return flat[shard.param_row_offset * row_bytes : (shard.param_row_offset + shard.row_count) * row_bytes]


def _by_rows(shard: ShardMap) -> bool:
    """True where this rank's slice is whole rows of the HF tensor, contiguous in its parameter (a row split)."""
    return shard.col_count == shard.hf_cols and _write.param_cols(shard.param.data) == shard.hf_cols


def _split_part(shard: ShardMap, width: int) -> _ranged.HeldTensor | _ranged.HeldColumns:
    """What this rank holds of a tensor split across the tensor-parallel ranks: of a row split, the byte interval
    of the HF tensor it holds and the hashes of the base-identity blocks wholly inside it (hashed where the
    parameter is: on a GPU, on the device), a ``_ranged.HeldTensor``; of a column split, which bytes of which rows,
    a ``_ranged.HeldColumns``."""
    from . import _identity

    block = _identity.BLOCK_BYTES
    nbytes = _numel(shard) * width
    row_bytes = shard.hf_cols * width
    if not _by_rows(shard):
        first = shard.col_start * width
        return _ranged.HeldColumns(
            nbytes, row_bytes, shard.row_start, shard.row_count, first, first + shard.col_count * width
        )
    start, end = shard.row_start * row_bytes, (shard.row_start + shard.row_count) * row_bytes
    first, stop = -(-start // block), (-(-nbytes // block) if end == nbytes else end // block)
    runs = []
    if stop > first:
        rows = _shard_rows(shard, width)
        runs.append((first, _identity.block_hashes(rows[first * block - start : min(stop * block, nbytes) - start])))
    return _ranged.HeldTensor(nbytes, ((start, end),), tuple(runs))


#: The most bytes the ranks send each other in one round of the split base check (a column split's slices, the
#: blocks of a row split that a boundary cuts): the check's exchange goes in rounds of about this much.
_SPLIT_ROUND_BYTES = 64 << 20


def _split_base_error(delta: Delta, plan: list[tuple[int, ShardMap]], everyone: list[dict[str, _Part]]) -> str | None:
    """At TP > 1 with ``check_base``: why the tensors split across the ranks (each holds a slice) do not hold the
    base ``delta`` was made against, found by the ranks together from what each holds of them (``everyone``, every
    rank's :func:`_split_part`s, in rank order). Row splits: the hashes of the 256 KiB blocks a rank holds whole,
    and each rank's bytes of the blocks it holds only part of (a block a boundary cuts; both ranks' bytes where two
    hold the same elements, as vLLM's replicated KV heads, so that each rank's own bytes are compared), sent to the
    others (``_ranged.held_fragment_plan``). Column splits: every rank's slice, sent to the one rank that rebuilds
    the tensor (``_ranged.columns_identity``; the tensors dealt out by size) and tells the others what it found. In
    rounds of about ``_SPLIT_ROUND_BYTES``, a tensor's in one. None where every such tensor holds its base. The same
    answer on every rank."""
    names = sorted({name for own in everyone for name in own})
    columns = {name for own in everyone for name, part in own.items() if isinstance(part, _ranged.HeldColumns)}
    layouts = {name for name in columns if any(isinstance(own.get(name), _ranged.HeldTensor) for own in everyone)}
    if layouts:
        return (
            f"tensor {min(layouts)!r}: the tensor-parallel ranks hold it split in different ways, so its base "
            "cannot be checked; nothing was applied"
        )
    rows: list[dict[str, _ranged.HeldTensor | None]] = [
        {name: part for name, part in own.items() if isinstance(part, _ranged.HeldTensor)} for own in everyone
    ]
    by_name: dict[str, list[_ranged.Fragment]] = {}
    for fragment in _ranged.held_fragment_plan(rows):
        by_name.setdefault(fragment[1], []).append(fragment)

    def size(name: str) -> int:
        if name in columns:
            return sum(part.sent_bytes for own in everyone if isinstance(part := own.get(name), _ranged.HeldColumns))
        return sum(end - start for _, _, _, start, end in by_name.get(name, ()))

    sizes = {name: size(name) for name in names}
    infos = delta.tensors
    bases = {info.name: delta.base_identity(index) for index, info in enumerate(infos)}
    widths = {info.name: _arrays.WIDTHS[info.dtype] for info in infos}
    shards = {shard.hf_name: shard for _, shard in plan}
    rank = _tp_rank()
    rounds: list[list[str]] = [[]]
    round_bytes = 0
    for name in names:
        if rounds[-1] and round_bytes + sizes[name] > _SPLIT_ROUND_BYTES:
            rounds.append([])
            round_bytes = 0
        rounds[-1].append(name)
        round_bytes += sizes[name]
    # Each column split is rebuilt by one rank, which tells the others what it found: the largest first, each to
    # the rank that has the fewest bytes to receive so far, so that the ranks share the traffic evenly.
    owners: dict[str, int] = {}
    load = [0] * len(everyone)
    for name in sorted(columns, key=lambda name: (-sizes[name], name)):
        owners[name] = load.index(min(load))
        load[owners[name]] += sizes[name]
    own_columns: dict[str, tuple[str | None, str]] = {}
    identities: dict[str, str] = {}
    conflicts: list[str] = []
    uncovered: list[str] = []
    for batch in rounds:
        fragments = [f for name in batch for f in by_name.get(name, ())]
        whole = [name for name in batch if name in columns and name in everyone[rank]]
        mine = [f for f in fragments if f[0] == rank]
        sent: list[dict[tuple[str, int], bytes]] = [{}] * len(everyone)
        slices: list[dict[str, bytes]] = [{}] * len(everyone)
        if fragments or any(name in columns for name in batch):  # the same on every rank

            def send(
                mine: list[_ranged.Fragment] = mine, whole: list[str] = whole
            ) -> tuple[dict[tuple[str, int], bytes], list[dict[str, bytes]]]:
                outgoing: list[dict[str, bytes]] = [{} for _ in everyone]
                for name in whole:
                    outgoing[owners[name]][name] = _slice_bytes(shards[name], widths[name])
                return _split_fragments(shards, widths, mine), outgoing

            # Fragments go to every rank (each combines every row split's identity); a column split's slices go
            # only to the rank that rebuilds it, which receives 1/TP of what an all-gather would bring it.
            (_, outgoing), sent = _together(send, None, "send its slices of the delta's bases", lambda own: own[0])
            if any(name in columns for name in batch):
                kept, outgoing[rank] = outgoing[rank], {}  # its own slices stay here, not pickled to itself
                slices = _exchange(outgoing)
                slices[rank] = kept
            del outgoing
        held = [{name: own[name] for name in batch if name in own} for own in rows]
        found, differ, gaps = _ranged.held_identities(held, fragments, sent)
        identities.update(found)
        conflicts += differ
        uncovered += gaps
        for name in batch:  # a column split is rebuilt and hashed by one rank, which tells the others below
            if name in columns and owners[name] == rank:
                holders = [r for r, own in enumerate(everyone) if name in own]
                try:  # raised here, on one rank, the others would wait for it: it tells them instead
                    own_columns[name] = _ranged.columns_identity(
                        [everyone[r][name] for r in holders],  # type: ignore[misc]
                        [slices[r].get(name, b"") for r in holders],
                    )
                except IntegrityError:  # a rank sent a slice of another size than it holds
                    own_columns[name] = (None, "differ")
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as error:  # out of memory, a panic in the core: told, not raised alone
                    own_columns[name] = (None, f"rank {rank} could not rebuild it ({type(error).__name__}: {error})")
        del sent, slices
    if columns:
        _, told = _together(lambda: own_columns, None, "check its share of the column-split tensors", lambda own: own)
        for results in told:
            for name, (identity, problem) in sorted(results.items()):
                if identity is not None:
                    identities[name] = identity
                elif problem == "differ":
                    conflicts.append(name)
                elif problem == "uncovered":
                    uncovered.append(name)
                else:
                    raise _on_every_rank(DeltaSyncError(f"tensor {name!r}: check_base: {problem}; nothing was applied"))
    if conflicts:
        return (
            f"tensor {min(conflicts)!r}: two tensor-parallel ranks hold different bytes for the same elements of "
            "it; nothing was applied"
        )
    if uncovered:
        return (
            f"tensor {min(uncovered)!r}: the tensor-parallel ranks' slices do not cover it between them, so its "
            "base cannot be checked; nothing was applied"
        )
    for name in names:  # each is in identities, conflicts or uncovered
        if identities[name] != bases[name]:
            return (
                f"tensor {name!r}: the tensor-parallel ranks hold base {identities[name]} between them, but "
                f"the delta was made against base {bases[name]}; nothing was applied"
            )
    return None


def _slice_bytes(shard: ShardMap, width: int) -> bytes:
    """This rank's slice of a column-split tensor (elements ``width`` bytes wide), row after row, copied to the
    host."""
    rows = _shard_rows(shard, width).reshape(shard.row_count, -1)[:, : shard.col_count * width]
    return rows.cpu().numpy().tobytes()


def _split_fragments(
    shards: Mapping[str, ShardMap], widths: Mapping[str, int], mine: list[_ranged.Fragment]
) -> dict[tuple[str, int], bytes]:
    """This rank's share of the fragments of row-split tensors (``_ranged.held_fragment_plan``): its bytes of each,
    by (tensor, first byte), copied to the host; ``widths`` are the tensors' element widths."""
    out = {}
    for _, name, _, start, end in mine:
        shard = shards[name]
        offset = shard.row_start * shard.hf_cols * widths[name]
        out[(name, start)] = _shard_rows(shard, widths[name])[start - offset : end - offset].cpu().numpy().tobytes()
    return out


def _reject_lone_tied_head(params: dict[str, torch.Tensor], names: set[str]) -> None:
    """vLLM's loader rejects ``lm_head.weight`` alone on a tied model; so do we, naming the fix: send it as
    ``model.embed_tokens.weight`` (docs/vllm.md §2)."""
    head, embed = params.get("lm_head.weight"), params.get("model.embed_tokens.weight")
    if head is not None and head is embed and "lm_head.weight" in names and "model.embed_tokens.weight" not in names:
        raise BaseMismatchError(
            "tensor 'lm_head.weight': the model ties lm_head to embed_tokens; publish the change "
            "as 'model.embed_tokens.weight' (or both names with the same changes)"
        )


def _refuse_untied(model: torch.nn.Module, delta: Delta, aliases: Mapping[str, str] | None) -> None:
    """BaseMismatchError where the trainer's model ties ``alias`` to published ``name`` but this model holds the
    alias as a parameter of its own (a model served untied): the delta, which carries ``name`` only, would leave
    it at its old values. An alias the model lacks, or one the delta carries itself, is nothing to write."""
    if not aliases:
        return
    params = _params(model)
    carried = {info.name for info in delta.tensors}
    for alias, name in aliases.items():
        if alias in carried or name not in carried:
            continue
        mine = _loader_target(model, params, alias)
        if mine is None:
            continue
        theirs = _loader_target(model, params, name)
        if theirs is None or mine is theirs or (mine.data_ptr() == theirs.data_ptr() and mine.shape == theirs.shape):
            continue
        raise BaseMismatchError(
            f"tensor {alias!r} is tied to {name!r} in the trainer's model and published as it, but "
            f"{type(model).__name__} holds {alias!r} as a parameter of its own, which the delta would leave at its "
            "old values; serve the model with the trainer's tie (tie_word_embeddings); nothing was written"
        )


def _loader_target(model: torch.nn.Module, params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The parameter vLLM's loader will write for HF name ``name``, found through the model's packed modules."""
    if name in params:
        return params[name]
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapped = mapper.map_name(name)
        if mapped in params:
            return params[mapped]
    for fused, parts in (getattr(model, "packed_modules_mapping", None) or {}).items():
        for part in parts:
            candidate = name.replace(f".{part}.", f".{fused}.", 1)
            if candidate != name and candidate in params:
                return params[candidate]
    return None


def _loader_patches(model: torch.nn.Module, delta: Delta) -> tuple[list[Any], list[Any], dict[int, torch.Tensor]]:
    """The checks of the path through vLLM's loader, before anything is written: the dense and sparse patches of
    ``delta`` and the parameters they write (by id)."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import CheckpointWeightPatch

    params = _params(model)
    device = next(iter(params.values())).device
    derived = _derived_weights(model)
    dense, sparse, touched = [], [], {}
    for index, info in enumerate(delta.tensors):
        if delta.holds_differences(index):
            why = (
                "path='loader' was asked for"
                if is_mapped(model)
                else f"{type(model).__name__} is not mapped by deltasync_rs.vllm"
            )
            raise DeltaSyncError(
                f"tensor {info.name!r} holds bit-pattern differences, but {why}, so the delta goes through vLLM's "
                "loader, which needs new values: publish it with values=\"abs\" (ds.diff(..., values='abs') or "
                "Publisher(..., values='abs')); nothing was written"
            )
        if info.positions == "context":
            raise DeltaSyncError(
                f"tensor {info.name!r}: its positions are coded against the base tensor (codec 'context'), which "
                "the path through vLLM's loader does not hold: publish it with codec='compact' or 'varint'; nothing "
                "was written"
            )
        if info.shape is None:
            raise DeltaSyncError(f"tensor {info.name!r}: the delta records no shape, which vLLM's loader needs")
        dtype = _TORCH_DTYPES.get(info.dtype)
        if dtype is None:
            raise DeltaSyncError(f"tensor {info.name!r}: vLLM's loader takes floating-point patches, not {info.dtype}")
        target = _loader_target(model, params, info.name)
        if target is None:
            if any(".experts." in name for name in params):  # FusedMoE's w13_weight / w2_weight (names vary)
                raise DeltaSyncError(
                    f"tensor {info.name!r}: {type(model).__name__} has no parameter of that name: its mixture-of-"
                    "experts layers are fused (FusedMoE: all experts in one parameter), whose expert weights "
                    "deltasync_rs.vllm does not map "
                    "(docs/vllm.md, Limits); nothing was written"
                )
            raise BaseMismatchError(f"tensor {info.name!r}: {type(model).__name__} has no parameter for it")
        _vllm_cpu.check_model(model, info.name)
        if id(target) in derived and info.changed:
            raise DeltaSyncError(
                f"tensor {info.name!r}: vLLM's {derived[id(target)]} derives other weights from it when the model "
                "loads (MLA attention's W_UK/W_UV from kv_b_proj), which an update in place would leave stale; "
                "deltasync_rs.vllm does not update it (docs/vllm.md, Limits); nothing was written"
            )
        touched[id(target)] = target
        positions, values = delta.decoded(index, device=device)
        values = values.view(dtype)
        if positions is None:
            dense.append(CheckpointWeightPatch(info.name, info.shape, dtype, values))
        elif positions.numel():
            if torch.isnan(values).any():
                raise DeltaSyncError(
                    f"tensor {info.name!r}: holds NaN values, which vLLM's sparse loader reserves for 'unchanged'"
                )
            sparse.append(CheckpointWeightPatch(info.name, info.shape, dtype, values, positions))
    return dense, sparse, touched


def _apply_through_loader(
    model: torch.nn.Module, delta: Delta, patches: tuple[list[Any], list[Any], dict[int, torch.Tensor]]
) -> int:
    """vLLM's own sparse-patch loader, made all-or-nothing: ``patches`` (``_loader_patches``) checked first, the
    touched parameters restored on failure."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import load_checkpoint_weight_patches

    dense, sparse, touched = patches
    params = _params(model)
    # Parameters a sparse patch writes (a dense one, an anchor, may hold NaN as a value like any other).
    marked = {id(_loader_target(model, params, patch.name)) for patch in sparse}
    backup = {key: t.detach().clone() for key, t in touched.items()}
    with _vllm_cpu.UnpackedForLoader(model) as unpacked:
        try:
            for batch in (dense, sparse):
                if batch:
                    load_checkpoint_weight_patches(model, batch)
            # vLLM's sparse patches are whole tensors whose NaNs mean "unchanged", kept by its final `copy_`; a
            # loader that writes another way (index assignment: DBRX's and MiniCPM's experts) writes the NaNs.
            poisoned = [
                key
                for key, t in touched.items()
                if key in marked and bool((torch.isnan(t) & ~torch.isnan(backup[key])).any())
            ]
            if poisoned:
                names = [n for n, p in params.items() if id(p) in poisoned]
                raise DeltaSyncError(
                    f"the loader wrote NaN into {names[:3]}: it writes them another way than the final copy_ that "
                    "vLLM's sparse patches need"
                )
        except Exception as exc:
            with torch.no_grad():
                for key, saved in backup.items():
                    touched[key].data.copy_(saved)
            raise DeltaSyncError(
                f"vLLM's loader failed ({type(exc).__name__}: {exc}); the weights were restored"
            ) from exc
        unpacked.restore(list(touched.values()))
    return sum(info.changed for info in delta.tensors)


def _derived_weights(model: torch.nn.Module) -> dict[int, str]:
    """Parameters (by id) from which vLLM derives other weights when the model loads, which an in-place update
    would leave stale: MLA attention's ``kv_b_proj`` (its W_UK/W_UV), by the layer's class name."""
    derived: dict[int, str] = {}
    for module in model.modules():
        if any(kind.__name__ == "MLAAttention" for kind in type(module).__mro__):
            weight = getattr(getattr(module, "kv_b_proj", None), "weight", None)
            if isinstance(weight, torch.Tensor):
                derived[id(weight)] = f"{type(module).__name__} (kv_b_proj)"
    return derived


def _load_all(sources: Iterable[Source]) -> list[Delta]:
    deltas = [s if isinstance(s, Delta) else load(s) for s in sources]
    for previous, current in zip(deltas, deltas[1:]):
        if current.base_step is not None and previous.step is not None and current.base_step != previous.step:
            raise BaseMismatchError(
                f"the deltas do not chain: step {previous.step} is followed by a delta that "
                f"applies to step {current.base_step}; nothing was written"
            )
    return deltas


#: Elements of each parameter a step tracker samples to notice weights written by something other than deltasync.
MARK_SAMPLES = 4096


class _StepTracker:
    """Applies deltas in order to one model and tracks the step it is at (None: unknown, only anchors apply).

    The step is bookkeeping: vLLM can put other weights in place (``reload_weights``, a wake-up from a level-2 sleep
    reloading the checkpoint, any ``load_weights`` call), and deltas of differences applied onto those would give
    weights of no step at all. So whenever the weights are known to be at the step (after each apply, or when the
    step is declared), the tracker keeps a sample of every parameter (``MARK_SAMPLES`` elements in runs spread over
    it, their bits), and before the next apply compares it with the weights: where they changed, the step is forgotten (a pull
    starts from an anchor; explicit files are refused). A reload to a checkpoint a step or more away changes about 1%
    of a parameter's elements or more, so one of 4,096 sampled elements catches it all but surely."""

    def __init__(self, current_step: int | None = None) -> None:
        self._step = current_step
        #: The manifest entry of ``current_step`` when a pull brought the model there: the next pull's first delta
        #: must name that very entry as its base, not another entry of that step number (a store emptied and
        #: published into again by a new run has its own step 3). None when the step came any other way.
        self.entry: Any = None
        #: Each parameter's sampled positions and their bits when the weights were last known at the step.
        self._marks: dict[str, tuple[int, Any, Any]] | None = None
        self._indexes: dict[tuple[str, int, Any], Any] = {}
        #: Manifest entries (by SHA-256) of anchors a pull found wrong (Subscriber._refused_anchors): each pull's
        #: subscriber is new, and no later pull downloads such an anchor again.
        self.refused_anchors: set[str] = set()

    @property
    def current_step(self) -> int | None:
        return self._step

    @current_step.setter
    def current_step(self, step: int | None) -> None:
        self._step = step
        self.entry = None  # set by hand or reached by other deltas: no entry is known for it
        self._marks = None

    def mark(self, model: torch.nn.Module) -> None:
        """Samples the weights, which are at ``current_step`` now."""
        marks = {}
        for name, flat in _sampled_parameters(model).items():
            key = (name, flat.numel(), flat.device)
            index = self._indexes.get(key)  # the same positions as last time
            if index is None:
                index = self._indexes[key] = _mark_index(flat.numel(), flat.device)
            marks[name] = (flat.numel(), index, _sample(flat, index))
        self._marks = marks

    def changed_outside(self, model: torch.nn.Module) -> list[str]:
        """The parameters whose sampled bits are not those of the last mark (the weights were written by something
        other than this tracker since), or that came, went or changed size; [] when unmarked. On a device, one
        comparison of every sample at once (one synchronisation), each parameter's only where they differ."""
        if self._marks is None or self._step is None:
            return []
        params = _sampled_parameters(model)
        changed = sorted(set(self._marks) ^ set(params))
        changed += [n for n, (numel, _, _) in self._marks.items() if n in params and params[n].numel() != numel]
        if changed:
            return sorted(set(changed))
        on_devices: dict[Any, list[str]] = {}
        for name, (_, index, then) in self._marks.items():
            if isinstance(then, np.ndarray):
                if not np.array_equal(_sample(params[name], index), then):
                    changed.append(name)
            else:
                on_devices.setdefault(params[name].device, []).append(name)
        for names in on_devices.values():
            now = [_sample(params[n], self._marks[n][1]) for n in names]
            joined = torch.cat([t.reshape(-1).view(torch.uint8) for t in now])
            if not torch.equal(joined, torch.cat([self._marks[n][2].reshape(-1).view(torch.uint8) for n in names])):
                changed += [n for n, t in zip(names, now) if not torch.equal(t, self._marks[n][2])]
        return changed

    def forget_if_changed(
        self, model: torch.nn.Module, *, together: bool, also: Callable[[], Any] | None = None
    ) -> Any:
        """Forgets the step (and its entry) where the weights changed outside deltasync since the last mark; with
        ``together`` at TP > 1 every rank forgets where any rank's weights changed. ``also()`` (a read of the store
        a pull needs) runs in the same step, so that a rank it fails on fails every rank, as none is left waiting
        in a later all-gather. Returns what ``also()`` returned."""

        def work() -> tuple[list[str], Any]:
            return self.changed_outside(model), (also() if also is not None else None)

        if together:
            (changed, extra), flags = _together(work, self._step, "check its weights", lambda done: bool(done[0]))
        else:
            (changed, extra), flags = work(), []
        if changed or any(flags):
            log.warning(
                "the weights at step %s changed since deltasync wrote them (%s: reloaded by vLLM?); the step is "
                "forgotten, and the next pull starts from an anchor",
                self._step,
                ", ".join(changed[:3]) + (" ..." if len(changed) > 3 else "") if changed else "on another rank",
            )
            self.current_step = None
        return extra

    def apply(
        self,
        model: torch.nn.Module,
        deltas: Sequence[Delta],
        *,
        path: str = "auto",
        check_base: bool = False,
        entries: Callable[[int], Any] | None = None,
    ) -> int | None:
        """Applies ``deltas`` in order, the step moving with each; with ``entries`` (a pull's subscriber's
        ``entry``, which read and verified them on the way) the entry of each step reached is kept too, so that a
        pull that fails part way leaves the model at a step whose entry is known, and the next pull's way on must
        start from it. Every caller compares the weights with the sample first (``forget_if_changed``), all ranks
        together."""
        self._apply_all(model, deltas, path=path, check_base=check_base, entries=entries)
        return self.current_step

    def _apply_all(
        self,
        model: torch.nn.Module,
        deltas: Sequence[Delta],
        *,
        path: str,
        check_base: bool,
        entries: Callable[[int], Any] | None,
    ) -> None:
        for delta in deltas:
            _check_linked(delta, self.current_step)
            apply_delta(
                model,
                delta,
                current_step=self.current_step,
                path=path,
                check_base=check_base and not delta.is_anchor,
                aliases=_entry_aliases(entries, delta),
            )
            # A file that names no step leaves weights of no known step.
            self.current_step = delta.step
            if delta.step is not None:
                # After each delta applied whole: one that failed after writing (a repack that raised) leaves the
                # sample of the step before, which the weights no longer match, so the next pull takes an anchor.
                self.mark(model)
                if entries is not None:
                    try:
                        self.entry = _entry_of(delta, entries)  # the one its file was verified against
                    except DeltaSyncError as error:  # the weights are at the step all the same
                        log.warning(
                            "step %d: its entry did not read back (%s); the next pull cannot check its link",
                            delta.step,
                            error,
                        )

    def pull(
        self,
        model: torch.nn.Module,
        store: Any,
        until: int | None,
        signing_key: Any = None,
        *,
        path: str = "auto",
        check_base: bool = False,
        max_age: float | None = None,
    ) -> int | None:
        from .sync import Subscriber

        # A rank of a mapped model at TP > 1 reads, of an anchor, only the verified pieces its own shard needs.
        ranges = anchor_ranges(model) if path != "loader" and _tensor_parallel() > 1 and is_mapped(model) else None
        subscriber = Subscriber(store, signing_key=signing_key, anchor_ranges=ranges, max_age=max_age)
        subscriber._refused_anchors = self.refused_anchors
        held = self.entry

        def run() -> Any:  # the store's run, where the entry held names one
            return subscriber.run if held is not None and held.run is not None else None

        # Weights put in place by vLLM: from an anchor. The run is read in the same step on every rank.
        store_run = self.forget_if_changed(model, together=True, also=run)
        start = self.current_step
        if self.entry is not None and self.entry.step == start:
            if self.entry.run is not None and store_run not in (None, self.entry.run):
                # The store holds another run now (emptied and published into again): its steps, even those
                # before this one, are not this model's history. The new run is followed from its anchor.
                log.warning(
                    "%s holds run %s, not run %s of the step %d this worker holds; following the new run from its "
                    "anchor",
                    subscriber.store.url,
                    store_run,
                    self.entry.run,
                    start,
                )
                start = None
            else:
                # The way on from this step must start from the very entry the model holds; where it does not (a
                # step published again), the subscriber takes an anchor instead.
                subscriber._at = self.entry

        # The deltas' bit-packed streams are checked as they are decoded for the apply, not decoded twice.
        def anchor_entry(step: int) -> Entry:
            return subscriber.entry(step)

        deltas, until = _agreed(
            subscriber._fetch_checked_by_the_apply,
            start,
            until,
            subscriber._refused_anchors,
            anchor_entry,
            subscriber._entries.clear,
        )
        try:
            step = self.apply(model, deltas, path=path, check_base=check_base, entries=subscriber.entry)
        except DeltaFormatError as error:
            # As in Subscriber.pull: nothing of the delta with the malformed stream was written (the step is the one
            # before it). Read the way on again with every file checked first, which takes a way around the file.
            log.warning(
                "%s; reading the way from step %s again with every stream checked first", error, self.current_step
            )
            if self.entry is not None and self.entry.step == self.current_step:
                subscriber._at = self.entry
            deltas, _ = _agreed(
                lambda at, to: subscriber.fetch(at, until=to),
                self.current_step,
                until,
                subscriber._refused_anchors,
                anchor_entry,
                subscriber._entries.clear,
            )
            step = self.apply(model, deltas, path=path, check_base=check_base, entries=subscriber.entry)
        return step


def _entry_aliases(entries: Callable[[int], Any] | None, delta: Delta) -> Mapping[str, str] | None:
    """The ties ``delta``'s manifest entry lists (the entry its file was verified against, else the one ``entries``
    reads of its step), if known."""
    if isinstance(getattr(delta, "_entry", None), Entry):
        return delta._entry.aliases
    if entries is None or delta.step is None:
        return None
    try:
        return entries(delta.step).aliases
    except DeltaSyncError:
        return None  # read (and its error raised) by the pull itself, or logged after the apply


def _agreed(
    fetch: Callable[[int | None, int | None], list[Delta]],
    current_step: int | None,
    until: int | None,
    refused: set[str] | None = None,
    anchor_entry: Callable[[int], Entry] | None = None,
    forget_entries: Callable[[], None] | None = None,
) -> tuple[list[Delta], int | None]:
    """``fetch(current_step, until)``, agreed on by every tensor-parallel rank: they pull together (collective_rpc),
    and must end at the same step, or their shards would hold different steps (``until=None`` is the newest step
    each rank finds, which a publish between two ranks' reads makes differ). The ranks all-gather where they start
    and the step they reached; the ranks ahead fetch again up to the step all reached. A failed fetch on any rank
    makes every rank raise before anything is applied. The ranks must also start from the same anchor (or none):
    the anchors one rank refused (``refused``, the entries of wrong anchors it saw in the tensors it read whole) are
    refused by every rank and the ranks fetch again; ranks that still start from different anchors (one could not
    read an anchor another took) raise together. A tensor of the anchor that no rank read whole (a row split: each
    rank read its own rows) is checked by the ranks together against the first delta's base identity
    (``_split_anchor_error``), or, where no delta follows the anchor, the state digest of its entry
    (``anchor_entry(step)``) is made by the ranks together (``_split_digest_error``); a wrong anchor is refused on
    every rank, and they fetch again. With ``anchor_entry`` (the verified manifest entry of a step) the ranks also
    compare the entries of the steps they fetched: ranks that reached the same step by different entries (the store
    was published into between their reads) hold different files, so they forget the entries they cached
    (``forget_entries``) and fetch again. Returns the deltas and the agreed step (``until`` at TP 1)."""
    refused = set() if refused is None else refused

    def summary(fetched: list[Delta]) -> tuple[int | None, int | None, list[str], list[str]]:
        reached = next((d.step for d in reversed(fetched) if d.step is not None), current_step)
        anchor = fetched[0].step if fetched and fetched[0]._whole_state else None
        # What each rank verified its files against: one entry's SHA-256 binds its files' (or pieces').
        if anchor_entry is None or _tensor_parallel() <= 1:
            return reached, anchor, sorted(refused), []
        # The entry each file was verified against, as the fetch recorded it (an entry read again here could be
        # another: one evicted from the subscriber's cache and published again since).
        read = [_entry_of(d, anchor_entry).sha256 for d in fetched if d.step is not None]
        return reached, anchor, sorted(refused), read

    tries = 0  # fetches that ended at different steps, or at one by different entries; a fetch whose anchor is
    # refused does not count (each refusal adds an anchor to `refused`, which no way starts from again, so they end)
    while tries < 3:

        def fetch_to(to: int | None = until) -> list[Delta]:
            return fetch(current_step, to)

        deltas, summaries = _together(fetch_to, current_step, "fetch the deltas", summary)
        reached = [step for step, _, _, _ in summaries]
        same_start = len({anchor for _, anchor, _, _ in summaries}) == 1
        if len(set(reached)) == 1 and same_start and len({tuple(read) for _, _, _, read in summaries}) > 1:
            # The same way by other entries: other files. Fetch again, every entry read afresh.
            log.warning("the tensor-parallel ranks read different manifest entries on the way to step %s", reached[0])
            if forget_entries is not None:
                forget_entries()
            tries += 1
            continue
        if len(set(reached)) == 1:
            if not same_start:
                seen = set().union(*(set(shas) for _, _, shas, _ in summaries))
                if any(set(shas) != seen for _, _, shas, _ in summaries):
                    refused |= seen  # every rank refuses what one refused, and all fetch again
                    continue
                starts = ", ".join(
                    f"rank {rank}: {'no anchor' if anchor is None else f'the anchor of step {anchor}'}"
                    for rank, (_, anchor, _, _) in enumerate(summaries)
                )
                raise _on_every_rank(
                    IntegrityError(
                        f"the tensor-parallel ranks reached step {reached[0]} from different anchors ({starts}): one "
                        "refused or could not read an anchor another took; none applied"
                    )
                )
            anchor_step = summaries[0][1]
            if anchor_entry is not None and anchor_step is not None and _tensor_parallel() > 1:
                entry = _entry_of(deltas[0], anchor_entry)
                if len(deltas) > 1:
                    wrong = _split_anchor_error(deltas[0], deltas[1], current_step)
                else:
                    wrong = _split_digest_error(deltas[0], entry.state_digest, current_step)
                if wrong is not None:
                    if entry.sha256 in refused:  # never expected: a refused anchor is not taken again
                        raise _on_every_rank(IntegrityError(f"{wrong}; that anchor was refused before; none applied"))
                    log.warning("%s; that anchor is not used", wrong)
                    refused.add(entry.sha256)
                    continue
            return deltas, until
        until = min(reached, key=lambda step: -1 if step is None else step)
        tries += 1
    raise _on_every_rank(
        DeltaSyncError(
            "the tensor-parallel ranks did not reach the same step by the same manifest entries in three fetches "
            "(the store was published into as they read it); none applied"
        )
    )


def _entry_of(delta: Delta, read: Callable[[int], Entry]) -> Entry:
    """The manifest entry ``delta``'s file was verified against, as its fetch recorded it; else ``read`` of its
    step (an entry read again could be another: evicted from the subscriber's cache and published again since)."""
    entry = getattr(delta, "_entry", None)
    if isinstance(entry, Entry):
        return entry
    assert delta.step is not None
    return read(delta.step)


def _split_anchor_error(anchor: Delta, first: Delta, current_step: int | None) -> str | None:
    """At TP > 1, why ``anchor`` is not the state ``first`` (the delta after it) was made against, found in the
    tensors that no rank read whole: each rank holds some rows of such a tensor (a row split reads only those), the
    ranks all-gather the hashes of the 256 KiB blocks they hold whole and the bytes of those that none holds whole,
    and every rank combines them into the tensor's base identity (docs/format.md §3.1) and compares it with the one
    ``first`` records. None where all agree; the same answer on every rank (each rank checks the tensors it read
    whole alone, in the fetch). A few KiB per GiB of anchor cross, plus at most one block per rank boundary that
    falls inside a block."""
    bases = {name: first.base_identity(index) for index, name in enumerate(first.names)}
    wanted = [name for name, base in bases.items() if base is not None]
    _, everyone = _together(
        lambda: _ranged.held_tensors(anchor, wanted), current_step, "hash its part of the anchor", lambda held: held
    )
    plan = _ranged.fragment_plan(everyone)
    sent: list[Any] = []
    if plan:  # the same on every rank
        rank = _tp_rank()
        _, sent = _together(
            lambda: _ranged.fragments(anchor, plan, rank), current_step, "send its part of the anchor", lambda own: own
        )
    identities, conflicts = _ranged.split_identities(everyone, plan, sent)
    step = f"the anchor of step {anchor.step}"
    if conflicts:
        return _read_differently(conflicts[0], anchor)
    for name, identity in sorted(identities.items()):
        if identity != bases[name]:
            return (
                f"the delta of step {first.step} was not made against the state {step} gives (tensor {name!r}, "
                f"read in parts by the tensor-parallel ranks: base {identity}, the delta was made against "
                f"{bases[name]})"
            )
    return None


def _read_differently(name: str, anchor: Delta) -> str:
    return f"the tensor-parallel ranks read different bytes of tensor {name!r} of the anchor of step {anchor.step}"


def _split_digest_error(anchor: Delta, state_digest: str, current_step: int | None) -> str | None:
    """At TP > 1, where no delta follows ``anchor`` on the way: why it does not make ``state_digest``, its entry's,
    found by the ranks together; None where it does, or where a rank read it whole (that rank checked it alone, in
    the fetch). Each rank hashes the tensors it read whole (docs/format.md §10: the state digest is over every
    tensor's own XXH3-128); a tensor no rank read whole is hashed by the ranks in turn, each feeding its own bytes
    of it, in order, into the hash the previous one handed on (core::digest::TensorHashParts: a few hundred bytes
    per tensor per turn cross, not the bytes); tensors start in staggered turns (``_ranged.hash_turns``), so that
    the ranks hash side by side rather than one after another. The same answer on every rank."""
    from ._core import combine_hashes, tensor_hash_begin, tensor_hash_feed, tensor_hash_finish, tensor_hashes

    infos = {info.name: info for info in anchor.tensors}

    def local() -> tuple[bool, dict[str, Any], dict[str, bytes]]:
        if not isinstance(anchor, PartialAnchor):
            return False, {}, {}
        held = _ranged.held_tensors(anchor, list(infos), hashes=False)
        whole = [name for name, part in held.items() if part is None]
        views = [anchor.tensor_view(name, 0, infos[name].nbytes) for name in whole]
        try:
            entries: list[tuple[str, str, list[int], Any]] = [
                (name, infos[name].dtype, list(infos[name].shape or ()), view)
                for name, view in zip(whole, views, strict=True)
            ]
            return True, held, dict(zip(whole, tensor_hashes(entries), strict=True))
        finally:
            for view in views:
                view.release()

    _, everyone = _together(local, current_step, "hash the anchor's tensors it read whole", lambda mine: mine)
    if not all(partial for partial, _, _ in everyone):
        return None
    found: dict[str, bytes] = {}
    for _, _, hashes in everyone:
        for name, hash_ in hashes.items():
            if found.setdefault(name, hash_) != hash_:
                return _read_differently(name, anchor)
    differ = _ranged.differently_sized([held for _, held, _ in everyone])
    if differ:  # parts of one tensor of different sizes: parts of different anchors
        return _read_differently(differ[0], anchor)
    cuts = _ranged.segments([held for _, held, _ in everyone])
    unread = sorted(name for name, cut in cuts.items() if cut is None) + sorted(set(infos) - set(found) - set(cuts))
    if unread:  # the digest cannot be made here
        log.warning(
            "the anchor of step %s is not checked against its entry's state digest: no tensor-parallel rank read "
            "all of %s",
            anchor.step,
            ", ".join(repr(name) for name in unread[:3]) + (f" and {len(unread) - 3} more" if len(unread) > 3 else ""),
        )
        return None
    rank = _tp_rank()
    split = {name: cut for name, cut in cuts.items() if cut is not None}  # every one, the unread being refused above
    states: dict[str, bytes] = {}
    for turn in _ranged.hash_turns(split, len(everyone)):

        def hash_mine(turn: list[tuple[str, int]] = turn) -> dict[str, bytes]:
            def one(segment: tuple[str, int]) -> bytes:
                name, index = segment
                cut, info = split[name], infos[name]
                state = tensor_hash_begin(info.dtype, list(info.shape or ())) if index == 0 else states[name]
                with anchor.tensor_view(name, cut[index][1], cut[index][2]) as view:  # type: ignore[attr-defined]
                    state = tensor_hash_feed(state, view)
                return tensor_hash_finish(state) if index == len(cut) - 1 else state

            mine = [(name, index) for name, index in turn if split[name][index][0] == rank]
            # One segment is one stream; the tensors side by side (the core releases the GIL as it hashes).
            with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
                return {name: state for (name, _), state in zip(mine, pool.map(one, mine), strict=True)}

        _, handed = _together(hash_mine, current_step, "hash its part of the anchor", lambda mine: mine)
        ended = {name for name, index in turn if index == len(split[name]) - 1}
        for part in handed:
            for name, value in part.items():
                (found if name in ended else states)[name] = value
    digest = combine_hashes(sorted(found.items()))
    if digest == state_digest:
        return None
    return (
        f"the tensors of the anchor of step {anchor.step}, read in parts by the tensor-parallel ranks, do not make "
        f"the state digest of its entry ({digest}, the entry says {state_digest})"
    )


def _together(
    work: Callable[[], Any], current_step: int | None, what: str, summary: Callable[[Any], Any] = lambda _: None
) -> tuple[Any, list[Any]]:
    """Runs ``work()`` on this rank. At TP > 1 the ranks then all-gather whether it worked, the step each is at and
    ``summary`` of what it returned; every rank raises if any failed, or if they are at different steps (they would
    apply different deltas, and a `context` delta's exchange would wait for a rank that never joins it). Returns
    the result and every rank's summary, in rank order (only this rank's at TP 1)."""
    if _tensor_parallel() <= 1:
        result = work()
        return result, [summary(result)]
    try:
        result = work()
        mine: tuple[Any, ...] = ("ok", current_step, summary(result))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # a panic in the core is a BaseException: the others must not wait for this rank
        _all_gather(("failed", current_step, (type(error).__name__, f"{type(error).__name__}: {error}")))
        _on_every_rank(error)  # the others raise too, having gathered that this rank failed
        raise
    everyone = _all_gather(mine)
    for rank, (status, _, detail) in enumerate(everyone):
        if status == "failed":
            # The failed rank's kind of error, so that every rank takes the same way on (a pull reads a delta with a
            # malformed stream again, checked first, on DeltaFormatError).
            kinds = (DeltaFormatError, BaseMismatchError, StaleStoreError, ChainError)
            kind = {k.__name__: k for k in kinds}.get(detail[0], DeltaSyncError)
            raise _on_every_rank(
                kind(f"tensor-parallel rank {rank} could not {what} ({detail[1]}); nothing was applied")
            )
    if len({start for _, start, _ in everyone}) > 1:
        raise _on_every_rank(
            BaseMismatchError(
                "the tensor-parallel ranks are at different steps "
                f"({', '.join(f'rank {r}: {start}' for r, (_, start, _) in enumerate(everyone))}); set the step "
                "(deltasync_set_step) or pull from an anchor; none applied"
            )
        )
    return result, [detail for _, _, detail in everyone]


_EVERY_RANK = "_deltasync_on_every_rank"


def _on_every_rank(error: BaseException) -> BaseException:
    """Marks ``error`` as one that every tensor-parallel rank raises in the same call (decided together, or from
    arguments and state they share), which ``_one_reply_per_failure`` may then let the last rank alone raise."""
    setattr(error, _EVERY_RANK, True)
    return error


def _one_reply_per_failure(method: Callable[..., Any]) -> Callable[..., Any]:
    """A worker extension method called by ``collective_rpc``: where every rank raises the same refusal, only the
    rank whose reply vLLM reads last raises it, and the others return None (logging it).

    vLLM's multiprocess executor reads the workers' replies in rank order and raises at the first failure, leaving
    the later ranks' replies unread: the next call then returned the previous call's replies (a
    ``deltasync_set_step(5)`` answered ``[5, 2]``), or raised the previous call's error. With the last rank alone
    raising, every reply is read and the caller still gets the error. A failure that not every rank shares still
    raises wherever it happens. Only under that executor (``distributed_executor_backend="mp"``, one node, no
    pipeline stages); under any other (``external_launcher``, where each process reads only its own worker's reply,
    Ray, uni) every rank raises."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as error:
            if _left_to_the_last_rank(error, getattr(self, "vllm_config", None)):
                log.error("%s: %s (raised by the last tensor-parallel rank)", method.__name__, error)
                return None
            raise

    return call


def _end_refused_update(engine: WeightTransferEngine[Any, Any], error: BaseException) -> bool:
    """On a rank whose reply vLLM reads before the last one's, ends the native API's weight update that ``error``
    (a refusal every rank shares) refused, as vLLM's worker does where ``update_weights`` raises; True where it did,
    and the rank may then return instead of raising.

    vLLM keeps an "update active" flag per worker and clears it only on a rank whose ``update_weights`` raised; a
    rank that returned would stay in the update (its next ``start_weight_update`` refused), while a rank that raised
    before the last leaves the later ranks' replies unread (``_one_reply_per_failure``). The flag lives on the
    worker, which calls this engine's ``update_weights`` and holds it as ``weight_transfer_engine``: it is looked for
    among the callers' frames. False (raise on every rank, as before) where it is not found, under another vLLM."""
    if not _left_to_the_last_rank(error, getattr(engine, "vllm_config", None)):
        return False
    frame: FrameType | None = sys._getframe(1)
    worker: Any = None
    for _ in range(8):
        if frame is None:
            return False
        worker = frame.f_locals.get("self")
        if getattr(worker, "weight_transfer_engine", None) is engine and isinstance(
            getattr(worker, "_weight_update_active", None), bool
        ):
            break
        frame = frame.f_back
    else:
        return False
    worker._weight_update_active = False
    reset = getattr(engine, "reset_weight_update_target", None)
    if reset is not None:
        reset()
    return True


def _left_to_the_last_rank(error: BaseException, vllm_config: Any) -> bool:
    """True where ``error`` is a refusal every rank shares and this rank's reply is read before the last one's: the
    last rank alone raises it."""
    return bool(getattr(error, _EVERY_RANK, False)) and _replies_before_the_last(vllm_config)


def _replies_before_the_last(vllm_config: Any) -> bool:
    """True on a worker whose ``collective_rpc`` reply vLLM's multiprocess executor reads before the last one's."""
    parallel = getattr(vllm_config, "parallel_config", None)
    tp = _tensor_parallel()
    if (
        parallel is None
        or getattr(parallel, "distributed_executor_backend", None) != "mp"
        or getattr(parallel, "pipeline_parallel_size", 1) != 1
        or getattr(parallel, "nnodes", 1) != 1
        or getattr(parallel, "world_size", tp) != tp  # other groups (context parallel) among the executor's workers
        or tp <= 1
    ):
        return False
    from vllm.distributed import parallel_state

    group = parallel_state.get_tp_group()
    return bool(group.rank_in_group < group.world_size - 1)


def _tp_rank() -> int:
    """This worker's rank in vLLM's tensor-parallel group."""
    from vllm.distributed import parallel_state

    return int(parallel_state.get_tp_group().rank_in_group)


def _all_gather(mine: Any) -> list[Any]:
    """Every tensor-parallel rank's ``mine``, in rank order, over vLLM's tensor-parallel CPU (gloo) group."""
    from vllm.distributed import parallel_state

    group = parallel_state.get_tp_group()
    everyone: list[Any] = [None] * group.world_size
    torch.distributed.all_gather_object(everyone, mine, group=group.cpu_group)
    return everyone


def _exchange(outgoing: list[Any]) -> list[Any]:
    """Sends ``outgoing[r]`` to tensor-parallel rank ``r`` alone, over vLLM's tensor-parallel CPU (gloo) group, and
    returns what every rank sent this one, in rank order: one gather to each rank in turn, each rank receiving only
    what is meant for it (an all-gather would bring every rank everything)."""
    from vllm.distributed import parallel_state

    group = parallel_state.get_tp_group()
    rank = group.rank_in_group
    received: list[Any] = [None] * group.world_size
    for owner in range(group.world_size):
        into = received if owner == rank else None
        torch.distributed.gather_object(outgoing[owner], into, group=group.cpu_group, group_dst=owner)
    return received


def _tensor_parallel() -> int:
    """This process's tensor-parallel world size (1 when vLLM's parallel state is not set up)."""
    from vllm.distributed import parallel_state

    try:
        return int(parallel_state.get_tensor_model_parallel_world_size())
    except (AssertionError, AttributeError, RuntimeError):
        return 1


#: A parameter's sampled elements come in runs of this many consecutive ones (two cache lines of bf16), spread over
#: it: a reload that changes 1% of the elements is caught as surely, with 64 times fewer cache misses.
MARK_RUN = 64


def _mark_index(numel: int, device: Any) -> Any:
    """The positions a step tracker samples of a parameter of ``numel`` elements: all of a small one, else
    ``MARK_SAMPLES`` in runs of ``MARK_RUN`` spread evenly over it, the last run ending at its last element. A
    numpy array for a parameter in host memory (numpy's gathers run on the calling thread: torch's small parallel
    ones took 100x longer on a busy host), else a tensor on its device."""
    if numel <= MARK_SAMPLES:
        index = np.arange(numel, dtype=np.int64)
    else:
        starts = np.linspace(0, numel - MARK_RUN, MARK_SAMPLES // MARK_RUN).astype(np.int64)
        index = (starts[:, None] + np.arange(MARK_RUN, dtype=np.int64)[None, :]).reshape(-1)
    return index if device.type == "cpu" else torch.from_numpy(index).to(device)


def _sampled_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters a step tracker samples, flat: each memory once (a CPU-backend layer's kept weight is also a
    registered parameter; tied weights are one), under the first name it has; none on the meta device."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[Any, ...]] = set()
    for name, param in _params(model).items():
        if param.numel() == 0 or param.device.type == "meta":  # no data to sample (a layer not materialised)
            continue
        memory = (param.device, param.data_ptr(), param.numel(), param.dtype)
        if memory not in seen:
            seen.add(memory)
            out[name] = param.detach().reshape(-1)
    return out


def _sample(flat: torch.Tensor, index: Any) -> Any:
    """The bits of ``flat`` at ``index``: a numpy array for a parameter in host memory, else a tensor."""
    if isinstance(index, np.ndarray):
        return _bits(flat).numpy()[index]
    return _bits(flat[index]).clone()


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """A floating-point tensor's bit patterns (NaNs compare equal to themselves); other tensors as they are."""
    return tensor.view(_write.int_dtype(tensor.element_size())) if tensor.is_floating_point() else tensor


def _tracker_for(model: torch.nn.Module) -> _StepTracker:
    """The step tracker of one worker's model, shared by the worker extension and the weight-transfer engine, so
    that updates through either way see the step the other reached."""
    tracker = getattr(model, "_deltasync_tracker", None)
    if tracker is None:
        tracker = _StepTracker()
        object.__setattr__(model, "_deltasync_tracker", tracker)
    return tracker


class DeltaSyncWorkerExtension:
    """Mixed into every vLLM worker by ``--worker-extension-cls deltasync_rs.vllm.DeltaSyncWorkerExtension``.

    Call its methods with ``llm.collective_rpc(name, args=...)``: each worker applies the changes of its own shard
    and returns the step it is at. The caller resets the prefix cache afterwards (``llm.reset_prefix_cache()``).
    """

    def _deltasync_tracker(self) -> _StepTracker:
        return _tracker_for(self._deltasync_model())

    model_runner: Any  # the vLLM worker's, once this class is mixed into it

    def _deltasync_model(self) -> torch.nn.Module:
        # get_model() unwraps what the runner wraps the model in (CUDAGraphWrapper with full CUDA graphs), as the
        # weight-transfer engine's model is: one model, one step tracker, either way in.
        runner = self.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        while not isinstance(model, torch.nn.Module) and callable(getattr(model, "unwrap", None)):
            model = model.unwrap()  # a runner without get_model holding a wrapper
        return model

    def deltasync_step(self) -> int | None:
        """The step this worker's weights are at (None until an anchor or ``deltasync_set_step``)."""
        return self._deltasync_tracker().current_step

    @_one_reply_per_failure
    def deltasync_set_step(self, step: int | None) -> int | None:
        """Declares the step the served weights are at (e.g. the trainer's step 0 checkpoint)."""
        step = _step_argument(step, "step")
        tracker = self._deltasync_tracker()
        tracker.current_step = step
        if step is not None:
            tracker.mark(self._deltasync_model())  # the weights as declared: checked before the next apply
        return step

    @_one_reply_per_failure
    def deltasync_apply(self, sources: Sequence[Source], path: str = "auto", check_base: Any = False) -> int | None:
        """Applies delta files (paths or bytes) in order; each is all-or-nothing. Returns the new step.
        ``path`` and ``check_base`` are as for :func:`apply_delta`."""
        if isinstance(sources, (str, bytes, bytearray, memoryview, os.PathLike, Delta)):
            sources = [sources]
        tracker = self._deltasync_tracker()
        tracker.forget_if_changed(self._deltasync_model(), together=True)  # then refused together, unless anchors
        # At TP > 1 every rank loads the same files and must be at the same step: checked together, before any apply.
        deltas, _ = _together(
            lambda: _load_onto(sources, tracker.current_step), tracker.current_step, "load the delta files"
        )
        with torch.no_grad():
            return tracker.apply(self._deltasync_model(), deltas, path=path, check_base=_flag(check_base))

    @_one_reply_per_failure
    def deltasync_pull(
        self,
        store: Any,
        step: int | str | None = None,
        signing_key: Any = None,
        path: str = "auto",
        check_base: Any = False,
        max_age: Any = None,
    ) -> int | None:
        """Fetches the verified chain from ``store`` up to ``step`` (latest by default) and applies it.
        ``path`` and ``check_base`` are as for :func:`apply_delta`; ``max_age`` (seconds) as for ``Subscriber``: a
        store whose newest step was published longer ago is refused (StaleStoreError), nothing applied.

        ``step``, ``check_base`` and ``max_age`` may be strings: vLLM's dev-mode ``/collective_rpc`` route passes
        only strings."""
        step = _step_argument(step, "step")
        max_age = _seconds_argument(max_age, "max_age")
        with torch.no_grad():
            return self._deltasync_tracker().pull(
                self._deltasync_model(),
                store,
                step,
                signing_key,
                path=path,
                check_base=_flag(check_base),
                max_age=max_age,
            )


def _seconds_argument(value: Any, name: str) -> float | None:
    """``value`` (seconds, above 0; a string from the dev-mode HTTP route too) as a float, or None; else a
    DeltaSyncError every rank raises alike (the same argument reached each)."""
    if value is None:
        return None
    try:
        seconds = float(value) if isinstance(value, str) and value.strip() else value
    except ValueError:
        seconds = value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):
        raise _on_every_rank(DeltaSyncError(f"{name} must be a number of seconds above 0, not {shown(value)}"))
    return float(seconds)


def _step_argument(value: Any, name: str) -> int | None:
    """A step argument: None, a step number, or (through vLLM's HTTP routes) its decimal string, "" for None."""
    if isinstance(value, str):
        text = value.strip()
        if text and not (text.isascii() and text.isdigit()):
            raise _on_every_rank(DeltaSyncError(f"{name} must be a step number, not {shown(value)}"))
        value = int(text) if text else None
    try:
        return _check_step(value, name)
    except DeltaSyncError as error:  # every rank has the same arguments
        raise _on_every_rank(error) from None


def _flag(value: Any) -> bool:
    """A boolean argument that may arrive as a string through vLLM's HTTP routes."""
    if isinstance(value, str):
        if value.strip().lower() not in ("", "0", "false", "1", "true"):
            raise _on_every_rank(DeltaSyncError(f"expected a boolean, not {shown(value)}"))
        return value.strip().lower() in ("1", "true")
    return bool(value)


@dataclass
class DeltaSyncInitInfo(WeightTransferInitInfo):
    """``init_weight_transfer_engine`` info: the default store and the step the served weights are at; ``max_age``
    (seconds) refuses a store whose newest step was published longer ago (as ``Subscriber``'s)."""

    store: str | None = None
    current_step: int | None = None
    signing_key: str | None = None
    max_age: float | None = None


@dataclass
class DeltaSyncUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights`` info: pull ``store`` (or the init store) up to ``step``, or apply ``paths`` in order."""

    store: str | None = None
    step: int | None = None
    paths: list[str] | None = None
    path: str = "auto"
    check_base: bool = False


class DeltaSyncWeightTransferEngine(WeightTransferEngine[DeltaSyncInitInfo, DeltaSyncUpdateInfo]):
    """The ``deltasync`` backend of vLLM's native weight-transfer API; each worker pulls and applies its own shard.

    Updates are applied in place, so ``start_weight_update`` / ``finish_weight_update`` have nothing to do.
    """

    init_info_cls = DeltaSyncInitInfo
    update_info_cls = DeltaSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.store: str | None = None
        self.signing_key: str | None = None
        self.max_age: float | None = None

    @property
    def tracker(self) -> _StepTracker:
        return _tracker_for(self.model)

    @_one_reply_per_failure
    def init_transfer_engine(self, init_info: DeltaSyncInitInfo) -> None:
        """Sets the default store and key; ``current_step``, when given, declares the step the weights are at
        (otherwise the step the worker reached, through either way in, is kept)."""
        # Every argument checked before any is taken: a refused init changes nothing.
        max_age = _seconds_argument(init_info.max_age, "max_age")
        current_step = _step_argument(init_info.current_step, "current_step")
        self.store, self.signing_key, self.max_age = init_info.store, init_info.signing_key, max_age
        if current_step is not None:
            self.tracker.current_step = current_step
            self.tracker.mark(self.model)

    def start_weight_update(self) -> None:
        pass  # in-place sparse updates need no layerwise reload

    def finish_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Pulls or applies what ``update_info`` names. A refusal every rank shares ends the update on every rank and
        is raised by the last rank alone, where ``_one_reply_per_failure`` would let it (see ``_end_refused_update``)."""
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except Exception as error:
            if not _end_refused_update(self, error):
                raise
            log.error("update_weights: %s (raised by the last tensor-parallel rank)", error)
            return
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: DeltaSyncUpdateInfo) -> None:
        with torch.no_grad():
            path, check_base = update_info.path, _flag(update_info.check_base)
            if update_info.paths is not None:
                paths: Sequence[Any] = update_info.paths
                if isinstance(paths, (str, os.PathLike)):
                    paths = [paths]  # one file, as deltasync_apply takes it (not read letter by letter)
                if update_info.store is not None or update_info.step is not None:
                    raise DeltaSyncError(
                        "update_info gives paths and a store or step: give the files to apply, or a store and step "
                        "to pull, not both; nothing was applied"
                    )
                self.tracker.forget_if_changed(self.model, together=True)
                deltas, _ = _together(
                    lambda: _load_onto(paths, self.tracker.current_step),
                    self.tracker.current_step,
                    "load the delta files",
                )
                self.tracker.apply(self.model, deltas, path=path, check_base=check_base)
                return
            store = update_info.store or self.store
            if store is None:
                raise DeltaSyncError("update_info names no store and init_weight_transfer_engine set none")
            step = _step_argument(update_info.step, "step")
            self.tracker.pull(
                self.model, store, step, self.signing_key, path=path, check_base=check_base, max_age=self.max_age
            )

    def shutdown(self) -> None:
        pass


ENGINE_NAME = "deltasync"


def register() -> None:
    """``vllm.general_plugins`` entry point, run in every vLLM process before the model loads: registers the
    ``deltasync`` weight-transfer engine, and on the CPU backend keeps packed layers updatable (_vllm_cpu.py).
    Idempotent."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    _vllm_cpu.install()
    try:
        WeightTransferEngineFactory.register_engine(ENGINE_NAME, DeltaSyncWeightTransferEngine)
    except ValueError:
        pass  # plugins load once per process, possibly several times: already registered


__all__ = [
    "MAPPED_ARCHITECTURES",
    "DeltaSyncInitInfo",
    "DeltaSyncUpdateInfo",
    "DeltaSyncWeightTransferEngine",
    "DeltaSyncWorkerExtension",
    "ShardMap",
    "anchor_ranges",
    "apply_delta",
    "is_mapped",
    "register",
    "shard_map",
]
