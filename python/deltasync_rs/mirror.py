"""The CPU mirror: a private copy of the last published state, which each new state is compared against in one pass
(core::mirror: record the changes and write the new bits in the same scan). The publisher keeps exactly one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from . import _arrays
from ._core import MirrorDiff
from .delta import Delta, _check_step, _Deferred, _finish, check_codec, in_batches, state_digest
from .errors import BaseMismatchError, DeltaSyncError


def _host_copy(name: str, tensor: Any) -> Any:
    _arrays.describe(tensor, name)  # refuses what no delta can hold (sparse, meta, other dtypes), naming the tensor
    if _arrays.is_torch(tensor):
        return tensor.detach().to("cpu", copy=True).contiguous()
    return np.array(tensor, copy=True, order="C")


class Mirror:
    """A CPU copy of a state at a known step.

    ``advance(state, step)`` diffs ``state`` against the mirror, applies the delta to the mirror and returns it, so
    the mirror always equals what subscribers reconstruct, bit for bit.
    """

    def __init__(self, state: Mapping[str, Any] | None = None, *, step: int | None = None) -> None:
        self._tensors: dict[str, Any] = {}
        self._read_only = False
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
        _check_step(step, "step")
        self._tensors = {name: _host_copy(name, tensor) for name, tensor in state.items()}
        self._read_only = False
        self.step = step

    def share(self, tensors: Mapping[str, Any], *, step: int | None, read_only: bool = False) -> None:
        """Adopts ``tensors`` (CPU, contiguous) as the mirror without copying them: the caller keeps them equal to
        the state at the mirror's step (as ds.torch.Mirror does). With ``read_only``, read-only arrays (a mapped
        checkpoint) are taken too, and the mirror is then only read (an anchor, a digest): moving it to another
        step is refused."""
        _check_step(step, "step")
        has_read_only = False
        for name, tensor in tensors.items():
            frozen = read_only and isinstance(tensor, np.ndarray) and not tensor.flags.writeable
            has_read_only |= frozen
            if not (tensor.flags.c_contiguous if frozen else _arrays.writable_bytes(tensor) is not None):
                raise DeltaSyncError(f"tensor {name!r}: a shared mirror must be a contiguous CPU tensor or array")
        self._tensors = tensors  # type: ignore[assignment]
        self._read_only = has_read_only
        self.step = step

    def _check_writable(self) -> None:
        if self._read_only:
            raise DeltaSyncError(
                f"the mirror at step {self.step} holds read-only arrays (shared with read_only=True, e.g. a mapped "
                "checkpoint): it cannot move to another step"
            )

    def advance(self, state: Mapping[str, Any], *, step: int, values: str = "diff", codec: str = "compact") -> Delta:
        """The delta from the mirror to ``state``; the mirror moves to ``state`` and ``step``.

        One pass per tensor: the core compares and writes the new bits into the mirror as it records the changes.
        ``codec`` is the stream family, as for :func:`diff` (the same bytes). Names, dtypes and shapes are all
        checked before the first write."""
        delta = self._advance(state, step=step, values=values, codec=codec, defer=False)
        assert isinstance(delta, Delta)
        return delta

    def _advance(
        self, state: Mapping[str, Any], *, step: int, values: str, codec: str, defer: bool
    ) -> Delta | _Deferred:
        """``advance``; with ``defer`` the encoding of the changes waits: the delta is returned as a ``_Deferred``,
        to be completed from this mirror before it moves again (a publisher's upload thread)."""
        kinds = self._check_advance(state, step=step, values=values, codec=codec)
        builder = MirrorDiff(values, codec, defer)

        def entries():
            for name, new in state.items():
                dtype, shape = kinds[name]
                new_bytes, copied = _arrays.host_bytes(new)
                yield (name, dtype, list(shape), _arrays.writable_bytes(self._tensors[name]), new_bytes), copied

        in_batches(entries(), builder.advance)
        delta = (
            _Deferred(builder.take_deferred(), step, self.step)
            if defer
            else _finish(builder.take(), step, self.step, None)
        )
        self.step = step
        return delta

    def _check_advance(
        self, state: Mapping[str, Any], *, step: int | None, values: str, codec: str
    ) -> dict[str, tuple[str, Any]]:
        """What ``advance`` checks before its first write (it raises those errors with the mirror untouched): each
        tensor's (dtype name, shape)."""
        if self.is_empty:
            raise DeltaSyncError("the mirror is empty: reset it with a first state before advancing it")
        self._check_writable()
        # Checked before the mirror moves: a step refused after the scan would leave the mirror at the new state
        # with its step unchanged, and the next delta would lose this step's changes.
        _check_step(step, "step")
        _check_step(self.step, "the mirror's step")
        check_codec(codec, values=values, mirror=True)
        only_mirror = [n for n in self._tensors if n not in state]
        only_state = [n for n in state if n not in self._tensors]
        if only_mirror or only_state:
            raise BaseMismatchError(
                f"the mirror and the state hold different tensors: only in the mirror {only_mirror[:5]}, "
                f"only in the state {only_state[:5]}"
            )
        return {name: _arrays.check_same_kind(self._tensors[name], new, name) for name, new in state.items()}

    def apply(self, delta: Delta, *, check_base: bool = True) -> None:
        """Moves the mirror forward by a delta made elsewhere, which must start at the mirror's step and, with
        ``check_base`` (the default), from exactly this state (every base identity it records)."""
        self._check_writable()
        if delta.base_step is not None and self.step is not None and delta.base_step != self.step:
            raise BaseMismatchError(f"delta starts at step {delta.base_step} but the mirror is at step {self.step}")
        delta.apply_(self._tensors, check_base=check_base)
        self.step = delta.step

    def digest(self) -> str:
        return state_digest(self._tensors)
