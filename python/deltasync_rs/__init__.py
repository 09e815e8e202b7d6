"""deltasync-rs: bit-exact sparse deltas of model weights, stored as valid safetensors files.

    import deltasync_rs as ds
    delta = ds.diff(prev_state, curr_state)
    delta.save("step_000042.safetensors")
    ds.load("step_000042.safetensors").apply_(state)
"""

# torch stays out of this module: `deltasync_rs.torch` is our submodule, which shadows a module-level
# `import torch` here once it is imported (docs/architecture.md, "Two names shadowed by our own modules").
from ._core import (
    FORMAT_VERSION,
    BaseMismatchError,
    DeltaFormatError,
    DeltaSyncError,
    __version__,
    get_num_threads,
    set_num_threads,
)
from .delta import DEFAULT_NAME, Delta, TensorInfo, anchor, diff, load, state_digest
from .errors import ChainError, IntegrityError, MissingObjectError, StoreError
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
        warnings.warn(f"DELTASYNC_NUM_THREADS={threads!r} is not a positive integer; using one thread per CPU",
                      RuntimeWarning, stacklevel=3)
    kernel = os.environ.get("DELTASYNC_SCAN_KERNEL", "").strip()
    if kernel and kernel not in SCAN_KERNELS:
        warnings.warn(f"DELTASYNC_SCAN_KERNEL={kernel!r} is not one of {', '.join(SCAN_KERNELS)}; using the "
                      "fastest kernel this CPU has", RuntimeWarning, stacklevel=3)


_check_environment()


def __getattr__(name: str):
    # `ds.torch` and `ds.integrations` import torch (or transformers) on first use, not with the package.
    if name in ("torch", "integrations"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
