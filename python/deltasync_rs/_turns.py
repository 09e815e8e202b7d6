"""Methods that change an object's state, run under the object's lock (``self._lock``, an RLock), so that calls
from several threads take turns instead of interleaving: a publisher's or subscriber's steps and its mirror or
target move one call at a time.

A forked child inherits the lock as it was: held, if another thread of the parent was inside such a call when the
process forked, by a thread the child does not have, so the child's first call waited forever (and would have found
the object, and what it moves, half-way through that call). The first call in a child (``self._pid``, the process
the object was last used in, differs) tries the lock without waiting and refuses with DeltaSyncError where it is
held."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar


class _Locked(Protocol):
    @property
    def _lock(self) -> Any: ...

    _pid: int


T = TypeVar("T")
P = ParamSpec("P")
S = TypeVar("S", bound=_Locked)


def one_at_a_time(method: Callable[Concatenate[S, P], T]) -> Callable[Concatenate[S, P], T]:
    """``method``, run under ``self._lock``."""

    @functools.wraps(method)
    def locked(self: S, *args: P.args, **kwargs: P.kwargs) -> T:
        if self._pid != os.getpid():
            _first_call_in_a_child(self)
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


def _first_call_in_a_child(owner: _Locked) -> None:
    from .errors import DeltaSyncError

    if not owner._lock.acquire(blocking=False):
        raise DeltaSyncError(
            f"this {type(owner).__name__} was in use by another thread of process {owner._pid} when it forked: in "
            "this child it may be half-way through that call (and so may what it was moving); make a new one here"
        )
    owner._lock.release()
    owner._pid = os.getpid()
