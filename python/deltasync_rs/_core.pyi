"""Type stubs for the Rust extension module `deltasync_rs._core`."""

from collections.abc import Callable, Sequence
from os import PathLike
from typing import Any, final

from typing_extensions import Buffer

__all__ = [
    "BaseMismatchError",
    "DeltaFormatError",
    "DeltaSyncError",
    "FORMAT_VERSION",
    "SCAN_KERNELS",
    "MirrorDiff",
    "DeferredDelta",
    "RawDelta",
    "__version__",
    "alias_problem",
    "apply_files",
    "range_identities",
    "base_identity",
    "base_identity_from_blocks",
    "block_hashes",
    "range_block_hashes",
    "tensor_hash_begin",
    "tensor_hash_feed",
    "tensor_hash_finish",
    "checkpoint_layout",
    "combine_hashes",
    "copy_checked_pieces",
    "diff_files",
    "file_piece_hashes",
    "fill_checked_pieces",
    "get_num_threads",
    "join_shards",
    "piece_hash",
    "scan_kernel",
    "set_num_threads",
    "state_digest",
    "tensor_hash_from_rounds",
    "tensor_hashes",
    "write_anchor",
]
__version__: str
FORMAT_VERSION: str
SCAN_KERNELS: tuple[str, ...]
"""The names DELTASYNC_SCAN_KERNEL accepts, slowest first."""

class DeltaSyncError(Exception):
    """Base class of every deltasync error."""

class DeltaFormatError(DeltaSyncError):
    """A delta file is corrupt, truncated or malformed."""

class BaseMismatchError(DeltaSyncError):
    """The target does not match the delta: names, shapes, dtypes or base identity."""

