"""The CPU mirror: a private copy of the last published state, which each new state is diffed against and which
then moves forward by applying that very delta. The publisher keeps exactly one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from . import _arrays
from .delta import Delta, diff, state_digest
from .errors import BaseMismatchError, DeltaSyncError


def _host_copy(tensor: Any) -> Any:
    if _arrays.is_torch(tensor):
        return tensor.detach().to("cpu", copy=True).contiguous()
    if isinstance(tensor, np.ndarray):
        return np.array(tensor, copy=True, order="C")
    raise DeltaSyncError(f"expected a torch.Tensor or numpy.ndarray, got {type(tensor).__name__}")


class Mirror:
    """A CPU copy of a state at a known step.

    ``advance(state, step)`` diffs ``state`` against the mirror, applies the delta to the mirror and returns it, so
    the mirror always equals what subscribers reconstruct, bit for bit.
    """

    def __init__(self, state: Mapping[str, Any] | None = None, *, step: int | None = None) -> None:
        self._tensors: dict[str, Any] = {}
        self.step: int | None = None
        if state is not None:
            self.reset(state, step=step)

    @property
    def is_empty(self) -> bool:
        return not self._tensors

    @property
    def tensors(self) -> Mapping[str, Any]:
        """The mirrored tensors (read them, don't write them)."""
        return self._tensors

    def reset(self, state: Mapping[str, Any], *, step: int | None) -> None:
        """Replaces the mirror with a copy of ``state``."""
        self._tensors = {name: _host_copy(tensor) for name, tensor in state.items()}
        self.step = step

    def advance(self, state: Mapping[str, Any], *, step: int, values: str = "diff") -> Delta:
        """The delta from the mirror to ``state``; the mirror moves to ``state`` and ``step``."""
        if self.is_empty:
            raise DeltaSyncError("the mirror is empty: reset it with a first state before advancing it")
        delta = diff(self._tensors, state, values=values, step=step, base_step=self.step)
        delta.apply_(self._tensors)
        self.step = step
        return delta

    def apply(self, delta: Delta) -> None:
        """Moves the mirror forward by a delta made elsewhere, which must start at the mirror's step."""
        if delta.base_step is not None and self.step is not None and delta.base_step != self.step:
            raise BaseMismatchError(f"delta starts at step {delta.base_step} but the mirror is at step {self.step}")
        delta.apply_(self._tensors)
        self.step = delta.step

    def digest(self) -> str:
        return state_digest(self._tensors)
