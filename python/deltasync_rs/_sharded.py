"""Checkpoints on disk as users keep them, for the CLI: one safetensors file, or a Hugging Face sharded checkpoint
(``save_pretrained`` above its ``max_shard_size``): a folder holding ``model.safetensors.index.json``, whose
``weight_map`` names the shard file of every tensor, and those shard files."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass

from ._outputs import require_regular_file
from .errors import DeltaFormatError, DeltaSyncError
from .store import TEMP_PREFIX, stale_temps

#: Suffixes of what a folder may hold: a sharded checkpoint's index, or a single-file checkpoint.
INDEX_SUFFIX = ".safetensors.index.json"
FILE_SUFFIX = ".safetensors"

#: The largest index document read (an index of a million tensors is about 100 MB).
MAX_INDEX_BYTES = 1 << 30


@dataclass(frozen=True)
class CheckpointFiles:
    """A checkpoint's safetensors files (one, or a sharded checkpoint's shards in file-name order) and, for a
    sharded checkpoint, its index file."""

    files: list[str]
    index: str | None = None

    @property
    def sharded(self) -> bool:
        return self.index is not None


def checkpoint_files(path: str) -> CheckpointFiles:
    """Resolves ``path``: a ``.safetensors`` file; a sharded checkpoint's ``*.safetensors.index.json``; or a folder
    holding exactly one of those (an index, or else a single ``.safetensors`` file). A sharded checkpoint's index
    must name, for every tensor in its shards, the shard that holds it, and nothing else."""
    if os.path.isdir(path):
        names = sorted(os.listdir(path))
        indexes = [n for n in names if n.endswith(INDEX_SUFFIX)]
        singles = [n for n in names if n.endswith(FILE_SUFFIX)]
        if len(indexes) > 1:
            raise DeltaSyncError(f"{path}: a folder with {len(indexes)} checkpoint indexes {indexes}: give one of them")
        if indexes:
            single = indexes[0][: -len(".index.json")]
            if single in singles:
                # transformers loads this file and ignores the index: which one is the checkpoint is not clear
                raise DeltaSyncError(
                    f"{path}: a folder with both {single} and {indexes[0]} (a sharded checkpoint's index; "
                    f"transformers loads {single} first): give the file or the index, or remove the stale one"
                )
            return checkpoint_files(os.path.join(path, indexes[0]))
        if len(singles) != 1:
            found = f"{len(singles)} .safetensors files {singles[:5]}" if singles else "no .safetensors file"
            raise DeltaSyncError(
                f"{path}: a folder with {found} and no {INDEX_SUFFIX} (a sharded checkpoint's index): give the "
                "checkpoint's file or index"
            )
        return CheckpointFiles([os.path.join(path, singles[0])])
    require_regular_file(path)
    if not path.endswith(".json"):
        return CheckpointFiles([path])
    return _sharded(path)


def _sharded(index: str) -> CheckpointFiles:
    folder = os.path.dirname(os.path.abspath(index))
    try:
        with open(index, "rb") as reader:
            text = reader.read(MAX_INDEX_BYTES + 1)
    except OSError as error:
        raise DeltaSyncError(f"{index}: cannot read: {error}") from error
    if len(text) > MAX_INDEX_BYTES:
        raise DeltaFormatError(f"{index}: a checkpoint index over {MAX_INDEX_BYTES} bytes")
    try:
        weight_map = json.loads(text)["weight_map"]
    except (ValueError, KeyError, TypeError, RecursionError) as error:
        raise DeltaFormatError(
            f"{index}: not a sharded checkpoint's index (a JSON object with a weight_map): {_short(error)}"
        ) from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise DeltaFormatError(f"{index}: its weight_map is not an object naming each tensor's file")
    shards: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        if (
            not isinstance(shard, str)
            or not shard.endswith(FILE_SUFFIX)
            or os.path.basename(shard) != shard
            or "\0" in shard
        ):
            raise DeltaFormatError(
                f"{index}: tensor {name!r} is mapped to {shard!r}, not a .safetensors file beside the index"
            )
        shards.setdefault(shard, set()).add(name)
    files = []
    for shard in sorted(shards):
        file = os.path.join(folder, shard)
        require_regular_file(file)
        held = set(_tensor_names(file))
        extra, missing = sorted(held - shards[shard]), sorted(shards[shard] - held)
        if missing:
            raise DeltaFormatError(f"{index}: tensor {missing[0]!r} is mapped to {shard}, which does not hold it")
        if extra:
            mapped = weight_map.get(extra[0])
            where = f"mapped to {mapped}" if mapped is not None else "not in the index"
            raise DeltaFormatError(f"{file}: holds tensor {extra[0]!r}, {where}")
        files.append(file)
    return CheckpointFiles(files, index)


def _short(error: BaseException) -> str:
    """An error's message in a few hundred characters (a decode error's repr holds the whole input)."""
    text = str(error) or type(error).__name__
    return text if len(text) <= 300 else text[:300] + "..."


def _tensor_names(path: str) -> list[str]:
    """The tensor names in a safetensors file's header (its other checks are the readers')."""
    try:
        with open(path, "rb") as reader:
            (size,) = struct.unpack("<Q", reader.read(8))
            if size > 100 << 20:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(reader.read(size))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError, struct.error, RecursionError) as error:
        raise DeltaFormatError(f"{path}: not a valid safetensors file: {_short(error)}") from None
    return [name for name in header if name != "__metadata__"]


#: Files of other weight formats: a new output folder does not get copies of them, which `apply` would leave at the
#: base's step beside the patched shards.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")


def write_folder(base: CheckpointFiles, output: str, write_shards: Callable[[list[str]], None]) -> None:
    """Writes the sharded checkpoint ``base`` with its shards rewritten into the folder ``output``, all at once:
    a new folder beside ``output`` gets every shard (``write_shards(paths)``), the index, and the base folder's other
    files, and then takes ``output``'s place in one rename. ``output`` is a path that does not exist (or an empty
    folder), which gets the base folder's files but other weights (``WEIGHT_SUFFIXES``); or the base folder itself,
    in place, whose every other entry is kept (hard links where the filesystem allows) and which is swapped with
    the new folder in one ``renameat2(RENAME_EXCHANGE)`` (Linux). A reader sees the old folder or the new one,
    never shards of both; a run killed part way leaves the base folder as it was."""
    assert base.index is not None
    base_folder = os.path.dirname(os.path.abspath(base.index))
    target = os.path.realpath(output)
    in_place = os.path.isdir(target) and os.path.samefile(target, base_folder)
    if not in_place and os.path.lexists(output) and not (os.path.isdir(output) and not os.listdir(output)):
        raise DeltaSyncError(
            f"{output}: exists; a sharded checkpoint is written as a new folder (a path that does not exist yet, or "
            "an empty folder), or in place (-o the base's own folder)"
        )
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        raise DeltaSyncError(f"{output}: its parent folder {parent} does not exist")
    remove_stale_folders(parent)
    staging = os.path.join(parent, f"{TEMP_PREFIX}{os.getpid()}-{os.urandom(6).hex()}.tmp")
    try:
        os.mkdir(staging)  # the mode any new folder gets (0o777 less the umask)
    except OSError as error:
        raise DeltaSyncError(f"{output}: cannot write beside it: {error}") from error
    try:
        shards = [os.path.join(staging, os.path.basename(file)) for file in base.files]
        write_shards(shards)
        if in_place:  # the shards keep their modes
            for source, shard in zip(base.files, shards):
                os.chmod(shard, stat.S_IMODE(os.stat(source).st_mode))
        shutil.copyfile(base.index, os.path.join(staging, os.path.basename(base.index)))
        rewritten = {os.path.basename(file) for file in base.files} | {os.path.basename(base.index)}
        with os.scandir(base_folder) as entries:
            others = [e for e in entries if e.name not in rewritten and not e.name.startswith(TEMP_PREFIX)]
        for entry in others:
            destination = os.path.join(staging, entry.name)
            if in_place:  # everything else kept as it is
                if entry.is_dir(follow_symlinks=False):
                    shutil.copytree(entry.path, destination, symlinks=True, copy_function=_link_or_copy)
                else:
                    _link_or_copy(entry.path, destination)
            elif entry.is_file() and not entry.name.endswith(WEIGHT_SUFFIXES):
                shutil.copy2(entry.path, destination)
        if in_place:
            os.chmod(staging, stat.S_IMODE(os.stat(base_folder).st_mode))
        _sync_folder(staging)
        if in_place:
            _exchange(staging, target)  # staging now holds the old folder, removed below
        else:
            os.rename(staging, target)
    except OSError as error:
        raise DeltaSyncError(
            f"{output}: cannot write the checkpoint's folder: {error}; it was left as it was"
        ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    with contextlib.suppress(OSError):
        _sync_folder(parent)


def remove_stale_folders(parent: str) -> None:
    """Removes the folders ``write_folder`` left in ``parent`` when killed (named ``.deltasync-*.tmp``, untouched
    for STALE_TEMP_SECONDS): a new checkpoint not yet in place, or an old one swapped out and not yet removed."""
    for name in stale_temps(parent, folders=True):
        shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _link_or_copy(source: str, destination: str) -> None:
    """A hard link of ``source`` (a symbolic link itself, not its target) at ``destination``, or a copy where the
    filesystem links no files."""
    try:
        os.link(source, destination, follow_symlinks=False)
    except OSError:
        shutil.copy2(source, destination, follow_symlinks=False)


def _sync_folder(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: str, b: str) -> None:
    """Swaps the two paths in one step (Linux's ``renameat2`` with ``RENAME_EXCHANGE``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available: write the checkpoint to a new folder instead")
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{os.strerror(code)} (swapping the new folder into place)", b)