@final
class RawDelta:
    """A delta held by the core: tensors with their encoded streams, and file metadata."""

    step: int | None
    base_step: int | None
    metadata: dict[str, str]
    aliases: dict[str, str]
    def __new__(cls) -> RawDelta: ...
    def add_diff(
        self, entries: list[tuple[str, str, list[int], Buffer, Buffer]], values: str, codec: str = "compact"
    ) -> None: ...
    def add_full(self, entries: list[tuple[str, str, list[int], Buffer]]) -> None: ...
    packed: bool
    @property
    def format_version(self) -> str: ...
    @property
    def num_changed(self) -> int: ...
    @property
    def num_elements(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def is_anchor(self) -> bool: ...
    def tensors(self) -> list[tuple[str, str, list[int] | None, int, str, str, int]]: ...
    def tensor_info(self, index: int) -> tuple[str, str, list[int] | None, int, str, str, int]: ...
    def has_tensor(self, name: str) -> bool: ...
    def changed_elements(self) -> list[int]: ...
    def __len__(self) -> int: ...
    def to_bytes(self, format: str = "deltasync") -> bytes: ...
    def save(self, path: str | PathLike[str], format: str = "deltasync") -> None: ...
    @staticmethod
    def from_bytes(data: Buffer, source_name: str = "<bytes>", defer_checks: bool = False) -> RawDelta: ...
    @staticmethod
    def load(path: str | PathLike[str], defer_checks: bool = False) -> RawDelta: ...
    @staticmethod
    def map(path: str | PathLike[str], checksum: bool = True) -> RawDelta: ...
    def check_target(self, index: int, dtype_name: str, shape: list[int]) -> None: ...
    def base_identity(self, index: int) -> str | None: ...
    def check_base(self, targets: list[tuple[int, Any]]) -> None: ...
    def check_follows(self, anchor: RawDelta, usable: list[int] | None = None) -> int: ...
    def whole_state_digest(self) -> str | None: ...
    def check_identities(self, found: list[tuple[int, str]]) -> None: ...
    def apply(
        self, targets: list[tuple[int, Any]], check_base: bool = False, digest: bool = False
    ) -> list[tuple[int, bytes]]: ...
    def decode(self, index: int, base: Buffer | Any | None = None) -> bytearray: ...
    def arranged(self, names: list[tuple[str, int]]) -> RawDelta: ...
    def same_changes(self, a: int, b: int) -> bool: ...
    def holds_differences(self, index: int) -> bool: ...
    def context_parts(self, index: int) -> tuple[int, list[bool], list[bytes], bytes, list[bytes]]: ...
    def context_runs(self, index: int, block: Buffer | Any, run_len: int, first_ranks: bytes) -> bytes: ...
    def context_counts(self, index: int, block: Buffer | Any, run_len: int) -> bytes: ...

@final
class MirrorDiff:
    """Builds a delta by comparing new bytes with a mirror and writing them into it, in one pass."""

    def __new__(cls, values: str = "diff", codec: str = "compact", defer: bool = False) -> MirrorDiff: ...
    def begin(self, name: str, dtype: str, shape: list[int]) -> None: ...
    def update(self, mirror: Buffer, new: Buffer, first_element: int) -> None: ...
    def finish(self, whole_mirror: Buffer | None = None) -> None: ...
    def take_shard_bases(self) -> list[tuple[str, int, int, str]]: ...
    def advance(self, entries: list[tuple[str, str, list[int], Any, Any]]) -> None: ...
    def take(self) -> RawDelta: ...
    def take_deferred(self) -> DeferredDelta: ...
    def __len__(self) -> int: ...

@final
class DeferredDelta:
    """A delta whose tensors' encoding waits until ``complete`` is given the mirrors they were compared into."""

    def complete(self, mirrors: list[tuple[str, Buffer | Any]]) -> RawDelta: ...
    def __len__(self) -> int: ...

def diff_files(
    prev: Sequence[str | PathLike[str]],
    curr: Sequence[str | PathLike[str]],
    values: str = "diff",
    progress: Callable[[int, int], object] | None = None,
    codec: str = "compact",
) -> RawDelta: ...
def apply_files(
    base: Sequence[str | PathLike[str]], delta: RawDelta, outs: Sequence[str | PathLike[str]], check_base: bool
) -> None: ...
def state_digest(entries: list[tuple[str, str, list[int], Buffer]]) -> str: ...
def write_anchor(
    path: str | PathLike[str],
    entries: list[tuple[str, str, list[int], Any]],
    step: int | None = None,
    metadata: dict[str, str] = ...,
    piece_bytes: int = 0,
    piece_hash: str = "blake3",
    whole_sha256: bool = True,
    early_writeback: bool = False,
    aliases: dict[str, str] = ...,
) -> tuple[int, str | None, str, bytes]: ...
def range_identities(ranges: list[tuple[Any, int, int]]) -> list[str]:
    """The base identities of byte ranges, each (buffer or CPU contiguous tensor, first byte, bytes), in one call."""

def range_block_hashes(ranges: list[tuple[Any, int, int]]) -> list[bytes]:
    """``block_hashes`` of byte ranges, each (buffer or CPU contiguous tensor, first byte, bytes), in one call."""

def base_identity(data: Any) -> str:
    """The base identity of a buffer or CPU contiguous tensor's bytes: 16 hex digits (docs/format.md §3)."""

def block_hashes(data: Any) -> bytes:
    """The XXH3-64 of each 256 KiB block of a buffer or CPU contiguous tensor's bytes (the last may be shorter),
    little-endian u64s in order: what a base identity combines (docs/format.md §3.1)."""

def base_identity_from_blocks(block_hashes: bytes, tail: Any) -> str:
    """The base identity of bytes whose whole blocks were hashed elsewhere: each whole block's XXH3-64 as
    little-endian u64s in ``block_hashes``, and ``tail``, the bytes after the last whole block, hashed here."""

def tensor_hash_from_rounds(dtype: str, shape: list[int], head: bytes, rounds: Any, tail: bytes, last: bytes) -> bytes:
    """A tensor's state-digest hash (as ``tensor_hashes`` gives it) from its bytes' XXH3 round sums made on its
    device: the bytes up to the first summed round, the rounds' sums (eight little-endian u64s each), the bytes after
    them, and the tensor's last 64 bytes."""

def file_piece_hashes(path: str | PathLike[str], piece_bytes: int, piece_hash: str) -> bytes:
    """The hash (``piece_hash``: "blake3" or "sha256") of each ``piece_bytes`` piece of the file, concatenated (32
    bytes each), hashed in parallel."""

def piece_hash(data: Buffer, piece_hash: str) -> bytes:
    """The hash (``piece_hash``: "blake3" or "sha256") of one anchor piece: 32 bytes."""

def tensor_hashes(entries: list[tuple[str, str, list[int], Buffer]]) -> list[bytes]:
    """Each tensor's own hash in a state digest (16 bytes, little-endian), for (name, dtype, shape, bytes) entries."""

def tensor_hash_begin(dtype: str, shape: list[int]) -> bytes:
    """The state of a tensor's ``tensor_hashes`` hash before its first byte: feed it the tensor's bytes in order
    (``tensor_hash_feed``, possibly on several holders in turn), then ``tensor_hash_finish``."""

def tensor_hash_feed(state: bytes, data: Any) -> bytes:
    """``state`` with the tensor's next bytes (a buffer or CPU contiguous tensor) fed."""

def tensor_hash_finish(state: bytes) -> bytes:
    """The tensor's ``tensor_hashes`` hash (16 bytes) from a state fed every byte of it."""

def combine_hashes(tensors: list[tuple[str, bytes]]) -> str:
    """The digest of a state from each tensor's name and ``tensor_hashes`` hash, in any order: 32 hex digits."""

def checkpoint_layout(tensors: list[tuple[str, str, list[int]]]) -> tuple[bytes, list[tuple[int, int]], int]:
    """The layout of a plain safetensors checkpoint of (name, dtype, shape) tensors as safetensors' own writer lays it
    out: its header (length prefix included), each tensor's absolute byte range in the given order, the file's size."""

def copy_checked_pieces(
    source: str | PathLike[str],
    size: int,
    piece_bytes: int,
    piece_hash: str,
    expected: bytes,
    dest: str | PathLike[str],
    segments: list[tuple[int, int, int]],
) -> tuple[str, int] | None:
    """Copies (from, length, to) segments of ``source`` into the existing file ``dest``, each piece of the source
    checked against ``expected`` (32-byte hashes of ``piece_hash``, concatenated) before it is used. None, or
    ("size", the source's size), or ("piece", the first piece that differs)."""

def fill_checked_pieces(
    source: str | PathLike[str],
    size: int,
    piece_bytes: int,
    piece_hash: str,
    expected: bytes,
    fills: list[tuple[int, Any]],
) -> tuple[str, int] | None:
    """Fills each target (a writable contiguous CPU tensor or buffer, with the offset of its bytes in ``source``),
    each group of pieces checked before its bytes are copied; targets must not overlap. None, ("size", the source's
    size: nothing written) or ("piece", the first piece that differs: the targets hold the groups that matched)."""

def join_shards(
    parts: list[RawDelta],
    codec: str = "compact",
    bases: list[tuple[str, Any]] | None = None,
    identities: list[tuple[str, str]] | None = None,
) -> RawDelta: ...
def set_num_threads(n: int) -> None: ...
def get_num_threads() -> int: ...
def scan_kernel() -> str:
    """The compare kernel this process uses: "avx512", "avx2", "sse2" or "portable"."""

def alias_problem(aliases: dict[str, str]) -> str | None:
    """What is wrong with ``aliases`` as the tied names of a file (docs/format.md §2.2: the rules that need no
    records), or None."""
