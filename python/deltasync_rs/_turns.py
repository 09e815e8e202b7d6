"""Methods that change an object's state, run under the object's lock (``self._lock``, an RLock), so that calls
from several threads take turns instead of interleaving: a publisher's or subscriber's steps and its mirror or
target move one call at a time.

A forked child inherits each lock as it was: held, if another thread of the parent was inside such a call when the
process forked, by a thread the child does not have, so the child's first call waited forever (and would have found
the object, and what it moves, half-way through that call). Right after a fork, while the child has one thread,
every object made with ``track`` has its lock tried: where another thread held it, the object gets a new lock and is
marked (``self._forked_mid_call``, the parent's process id), and its calls refuse with DeltaSyncError."""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar


class _Locked(Protocol):
    _lock: Any
    #: The process a fork copied this object from while another of its threads was inside a call; else None.
    _forked_mid_call: int | None


T = TypeVar("T")
P = ParamSpec("P")
S = TypeVar("S", bound=_Locked)

_TRACKED: weakref.WeakSet[Any] = weakref.WeakSet()


def track(owner: _Locked) -> None:
    """Has ``owner``'s lock checked in every forked child (see the module's docstring)."""
    owner._forked_mid_call = None
    _TRACKED.add(owner)


def one_at_a_time(method: Callable[Concatenate[S, P], T]) -> Callable[Concatenate[S, P], T]:
    """``method``, run under ``self._lock``."""

    @functools.wraps(method)
    def locked(self: S, *args: P.args, **kwargs: P.kwargs) -> T:
        if self._forked_mid_call is not None:
            _refuse(self, self._forked_mid_call)
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


def _refuse(owner: _Locked, parent: int) -> None:
    from .errors import DeltaSyncError

    raise DeltaSyncError(
        f"this {type(owner).__name__} was in use by another thread of process {parent} when this process forked "
        "from it: here it may be half-way through that call (and so may what it was moving); make a new one here"
    )


def _after_fork_in_child() -> None:
    # The child has one thread now: a lock it cannot take is held by a thread of the parent, which it does not have.
    # (A lock the forking thread itself held is taken again: an RLock.)
    for owner in list(_TRACKED):
        if owner._lock.acquire(blocking=False):
            owner._lock.release()
        else:
            owner._lock = threading.RLock()
            owner._forked_mid_call = os.getppid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
