"""The sync protocol's public names in one place: the Publisher writes a run's anchors, deltas and signed manifest
entries to a store, and Subscribers pull, verify and replay them (docs/format.md §10). The code lives in
manifest.py, publisher.py and subscriber.py."""

from .manifest import (
    LATEST_KEY,
    RUN_KEY,
    Entry,
    anchor_key,
    delta_key,
    entry_key,
    step_of,
)
from .publisher import Publisher
from .subscriber import Subscriber, log_entries, verify_store

__all__ = [
    "LATEST_KEY",
    "RUN_KEY",
    "Entry",
    "Publisher",
    "Subscriber",
    "anchor_key",
    "delta_key",
    "entry_key",
    "log_entries",
    "step_of",
    "verify_store",
]
