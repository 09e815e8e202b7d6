"""The exception hierarchy: the core's classes plus the ones the sync protocol and stores raise; and the check of
an option that counts something (every such option is refused the same way, with DeltaSyncError)."""

from typing import Any

from ._core import BaseMismatchError, DeltaFormatError, DeltaSyncError


def shown(value: Any) -> str:
    """``value`` as an error message shows what was given instead of an option: its repr when it is a plain scalar
    (cut at 100 characters), else its type, which is enough to see the mistake; a state of thousands of tensors passed
    in an option's place would otherwise be printed whole, which alone takes minutes."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        text = repr(value)
        return text if len(text) <= 100 else text[:100] + "..."
    kind = type(value)
    module = "" if kind.__module__ == "builtins" else kind.__module__ + "."
    size = f" of {len(value)} items" if isinstance(value, (dict, list, tuple, set, frozenset)) else ""
    return f"a {module}{kind.__qualname__}{size}"


def at_least_one(value: Any, name: str) -> int:
    """``value`` when it is an integer of at least 1 (not a bool); else DeltaSyncError naming the option ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DeltaSyncError(f"{name} must be an integer of at least 1, not {shown(value)}")
    return value


def flag(value: Any, name: str) -> bool:
    """``value`` when it is True or False; else DeltaSyncError naming the option ``name``."""
    if not isinstance(value, bool):
        raise DeltaSyncError(f"{name} must be True or False, not {shown(value)}")
    return value


def seconds(value: Any, name: str, *, positive: bool = False) -> float:
    """``value`` as a float when it is a number of seconds (not a bool; at least 0, or above 0 with ``positive``);
    else DeltaSyncError naming the option ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 if positive else value >= 0):
        least = "above 0" if positive else "at least 0"
        raise DeltaSyncError(f"{name} must be a number of seconds, {least}, not {shown(value)}")
    return float(value)


class IntegrityError(DeltaSyncError):
    """A file's digest, a signature, a run id, an entry's link to its base entry or a state digest does not match."""


class RunChangedError(IntegrityError):
    """The store now holds another run than the one a subscriber followed: its ``run.json`` and newest files name
    a new run (the store was emptied and published into again, or replaced). The subscriber stays at its step; a
    new Subscriber follows the new run."""


class StaleStoreError(IntegrityError):
    """The newest step a store offers was published longer ago than the subscriber's ``max_age`` allows: the
    trainer stopped publishing, or someone who can write to the store but lacks the key put back an earlier copy
    of it (a rollback, which signatures alone cannot show). Nothing was pulled."""


class ChainError(DeltaSyncError):
    """No consistent chain of anchor and deltas leads to the requested step."""


class StoreError(DeltaSyncError):
    """A store could not read, write, list or delete an object."""


class MissingObjectError(StoreError):
    """The store holds no object under the key."""


__all__ = [
    "BaseMismatchError",
    "ChainError",
    "DeltaFormatError",
    "DeltaSyncError",
    "IntegrityError",
    "MissingObjectError",
    "RunChangedError",
    "StaleStoreError",
    "StoreError",
]
