"""Type stubs for the Rust extension module `deltasync_rs._core`."""

from collections.abc import Callable
from os import PathLike
from typing import Any, final

from typing_extensions import Buffer

__all__ = [
    "BaseMismatchError",
    "DeltaFormatError",
    "DeltaSyncError",
    "FORMAT_VERSION",
    "RawDelta",
    "__version__",
    "apply_file",
    "diff_files",
    "get_num_threads",
    "set_num_threads",
]
__version__: str
FORMAT_VERSION: str

class DeltaSyncError(Exception):
    """Base class of every deltasync error."""

class DeltaFormatError(DeltaSyncError):
    """A delta file is corrupt, truncated or malformed."""

class BaseMismatchError(DeltaSyncError):
    """The target does not match the delta: names, shapes or dtypes."""

@final
class RawDelta:
    """A delta held by the core: tensors with their encoded streams, and file metadata."""

    step: int | None
    base_step: int | None
    metadata: dict[str, str]
    def __new__(cls) -> RawDelta: ...
    def add_diff(
        self, entries: list[tuple[str, str, list[int], Buffer, Buffer]], values: str, codec: str = "varint"
    ) -> None: ...
    def add_full(self, entries: list[tuple[str, str, list[int], Buffer]]) -> None: ...
    @property
    def num_changed(self) -> int: ...
    @property
    def num_elements(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def is_anchor(self) -> bool: ...
    def tensors(self) -> list[tuple[str, str, list[int] | None, int, str, str, int]]: ...
    def __len__(self) -> int: ...
    def to_bytes(self, format: str = "deltasync") -> bytes: ...
    def save(self, path: str | PathLike[str], format: str = "deltasync") -> None: ...
    @staticmethod
    def from_bytes(data: Buffer, source_name: str = "<bytes>") -> RawDelta: ...
    @staticmethod
    def load(path: str | PathLike[str]) -> RawDelta: ...
    def check_target(self, index: int, dtype_name: str, shape: list[int]) -> None: ...
    def apply(self, targets: list[tuple[int, Any]]) -> None: ...
    def decode(self, index: int) -> bytearray: ...
    def same_changes(self, a: int, b: int) -> bool: ...

def diff_files(
    prev: str | PathLike[str],
    curr: str | PathLike[str],
    values: str = "diff",
    progress: Callable[[int, int], object] | None = None,
    codec: str = "varint",
) -> RawDelta: ...
def apply_file(base: str | PathLike[str], delta: RawDelta, out: str | PathLike[str]) -> None: ...
def set_num_threads(n: int) -> None: ...
def get_num_threads() -> int: ...
