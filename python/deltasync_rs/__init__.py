"""deltasync-rs: bit-exact sparse deltas of model weights, stored as valid safetensors files.

import deltasync_rs as ds
delta = ds.diff(prev_state, curr_state)
delta.save("step_000042.safetensors")
ds.load("step_000042.safetensors").apply_(state)
"""

# torch stays out of this module: `deltasync_rs.torch` is our submodule, which shadows a module-level
# `import torch` here once it is imported (docs/architecture.md, "Two names shadowed by our own modules").
from typing import TYPE_CHECKING, Any

from ._core import (
    FORMAT_VERSION,
    BaseMismatchError,
    DeltaFormatError,
    DeltaSyncError,
    __version__,
    get_num_threads,
)
from ._core import set_num_threads as _core_set_num_threads
from .delta import DEFAULT_NAME, Delta, TensorInfo, anchor, diff, load, state_digest
from .errors import ChainError, IntegrityError, MissingObjectError, RunChangedError, StaleStoreError, StoreError
from .errors import shown as _shown
from .mirror import Mirror
from .store import FsspecStore, HFBucketStore, LocalStore, Store, open_store
from .sync import Publisher, Subscriber

__all__ = [
    "DEFAULT_NAME",
    "FORMAT_VERSION",
    "BaseMismatchError",
    "ChainError",
    "Delta",
    "DeltaFormatError",
    "DeltaSyncError",
    "FsspecStore",
    "HFBucketStore",
    "IntegrityError",
    "LocalStore",
    "Mirror",
    "MissingObjectError",
    "Publisher",
    "RunChangedError",
    "StaleStoreError",
    "Store",
    "StoreError",
    "Subscriber",
    "TensorInfo",
    "__version__",
    "anchor",
    "diff",
    "get_num_threads",
    "load",
    "open_store",
    "set_num_threads",
    "state_digest",
]


def _check_environment() -> None:
    """Warns about settings the core would silently ignore (it falls back to its defaults)."""
    import os
    import warnings

    from ._core import SCAN_KERNELS

    threads = os.environ.get("DELTASYNC_NUM_THREADS", "").strip()
    if threads and not (threads.isdigit() and int(threads) > 0):
        warnings.warn(
            f"DELTASYNC_NUM_THREADS={threads!r} is not a positive integer; using one thread per CPU",
            RuntimeWarning,
            stacklevel=3,
        )
    elif threads and int(threads) > get_num_threads():
        # The core caps the pool at 4 threads per CPU (at least 256): see src/core/pool.rs.
        warnings.warn(
            f"DELTASYNC_NUM_THREADS={threads!r} is more threads than this machine can use; using {get_num_threads()}",
            RuntimeWarning,
            stacklevel=3,
        )
    kernel = os.environ.get("DELTASYNC_SCAN_KERNEL", "").strip()
    if kernel and kernel not in SCAN_KERNELS:
        warnings.warn(
            f"DELTASYNC_SCAN_KERNEL={kernel!r} is not one of {', '.join(SCAN_KERNELS)}; using the "
            "fastest kernel this CPU has",
            RuntimeWarning,
            stacklevel=3,
        )


_check_environment()


def set_num_threads(n: int) -> None:
    """Sets the number of threads for later calls (0 restores DELTASYNC_NUM_THREADS or the CPU count).

    More than 4 threads per CPU (at least 256) is clamped to that bound, with a RuntimeWarning.
    """
    import warnings

    if isinstance(n, bool) or not isinstance(n, int):
        raise DeltaSyncError(f"the number of threads must be an integer, not {_shown(n)}")
    if n < 0:
        raise DeltaSyncError(f"the number of threads must be 0 or more, not {n}")
    _core_set_num_threads(min(n, 1 << 16))  # more than the machine has is capped below (and warned about)
    if n > 0 and get_num_threads() < n:
        warnings.warn(
            f"set_num_threads({n}) is more threads than this machine can use; using {get_num_threads()}",
            RuntimeWarning,
            stacklevel=2,
        )


if TYPE_CHECKING:  # for type checkers: the lazily imported submodules below, with their types
    from . import integrations, torch, vllm  # noqa: F401


def __getattr__(name: str) -> Any:
    # `ds.torch`, `ds.integrations` and `ds.vllm` import torch (or transformers, or vllm) on first use, not with the
    # package.
    if name in ("torch", "integrations", "vllm"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
