"""vLLM's CPU backend, made updatable in place.

At load, vLLM's CPU backend copies every linear (and LM-head) weight into a packed oneDNN copy and computes from
that copy; for linear layers it also empties the parameter to shape (0,). An in-place update of the parameter would
then never reach the outputs. When deltasync's vLLM plugin runs before the model loads (it does in every vLLM
process, through the ``vllm.general_plugins`` entry point), each layer keeps its unpacked weight, deltas are written
into it, and the layers whose weights changed are packed again by vLLM's own function, so they compute exactly as a
fresh engine loaded from the new checkpoint. Cost: one unpacked copy of the packed weights in memory, and one
repack of every changed layer per update (docs/vllm.md).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ._core import DeltaSyncError

#: Set to "0" to leave vLLM's CPU backend alone (updates to packed layers are then refused).
KEEP_WEIGHTS_ENV = "DELTASYNC_VLLM_CPU_KEEP_WEIGHTS"
_KEPT = "_deltasync_unpacked_weight"  # on a packed layer: its unpacked weight Parameter
_REMOVED = "_deltasync_remove_weight"  # on a packed layer: whether vLLM emptied its parameter


def install() -> bool:
    """Wraps vLLM's ``dispatch_cpu_unquantized_gemm`` so that packed layers keep their unpacked weight. Idempotent;
    does nothing off the CPU platform or with ``DELTASYNC_VLLM_CPU_KEEP_WEIGHTS=0``. Returns whether it is in place."""
    if os.environ.get(KEEP_WEIGHTS_ENV, "1").strip() == "0":
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_deltasync_original", None) is not None:
        return True

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = layer.weight
        original(layer, remove_weight)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and not weight.is_meta:
            setattr(layer, _KEPT, weight)
            setattr(layer, _REMOVED, remove_weight)

    dispatch._deltasync_original = original  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = dispatch
    return True


def live_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters by name, each packed layer's unpacked weight in place of its emptied parameter."""
    params: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    for module_name, module in model.named_modules(remove_duplicate=False):
        kept = getattr(module, _KEPT, None)
        if kept is not None:
            params[f"{module_name}.weight" if module_name else "weight"] = kept
    return params


def check_updatable(module: torch.nn.Module, attr: str, hf_name: str, vllm_name: str) -> None:
    """Refuses a write that the layer would not compute with: a layer packed by the CPU backend without a kept
    unpacked weight (the plugin did not run before the model loaded)."""
    if attr != "weight" or not hasattr(module, "cpu_linear") or getattr(module, _KEPT, None) is not None:
        return
    weight = getattr(module, "weight", None)
    emptied = isinstance(weight, torch.Tensor) and weight.numel() == 0
    raise DeltaSyncError(
        f"tensor {hf_name!r}: vLLM's CPU backend packed {vllm_name!r} into a private copy at load"
        f"{' and emptied the parameter' if emptied else ''}, and computes from that copy, so an in-place update "
        "would not reach the outputs. deltasync keeps unpacked weights and repacks changed layers when its vLLM "
        "plugin runs before the model loads: install deltasync-rs in the engine's environment, keep 'deltasync' in "
        f"VLLM_PLUGINS if you set it, and leave {KEEP_WEIGHTS_ENV} unset; nothing was written"
    )


def check_model(model: torch.nn.Module, hf_name: str) -> None:
    """Refuses an update through vLLM's loader when some layer computes from a packed copy that cannot be refreshed."""
    for name, module in model.named_modules():
        check_updatable(module, "weight", hf_name, f"{name}.weight")


def packed_layers(model: torch.nn.Module, weights: list[torch.Tensor]) -> list[torch.nn.Module]:
    """The packed layers whose kept weight is one of ``weights`` (tied embeddings: two layers, one weight)."""
    wanted = {id(weight) for weight in weights}
    return [m for m in model.modules() if id(getattr(m, _KEPT, None)) in wanted] if wanted else []


def repack(model: torch.nn.Module, weights: list[torch.Tensor]) -> None:
    """Packs again, with vLLM's own function, every layer computing from a copy of one of ``weights``."""
    layers = packed_layers(model, weights)
    if not layers:
        return
    from vllm.model_executor.layers import utils

    for layer in layers:
        layer.weight = getattr(layer, _KEPT)
        utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=getattr(layer, _REMOVED))


class UnpackedForLoader:
    """While open, packed layers hold their unpacked weight as their parameter, so vLLM's own weight loaders find
    it (an emptied parameter has no ``weight_loader``). On exit the layers whose weights are in ``changed()`` are
    repacked and the others get their emptied parameter back."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._swapped: list[tuple[torch.nn.Module, Any]] = []

    def __enter__(self) -> UnpackedForLoader:
        for layer in self.model.modules():
            kept = getattr(layer, _KEPT, None)
            if kept is not None and layer.weight is not kept:
                self._swapped.append((layer, layer.weight))
                layer.weight = kept
        return self

    def restore(self, changed: list[torch.Tensor]) -> None:
        repacked = {id(layer) for layer in packed_layers(self.model, changed)}
        for layer, emptied in self._swapped:
            if id(layer) not in repacked:
                layer.weight = emptied
        self._swapped.clear()
        repack(self.model, changed)

    def __exit__(self, *exc: object) -> None:
        for layer, emptied in self._swapped:  # not restored through restore(): put everything back as it was
            layer.weight = emptied
        self._swapped.clear()
