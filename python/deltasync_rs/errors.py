"""The exception hierarchy: the core's classes plus the ones the sync protocol and stores raise."""

from ._core import BaseMismatchError, DeltaFormatError, DeltaSyncError


class IntegrityError(DeltaSyncError):
    """A file's digest, a signature, a run id, an entry's link to its base entry or a state digest does not match."""


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
    "StoreError",
]
