"""Methods that change an object's state, run under the object's lock (``self._lock``, an RLock), so that calls
from several threads take turns instead of interleaving: a publisher's or subscriber's steps and its mirror or
target move one call at a time."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar


class _Locked(Protocol):
    @property
    def _lock(self) -> AbstractContextManager[Any]: ...


T = TypeVar("T")
P = ParamSpec("P")
S = TypeVar("S", bound=_Locked)


def one_at_a_time(method: Callable[Concatenate[S, P], T]) -> Callable[Concatenate[S, P], T]:
    """``method``, run under ``self._lock``."""

    @functools.wraps(method)
    def locked(self: S, *args: P.args, **kwargs: P.kwargs) -> T:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked
