"""Checkpoints on disk as users keep them, for the CLI: one safetensors file, or a Hugging Face sharded checkpoint
(``save_pretrained`` above its ``max_shard_size``): a folder holding ``model.safetensors.index.json``, whose
``weight_map`` names the shard file of every tensor, and those shard files."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

from ._outputs import require_regular_file
from .errors import DeltaFormatError, DeltaSyncError

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
    except (ValueError, KeyError, TypeError) as error:
        raise DeltaFormatError(
            f"{index}: not a sharded checkpoint's index (a JSON object with a weight_map): {error!r}"
        ) from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise DeltaFormatError(f"{index}: its weight_map is not an object naming each tensor's file")
    shards: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard.endswith(FILE_SUFFIX) or os.path.basename(shard) != shard:
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
    except (OSError, ValueError, struct.error) as error:
        raise DeltaFormatError(f"{path}: not a valid safetensors file: {error}") from None
    return [name for name in header if name != "__metadata__"]
