"""Checkpoints on disk as users keep them, for the CLI: one safetensors file, or a Hugging Face sharded checkpoint
(``save_pretrained`` above its ``max_shard_size``): a folder holding ``model.safetensors.index.json``, whose
``weight_map`` names the shard file of every tensor, and those shard files."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass

from ._outputs import require_regular_file
from .errors import DeltaFormatError, DeltaSyncError
from .store import TEMP_OF_A_PROCESS, TEMP_PREFIX, alive, stale_temps

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


def checkpoint_files(path: str) -> CheckpointFiles:
    """Resolves ``path``: a ``.safetensors`` file; a sharded checkpoint's ``*.safetensors.index.json``; or a folder
    holding exactly one of those (an index, or else a single ``.safetensors`` file). A sharded checkpoint's index
    must name, for every tensor in its shards, the shard that holds it, and nothing else."""
    if os.path.isdir(path):
        try:
            names = sorted(os.listdir(path))
        except OSError as error:
            raise DeltaSyncError(f"{path}: cannot read the folder: {error}") from None
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
        held = set(tensor_names(file))
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


def tensor_names(path: str) -> list[str]:
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
    """Writes the sharded checkpoint ``base`` with its shards rewritten into the new folder ``output`` (a path that
    does not exist yet, or an empty folder), all at once: a staging folder beside it gets every shard
    (``write_shards(paths)``), the index and the base folder's other files (not other weights:
    ``WEIGHT_SUFFIXES``), and then takes ``output``'s place in one rename. A reader sees no folder or the whole
    checkpoint; a run killed part way leaves a staging folder, removed by a later run.

    Not in place: replacing a folder of shards at once would mean swapping whole folders, which loses what others
    write into the old one meanwhile, and whatever of it cannot be linked across (mounts, immutable files)."""
    assert base.index is not None
    base_folder = os.path.dirname(os.path.abspath(base.index))
    target = os.path.realpath(output)
    if os.path.isdir(target) and os.path.samefile(target, base_folder):
        raise DeltaSyncError(
            f"{output}: a sharded checkpoint is not patched in place, where a reader could see shards of two steps: "
            "-o a new folder (then swap the two folders yourself); nothing was written"
        )
    if os.path.lexists(output) and not (os.path.isdir(output) and not os.listdir(output)):
        raise DeltaSyncError(
            f"{output}: exists; a sharded checkpoint is written as a new folder (a path that does not exist yet, or "
            "an empty folder); nothing was written"
        )
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        raise DeltaSyncError(f"{output}: its parent folder {parent} does not exist")
    if os.path.isdir(target) and os.stat(target).st_dev != os.stat(parent).st_dev:
        raise DeltaSyncError(f"{output}: a mount point, which a folder cannot be renamed onto: -o a folder inside it")
    remove_stale_folders(parent)
    staging = os.path.join(parent, f"{TEMP_PREFIX}{os.getpid()}-{os.urandom(6).hex()}.tmp")
    try:
        os.mkdir(staging)  # the mode any new folder gets (0o777 less the umask)
    except OSError as error:
        raise DeltaSyncError(f"{output}: cannot write beside it: {error}") from error
    try:
        write_shards([os.path.join(staging, os.path.basename(file)) for file in base.files])
        shutil.copyfile(base.index, os.path.join(staging, os.path.basename(base.index)))
        rewritten = {os.path.basename(file) for file in base.files} | {os.path.basename(base.index)}
        with os.scandir(base_folder) as entries:
            others = [
                e.path
                for e in entries
                if e.name not in rewritten and e.is_file() and not e.name.endswith(WEIGHT_SUFFIXES)
            ]
        for path in others:
            shutil.copy2(path, os.path.join(staging, os.path.basename(path)))
        _sync_folder(staging)
        os.rename(staging, target)
    except OSError as error:
        raise DeltaSyncError(f"{output}: cannot write the checkpoint's folder: {error}; nothing was written") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    with contextlib.suppress(OSError):
        _sync_folder(parent)


def remove_stale_folders(parent: str) -> None:
    """Removes the staging folders ``write_folder`` left in ``parent`` when killed (``.deltasync-<pid>-<hex>.tmp``,
    untouched for STALE_TEMP_SECONDS, of a process that is gone: a live apply may spend longer than that checking a
    large base before it writes into its folder). Folders of any other name are left alone."""
    for name in stale_temps(parent, folders=True):
        match = TEMP_OF_A_PROCESS.fullmatch(name)
        if match is not None and not alive(int(match.group(1))):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _sync_folder(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
