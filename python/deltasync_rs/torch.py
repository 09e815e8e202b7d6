"""torch glue: stage decoded changes on a tensor's own device and write them with index_copy_ / index_put_."""

from __future__ import annotations

from typing import Callable

import torch

from ._core import RawDelta

_INT_FOR_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WIDER = {1: torch.int16, 2: torch.int32, 4: torch.int64}


def _wrapping_add(old: torch.Tensor, difference: torch.Tensor, width: int) -> torch.Tensor:
    """old + difference modulo 2**(8*width), computed exactly in a wider integer type."""
    if width == 8:
        return old + difference  # int64 addition wraps in two's complement on every torch backend
    wide = _WIDER[width]
    bits = 8 * width
    total = (old.to(wide) + difference.to(wide)) & ((1 << bits) - 1)
    if width > 1:
        total = torch.where(total >= (1 << (bits - 1)), total - (1 << bits), total)
    return total.to(old.dtype)


def stage_write(raw: RawDelta, index: int, target: torch.Tensor, *, width: int, changed: int,
                values: str, dense: bool) -> Callable[[], object] | None:
    """Decodes tensor `index` on the CPU, moves it to the target's device in one transfer, computes the new
    bit patterns there, and returns the write still to be done. Nothing is written before the call."""
    if changed == 0:
        return None
    view = target.detach().view(_INT_FOR_WIDTH[width])
    host = torch.frombuffer(raw.decode(index), dtype=torch.uint8)
    staged = host.to(view.device, non_blocking=False)
    if dense:
        new = staged.view(_INT_FOR_WIDTH[width]).view(view.shape)
        return lambda: view.copy_(new)
    positions = staged[: changed * 8].view(torch.int64)
    new_values = staged[changed * 8 :].view(_INT_FOR_WIDTH[width])
    if view.is_contiguous():
        flat = view.view(-1)
        if values != "abs":  # "diff" and "diffbits" both hold differences
            new_values = _wrapping_add(flat.index_select(0, positions), new_values, width)
        return lambda: flat.index_copy_(0, positions, new_values)
    coordinates = torch.unravel_index(positions, tuple(view.shape))
    if values != "abs":  # "diff" and "diffbits" both hold differences
        new_values = _wrapping_add(view[coordinates], new_values, width)
    return lambda: view.index_put_(coordinates, new_values)
